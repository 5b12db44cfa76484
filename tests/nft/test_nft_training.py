"""DiffusionNFT in the trainer (train.algorithm nft, train/nft.py): JAGG-NFT is exact where the math says, the old
policy's schedule, resume, LoRA, the config's checks."""

from pathlib import Path

import pytest
import torch

from jagg_scale.jagg import exact_plan, knot_backward
from jagg_scale.nft import NFTBatch, NFTStepLoss, optimality
from jagg_scale.train import ConfigError, Trainer, load_config
from jagg_scale.train.logging import read_metrics
from jagg_scale.train.nft import old_decay
from toy_velocity import LinearVelocity

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
NFT = ["train.algorithm=nft", "model.dit.hidden_size=32", "model.dit.depth=1", "model.dit.image_size=16",
       "sampling.num_steps=6", "sampling.chunk_size=8", "train.prompts_per_step=2", "train.minibatch_size=4",
       "grpo.timestep_fraction=0.8", "log.progress=false", "run.checkpoint_every=1", "nft.kl_beta=0.01"]


def _grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _nft_batch(K, B, shared_noise, g):
    d = torch.randn(B, 3, 2, 2, generator=g, dtype=torch.float64)
    t = torch.sort(torch.rand(K, B, generator=g, dtype=torch.float64), dim=0, descending=True).values * 0.9 + 0.05
    e = torch.randn(1 if shared_noise else K, B, 3, 2, 2, generator=g, dtype=torch.float64).expand(K, B, 3, 2, 2)
    tb = t.reshape(K, B, 1, 1, 1)
    x = (1 - tb) * d + tb * e
    old = torch.randn(K, B, 3, 2, 2, generator=g, dtype=torch.float64)
    return NFTBatch(clean=d, t=t, noised=x, old=old, optimality=optimality(torch.randn(B, generator=g), 5.0),
                    mask=torch.ones(B, dtype=torch.bool), ref=old + 0.1)


@pytest.mark.parametrize("intermediate", ["forward", "interpolate"])
def test_jagg_nft_is_exact_with_shared_noise_on_an_affine_velocity(intermediate):
    """A sample's training inputs x_t = (1 - t) d + t e with one e lie on a line in (x, t); the NFT loss depends on
    theta only through v(x_t, t): for a velocity affine in (x, t) one joint pass over the two end timesteps gives the
    per-timestep gradient exactly (docs/algorithm.md, section 8), with each row's own timesteps. With fresh noise per
    timestep the inputs leave the line and it does not."""
    K, B = 5, 3
    torch.manual_seed(0)
    model = LinearVelocity().double()
    cond = torch.randn(B, 4, dtype=torch.float64)
    loss = NFTStepLoss(beta=0.7, kl_beta=0.1, adv_clip_max=5.0, scale=1 / K)
    for shared, exact in ((True, True), (False, False)):
        batch = _nft_batch(K, B, shared, torch.Generator().manual_seed(1))
        if intermediate == "interpolate":  # interior values moved from what the "old" predictions hold
            with torch.no_grad():
                batch.old = torch.stack([model(batch.noised[k], batch.t[k], cond) for k in range(K)]) + 0.01
        grads = []
        for plan in (exact_plan(K), [(0, K - 1)]):
            model.zero_grad(set_to_none=True)
            knot_backward(model, plan, batch.noised, batch.t, cond, loss.fresh().on(batch), cached_velocities=batch.old,
                          intermediate=intermediate)
            grads.append(_grad(model).clone())
        err = float((grads[1] - grads[0]).norm() / grads[0].norm())
        assert (err < 1e-9) if exact else (err > 1e-4), (shared, intermediate, err)


@pytest.mark.parametrize("noise,window,expect", [("per_timestep", None, [0, 1, 2, 3]), ("per_sample", None, [0] * 4),
                                                  ("per_window", 3, [0, 0, 0, 1])])
def test_nft_noise_draws_one_noise_per_group_of_timesteps(tmp_path, noise, window, expect):
    """nft.noise: which of a sample's K = 4 sorted timesteps share a draw (per_window: jagg.window 3 gives windows
    [0-2] [3]); the draws differ between rows and between groups."""
    over = NFT + [f"nft.noise={noise}", f"run.output_dir={tmp_path}"] + ([f"jagg.window={window}"] if window else [])
    trainer = Trainer(load_config(TINY, over))
    e = trainer.algorithm._noise(step=3, epoch=0, global_rows=torch.tensor([5, 9]), shape=(2, 2))
    assert e.shape == (4, 2, 2, 2)
    for row in range(2):
        groups = {}
        for k, group in enumerate(expect):
            groups.setdefault(group, e[k, row])
            assert torch.equal(e[k, row], groups[group]), (noise, k)
        assert len({tuple(v.flatten().tolist()) for v in groups.values()}) == len(groups)
    assert not torch.equal(e[0, 0], e[0, 1])
    again = trainer.algorithm._noise(step=3, epoch=0, global_rows=torch.tensor([9]), shape=(2, 2))
    assert torch.equal(again[:, 0], e[:, 1])  # a row's draws are its own: seeded by (seed, step, row)
    trainer.close()


def test_nft_old_at_knots_runs_the_frozen_models_at_the_knots_only(tmp_path):
    """nft.old_at knots: the old policy's and the reference's velocities come from forwards at the windows' knots
    (K = 4 in windows [0-2] [3]: positions 0, 2, 3) and are linear in each row's t inside a window, which is the
    true value when the velocity is affine along a shared-noise line."""
    over = NFT + ["jagg.window=3", "nft.noise=per_sample", "nft.old_at=knots", f"run.output_dir={tmp_path}"]
    nft = Trainer(load_config(TINY, over)).algorithm
    K, B = 4, 3
    d, e = torch.randn(B, 4, dtype=torch.float64), torch.randn(B, 4, dtype=torch.float64)
    t = torch.sort(torch.rand(K, B, dtype=torch.float64), dim=0, descending=True).values
    x = (1 - t[..., None]) * d + t[..., None] * e  # one line per row
    A = torch.randn(4, 4, dtype=torch.float64)
    seen = []

    def affine(x_k, t_k, cond):
        seen.append(x_k.shape[0])
        return x_k @ A + 2.0 * t_k[:, None] + cond

    cond = torch.randn(B, 4, dtype=torch.float64)
    got = nft._predict(affine, x, t, cond)
    assert len(seen) == 3  # three knots, one micro-batch of B rows each, instead of K forwards
    expect = torch.stack([x[k] @ A + 2.0 * t[k][:, None] + cond for k in range(K)])
    assert torch.allclose(got.double(), expect, atol=1e-5)
    seen.clear()
    x_fresh = (1 - t[..., None]) * d + t[..., None] * torch.randn(K, B, 4, dtype=torch.float64)  # off the line
    assert not torch.allclose(nft._predict(affine, x_fresh, t, cond)[1].double(),
                              x_fresh[1] @ A + 2.0 * t[1][:, None] + cond, atol=1e-3)


def test_the_old_policy_decay_schedule_is_diffusion_nfts():
    assert [old_decay(s, (0, 0.001, 0.5)) for s in (0, 1, 100, 499, 500, 10_000)] == [0.0, 0.001, 0.1, 0.499, 0.5, 0.5]
    assert [old_decay(s, (75, 0.0075, 0.999)) for s in (0, 74, 75, 76, 300)] == [0.0, 0.0, 0.0, 0.0075, 0.999]
    assert old_decay(10, (0, 0, 0)) == 0.0


@pytest.mark.slow
def test_nft_trains_resumes_exactly_and_keeps_its_old_policy(tmp_path):
    # one noise draw per window and the frozen models at the knots only: the draws and the fill are resume-exact too
    common = NFT + ["nft.noise=per_window", "nft.old_at=knots", "jagg.window=3", "train.ema_decay=0.5"]
    full = Trainer(load_config(TINY, common + [f"run.output_dir={tmp_path / 'full'}", "train.steps=3"]))
    rows = full.fit()
    old = {n: t.clone() for n, t in full.engine.shadows["old"].items()}
    live = dict(full.engine.model.named_parameters())
    assert any(not torch.equal(old[n], live[n]) for n in old)  # the old policy lags the trained one
    # two optimizer steps per rollout (8 rows in minibatches of 4): decay 0.001 per optimizer step so far
    assert rows[0]["old_decay"] == pytest.approx(0.002) and rows[-1]["old_decay"] == pytest.approx(0.006)
    # K = 4 timesteps (6 x 0.8) in windows [0-2] [3]: knots 0, 2, 3 per minibatch instead of 4
    assert all(r["backward_passes"] == 3 * 2 and r["per_step_equiv"] == 4 * 2 for r in rows)
    assert rows[-1]["kl"] > 0 and rows[0]["loss"] > 0
    full.close()
    Trainer(load_config(TINY, common + [f"run.output_dir={tmp_path / 'cut'}", "train.steps=2"])).fit()
    resumed = Trainer(load_config(TINY, common + [f"run.output_dir={tmp_path / 'cut'}", "train.steps=3",
                                                  "run.resume=auto"]))
    assert resumed.start_step == 2
    resumed.fit()
    for n, t in resumed.engine.shadows["old"].items():
        assert torch.equal(t, old[n]), n
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rs]  # noqa: E731
    assert strip(read_metrics(tmp_path / "cut")) == strip(read_metrics(tmp_path / "full"))
    resumed.close()


@pytest.mark.slow
def test_nft_with_lora_keeps_the_old_adapter_and_exports_a_diffusers_lora(sd3_dir, tmp_path):
    cfg = load_config(ROOT / "configs" / "sd3_tiny_cpu.yaml", [
        f"model.pretrained={sd3_dir}", "model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8",
        "train.algorithm=nft", "sampling.guidance=1", "sampling.ode_solver=dpm2", "sampling.num_steps=4",
        "train.steps=2",
        "nft.noise=per_sample", "jagg.window=4", "nft.kl_beta=0.01", f"run.output_dir={tmp_path}",
        "log.progress=false", "eval.enabled=false"])
    trainer = Trainer(cfg)
    assert trainer.policy.ref_model is None  # the reference is the adapter off, as under GRPO
    rows = trainer.fit()
    trainable = {n for n, p in trainer.engine.model.named_parameters() if p.requires_grad}
    assert set(trainer.engine.shadows["old"]) == trainable
    assert all("lora_" in n for n in trainer.engine.shadows["old"])  # the old policy is an adapter's worth
    steps = rows[-1]["optimizer_steps"]  # K = 4 timesteps, one window: 2 backwards per minibatch instead of 4
    assert rows[-1]["backward_passes"] == 2 * steps and rows[-1]["per_step_equiv"] == 4 * steps
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").exists()
    trainer.close()


@pytest.mark.parametrize("override,key", [
    (["nft.mix=0.5"], "nft.mix"),  # a DiffusionNFT key on a GRPO run
    (["train.algorithm=nft", "sampling.guidance=4.5"], "sampling.guidance"),
    (["train.algorithm=nft", "grpo.sde_window=2"], "grpo.sde_window"),
    (["train.algorithm=nft", "sampling.noise_level=0.9"], "sampling.noise_level"),
    (["train.algorithm=nft", "sampling.sde=cps"], "sampling.sde"),
    (["train.algorithm=nft", "grpo.clip_range=0.2"], "grpo.clip_range"),
    (["train.algorithm=nft", "grpo.kl_beta=0.01"], "grpo.kl_beta"),
    (["train.algorithm=nft", "nft.old_decay=[0, 0.1, 1.0]"], "nft.old_decay"),
    (["train.algorithm=nft", "nft.mix=0"], "nft.mix"),
    (["train.algorithm=nft", "nft.noise=per_window", "jagg.mode=exact"], "nft.noise"),  # windows need the planner
    (["train.algorithm=nft", "nft.noise=per_window", "jagg.share_knots=true"], "nft.noise"),
    (["train.algorithm=nft", "nft.old_at=knots", "jagg.jagg_frac=0.5"], "nft.old_at"),  # routed steps: no window
    (["train.algorithm=nft", "nft.old_at=knots", "jagg.planner=budget"], "nft.old_at"),
    (["nft.noise=per_sample"], "nft.noise"),
    (["nft.adv_mode=binary"], "nft.adv_mode"),
    (["train.algorithm=nft", "nft.adv_mode=positive"], "nft.adv_mode"),  # not one of DiffusionNFT's modes
])
def test_what_nft_does_not_use_is_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        load_config(TINY, override)
    assert load_config(TINY, ["train.algorithm=nft", "sampling.ode_solver=dpm2"]).train.algorithm == "nft"
