"""The global random-number states a checkpoint carries (python, numpy, torch CPU, every CUDA device), so that a
resumed run draws the same numbers: as tensors and numbers only, which the weights-only unpickler reads back
(pickles.py)."""

from __future__ import annotations

import logging
import random
from typing import Any, Mapping

import numpy as np
import torch

log = logging.getLogger(__name__)


def capture_rng_state() -> dict:
    """Global RNG states (python, numpy, torch CPU, every CUDA device) so a resumed run draws the same numbers; as
    tensors and numbers only, so that a weights-only load reads them back."""
    version, internal, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    state = {"python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
             "numpy": {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(cached)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of ``capture_rng_state`` (and of its older form: python and numpy states as tuples); tolerates
    tensors loaded onto a GPU and a different CUDA device count."""
    py, npy = state["python"], state["numpy"]
    if isinstance(py, Mapping):
        random.setstate((int(py["version"]), tuple(py["state"].tolist()), py["gauss"]))
        np.random.set_state((npy["kind"], npy["key"].cpu().numpy().astype(np.uint32), int(npy["pos"]),
                             int(npy["has_gauss"]), float(npy["gauss"])))
    else:
        version, internal, gauss = py
        random.setstate((version, tuple(internal), gauss))
        np.random.set_state(npy)
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda") or []
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(cuda) != n and cuda:
        log.warning("CUDA RNG state saved for %d devices, %d visible: restoring %d", len(cuda), n, min(n, len(cuda)))
    for i, s in enumerate(cuda[:n]):
        torch.cuda.set_rng_state(s.cpu(), i)
