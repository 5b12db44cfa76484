"""Wan2.2 A14B's two experts (models/wan.py, models/wan_experts.py) on a tiny random WanPipeline with a
transformer_2 and boundary_ratio 0.875 (jagg_scale/models/tiny.py --kind wan22).

The adapter samples exactly as the pipeline's own two-expert loop; each row of a pass runs, and trains, the expert
the pipeline runs at its noise level; a LoRA lands on both experts; the VAE is float32; what cannot be right with
two experts is refused at start-up by key; and jagg-train trains it with JAGG windows cut at the switch, its LoRA
export loading into a plain WanPipeline (both experts) to the trained velocities.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from extras import need

need("diffusers")
need("transformers")

from adapter_checks import PROMPTS  # noqa: E402
from jagg_scale.grpo import sample_ode  # noqa: E402
from jagg_scale.grpo.rollout import guided_velocity  # noqa: E402
from jagg_scale.models.wan import WanVelocity  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "wan22_tiny_cpu.yaml"
JAGG_TRAIN = str(Path(sys.executable).parent / "jagg-train")


@pytest.fixture(scope="module")
def wan22_dir(tmp_path_factory):
    from jagg_scale.models.tiny import make_tiny_wan

    return make_tiny_wan(tmp_path_factory.mktemp("tiny_wan22") / "pipe", seed=0, experts=True)


def load(path, **kw) -> WanVelocity:
    return WanVelocity.from_pretrained(path, max_sequence_length=32, resolution=16, num_frames=5, **kw)


@pytest.fixture(scope="module")
def model(wan22_dir):
    return load(wan22_dir)


def test_the_adapter_samples_as_the_two_expert_pipeline(model):
    """WanPipeline's loop (pipeline_wan.py:585-638: transformer while t >= 875, transformer_2 below, CFG 4 with the
    empty negative prompt) and ours over its 8 sigmas (3 steps high, 5 low) land on the same latents; with the
    low-noise expert replaced by the high one they do not (the switch is what makes them agree)."""
    from jagg_scale.models.wan_experts import WanExperts

    cond, uncond = model.encode_prompts(PROMPTS), model.encode_prompts([""] * 2)
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1))
    sigmas = model.pipeline_sigmas(8)
    assert model.expert_switch.high(sigmas[:-1]).tolist() == [True] * 3 + [False] * 5
    out = model.pipe(prompt_embeds=cond, negative_prompt_embeds=uncond, guidance_scale=4.0, num_inference_steps=8,
                     height=16, width=16, num_frames=5, latents=noise.clone(), output_type="latent").frames

    def ours(m):
        return sample_ode(lambda x, s, c: guided_velocity(m, x, s, c, 4.0, m.guidance_rule), (cond, uncond),
                          noise, sigmas)

    assert torch.allclose(out, ours(model), atol=1e-5)
    one = model.with_transformer(WanExperts(model.transformer.high, model.transformer.high, model.expert_switch))
    assert not torch.allclose(out, ours(one), atol=1e-3)


def test_a_scale_per_expert_samples_as_the_pipelines_guidance_scale_2(model):
    """sampling.guidance_2 (grpo/guidance.py ExpertGuidance): the low-noise expert's 5 steps guided with 3, the
    high-noise expert's 3 with 4, as WanPipeline's guidance_scale_2 (pipeline_wan.py:597-604; Wan2.2's own (3.0, 4.0):
    wan_t2v_A14B.py:37); not as one scale of 4 on both."""
    from jagg_scale.grpo.guidance import ExpertGuidance

    cond, uncond = model.encode_prompts(PROMPTS), model.encode_prompts([""] * 2)
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1))
    sigmas = model.pipeline_sigmas(8)
    out = model.pipe(prompt_embeds=cond, negative_prompt_embeds=uncond, guidance_scale=4.0, guidance_scale_2=3.0,
                     num_inference_steps=8, height=16, width=16, num_frames=5, latents=noise.clone(),
                     output_type="latent").frames

    def ours(guidance):
        return sample_ode(lambda x, s, c: guided_velocity(model, x, s, c, guidance, model.guidance_rule),
                          (cond, uncond), noise, sigmas)

    assert torch.allclose(out, ours(ExpertGuidance(high=4.0, low=3.0, switch=model.expert_switch)), atol=1e-5)
    assert not torch.allclose(out, ours(4.0), atol=1e-3)


def test_each_row_runs_and_trains_the_expert_of_its_noise_level(wan22_dir):
    """A pass with a row at sigma 0.95 (t 950: high) and one at 0.5 (low): each row's velocity is its expert's alone,
    and each row's gradient reaches its expert's parameters only."""
    m = load(wan22_dir)
    tr = m.transformer
    x, sigma = torch.randn(2, *m.latent_shape), torch.tensor([0.95, 0.5])
    cond = m.encode_prompts(PROMPTS)
    v = m(x, sigma, cond)
    for row, expert in ((0, tr.high), (1, tr.low)):
        alone = expert(hidden_states=x[row:row + 1], timestep=sigma[row:row + 1] * 1000,
                       encoder_hidden_states=cond[row:row + 1], return_dict=False)[0]
        assert torch.allclose(v[row:row + 1], alone, atol=1e-5)
    for row, trained, idle in ((0, tr.high, tr.low), (1, tr.low, tr.high)):
        m.zero_grad(set_to_none=True)
        m(x, sigma, cond)[row].square().sum().backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained.proj_out.parameters())
        # the other expert ran on the other row: its gradient from this row is zero
        assert all(p.grad is None or not p.grad.any() for p in idle.parameters())
    names = {n.split(".")[1] for n, _ in m.named_parameters()}
    assert names == {"high", "low"}  # both experts are the adapter's parameters (the optimizer's, checkpoints')


def test_a_lora_lands_on_both_experts_and_the_reference_turns_both_off(wan22_dir):
    from jagg_scale.models.lora import lora_module_names, lora_parameters, lora_targets

    m = load(wan22_dir)
    x, sigma, cond = torch.randn(2, *m.latent_shape), torch.tensor([0.95, 0.5]), m.encode_prompts(PROMPTS)
    base = m(x, sigma, cond).detach()
    m.add_lora(rank=4, alpha=4, targets=lora_targets("wan"))
    names = lora_module_names(m)
    assert len(names) == 20 and {n.split(".")[0] for n in names} == {"high", "low"}  # 10 targets x 2 experts
    for p in lora_parameters(m):  # move every B off zero: the adapter now changes both experts' rows
        p.data.normal_()
    assert {n.split(".")[0] for n, p in m.transformer.named_parameters() if p.requires_grad} == {"high", "low"}
    trained = m(x, sigma, cond).detach()
    assert not torch.allclose(trained[0], base[0]) and not torch.allclose(trained[1], base[1])
    with m.reference_disabled():
        assert torch.allclose(m(x, sigma, cond), base, atol=1e-6)
    assert torch.allclose(m(x, sigma, cond), trained)  # back on afterwards


def test_exports_from_a_gathered_state_are_the_live_exports_per_expert(wan22_dir, tmp_path):
    """A sharded run exports from its gathered state dict ("transformer.high.<...>", "transformer.low.<...>"): each
    expert's LoRA file and full transformer directory equal those written from the live modules, the high expert's
    in the directory, the low one's in transformer_2/, and the two differ (each is its own expert's)."""
    from safetensors.torch import load_file

    from jagg_scale.models.lora import LORA_FILE, lora_parameters, lora_targets

    def same(a: Path, b: Path) -> bool:
        x, y = load_file(str(a)), load_file(str(b))
        return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)

    m = load(wan22_dir)
    m.add_lora(rank=4, alpha=4, targets=lora_targets("wan"))
    for p in lora_parameters(m):
        p.data.normal_()
    m.save_lora(tmp_path / "live")
    m.save_lora(tmp_path / "gathered", state=m.state_dict())
    for sub in (".", "transformer_2"):
        assert same(tmp_path / "live" / sub / LORA_FILE, tmp_path / "gathered" / sub / LORA_FILE)
    assert not same(tmp_path / "live" / LORA_FILE, tmp_path / "live" / "transformer_2" / LORA_FILE)

    full = load(wan22_dir)
    weights = "diffusion_pytorch_model.safetensors"
    full.save_full(tmp_path / "full_live")
    full.save_full(tmp_path / "full_gathered", state=full.state_dict())
    for sub in (".", "transformer_2"):
        assert same(tmp_path / "full_live" / sub / weights, tmp_path / "full_gathered" / sub / weights)
    assert not same(tmp_path / "full_live" / weights, tmp_path / "full_live" / "transformer_2" / weights)


def test_refused_pipelines_name_what_is_wrong(wan22_dir, wan_dir):
    from diffusers import WanPipeline, WanTransformer3DModel

    from jagg_scale.models.wan_experts import ExpertsError

    assert load(wan_dir).expert_switch is None and type(load(wan_dir).transformer).__name__ == "WanTransformer3DModel"
    pipe = WanPipeline.from_pretrained(str(wan22_dir), local_files_only=True)
    pipe.register_to_config(boundary_ratio=None)  # a transformer_2 the pipeline never runs
    with pytest.raises(ExpertsError, match="no boundary_ratio"):
        WanVelocity(pipe, latent_size=8, num_frames=5)
    pipe.register_to_config(boundary_ratio=0.875)
    pipe.transformer_2 = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                               in_channels=4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32,
                                               num_layers=1)
    with pytest.raises(ExpertsError, match="experts disagree on text_dim"):
        WanVelocity(pipe, latent_size=8, num_frames=5)


def test_the_vae_is_float32_and_both_experts_load_alike(wan22_dir):
    """diffusers' Wan example loads the VAE in float32 beside a bfloat16 pipeline (pipeline_wan.py:56): so does the
    adapter under model.dtype bfloat16; the LoRA's frozen base of both experts in bfloat16, their adapters float32."""
    from jagg_scale.models import build_model
    from jagg_scale.train import load_config

    m = build_model(load_config(CONFIG, [f"model.pretrained={wan22_dir}", "model.dtype=bfloat16"]).model)
    assert m.frozen["vae"].dtype == torch.float32 and m.frozen["text_encoder"].dtype == torch.bfloat16
    for expert in m.transformer.experts:
        assert expert.proj_out.weight.dtype == torch.bfloat16
        assert {p.dtype for n, p in expert.named_parameters() if "lora_" in n} == {torch.float32}


REFUSED = {"step_selection": ("grpo.step_selection", ["grpo.step_selection=random"]),
           "ref_at": ("grpo.ref_at", ["grpo.ref_at=knots"]),
           "budget": ("jagg.planner", ["jagg.planner=budget", "jagg.window=null"]),
           "nft": ("train.algorithm", ["train.algorithm=nft", "grpo.clip_range=null", "grpo.kl_beta=null",
                                       "sampling.guidance=1", "sampling.guidance_2=null"]),
           "gcpo": ("train.algorithm", ["train.algorithm=gcpo", "grpo.kl_beta=null", "gcpo.chunks=[2, 2, 3]",
                                        "jagg.window=3"])}


@pytest.mark.parametrize("case", REFUSED)
def test_what_two_experts_rule_out_is_refused_by_key(wan22_dir, wan_dir, case):
    """Each combination is refused naming its key (train/config_experts.py), and loads with the one-expert pipeline:
    the second expert is why."""
    from jagg_scale.train import ConfigError, load_config

    key, overrides = REFUSED[case]
    with pytest.raises(ConfigError, match=f"^config key '{key}' .*two experts"):
        load_config(CONFIG, [f"model.pretrained={wan22_dir}", *overrides])
    load_config(CONFIG, [f"model.pretrained={wan_dir}", *overrides, "sampling.guidance_2=null"])  # also the second's


def test_a_low_noise_scale_is_refused_by_key_without_a_second_expert(wan22_dir, wan_dir):
    """sampling.guidance_2 acts on the low-noise expert alone: refused naming it with one transformer (Wan2.1, the
    built-in DiT) and with CFG off (the pipeline guides neither expert then)."""
    from jagg_scale.train import ConfigError, load_config

    low = ["sampling.guidance=4", "sampling.guidance_2=3"]
    assert load_config(CONFIG, [f"model.pretrained={wan22_dir}", *low]).sampling.guidance_2 == 3.0
    for config, overrides in ((CONFIG, [f"model.pretrained={wan_dir}", *low]),
                              (ROOT / "configs" / "tiny_cpu.yaml", low),
                              (CONFIG, [f"model.pretrained={wan22_dir}", "sampling.guidance=1",
                                        "sampling.guidance_2=3"])):
        with pytest.raises(ConfigError, match="^config key 'sampling.guidance_2' "):
            load_config(config, overrides)


def test_jagg_train_refuses_at_start_up_in_one_line_exit_2(wan22_dir, tmp_path):
    r = subprocess.run([JAGG_TRAIN, str(CONFIG), f"model.pretrained={wan22_dir}", "grpo.step_selection=random",
                        f"run.output_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    said = [line for line in r.stderr.splitlines() if line.startswith("jagg-train")]
    assert len(said) == 1 and "'grpo.step_selection'" in said[0] and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_jagg_train_cuts_windows_at_the_switch_and_exports_both_experts(wan22_dir, tmp_path):
    """Two steps of configs/wan22_tiny_cpu.yaml through jagg-train: the 8 trained steps (3 high, 5 low) in windows
    [0-2] [3-6] [7] (5 backward rows a sample instead of 4 for [0-3] [4-7], which would cross the switch), the
    training pass rescoring the rollout; the exported LoRA (the high expert's file, transformer_2/ the low one's)
    loaded into a plain WanPipeline gives the trained model's velocities on both sides of the switch."""
    from diffusers import WanPipeline

    from jagg_scale.train import Trainer, load_config

    from jagg_scale.cli import train_main

    run = tmp_path / "run"
    args = [f"model.pretrained={wan22_dir}", "train.steps=2", f"run.output_dir={run}", "log.progress=false"]
    assert train_main([str(CONFIG), *args]) == 0  # jagg-train's entry point, in this process
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["windows"], r["windows_jagg"], r["backward_passes"], r["per_step_equiv"]) for r in rows] == [
        (3, 3, 5, 8)] * 2
    assert rows[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert (run / "lora" / "transformer_2" / "pytorch_lora_weights.safetensors").is_file()

    trainer = Trainer(load_config(CONFIG, [*args, "run.resume=auto"]))  # the trained weights, from the checkpoint
    try:
        assert trainer.start_step == 2
        x = torch.randn(2, *trainer.model.latent_shape, generator=torch.Generator().manual_seed(3))
        sigma, cond = torch.tensor([0.95, 0.3]), trainer.model.encode_prompts(PROMPTS)
        with torch.no_grad():
            trained = trainer.model(x, sigma, cond)
    finally:
        trainer.close()
    plain = WanPipeline.from_pretrained(str(wan22_dir), local_files_only=True)
    base = WanVelocity(plain, max_sequence_length=32, latent_size=8, num_frames=5)
    with torch.no_grad():
        before = base(x, sigma, cond)
    plain.load_lora_weights(str(run / "lora"))
    plain.load_lora_weights(str(run / "lora" / "transformer_2"), load_into_transformer_2=True)
    with torch.no_grad():
        after = base(x, sigma, cond)
    assert torch.allclose(after, trained, atol=1e-5)
    assert all(not torch.equal(after[i], before[i]) for i in (0, 1))  # both experts' adapters moved and loaded


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_sharding_both_experts_train_as_one_process(wan22_dir, tmp_path, sp=2):
    """FSDP2 over 2 ranks (gloo) shards the two-expert module (each expert's blocks its units, both roots the root
    unit; a pass runs one expert, the other's parameters take no part), sp = 2 splitting each expert's tokens too
    (parallel/sequence.py applies Ulysses to each expert): the metrics of one process, step 0 to 1e-5 and after an
    update within the reduction order's tolerance (tests/parallel/test_sequence_parallel.py's). (sp 1 alone: the
    sharding of both experts without the split, its own run once; sp 2 covers it, and the CI budget is spent.)"""
    from train_runs import fit_metrics, launch_metrics

    args = [f"model.pretrained={wan22_dir}", "log.progress=false", "train.steps=2", "run.checkpoint_every=0"]
    one = fit_metrics(CONFIG, args, tmp_path / "one", timing=True)
    split = launch_metrics([str(CONFIG), *args, "parallel.engine=fsdp2", f"parallel.sequence_parallel={sp}"], 2,
                           tmp_path / "split")
    assert [r["step"] for r in split] == [r["step"] for r in one] == [0, 1]
    for a, b in zip(split, one):
        assert (a["windows"], a["backward_passes"]) == (b["windows"], b["backward_passes"]) == (3, 5)
        for key, rel in ({"reward_mean": 1e-5, "grad_norm": 1e-5, "ratio_mean": 1e-6} if a["step"] == 0 else
                         {"reward_mean": 1e-3, "grad_norm": 1e-2, "ratio_mean": 1e-5}).items():
            assert a[key] == pytest.approx(b[key], rel=rel, abs=1e-8), (a["step"], key, a[key], b[key])
