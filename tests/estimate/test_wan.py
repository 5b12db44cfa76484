"""jagg-estimate on video and on sequence parallelism (jagg_scale/estimate/): Wan2.1-T2V-14B's shapes against its
reference code's arithmetic, a video row's latents, tokens, conditioning, decode and frames scored, and what
parallel.sequence_parallel changes per rank (rows, tokens, activations, FLOPs, all-to-alls, the redundant decode) and
what it refuses. From the committed shapes and coefficients: nothing is measured here."""

import json
from pathlib import Path

import pytest
from extras import need

need("diffusers")
need("transformers")

from jagg_scale.estimate import memory as E  # noqa: E402 - after the extras check
from jagg_scale.estimate import steptime as T  # noqa: E402
from jagg_scale.estimate.activations import transformer_activations  # noqa: E402
from jagg_scale.estimate.shapes import ShapeError, component_params, pipeline_shapes  # noqa: E402
from jagg_scale.train.config import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WAN, FLUX = ROOT / "configs" / "wan21_t2v_14b_hps.yaml", ROOT / "configs" / "flux1_dev_1024_hps.yaml"


def prepare(path, overrides=(), world=32, memory=True):
    return E.prepare(load_config(path, list(overrides), check_files=False), world, memory=memory)


def flops(s):
    comp = json.dumps(s["components"]["transformer"], sort_keys=True)
    return T._transformer_flops(comp, s["kind"], tuple(s["latent"]), s["patch"], s["text_tokens"], s["sp"],
                                s["sp_text"])


def test_wan_shapes_count_what_the_reference_code_builds():
    """The shape file's transformer and UMT5 encoder, instantiated by diffusers / transformers on the meta device,
    hold exactly the parameters of Wan's own modules (Wan-Video/Wan2.1 wan/modules/model.py WanModel with
    wan/configs/wan_t2v_14B.py's values; wan/modules/t5.py umt5_xxl's encoder), counted here from those modules'
    layer shapes: a wrong width, depth or FFN size in the file changes them."""
    comps = pipeline_shapes(None, "wan21_t2v_14b")["components"]
    d, f, L, text, freq, cin, cout, p = 5120, 13824, 40, 4096, 256, 16, 16, 1 * 2 * 2
    linear = lambda i, o: i * o + o  # noqa: E731 - WanModel's nn.Linear layers carry biases
    block = (4 * linear(d, d) + 2 * d  # self-attention q, k, v, o and its RMS q / k norms (qk_norm)
             + 4 * linear(d, d) + 2 * d  # cross-attention to the prompt, the same
             + 2 * d  # norm3, affine (cross_attn_norm)
             + linear(d, f) + linear(f, d)  # the FFN
             + 6 * d)  # the block's modulation
    root = (cin * p * d + d  # patch embedding (Conv3d, kernel 1 x 2 x 2)
            + linear(text, d) + linear(d, d)  # text embedding
            + linear(freq, d) + linear(d, d) + linear(d, 6 * d)  # time embedding and projection
            + linear(d, cout * p) + 2 * d)  # head and its modulation
    assert component_params(comps["transformer"]) == L * block + root == 14_288_491_584
    vocab, dim, ffn, heads, buckets, layers = 256384, 4096, 10240, 64, 32, 24
    umt5 = vocab * dim + layers * (4 * dim * dim + 3 * dim * ffn + 2 * dim + buckets * heads) + dim  # gated FFN,
    # no biases, a position bias per layer (shared_pos False), the final norm
    assert component_params(comps["text_encoder"]) == umt5 == 5_680_910_336


def test_a_wan_row_is_a_video_of_latent_frames():
    """640 px, 81 frames: latents [16, 21, 80, 80] (the VAE's 8x spatial, 4x temporal), 21 x 40 x 40 tokens after the
    (1, 2, 2) patches, the UMT5 prompt at model.max_sequence_length (226: the encoder runs on it, the transformer
    cross-attends to it, a row stores its embeddings); fewer frames, fewer latent frames and tokens."""
    s = prepare(WAN, memory=False)
    assert s["kind"] == "wan" and tuple(s["latent"]) == (16, 21, 80, 80) and s["frames"] == (21, 81)
    assert s["image_tokens"] == 21 * 40 * 40 and s["text_tokens"] == 226
    assert [e["seq"] for e in s["encoders"].values()] == [226] and s["cond_row"] == 226 * 4096
    short = prepare(WAN, ["model.num_frames=33", "model.resolution=480"], memory=False)
    assert tuple(short["latent"]) == (16, 9, 60, 60) and short["image_tokens"] == 9 * 30 * 30


def test_the_wan_flop_count_is_its_blocks_arithmetic_split_by_sequence_parallelism():
    """Forward FLOPs of a row as the adapter calls the transformer, on one rank of a sequence-parallel group of N:
    per block 2 x the weights a video token meets (self-attention, the cross-attention's q / out, the FFN) x S / N,
    2 x the cross-attention's k / v weights x the prompt's T tokens (whole on every rank), and attention
    (4 S^2 d + 4 S T d) / N (each rank all tokens of 1 / N of the heads)."""
    for sp in (1, 2, 8):
        s = prepare(WAN, [f"parallel.sequence_parallel={sp}"], memory=False)
        S, T_, d, f, L = s["image_tokens"], s["text_tokens"], 5120, 13824, 40
        per_block = 2 * (6 * d * d + 2 * d * f) * S / sp + 2 * 2 * d * d * T_ + (4 * S * S * d + 4 * S * T_ * d) / sp
        text_embedding = 2 * (4096 * d + d * d) * T_
        assert flops(s) == pytest.approx(L * per_block + text_embedding, rel=1e-3), sp


@pytest.mark.parametrize("path, text_split", [(WAN, False), (FLUX, True)])
def test_sequence_parallel_2_halves_a_ranks_tokens_activations_and_flops_and_doubles_its_rows(path, text_split):
    """At the same world size, sp 2 against sp 1: twice the rows a rank samples and trains (half the data-parallel
    groups), half the image tokens of every pass (FLUX's text tokens too; Wan's prompt whole), so half the
    token-proportional activations of a with-grad pass and half the FLOPs a row, within what stays whole (Wan: its
    prompt's cross-attention keys; both: the per-row embeddings, the gathered output and the all-to-all buffers)."""
    world = 32 if path == WAN else 8
    one, two = (prepare(path, [f"parallel.sequence_parallel={sp}", "sampling.chunk_size=2"], world) for sp in (1, 2))
    cfg1, cfg2 = one["cfg"], two["cfg"]
    assert E.local_rows(cfg2, world) == tuple(2 * n for n in E.local_rows(cfg1, world))
    img, txt = one["image_tokens"], one["text_tokens"]
    assert one["rank_tokens"] == (img, txt) and two["rank_tokens"] == (img // 2, txt // 2 if text_split else txt)
    assert two["sp_text"] == text_split
    a1, a2 = (E.estimate(s, micro=1)["phases"]["update"]["components"]["activations"] for s in (one, two))
    assert a1 == pytest.approx(transformer_activations(one["act"], "ckpt", 2, img, txt))  # a joint pass of 2 rows
    assert a2 - 2 * two["sp_row"]["grad"] == pytest.approx(
        transformer_activations(one["act"], "ckpt", 2, img // 2, txt // 2 if text_split else txt))
    assert 0.45 * a1 < a2 < 0.55 * a1
    f1, f2 = flops(one), flops(two)
    if text_split:
        assert f2 == pytest.approx(f1 / 2, rel=1e-3)
    else:
        assert f1 / 2 < f2 < 0.505 * f1


def test_the_all_to_alls_are_priced_and_the_decode_is_split_over_the_group():
    """sp 2: each attention layer sends (N - 1) / N of a rank's q, k, v and output, 4 tensors of its tokens x the width
    in bf16, once per forward (three times in a checkpointed with-grad pass), at the bandwidth given; sp 1 sends
    nothing. A rank's rows double with sp 2, but its group's ranks split their decode and reward (trainer.py): the
    decode seconds stay a rank's share; a sharded reward (reward.shard) decodes every row on every rank. Under
    model.attention sdpa each with-grad pass runs its attention forward again (the native backward); cudnn not."""
    one, two = (prepare(WAN, [f"parallel.sequence_parallel={sp}", "sampling.chunk_size=3"]) for sp in (1, 2))
    assert two["a2a_row"] == 40 * 4 * (33600 // 2) * 5120 * 2 * (2 - 1) / 2 and one["a2a_row"] == 0
    t1, t2 = (T.step_seconds(s, E.estimate(s)) for s in (one, two))
    assert t1["sp_all_to_all"] == 0 and t2["sp_all_to_all"] > 0
    slow = T.step_seconds(two, E.estimate(two), a2a_gbps=T.A2A_GBPS / 2)
    assert slow["sp_all_to_all"] == pytest.approx(2 * t2["sp_all_to_all"])
    assert slow["step"] - t2["step"] == pytest.approx(t2["sp_all_to_all"])
    est = E.estimate(two)
    rollout = 20 * est["local_rows"] * 2  # the rollout's 20 steps of CFG pairs; the training passes come besides
    assert t2["sp_all_to_all"] > rollout * two["a2a_row"] / (T.A2A_GBPS * 1e9)
    assert t2["decode"] == pytest.approx(t1["decode"]) and est["local_rows"] == 12  # 12 rows, 6 of them decoded
    assert T.group_share([3, 3, 3, 3], 2) == [2, 1, 2, 1] and T.group_share([5], 1) == [5]
    shard = prepare(WAN, ["parallel.sequence_parallel=2", "sampling.chunk_size=3", "reward.shard=true"])
    assert T.step_seconds(shard, E.estimate(shard))["decode"] == pytest.approx(2 * t1["decode"])
    cudnn = prepare(WAN, ["parallel.sequence_parallel=2", "sampling.chunk_size=3", "model.attention=cudnn"])
    tc = T.step_seconds(cudnn, E.estimate(cudnn))
    assert tc["train"] < t2["train"] and tc["rollout"] == t2["rollout"]  # the recompute is the backward's alone
    one_c = prepare(WAN, ["parallel.sequence_parallel=1", "sampling.chunk_size=3", "model.attention=cudnn"])
    assert T.step_seconds(one_c, E.estimate(one_c))["train"] == pytest.approx(t1["train"])  # no sp: no recompute


@pytest.mark.parametrize("overrides, world, error, match", [
    (["parallel.sequence_parallel=2"], 8, ShapeError, "no context-parallel plan"),  # Z-Image: no plan
    (["parallel.sequence_parallel=16"], 32, E.DoesNotDivide, "40 attention heads"),  # Wan: whole heads a rank
    (["parallel.sequence_parallel=8", "model.resolution=624"], 32, E.DoesNotDivide, "31941 image tokens"),
])
def test_sequence_parallel_refuses_what_the_trainer_refuses(overrides, world, error, match):
    """A transformer without a context-parallel plan, a degree that does not divide the heads, tokens Ulysses cannot
    split evenly (624 px: 21 x 39 x 39 tokens): named, as parallel/sequence.py refuses them at the start."""
    path = ROOT / "configs" / ("zimage_pickscore.yaml" if "no context" in match else "wan21_t2v_14b_hps.yaml")
    with pytest.raises(error, match=match):
        prepare(path, overrides, world, memory=False)


def test_a_video_reward_scores_every_kth_frame_of_the_decoded_videos():
    """video_frames over HPS every 4th of 81 frames: the reward sized is HPS's CLIP, 21 frames a video scored; the
    rollout's decode and scoring cost more the more frames are scored (a copy of them beside the videos), of its
    sequence-parallel group's share of a chunk."""
    s = prepare(WAN, ["sampling.chunk_size=2"])
    assert list(s["rewards"]) == ["hps"] and s["rewards"]["hps"]["every"] == 4
    rollout = {}
    for every in (1, 4, 81):
        t = prepare(WAN, ["sampling.chunk_size=2", f"reward.options.every={every}"])
        rollout[every] = E.estimate(t)["phases"]["rollout"]["components"][
            "encoder / sampling / decode / reward transients"]
    frame = 3 * 640 * 640 * 4  # a float32 frame
    # a chunk of 2 videos, split over the sp 2 group's ranks: 1 video's frames a rank
    assert rollout[1] - rollout[4] == pytest.approx(1 * (81 - 21) * frame, rel=1e-6)
    assert rollout[4] > rollout[81]
