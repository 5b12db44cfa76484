"""The policy: the velocity the trainer samples and trains, its KL reference, prompt encoding and the rollout.

    policy.velocity_fn()     v(x, sigma, cond): CFG-guided, under bf16 / fp16 autocast when model.dtype is
                             bfloat16 / float16 (the SDE math that consumes it casts back to float32): the
                             rollout, evaluation, the KL reference
    policy.model_fn()        the model's own prediction, under the same autocast: what training differentiates.
                             With CFG it is called with the conditional rows only (the unconditional prediction
                             is a constant for the gradient, see grpo/loss.py), so a JAGG joint pass has 2B rows
    policy.reference_fn()    the KL reference's velocity, or None when grpo.kl_beta = 0
    policy.encode(prompts)   the conditioning; with guidance != 1 the pair (cond, uncond) of the prompts and of the
                             model's negative prompt (an edit prompt's on its own input image). Each distinct
                             prompt is encoded once (distinct_prompts) and its rows are copies of that encoding
    policy.rollout(...)      the rollout an algorithm's RolloutSpec asks for (algorithm.py): trajectories of given
                             global rows on the training schedule `policy.sigmas`, every draw seeded per (run
                             seed, step, row) (x_0 per group with sampling.same_initial_noise); outside the SDE steps
                             the ODE runs sampling.ode_solver on sampling.ode_steps (grpo/solver.py); every step kept
                             or only the final latents. With same_initial_noise, the rows of a group with the same
                             prompt in a chunk take the ODE steps before the first SDE step from one of them
                             (grpo/rollout.py sample_sde's shared prefix)
    policy.take_counts()     what encode and rollout saved since the last call (the step's metrics)

Used by the trainer and by `jagg-eval` (which needs only velocity_fn and encode: no optimizer, no engine).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from ..cond import expand_cond, index_cond
from ..data.images import EditPrompt
from ..grpo import StepBatch, Trajectories, guided_velocity, model_schedule, sample_sde
from ..grpo.guidance import ExpertGuidance, Guidance
from ..grpo.rollout import FinalLatents, prefix_forwards, to_device
from ..jagg import Plan, fill_interior, plan_knots
from .algorithm import RolloutSpec
from .config import Config
from .rows import initial_noise, row_generators

log = logging.getLogger(__name__)


def rollout_batch(cfg: Config, world_size: int, device: torch.device, *, gpu_gib: float | None = None) -> int:
    """sampling.chunk_size, with auto resolved for this rank: on a GPU the largest chunk whose rollout fits its memory
    by the estimator (estimate/memory.rollout_batch, the same number `jagg-estimate` prints), off a GPU or for the
    built-in DiT (no estimator shapes) half of a rank's rows; a model the estimator cannot size (no shapes or
    coefficients for it) falls back to that, with a warning. `gpu_gib`: this rank's memory in GiB instead of its
    device's (a test gives each rank its own). Ranks must agree on it: agreed_rollout_batch."""
    n = cfg.sampling.chunk_size
    if n != "auto":
        return n
    from ..estimate import memory as M  # the estimator sits above the trainer: imported only for auto

    half = M.rollout_cap(cfg, world_size)
    if cfg.model.kind == "dit" or (gpu_gib is None and device.type != "cuda"):
        return half
    try:
        gib = torch.cuda.get_device_properties(device).total_memory / M.GiB if gpu_gib is None else gpu_gib
        return M.rollout_batch(M.prepare(cfg, world_size, gpu_gib=gib), gib)
    except (LookupError, ValueError, OSError) as err:  # no shapes or coefficients for this model
        log.warning("sampling.chunk_size auto: the estimator cannot size this model (%s); %d rows per forward",
                    err, half)
        return half


def agreed_rollout_batch(cfg: Config, dist, device: torch.device, *, gpu_gib: float | None = None) -> int:
    """rollout_batch agreed over the ranks of `dist` (a DistContext): the smallest rank's, by one all-gather at
    start-up, logged once. Resolved per rank from its own GPU's memory, ranks on different GPUs (a mixed partition,
    MIG slices) would run different numbers of rollout chunks, and every chunk runs collectives (the sharded
    transformer's parameter gathers at each forward, a sharded reward's per chunk): they would stop matching."""
    local = rollout_batch(cfg, dist.world_size, device, gpu_gib=gpu_gib)
    if cfg.sampling.chunk_size != "auto":  # the config's number: the same on every rank
        return local
    every = dist.all_gather_object(local)
    agreed = min(every)
    if dist.is_main:
        log.info("sampling.chunk_size auto: %d rows per rollout forward on every rank (the smallest of the ranks' "
                 "%s)", agreed, sorted(set(every)))
    return agreed


def distinct_prompts(prompts) -> tuple[list, torch.Tensor | None]:
    """The distinct prompts in order of first appearance and each row's position among them (a host index), or
    (prompts, None) when a prompt is not hashable. Equal is str equality, and for an edit prompt its input image's
    too (data.EditPrompt: a path or bytes by value, an image object by identity), so rows of one prompt get the same
    conditioning, text and image."""
    first: dict = {}
    try:
        index = [first.setdefault(p, len(first)) for p in prompts]
    except TypeError:  # an unhashable prompt: every row encoded on its own
        return list(prompts), None
    return list(first), torch.tensor(index, dtype=torch.long)


def prefix_leads(keys: list, noise: torch.Tensor) -> torch.Tensor:
    """Each row's lead for sample_sde's shared prefix: the first row of the chunk with its key (its prompt group and
    distinct prompt, so the same conditioning) whose x_0 (host `noise`) is the row's own too, else the row itself."""
    first: dict = {}
    leads = []
    for i, key in enumerate(keys):
        j = first.setdefault(key, i)
        leads.append(j if j == i or torch.equal(noise[i], noise[j]) else i)
    return torch.tensor(leads, dtype=torch.long)


class Policy:
    def __init__(self, model: torch.nn.Module, cfg: Config, device: torch.device, *,
                 ref_model: torch.nn.Module | None = None, rollout_batch: int | None = None):
        """`model` is what to call for velocities (an engine's wrapped module when sharded). The KL reference is
        `ref_model` (a frozen copy, full fine-tune) or, with LoRA, the same model with its adapter off.
        `rollout_batch`: rows per rollout forward (sampling.chunk_size, auto resolved by rollout_batch())."""
        self.model, self.ref_model, self.cfg, self.device = model, ref_model, cfg, device
        self.rollout_batch = rollout_batch or cfg.sampling.chunk_size
        sigmas = model_schedule(model, cfg.sampling.num_steps, cfg.sampling.shift)
        self.host_sigmas = sigmas.tolist()  # the rollout's ODE solver computes its coefficients from these
        self.sigmas = sigmas.to(device)
        self._uncond = None  # the negative prompt's conditioning (CFG), encoded on first use
        self._counts: dict[str, int] = {}  # take_counts()
        self.stop_point: Callable[[], None] = lambda: None  # the trainer's preemption check (preemption.StopPoints)
        # the model family's CFG: its rule (grpo/guidance.py) and negative prompt (models/base.py VelocityModel)
        self.guidance_rule = getattr(model, "guidance_rule", "plain")
        self.negative_prompt = getattr(model, "negative_prompt", "")

    @property
    def guidance(self) -> float:
        """sampling.guidance: CFG is on where it is not 1 (the scale itself with one expert)."""
        return self.cfg.sampling.guidance

    @property
    def guidance_scales(self) -> Guidance:
        """The scale(s) the sampler and the losses guide with: sampling.guidance, or with sampling.guidance_2 a scale
        per expert of a two-expert model (grpo/guidance.py ExpertGuidance)."""
        low = self.cfg.sampling.guidance_2
        if low is None:
            return self.guidance
        switch = getattr(self.model, "expert_switch", None)
        if switch is None:  # config_experts.py refuses it by key; a policy built by hand is held to it too
            raise ValueError("sampling.guidance_2 guides a two-expert model's low-noise expert; this model has one")
        return ExpertGuidance(high=self.guidance, low=low, switch=switch)

    def model_fn(self, model: torch.nn.Module | None = None) -> Callable:
        model = self.model if model is None else model
        dtype = getattr(torch, self.cfg.model.dtype)
        half, device_type = dtype != torch.float32, self.device.type

        def fn(x, sigma, cond):
            self.stop_point()  # a preemption inside the step (trainer.py StopPoints): before the forward, not within
            with torch.autocast(device_type, dtype=dtype if half else torch.bfloat16, enabled=half):
                return model(x, sigma, cond)

        return fn

    def velocity_fn(self, model: torch.nn.Module | None = None) -> Callable:
        predict, guidance, rule = self.model_fn(model), self.guidance_scales, self.guidance_rule
        return lambda x, sigma, cond: guided_velocity(predict, x, sigma, cond, guidance, rule)

    def reference_fn(self) -> Callable | None:
        if not self.cfg.uses_reference:
            return None
        if self.ref_model is not None:
            return self.velocity_fn(self.ref_model)
        policy = self.velocity_fn()

        def adapter_off(x, sigma, cond):
            with self.model.reference_disabled():
                return policy(x, sigma, cond)

        return adapter_off

    def encode(self, prompts: list[str]):
        cond = self._encode_once(prompts, count=True)
        if self.guidance != 1.0 and any(getattr(p, "image", None) is not None for p in prompts):
            # edits: the negative half is the negative prompt on each row's own input image (the editing pipelines'
            # true CFG encodes it so), so it is encoded per distinct image, not once
            return cond, self._encode_once([EditPrompt(self.negative_prompt, p.image) for p in prompts])
        if self.guidance != 1.0:
            if self._uncond is None:  # the negative prompt's embedding never changes (frozen encoders): encode once
                self._uncond = self.model.encode_prompts([self.negative_prompt])
            return cond, expand_cond(self._uncond, len(prompts))
        return cond

    def _encode_once(self, prompts: list, *, count: bool = False):
        """The conditioning of `prompts`, each distinct one encoded once, its rows copies of it (index_cond)."""
        distinct, index = distinct_prompts(prompts)
        if count:
            self._add_counts(encode_rows=len(prompts), encode_prompts=len(distinct))
        cond = self.model.encode_prompts(distinct)
        return cond if index is None or len(distinct) == len(prompts) else index_cond(cond, index)

    def _add_counts(self, **counts: int) -> None:
        for name, value in counts.items():
            self._counts[name] = self._counts.get(name, 0) + value

    def take_counts(self) -> dict[str, int]:
        """Rows since the last call: encode_rows (the prompts encode was given) and encode_prompts (the distinct ones
        the encoders ran on); rollout_prefix_rows (rollout rows that took the deterministic prefix from a group mate)
        and rollout_prefix_forwards (the row-forwards of the prefix that saved: one per model call, CFG's two halves
        one)."""
        counts, self._counts = self._counts, {}
        return counts

    def split_cond(self, cond):
        """(conditional, unconditional or None) of what `encode` returned."""
        return cond if self.guidance != 1.0 else (cond, None)

    @torch.no_grad()
    def fresh_uncond(self, batch: StepBatch, steps: list[int], uncond, plan: Plan | None = None) -> StepBatch:
        """The batch with the unconditional predictions of the trained steps recomputed at the current parameters
        (one no-grad forward of B rows per step): after an optimizer step the rollout's are stale. With `plan` (the
        minibatch's knot plan over `steps`: grpo.refresh_at knots) only its knots are recomputed, and every other
        trained step's u_k is the rollout's moved by its segment's knots' drift, linear in sigma (fill_interior's
        `moved`: u_k + (1 - a_k)(u_a' - u_a) + a_k (u_b' - u_b), as knot_backward's `interpolate` values)."""
        # float32: the stored u_k are the model's bf16 / fp16 output, but the moved interior values are float32 math
        fresh = batch.uncond_velocities.to(torch.float32, copy=True)
        predict = self.model_fn()
        B = batch.latents.shape[1]
        for k in steps if plan is None else [steps[q] for q in plan_knots(plan)]:
            fresh[k] = predict(batch.latents[k], batch.sigmas[k].expand(B), uncond).float()
        if plan is not None:
            at = torch.tensor(steps, device=fresh.device)
            fresh[at] = fill_interior(plan, fresh[at], batch.sigmas[at], moved=batch.uncond_velocities[at])
        return dataclasses.replace(batch, uncond_velocities=fresh, rollout_uncond=batch.old_uncond)

    @torch.no_grad()
    def rollout(self, cond, rows: torch.Tensor, step: int, *, spec: RolloutSpec | None = None,
                on_chunk=None, prompts: list | None = None) -> Trajectories | FinalLatents:
        """Trajectories of the given global rows (cond holds their conditioning, in that order) as the algorithm's
        `spec` says (algorithm.RolloutSpec; None: the SDE and the KL reference on every step, every step kept), in
        chunks of self.rollout_batch rows, under the spec's weights; `on_chunk(rows, final_latents)` is called after
        each (reward scoring), `rows` the chunk's slice of `rows`. With the spec's `ref_plan` (a plan over its trained
        steps whose knots are its ref_steps: grpo.ref_at knots) the other trained steps' reference velocities are
        filled in, linear in sigma between the knots (fill_interior). Nothing here reads a device value back: noise
        goes up once per chunk, asynchronously.

        `prompts`: the rows' prompts, `cond` their `encode` (so rows of one prompt have identical conditioning).
        Given them with sampling.same_initial_noise, the rows of a chunk with the same group, prompt and x_0 run the
        deterministic steps before the first SDE step once (sample_sde's shared_prefix): counted in take_counts."""
        cfg, spec = self.cfg, spec or RolloutSpec()
        if self.rollout_batch == "auto":
            raise ValueError("sampling.chunk_size auto: give Policy the resolved rollout_batch (rollout_batch())")
        gens = row_generators(cfg.run.seed, step, rows)
        keys, saved = self._prefix_keys(rows, prompts, spec), 0
        trained, plan = list(spec.trained or ()), spec.ref_plan
        fill = plan is not None and len(plan_knots(plan)) < len(trained)
        # stored in the compute dtype where that is the model's own output (grpo/rollout.py's docstring): the
        # predictions always, the reference unless it is CFG's guided combination or filled between its knots
        dtype = getattr(torch, cfg.model.dtype)
        ref_dtype = dtype if self.guidance == 1.0 and not fill else torch.float32
        parts = []
        with spec.weights():
            predict, ref = self.model_fn(), self.reference_fn()
            for start in range(0, len(rows), self.rollout_batch):
                chunk = slice(start, min(start + self.rollout_batch, len(rows)))
                # each row's generator draws its initial noise, then its SDE steps' (inside sample_sde), as one
                # stream; sampling.same_initial_noise: x_0 its group's (rows.initial_noise)
                noise = initial_noise(gens[chunk], rows[chunk], self.model.latent_shape, seed=cfg.run.seed, step=step,
                                      group_size=cfg.grpo.group_size if cfg.sampling.same_initial_noise else None)
                leads = None if keys is None else prefix_leads(keys[chunk], noise)
                saved += 0 if leads is None else len(leads) - len(leads.unique())
                parts.append(sample_sde(predict, index_cond(cond, chunk), to_device(noise, self.device), self.sigmas,
                                        noise_level=cfg.sampling.noise_level, generator=gens[chunk],
                                        ref_velocity_fn=ref, sde_steps=spec.sde_steps, ref_steps=spec.ref_steps,
                                        guidance=self.guidance_scales, guidance_rule=self.guidance_rule,
                                        ode_solver=cfg.sampling.ode_solver, ode_steps=cfg.sampling.ode_steps,
                                        host_sigmas=self.host_sigmas, sde=cfg.sampling.sde, keep=spec.keep,
                                        shared_prefix=leads, keep_steps=spec.trained, prediction_dtype=dtype,
                                        ref_dtype=ref_dtype))
                if on_chunk is not None:
                    on_chunk(chunk, parts[-1].final)
        if keys is not None:
            self._add_counts(rollout_prefix_rows=saved, rollout_prefix_forwards=saved * prefix_forwards(
                self.host_sigmas, spec.sde_steps, cfg.sampling.ode_solver, cfg.sampling.ode_steps))
        traj = type(parts[0]).cat(parts)
        if fill and getattr(traj, "ref_velocities", None) is not None:
            at = traj.positions(trained)
            traj.ref_velocities[at] = fill_interior(plan, traj.ref_velocities[at], traj.sigmas[at])
        return traj

    def _prefix_keys(self, rows: torch.Tensor, prompts: list | None, spec: RolloutSpec) -> list | None:
        """Per row (group, distinct prompt): rows with equal keys and x_0 share the deterministic prefix. None where
        nothing is shared: no shared x_0 (sampling.same_initial_noise false), no prefix (SDE from the first step),
        no prompts given, or a prompt not hashable (encode then encodes every row on its own)."""
        cfg = self.cfg
        if not cfg.sampling.same_initial_noise or prompts is None or not prefix_forwards(
                self.host_sigmas, spec.sde_steps, cfg.sampling.ode_solver, cfg.sampling.ode_steps):
            return None
        _, index = distinct_prompts(prompts)
        if index is None:
            return None
        return list(zip((rows // cfg.grpo.group_size).tolist(), index.tolist()))
