"""The memory estimator (jagg-estimate, jagg_scale/estimate/) on the shipped production configs, from the committed
shapes and measured coefficients (nothing is measured here): every config fits its cluster (8 GPUs of 80 GB;
Wan2.1-14B 4 nodes of them) with >= 10% headroom as shipped (the command's exit status says so), each phase's
components add up to its total, the trainer's own planner decides the rows of a pass, and the shapes count the
published parameter numbers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from extras import need

need("diffusers")  # the shapes are diffusers / transformers classes on the meta device
need("transformers")

from jagg_scale.estimate import memory as E  # noqa: E402 - after the extras check
from jagg_scale.estimate import shapes as S  # noqa: E402
from jagg_scale.estimate.cli import main  # noqa: E402
from jagg_scale.train.config import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


# the edit recipes' sets are the user's (/data/edits, no peer's set to fetch): the estimator counts the
# held-out prompts it is given, here the tiny committed edit set's
EDITS = {name: [f"eval.prompt_file={ROOT / 'data/edits/tiny/edits.jsonl'}"]
         for name in ("flux1_kontext_pickscore", "qwenimage_edit_pickscore")}


def load(path, overrides=()):
    # the model and training prompts need not exist here (the held-out prompts are counted: data/prompt_sets)
    return load_config(path, [*EDITS.get(Path(path).stem, []), *overrides], check_files=False)

PRODUCTION = ["sd35m_pickscore", "sd35m_geneval", "sd35m_ocr", "flux1_dev_hps", "sd35m_nft_pickscore",
              "qwenimage_hps", "sd35l_pickscore", "flux2_klein_pickscore", "zimage_pickscore",
              "flux1_kontext_pickscore", "qwenimage_edit_pickscore", "flux1_dev_1024_hps", "wan21_t2v_14b_hps",
              "wan22_t2v_a14b_hps",
              "sd35m_pickscore_nocfg", "sd35m_geneval_nocfg", "sd35m_gcpo_pickscore",
              "sd35m_dppo_pickscore", "sd35m_awm_pickscore", "sd35m_pickscore_fast", "sd35m_unifiedreward"]
# the GPUs each config is shipped for (its header); 8 unless named
WORLD = {"wan21_t2v_14b_hps": 32, "wan22_t2v_a14b_hps": 32}
# the recipes whose peer trains without activation checkpointing and fit without it (their header): UniRL's
# Flow-DPPO (sd3_flowdppo.yaml:60) at its micro-batch of 8
NO_CHECKPOINTING = {"sd35m_dppo_pickscore"}
# SD3.5 recipes whose peer runs bf16, not fp16 (UniRL's, sd3_flowdppo.yaml:34-35; Flow-Factory's AWM,
# examples/awm/lora/sd3_5/default.yaml:7)
BF16 = {"sd35m_dppo_pickscore", "sd35m_awm_pickscore"}
GPU_80GB = 79.2  # GiB torch reports for an 80 GB H100 / A100
HEADROOM = 0.10


@pytest.fixture(scope="module")
def estimates():
    out = {}
    for name in PRODUCTION:
        s = E.prepare(load(ROOT / "configs" / f"{name}.yaml"), WORLD.get(name, 8))
        out[name] = (s, E.estimate(s))
    return out


@pytest.mark.parametrize("name", PRODUCTION)
def test_shipped_config_fits_its_gpus_of_80gb_with_headroom(name, estimates):
    s, est = estimates[name]
    cfg = s["cfg"]
    assert cfg.parallel.engine == "fsdp2" and cfg.parallel.activation_checkpointing == (name not in NO_CHECKPOINTING)
    assert cfg.train.micro_batch_size >= 1 and est["micro_batch_size"] == min(cfg.train.micro_batch_size,
                                                                                est["local_batch"])
    assert est["total"] <= (1 - HEADROOM) * GPU_80GB * E.GiB, E.report(s, est, GPU_80GB)
    assert est["phases"]["update"]["components"]["activations"] > 0  # the joint pass is estimated, not left out


@pytest.mark.parametrize("name", [n for n in PRODUCTION if n.startswith("sd35") and n not in BF16])
def test_float16_costs_bf16s_bytes_with_a_float32_vae_and_the_sd35_recipes_still_fit(name, estimates):
    """model.dtype float16 (Flow-GRPO's and DiffusionNFT's precision): the same bytes and measured coefficients as
    bf16 everywhere but the VAE, which fp16 runs keep in float32 (models/__init__.py): its weights and its decode
    (measured: twice bf16's per latent pixel) double. Each SD3.5 recipe still fits its 8 x 80 GB with 10% headroom."""
    half, got = estimates[name]  # the recipes ship float16 (their peers'): compared with the same at bfloat16
    assert load(ROOT / "configs" / f"{name}.yaml").model.dtype == "float16"
    s = E.prepare(load(ROOT / "configs" / f"{name}.yaml", ["model.dtype=bfloat16"]), WORLD.get(name, 8))
    est = E.estimate(s)
    assert (half["precision"], half["act"], half["encoders"]) == (s["precision"], s["act"], s["encoders"])
    assert half["decode"][0] == pytest.approx(2 * s["decode"][0], rel=0.01)
    for phase in ("update", "optimizer"):  # the rollout's chunk (sampling.chunk_size auto) follows the decode
        a, b = got["phases"][phase]["components"], est["phases"][phase]["components"]
        frozen = "frozen encoders + VAE"
        assert a[frozen] - b[frozen] == pytest.approx(2 * s["frozen"]["vae"])  # 4 bytes a weight instead of 2
        assert {k: v for k, v in a.items() if k != frozen} == {k: v for k, v in b.items() if k != frozen}
    assert got["total"] <= (1 - HEADROOM) * GPU_80GB * E.GiB, E.report(half, got, GPU_80GB)


@pytest.mark.parametrize("name", PRODUCTION)
def test_components_add_up_to_each_phase_total_and_the_peak_is_the_largest_phase(name, estimates):
    _, est = estimates[name]
    for phase in est["phases"].values():
        assert sum(phase["components"].values()) == pytest.approx(phase["total"], rel=1e-12)
        assert all(v >= 0 for v in phase["components"].values())
    assert est["total"] == max(p["total"] for p in est["phases"].values())
    assert est["phases"][est["peak_phase"]]["total"] == est["total"]


def test_a_larger_micro_batch_costs_more_and_the_chosen_one_is_the_largest_that_fits(estimates):
    s, _ = estimates["flux1_dev_hps"]
    small, large = E.estimate(s, 1), E.estimate(s, 4)
    assert (large["phases"]["update"]["components"]["activations"]
            > small["phases"]["update"]["components"]["activations"])
    m, est = E.choose_micro(s, GPU_80GB, HEADROOM)
    assert m is not None and est["total"] <= (1 - HEADROOM) * GPU_80GB * E.GiB
    if m < est["local_batch"]:
        assert E.estimate(s, m + 1)["total"] > (1 - HEADROOM) * GPU_80GB * E.GiB


@pytest.mark.parametrize("shape, component, published, rel, extra", [
    ("sd35_medium", "transformer", 2.47e9, 0.01, "pos_embed"),  # the published count includes the pos_embed table
    ("sd35_large", "transformer", 8.1e9, 0.01, "pos_embed"),
    ("flux1_dev", "transformer", 11.9e9, 0.01, None),
    ("sd35_medium", "text_encoder", 123.7e6, 0.01, None),
    ("sd35_medium", "text_encoder_2", 694.7e6, 0.01, None),
    ("sd35_medium", "text_encoder_3", 4.762e9, 0.01, None),
    ("flux1_dev", "vae", 83.8e6, 0.01, None),
    ("qwen_image", "text_encoder", 8.29e9, 0.01, None),  # Qwen2.5-VL-7B-Instruct, its vision tower included
    # FLUX.2 [klein] 4B: "4B", a size rounded to the billion (3.5 to 4.5B; the 9B's shapes count 9.08B)
    ("flux2_klein", "transformer", 4.0e9, 0.125, None),
    ("flux2_klein", "text_encoder", 4.0e9, 0.01, None),  # Qwen3-4B, 4.0B (untied embeddings would make it 4.41B)
    ("z_image", "transformer", 6.15e9, 0.005, None),  # the Hub's 12.3 GB of bf16 (the published "6B")
    ("z_image", "text_encoder", 4.025e9, 0.005, None),  # Qwen3-4B: the Hub's 8.05 GB of bf16
    ("z_image", "vae", 84e6, 0.01, None),  # FLUX.1's VAE: the Hub's 168 MB of bf16
    # Wan2.1-T2V-14B: "14B", a size rounded to the billion (13.5 to 14.5B); Wan-VAE 127M (as recalled from the Wan
    # report: not read here, shapes/README.md); the exact counts are the reference code's arithmetic (test_wan.py)
    ("wan21_t2v_14b", "transformer", 14e9, 0.5 / 14, None),
    ("wan21_t2v_14b", "vae", 127e6, 0.01, None),
])
def test_shapes_count_the_published_parameters(shape, component, published, rel, extra):
    comp = S.pipeline_shapes(None, shape)["components"][component]
    n = S.component_params(comp)
    if extra:
        n += S.transformer_stats(comp)["buffers"] // 4  # SD3's fp32 pos_embed table, a buffer here
    assert n == pytest.approx(published, rel=rel)


def test_the_qwen_families_shapes_fit_together():
    """FLUX.2 [klein] concatenates three of Qwen3's hidden states per token and packs 2x2 patches of its VAE's
    latents; Z-Image's caption features are one hidden state, its latents the VAE's own."""
    klein, zimage = (S.pipeline_shapes(None, n)["components"] for n in ("flux2_klein", "z_image"))
    tk, tz = klein["transformer"]["config"], zimage["transformer"]["config"]
    assert tk["joint_attention_dim"] == 3 * klein["text_encoder"]["config"]["hidden_size"]
    assert tk["in_channels"] == 4 * klein["vae"]["config"]["latent_channels"]
    assert tz["cap_feat_dim"] == zimage["text_encoder"]["config"]["hidden_size"]
    assert tz["in_channels"] == zimage["vae"]["config"]["latent_channels"]
    assert sum(tz["axes_dims"]) == tz["dim"] // tz["n_heads"]  # RoPE over a head's width
    assert zimage["vae"] == S.pipeline_shapes(None, "flux1_dev")["components"]["vae"]  # FLUX.1's VAE, its coefficients


@pytest.mark.parametrize("path, name", [("/models/FLUX.2-klein-base-4B", "flux2_klein"),
                                        ("/models/FLUX.2-klein-4B", "flux2_klein"), ("/models/Z-Image", "z_image"),
                                        ("/models/Z-Image-Turbo", "z_image"), ("/models/FLUX.2-klein-base-9B", None)])
def test_a_checkpoint_not_here_is_sized_by_its_name(path, name):
    """model.pretrained names the shapes when the directory is not here; the 9B [klein] is not the 4B's shapes."""
    kind = "flux2" if "FLUX" in path else "zimage"
    cfg = load(ROOT / "configs" / f"{'flux2_klein' if kind == 'flux2' else 'zimage'}_pickscore.yaml",
               [f"model.pretrained={path}"])
    if name is None:
        with pytest.raises(S.ShapeError, match="--shapes NAME"):
            S.pipeline_shapes(cfg)
    else:
        assert S.pipeline_shapes(cfg)["name"] == name


@pytest.mark.parametrize("name, length, text, image", [
    ("zimage_pickscore", 100, 128, 1024),  # its own tokens rounded up to 32 (the bound: the padded length)
    ("zimage_pickscore", 512, 512, 1024),
    ("flux2_klein_pickscore", 100, 100, 576),  # the padded prompt itself; 384 px: 24 x 24 packed patches
])
def test_the_qwen_families_text_and_image_tokens(name, length, text, image):
    """The text tokens a pass carries and what the encoder sees: Z-Image's transformer takes each prompt's tokens
    rounded up to 32 (a pass its longest prompt's, at most the padded length), FLUX.2 [klein]'s the padded prompt;
    both encoders run on model.max_sequence_length tokens, and the stored conditioning is the padded prompt (with
    Z-Image's int64 mask, 2 float32 words a token)."""
    s = E.prepare(load(ROOT / "configs" / f"{name}.yaml", [f"model.max_sequence_length={length}"]), 8, memory=False)
    tc = s["components"]["transformer"]["config"]
    assert (s["text_tokens"], s["image_tokens"]) == (text, image)
    assert [e["seq"] for e in s["encoders"].values()] == [length]
    width = tc["cap_feat_dim"] + 2 if name.startswith("zimage") else tc["joint_attention_dim"]
    assert s["cond_row"] == length * width


def test_kontext_passes_carry_the_input_images_tokens_and_its_latents_ride_in_the_conditioning():
    """FLUX.1-Kontext: each transformer pass holds the noisy and the input image's tokens (2 x 24 x 24 at 384 px), the
    conditioning a row stores the input image's latents besides T5's embeddings; the same config as plain FLUX.1
    (the same transformer) carries half the image tokens and costs fewer FLOPs a row."""
    from jagg_scale.estimate import steptime as T

    cfg = load(ROOT / "configs" / "flux1_kontext_pickscore.yaml")
    s = E.prepare(cfg, 8, memory=False)
    plain = E.prepare(load(ROOT / "configs" / "flux1_kontext_pickscore.yaml", ["model.kind=flux"]), 8,
                      shapes_name="flux1_dev", memory=False)
    tc = s["components"]["transformer"]["config"]
    assert s["kind"] == "flux_kontext" and s["image_tokens"] == 2 * plain["image_tokens"] == 2 * 24 * 24
    assert s["cond_row"] - plain["cond_row"] == 16 * 48 * 48 and s["text_tokens"] == 512
    comp = json.dumps(s["components"]["transformer"], sort_keys=True)
    kontext = T._transformer_flops(comp, "flux_kontext", tuple(s["latent"]), 2, 512)
    flux = T._transformer_flops(comp, "flux", tuple(s["latent"]), 2, 512)
    assert 1.5 * flux < kontext < 2.5 * flux and tc["guidance_embeds"]


def test_the_cli_prints_the_table_and_the_chosen_micro_batch(capsys):
    assert main([str(ROOT / "configs" / "sd35m_ocr.yaml"), "--world-size", "32", "--gpu-mem", "139.8"]) == 0
    out = capsys.readouterr().out
    assert "largest train.micro_batch_size that fits:" in out and "| **total** |" in out and "fits with >= 10%" in out


def test_the_jagg_estimate_command_runs_as_installed():
    """The command as a user runs it, in its own process: exit 0, the planner and the fit said."""
    config = ROOT / "configs" / "sd35m_pickscore.yaml"
    proc = subprocess.run([sys.executable, "-m", "jagg_scale.estimate.cli", str(config), "--world-size", "8",
                           "--gpu-mem", str(GPU_80GB)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WindowPlanner(window=4" in proc.stdout and "(fits with >= 10%)" in proc.stdout


@pytest.mark.parametrize("name", PRODUCTION)
def test_the_jagg_estimate_command_passes_every_production_config_as_shipped(name, capsys):
    """Its entry point on every shipped config (in this process: the imports are paid once): exit 0, the
    planner and the fit said."""
    assert main([str(ROOT / "configs" / f"{name}.yaml"), *EDITS.get(name, []), "--world-size", str(WORLD.get(name, 8)),
                 "--gpu-mem", str(GPU_80GB)]) == 0
    out = capsys.readouterr().out
    planner = repr(load(ROOT / "configs" / f"{name}.yaml").jagg.make_planner())
    assert planner.startswith("ExactPlanner" if "nft" in name else "WindowPlanner(window=")
    # the planner's settings (a two-expert model's switch printed after them: estimate/experts.py)
    assert planner.split(", switch=")[0] in out and "(fits with >= 10%)" in out
    assert "step time per rank: " in out  # and its seconds per phase (estimate/steptime.py)
    forward_process = "nft" in name or "awm" in name  # no Flow-GRPO step to compare
    assert ("Flow-GRPO's step of the same config" in out) == (not forward_process)


def test_a_config_that_does_not_fit_exits_1_and_a_bad_one_2(tmp_path, capsys):
    config = str(ROOT / "configs" / "flux1_dev_hps.yaml")
    assert main([config, "--world-size", "8", "--gpu-mem", "40"]) == 1
    assert "does not fit 40 GiB per GPU" in capsys.readouterr().err
    assert main([config, "jagg.widow=4", "--world-size", "8"]) == 2
    assert "config key 'jagg.widow'" in capsys.readouterr().err
    assert main([config, "--world-size", "7"]) == 2  # 96 rows per minibatch over 7 ranks
    assert "world size 7" in capsys.readouterr().err


@pytest.mark.parametrize("overrides,knots", [
    ([], 2),  # the window planner: a joint pass over a window's two endpoints
    (["jagg=null", "jagg.mode=exact", "grpo.ref_at=steps"], 1),
    (["jagg.share_knots=true", "jagg.jagg_frac=null", "jagg.route_by=null", "jagg.rows_per_pass=3"], 3),
    (["jagg.planner=budget", "jagg.window=null", "jagg.jagg_frac=null", "jagg.route_by=null", "jagg.rows_per_pass=4",
      "grpo.ref_at=steps"], 4),
])
def test_the_rows_of_a_pass_are_the_trainers_planners(overrides, knots):
    s = E.prepare(load(ROOT / "configs" / "sd35m_pickscore.yaml", overrides), 8)
    est = E.estimate(s)
    assert est["pass_rows"] == knots * est["micro_batch_size"]
    assert est["planner"] == repr(s["cfg"].jagg.make_planner())


@pytest.mark.parametrize("name", [n for n in PRODUCTION if n.startswith("sd35m")])
def test_hsdp_on_four_nodes_shards_within_a_node_and_still_fits(name):
    """slurm/jagg.sbatch runs LoRA configs on several nodes with parallel.replicate = the node count: each node
    holds a whole sharded copy, so the per-rank states are those of 8 ranks, not of 32."""
    path = ROOT / "configs" / f"{name}.yaml"
    node = E.estimate(E.prepare(load(path), 8))
    fsdp32 = E.estimate(E.prepare(load(path), 32))
    s = E.prepare(load(path, ["parallel.replicate=4"]), 32)
    hsdp = E.estimate(s)
    static = lambda est, c: est["phases"]["update"]["components"][c]
    for c in ("transformer weights", "optimizer states"):
        assert static(hsdp, c) == pytest.approx(static(node, c)) and static(hsdp, c) > static(fsdp32, c)
    assert hsdp["total"] <= (1 - HEADROOM) * GPU_80GB * E.GiB, E.report(s, hsdp, GPU_80GB)
    assert "HSDP: 4 replicas of 8" in E.report(s, hsdp, GPU_80GB)


def test_the_t5_length_is_the_configs():
    """model.max_sequence_length sets the text tokens of every pass (sd35m: Flow-GRPO's 128); null: diffusers' 256."""
    path = ROOT / "configs" / "sd35m_pickscore.yaml"
    shipped, default = (E.prepare(load(path, o), 8) for o in ([], ["model.max_sequence_length=null"]))
    assert (shipped["text_tokens"], default["text_tokens"]) == (77 + 128, 77 + 256)
    # at one rollout chunk (sampling.chunk_size auto sizes it to the phase's memory: a shorter prompt buys more rows)
    assert E.estimate(shipped, sampling_batch=48)["total"] < E.estimate(default, sampling_batch=48)["total"]


def test_rollout_batch_auto_is_the_fewest_even_chunks_that_fit_in_two_chunks_or_more():
    """sampling.chunk_size auto: half a rank's rows when they fit (the reward of one chunk overlaps the next
    chunk's sampling), more chunks on a smaller GPU: the fewest whose rollout phase fits, each as small as that count
    allows (the same forwards at a lower peak); the trainer's resolver gives the estimator's number."""
    cfg = load(ROOT / "configs" / "sd35m_pickscore.yaml")
    assert cfg.sampling.chunk_size == "auto"
    s = E.prepare(cfg, 8)
    big, small = E.rollout_batch(s, GPU_80GB), E.rollout_batch(s, 40.0)
    # 144 rows per rank: at most two chunks of 72 (three of 48 under float16's float32 VAE decode)
    assert big == E.estimate(s)["sampling_batch"] and 1 <= big <= 72
    assert 1 <= small < big
    fits = lambda bs, gib: E.estimate(s, sampling_batch=bs)["phases"]["rollout"]["total"] <= 0.9 * gib * E.GiB
    for bs, gib in ((big, GPU_80GB), (small, 40.0)):
        chunks = -(-144 // bs)
        assert fits(bs, gib) and bs == -(-144 // chunks)  # even chunks: the smallest size that many chunks take
        assert chunks == 2 or not fits(-(-144 // (chunks - 1)), gib)  # one chunk fewer does not fit


def test_rollout_batch_auto_off_a_gpu_is_half_a_ranks_rows(tmp_path):
    import torch
    from jagg_scale.train.policy import rollout_batch

    cfg = load(ROOT / "configs" / "sd35m_pickscore.yaml")
    assert rollout_batch(cfg, 8, torch.device("cpu")) == 72 and rollout_batch(cfg, 16, torch.device("cpu")) == 36
    assert rollout_batch(load(ROOT / "configs" / "sd35m_pickscore.yaml", ["sampling.chunk_size=9"]), 8,
                         torch.device("cpu")) == 9
