"""Evaluation at scale (train/evaluate.py): bounded memory, ranks sharing the images, the noise of image i fixed.

- the chunked noise is the single seeded draw the evaluation always used, whatever the chunking or the ranks;
- one process reproduces the unbatched evaluation (encode all, sample in batches, decode all, score all) exactly;
- the model, the decoder, the encoder and the reward never see more than eval.chunk_size images at once (2x for the
  CFG pair), for 16 or 128 eval images alike: memory does not grow with the eval set;
- eval.at_start=false skips the step-0 evaluation;
- 2 processes (torchrun, gloo, fsdp2) write the eval.json and grid.png one process writes, and a 2-process
  `jagg-eval` reproduces the 2-process run's own evaluation.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hang_guard import RUN_S
from jagg_scale.cond import index_cond
from jagg_scale.grpo import model_schedule, sample_ode
from jagg_scale.models import build_model
from jagg_scale.parallel.ranks import free_port, launcher_env
from jagg_scale.rewards import score_safely
from jagg_scale.rewards.multi import build_reward_mix
from jagg_scale.train import Trainer, load_config
from jagg_scale.train import evaluate as evaluate_mod
from jagg_scale.train.evaluate import EvalNoise, eval_prompts, eval_share, evaluate
from jagg_scale.train.grid import LABEL_WIDTH
from jagg_scale.train.policy import Policy

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.image_size=8", "model.dit.patch_size=2", "model.dit.hidden_size=32", "model.dit.depth=2",
         "model.dit.num_heads=2", "sampling.num_steps=4", "sampling.eval_num_steps=3", "train.prompts_per_step=2",
         "grpo.group_size=3", "train.minibatch_size=6", "log.progress=false", "run.checkpoint_every=0",
         "jagg.window=2"]
WORDS = ["apple", "sky", "cat", "dog", "tree", "lake", "car", "house"]


def _prompts(n: int) -> str:
    return "eval.prompts=[" + ", ".join(f"a {WORDS[i % 8]} number {i}" for i in range(n)) + "]"


def _setup(*extra: str):
    cfg = load_config(TINY, SMALL + ["eval.enabled=true", *extra])
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model)
    return cfg, model, Policy(model, cfg, torch.device("cpu")), build_reward_mix(cfg.reward)


# ----------------------------------------------------------------------------------------------------- the noise


@pytest.mark.parametrize("shape", [(3, 8, 8), (1, 3, 3), (3, 5, 5), (16, 16, 16), (1, 1, 1), (2, 3, 1)])
def test_eval_noise_is_the_single_seeded_draw_whatever_the_chunks_and_ranks(shape):
    for n in (1, 2, 5, 17, 33):
        full = torch.randn(n, *shape, generator=torch.Generator().manual_seed(1234))
        for chunk in (1, 3, 4, 16):
            assert torch.equal(EvalNoise(1234, shape, n, chunk).rows(torch.arange(n)), full), (n, chunk)
        for world in (1, 2, 3, 4):  # every rank's share, padding rows included, in the shares' batches
            for rank in range(world):
                index, real = eval_share(n, rank, world)
                noise = EvalNoise(1234, shape, n, 2)
                got = torch.cat([noise.rows(rows) for rows in index.split(2)])
                assert torch.equal(got[real], full[index[real]])


def test_eval_shares_cover_the_images_once_in_order_with_equal_lengths():
    for n in (1, 2, 5, 8, 13):
        for world in (1, 2, 3, 5):
            shares = [eval_share(n, r, world) for r in range(world)]
            assert len({len(i) for i, _ in shares}) == 1
            order = torch.cat([i[m] for i, m in shares])
            assert order.tolist() == list(range(n))
            # rank-major: the first n of the gathered rows are the images in order, the padding after them
            assert torch.cat([m for _, m in shares]).tolist() == [True] * n + [False] * (world * len(shares[0][0]) - n)


def test_eval_noise_refuses_rows_out_of_order():
    noise = EvalNoise(0, (4, 4), 40, 4)
    noise.rows([10, 10, 11])
    with pytest.raises(ValueError, match="non-decreasing"):
        noise.rows([3])


# ------------------------------------------------------------------------------------ one process: unchanged


def _unbatched_reference(model, velocity_fn, encode, reward, cfg, prompts) -> list[float]:
    """The evaluation before it was batched (encode all, sample in batches, decode all, score all at once)."""
    e = cfg.eval
    records = [r for r in prompts.records for _ in range(e.num_per_prompt)]
    texts = [r.prompt for r in records]
    noise = torch.randn(len(records), *model.latent_shape, generator=torch.Generator().manual_seed(e.seed))
    sigmas = model_schedule(model, cfg.sampling.eval_num_steps, cfg.sampling.shift)
    cond = encode(texts)
    finals = [sample_ode(velocity_fn, index_cond(cond, rows), noise[rows], sigmas)
              for rows in torch.arange(len(records)).split(e.chunk_size)]
    images = model.decode(torch.cat(finals))
    scores, _, _ = score_safely(reward, images, texts, [r.metadata for r in records], max_fail_frac=1.0)
    return [float(s) for s in scores]


@pytest.mark.parametrize("extra", [[], ["sampling.guidance=3.0"], ["eval.chunk_size=4", "eval.seed=7"]],
                         ids=["plain", "cfg", "batch4"])
def test_one_process_eval_equals_the_unbatched_evaluation(tmp_path, extra):
    cfg, model, policy, reward = _setup(_prompts(5), "eval.num_per_prompt=3", "eval.chunk_size=2", *extra)
    prompts = eval_prompts(cfg)
    result = evaluate(model, policy.velocity_fn(), policy.encode, reward, cfg, prompts, tmp_path)
    expected = _unbatched_reference(model, policy.velocity_fn(), policy.encode, reward, cfg, prompts)
    assert [s for p in result["per_prompt"] for s in p["scores"]] == expected  # exactly
    assert result["num_images"] == 15 and result["num_failed"] == 0
    assert json.loads((tmp_path / "eval.json").read_text()) == result


def test_grid_shows_the_first_grid_images(tmp_path):
    cfg, model, policy, reward = _setup(_prompts(6), "eval.num_per_prompt=2", "eval.chunk_size=3",
                                        "eval.grid_images=5")
    evaluate(model, policy.velocity_fn(), policy.encode, reward, cfg, eval_prompts(cfg), tmp_path / "five")
    cfg0 = load_config(TINY, SMALL + ["eval.enabled=true", _prompts(6), "eval.num_per_prompt=2", "eval.grid_images=0"])
    evaluate(model, policy.velocity_fn(), policy.encode, reward, cfg0, eval_prompts(cfg0), tmp_path / "none")
    # 8 px images shown at 64 px, 2 px gaps; one row per prompt after its label: 5 images -> rows of 2, 2, 1
    assert Image.open(tmp_path / "five" / "grid.png").size == (LABEL_WIDTH + 2 * 66 + 2, 3 * 66 + 2)
    assert not (tmp_path / "none" / "grid.png").exists() and (tmp_path / "none" / "eval.json").exists()


# ------------------------------------------------------------------------------------------- bounded batches


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_no_call_sees_more_than_a_batch_whatever_the_number_of_prompts(tmp_path, monkeypatch, guidance):
    seen: dict[str, list[int]] = {}

    def record(name, rows):
        seen.setdefault(name, []).append(int(rows))

    class SpyNoise(EvalNoise):
        def rows(self, index):
            out = super().rows(index)
            record("noise_chunk", len(self.chunk))
            return out

    monkeypatch.setattr(evaluate_mod, "EvalNoise", SpyNoise)
    batch = 4
    for n_prompts in (8, 64):
        seen.clear()
        cfg, model, policy, reward = _setup(_prompts(n_prompts), "eval.num_per_prompt=2", f"eval.chunk_size={batch}",
                                            f"sampling.guidance={guidance}", "sampling.eval_num_steps=2")
        model.register_forward_hook(lambda mod, args, out: record("model", args[0].shape[0]))
        decode, encode_prompts = model.decode, model.encode_prompts
        monkeypatch.setattr(model, "decode", lambda x, decode=decode: (record("decode", x.shape[0]), decode(x))[1])
        monkeypatch.setattr(model, "encode_prompts",
                            lambda p, encode_prompts=encode_prompts: (record("encode", len(p)), encode_prompts(p))[1])
        score = reward.__call__
        spy_reward = type("SpyReward", (), {"name": reward.name,
                                            "__call__": lambda self, im, p, m, score=score: (
                                                record("reward", im.shape[0]), score(im, p, m))[1]})()
        result = evaluate(model, policy.velocity_fn(), policy.encode, spy_reward, cfg, eval_prompts(cfg), None)
        assert result["num_images"] == 2 * n_prompts and result["num_failed"] == 0
        pair = 1 if guidance == 1.0 else 2  # CFG: the conditional and unconditional rows of a batch in one call
        assert max(seen["model"]) == batch * pair
        for name in ("decode", "reward", "noise_chunk"):
            assert max(seen[name]) == batch, (name, n_prompts)
        assert max(seen["encode"]) == batch // 2, n_prompts  # a chunk's distinct prompts once: 2 rows a prompt
        assert len(seen["decode"]) == len(seen["reward"]) == 2 * n_prompts // batch


# ------------------------------------------------------------------------------------------- eval.at_start


@pytest.mark.slow  # a 1-step run with its evaluation
def test_at_start_false_skips_the_step_zero_evaluation(tmp_path):
    cfg = load_config(TINY, SMALL + [f"run.output_dir={tmp_path}", "train.steps=1", "eval.enabled=true",
                                     _prompts(2), "eval.at_start=false"])
    trainer = Trainer(cfg)
    trainer.fit()
    assert sorted(trainer.evals) == [1]
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["step_00000001"]


# ------------------------------------------------------------------------------------------- 2 processes

BIN = Path(sys.executable).parent
# 5 images of 1 per prompt in batches of 2: rank 0 samples images 0 1 | 2, rank 1 images 3 4 | 4 (padding);
# one process 0 1 | 2 3 | 4
DIST_EVAL = [_prompts(5), "eval.enabled=true", "eval.num_per_prompt=1", "eval.chunk_size=2", "train.steps=1",
             "run.checkpoint_every=1"]


def _torchrun(script: str, *args: str) -> None:
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), str(BIN / script),
           *args]
    proc = subprocess.run(cmd, env=launcher_env(), capture_output=True, text=True,
                          timeout=RUN_S)  # a hang guard only (tests/hang_guard.py)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def _eval(d: Path) -> dict:
    return json.loads((d / "eval.json").read_text())


def _same_scores(a: dict, b: dict) -> None:
    assert [p["prompt"] for p in a["per_prompt"]] == [p["prompt"] for p in b["per_prompt"]]
    for pa, pb in zip(a["per_prompt"], b["per_prompt"]):
        assert pa["scores"] == pytest.approx(pb["scores"], abs=1e-6), (pa, pb)
    # "base" / "diversity_ratio": a run's comparison with its own step-0 evaluation, which jagg-eval does not have
    skip = ("per_prompt", "reward_mean", "reward_std", "base", "diversity_ratio")
    assert {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}
    assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-6)


@pytest.mark.dist
@pytest.mark.slow
def test_two_process_eval_matches_one_process_and_jagg_eval_reproduces_it(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    trainer = Trainer(load_config(TINY, SMALL + DIST_EVAL + [f"run.output_dir={one}"]))
    try:
        trainer.fit()
    finally:
        trainer.close()
    _torchrun("jagg-train", TINY, *SMALL, *DIST_EVAL, "parallel.engine=fsdp2", f"run.output_dir={two}")
    step0 = "eval/step_00000000"
    # before training the weights are the same: the same score for every image, the same grid
    _same_scores(_eval(two / step0), _eval(one / step0))
    grid_one = np.asarray(Image.open(one / step0 / "grid.png"), dtype=np.int16)
    grid_two = np.asarray(Image.open(two / step0 / "grid.png"), dtype=np.int16)
    assert grid_one.shape == grid_two.shape and np.abs(grid_one - grid_two).max() <= 1
    assert _eval(two / "eval/step_00000001")["num_images"] == 5
    # jagg-eval under torchrun on the 2-process run's (DCP) checkpoint: each rank its share of the images, rank 0
    # writes what the run's own evaluation after step 1 measured
    _torchrun("jagg-eval", TINY, *SMALL, *DIST_EVAL, "--checkpoint", str(two), "--output", str(tmp_path / "re"))
    _same_scores(_eval(tmp_path / "re"), _eval(two / "eval/step_00000001"))
