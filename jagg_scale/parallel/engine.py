"""Training engines: how parameters are held, gradients reduced, the optimizer stepped and state checkpointed.

The trainer talks to one `Engine`, built by `parallel.build.build_engine(model, cfg.parallel, cfg.train, dist)`
from the engines' own config section (config.py, beside them) and the optimizer settings of the `train` section
(`OptimizerSettings`); which engine is `parallel.engine`:

    none       `LocalEngine`: one process, plain autograd, torch AdamW (local_engine.py): the reference the
               others match
    fsdp2      `FSDP2Engine`: torch FSDP2 `fully_shard` per transformer block + root (fsdp.py)
    deepspeed  `DeepSpeedEngine`: a DeepSpeed ZeRO-3 engine (deepspeed_engine.py)

What an engine needs from the model it reads off the model: `compute_dtype` (bfloat16 / float16: FSDP2's 16-bit
gathers, DeepSpeed's 16-bit weights; float16 also a loss scaler, loss_scale.py), `master_dtype` (16-bit weights
upcast on the way to the device), and which parameters train (a frozen base, LoRA: checkpoints and exports hold the
trainable weights alone).

This module is the contract (`Engine`, with what every engine shares); local_engine.py, fsdp.py and
deepspeed_engine.py import it, never the reverse. The contract, in the order a training step uses it:

    build_engine(model, parallel, optim, dist)  the model arrives on the host; the engine applies per-block
                                        activation checkpointing (parallel.activation_checkpointing) and places
                                        its registered parameters (the transformer) on the device: sharded
                                        first, then the shards moved (FSDP2 / ZeRO-3), or moved whole here
    engine.shard_frozen(module)         a frozen copy (the KL reference of a full fine-tune) placed like the
                                        model, sharded where the model is, without optimizer or upcast
    engine.model                        the module to call for velocities (sharded or not)
    engine.backward(out, grad, last=)   out.backward(grad) for one backward of a minibatch (knot_backward's
                                        backward callable); gradients accumulate, and are synchronised across
                                        ranks when `last` is True (the minibatch's accumulation boundary), or at
                                        every backward under grad_sync every (resolve_grad_sync); under float16
                                        the gradient is seeded times the loss scale
    engine.step(loss=) -> grad_norm     (unscale,) clip (grad_clip) and step the optimizer, zero grads, update the
                                        EMA when due (ema.py); returns the global gradient norm before clipping
                                        (0-d). A non-finite norm (or `loss`, on any rank) skips the update:
                                        `step_applied` says whether it was taken, `scale_skipped` whether that skip
                                        was the loss scale's search (float16), `loss_scale` the scale the step used
                                        (None without a scaler); `optimizer_steps` counts the steps either way
    engine.comm                         the collective counter (comm.py): a CommCounter on engines that issue
                                        collectives, a NullCounter (same phase()/take()) here
    engine.ema / ema_weights()          ema_decay > 0: the EMA of the trainable weights (None when off), moved
                                        by Flow-GRPO's rule (ema.py: ema_every, ema_warmup, ema_repeat), and a
                                        context with it swapped into the model (evaluation, export)
    engine.add_shadow(name) / lerp_shadow(name, decay) / shadow_weights(name)
                                        named copies of the trainable weights, held like them (this rank's shards
                                        or partitions), moved towards them, swapped into the model and
                                        checkpointed with the engine's state; the EMA is the shadow "ema", the
                                        old policy of DiffusionNFT (train/nft.py) the shadow "old"
    engine.save(dir) / load(dir)        model + optimizer (+ EMA, loss scaler) state into / from a checkpoint
                                        directory (collective); save returns the files this rank wrote (each
                                        rank hashes its own, checkpoint/digests.py) and refuses non-finite
                                        weights (NonFiniteError on every rank); load refuses another engine's
                                        checkpoint
    engine.full_state_dict()            the trainable weights gathered on rank 0 for export (others get {})
    Engine.read_weights(dir, model, trainable, ema)   (a classmethod) the checkpoint's trainable weights (or
                                        their EMA) as full tensors, with no engine, process group or optimizer:
                                        what jagg-eval loads (weights.py). Each engine reads the format it writes
"""

from __future__ import annotations

import errno
import json
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch

from ..checkpoint.local import write_bytes
from .config import ParallelConfig
from .dist import DistContext
from .ema import ema_decay_at
from .loss_scale import load_scaler, save_scaler, search_skip

__all__ = ["ENGINE_MARKER", "Engine", "NonFiniteError", "OptimizerSettings", "checkpoint_engine",
           "make_optimizer", "place_", "placed_dtype", "resolve_grad_sync", "trains_all"]

ENGINE_MARKER = "engine.json"  # {"engine": name}, written into every checkpoint directory by rank 0


class NonFiniteError(RuntimeError):
    """Training produced non-finite values it cannot go on from: weights that would be checkpointed, or too many
    optimizer steps in a row skipped for a non-finite loss or gradient (train.max_nonfinite_steps)."""


class OptimizerSettings(Protocol):
    """The optimizer settings an engine reads (the run config's `train` section has them): torch AdamW on every
    engine, the gradient clip and the EMA of the trainable weights."""

    lr: float
    weight_decay: float
    adam_betas: tuple[float, float]
    adam_eps: float
    grad_clip: float  # max global gradient norm; 0 disables clipping
    ema_decay: float  # > 0: an EMA of the trainable weights, moved by ema.py's rule (ema_every, ema_warmup, ...)
    ema_every: int
    ema_warmup: bool
    ema_repeat: int


def trains_all(model: torch.nn.Module) -> bool:
    """Whether every parameter of `model` trains (a full fine-tune); False for a frozen base (LoRA)."""
    return all(p.requires_grad for p in model.parameters())


def resolve_grad_sync(parallel: ParallelConfig, full_fine_tune: bool) -> str:
    """`auto`: every backward for a full fine-tune (FSDP2 would otherwise hold each block's gradient unsharded in
    fp32 until the boundary: the whole model's gradient per rank, 47.6 GB for FLUX), the boundary for LoRA (a few
    MB of gradients, one reduce-scatter per minibatch)."""
    if parallel.grad_sync != "auto":
        return parallel.grad_sync
    return "every" if full_fine_tune else "boundary"


def checkpoint_engine(directory: Path) -> str:
    """The name of the engine that wrote checkpoint `directory`, from its marker (CheckpointError without one)."""
    from ..checkpoint import CheckpointError

    marker = Path(directory) / ENGINE_MARKER
    try:
        name = json.loads(marker.read_text()).get("engine")
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointError(f"checkpoint {directory}: no readable engine marker {ENGINE_MARKER} ({err})") from None
    if not isinstance(name, str):
        raise CheckpointError(f"checkpoint {directory}: its {ENGINE_MARKER} names no engine")
    return name


HALF = (torch.bfloat16, torch.float16)


def placed_dtype(dtype: torch.dtype, master_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype place_ gives a tensor of `dtype`: 16-bit floating ones upcast to `master_dtype` when it is set."""
    return master_dtype if master_dtype is not None and dtype in HALF else dtype


@torch.no_grad()
def place_(module: torch.nn.Module, device: torch.device | None, master_dtype: torch.dtype | None = None,
           dtypes: dict[int, torch.dtype] | None = None) -> torch.nn.Module:
    """Move `module`'s registered parameters and buffers to `device` (None: where they are) in place, one tensor at a
    time, so that at most one full tensor is in flight; 16-bit floating ones are upcast to `master_dtype` when
    given; `dtypes` (by id of the tensor) overrides both for the tensors it names (pools/replica.py). Already
    sharded parameters (DTensors) and modules kept outside the registered tree (a diffusers adapter's frozen parts)
    are left alone. Parameters keep their identity where the device allows (`.data` swap, as nn.Module._apply does),
    tied ones stay tied."""
    from torch.distributed.tensor import DTensor

    done: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for store in (m._parameters, m._buffers):
            for name, t in list(store.items()):
                if t is None or isinstance(t, DTensor):
                    continue
                if id(t) in done:  # tied: already placed through another module
                    store[name] = done[id(t)]
                    continue
                dtype = placed_dtype(t.dtype, master_dtype)
                dtype = dtypes.get(id(t), dtype) if dtypes else dtype
                new = t.data.to(device=t.device if device is None else device, dtype=dtype)  # no copy if in place
                if torch._has_compatible_shallow_copy_type(t, new):
                    t.data = new
                    done[id(t)] = t
                else:  # e.g. to the meta device: a new tensor in the same slot
                    done[id(t)] = store[name] = (torch.nn.Parameter(new, t.requires_grad)
                                                 if isinstance(t, torch.nn.Parameter) else new)
    return module


def make_optimizer(params, optim: OptimizerSettings) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.adam_betas),
                             eps=optim.adam_eps)


def _disk_full(err: BaseException, directory: Path) -> OSError | None:
    """An ENOSPC OSError naming `directory` and its free space when `err` came from a full disk, else None. The
    writers hide it: torch.save raises "unexpected pos N vs M" with the ENOSPC only in its __context__, and
    safetensors a SafetensorError that merely mentions it (StorageFull)."""
    chain, e = [], err
    while e is not None and e not in chain and len(chain) < 16:
        chain.append(e)
        e = e.__cause__ or e.__context__
    full = any((isinstance(e, OSError) and e.errno == errno.ENOSPC)
               or "No space left on device" in str(e) or "StorageFull" in str(e) for e in chain)
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    if not full and (free is None or free >= 1 << 20):  # under 1 MiB free after a failed write: full, whatever it said
        return None
    there = f"{free / 2**30:.2f} GiB free there now" if free is not None else "free space unknown"
    return OSError(errno.ENOSPC, f"no space left on device while writing checkpoint {directory} ({there}; the "
                                 f"failure was {type(err).__name__}: {err}); free disk space or lower run.keep_last",
                   str(directory))


class Engine:
    """The contract (module docstring) and what every engine shares: the EMA of the trainable weights as a dict of
    tensors (shards of them where sharded), the step with its finite check, the checkpoint marker, the writer check
    on load, the refusal to save non-finite weights. A subclass sets `name`, and in __init__ `parallel`, `optim`,
    `dist`, `comm`, `model`, `params`, `optimizer` (then calls init_ema); it implements `backward`,
    `shard_frozen`, `_save`, `_load`, `full_state_dict` and `read_weights`."""

    name = ""
    step_applied = True  # whether the last step() updated the weights
    # optimizer steps taken, the skipped ones included: the EMA rule's s (ema.py). Flow-GRPO's global_step counts
    # every accumulation boundary, the steps its fp16 grad scaler skips included, and so does this: the count is
    # then a function of the training step alone (a resumed run sets it from the step: RunState), the same on every
    # rank. A skipped step still moves no EMA, as it changes no other state.
    optimizer_steps = 0
    scale_skipped = False  # whether the last step() was skipped by the loss scale's search (loss_scale.py)
    scaler = None  # model.dtype float16: the engine's loss scaler (loss_scale.make_scaler), else None
    loss_scale: float | None = None  # the loss scale the last step's backwards used (None: no scaler)

    parallel: ParallelConfig
    optim: OptimizerSettings
    dist: DistContext

    # ------------------------------------------------------------------ shadow weights: the EMA, the old policy
    def init_ema(self) -> None:
        """The shadow weight sets start empty; ema_decay > 0 adds the EMA of the trainable weights (shards of them
        under FSDP2, fp32 partitions under ZeRO-3), updated after the applied optimizer steps ema.py's rule names,
        checkpointed, used for evaluation and export."""
        self.ema_decay = float(self.optim.ema_decay)
        self.shadows: dict[str, dict[str, torch.Tensor]] = {}
        if self.ema_decay > 0:
            self.add_shadow("ema")

    @property
    def ema(self) -> dict[str, torch.Tensor] | None:
        return self.shadows.get("ema")

    def _live(self) -> dict[str, torch.Tensor]:
        """The trainable weights as this engine holds them (local shards where sharded), by name."""
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def add_shadow(self, name: str) -> None:
        """A named copy of the trainable weights as they are now (this rank's part of them)."""
        self.shadows[name] = {n: t.detach().clone() for n, t in self._live().items()}

    @torch.no_grad()
    def lerp_shadow(self, name: str, decay: float) -> None:
        """shadow = decay x shadow + (1 - decay) x the trainable weights (decay 0: a copy of them)."""
        shadow = self.shadows[name]
        for n, t in self._live().items():
            shadow[n].lerp_(t.detach(), 1.0 - decay)

    @torch.no_grad()
    def _count_step(self) -> None:
        """After an optimizer step (applied or skipped): count it; move the EMA when the step was applied and the
        rule has an update due after it."""
        self.optimizer_steps += 1
        decay = ema_decay_at(self.optimizer_steps, self.optim) if self.ema is not None else None
        if self.step_applied and decay is not None:
            self.lerp_shadow("ema", decay)

    @contextmanager
    def shadow_weights(self, name: str):
        """The model with the shadow `name` in place of its trainable weights (copied in and back: sharded
        parameters keep their storage). Collective under engines that gather (every rank enters and leaves)."""
        shadow = self.shadows[name]
        params = {n: p for n, p in self._live().items() if n in shadow}
        live = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(shadow[n])
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(live[n])

    @contextmanager
    def ema_weights(self):
        """The model with its EMA weights in place; the model unchanged when there is no EMA."""
        if self.ema is None:
            yield self.model
            return
        with self.shadow_weights("ema") as model:
            yield model

    # ------------------------------------------------------------------ one minibatch
    def shard_frozen(self, module: torch.nn.Module) -> torch.nn.Module:
        raise NotImplementedError

    def backward(self, out: torch.Tensor, grad: torch.Tensor | None = None, *, last: bool = True) -> None:
        """out.backward(grad) into the gradients of this minibatch. `last` marks the accumulation boundary (the
        minibatch's last backward): sharded engines synchronise gradients across ranks only then."""
        raise NotImplementedError

    def _scaled(self, out: torch.Tensor, grad: torch.Tensor | None):
        """(out, grad) of a backward with the loss scale applied to its seed (float16; unchanged otherwise)."""
        if self.scaler is None:
            return out, grad
        return (self.scaler.scale(out), None) if grad is None else (out, self.scaler.scale(grad))

    def _clip_grads(self) -> torch.Tensor:
        """Clip the gradients to grad_clip (0: no clipping); the global norm before clipping (0-d, on the device:
        the trainer reads it with the step's other metrics, not here)."""
        max_norm = self.optim.grad_clip if self.optim.grad_clip > 0 else float("inf")
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm).detach()

    def step(self, loss: torch.Tensor | None = None) -> torch.Tensor:
        """(Unscale,) clip, optimizer step, zero grads, EMA update; returns the global gradient norm before clipping
        (a 0-d tensor, read by the caller with its other metrics). The update is skipped, and `step_applied` is
        False, when the norm or `loss` (this rank's loss of the minibatch, when given) is not finite on any rank.
        Under float16 the gradients are unscaled first (the clip and the norm are the true gradients'), and the
        scaler backs off after an overflow and grows after its interval of clean steps (loss_scale.py)."""
        scaling = self.scaler is not None and any(p.grad is not None for p in self.params)
        if scaling:
            self.scaler.unscale_(self.optimizer)
        norm = self._clip_grads()
        self.step_applied, loss_finite = self._finite(norm, loss, scaling)
        self.scale_skipped = scaling and search_skip(self.step_applied, loss_finite, self.loss_scale)
        if self.step_applied:
            self.optimizer.step()
        self._count_step()
        if scaling:  # its overflow verdict (recorded by unscale_) is ours: an overflow is a non-finite norm
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _finite(self, norm: torch.Tensor, loss: torch.Tensor | None, scaling: bool = False) -> tuple[bool, bool]:
        """(whether the update may be taken, whether the loss was finite on every rank): one host read per
        optimizer step, the loss scale (`scaling`) read with it. A NaN gradient would make every weight and
        AdamW's moments NaN, and no mask on the device keeps AdamW's state and step count as they were, so a bad
        update is not taken at all. The norm is global already; the losses are per rank, so their verdict is
        gathered (one tiny collective, counted as control traffic) for every rank to decide alike."""
        ok = torch.stack([torch.isfinite(norm), torch.isfinite(loss.detach()).all() if loss is not None
                          else torch.ones((), dtype=torch.bool, device=norm.device)]).to(torch.float32)
        if loss is not None and self.dist.active:
            with self.comm.phase("control"):
                ok = self.dist.all_gather_tensor(ok.reshape(1, 2)).amin(0)
        if scaling:  # the scale tensor itself (get_scale() would read the device a second time)
            ok = torch.cat([ok, self.scaler._get_scale_async().reshape(1).float().to(ok.device)])
        values = ok.tolist()
        if scaling:
            self.loss_scale = values[2]
        return bool(values[0] and values[1]), bool(values[1])

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The trainable weights for export, on rank 0 (other ranks get {})."""
        raise NotImplementedError

    def save(self, directory: Path) -> list[Path]:
        """This engine's state into `directory` (collective: every rank calls it) and the engine marker (rank 0);
        returns the files this rank wrote, which this rank then hashes for the manifest. A file left out is not
        lost: rank 0 hashes whatever no rank reported, only slower."""
        self.check_finite(directory)
        try:
            files = list(self._save(directory))
            if self.dist.is_main:
                files.append(write_bytes(directory / ENGINE_MARKER, json.dumps({"engine": self.name}).encode()))
                if self.scaler is not None:  # the same on every rank (ShardedGradScaler agrees on overflows)
                    files.append(save_scaler(directory, self.scaler))
        except Exception as err:
            full = _disk_full(err, directory)
            if full is None:
                raise
            raise full from err
        return files

    def _local_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor): this rank's part (its shards, where sharded) of the trainable weights and of their EMA."""
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        named += [(f"{s}.{n}", t) for s, shadow in self.shadows.items() for n, t in shadow.items()]
        return [(n, t.to_local() if hasattr(t, "to_local") else t) for n, t in named]

    def check_finite(self, directory: Path) -> None:
        """NonFiniteError on every rank unless every trainable weight (and its EMA) is finite on every rank:
        checked before any rank writes, so a checkpoint of NaN weights is never sealed as complete, and no rank
        leaves the others waiting in the save's collectives. One host read per save."""
        what = self._non_finite()
        if what:
            raise NonFiniteError(f"refusing to save checkpoint {directory}: the trainable weights are not finite "
                                 f"({what} has NaN or inf values); the newest complete checkpoint is the last good "
                                 "state")

    def check_loaded(self, directory: Path) -> None:
        """CheckpointError on every rank when a weight just loaded from `directory` (any engine's format, its EMA
        and old policy included) is not finite: refused on load as on save (collective)."""
        from ..checkpoint import CheckpointError

        what = self._non_finite()
        if what:
            raise CheckpointError(f"checkpoint {directory}: {what} has NaN or inf values; refusing to resume from it")

    @torch.no_grad()
    def _non_finite(self) -> str | None:
        """The first trainable weight (or EMA / old-policy weight) that is not finite on any rank, named, or None
        (collective: every rank gets the same answer)."""
        tensors = self._local_weights()
        device = self.dist.device
        bad = torch.stack([~torch.isfinite(t).all().to(device) for _, t in tensors]
                          or [torch.zeros((), dtype=torch.bool, device=device)])
        first = torch.where(bad.any(), bad.to(torch.int64).argmax(), -1).reshape(1)  # the first bad one, or -1
        verdicts = (self.dist.all_gather_tensor(first) if self.dist.active else first).tolist()
        if max(verdicts) < 0:
            return None
        mine, rank = verdicts[self.dist.rank], next(r for r, v in enumerate(verdicts) if v >= 0)
        return f"'{tensors[mine][0]}'" if mine >= 0 else f"a weight on rank {rank}"

    def load(self, directory: Path) -> None:
        """State from a checkpoint `directory` written by the same engine (CheckpointError otherwise)."""
        from ..checkpoint import CheckpointError

        writer = checkpoint_engine(directory)
        if writer != self.name:
            raise CheckpointError(f"checkpoint {directory} was written by the {writer} engine (parallel.engine "
                                  f"{writer}), this run uses {self.name} (parallel.engine {self.name}): resume "
                                  f"with parallel.engine {writer}")
        self._load(directory)
        if self.scaler is not None:
            load_scaler(directory, self.scaler)

    def _save(self, directory: Path) -> list[Path]:
        raise NotImplementedError

    def _load(self, directory: Path) -> None:
        raise NotImplementedError

    @classmethod
    def read_weights(cls, directory: Path, model: torch.nn.Module, trainable: set[str], ema: bool
                     ) -> dict[str, torch.Tensor]:
        """The trainable weights (`ema`: their EMA) of a checkpoint this engine wrote, as full tensors keyed like
        `model.named_parameters()`, without an engine or a process group (weights.load_trained_weights)."""
        raise NotImplementedError
