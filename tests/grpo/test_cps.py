"""Coefficients-preserving sampling (sampling.sde: cps, grpo/sde.py) against Flow-GRPO's own step, on fixed tensors,
its defining property, and through the trainer with JAGG."""

import math
from pathlib import Path

import pytest
import torch

from jagg_scale.grpo import GRPOStepLoss, cps_step_with_logprob, sample_sde
from jagg_scale.train import ConfigError, Trainer, load_config

ROOT = Path(__file__).resolve().parents[2]


def _flow_grpo_cps(sample, model_output, sigma, sigma_prev, noise_level, variance_noise):
    """Flow-GRPO's sde_step_with_logprob with sde_type 'cps', its arithmetic transcribed (yifan123/flow_grpo
    flow_grpo/diffusers_patch/sd3_sde_with_logprob.py at commit 54809b5): sigma the current noise level, sigma_prev
    the next one (the scheduler's naming), broadcast over [B, 1, 1, 1]. Returns (prev_sample, log_prob, mean,
    std_dev_t)."""
    sigma = sigma.view(-1, 1, 1, 1)
    sigma_prev = sigma_prev.view(-1, 1, 1, 1)
    std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
    pred_original_sample = sample - sigma * model_output
    noise_estimate = sample + model_output * (1 - sigma)
    prev_sample_mean = pred_original_sample * (1 - sigma_prev) + noise_estimate * torch.sqrt(sigma_prev**2
                                                                                             - std_dev_t**2)
    prev_sample = prev_sample_mean + std_dev_t * variance_noise
    log_prob = -((prev_sample.detach() - prev_sample_mean) ** 2)
    return prev_sample, log_prob.mean(dim=(1, 2, 3)), prev_sample_mean, std_dev_t


@pytest.mark.parametrize("sigma,sigma_next,noise_level", [(1.0, 0.9, 0.8), (0.7, 0.55, 0.8), (0.3, 0.1, 0.5),
                                                          (0.2, 0.0, 0.8)])
def test_cps_is_flow_grpos_step(sigma, sigma_next, noise_level):
    g = torch.Generator().manual_seed(int(sigma * 100))
    x, v, eps = (torch.randn(3, 4, 6, 6, generator=g) for _ in range(3))
    s, s_next = torch.full((3,), sigma), torch.full((3,), sigma_next)
    ref_prev, ref_logp, ref_mean, ref_std = _flow_grpo_cps(x, v, s, s_next, noise_level, eps)
    ours = cps_step_with_logprob(x, v, s, s_next, noise_level=noise_level, noise=eps)
    torch.testing.assert_close(ours.prev_sample, ref_prev, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.mean, ref_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.std.expand_as(ref_std), ref_std, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours.log_prob, ref_logp, rtol=1e-6, atol=1e-7)
    # scoring a given sample (the training pass) gives the rollout's log p back
    again = cps_step_with_logprob(x, v, s, s_next, noise_level=noise_level, prev_sample=ours.prev_sample)
    torch.testing.assert_close(again.log_prob, ours.log_prob, rtol=0, atol=0)


def test_cps_preserves_the_rectified_flow_coefficients():
    """With the exact velocity of a point-mass data d (v = e - d at x_s = (1 - s) d + s e), one CPS step from s to s'
    lands on the rectified-flow marginal at s': coefficient (1 - s') on d, noise of total std s'."""
    torch.manual_seed(0)
    d = torch.randn(1, 1, 8, 8).expand(20000, 1, 8, 8)
    s, s_next = 0.8, 0.5
    e = torch.randn(20000, 1, 8, 8)
    x = (1 - s) * d + s * e
    step = cps_step_with_logprob(x, e - d, s, s_next, noise_level=0.8, noise=torch.randn_like(x))
    residual = step.prev_sample - (1 - s_next) * d
    assert abs(float(residual.mean())) < 5e-3
    assert float(residual.std()) == pytest.approx(s_next, rel=1e-2)


def test_a_cps_rollout_is_scored_back_on_policy_and_configured_by_name():
    torch.manual_seed(0)
    model = lambda x, s, c: -0.5 * x + s.view(-1, 1, 1, 1)  # noqa: E731 - a velocity field with nothing to learn
    sigmas = torch.linspace(1.0, 0.0, 6)
    traj = sample_sde(model, None, torch.randn(4, 2, 4, 4), sigmas, noise_level=0.8,
                      generator=[torch.Generator().manual_seed(i) for i in range(4)], sde="cps")
    loss = GRPOStepLoss(noise_level=0.8, clip_range=1e-4, sde="cps")
    batch = traj.step_batch(torch.arange(4), torch.ones(4), torch.ones(4, dtype=torch.bool))
    for k in range(4):
        loss(batch, k, batch.velocities[k])
    assert all(float(r) == pytest.approx(1.0, abs=1e-6) for r in loss.metrics["ratio_mean"])  # on-policy
    with pytest.raises(ConfigError, match=r"'sampling.noise_level' must be in \(0, 1\] with sampling.sde cps"):
        load_config(ROOT / "configs" / "tiny_cpu.yaml", ["sampling.sde=cps", "sampling.noise_level=1.5"])
    with pytest.raises(ConfigError, match="'grpo.timestep_fraction' must leave the last step untrained"):
        load_config(ROOT / "configs" / "tiny_cpu.yaml", ["sampling.sde=cps", "sampling.noise_level=0.8"])
    with pytest.raises(ConfigError, match="'grpo.sde_window_range' must end before the last step"):
        load_config(ROOT / "configs" / "tiny_cpu.yaml", ["sampling.sde=cps", "sampling.noise_level=0.8",
                                                          "grpo.sde_window=2"])
    with pytest.raises(ConfigError, match="'sampling.sde' must be one of flow_grpo, cps"):
        load_config(ROOT / "configs" / "tiny_cpu.yaml", ["sampling.sde=dance"])


def test_jagg_trains_on_cps_rollouts(tmp_path):
    """The JAGG joint pass needs only that the loss depends on theta through v_k: the same with CPS. On-policy the
    ratio is 1, and JAGG windows of 2 (exact for W <= 2) give the per-step gradient's update."""
    small = ["model.dit.hidden_size=32", "model.dit.depth=1", "model.dit.image_size=16", "sampling.num_steps=4",
             "train.prompts_per_step=2", "train.minibatch_size=8", "sampling.chunk_size=8", "train.steps=1",
             "sampling.sde=cps", "sampling.noise_level=0.8", "grpo.timestep_fraction=0.8", "log.progress=false",
             "run.checkpoint_every=0"]
    rows = {}
    for name, extra in (("exact", ["jagg.mode=exact"]), ("jagg", ["jagg.window=2"])):
        trainer = Trainer(load_config(ROOT / "configs" / "tiny_cpu.yaml", small + extra
                                      + [f"run.output_dir={tmp_path / name}"]))
        rows[name] = trainer.fit()[0]
        trainer.close()
    assert rows["jagg"]["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and rows["jagg"]["backward_passes"] == 3
    assert rows["jagg"]["grad_norm"] == pytest.approx(rows["exact"]["grad_norm"], rel=1e-4)
    assert rows["jagg"]["reward_mean"] == rows["exact"]["reward_mean"]
