"""What the rollout stores (grpo/rollout.py): only the range of steps training reads, the predictions in the dtype the
model computed them in (lossless: a bf16 run trains bit for bit as with float32 storage), and the minibatch handed to
the loss is a view of the trajectory where the rows are a contiguous range (no copy)."""

import hashlib
import math
import tempfile

import pytest
import torch

import jagg_scale.train.policy as policy_module
from jagg_scale.grpo import sample_sde
from jagg_scale.grpo.rollout import row_index
from jagg_scale.train import Trainer, load_config
from train_runs import TINY, small_dit


def _trajectory(n=6, steps=3, guidance=1.0, keep_steps=None):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 4, generator=g) * 0.3

    def model(x, s, cond):
        return torch.tanh(x @ w) * (1 + s.view(-1, 1, 1, 1))

    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    cond = (None, None) if guidance != 1.0 else None
    noise = torch.randn(n, 2, 4, 4, generator=g)
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    return sample_sde(model, cond, noise, sigmas, noise_level=0.7, generator=gens, guidance=guidance,
                      ref_velocity_fn=lambda x, s, c: model(x, s, c) + 0.1, keep_steps=keep_steps)


def test_a_contiguous_minibatch_is_a_view_of_the_trajectory_and_a_permuted_one_a_copy():
    traj = _trajectory()
    adv, mask = torch.linspace(-1, 1, 6), torch.ones(6, dtype=torch.bool)
    whole = traj.step_batch(torch.arange(6), adv, mask)
    second = traj.step_batch(torch.arange(3, 6), adv, mask)
    for batch, first in ((whole, 0), (second, 3)):
        for name in ("latents", "velocities", "log_probs", "ref_velocities"):
            t, stored = getattr(batch, name), getattr(traj, name)
            assert t.data_ptr() == stored[:, first].data_ptr(), name  # the same memory: no copy
            assert torch.equal(t, stored[:, first:first + t.shape[1]])
    permuted = traj.step_batch(torch.tensor([4, 1, 2]), adv, mask)
    assert permuted.latents.data_ptr() != traj.latents.data_ptr()
    assert torch.equal(permuted.velocities, traj.velocities[:, [4, 1, 2]])
    assert torch.equal(permuted.advantages, adv[[4, 1, 2]])


def test_row_index_is_a_slice_only_for_an_ascending_contiguous_host_range():
    assert row_index(torch.arange(2, 5), torch.device("cpu")) == slice(2, 5)
    for index in (torch.tensor([0, 2]), torch.tensor([1, 0]), torch.tensor([], dtype=torch.long)):
        assert torch.equal(row_index(index, torch.device("cpu")), index)


def test_the_trajectory_keeps_the_range_of_the_steps_read_and_x_T():
    """keep_steps: the stored tensors are the full trajectory's over first .. last of them (x_k .. x_{last+1}), x_T
    beside them, and sigma_max the schedule's s_1; nothing else is stored."""
    full = _trajectory(steps=6)
    part = _trajectory(steps=6, keep_steps=[2, 4])
    assert part.first == 2 and part.positions([2, 3, 4]) == [0, 1, 2]
    assert torch.equal(part.latents, full.latents[2:6]) and torch.equal(part.sigmas, full.sigmas[2:6])
    for name in ("velocities", "log_probs", "ref_velocities"):
        assert torch.equal(getattr(part, name), getattr(full, name)[2:5]), name
    assert torch.equal(part.final, full.final) and torch.equal(part.sigma_max, full.sigmas[1])
    tail = _trajectory(steps=6, keep_steps=[3, 4, 5])
    assert tail.last is None and torch.equal(tail.final, tail.latents[-1])  # the range reaches x_T: no copy of it


SMALL = small_dit(6, 3) + ["train.steps=2", "model.dtype=bfloat16", "jagg.window=3", "log.progress=false"]


def _fit(overrides, out, float32_storage: bool = False):
    """Two steps of a bf16-autocast tiny run: the rollout of step 0 (its spec's), the metrics and a hash of the
    weights; float32_storage: the rollout told to store everything in float32, as before."""
    trainer = Trainer(load_config(TINY, SMALL + overrides + [f"run.output_dir={out}"]))
    try:
        with pytest.MonkeyPatch.context() as mp:
            if float32_storage:
                mp.setattr(policy_module, "sample_sde", lambda *a, **kw: sample_sde(
                    *a, **{**kw, "prediction_dtype": None, "ref_dtype": None}))
            spec = trainer.algorithm.rollout_spec(0)
            traj = trainer.policy.rollout(trainer.policy.encode(["a"] * 3 + ["b"] * 3), torch.arange(6), 0, spec=spec)
            rows = [trainer.train_step(step) for step in range(2)]
        h = hashlib.sha256()
        for k, v in sorted(trainer.model.state_dict().items()):
            h.update(k.encode() + v.detach().float().contiguous().numpy().tobytes())
    finally:
        trainer.close()
    rows = [{k: float(v) for k, v in r.items() if not k.startswith(("time_", "comm_"))} for r in rows]
    return spec, traj, rows, h.hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("overrides,uncond,ref_dtype", [
    # the SDE window of steps 1-3, the KL reference on them: the model's own outputs, all bf16
    (["grpo.kl_beta=0.1", "grpo.sde_window=3", "grpo.sde_window_range=[1, 5]"], False, torch.bfloat16),
    # CFG, the first 4 of 6 steps trained: the reference is the guided combination (float32 math), kept float32
    (["sampling.guidance=2.0", "grpo.kl_beta=0.1", "grpo.timestep_fraction=0.7"], True, torch.float32),
])
def test_a_bf16_run_stores_the_model_dtype_and_trains_as_with_float32_storage(overrides, uncond, ref_dtype):
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        spec, traj, rows, weights = _fit(overrides, a)
        _, traj32, rows32, weights32 = _fit(overrides, b, float32_storage=True)
    K = len(spec.trained)
    assert traj.first == spec.trained[0] and traj.velocities.shape[0] == K and traj.latents.shape[0] == K + 1
    assert traj.latents.dtype == traj.log_probs.dtype == torch.float32  # the SDE's float32 results
    assert traj.velocities.dtype == torch.bfloat16 and traj.ref_velocities.dtype == ref_dtype
    assert (traj.uncond_velocities is not None) == uncond
    for name in ("velocities", "uncond_velocities", "ref_velocities", "latents", "log_probs"):
        t, t32 = getattr(traj, name), getattr(traj32, name)
        assert t is None or torch.equal(t.float(), t32), name  # bf16 storage lost nothing
    assert rows == rows32 and weights == weights32  # ... so training is the float32 storage's, bit for bit
    assert rows[0]["onpolicy_log_ratio"] < 1e-6 and rows[0]["ratio_max"] != 1.0


@pytest.mark.parametrize("overrides", [
    ["model.dtype=float32", "grpo.kl_beta=0.1"],
    ["sampling.guidance=2.0", "grpo.kl_beta=0.1", "grpo.ref_at=knots", "grpo.timestep_fraction=0.7"],
    ["grpo.kl_beta=0.1", "grpo.sde_window=3", "grpo.sde_window_range=[1, 5]"],
    ["grpo.step_selection=random", "grpo.timestep_fraction=0.6", "sampling.guidance=2.0"],
    ["train.algorithm=gcpo", "gcpo.chunks=[2, 3]", "sampling.guidance=2.0"],
    ["train.algorithm=nft", "nft.kl_beta=0.1"],
])
def test_the_estimators_rollout_row_is_what_the_rollout_stores(overrides, tmp_path):
    """jagg-estimate's rollout storage (estimate/memory.py rollout_row) prices the bytes a row's trajectory holds."""
    from jagg_scale.estimate.memory import rollout_row

    cfg = load_config(TINY, SMALL + overrides + [f"run.output_dir={tmp_path}"])
    trainer = Trainer(cfg)
    try:
        spec = trainer.algorithm.rollout_spec(0)
        traj = trainer.policy.rollout(trainer.policy.encode(["a"] * 3 + ["b"] * 3), torch.arange(6), 0, spec=spec)
        lat = math.prod(trainer.model.latent_shape)
    finally:
        trainer.close()
    # every per-row tensor (the schedule's sigmas, [K + 1], and sigma_max are not per row)
    held = sum(t.nbytes for t in vars(traj).values() if torch.is_tensor(t) and t.ndim >= 2)
    cdt = 4 if cfg.model.dtype == "float32" else 2
    assert held == 6 * rollout_row(cfg, lat, cdt, cfg.jagg.make_planner())[0]
