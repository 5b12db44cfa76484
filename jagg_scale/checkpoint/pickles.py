"""What a checkpoint may unpickle: data, never code.

A pickle can call any importable function while it loads (`__reduce__`), and the sha256 manifest does not stop
that: whoever can write a checkpoint directory can recompute the manifest and the COMPLETE marker. So a checkpoint
read by this package (a resume, `jagg-eval` of someone else's run) never runs the general unpickler on it:

    *.pt            torch.save files (optimizer state, RNG state, DeepSpeed's model/optimizer partitions) load
                    with torch's weights-only unpickler: tensors and plain containers, plus the few named classes
                    a file kind needs (`allowed_globals`); anything else is refused by name
    *.metadata      DCP's global (and per-rank) metadata, a plain pickle, loads through `_DCPMetadataUnpickler`,
                    which admits only torch.distributed.checkpoint's metadata classes, torch.Size, torch's dtypes,
                    layouts and memory formats, and paths (dcp_reader.py reads DCP checkpoints through it)
    *.distcp        DCP's shards: tensors (which torch reads weights-only) and each non-tensor entry (the
                    optimizer's lr, betas, ...) a torch.save of its own, checked weights-only here and read so by
                    dcp_reader.py (an entry stored through a DCP transform is left to that reader)

`check_file` is the guard `verify_checkpoint` runs on every such file (each rank its share, before anything is
loaded), so every rank refuses a tampered checkpoint with the same error, naming the file; the loaders use the same
functions, so a file is never unpickled unchecked even when nobody verified it first. A refusal is an
`UnsafeCheckpointError`.
"""

from __future__ import annotations

import io
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Iterable

import torch

from .errors import CheckpointError, UnsafeCheckpointError

__all__ = ["UnsafeCheckpointError", "allowed_globals", "check_file", "is_pickle", "load_dcp_metadata",
           "load_torch"]

_RNG_RE = re.compile(r"(^|/)rng_rank\d+\.pt$")


def is_pickle(name: str) -> bool:
    """Whether a checkpoint file (its path relative to the checkpoint) is one of the pickles this package reads."""
    return name.endswith((".pt", ".metadata", ".distcp"))


def check_file(path: Path, name: str | None = None) -> None:
    """Refuse (UnsafeCheckpointError) a pickle `path` that the loaders below would refuse; other files pass.
    `name` is the path inside the checkpoint (it decides which classes the file may hold)."""
    name = name or Path(path).name
    if name.endswith(".metadata"):
        load_dcp_metadata(path)
    elif name.endswith(".distcp"):
        _check_dcp_entries(Path(path))
    elif name.endswith(".pt"):
        # the tensors' bytes stay on disk (mmap): only the pickle itself is read
        load_torch(path, allow=allowed_globals(name), mmap=zipfile.is_zipfile(path))


def allowed_globals(name: str) -> list:
    """The classes a checkpoint file may hold beyond tensors and plain containers, by its path in the checkpoint:
    DeepSpeed's partitions (`ds/`) hold its ZeRO stage enum and loss scaler; RNG files written before they held
    tensors only hold numpy's MT19937 state (a uint32 array). Everything else (our optimizer state, new RNG files)
    needs nothing."""
    if name.startswith("ds/"):
        return _deepspeed_globals()
    if _RNG_RE.search(name):
        return _numpy_array_globals()
    return []


def load_torch(path: Path, *, map_location: Any = "cpu", allow: Iterable = (), mmap: bool = False) -> Any:
    """torch.load with the weights-only unpickler (and `allow`ed classes): a file that asks for anything else is
    refused unread, by name (UnsafeCheckpointError)."""
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(f"checkpoint file {path} was refused: it needs more than tensors and plain "
                                    f"data to load (not a file this code writes, or tampered with): "
                                    f"{weights_only_refusal(err)}") from None
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile) as err:
        raise CheckpointError(f"checkpoint file {path} is unreadable: {type(err).__name__}: {_first_line(err)}"
                              ) from err


def load_dcp_metadata(path: Path):
    """DCP's `.metadata` (a pickle of torch.distributed.checkpoint.metadata.Metadata) through an unpickler that
    admits its metadata classes only; UnsafeCheckpointError for anything else."""
    try:
        with open(path, "rb") as f:
            meta = _DCPMetadataUnpickler(f, path).load()
    except UnsafeCheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError, KeyError) as err:
        raise UnsafeCheckpointError(f"checkpoint file {path} was refused: not DCP metadata "
                                    f"({type(err).__name__}: {_first_line(err)})") from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(meta, Metadata):
        raise UnsafeCheckpointError(f"checkpoint file {path} was refused: it holds a {type(meta).__name__}, not "
                                    "DCP metadata")
    return meta


def _check_dcp_entries(shard: Path) -> None:
    """Every non-tensor entry that DCP's metadata (beside the shard) places in `shard`, loaded weights-only."""
    if not (shard.parent / ".metadata").is_file():
        raise CheckpointError(f"checkpoint file {shard}: no DCP metadata beside it ({shard.parent / '.metadata'})")
    meta = load_dcp_metadata(shard.parent / ".metadata")
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    entries = sorted((info.offset, info.length, index.fqn) for index, info in meta.storage_data.items()
                     if info.relative_path == shard.name and info.transform_descriptors in (None, [], ())
                     and isinstance(meta.state_dict_metadata.get(index.fqn), BytesStorageMetadata))
    with open(shard, "rb") as f:
        for offset, length, fqn in entries:
            f.seek(offset)
            try:
                torch.load(io.BytesIO(f.read(length)), weights_only=True)
            except pickle.UnpicklingError as err:
                raise UnsafeCheckpointError(f"checkpoint file {shard} was refused: its entry {fqn!r} needs more than "
                                            f"tensors and plain data to load: {weights_only_refusal(err)}") from None
            except (RuntimeError, EOFError, ValueError) as err:
                raise CheckpointError(f"checkpoint file {shard}: entry {fqn!r} is unreadable: {_first_line(err)}"
                                      ) from err


# ------------------------------------------------------------------------------------------ the allowlists

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # torch.layout pickles as _get_layout("torch.strided"): a table lookup
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
    "collections": {"OrderedDict"},
}


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Resolves only the names in _DCP_CLASSES and torch's dtype / layout / memory-format constants (data, not
    callables that act); every other global, and persistent ids, are refused before anything is called."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"checkpoint file {self.path} was refused: it names {module}.{name}, which "
                                    "is not a DCP metadata class (not a file torch's checkpointing writes, or "
                                    "tampered with)")

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"checkpoint file {self.path} was refused: DCP metadata has no persistent ids")


def _deepspeed_globals() -> list:
    """What DeepSpeed's ZeRO checkpoints pickle besides tensors (its optimizer-state files): the stage, the loss
    scaler, and (ZeRO-1/2) each parameter's slice of the flat partition. Plain records: building them runs nothing
    but their own field assignments."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:  # no DeepSpeed: its files then load as plain weights-only files, or are refused
        return []
    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def _numpy_array_globals() -> list:
    """numpy's array reconstruction (no code: a dtype, a shape, raw bytes), for RNG files of older checkpoints."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    # the same function under both module names: numpy 1 pickles numpy.core, numpy 2 numpy._core
    out = [(_reconstruct, "numpy.core.multiarray._reconstruct"), (_reconstruct, "numpy._core.multiarray._reconstruct"),
           np.ndarray, np.dtype]
    if hasattr(np, "dtypes"):  # a dtype's state is set on its class (numpy >= 1.25)
        out.append(np.dtypes.UInt32DType)
    return out


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def weights_only_refusal(err: pickle.UnpicklingError) -> str:
    """What the file asked for, from torch's weights-only refusal (the rest of that message is advice to load the
    file with weights_only=False, which is exactly what must not happen here)."""
    text = str(err)
    for pattern in (r"WeightsUnpickler error: ([^\n]*?)(?: Please use|$)", r"(Trying to load unsupported[^\n]*)"):
        if m := re.search(pattern, text, re.MULTILINE):
            return m.group(1).strip()[:400]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else type(err).__name__)[:400]
