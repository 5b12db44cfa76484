"""Classifier-free guidance in training, against Flow-GRPO's recipe (docs/algorithm.md, section 1): the unconditional
prediction is a constant for the gradient (scripts/train_sd3.py detaches it), the rollout's unconditional
predictions are reused while the parameters are the rollout's, and a JAGG joint pass holds the conditional rows
only."""

from pathlib import Path

import pytest
import torch

from jagg_scale.cond import cat_cond
from jagg_scale.grpo import GRPOStepLoss, guided_velocity, sample_sde, sigma_schedule
from jagg_scale.train import Trainer, load_config
from jagg_scale.train.update import UncondRefresh
from minibatch import grpo_backward, plan_of, rollout_minibatch

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.image_size=8", "model.dit.patch_size=2", "model.dit.hidden_size=32", "model.dit.depth=2",
         "model.dit.num_heads=2", "sampling.num_steps=4", "train.prompts_per_step=2", "grpo.group_size=3",
         "train.minibatch_size=6", "log.progress=false", "run.checkpoint_every=0"]
LOSS = dict(noise_level=0.7, clip_range=1e-4)


def _setup(tmp_path, guidance):
    trainer = Trainer(load_config(TINY, SMALL + [f"run.output_dir={tmp_path}", f"sampling.guidance={guidance}"]))
    return (trainer, *rollout_minibatch(trainer))


def _grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()]).double()


def _ours(trainer, cond, batch, guidance, jagg_cfg, on_policy=True):
    trainer.model.zero_grad(set_to_none=True)
    c, uc = trainer.policy.split_cond(cond)
    if uc is not None and not on_policy:
        batch = trainer.policy.fresh_uncond(batch, trainer.algorithm.steps, uc)
    loss = GRPOStepLoss(**LOSS, scale=1 / len(trainer.algorithm.steps), guidance=guidance)
    grpo_backward(trainer.policy.model_fn(), batch, c, loss, trainer.algorithm.steps, **plan_of(**jagg_cfg),
                                  on_policy=on_policy)
    return _grad(trainer.model)


def _flow_grpo(trainer, cond, batch, guidance, detach=True):
    """Flow-GRPO's training step, transcribed: per trained step one batched forward of the unconditional and
    conditional rows WITH grad, the unconditional half detached, the guided velocity into the loss, a backward."""
    trainer.model.zero_grad(set_to_none=True)
    model = trainer.model
    loss = GRPOStepLoss(**LOSS, scale=1 / len(trainer.algorithm.steps))  # called with the guided velocity itself
    B = batch.latents.shape[1]
    for k in trainer.algorithm.steps:
        x, s = batch.latents[k], batch.sigmas[k].expand(B)
        if guidance == 1.0:
            v = model(x, s, cond)
        else:
            c, uc = cond
            out = model(torch.cat([x, x]), torch.cat([s, s]), cat_cond([uc, c]))
            u, cp = out[:B], out[B:]
            u = u.detach() if detach else u
            v = u + guidance * (cp - u)
        loss(batch, k, v.float()).backward()
    return _grad(model)


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


@pytest.mark.parametrize("guidance", [1.0, 4.5, 7.0])
def test_cfg_gradient_is_flow_grpo_detached_uncond_exact_and_jagg_w2(tmp_path, guidance):
    trainer, cond, batch = _setup(tmp_path, guidance)
    ref = _flow_grpo(trainer, cond, batch, guidance)
    for jagg_cfg in (dict(mode="exact"), dict(window=2, intermediate="cached")):
        assert _cos(_ours(trainer, cond, batch, guidance, jagg_cfg), ref) > 0.99999
    if guidance != 1.0:  # what the project did before: the gradient through both halves is another direction
        assert _cos(_flow_grpo(trainer, cond, batch, guidance, detach=False), ref) < 0.99


def test_after_an_optimizer_step_the_uncond_is_recomputed_at_the_new_weights(tmp_path):
    guidance = 4.5
    trainer, cond, batch = _setup(tmp_path, guidance)
    with torch.no_grad():  # as an optimizer step would: the rollout's unconditional predictions are now stale
        for p in trainer.model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ref = _flow_grpo(trainer, cond, batch, guidance)
    fresh = _ours(trainer, cond, batch, guidance, dict(mode="exact"), on_policy=False)
    stale = _ours(trainer, cond, batch, guidance, dict(mode="exact"), on_policy=True)
    assert _cos(fresh, ref) > 0.99999
    assert _cos(stale, ref) < _cos(fresh, ref)  # the cached values are what off-policy would get wrong


def test_rollout_latents_and_log_probs_are_unchanged_by_keeping_both_predictions():
    torch.manual_seed(0)
    model = torch.nn.Linear(12, 12)

    def predict(x, s, c):
        return (model(x.flatten(1)) * (1 + s[:, None]) + c).view_as(x)

    cond = (torch.randn(3, 12), torch.zeros(3, 12))
    noise, sigmas = torch.randn(3, 3, 2, 2), sigma_schedule(6, 3.0)
    kw = dict(noise_level=0.7)
    old = sample_sde(lambda x, s, c: guided_velocity(predict, x, s, c, 4.5), cond, noise, sigmas,
                     generator=torch.Generator().manual_seed(1), **kw)
    new = sample_sde(predict, cond, noise, sigmas, generator=torch.Generator().manual_seed(1), guidance=4.5, **kw)
    assert torch.equal(old.latents, new.latents) and torch.equal(old.log_probs, new.log_probs)
    guided = new.uncond_velocities + 4.5 * (new.velocities - new.uncond_velocities)
    assert torch.allclose(guided, old.velocities, atol=1e-6)  # stored apart: c and u, the guided one recomputable
    assert not torch.allclose(new.velocities, old.velocities)


def test_cfg_training_runs_conditional_rows_only_and_reuses_the_rollouts_uncond(tmp_path):
    """W = 4 windows with CFG: every with-grad forward has at most 2B rows (the joint pass; 4B if the unconditional
    rows rode along), no unconditional forward before the first optimizer step, one per trained step after it."""
    cfg = load_config(TINY, SMALL + [f"run.output_dir={tmp_path}", "sampling.guidance=4.5", "jagg.window=4",
                                     "train.minibatch_size=3", "train.steps=1"])
    trainer = Trainer(cfg)
    rows = []
    trainer.model.register_forward_pre_hook(lambda m, args: rows.append((args[0].shape[0], torch.is_grad_enabled())))
    out = trainer.fit()[0]
    grad_rows = [n for n, grad in rows if grad]
    assert grad_rows and max(grad_rows) == 2 * 3  # the joint pass of the 3-row minibatch
    assert out["uncond_forward_passes"] == 4  # the second minibatch (off-policy): 4 trained steps x B rows
    assert out["backward_passes"] == 2 * 2 and out["windows_jagg"] == 2


def test_off_policy_cfg_in_micro_batches_recomputes_the_uncond_per_chunk(tmp_path):
    guidance = 4.5
    trainer, cond, batch = _setup(tmp_path, guidance)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ref = _flow_grpo(trainer, cond, batch, guidance)
    c, uc = cond
    trainer.model.zero_grad(set_to_none=True)
    loss = GRPOStepLoss(**LOSS, scale=1 / len(trainer.algorithm.steps), guidance=guidance, denominator=6.0)
    chunk_rows = []

    class Refresh(UncondRefresh):
        def __call__(self, b, rows, plan):
            chunk_rows.append(b.latents.shape[1])
            return super().__call__(b, rows, plan)

    steps = trainer.algorithm.steps
    stats = grpo_backward(trainer.policy.model_fn(), batch, c, loss, steps, **plan_of(window=2), on_policy=False,
                          micro_batch_size=4, refresh=Refresh(trainer.policy, uc, steps))
    assert chunk_rows == [4, 2] and stats.uncond_forward_passes == len(trainer.algorithm.steps)
    assert _cos(_grad(trainer.model), ref) > 0.99999


def test_a_scale_per_expert_guides_each_step_with_its_experts_scale_and_a_float_bit_for_bit():
    """ExpertGuidance (sampling.guidance_2, Wan2.2 A14B): the high-noise expert's steps guided with `high`, the
    low-noise expert's with `low` (the pipeline's rule: t >= boundary_ratio x 1000), a row at a time; a scale given
    as a tensor (0-d or one per row) guides 16-bit predictions to the same bits as the Python float."""
    from jagg_scale.grpo.guidance import ExpertGuidance, guide, scale_at
    from jagg_scale.jagg.experts import ExpertSwitch

    g = ExpertGuidance(high=4.0, low=3.0, switch=ExpertSwitch(boundary_ratio=0.875))
    sigma = torch.tensor([0.95, 0.875, 0.8749, 0.3])
    assert scale_at(g, sigma).tolist() == [4.0, 4.0, 3.0, 3.0] and scale_at(2.5, sigma) == 2.5
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        c, u = (torch.randn(4, 3, 4, 4, generator=gen).to(dtype) for _ in range(2))
        per_row = guide(c, u, scale_at(g, sigma))
        for i, scale in enumerate([4.0, 4.0, 3.0, 3.0]):
            assert torch.equal(per_row[i], guide(c, u, scale)[i]), (dtype, i)
        assert torch.equal(guide(c, u, torch.tensor(3.3)), guide(c, u, 3.3))  # a scale bf16 cannot hold
    assert g != 1.0  # CFG on: the checks that compare the scale with 1
