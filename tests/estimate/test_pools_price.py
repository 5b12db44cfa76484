"""The split pipeline's price (jagg_scale/estimate/pools.py): each pool is the synchronous model's phases at its own
size, the steady step the slower pool (k >= 1) or both in turn (k = 0), a reward's latency on the rollout pool's side
alone, and the transfers the trajectories and weights the memory model and the shapes give."""

from pathlib import Path

import pytest
from extras import need

need("diffusers")
need("transformers")

from jagg_scale.estimate import memory as E  # noqa: E402 - after the extras check
from jagg_scale.estimate import steptime as T  # noqa: E402
from jagg_scale.estimate.collectives import Links  # noqa: E402
from jagg_scale.estimate.pools import price_split, splits  # noqa: E402
from jagg_scale.train.config import load_config  # noqa: E402

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "sd35m_pickscore.yaml"


def price(rollout, **kw):
    return price_split(load_config(CONFIG, [], check_files=False), 8, rollout, links=Links(), a2a_gbps=T.A2A_GBPS,
                       **kw)


def test_the_splits_are_those_the_pools_accept():
    assert splits(8) == [1, 2, 4] and splits(32) == [1, 2, 4, 8, 16] and splits(3) == [1]


def test_each_pool_is_the_synchronous_phases_at_its_size_and_the_step_the_slower_one():
    p = price(4)
    cfg = load_config(CONFIG, [], check_files=False)
    s = E.prepare(cfg, 4)
    sync4 = T.step_seconds(s, E.estimate(s))
    rollout_phases = sum(sync4[k] for k in ("rollout", "reference", "encode", "decode"))
    assert p["rollout_pool"] == pytest.approx(rollout_phases + p["traj_gb"] / Links().ib_gbps)
    assert p["trainer_pool"] > sum(sync4[k] for k in ("train", "train_nograd"))
    assert p["step"] == max(p["rollout_pool"], p["trainer_pool"])
    in_turn = price(4, k=0)
    assert in_turn["step"] == pytest.approx(in_turn["rollout_pool"] + in_turn["trainer_pool"])
    late = price(4, k=0, reward_s=7.0)  # in turn, the reward's latency is waited between the pools
    assert late["step"] == pytest.approx(in_turn["step"] + 7.0)
    # LoRA r32's adapter (Flow-GRPO's attn.-prefixed targets, 18.8M parameters) in bf16, as FSDP2 gathers it for its
    # block, not the 2.5B base
    assert 0.03 < p["weights_gb"] < 0.05


def test_a_rewards_latency_overlaps_the_next_steps_sampling_on_the_rollout_pool():
    quick = price(2)
    send = quick["traj_gb"] * 3 / Links().ib_gbps  # 2 rollout ranks serve 3 trainers each
    sampling = quick["rollout_pool"] - send
    hidden, exposed = price(2, reward_s=0.5 * sampling), price(2, reward_s=2 * sampling)
    assert hidden["rollout_pool"] == pytest.approx(quick["rollout_pool"])  # behind the next step's sampling
    assert exposed["rollout_pool"] == pytest.approx(2 * sampling + send)  # the reward sets the pace
    assert exposed["trainer_pool"] == quick["trainer_pool"]


def test_a_split_whose_trainers_do_not_share_the_rollout_ranks_evenly_is_refused():
    with pytest.raises(E.DoesNotDivide):
        price(3)


def test_jagg_estimate_pools_prints_the_fastest_split_against_the_synchronous_step():
    from types import SimpleNamespace

    from jagg_scale.estimate.cli import pools_report, pools_table

    args = SimpleNamespace(config=str(CONFIG), overrides=[], reward_s=60.0, a2a_gbps=T.A2A_GBPS, shapes=None,
                           overhead_gb=1.5, gpu_mem=79.2, headroom=0.10, nvlink_gbps=Links().nvlink_gbps,
                           ib_gbps=Links().ib_gbps, gpus_per_node=8)
    (row,) = pools_table(args, [{"gpus": 8, "step": 97.7, "flow_grpo": 164.3}])
    assert [p["rollout_ranks"] for p in row["splits"]] == [2, 4]  # 1 + 7: 7 trainers do not split 576 rows
    assert row["step"] == min(p["step"] for p in row["splits"]) and row["sync"] == 97.7 + 60.0
    text = pools_report([row], 60.0)
    assert f"| 8 | {row['rollout_ranks']} + {row['trainers']} |" in text and "60 s of reward latency" in text


def test_a_rollout_rank_holds_the_policy_whole_in_the_dtypes_its_trainers_compute_with():
    """pools/replica.py: FSDP2 in bf16 gathers blocks in bf16, so the replica holds them so; a one-process engine
    computes from float32 masters. No shards, gradients, optimizer states or EMA; one step being sent beside the
    next one sampled; one part of a policy version received."""
    cfg = load_config(CONFIG, [], check_files=False)
    p = price(4)
    st = E.prepare(cfg, 4)["stats"]
    r = {c: b * E.GiB for c, b in p["replica"].items()}
    assert r["transformer weights"] == pytest.approx(2 * st["params"] + 2 * st["lora_params"])  # LoRA r32, fsdp2
    assert not {"optimizer states", "EMA", "gradients", "FSDP2 gathered weights + reduce buffers"} & r.keys()
    assert r["the previous step's rollout, being sent"] > r["rollout storage"]  # the step's rows + a packed share
    assert 0 < r["a policy version's part received"] <= 2**30 and p["replica_gib"] <= 0.9 * 79.2
    flux = Path(CONFIG).parent / "flux1_dev_hps.yaml"  # a full fine-tune of 12B parameters
    sharded = price_split(load_config(flux, [], check_files=False), 8, 4, links=Links(), a2a_gbps=T.A2A_GBPS)
    fs = E.prepare(load_config(flux, [], check_files=False), 4)["stats"]
    blocks = fs["params"] - fs["root_params"]
    assert sharded["replica"]["transformer weights"] * E.GiB == pytest.approx(2 * blocks + 4 * fs["root_params"])
    assert sharded["weights_gb"] == pytest.approx(2 * fs["params"] / 1e9)  # sent in bf16, not float32


def test_a_split_whose_rollout_rank_does_not_fit_is_not_offered_and_a_refused_config_says_so():
    from types import SimpleNamespace

    from jagg_scale.estimate.cli import pools_report, pools_table

    def table(config, gpu_mem):
        args = SimpleNamespace(config=str(config), overrides=[], reward_s=0.0, a2a_gbps=T.A2A_GBPS, shapes=None,
                               overhead_gb=1.5, gpu_mem=gpu_mem, headroom=0.10, nvlink_gbps=Links().nvlink_gbps,
                               ib_gbps=Links().ib_gbps, gpus_per_node=8)
        return pools_table(args, [{"gpus": 8, "step": 97.7, "flow_grpo": 164.3}])

    (row,) = table(CONFIG, 24.0)  # the replica (~4 GiB of weights, 14 of encoders and reward) and a chunk: no room
    assert row["error"].startswith("no split: a rollout rank holds") and "over 21.6 GiB" in row["error"]
    assert "| 8 | no split" in pools_report([row], 0.0)
    (wan,) = table(Path(CONFIG).parent / "wan21_t2v_14b_hps.yaml", 79.2)
    assert "pools refused" in wan["error"] and "sequence_parallel" in wan["error"]
