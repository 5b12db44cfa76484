"""configs/sd35m_dppo_pickscore.yaml, UniRL's Flow-DPPO SD3.5 recipe: its values against UniRL's, and a step of it on
the tiny SD3 pipeline (the other production configs: tests/train/test_production_configs.py; its fit on 8 x 80 GB:
tests/estimate/test_memory.py)."""

from pathlib import Path

import pytest
import torch

from extras import need
from jagg_scale.train import Trainer, load_config

need("diffusers")

ROOT = Path(__file__).resolve().parents[2]


def _paths(name, pipe_dir, tmp_path):
    """The model and prompt paths pointed at the tiny pipeline and a prompt file (the recipe's own are not here)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red apple\na dog\na blue car\na cat\n")
    return [f"model.pretrained={pipe_dir}", f"data.prompt_file={prompts}", f"eval.prompt_file={prompts}",
            f"run.output_dir={tmp_path / 'run'}", "model.lora.expect_modules=null"]


# UniRL's Flow-DPPO SD3.5 recipe, value for value (Tencent-Hunyuan/UniRL 1a7b501, examples/diffusion/sd3_flowdppo.yaml)
UNIRL_DPPO = dict(
    num_devices=8, batch_size=48, num_rollouts=10000, adv_use_global_std=True,  # l. 19-21, 27
    model_precision="bf16", activation_checkpointing=False, learning_rate=3e-4, betas=(0.9, 0.999),  # l. 34, 60, 64-66
    adam_epsilon=1e-8, weight_decay=0.0, lora_rank=32, lora_alpha=64,  # l. 67-68, 76-77
    kl_mask_threshold=1e-5, add_kl_coefficient=True,  # l. 116-117
    micro_batch_size=8, max_grad_norm=1.0, num_updates_per_batch=2, seed=42,  # l. 121-123, 131
    num_inference_steps=10, guidance_scale=1.0, height=512, eta=0.7, samples_per_prompt=16,  # l. 137-142
    init_same_noise=False, timestep_fraction=(0.0, 0.5), num_sde_steps=3,  # l. 144, 151-152
)


def test_the_dppo_recipe_is_unirls_value_for_value(sd3_dir, tmp_path):
    """Each value of UniRL's recipe against the config as the trainer reads it, and what the trainer makes of it: 3 of
    the first 5 steps drawn per step (every 3-subset of them, as its rng.choice(pool, 3, replace=False) draws), one
    JAGG window over them, two disjoint optimizer steps per rollout, and UniRL's per-step training as the one
    override `jagg=null jagg.mode=exact`."""
    from itertools import combinations

    from jagg_scale.jagg import ExactPlanner, WindowPlanner
    from jagg_scale.train.dppo import DPPO
    from jagg_scale.train.rows import StepRows

    p = UNIRL_DPPO
    name = "sd35m_dppo_pickscore"
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", _paths(name, sd3_dir, tmp_path))
    s, g, t, d = cfg.sampling, cfg.grpo, cfg.train, cfg.dppo
    assert t.algorithm == "dppo" and (d.kl_mask_threshold, d.add_kl_coefficient) == (p["kl_mask_threshold"],
                                                                                     p["add_kl_coefficient"])
    assert (s.num_steps, s.guidance, cfg.model.resolution, s.noise_level) == (
        p["num_inference_steps"], p["guidance_scale"], p["height"], p["eta"])
    assert s.sde == "flow_grpo" and s.same_initial_noise == p["init_same_noise"]
    assert (g.group_size, g.global_std, g.kl_beta) == (p["samples_per_prompt"], p["adv_use_global_std"], 0.0)
    assert (t.prompts_per_step, t.steps) == (p["batch_size"], p["num_rollouts"])
    assert t.minibatch_size == p["batch_size"] * p["samples_per_prompt"] // p["num_updates_per_batch"]
    assert (t.lr, t.adam_betas, t.adam_eps, t.weight_decay, t.grad_clip) == (
        p["learning_rate"], p["betas"], p["adam_epsilon"], p["weight_decay"], p["max_grad_norm"])
    assert t.micro_batch_size == p["micro_batch_size"] and t.ema_decay == 0.0  # no EMA (l. 14-16)
    assert cfg.parallel.activation_checkpointing == p["activation_checkpointing"]
    assert cfg.model.dtype == "bfloat16" and p["model_precision"] == "bf16" and cfg.run.seed == p["seed"]
    assert (cfg.model.lora.rank, cfg.model.lora.alpha) == (p["lora_rank"], p["lora_alpha"])
    assert cfg.reward.name == "pickscore" and cfg.reward.options["normalize"]  # / 26 (pickscore.py:92)
    rows = StepRows.draw(t.prompts_per_step * g.group_size, t.minibatch_size, cfg.run.seed, 0, 0, p["num_devices"])
    assert rows.num_minibatches == p["num_updates_per_batch"] and rows.local_batch == 48
    unit = DPPO.__new__(DPPO)
    unit.cfg = cfg
    lo, hi = (int(f * p["num_inference_steps"]) for f in p["timestep_fraction"])  # scheduler_utils.py:99-100
    drawn = {tuple(unit.trained_steps_at(step)) for step in range(400)}
    assert drawn == set(combinations(range(lo, hi), p["num_sde_steps"]))
    planner = cfg.jagg.make_planner()
    plan = planner.plan(torch.randn(3, 2, 4), torch.tensor([1.0, 0.8, 0.6]), grad_norms=lambda: [1.0] * 3)
    assert isinstance(planner, WindowPlanner) and plan.windows == [[0, 1, 2]] and plan.jagg_windows == 1
    exact = load_config(ROOT / "configs" / f"{name}.yaml", _paths(name, sd3_dir, tmp_path) + ["jagg=null",
                                                                                             "jagg.mode=exact"])
    assert exact.jagg.make_planner() == ExactPlanner()
    assert (exact.grpo, exact.sampling, exact.train, exact.dppo) == (g, s, t, d)  # nothing else moves


@pytest.mark.slow
def test_the_dppo_recipe_trains_a_step_on_the_tiny_pipeline(sd3_dir, tmp_path):
    """One step of the recipe as shipped (FSDP2, one process, no activation checkpointing) on the tiny SD3 pipeline:
    its 3 drawn steps trained in one JAGG window (2 backwards per minibatch), two optimizer steps, on-policy first."""
    name = "sd35m_dppo_pickscore"
    shrink = ["model.resolution=null", "grpo.group_size=4", "train.prompts_per_step=2", "train.minibatch_size=4",
              "train.micro_batch_size=2", "train.steps=1", "eval.enabled=false", "log.wandb=false",
              "log.progress=false", "reward.name=jpeg_compressibility", "reward.options={}", "run.resume=none",
              "model.lora.expect_modules=null"]
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", _paths(name, sd3_dir, tmp_path) + shrink)
    trainer = Trainer(cfg)
    try:
        drawn = list(trainer.algorithm.rollout_spec(0).trained)
        (row,) = trainer.fit()
    finally:
        trainer.close()
    assert len(drawn) == 3 and set(drawn) <= set(range(5))
    assert row["optimizer_steps"] == 2 and row["backward_passes"] == 2 * 2 and row["per_step_equiv"] == 3 * 2
    assert row["onpolicy_log_ratio"] < 1e-3 and 0 <= row["masked_fraction"] <= 1
