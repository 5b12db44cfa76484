"""The checkpoint package's errors (apart, so that every module of the package can raise them)."""


class CheckpointError(RuntimeError):
    """A checkpoint directory is incomplete or corrupt; the message names the path and the problem."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file would need the general unpickler (it names code to run, or classes this code never
    writes): refused unread (pickles.py). The message names the file and what it asked for."""
