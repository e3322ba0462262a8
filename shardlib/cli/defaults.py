"""Defaults the command line shares between its subcommands (no heavy imports here)."""

DEFAULT_CPU_DEVICES = 8  # simulated CPU devices when no accelerator is found
