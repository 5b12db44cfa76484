"""The algorithm units (train/algorithm.py): the registry, each unit's RolloutSpec, and a rollout that keeps only
what its algorithm reads."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from jagg_scale.grpo import sample_sde, sigma_schedule
from jagg_scale.grpo.rollout import FinalLatents, Trajectories
from jagg_scale.train import ConfigError, Trainer, load_config
from jagg_scale.train.algorithm import ALGORITHMS, Algorithm, algorithm_class, build_algorithm
from train_runs import TINY, small_dit


def _velocity(x, s, c):
    return -x * (1 + s[:, None, None, None]) + c


@pytest.mark.parametrize("window,solver", [(None, "euler"), ({4, 5, 6}, "dpm2"), (set(), "euler"), (set(), "dpm2")])
def test_a_final_only_rollout_is_the_trajectorys_final_sample_and_keeps_nothing_else(window, solver):
    """keep final (DiffusionNFT) samples exactly what the whole trajectory's sampler does, compressed or not, and
    returns x_T alone."""
    g = torch.Generator().manual_seed(0)
    cond, noise = torch.randn(3, 1, 1, 1, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    sigmas = sigma_schedule(10, 3.0)
    kw = dict(noise_level=0.7, sde_steps=window, ode_solver=solver, ode_steps=3 if solver == "dpm2" else 0)
    full = sample_sde(_velocity, cond, noise, sigmas, generator=[torch.Generator().manual_seed(i) for i in range(3)],
                      **kw)
    final = sample_sde(_velocity, cond, noise, sigmas, generator=[torch.Generator().manual_seed(i) for i in range(3)],
                       keep="final", **kw)
    assert isinstance(full, Trajectories) and isinstance(final, FinalLatents)
    assert torch.equal(final.final, full.final) and list(vars(final)) == ["final"]


def test_the_registry_builds_the_configured_unit_and_refuses_an_unknown_name(tmp_path):
    assert set(ALGORITHMS) == {"grpo", "nft", "dppo", "gcpo", "awm"}
    for name in ALGORITHMS:
        unit = algorithm_class(name)
        assert issubclass(unit, Algorithm) and unit.name == name
    cfg = load_config(TINY, small_dit(4, 3) + [f"run.output_dir={tmp_path}"])
    cfg.train.algorithm = "ppo"  # past the loader: the registry itself names the key
    with pytest.raises(ConfigError, match="config key 'train.algorithm': unknown algorithm 'ppo'"):
        build_algorithm(cfg, None, None, None)


def test_grpo_shapes_its_own_rollout_from_the_sde_window(tmp_path):
    """GRPO's spec: the sliding SDE window's steps are the SDE steps and the trained ones, the KL reference at the
    plan's knots (grpo.ref_at knots), the whole trajectory kept."""
    t = Trainer(load_config(TINY, small_dit(6, 3) + [
        f"run.output_dir={tmp_path}", "grpo.sde_window=3", "grpo.sde_window_mode=sliding", "jagg.window=3",
        "grpo.kl_beta=0.04", "grpo.ref_at=knots"]))
    try:
        specs = [t.algorithm.rollout_spec(step) for step in range(3)]
    finally:
        t.close()
    assert [s.trained for s in specs] == [(0, 1, 2), (1, 2, 3), (2, 3, 4)]
    for s in specs:
        assert s.sde_steps == set(s.trained) and s.keep == "trajectory"
        assert s.ref_steps == {s.trained[0], s.trained[-1]}  # one window of 3: its two knots


def test_nft_samples_with_its_old_policy_and_keeps_only_the_final_latents(tmp_path):
    """NFT's spec: the ODE throughout (no SDE step, no reference), under the old policy's weights, the final latents
    alone: the same samples as the whole trajectory under the same weights, and the old weights are the ones used."""
    t = Trainer(load_config(TINY, small_dit(4, 3) + [f"run.output_dir={tmp_path}", "train.algorithm=nft",
                                                     "nft.kl_beta=0.01", "grpo.timestep_fraction=0.75"]))
    try:
        spec = t.algorithm.rollout_spec(0)
        assert spec.sde_steps == set() and spec.ref_steps == set() and spec.keep == "final"
        cond, rows = t.policy.encode(["a", "b", "c"]), torch.arange(3)
        final = t.policy.rollout(cond, rows, 0, spec=spec)
        whole = t.policy.rollout(cond, rows, 0, spec=dataclasses.replace(spec, keep="trajectory"))
        assert isinstance(final, FinalLatents) and final.final.shape == (3, *t.model.latent_shape)
        assert torch.equal(final.final, whole.final)
        with torch.no_grad():  # the trained weights moved away from the old policy's: another sample
            for p in t.engine.params:
                p.add_(0.05)
        assert torch.equal(t.policy.rollout(cond, rows, 0, spec=spec).final, final.final)
        trained = dataclasses.replace(spec, weights=contextlib.nullcontext)
        assert not torch.equal(t.policy.rollout(cond, rows, 0, spec=trained).final, final.final)
    finally:
        t.close()
