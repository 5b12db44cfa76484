"""Loading a torch.distributed.checkpoint (DCP) directory without the general unpickler.

torch's own FileSystemReader reads `.metadata` (and, when that fails, `__<rank>.metadata`) with `pickle.load`, and
its DefaultLoadPlanner reads every non-tensor entry (the optimizer's param_groups: lr, betas, ...) with
`torch.load(weights_only=False)`: a planted pickle in either runs on load. Here the metadata goes through the
restricted unpickler of pickles.py and the non-tensor entries through the weights-only one; tensors were already
read weights-only by torch.

    dcp_load(state, directory)   dcp.load(state) from `directory` (collective, like dcp.load)
    read_metadata(directory)     the Metadata alone (what is in the checkpoint, no process group needed)
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from .errors import CheckpointError, UnsafeCheckpointError
from .pickles import load_dcp_metadata, weights_only_refusal

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "dcp_load", "read_metadata"]


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata (global or per rank) is read by pickles.load_dcp_metadata."""

    def read_metadata(self, *args, **kwargs):
        metadata = load_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:  # as torch's reader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor entries are unpickled weights-only."""

    def __init__(self, directory: Path, **kwargs):
        super().__init__(**kwargs)
        self.directory = directory

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(f"checkpoint {self.directory}: the entry {fqn!r} was refused: it needs more "
                                        f"than tensors and plain data to load: {weights_only_refusal(err)}"
                                        ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def dcp_load(state: dict, directory: Path, *, no_dist: bool = False) -> None:
    """dcp.load of `state` (in place) from `directory`, nothing unpickled beyond data. A refused file raises its
    own CheckpointError on every rank (DCP would bury it in a CheckpointException, or in an AssertionError of
    its metadata fallback)."""
    directory = Path(directory)
    for meta in sorted(directory.glob("*.metadata")):  # the global one and any per-rank fallback: same files on
        load_dcp_metadata(meta)                          # every rank, so every rank refuses alike, before DCP
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(directory)), planner=SafeLoadPlanner(directory),
                 no_dist=no_dist)
    except CheckpointException as err:
        ours = [err.failures[r][0] for r in sorted(err.failures) if isinstance(err.failures[r][0], CheckpointError)]
        if ours:
            raise ours[0] from None
        raise


def read_metadata(directory: Path):
    return SafeFileSystemReader(str(directory)).read_metadata()
