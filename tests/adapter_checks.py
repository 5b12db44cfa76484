"""Checks shared by the diffusers adapter tests (tests/models/test_*_adapter.py): the GRPO log-prob round trip
(rollout vs training pass) and JAGG W = 2 == per-step on the real transformer, under each family's own CFG (its
guidance rule and negative prompt)."""

import torch

from jagg_scale.grpo import sample_sde
from jagg_scale.grpo.rollout import guided_velocity
from jagg_scale.grpo.sde import sde_step_with_logprob
from jagg_scale.jagg import exact_backward, jagg_backward

PROMPTS = ["a red cat", "two dogs on a photo"]


def guided(model, guidance, prompts=PROMPTS):
    """(velocity fn with CFG, the conditioning it takes): the (cond, uncond) pair when guidance != 1."""
    c = model.encode_prompts(prompts)
    cond = c if guidance == 1.0 else (c, model.encode_prompts([model.negative_prompt] * len(prompts)))
    return (lambda x, s, cc: guided_velocity(model, x, s, cc, guidance, model.guidance_rule)), cond


def check_rollout_logprobs_recomputed(model, sigmas, guidance, prompts=PROMPTS):
    """On-policy, the training pass rescores the rollout: ratio 1 within 1e-5 and the same velocities."""
    torch.manual_seed(0)
    fn, cond = guided(model, guidance, prompts)
    steps = len(sigmas) - 1
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(2))
    traj = sample_sde(fn, cond, noise, sigmas, noise_level=0.7, generator=torch.Generator().manual_seed(3))
    assert traj.latents.shape == (steps + 1, 2, *model.latent_shape) and torch.isfinite(traj.log_probs).all()
    for k in range(steps):
        v = fn(traj.latents[k], sigmas[k].expand(2), cond)  # training pass, with grad
        assert v.requires_grad
        step = sde_step_with_logprob(traj.latents[k], v, sigmas[k], sigmas[k + 1], noise_level=0.7,
                                     sigma_max=float(sigmas[1]), prev_sample=traj.latents[k + 1])
        ratio = torch.exp(step.log_prob - traj.log_probs[k])
        assert (ratio - 1).abs().max() <= 1e-5, (k, ratio)
        assert torch.allclose(v.detach(), traj.velocities[k], atol=1e-5)


def _grads(m):
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in m.parameters()])


def check_jagg_w2_equals_per_step(m, window_sigmas, guidance, prompts=PROMPTS):
    """A float64 model: jagg_backward on a 2-step window gives the per-step loss and gradient (JAGG is exact
    for W <= 2), with the CFG pair carried through the joint batch."""
    fn, cond = guided(m, guidance, prompts)
    gen = torch.Generator().manual_seed(4)
    latents = torch.randn(2, 2, *m.latent_shape, generator=gen, dtype=torch.float64)
    targets = torch.randn(2, 2, *m.latent_shape, generator=gen, dtype=torch.float64)
    adv = torch.randn(2, 2, generator=gen, dtype=torch.float64)

    def step_loss(k, v):  # GRPO-like: -A exp(log-ratio), log-prob a Gaussian in v
        logp = -((v.double() - targets[k]) ** 2).flatten(1).mean(dim=1)
        return (-adv[k] * torch.exp(0.1 * logp)).mean()

    m.zero_grad(set_to_none=True)
    loss_j = jagg_backward(fn, latents, window_sigmas, cond, step_loss)
    g_j = _grads(m).clone()
    m.zero_grad(set_to_none=True)
    loss_e = exact_backward(fn, latents, window_sigmas, cond, step_loss)
    g_e = _grads(m).clone()
    m.zero_grad(set_to_none=True)
    assert g_e.norm() > 0
    assert torch.allclose(loss_j.double(), loss_e.double(), rtol=1e-10)
    assert float((g_j - g_e).norm() / g_e.norm()) <= 1e-5


def check_only_the_transformer_trains(model, frozen: set):
    """The optimizer sees the transformer alone; the frozen parts are frozen and not in the state dict."""
    assert {id(p) for p in model.parameters()} == {id(p) for p in model.transformer.parameters()}
    assert all(k.startswith("transformer.") for k in model.state_dict())
    assert set(model.frozen) == frozen
    for m in model.frozen.values():
        assert not any(p.requires_grad for p in m.parameters())


def check_trains_and_the_lora_loads(config, overrides: list, run, mode: str, load_plain, prompts=PROMPTS):
    """Two jagg-train steps of a tiny pipeline's LoRA config (`mode` jagg or exact): 8 trained steps each, 4 backwards
    with JAGG (2 windows of 4) or 8 per step, the training pass rescoring the rollout (ratio 1); then the exported
    diffusers LoRA, loaded by `load_plain(lora_dir)` into a plain pipeline's velocity, gives the trained outputs."""
    import pytest

    from jagg_scale.train import Trainer, load_config

    trainer = Trainer(load_config(config, [*overrides, "train.steps=2", f"jagg.mode={mode}", f"run.output_dir={run}",
                                           "log.progress=false"]))
    try:
        rows = trainer.fit()
        x = torch.randn(2, *trainer.model.latent_shape, generator=torch.Generator().manual_seed(3))
        sigma, cond = torch.tensor([0.8, 0.3]), trainer.model.encode_prompts(prompts)
        with torch.no_grad():
            trained = trainer.model(x, sigma, cond)
    finally:
        trainer.close()
    assert len(rows) == 2 and all(r["per_step_equiv"] == 8 for r in rows)
    assert [r["backward_passes"] for r in rows] == ([4, 4] if mode == "jagg" else [8, 8])
    assert rows[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # rollout and training passes agree
    lora = run / "lora" / "pytorch_lora_weights.safetensors"
    assert lora.is_file()
    plain = load_plain(lora.parent)
    with torch.no_grad():
        assert torch.allclose(plain(x, sigma, cond), trained, atol=1e-5)
