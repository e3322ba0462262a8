"""Run every ``shardlib`` command of the README and the how-tos, as a new user pastes them.

Each command runs in one scratch folder (so ``runs/a`` written by one line is read by the
next line of its page, in page order), through the installed ``shardlib`` entry point.
A Hugging Face checkpoint at ``path/to/...`` and the JSONL files the post-training pages
read are tiny random stand-ins (``hf_files``). Commands needing what one CPU host lacks (a
cluster, a placeholder ``...``, the ``[gpu]`` extra) are listed as not runnable with the
reason. ``--steps N`` caps every ``train`` line at N steps (``--steps 0``: as written).

    python experiments/docs_commands.py                 # every page, train capped at 4 steps
    python experiments/docs_commands.py --page lora.md  # one page
    python experiments/docs_commands.py --list          # the commands and why some are not run

Prints one row per command (page, seconds, exit status, the command) and exits non-zero if
any runnable command failed. ``tests/test_docs_run.py`` runs them on each CI run (train
capped at 2 steps; about 10 minutes).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "how-to").glob("*.md"))]

# why a command cannot run on one CPU host, by a piece of its text
NOT_RUNNABLE = {
    "...": "a placeholder for the flags of the line above",
    "/shared/": "a cluster's shared filesystem",
    "--coordinator 10.": "a second host",
    "[--": "optional flags in brackets",
}


@dataclass(frozen=True)
class DocCommand:
    page: str
    argv: tuple[str, ...]  # after ``shardlib``
    text: str  # as the page writes it (continuations joined)
    after: str = ""  # why an earlier line of its page, whose output it reads, is not run
    setup: tuple[str, ...] = ()  # the page's ``mkdir`` lines before it (run first, in bash)

    @property
    def why_not(self) -> str:
        own = next((why for piece, why in NOT_RUNNABLE.items() if piece in self.text), "")
        if not own and "path/to/" in self.text and not HAS_TRANSFORMERS:
            own = "needs a Hugging Face checkpoint (stand-ins need transformers: the dev extra)"
        if not own and gpu_target(self.argv) and not has_cuda_plugin():
            own = 'needs the [gpu] extra (pip install -e ".[gpu]": JAX\'s CUDA plugin)'
        return own or (f"follows a line not run here ({self.after})" if self.after else "")


# what the stand-in checkpoints are made with (the dev extra's transformers and torch)
HAS_TRANSFORMERS = all(importlib.util.find_spec(name) is not None
                       for name in ("transformers", "torch"))


def gpu_target(argv: tuple[str, ...]) -> bool:
    """Whether the command compiles for a GPU ``--target`` (``h100x8``, ``a100x8``, ...)."""
    from shardlib.target import parse_target

    return any(parse_target(name).chip.platform == "gpu"
               for name in flag_values(argv, "--target"))


def has_cuda_plugin() -> bool:
    """Whether JAX's CUDA plugin is installed (what ``--target h100x8`` compiles with)."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def shell_blocks(page: Path) -> list[list[str]]:
    """The page's ```bash blocks, each as its lines (continuation lines joined)."""
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)
    return [[line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
            for block in blocks]


def shardlib_argv(line: str) -> tuple[str, ...] | None:
    """The arguments after ``shardlib`` in one shell line (the last of a ``&&`` chain that
    runs it), or None if the line runs no ``shardlib`` command of its own (or is a piece of
    a quote over several lines: a cluster's ``bash -c '...``)."""
    for part in reversed(line.split("&&")):
        try:
            words = shlex.split(part, comments=True)
        except ValueError:  # no closing quotation
            return None
        heads = [i for i, w in enumerate(words) if Path(w).name == "shardlib"]
        if heads and not words[0].startswith(("srun", "gcloud", "cd")):
            return tuple(words[heads[0] + 1:])
    return None


def flag_values(argv: tuple[str, ...], *flags: str) -> set[str]:
    return {argv[i + 1] for i, word in enumerate(argv[:-1]) if word in flags}


def written(argv: tuple[str, ...]) -> set[str]:
    """What a command writes: its ``--out``, and a ``train``'s ``--checkpoint-dir``."""
    return flag_values(argv, "--out") | (flag_values(argv, "--checkpoint-dir")
                                          if argv[:1] == ("train",) else set())


def read(argv: tuple[str, ...]) -> set[str]:
    """What a command reads: every word it does not write, and a resumed checkpoint."""
    resumed = flag_values(argv, "--checkpoint-dir") if "--resume" in argv else set()
    return (set(argv) - written(argv)) | resumed


def doc_commands(pages: list[Path] = PAGES) -> list[DocCommand]:
    """Every ``shardlib`` command of ``pages``, in page order. A command that names what a
    command not run here would have written (its checkpoint folder, its output) is not run
    either."""
    out = []
    for page in pages:
        missing: dict[str, str] = {}  # path -> why the command writing it is not run
        setup: tuple[str, ...] = ()
        for line in (line for block in shell_blocks(page) for line in block):
            argv = shardlib_argv(line)
            if argv is None:
                mkdir = shlex.split(line, comments=True) if line.startswith("mkdir ") else []
                setup += (shlex.join(mkdir),) if mkdir else ()
                continue
            after = next((why for path, why in missing.items() if path in read(argv)), "")
            command = DocCommand(page.name, argv, line, after, setup)
            for path in written(argv):
                if command.why_not:
                    missing.setdefault(path, after or command.why_not)
                else:  # a runnable command writes it again
                    missing.pop(path, None)
            out.append(command)
    return out


def capped(argv: tuple[str, ...], steps: int) -> list[str]:
    """``argv`` with a ``train``'s steps capped (also one that ``launch`` runs: ``launch ... --
    train ...``), eval and samples off so that the cap is the cost."""
    words = list(argv)
    command = words[words.index("--") + 1:] if "--" in words else words
    if steps <= 0 or command[:1] != ["train"]:
        return words
    if "--steps" in words:
        at = words.index("--steps") + 1
        words[at] = str(min(steps, int(words[at])))
    else:
        words += ["--steps", str(steps)]
    return words + ["--set", "train.eval_every=0", "train.sample_tokens=0"]


def user_files(folder: Path, hf_root: Path | None = None) -> None:
    """What the docs assume a user has: ``corpus/*.jsonl`` (the README's own data: a few
    hundred JSON lines of text, Python's own source as the stand-in), and where
    ``hf_root`` holds them (``hf_files``) the downloaded checkpoints and the JSONL files."""
    if hf_root is not None:
        for name in ("path", "pairs.jsonl", "chat.jsonl"):
            (folder / name).symlink_to(hf_root / name)
    corpus = folder / "corpus"
    corpus.mkdir(parents=True)
    sources = sorted(Path(os.__file__).parent.glob("[a-c]*.py"))[:40]
    for index, source in enumerate(sources):
        lines = [json.dumps({"text": chunk}) for chunk in source.read_text().split("\n\n")]
        (corpus / f"part-{index:03d}.jsonl").write_text("\n".join(lines) + "\n")


# ChatML with TRL's generation markers (the SFT how-to's template) and its two markers,
# added to the stand-in tokenizer as special tokens
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{{ '\\n' }}{% else %}{{ m['content'] + '<|im_end|>\\n' }}"
          "{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def sums(count: int) -> list[tuple[str, str, str]]:
    """(question, right answer, wrong answer): the stand-in chats' and pairs' text."""
    return [(f"What is {i % 10} + {i // 10 % 10}? ", f"{i % 10 + i // 10 % 10}",
             f"{i % 10 + i // 10 % 10 + 1}") for i in range(count)]


def hf_files(root: Path) -> Path | None:
    """Stand-ins for what the Hugging Face lines assume a user downloaded: tiny random
    ``path/to/{llama,qwen,mixtral,qwen3-moe}`` (2 layers, 128 or 512 wide, a 300-token BPE
    from ``shardlib tokenizer train``'s ``train_tokenizer`` with the ChatML template),
    ``pairs.jsonl`` (DPO) and ``chat.jsonl`` (SFT); None without ``transformers`` (the dev
    extra's), whose lines are then not run."""
    if not HAS_TRANSFORMERS:
        return None
    import torch
    import transformers

    from shardlib.data.tokenizer import train_tokenizer

    corpus = root / "tokenizer_corpus.jsonl"
    corpus.parent.mkdir(parents=True, exist_ok=True)
    texts = [" ".join(row) for row in sums(100)] + ["user assistant system hello def fib(n):"]
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts * 4))
    bpe = train_tokenizer([str(corpus)], 300, str(root / "tokenizer.json"))
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=384,
                 max_position_embeddings=1024)
    # Llama 512 wide, heads of 64: the QLoRA line's quant_block (64) divides them, and the
    # double quantization's 8 blocks per row split over its fsdp=8
    wide = dict(shape, hidden_size=512, intermediate_size=512, num_attention_heads=8)
    torch.manual_seed(0)
    checkpoints = {
        "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(**wide)),
        "qwen": transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **shape, use_sliding_window=False)),
        "mixtral": transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **shape, num_local_experts=4, num_experts_per_tok=2)),
        "qwen3-moe": transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **shape, head_dim=32, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=64)),
    }
    for name, model in checkpoints.items():
        model.save_pretrained(root / "path" / "to" / name)
        transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(bpe.path), additional_special_tokens=CHAT_TOKENS,
            eos_token="<|im_end|>", pad_token="<|endoftext|>",
            chat_template=CHATML).save_pretrained(root / "path" / "to" / name)
    (root / "pairs.jsonl").write_text("".join(
        json.dumps({"prompt": q, "chosen": right, "rejected": wrong}) + "\n"
        for q, right, wrong in sums(96)))
    (root / "chat.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": q}, {"role": "assistant", "content": right}]}) + "\n"
        for q, right, _ in sums(4000)))  # ~100 packed rows of 1025 tokens: a batch of 32
    return root


def shell_words(command: DocCommand, argv: list[str]) -> str:
    """``argv`` for bash, quoted except where the page leaves a glob for the shell."""
    def unquoted_glob(word: str) -> bool:
        return "*" in word and f"'{word}'" not in command.text and f'"{word}"' not in command.text
    return " ".join(word if unquoted_glob(word) else shlex.quote(word) for word in argv)


def run(command: DocCommand, cwd: Path, steps: int) -> tuple[int, float, str]:
    """Run one command through bash with this venv's ``shardlib`` first on PATH."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    started = time.perf_counter()
    line = "shardlib " + shell_words(command, capped(command.argv, steps))
    done = subprocess.run(["bash", "-c", " && ".join([*command.setup, line])],
                          cwd=cwd, capture_output=True, text=True, env=os.environ | {"PATH": path})
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
    return done.returncode, time.perf_counter() - started, tail[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="cap on train steps (0: as written)")
    parser.add_argument("--page", default="", help="only this page (e.g. lora.md)")
    parser.add_argument("--list", action="store_true", help="list the commands, run nothing")
    args = parser.parse_args()
    commands = [c for c in doc_commands() if not args.page or c.page == args.page]
    failed = 0
    with tempfile.TemporaryDirectory() as scratch:
        hf_root = hf_files(Path(scratch) / "downloads") if not args.list else None
        for command in commands:
            if command.why_not or args.list:
                why = f"not run: {command.why_not}" if command.why_not else ""
                print(f"{command.page:30s}      -  {why}\n    shardlib {shlex.join(command.argv)}")
                continue
            folder = Path(scratch) / command.page
            if not folder.exists():
                user_files(folder, hf_root)
            status, seconds, tail = run(command, folder, args.steps)
            failed += status != 0
            failure = f"\n    -> {tail}" if status else ""
            print(f"{command.page:30s} {seconds:6.1f}s  exit {status}\n"
                  f"    shardlib {shlex.join(command.argv)}{failure}", flush=True)
    print(f"{len(commands)} commands, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
