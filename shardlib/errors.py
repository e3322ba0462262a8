"""The one exception family users see: each names the field, the value and the fix."""


class ShardlibError(Exception):
    """Base class for every error shardlib raises on purpose."""


class ConfigError(ShardlibError, ValueError):
    """A config field or CLI flag has a bad value."""


class MeshError(ConfigError):
    """Mesh degrees do not fit the devices."""


class ShardingError(ConfigError):
    """A sharding rule conflicts, names an unknown axis, or does not divide a dim."""


class CheckpointError(ShardlibError):
    """A checkpoint directory is unusable, or a checkpoint does not fit the model."""


class DamagedCheckpointError(CheckpointError):
    """A finished checkpoint has a missing, truncated, changed or unreadable file."""


class CheckpointInUseError(CheckpointError):
    """Another live run holds the checkpoint folder's lock."""


class CheckpointWriteError(CheckpointError):
    """A save failed (disk full, permission denied, a vanished folder): the run stops."""


class DistributedError(ShardlibError):
    """A multi-process run cannot start: a bad coordinator, or processes that never join."""


class OutOfMemoryError(ShardlibError):
    """A target's compiler refused the step: it needs more memory than a device has."""

    def __init__(self, message: str, *, required_bytes: int | None = None,
                 available_bytes: int | None = None):
        super().__init__(message)
        self.required_bytes, self.available_bytes = required_bytes, available_bytes


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived where a run cannot stop at a step boundary (start-up): it unwinds
    like Ctrl-C, so what was started is closed; the CLI exits with 143 (128 + SIGTERM)."""
