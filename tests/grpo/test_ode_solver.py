"""The compressed rollout (issue 18 item 1): DPM-Solver++(2M) for the ODE outside the SDE window, on fewer steps.

The solver's order on a closed-form flow, its equality with diffusers' scheduler, the re-spaced grid, the
trajectory layout the trainer indexes, on-policy log-probs, training and exact resume."""

import math
from pathlib import Path

import pytest
import torch

from jagg_scale.grpo import sample_sde, sde_step_with_logprob, sigma_schedule
from jagg_scale.grpo.solver import OdeSolverState, respace, split_ode_steps, window_grids
from jagg_scale.train import ConfigError, Trainer, load_config
from jagg_scale.train.algorithm import RolloutSpec
from jagg_scale.train.host_syncs import HostSyncs
from jagg_scale.train.logging import read_metrics
from extras import need

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.hidden_size=32", "model.dit.depth=1", "model.dit.image_size=16", "sampling.num_steps=8",
         "sampling.chunk_size=8", "train.prompts_per_step=2", "train.minibatch_size=8", "log.progress=false",
         "run.checkpoint_every=0"]

# Gaussian data N(MU, C^2) under rectified flow x_s = (1 - s) d + s e: the marginal velocity is linear in x and
# the ODE's solution is known, x_s = (1 - s) MU + sqrt((1 - s)^2 C^2 + s^2) z
MU, C = 2.0, 0.5


def gaussian_velocity(x, s):
    s = torch.as_tensor(s, dtype=torch.float64)
    s = s.reshape(-1, *([1] * (x.ndim - 1))) if s.ndim else s
    return (-MU + (x.double() - (1 - s) * MU) * (s - (1 - s) * C * C) / ((1 - s) ** 2 * C * C + s**2)).float()


def gaussian_x(z, s):
    return (1 - s) * MU + math.sqrt((1 - s) ** 2 * C * C + s * s) * z


def solve(solver, grid, x):
    state = OdeSolverState(solver)
    for s, t in zip(grid[:-1], grid[1:]):
        x = state.step(x, gaussian_velocity(x, s), s, t)
    return x


def test_dpm2_is_second_order_and_euler_first_order_on_a_closed_form_flow():
    z = torch.linspace(-2, 2, 9, dtype=torch.float64)
    s0, s1 = 0.9, 0.1
    errors = {}
    for solver in ("euler", "dpm2"):
        errors[solver] = [float((solve(solver, torch.linspace(s0, s1, n + 1).tolist(), gaussian_x(z, s0).float())
                                 .double() - gaussian_x(z, s1)).abs().max()) for n in (16, 32, 64)]
    euler, dpm2 = errors["euler"], errors["dpm2"]
    # halving the step: the error halves (order 1) for Euler, quarters (order 2) for DPM-Solver++(2M)
    assert all(1.8 < a / b < 2.2 for a, b in zip(euler, euler[1:])), euler
    assert all(3.4 < a / b < 4.6 for a, b in zip(dpm2, dpm2[1:])), dpm2
    assert all(d < e / 5 for d, e in zip(dpm2, euler))


def test_dpm2_from_noise_to_data_beats_euler_at_equal_steps():
    """The whole range s = 1 -> 0 (the first two steps and the last are first order, lambda being infinite there)."""
    z = torch.linspace(-2, 2, 9)
    exact = gaussian_x(z.double(), 0.0)
    for n in (16, 32):  # at 8 steps on this flow: 0.27 vs 0.32, barely better
        grid = sigma_schedule(n, 3.0).tolist()
        euler = (solve("euler", grid, z).double() - exact).abs().max()
        dpm2 = (solve("dpm2", grid, z).double() - exact).abs().max()
        assert dpm2 < euler / 2


def test_dpm2_is_diffusers_flow_matching_dpm_solver_pp_2m():
    diffusers = need("diffusers")
    sched = diffusers.DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                                                  flow_shift=3.0, solver_order=2)
    sched.set_timesteps(10)
    sigmas = sched.sigmas.double().tolist()
    x_ref = x = torch.linspace(-2, 2, 5).reshape(5, 1)
    state = OdeSolverState("dpm2")
    for i, t in enumerate(sched.timesteps):
        x_ref = sched.step(gaussian_velocity(x_ref, sigmas[i]), t, x_ref).prev_sample
        x = state.step(x, gaussian_velocity(x, sigmas[i]), sigmas[i], sigmas[i + 1])
    assert torch.allclose(x, x_ref.float(), atol=1e-5)


def test_ode_steps_are_split_in_proportion_and_respaced_on_the_grid():
    assert split_ode_steps(0, 5, 7) == (5, 7) and split_ode_steps(12, 5, 7) == (5, 7)
    assert split_ode_steps(4, 6, 6) == (2, 2) and split_ode_steps(4, 0, 12) == (0, 4)
    assert split_ode_steps(6, 1, 11) == (1, 5)  # a non-empty side keeps at least one step ...
    assert split_ode_steps(4, 11, 1) == (3, 1)
    assert split_ode_steps(1, 3, 3) == (1, 1)  # ... even past the total
    assert split_ode_steps(8, 2, 10) == (1, 7)  # 8 x 2/12 = 1.33, rounded
    sig = sigma_schedule(16, 3.0).tolist()
    assert respace(sig, 9, 16, 7) == [(sig[k], k) for k in range(9, 17)]  # its own count: the original points
    assert respace(sig, 0, 6, 3) == [(sig[k], k) for k in (0, 2, 4, 6)]  # a divisor: a subset
    mid = respace(sig, 0, 5, 2)
    assert mid[0] == (1.0, 0) and mid[2] == (sig[5], 5) and mid[1][1] is None
    assert mid[1][0] == pytest.approx(sig[2] + 0.5 * (sig[3] - sig[2]))
    before, after = window_grids(sig, 5, 4, 4)
    assert [k for _, k in before] == [0, None, 5] and after[0] == (sig[9], 9) and after[-1] == (0.0, 16)
    assert len(before) - 1 + len(after) - 1 == 4


def _toy(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    calls = []

    def velocity(x, s, c):
        calls.append(s[0].item())
        return -x * (1 + s[:, None, None, None]) + c

    return velocity, torch.randn(n, 1, 1, 1, generator=g), torch.randn(n, 2, 4, 4, generator=g), calls


def _gens(n):
    return [torch.Generator().manual_seed(100 + i) for i in range(n)]


def test_compressed_rollout_keeps_the_window_at_its_indices_and_its_log_probs_on_policy():
    velocity, cond, noise, calls = _toy()
    sigmas = sigma_schedule(10, 3.0)
    window = {4, 5, 6}
    traj = sample_sde(velocity, cond, noise, sigmas, noise_level=0.7, generator=_gens(3), sde_steps=window,
                      ode_solver="dpm2", ode_steps=3)
    assert len(calls) == 3 + 3  # 3 deterministic steps (before: 2 of 4, after: 1 of 3) + the window's 3
    assert traj.latents.shape[0] == 11 and traj.velocities.shape[0] == 10 and torch.equal(traj.sigmas, sigmas)
    assert torch.equal(traj.latents[0], noise) and torch.equal(traj.final, traj.latents[10])
    for k in range(10):
        if k in window:  # the trainer's rescoring of the stored window reproduces the rollout's log-probs: ratio 1
            again = sde_step_with_logprob(traj.latents[k], traj.velocities[k], sigmas[k], sigmas[k + 1],
                                          noise_level=0.7, sigma_max=sigmas[1], prev_sample=traj.latents[k + 1])
            assert torch.equal(again.log_prob, traj.log_probs[k]) and (traj.log_probs[k] != 0).all()
            assert torch.equal(traj.velocities[k], velocity(traj.latents[k], sigmas[k].expand(3), cond))
        else:
            assert (traj.log_probs[k] == 0).all()
    # the window starts from the compressed ODE's x_4 and the same SDE noise as the uncompressed rollout
    full = sample_sde(velocity, cond, noise, sigmas, noise_level=0.7, generator=_gens(3), sde_steps=window)
    assert 0 < (traj.latents[4] - full.latents[4]).norm() < 0.1 * full.latents[4].norm()
    assert 0 < (traj.final - full.final).norm() < 0.1 * full.final.norm()


def test_euler_on_the_schedule_own_grid_is_the_uncompressed_rollout_bit_for_bit():
    velocity, cond, noise, _ = _toy()
    sigmas = sigma_schedule(10, 3.0)
    kw = dict(noise_level=0.7, sde_steps={2, 3, 4, 5})
    full = sample_sde(velocity, cond, noise, sigmas, generator=_gens(3), **kw)
    same = sample_sde(velocity, cond, noise, sigmas, generator=_gens(3), ode_solver="euler", ode_steps=6, **kw)
    for name in ("latents", "velocities", "log_probs", "sigmas"):
        assert torch.equal(getattr(full, name), getattr(same, name)), name
    # dpm2 on the same grid points (ode_steps 0): every grid point visited and stored, the window unchanged in law
    dpm2 = sample_sde(velocity, cond, noise, sigmas, generator=_gens(3), ode_solver="dpm2", **kw)
    assert (dpm2.latents != 0).flatten(1).any(1).all()
    with pytest.raises(ValueError, match="consecutive"):
        sample_sde(velocity, cond, noise, sigmas, generator=_gens(3), noise_level=0.7, sde_steps={1, 3},
                   ode_solver="dpm2")


def test_the_compressed_rollout_reads_nothing_back_per_step():
    velocity, cond, noise, _ = _toy()
    velocity_quiet = lambda x, s, c: -x * (1 + s[:, None, None, None]) + c
    sigmas = sigma_schedule(16, 3.0)
    host = sigmas.tolist()
    counts = {}
    for solver, steps in (("euler", 0), ("dpm2", 4)):
        with HostSyncs() as syncs:
            sample_sde(velocity_quiet, cond, noise, sigmas, noise_level=0.7, generator=_gens(3), sde_steps={6, 7, 8, 9},
                       ode_solver=solver, ode_steps=steps, host_sigmas=host)
        counts[solver] = syncs.count
    assert counts["dpm2"] <= counts["euler"], counts


def _cfg(tmp_path, *extra):
    return load_config(TINY, SMALL + [f"run.output_dir={tmp_path}", "grpo.sde_window=3", "jagg.window=3",
                                      "sampling.ode_solver=dpm2", "sampling.ode_steps=3", *extra])


@pytest.mark.slow
def test_training_with_a_compressed_rollout_is_on_policy_and_resumes_exactly(tmp_path):
    common = ["train.steps=4", "grpo.kl_beta=0.01"]
    Trainer(_cfg(tmp_path / "whole", *common)).fit()
    Trainer(_cfg(tmp_path / "cut", *common, "train.steps=2", "run.checkpoint_every=2")).fit()
    Trainer(_cfg(tmp_path / "cut", *common, "run.checkpoint_every=2", "run.resume=auto")).fit()
    timing = ("time_rollout", "time_reward", "time_train")
    whole, cut = ([{k: v for k, v in r.items() if k not in timing} for r in read_metrics(tmp_path / d)]
                  for d in ("whole", "cut"))
    assert [r["step"] for r in cut] == [0, 1, 2, 3] and whole == cut
    for r in whole:
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and r["per_step_equiv"] == 3
        assert r["windows_jagg"] == 1 and r["kl"] >= 0


def test_rollout_forwards_drop_to_the_window_plus_ode_steps(tmp_path):
    counts = {}
    for steps in (0, 2):
        trainer = Trainer(_cfg(tmp_path / f"s{steps}", f"sampling.ode_steps={steps}", "train.steps=1"))
        seen = []
        real = trainer.model.forward
        trainer.model.forward = lambda x, *a, seen=seen, real=real, **k: seen.append(1) or real(x, *a, **k)
        trainer.policy.rollout(trainer.policy.encode(["a"] * 8), torch.arange(8), 0,
                               spec=RolloutSpec(sde_steps=frozenset({2, 3, 4})))
        counts[steps] = len(seen)
    assert counts == {0: 8, 2: 5}  # one chunk of 8 rows: T = 8 forwards, then W + ode_steps = 3 + 2


def test_ode_solver_config_errors_name_the_key():
    for override, key in [("sampling.ode_steps=6", "sampling.ode_steps"),
                          ("sampling.ode_solver=heun", "sampling.ode_solver")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(TINY, SMALL + ["grpo.sde_window=3", override])
    for override, key in [("sampling.ode_steps=2", "sampling.ode_steps"),
                          ("sampling.ode_solver=dpm2", "sampling.ode_solver")]:  # no SDE window: nothing to act on
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(TINY, SMALL + [override])
