"""The production configs (SD3.5-medium / -large with PickScore / GenEval / OCR, FLUX.1-dev with HPS, Qwen-Image,
Flow-Factory's FLUX.2 [klein], Z-Image and FLUX.1-Kontext recipes, UniRL's Flow-DPPO recipe: its own tests in
tests/dppo/test_dppo_recipe.py).

Their weights cannot live on a CI machine, so each config is checked in two ways: (1) it validates once model and
prompt paths point at something real, and what its header says it does is what the code makes of it (the planner's
windows, the optimizer steps per rollout, the trained part, reward options the registered reward accepts); (2) the
same config, with only sizes shrunk and the model swapped for the tiny offline pipeline of the same family, runs a
training step end to end - so the combination it asks for (LoRA + KL reference, bf16 autocast, activation
checkpointing, pipeline schedule, JAGG routing) is exercised, not just parsed. Whether each fits 8 x 80 GB:
tests/estimate/test_memory.py.
"""

from pathlib import Path

import pytest
import torch

from hang_guard import RUN_S
from jagg_scale.jagg import trained_steps
from jagg_scale.rewards import available
from jagg_scale.rewards.base import _REGISTRY, _check_options
from jagg_scale.train import ConfigError, Trainer, load_config
from recipe_paths import recipe_paths
from stand_ins import stand_in_paths
from extras import need

need("diffusers")

ROOT = Path(__file__).resolve().parents[2]
SD35 = ["sd35m_pickscore", "sd35m_geneval", "sd35m_ocr", "sd35l_pickscore", "sd35m_unifiedreward"]
ALL = SD35 + ["flux1_dev_hps"]
NOCFG = ["sd35m_pickscore_nocfg", "sd35m_geneval_nocfg"]  # Flow-GRPO-Fast's CFG-free recipes (below)
GCPO = ["sd35m_gcpo_pickscore"]  # GCPO's chunk-level recipe (below)


def _paths(name, pipe_dir, tmp_path):
    return recipe_paths(pipe_dir, tmp_path)


@pytest.fixture
def pipe_dirs(sd3_dir, flux_dir):
    return {"sd3": sd3_dir, "flux": flux_dir}


@pytest.mark.parametrize("name", ALL + NOCFG + GCPO + ["sd35m_dppo_pickscore", "sd35m_awm_pickscore"])
def test_a_missing_model_directory_fails_early_naming_the_key(name):
    with pytest.raises(ConfigError, match="model.pretrained|data.prompt_file"):
        load_config(ROOT / "configs" / f"{name}.yaml")


@pytest.mark.parametrize("name", ALL)
def test_what_each_config_asks_the_trainer_for(name, pipe_dirs, tmp_path):
    """What the header says the config does, read through the code that does it (not the YAML values restated): the
    planner and the windows it makes of the trained steps, the optimizer steps per rollout, bf16 compute, the
    trained part (LoRA on the library's targets for SD3.5, the whole transformer for FLUX), and reward options the
    registered reward accepts."""
    from jagg_scale.jagg import WindowPlanner
    from jagg_scale.train.rows import StepRows

    kind = "flux" if name.startswith("flux") else "sd3"
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", _paths(name, pipe_dirs[kind], tmp_path))
    planner = cfg.jagg.make_planner()
    assert isinstance(planner, WindowPlanner) and planner.window == 4 and 0 < planner.jagg_frac <= 1
    # "9 trained steps -> windows [0-3] [4-7] [8]", each 4-step window a joint pass when routed
    T = len(trained_steps(cfg.sampling.num_steps, cfg.grpo.timestep_fraction))
    plan = planner.plan(torch.randn(T, 2, 4), torch.linspace(1.0, 0.1, T), grad_norms=lambda: [1.0] * T)
    assert plan.windows == [[0, 1, 2, 3], [4, 5, 6, 7], [8]] and plan.jagg_windows == round(3 * planner.jagg_frac)
    rows = StepRows.draw(cfg.train.prompts_per_step * cfg.grpo.group_size, cfg.train.minibatch_size, cfg.run.seed,
                         0, 0, 8)
    assert rows.num_minibatches == 2  # two optimizer steps per rollout
    assert rows.local_batch == (72 if kind == "sd3" else 12)  # "a rank's minibatch share on 8 GPUs", as the header says
    # Flow-GRPO trains SD3.5 in fp16 (config/base.py:21), DanceGRPO FLUX in bf16
    assert cfg.model.dtype == ("float16" if kind == "sd3" else "bfloat16") and cfg.parallel.activation_checkpointing
    assert cfg.model.lora.enabled == (kind == "sd3") and not cfg.model.lora.targets  # the library's targets
    assert cfg.reward.name in available()
    _check_options(cfg.reward.name, _REGISTRY[cfg.reward.name], cfg.reward.options)


@pytest.mark.parametrize("name", ALL)
def test_the_recipe_trains_a_step_on_the_tiny_pipeline(name, pipe_dirs, tmp_path):
    kind = "flux" if name.startswith("flux") else "sd3"
    shrink = ["model.resolution=null", "grpo.group_size=4", "train.prompts_per_step=2",
              "train.minibatch_size=4", "train.steps=1", "eval.enabled=false", "log.wandb=false", "log.progress=false",
              "reward.name=jpeg_compressibility", "reward.options={}", "run.resume=none",
              "model.lora.expect_modules=null"]  # the recipe's count is its real model's, not the tiny pipeline's
    # flux runs its production backend, FSDP2 (one process here): the sharded path on a real diffusers model
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", _paths(name, pipe_dirs[kind], tmp_path) + shrink)
    trainer = Trainer(cfg)
    try:
        # as shipped (auto); off a GPU half of the rank's 8 rows: two chunks
        assert trainer.policy.rollout_batch == (4 if cfg.sampling.chunk_size == "auto" else cfg.sampling.chunk_size)
        rows = trainer.fit()
        trained = trainer.engine.full_state_dict()
    finally:
        trainer.close()  # FSDP2 in one process starts a trivial process group: leave none behind
    assert len(rows) == 1
    r = rows[0]
    minibatches = cfg.train.prompts_per_step * cfg.grpo.group_size // cfg.train.minibatch_size
    big_jagg = 2 if cfg.jagg.jagg_frac == 1.0 else 1  # of the two 4-step windows; the 1-step window is exact anyway
    # per minibatch: 2 passes per JAGG window, 4 per exact 4-step window, 1 for the 1-step window
    assert r["backward_passes"] == (2 * big_jagg + 4 * (2 - big_jagg) + 1) * minibatches
    assert r["per_step_equiv"] == 9 * minibatches
    assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-3)  # on-policy: recomputed log-probs equal the rollout's
    export = tmp_path / "run" / ("lora" if cfg.model.lora.enabled else "transformer")
    assert any(export.glob("*.safetensors"))  # LoRA file, or the full transformer gathered from FSDP2 shards
    if kind == "flux":
        from diffusers import FluxTransformer2DModel

        loaded = FluxTransformer2DModel.from_pretrained(export, local_files_only=True)
        for name, p in loaded.state_dict().items():
            assert torch.equal(p, trained["transformer." + name]), name


@pytest.mark.dist  # a DeepSpeed ZeRO-3 jagg-train process
@pytest.mark.slow
def test_deepspeed_lora_run_exports_a_diffusers_lora(sd3_dir, tmp_path):
    """ZeRO-3 holds only partitions: the LoRA export is consolidated on rank 0 and must load into a plain
    StableDiffusion3Pipeline like a single-process one."""
    need("deepspeed")
    import subprocess
    import sys

    from diffusers import StableDiffusion3Pipeline
    from safetensors.torch import load_file

    out = tmp_path / "ds"
    cmd = [str(Path(sys.executable).parent / "jagg-train"), str(ROOT / "configs" / "sd3_tiny_cpu.yaml"),
           f"model.pretrained={sd3_dir}", "model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8",
           "parallel.engine=deepspeed", "train.steps=1", f"run.output_dir={out}", "log.progress=false",
           "train.lr=1e-2"]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=RUN_S)  # a hang guard only: includes DeepSpeed's first-use compile, if first
    assert proc.returncode == 0, proc.stderr[-4000:]
    lora = load_file(str(out / "lora" / "pytorch_lora_weights.safetensors"))
    assert lora and all(k.startswith("transformer.") and ("lora_A" in k or "lora_B" in k) for k in lora)
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in lora.items())  # trained (B starts at zero)
    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_dir, local_files_only=True)
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    pipe.load_lora_weights(str(out / "lora"))
    assert any("lora" in k for k in pipe.transformer.state_dict()) and len(pipe.transformer.state_dict()) > len(before)


# ------------------------------------------------------------------ as shipped, under a launcher's environment


def _torchrun_env(monkeypatch, world: int, local: int = 8) -> None:
    """What torchrun exports to worker 0 of `world` (`local` per node)."""
    for k, v in dict(RANK=0, LOCAL_RANK=0, WORLD_SIZE=world, LOCAL_WORLD_SIZE=local, GROUP_RANK=0,
                     MASTER_ADDR="node01", MASTER_PORT=29500).items():
        monkeypatch.setenv(k, str(v))


@pytest.mark.parametrize("name", ALL + NOCFG + GCPO)
@pytest.mark.parametrize("nodes", [1, 4])
def test_validates_as_shipped_under_torchrun(name, nodes, tmp_path, monkeypatch):
    """Each production config runs under torchrun with no parallel override: FSDP2 with activation checkpointing,
    on one node of 8 GPUs and on 4 (HSDP, parallel.replicate = nodes, what slurm/jagg.sbatch sets for LoRA)."""
    from jagg_scale.parallel.ranks import discover
    from jagg_scale.train.config import validate_world

    _torchrun_env(monkeypatch, 8 * nodes)
    hsdp = [f"parallel.replicate={nodes}"] if nodes > 1 else []
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", stand_in_paths(tmp_path) + hsdp)
    assert cfg.parallel.engine == "fsdp2" and cfg.parallel.activation_checkpointing
    assert not cfg.parallel.compile and cfg.parallel.collective_timeout_s > 0
    validate_world(cfg, discover().world_size)


@pytest.mark.parametrize("override,key", [
    ("parallel.engine=none", "parallel.engine"),
    ("parallel.replicate=3", "parallel.replicate"),  # 8 ranks are not 3 replicas
    ("train.minibatch_size=12", "train.minibatch_size"),  # 12 rows do not split over 8 ranks
    ("jagg.probe_every=5", "jagg.probe_every"),
])
def test_jagg_train_refuses_a_config_that_cannot_run_on_the_launched_ranks(override, key, tmp_path, monkeypatch,
                                                                          capsys):
    """Before any model is loaded (the stand-in pipeline directory holds no model): exit 2, naming the key."""
    import jagg_scale.train
    from jagg_scale.cli import train_main

    def no_trainer(cfg):
        raise AssertionError("jagg-train built a Trainer (and would load the models) before refusing the config")

    monkeypatch.setattr(jagg_scale.train, "Trainer", no_trainer)
    _torchrun_env(monkeypatch, 8)
    argv = [str(ROOT / "configs" / "sd35m_pickscore.yaml"), *stand_in_paths(tmp_path), override]
    assert train_main(argv) == 2
    assert f"config key '{key}'" in capsys.readouterr().err


@pytest.mark.slow
def test_the_nft_recipe_trains_a_step_on_the_tiny_pipeline(sd3_dir, tmp_path):
    """configs/sd35m_nft_pickscore.yaml (DiffusionNFT's recipe) end to end on the tiny SD3 pipeline: the old policy's
    dpm2 ODE rollout, 9 of its 10 timesteps trained per sample, one backward each (mode exact), LoRA exported."""
    shrink = ["model.resolution=null", "grpo.group_size=4", "train.prompts_per_step=2",
              "train.minibatch_size=8", "train.micro_batch_size=4", "train.steps=1", "eval.enabled=false",
              "log.wandb=false", "log.progress=false", "reward.name=jpeg_compressibility", "reward.options={}",
              "run.resume=none"]
    cfg = load_config(ROOT / "configs" / "sd35m_nft_pickscore.yaml", _paths("nft", sd3_dir, tmp_path) + shrink)
    assert cfg.train.algorithm == "nft" and cfg.jagg.make_planner().name == "exact"
    assert cfg.sampling.ode_solver == "dpm2"
    trainer = Trainer(cfg)
    try:
        (row,) = trainer.fit()
    finally:
        trainer.close()
    assert row["per_step_equiv"] == row["backward_passes"] == 9  # int(10 x 0.99) timesteps, one backward each
    assert row["optimizer_steps"] == 1 and row["old_decay"] == pytest.approx(0.001)
    assert (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").exists()


@pytest.mark.slow
def test_the_awm_recipe_trains_a_step_on_the_tiny_pipeline(sd3_dir, tmp_path):
    """configs/sd35m_awm_pickscore.yaml (Flow-Factory's AWM recipe, JAGG-AWM) end to end on the tiny SD3 pipeline
    with its 14-step schedule: 6 timesteps per sample strictly inside the schedule's steps 1 .. 12, in windows of 3
    with a noise draw each, 4 backwards instead of 6, the EMA policy an adapter's worth, the LoRA exported."""
    from jagg_scale.train.awm import EMA_SHADOW

    shrink = ["model.resolution=null", "grpo.group_size=4", "train.prompts_per_step=2", "train.minibatch_size=8",
              "train.micro_batch_size=4", "train.steps=1", "eval.enabled=false", "log.wandb=false",
              "log.progress=false", "reward.name=jpeg_compressibility", "reward.options={}", "run.resume=none"]
    cfg = load_config(ROOT / "configs" / "sd35m_awm_pickscore.yaml", _paths("awm", sd3_dir, tmp_path) + shrink)
    assert cfg.train.algorithm == "awm" and cfg.jagg.make_planner().window == 3 and cfg.trained_per_sample == 6
    trainer = Trainer(cfg)
    try:
        unit = trainer.algorithm
        t = unit._timesteps(0, 0, torch.arange(8), torch.arange(8))
        assert (t[:-1] > t[1:]).all() and (t < unit.sigmas[0]).all() and (t > unit.sigmas[-1]).all()
        (row,) = trainer.fit()
        assert all("lora_" in n for n in trainer.engine.shadows[EMA_SHADOW])
    finally:
        trainer.close()
    assert row["per_step_equiv"] == 6 and row["backward_passes"] == 4 and row["ema_policy_decay"] == 0.0
    assert row["optimizer_steps"] == 1 and row["kl"] >= 0 and row["ema_kl"] >= 0
    assert (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").exists()


@pytest.mark.slow
def test_the_qwenimage_recipe_trains_a_step_on_the_tiny_pipeline(qwenimage_dir, tmp_path):
    """configs/qwenimage_hps.yaml (eff_grpo's Qwen-Image JAGG recipe) as its header says, then one step end to end on
    the tiny Qwen-Image pipeline on its production backend (FSDP2, one process): 12 trained steps in windows of 4, a
    full fine-tune whose export is a QwenImageTransformer2DModel equal to the trained weights."""
    from diffusers import QwenImageTransformer2DModel

    from jagg_scale.jagg import WindowPlanner

    name = "qwenimage_hps"
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", _paths(name, qwenimage_dir, tmp_path))
    planner = cfg.jagg.make_planner()
    T = len(trained_steps(cfg.sampling.num_steps, cfg.grpo.timestep_fraction))
    plan = planner.plan(torch.randn(T, 2, 4), torch.linspace(1.0, 0.1, T), grad_norms=lambda: [1.0] * T)
    assert isinstance(planner, WindowPlanner) and plan.windows == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert cfg.sampling.guidance == 1.0 and cfg.grpo.kl_beta == 0 and not cfg.model.lora.enabled
    assert cfg.model.shard_text_encoder and cfg.parallel.engine == "fsdp2" and cfg.reward.name == "hps"
    shrink = ["model.resolution=32", "model.max_sequence_length=64", "model.shard_text_encoder=false",
              "grpo.group_size=4",
              "train.prompts_per_step=2", "train.minibatch_size=4", "train.steps=1", "eval.enabled=false",
              "log.wandb=false", "log.progress=false", "reward.name=jpeg_compressibility", "reward.options={}",
              "run.resume=none"]
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", _paths(name, qwenimage_dir, tmp_path) + shrink)
    trainer = Trainer(cfg)
    try:
        (row,) = trainer.fit()
        trained = trainer.engine.full_state_dict()
    finally:
        trainer.close()
    minibatches = cfg.train.prompts_per_step * cfg.grpo.group_size // cfg.train.minibatch_size
    assert row["backward_passes"] == 2 * 3 * minibatches and row["per_step_equiv"] == 12 * minibatches
    assert row["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    loaded = QwenImageTransformer2DModel.from_pretrained(tmp_path / "run" / "transformer", local_files_only=True)
    for key, p in loaded.state_dict().items():
        assert torch.equal(p, trained["transformer." + key]), key


# the Flow-Factory recipes (FLUX.2 [klein], Z-Image, FLUX.1-Kontext, Qwen-Image-Edit): the tiny pipeline of each
# family, its size, and whether its prompts are an edit set (the committed tiny edit set, each instruction with its
# input image)
FLOW_FACTORY = {"flux2_klein_pickscore": ("flux2_dir", 32, False), "zimage_pickscore": ("zimage_dir", 16, False),
                "flux1_kontext_pickscore": ("flux_kontext_dir", 16, True),
                "qwenimage_edit_pickscore": ("qwenimage_edit_dir", 16, True)}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FLOW_FACTORY))
def test_the_flow_factory_recipes_train_a_step_on_the_tiny_pipelines(name, request, tmp_path):
    """Each as its header says - its SDE steps 1-3 trained as one JAGG window of 3 (2 backwards instead of 3), two
    optimizer steps per rollout, on its production backend (FSDP2, one process) - then one step end to end on the
    family's tiny pipeline: on-policy ratio 1, and the export (a full transformer or a LoRA) written."""
    from jagg_scale.jagg import WindowPlanner
    from jagg_scale.train.rows import StepRows

    fixture, resolution, edits = FLOW_FACTORY[name]
    pipe = request.getfixturevalue(fixture)
    paths = _paths(name, pipe, tmp_path)
    if edits:
        prompts = ROOT / "data" / "edits" / "tiny" / "edits.jsonl"
        paths += [f"data.prompt_file={prompts}", f"eval.prompt_file={prompts}"]
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", paths)
    planner = cfg.jagg.make_planner()
    assert isinstance(planner, WindowPlanner) and planner.window == 3 and planner.jagg_frac == 1.0
    assert (cfg.grpo.sde_window, cfg.grpo.sde_window_range) == (3, [1, 4])
    rows = StepRows.draw(cfg.train.prompts_per_step * cfg.grpo.group_size, cfg.train.minibatch_size, cfg.run.seed,
                         0, 0, 8)
    assert rows.num_minibatches == 2 and cfg.parallel.engine == "fsdp2" and cfg.model.dtype == "bfloat16"
    shrink = [f"model.resolution={resolution}", "model.max_sequence_length=64", "grpo.group_size=4",
              "train.prompts_per_step=2", "train.minibatch_size=4", "train.micro_batch_size=4", "train.steps=1",
              "eval.enabled=false", "log.wandb=false", "log.progress=false", "reward.name=jpeg_compressibility",
              "reward.options={}", "run.resume=none"]
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", paths + shrink)
    trainer = Trainer(cfg)
    try:
        assert list(trainer.algorithm.rollout_spec(0).trained) == [1, 2, 3]
        (row,) = trainer.fit()
    finally:
        trainer.close()
    minibatches = cfg.train.prompts_per_step * cfg.grpo.group_size // cfg.train.minibatch_size
    assert row["backward_passes"] == 2 * minibatches and row["per_step_equiv"] == 3 * minibatches
    assert row["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    export = tmp_path / "run" / ("lora" if cfg.model.lora.enabled else "transformer")
    assert any(export.glob("*.safetensors"))


# Flow-GRPO's CFG-free Flow-GRPO-Fast recipes, value for value (yifan123/flow_grpo 9745241): config/grpo.py
# `pickscore_sd3_fast_nocfg` (l. 323-363) and `geneval_sd3_fast_nocfg` (l. 163-203), their base config/base.py, the
# script scripts/train_sd3_fast.py that runs them and its pipeline. The recipe-specific values, then the shared ones.
FLOW_GRPO_NOCFG = {
    "sd35m_pickscore_nocfg": dict(num_image_per_prompt=18, batches_over=64, test_batch_size=16, reward="pickscore"),
    "sd35m_geneval_nocfg": dict(num_image_per_prompt=24, batches_over=48, test_batch_size=14, reward="remote"),
}
FLOW_GRPO_FAST = dict(
    gpu_number=32, train_batch_size=9,  # grpo.py:324, 337 (164, 177): rows per GPU per rollout batch
    num_steps=10, eval_num_steps=40, guidance_scale=1.0, eval_guidance_scale=1.0, cfg=False,  # :330-334 (:170-174)
    resolution=512, clip_range=1e-5, beta=0.0, global_std=True, noise_level=0.8,  # :336, 345-348 (:176, 185-188)
    sde_window_size=3, sde_type="cps", ema=True, save_freq=60, eval_freq=60,  # :349-354 (:189-194)
    seed=42, mixed_precision="fp16", learning_rate=3e-4, adam_weight_decay=1e-4,  # base.py:14, 24, 76, 82
    max_grad_norm=1.0, adv_clip_max=5.0,  # base.py:89, 97
    lora_r=32, lora_alpha=64, ema_decay=0.9, ema_interval=8, max_sequence_length=128,  # train_sd3_fast.py:436-437,
)                                                                                      # 451, 631


def _flow_grpo_fast(name: str) -> dict:
    """The peer's recipe with its derived values computed as its config computes them."""
    p = {**FLOW_GRPO_FAST, **FLOW_GRPO_NOCFG[name]}
    per_batch = p["gpu_number"] * p["train_batch_size"]  # rows of one rollout batch over all GPUs
    p["num_batches_per_epoch"] = int(p["batches_over"] / (per_batch / p["num_image_per_prompt"]))  # grpo.py:339
    p["gradient_accumulation_steps"] = p["num_batches_per_epoch"] // 2  # grpo.py:343 (183)
    p["prompts_per_epoch"] = per_batch * p["num_batches_per_epoch"] // p["num_image_per_prompt"]
    p["rows_per_optimizer_step"] = per_batch * p["gradient_accumulation_steps"]  # train.batch_size = 9 (l. 342)
    p["sde_window_range"] = [0, p["num_steps"] // 2]  # grpo.py:350 (190)
    return p


@pytest.mark.parametrize("name", NOCFG)
def test_the_nocfg_recipes_are_flow_grpos_value_for_value(name, sd3_dir, tmp_path):
    """Each value of Flow-GRPO's recipe against the config as the trainer reads it, and what the trainer makes of
    it: the window's starts (the peer's random.randint(0, 5 - 3), sd3_pipeline_with_logprob_fast.py:137), its 3
    steps one JAGG window, and Flow-GRPO's per-step training as the one override `jagg=null jagg.mode=exact`."""
    from jagg_scale.jagg import ExactPlanner, WindowPlanner
    from jagg_scale.train.rows import StepRows
    from jagg_scale.train.update import GRPO

    p = _flow_grpo_fast(name)
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", _paths(name, sd3_dir, tmp_path))
    s, g, t = cfg.sampling, cfg.grpo, cfg.train
    assert (s.num_steps, s.eval_num_steps, cfg.model.resolution) == (p["num_steps"], p["eval_num_steps"],
                                                                     p["resolution"])
    # guidance 1 in the rollout, in training (cfg False: no unconditional rows) and in evaluation, which samples
    # with sampling.guidance (train/evaluate.py through policy.velocity_fn)
    assert s.guidance == p["guidance_scale"] == p["eval_guidance_scale"] and not p["cfg"]
    assert (s.sde, s.noise_level) == (p["sde_type"], p["noise_level"])
    assert (g.sde_window, g.sde_window_range, g.sde_window_mode) == (p["sde_window_size"], p["sde_window_range"],
                                                                     "random")
    assert (g.group_size, g.clip_range, g.kl_beta, g.global_std, g.adv_clip_max) == (
        p["num_image_per_prompt"], p["clip_range"], p["beta"], p["global_std"], p["adv_clip_max"])
    assert t.prompts_per_step == p["prompts_per_epoch"] and t.minibatch_size == p["rows_per_optimizer_step"]
    assert (t.lr, t.weight_decay, t.grad_clip) == (p["learning_rate"], p["adam_weight_decay"], p["max_grad_norm"])
    assert p["ema"] and (t.ema_decay, t.ema_every, t.ema_warmup) == (p["ema_decay"], p["ema_interval"], True)
    # its EMA steps once per batch, gradient_accumulation_steps batches per optimizer step (train_sd3_fast.py:959-960)
    assert t.ema_repeat == p["gradient_accumulation_steps"]
    assert (cfg.eval.every, cfg.run.checkpoint_every) == (p["eval_freq"], p["save_freq"])
    assert (cfg.eval.chunk_size, cfg.run.seed) == (p["test_batch_size"], p["seed"])
    assert cfg.model.dtype == "float16" and p["mixed_precision"] == "fp16"
    assert cfg.model.max_sequence_length == p["max_sequence_length"]
    assert (cfg.model.lora.rank, cfg.model.lora.alpha) == (p["lora_r"], p["lora_alpha"])
    assert cfg.reward.name == p["reward"]
    rows = StepRows.draw(t.prompts_per_step * g.group_size, t.minibatch_size, cfg.run.seed, 0, 0, 8)
    assert rows.num_minibatches == p["num_batches_per_epoch"] // p["gradient_accumulation_steps"] == 2
    # the window: starts 0, 1, 2 as the peer's; its 3 steps are the trained ones and one JAGG window
    unit = GRPO.__new__(GRPO)
    unit.cfg = cfg
    starts = {unit.trained_steps_at(step)[0] for step in range(100)}
    assert starts == set(range(p["sde_window_range"][0], p["sde_window_range"][1] - p["sde_window_size"] + 1))
    planner = cfg.jagg.make_planner()
    plan = planner.plan(torch.randn(3, 2, 4), torch.linspace(1.0, 0.5, 3), grad_norms=lambda: [1.0] * 3)
    assert isinstance(planner, WindowPlanner) and plan.windows == [[0, 1, 2]] and plan.jagg_windows == 1
    exact = load_config(ROOT / "configs" / f"{name}.yaml", _paths(name, sd3_dir, tmp_path) + ["jagg=null",
                                                                                             "jagg.mode=exact"])
    assert exact.jagg.make_planner() == ExactPlanner()
    assert (exact.grpo, exact.sampling, exact.train) == (g, s, t)  # nothing else moves


@pytest.mark.slow
@pytest.mark.parametrize("name", NOCFG)
def test_the_nocfg_recipes_train_a_step_on_the_tiny_pipeline(name, sd3_dir, tmp_path):
    """One step end to end on the tiny SD3 pipeline as shipped (FSDP2, one process) and with the per-step override:
    the window's 3 CPS steps trained, 2 backwards per minibatch with JAGG, 3 per-step; on-policy ratio 1."""
    shrink = ["model.resolution=null", "grpo.group_size=4", "train.prompts_per_step=2", "train.minibatch_size=4",
              "train.micro_batch_size=4", "train.steps=1", "eval.enabled=false", "log.wandb=false",
              "log.progress=false", "reward.name=jpeg_compressibility", "reward.options={}", "run.resume=none",
              "model.lora.expect_modules=null"]
    for extra, backwards in (([], 2), (["jagg=null", "jagg.mode=exact"], 3)):
        out = tmp_path / str(backwards)
        out.mkdir()
        cfg = load_config(ROOT / "configs" / f"{name}.yaml",
                          _paths(name, sd3_dir, out) + shrink + [f"run.output_dir={out / 'run'}"] + extra)
        trainer = Trainer(cfg)
        try:
            window = list(trainer.algorithm.rollout_spec(0).trained)
            (row,) = trainer.fit()
        finally:
            trainer.close()
        assert len(window) == 3 and window[0] in (0, 1, 2) and window == list(range(window[0], window[0] + 3))
        minibatches = cfg.train.prompts_per_step * cfg.grpo.group_size // cfg.train.minibatch_size
        assert row["backward_passes"] == backwards * minibatches and row["per_step_equiv"] == 3 * minibatches
        assert row["sde_window_start"] == window[0]
        assert row["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
        assert (out / "run" / "lora" / "pytorch_lora_weights.safetensors").exists()


# GCPO's published PickScore recipe (xingzhejun/GCPO ea6cc4d scripts/finetune/finetune_pickscore_chunk.sh), the values
# configs/sd35m_gcpo_pickscore.yaml takes from it, with their lines; the last three are train_grpo_flux_pickscore.py's
# defaults the script leaves alone (--kl_coeff 0, --use_global_std and --use_ema off)
GCPO_PICKSCORE = dict(
    sampling_steps=17, new_chunk_list=[2, 3, 4, 7], timestep_fraction=0.5,  # :26, :44-46, :36
    clip_range=5e-5, right_clip_range=5e-5, adv_clip_max=5.0, eta=0.7,  # :39, :42, :40, :27
    num_generations=12, train_batch_size=2, gpus=8, gradient_accumulation_steps=12,  # :33, :11, :5, :16
    max_train_steps=151, checkpointing_steps=30, init_same_noise=True,  # :17, :20, :38
    kl_coeff=0.0, use_global_std=False, use_ema=False)


def test_the_gcpo_recipe_is_gcpos_value_for_value(sd3_dir, tmp_path):
    """Each value of GCPO's recipe against the config as the trainer reads it, and what the trainer makes of it: the
    chunks over 16 of 17 steps, 2 per sample in slots of 7, one JAGG window per slot, two optimizer steps a rollout of
    12 rows per rank (GCPO's accumulation)."""
    from jagg_scale.gcpo import trained_chunks
    from jagg_scale.jagg import WindowPlanner
    from jagg_scale.train.rows import StepRows

    p = GCPO_PICKSCORE
    cfg = load_config(ROOT / "configs" / "sd35m_gcpo_pickscore.yaml", _paths("gcpo", sd3_dir, tmp_path))
    s, g, t, gc = cfg.sampling, cfg.grpo, cfg.train, cfg.gcpo
    assert t.algorithm == "gcpo" and s.num_steps == p["sampling_steps"] and s.sde == "flow_grpo"
    assert gc.layout(s.num_steps) == p["new_chunk_list"] and sum(p["new_chunk_list"]) == p["sampling_steps"] - 1
    assert trained_chunks(len(p["new_chunk_list"]), gc.chunk_fraction) == int(4 * p["timestep_fraction"]) == 2
    assert g.clip_range == p["clip_range"] == p["right_clip_range"] and g.adv_clip_max == p["adv_clip_max"]
    assert s.noise_level == p["eta"] and s.same_initial_noise == p["init_same_noise"]
    assert g.group_size == p["num_generations"] and t.prompts_per_step == p["train_batch_size"] * p["gpus"]
    assert t.minibatch_size == p["gradient_accumulation_steps"] * p["gpus"]
    assert (t.steps, cfg.run.checkpoint_every) == (p["max_train_steps"], p["checkpointing_steps"])
    assert g.kl_beta == p["kl_coeff"] and not cfg.uses_reference and g.global_std == p["use_global_std"]
    assert (t.ema_decay > 0) == p["use_ema"]
    rows = StepRows.draw(t.prompts_per_step * g.group_size, t.minibatch_size, cfg.run.seed, 0, 0, p["gpus"])
    assert rows.num_minibatches == 2
    planner = cfg.jagg.make_planner()
    K = cfg.trained_per_sample
    plan = planner.plan(torch.randn(K, 2, 4), torch.linspace(1.0, 0.1, K), grad_norms=lambda: [1.0] * K)
    assert isinstance(planner, WindowPlanner) and K == 14
    assert plan.windows == [list(range(7)), list(range(7, 14))] and plan.jagg_windows == 2


@pytest.mark.slow
def test_the_gcpo_recipe_trains_a_step_on_the_tiny_pipeline(sd3_dir, tmp_path):
    """configs/sd35m_gcpo_pickscore.yaml end to end on the tiny SD3 pipeline, sizes shrunk: 17-step SDE rollouts with
    CFG, each row's 2 chunks as 2 joint passes, the second minibatch's factors from fresh forwards of both CFG
    branches at its rows' real chunk steps (5 to 11 of their 14 positions), LoRA exported."""
    shrink = ["model.resolution=null", "grpo.group_size=4", "train.prompts_per_step=2", "train.minibatch_size=4",
              "train.micro_batch_size=2", "train.steps=1", "eval.enabled=false", "log.wandb=false",
              "log.progress=false", "reward.name=jpeg_compressibility", "reward.options={}", "run.resume=none"]
    trainer = Trainer(load_config(ROOT / "configs" / "sd35m_gcpo_pickscore.yaml",
                                  _paths("gcpo", sd3_dir, tmp_path) + shrink))
    try:
        (row,) = trainer.fit()
    finally:
        trainer.close()
    assert row["optimizer_steps"] == 2 and row["backward_passes"] == 2 * 2 * 2 and row["per_step_equiv"] == 14 * 2
    assert 5 * 2 <= row["nograd_forward_passes"] <= 11 * 2 and row["onpolicy_log_ratio"] < 1e-3
    assert (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").exists()
