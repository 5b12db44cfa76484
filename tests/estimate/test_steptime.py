"""The step-time model (jagg_scale/estimate/steptime.py): it reproduces the GPU passes it is calibrated on, its
FLOP count is the one the calibration was read with, and each knob moves the phase it acts on, the way it should."""

from pathlib import Path

import pytest
from extras import need

need("diffusers")
need("transformers")

from jagg_scale.estimate import memory as E  # noqa: E402 - after the extras check
from jagg_scale.estimate import steptime as T  # noqa: E402
from jagg_scale.estimate.shapes import pipeline_shapes  # noqa: E402
from jagg_scale.train.config import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "sd35m_pickscore.yaml"


def seconds(*overrides, **kw):
    s = E.prepare(load_config(CONFIG, list(overrides), check_files=False), 8)
    return T.step_seconds(s, E.estimate(s), **kw)


def test_the_model_reproduces_its_calibration_passes():
    c = T.calibration()
    F = c["forward_tflop_per_row"] * 1e12
    for kind in ("grad", "nograd"):
        for rows, measured in c[kind]:
            assert T.pass_seconds(rows, F, grad=kind == "grad") == pytest.approx(measured, rel=1e-9)
    # between and past the measured passes: linear in the rate, then the largest pass's rate
    assert c["grad"][2][1] < T.pass_seconds(100, F, grad=True) < c["grad"][3][1]
    assert T.pass_seconds(288, F, grad=True) == pytest.approx(2 * c["grad"][3][1])


def test_the_flop_count_is_the_calibrations():
    """FlopCounterMode on the meta SD3.5-medium at the calibration's 1357 tokens gives the stored forward FLOPs."""
    cfg = load_config(CONFIG, ["model.max_sequence_length=256"], check_files=False)
    s = E.prepare(cfg, 8)
    assert s["image_tokens"] + s["text_tokens"] == T.calibration()["tokens_per_row"]
    comp = pipeline_shapes(cfg)["components"]["transformer"]
    import json

    F = T._transformer_flops(json.dumps(comp, sort_keys=True), "sd3", tuple(s["latent"]), s["patch"],
                             s["text_tokens"])
    assert F / 1e12 == pytest.approx(T.calibration()["forward_tflop_per_row"], rel=1e-3)


def test_each_knob_moves_its_phase():
    shipped = seconds()
    phases = ("rollout", "reference", "train", "train_nograd", "encode", "decode", "eval")
    # and the data-parallel collectives compute leaves exposed (test_collectives.py)
    assert shipped["step"] == pytest.approx(sum(shipped[p] for p in phases) + shipped["collectives"])
    assert all(shipped[p] > 0 for p in ("rollout", "reference", "train", "decode"))
    exact = seconds("jagg=null", "jagg.mode=exact", "grpo.ref_at=steps")
    assert exact["train"] > 1.5 * shipped["train"] and exact["rollout"] == shipped["rollout"]  # 9 passes, not 5
    small = seconds("sampling.chunk_size=9")
    assert small["rollout"] > shipped["rollout"] and small["train"] == shipped["train"]
    window = seconds("grpo.sde_window=4", "grpo.sde_window_range=[0, 5]", "grpo.timestep_fraction=1.0",
                     "sampling.ode_solver=dpm2", "sampling.ode_steps=3")
    assert window["rollout"] < 0.8 * shipped["rollout"] and window["train"] < shipped["train"]
    assert window["reference"] < 0.5 * shipped["reference"]  # 2 knots of a 4-step window, not 5 of 9 steps
    assert seconds("grpo.kl_beta=0", "grpo.ref_at=steps")["reference"] == 0
    steps = seconds("grpo.ref_at=steps")  # shipped: windows [0-3] [4-7] [8], the reference on 5 of the 9 steps
    assert shipped["reference"] == pytest.approx(steps["reference"] * 5 / 9)
    assert {p: steps[p] for p in phases if p != "reference"} == {p: shipped[p] for p in phases if p != "reference"}


def test_nft_prices_the_frozen_forwards_where_they_run():
    """DiffusionNFT: the old policy's and the reference's forwards at its 9 timesteps per sample, or at the knots
    (nft.old_at); with-grad passes by the plan (exact: 9, one JAGG window: one joint pass of 2 rows)."""
    nft = ROOT / "configs" / "sd35m_nft_pickscore.yaml"

    def nft_seconds(*overrides):
        s = E.prepare(load_config(nft, list(overrides), check_files=False), 8)
        return T.step_seconds(s, E.estimate(s))

    exact = nft_seconds()
    one = nft_seconds("jagg.mode=jagg", "jagg.window=9", "nft.noise=per_sample")
    knots = nft_seconds("jagg.mode=jagg", "jagg.window=9", "nft.noise=per_sample", "nft.old_at=knots")
    assert one["train"] < 0.5 * exact["train"] and one["train_nograd"] == pytest.approx(exact["train_nograd"])
    assert knots["train_nograd"] == pytest.approx(exact["train_nograd"] * 2 / 9) and knots["train"] == one["train"]
    assert exact["reference"] == 0 and exact["rollout"] == knots["rollout"]


def test_awm_prices_its_frozen_models_and_holds_its_ema_policy():
    """AWM (Flow-Factory's recipe, K = 6): the EMA policy's and the reference's forwards at the 4 knots of windows of 3
    (awm.frozen_at knots) or at all 6 timesteps, none without either model; the EMA policy a shadow copy of the
    adapter beside the trained one's (memory) and in the checkpoint (preemption), absent when nothing reads it."""
    from jagg_scale.estimate.preemption import checkpoint_bytes

    awm = ROOT / "configs" / "sd35m_awm_pickscore.yaml"

    def prepared(*overrides):
        s = E.prepare(load_config(awm, list(overrides), check_files=False), 8)
        est = E.estimate(s)
        return s, est, T.step_seconds(s, est)

    s, est, knots = prepared()
    _, _, steps = prepared("awm.frozen_at=timesteps")
    _, _, no_ema = prepared("awm.ema_kl_beta=0", "awm.ema_decay=null", "awm.ema_schedule=null",
                            "awm.ema_warmup_steps=null", "awm.ema_update_interval=null")
    no_frozen_s, no_frozen_est, no_frozen = prepared(
        "awm.ema_kl_beta=0", "awm.kl_beta=0", "awm.frozen_at=timesteps", "awm.ema_decay=null",
        "awm.ema_schedule=null", "awm.ema_warmup_steps=null", "awm.ema_update_interval=null")
    assert knots["train_nograd"] == pytest.approx(steps["train_nograd"] * 4 / 6)
    assert no_ema["train_nograd"] == pytest.approx(knots["train_nograd"] / 2) and no_frozen["train_nograd"] == 0
    assert knots["train"] == steps["train"] and knots["reference"] == 0
    ema = lambda e: e["phases"]["update"]["components"]["EMA"]  # noqa: E731
    assert ema(est) > 0 and ema(no_frozen_est) == 0
    lora = s["stats"]["lora_params"]
    assert checkpoint_bytes(s["cfg"], s["stats"]) - checkpoint_bytes(no_frozen_s["cfg"], s["stats"]) == 4 * lora


def test_flow_grpos_step_is_priced_on_the_same_passes():
    """The Flow-GRPO step (per step, 9-row passes, the CFG pair trained with grad, no checkpointing) costs more than
    the shipped JAGG config's, in training above all; its rollout at 9-row chunks too."""
    s = E.prepare(load_config(CONFIG, T.flow_grpo_overrides(None), check_files=False), 8)
    peer, own = T.step_seconds(s, E.estimate(s), cfg_rows_with_grad=True), seconds()
    assert peer["train"] > 2 * own["train"] and peer["rollout"] > own["rollout"]
    assert peer["step"] > own["step"]
    assert "x faster" in T.report(own, peer)


@pytest.mark.parametrize("shape, kind, latent, text", [("z_image", "zimage", (16, 64, 64), 512),
                                                      ("flux2_klein", "flux2", (32, 48, 48), 512)])
def test_the_flop_count_of_the_qwen_families_is_their_blocks_arithmetic(shape, kind, latent, text):
    """FLOPs per row as the adapter calls the transformer (Z-Image: lists of one latent and one prompt; FLUX.2: packed
    tokens with 4-axis rope ids), against 2 x the blocks' matmul weights x the tokens each block sees plus attention's
    4 x tokens^2 x width: Z-Image's refiners see the image or the prompt alone, its joint blocks both; FLUX.2's
    double-stream blocks apply each stream's weights to its own tokens, its single-stream blocks see both."""
    import json

    from jagg_scale.estimate.shapes import meta_module

    comp = pipeline_shapes(None, shape)["components"]["transformer"]
    image = latent[1] * latent[2] // 4  # 2x2 latent pixels a token: 512 px Z-Image, 384 px FLUX.2
    F = T._transformer_flops(json.dumps(comp, sort_keys=True), kind, latent, 2, text)
    c, m, tok = comp["config"], meta_module(comp), image + text

    def weights(block, keep=lambda name: True):  # matmul weights applied per token (not the per-row modulation)
        return sum(p.numel() for n, p in block.named_parameters() if p.dim() == 2 and "adaLN" not in n and keep(n))

    if kind == "zimage":
        d, L, R, w = c["dim"], c["n_layers"], c["n_refiner_layers"], weights(m.layers[0])
        expected = 2 * w * (R * image + R * text + L * tok) + 4 * d * (R * image**2 + R * text**2 + L * tok**2)
    else:
        d = c["num_attention_heads"] * c["attention_head_dim"]
        txt = lambda n: "add_" in n or "context" in n  # noqa: E731 - the text stream's projections
        dbl, sgl = m.transformer_blocks[0], m.single_transformer_blocks[0]
        expected = (c["num_layers"] * (2 * weights(dbl, lambda n: not txt(n)) * image + 2 * weights(dbl, txt) * text
                                       + 4 * d * tok**2)
                    + c["num_single_layers"] * (2 * weights(sgl) * tok + 4 * d * tok**2))
    assert F == pytest.approx(expected, rel=0.02)  # the rest: embedders, norms, the head
    assert T._transformer_flops(json.dumps(comp, sort_keys=True), kind, latent, 2, text // 2) < F  # the prompt


def test_the_no_grad_refresh_runs_after_an_optimizer_step_only():
    """sd35m_pickscore's 2 minibatches: the first is on-policy (jagg.intermediate auto: cached), the second runs the
    4 interior forwards and the 9 unconditional ones per sample (13 row-forwards); `forward` runs the interior on
    both (17); one minibatch a rollout runs none (as tools/bench/whole_step.py measures it)."""
    shipped, forward = seconds(), seconds("jagg.intermediate=forward")
    assert forward["train_nograd"] == pytest.approx(shipped["train_nograd"] * 17 / 13)
    assert seconds("train.minibatch_size=1152")["train_nograd"] == 0


def test_the_refresh_at_the_knots_runs_the_unconditional_prediction_there_alone():
    """grpo.refresh_at knots: the second minibatch runs CFG's unconditional prediction at the plan's 5 knots and no
    interior forward (auto is interpolate): 5 row-forwards per refreshed sample instead of 13; interpolate's lookup
    of a right knot in a later pass (rows_per_pass) is a no-grad forward more."""
    import torch

    from jagg_scale.jagg.plans import interpolate_forwards

    shipped, knots = seconds(), seconds("grpo.refresh_at=knots")
    assert knots["train_nograd"] == pytest.approx(shipped["train_nograd"] * 5 / 13)
    assert {p: knots[p] for p in ("rollout", "reference", "train")} == {p: shipped[p] for p in ("rollout",
                                                                                               "reference", "train")}
    split = ["jagg.share_knots=true", "jagg.jagg_frac=null", "jagg.route_by=null", "jagg.rows_per_pass=3",
             "grpo.ref_at=steps"]
    s = E.prepare(load_config(CONFIG, split, check_files=False), 8)
    planner = s["cfg"].jagg.make_planner()
    plan = planner.plan(torch.randn(9, 2, 4), torch.linspace(1, 0, 10), grad_norms=lambda: torch.ones(9)).plan
    lookups = interpolate_forwards(plan, planner.rows_per_pass)
    assert lookups > 0
    cached, lookup = seconds(*split, "jagg.intermediate=cached"), seconds(*split, "jagg.intermediate=interpolate")
    per_forward = cached["train_nograd"] / 9  # the 9 unconditional forwards of the second minibatch, one of two
    assert lookup["train_nograd"] == pytest.approx(cached["train_nograd"] + 2 * lookups * per_forward)


def test_each_distinct_prompt_is_encoded_once_and_flow_grpo_encodes_every_row():
    """Policy.encode runs the encoders on a rank's distinct prompts (sd35m_pickscore on 8 GPUs: ~46 of 144 rows'),
    Flow-GRPO's train_sd3.py on every row."""
    import json

    from jagg_scale.estimate.prompt_tokens import distinct_prompts

    s = E.prepare(load_config(CONFIG, [], check_files=False), 8)
    est = E.estimate(s)
    F = sum(T._frozen_flops(json.dumps(s["components"][n], sort_keys=True), "text", e["seq"])
            for n, e in s["encoders"].items())
    d = distinct_prompts(144, 48, 24)
    assert 45 < d < 47 and est["local_rows"] == 144
    assert T.step_seconds(s, est)["encode"] == pytest.approx(T.pass_seconds(d, F))
    assert T.step_seconds(s, est, encode_every_row=True)["encode"] == pytest.approx(T.pass_seconds(144, F))


WINDOW = ["grpo.sde_window=4", "grpo.sde_window_range=[0, 5]", "grpo.timestep_fraction=1.0"]


@pytest.mark.parametrize("overrides, prefix", [
    ([], 0.0),  # SDE from step 0: nothing before it
    (WINDOW, 0.5),  # starts 0 and 1: 0 or 1 Euler step before the window
    ([*WINDOW, "sampling.ode_solver=dpm2", "sampling.ode_steps=3"], 0.5),  # start 1: 1 of 3 dpm2 steps before it
    ([*WINDOW, "grpo.sde_window_range=[2, 8]"], 3.0),  # starts 2, 3, 4
    (["grpo.sde_window=3", "grpo.sde_window_range=[0, 5]", "grpo.timestep_fraction=1.0",
      "grpo.sde_window_mode=scattered"], 0.5),  # E[the first of 3 of 5 steps] = (C(4,3) + C(3,3)) / C(5,3)
])
def test_the_prefix_before_the_sde_window_by_hand(overrides, prefix):
    assert T.expected_prefix(load_config(CONFIG, overrides, check_files=False)) == pytest.approx(prefix)


def test_a_groups_prefix_runs_once_per_chunk_with_a_shared_initial_noise():
    """sampling.same_initial_noise: the steps before the SDE window run on one row per prompt group of a chunk; the
    rollout's other steps and every other phase are unchanged; no window (SDE from step 0), no saving."""
    w = [*WINDOW, "grpo.sde_window_range=[2, 8]", "sampling.ode_solver=dpm2", "sampling.ode_steps=3"]
    own, shared = seconds(*w), seconds(*w, "sampling.same_initial_noise=true")
    # starts 2, 3, 4: 1, 2, 2 of the 3 dpm2 steps before the window, of 7 model calls a row
    assert T.expected_prefix(load_config(CONFIG, w, check_files=False)) == pytest.approx(5 / 3)
    assert own["rollout"] * (1 - 5 / 3 / 7) < shared["rollout"] < own["rollout"]
    assert {p: own[p] for p in ("reference", "train", "train_nograd", "encode")} == {
        p: shared[p] for p in ("reference", "train", "train_nograd", "encode")}
    assert seconds("sampling.same_initial_noise=true")["rollout"] == seconds()["rollout"]


def test_a_videos_decode_is_counted_from_its_first_two_frames_exactly():
    """Wan's VAE decodes a latent frame at a time with a causal cache: the estimate counts the first two frames and
    extrapolates; the decode of 5 latent frames counted op by op on the meta device is the same number."""
    import json

    import torch

    comp = json.dumps(pipeline_shapes(None, "wan21_t2v_14b")["components"]["vae"], sort_keys=True)
    m = T._meta(comp)
    z = torch.zeros(1, json.loads(comp)["config"]["z_dim"], 5, 4, 4, device="meta")
    whole = T.count_flops(lambda: m.decode(z, return_dict=False))
    assert whole > 0 and T._frozen_flops(comp, "vae", (5, 4)) == whole
    assert T._frozen_flops(comp, "vae", (2, 4)) < whole  # the frames after the first cost something
