"""jagg-estimate on Wan2.2 A14B (estimate/experts.py): two experts of Wan2.1-14B's architecture, both held and only
the active one computing; the Wan VAE in float32; the plan cut at the switch; configs/wan22_t2v_a14b_hps.yaml fits
its 32 GPUs of 80 GB. From the committed shapes and coefficients: nothing is measured here."""

from pathlib import Path

import pytest
import torch
from extras import need

need("diffusers")
need("transformers")

from jagg_scale.estimate import memory as E  # noqa: E402 - after the extras check
from jagg_scale.estimate import steptime as T  # noqa: E402
from jagg_scale.estimate.experts import plan_sigmas, shape_switch  # noqa: E402
from jagg_scale.estimate.shapes import component_params, pipeline_shapes  # noqa: E402
from jagg_scale.jagg.planners import with_switch  # noqa: E402
from jagg_scale.train.config import ConfigError, load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WAN22, WAN21 = ROOT / "configs" / "wan22_t2v_a14b_hps.yaml", ROOT / "configs" / "wan21_t2v_14b_hps.yaml"
EXPERT = 14_288_491_584  # Wan2.1-T2V-14B's transformer, checked against Wan's own arithmetic in test_wan.py
GiB = 2**30


def prepare(path, overrides=(), shapes=None, memory=True):
    return E.prepare(load_config(path, list(overrides), check_files=False), 32, shapes, memory=memory)


@pytest.fixture(scope="module")
def both():
    """The shipped config as it is (two experts) and on one expert's shapes (Wan2.1-14B's, the same architecture;
    one CFG scale: a second is the second expert's)."""
    two, one = prepare(WAN22), prepare(WAN22, ["sampling.guidance_2=null"], shapes="wan21_t2v_14b")
    return (two, E.estimate(two)), (one, E.estimate(one))


def test_the_a14b_shapes_are_two_experts_of_wan21_14b():
    """diffusers' converter builds both A14B experts with Wan2.1-14B's config (convert_wan_to_diffusers.py:529-546),
    with Wan2.1's VAE and UMT5 encoder: each component counts what Wan2.1's does."""
    two, one = (pipeline_shapes(None, n)["components"] for n in ("wan22_t2v_a14b", "wan21_t2v_14b"))
    assert component_params(two["transformer"]) == component_params(two["transformer_2"]) == EXPERT
    assert all(component_params(two[n]) == component_params(one[n]) for n in ("vae", "text_encoder"))


def test_both_experts_are_held_and_one_computes_a_pass(both):
    """Weights, gradients and optimizer states count both experts (twice one expert's); a pass's activations are
    one expert's; the FSDP2 root gathered holds both roots, a block one expert's."""
    (two, est2), (one, est1) = both
    assert two["stats"]["params"] == 2 * EXPERT and len(two["stats"]["block_params"]) == 80
    assert len(two["pass_stats"]["block_params"]) == 40 and one["switch"] is None
    c2, c1 = (e["phases"]["optimizer"]["components"] for e in (est2, est1))
    for name in ("transformer weights", "optimizer states", "gradients"):
        assert c2[name] == pytest.approx(2 * c1[name]), name
    u2, u1 = (e["phases"]["update"]["components"] for e in (est2, est1))
    assert u2["activations"] == u1["activations"] > 0
    held = sum(c2[n] - c1[n] for n in ("transformer weights", "optimizer states"))  # in every phase
    assert held > 4.5 * GiB and est2["total"] - est1["total"] >= held  # the second expert's fp32 masters and states


@pytest.mark.parametrize("path", [WAN21, WAN22])
def test_the_wan_vae_is_counted_in_float32(path):
    """The VAE is loaded float32 under a bfloat16 model (pipeline_wan.py:56; models/wan.py): its weights 4 bytes a
    parameter beside the bf16 text encoder's shard."""
    s = prepare(path, memory=False)
    assert s["cfg"].model.dtype == "bfloat16" and s["vae_bytes"] == 4
    vae, t5 = (component_params(s["components"][n]) for n in ("vae", "text_encoder"))
    assert s["frozen"] == {"vae": vae, "text_encoder": t5 / 32}


def test_the_plan_is_cut_at_the_switch_and_the_step_time_counts_it(both):
    """The config's 12 trained steps of its shift-3 schedule: 0-6 above 0.875 (the high-noise expert), 7-11 below.
    Windows of 4 are then [0-3] [4-6] [7-10] [11]: a seventh with-grad row a sample, which the step time prices."""
    (two, est2), (one, est1) = both
    cfg = two["cfg"]
    sigmas = plan_sigmas(cfg, two["experts"], cfg.trained_per_sample)
    assert two["switch"].high(sigmas).tolist() == [True] * 7 + [False] * 5
    plan = with_switch(cfg.jagg.make_planner(), two["switch"]).plan(torch.randn(12, 2, 4), sigmas).plan
    assert plan == [(0, 3), (4, 6), (7, 10), (11, 11)]
    t2, t1 = T.step_seconds(two, est2), T.step_seconds(one, est1)
    assert t2["train"] == pytest.approx(t1["train"] * 7 / 6, rel=0.05)  # 7 rows of passes a sample, not 6
    assert t2["rollout"] == pytest.approx(t1["rollout"], rel=0.05)  # one expert computes each forward


def test_the_shipped_config_fits_its_32_gpus_of_80gb(both):
    (two, est), _ = both
    assert est["total"] <= 0.9 * 79.2 * GiB, E.report(two, est, 79.2)
    assert "switch=ExpertSwitch(boundary_ratio=0.875" in est["planner"]


def test_what_the_trainer_refuses_the_estimator_refuses():
    with pytest.raises(ConfigError, match="config key 'grpo.step_selection' is random, but the model has two experts"):
        prepare(WAN22, ["grpo.step_selection=random"], memory=False)


def test_a_local_two_expert_pipeline_gives_its_experts_switch_and_scheduler(tmp_path):
    """Shapes read from a pipeline directory (the tiny Wan2.2): transformer_2, model_index.json's boundary_ratio and
    the scheduler's own config, whose float timesteps compare untruncated."""
    from jagg_scale.models.tiny import make_tiny_wan

    pipe = make_tiny_wan(tmp_path / "pipe", experts=True)
    cfg = load_config(ROOT / "configs" / "wan22_tiny_cpu.yaml", [f"model.pretrained={pipe}"])
    shapes = pipeline_shapes(cfg)
    assert set(shapes["components"]) == {"transformer", "transformer_2", "vae", "text_encoder"}
    assert shapes["experts"]["scheduler"]["class"] == "FlowMatchEulerDiscreteScheduler"
    switch = shape_switch(shapes)
    assert switch.boundary_ratio == 0.875 and not switch.integer_timesteps
    assert shape_switch(pipeline_shapes(None, "wan22_t2v_a14b")).integer_timesteps  # UniPC's int64 timesteps
