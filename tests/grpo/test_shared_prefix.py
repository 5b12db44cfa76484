"""The deterministic prefix shared by a prompt group (grpo/rollout.py sample_sde's shared_prefix, train/policy.py
Policy.rollout): with sampling.same_initial_noise every row of a group starts from one x_0, and with one prompt its
conditioning is one encoding copied (Policy.encode), so the ODE steps before the first SDE step are the same for the
group's rows in a chunk: they run once on a lead row, and its latents, predictions (CFG's unconditional too) and
state are copied to the others.

Bit-identical to computing every row: exactly, by construction, for a velocity whose rows do not interact (the
sampler's logic); for the tiny model families at 16 lead rows a chunk. A row's numbers depend on its batch where the
CPU's BLAS takes another kernel for a small batch (MKL 2024.2, AVX-512, here: sgemm's M <= 3 rows at 1 thread, M < 12
at 2 threads, and the models' per-row layers, time embedding and modulation, have M = rows): with 3 prompts of 4 rows
in a chunk of 12 the tiny DiT's shared-prefix rollout differs from the per-row one by up to 7.2e-7 in the latents,
9.5e-7 in the velocities and 6.0e-8 in the log-probs (1 and 2 threads) - the batch dependence a rollout chunk's size
already has today, not an error of the sharing. The tests below use sizes at which both batches take one kernel.
"""

import io
from pathlib import Path

import pytest
import torch

from jagg_scale.data import EditPrompt
from jagg_scale.grpo import sample_sde, sigma_schedule
from jagg_scale.grpo.rollout import FinalLatents, prefix_forwards
from jagg_scale.grpo.solver import window_grids
from jagg_scale.models import build_model
from jagg_scale.train import Trainer, load_config
from jagg_scale.train.algorithm import RolloutSpec
from jagg_scale.train.policy import Policy, prefix_leads

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
FIELDS = ("latents", "velocities", "uncond_velocities", "log_probs", "ref_velocities")
LEADS = torch.tensor([0, 0, 2, 2, 2, 5])  # rows 0-1, 2-4 and 5: three leads


def _toy(calls):
    """A velocity whose rows do not interact (no batch-dependent kernel), recording the rows of every call."""
    def velocity(x, s, c):
        calls.append(x.shape[0])
        return -x * (1 + s[:, None, None, None]) + c
    return velocity


def _toy_rollout(shared, guidance=1.0, **kw):
    torch.manual_seed(0)
    x0 = torch.randn(6, 2, 4, 4)[LEADS]  # a lead's rows start from its x_0
    c = torch.randn(6, 1, 1, 1)[LEADS]
    cond = c if guidance == 1.0 else (c, torch.randn(1, 1, 1, 1).expand(6, 1, 1, 1))
    calls = []
    traj = sample_sde(_toy(calls), cond, x0, sigma_schedule(8, 3.0), noise_level=0.7,
                      generator=[torch.Generator().manual_seed(i) for i in range(6)], guidance=guidance,
                      shared_prefix=LEADS if shared else None, **kw)
    return traj, calls


@pytest.mark.parametrize("kw, prefix", [
    (dict(sde_steps={3, 4}), 3),  # an SDE window: Euler before it
    (dict(sde_steps={2, 5}), 2),  # scattered SDE steps: the ODE step between them is every row's own
    (dict(sde_steps={3, 4}, ode_solver="dpm2", ode_steps=3), 2),  # compressed (MixGRPO-Flash): 2 of 6 steps before
    (dict(sde_steps={3, 4}, guidance=4.5), 3),  # CFG: both halves
    (dict(sde_steps={3, 4}, ref_velocity_fn=lambda x, s, c: 2 * x), 3),  # the KL reference, on the SDE steps
    (dict(sde_steps={3, 4}, keep="final"), 3),
    (dict(sde_steps=None), 0),  # the SDE from the first step: nothing before it to share
])
def test_the_shared_prefix_is_the_per_row_rollout_exactly(kw, prefix):
    ours, calls = _toy_rollout(True, **kw)
    rows, per_row_calls = _toy_rollout(False, **kw)
    if isinstance(ours, FinalLatents):
        assert torch.equal(ours.final, rows.final)
    else:
        for name in FIELDS:
            a, b = getattr(ours, name), getattr(rows, name)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
    cfg_rows = 2 if kw.get("guidance", 1.0) != 1.0 else 1
    assert calls[:prefix] == [3 * cfg_rows] * prefix and per_row_calls[:prefix] == [6 * cfg_rows] * prefix
    assert calls[prefix:] == per_row_calls[prefix:]
    host = sigma_schedule(8, 3.0).tolist()
    assert prefix_forwards(host, kw["sde_steps"], kw.get("ode_solver", "euler"), kw.get("ode_steps", 0)) == prefix


def test_prefix_forwards_counts_the_compressed_grid():
    host = sigma_schedule(10, 3.0).tolist()
    assert prefix_forwards(host, frozenset(range(4, 8)), "dpm2", 3) == len(window_grids(host, 4, 4, 3)[0]) - 1 == 2
    assert prefix_forwards(host, frozenset(range(4, 8))) == 4 and prefix_forwards(host, frozenset()) == 10


def test_a_lead_is_a_row_of_the_same_key_and_x0():
    noise = torch.zeros(5, 2)
    noise[3] = 1  # key of row 1, another x_0: its own lead
    assert prefix_leads([("g0", 0), ("g0", 0), ("g1", 1), ("g0", 0), ("g0", 1)], noise).tolist() == [0, 0, 2, 3, 4]


# ---------------------------------------------------------------- the tiny model families through Policy.rollout
WORDS = ["a", "the", "photo", "of", "cat", "dog", "red", "blue", "digit", "one", "two", "three", "on", "with"]
PROMPTS = [" ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(2 + i % 5)) for i in range(16)]


def _images(n: int) -> list[bytes]:
    from PIL import Image

    out = []
    for i in range(n):
        buf = io.BytesIO()
        Image.new("RGB", (16, 16), (20 * i % 256, 255 - 20 * i % 256, (70 * i) % 256)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def _policy(kind, request, group, *extra):
    common = ["sampling.same_initial_noise=true", f"grpo.group_size={group}", "train.prompts_per_step=16",
              f"train.minibatch_size={16 * group}", "sampling.num_steps=6", *extra]
    if kind == "dit":
        cfg = load_config(TINY, ["model.dit.hidden_size=32", "model.dit.depth=1", "model.dit.image_size=16", *common])
    else:
        pipe = request.getfixturevalue(f"{kind}_dir")
        cfg = load_config(ROOT / "configs" / f"{kind}_tiny_cpu.yaml",
                          [f"model.pretrained={pipe}", "model.resolution=16", *common])
    torch.manual_seed(0)
    return Policy(build_model(cfg.model), cfg, torch.device("cpu"), rollout_batch=32)


@pytest.mark.parametrize("kind, group, extra", [
    ("dit", 4, ()),  # 64 rows in 2 chunks of 32, groups cut across them
    ("dit", 4, ("grpo.sde_window=2", "sampling.ode_solver=dpm2", "sampling.ode_steps=3")),
    pytest.param("sd3", 2, (), marks=pytest.mark.slow),  # CFG: a pair of tensors, both halves' predictions
    ("qwenimage", 2, ()),  # Tokens: the leads' rows cut to their own longest prompt, the chunk's
    pytest.param("qwenimage_edit", 2, (), marks=pytest.mark.slow),  # edits: text, input image, the negative on it
])
def test_the_families_share_the_prefix_bit_identically(kind, group, extra, request):
    policy = _policy(kind, request, group, *extra)
    records = PROMPTS
    if kind == "qwenimage_edit":
        records = [EditPrompt(p, image) for p, image in zip(PROMPTS, _images(len(PROMPTS)))]
    rows = torch.randperm(16 * group, generator=torch.Generator().manual_seed(3))
    prompts = [records[i // group] for i in rows.tolist()]
    cond = policy.encode(prompts)
    spec = RolloutSpec(sde_steps=frozenset({3, 4}), trained=(3, 4))
    policy.take_counts()
    ours = policy.rollout(cond, rows, 2, spec=spec, prompts=prompts)
    counts = policy.take_counts()
    every = policy.rollout(cond, rows, 2, spec=spec)  # no prompts: every row its own prefix
    assert policy.take_counts() == {}
    for name in FIELDS:
        a, b = getattr(ours, name), getattr(every, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (name, (a - b).abs().max())
    groups_in_chunks = sum(len(set((c // group).tolist())) for c in rows.split(32))
    assert counts["rollout_prefix_rows"] == len(rows) - groups_in_chunks > 0
    forwards = prefix_forwards(policy.host_sigmas, spec.sde_steps, policy.cfg.sampling.ode_solver,
                               policy.cfg.sampling.ode_steps)
    assert counts["rollout_prefix_forwards"] == counts["rollout_prefix_rows"] * forwards > 0


def test_nothing_is_shared_without_one_x0_or_one_conditioning(request):
    """Rows of a group share nothing when sampling.same_initial_noise is off, nor with another input image (an
    edit's conditioning) or a prompt that cannot be compared."""
    spec = RolloutSpec(sde_steps=frozenset({3, 4}), trained=(3, 4))
    rows = torch.arange(8)

    def counts(policy, prompts):
        policy.take_counts()
        policy.rollout(policy.encode(prompts), rows, 0, spec=spec, prompts=prompts)
        return policy.take_counts()

    same = [p for p in PROMPTS[:2] for _ in range(4)]
    assert counts(_policy("dit", request, 4), same)["rollout_prefix_rows"] == 6
    assert "rollout_prefix_rows" not in counts(_policy("dit", request, 4, "sampling.same_initial_noise=false"), same)
    images = [EditPrompt("make it blue", image) for image in _images(8)]  # one text, every row its own image
    assert counts(_policy("dit", request, 4), images)["rollout_prefix_rows"] == 0
    policy = _policy("dit", request, 4)
    assert policy._prefix_keys(rows, [[p] for p in same], spec) is None


@pytest.mark.slow
def test_training_counts_what_it_shared_and_resumes_exactly(tmp_path):
    """A run with an SDE window and one x_0 per group: the metrics say rows encoded vs prompts encoded and the rows
    and row-forwards the shared prefix saved; training rescores the window on-policy; a run cut after step 1 and
    resumed logs what the whole run logs."""
    def run(out, *extra):
        return Trainer(load_config(TINY, [
            "model.dit.hidden_size=32", "model.dit.depth=1", "model.dit.image_size=16", "sampling.num_steps=8",
            "sampling.chunk_size=8", "train.prompts_per_step=2", "train.minibatch_size=8", "log.progress=false",
            "run.checkpoint_every=0", f"run.output_dir={out}", "train.steps=2", "grpo.sde_window=2",
            "grpo.sde_window_range=[3, 5]", "jagg.window=2", "sampling.same_initial_noise=true", *extra])).fit()

    whole = run(tmp_path / "whole")
    run(tmp_path / "cut", "train.steps=1", "run.checkpoint_every=1")
    cut = run(tmp_path / "cut", "run.checkpoint_every=1", "run.resume=auto")
    timing = ("time_rollout", "time_reward", "time_train")
    assert [{k: v for k, v in r.items() if k not in timing} for r in whole[1:]] == [
        {k: v for k, v in r.items() if k not in timing} for r in cut]
    for r in whole:
        assert r["encode_rows"] == 8 and r["encode_prompts"] == 2
        start = r["sde_window_start"]
        assert r["rollout_prefix_rows"] == 6 and r["rollout_prefix_forwards"] == 6 * start  # one chunk, 2 groups of 4
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
