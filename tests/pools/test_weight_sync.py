"""The weight sync between the pools fails closed (jagg_scale/pools/rollout_pool.bind, trainer_link.receive): a bind
of zero or part of the trainable parameters, an unknown name, another dtype or shape, bytes that read back other than
sent, and a rollout that reports another version, other bound weights or other prompts than the trainer's each stop
the run with one line. Each failure is planted in real tensors sent over a real bridge."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from jagg_scale.grpo.rollout import Trajectories
from jagg_scale.pools.bridge import PoolError
from jagg_scale.pools.messages import combined, pack_rollout, prompts_digest, weight_digests
from jagg_scale.pools.rollout_pool import Binder, bind
from jagg_scale.pools.trainer_link import TrainerLink
from jagg_scale.pools.world import Layout, PoolMember
from jagg_scale.rewards.multi import ComponentScores
from bridge_pair import both, pair


class Adapted(torch.nn.Module):
    """A frozen base with two trainable adapter matrices (LoRA's layout of trainable names)."""

    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(4, 4)
        self.base.requires_grad_(False)
        self.lora_A = torch.nn.Parameter(torch.randn(2, 4))
        self.lora_B = torch.nn.Parameter(torch.zeros(4, 2))


def sent_state():
    torch.manual_seed(1)
    return {"lora_A": torch.randn(2, 4), "lora_B": torch.randn(4, 2)}


def test_a_full_bind_copies_every_trainable_parameter_and_returns_the_senders_digest():
    model, state = Adapted(), sent_state()
    base = model.base.weight.clone()
    got = bind(model, state, weight_digests(state), version=3, rank=2)
    assert got == combined(weight_digests(state))
    assert torch.equal(model.lora_A, state["lora_A"]) and torch.equal(model.lora_B, state["lora_B"])
    assert torch.equal(model.base.weight, base)  # frozen weights are not the sync's


@pytest.mark.parametrize("plant, match", [
    # verl-omni #552: names of another wrapping bind no layer at all
    (lambda s: {f"base_model.model.{k}": v for k, v in s.items()}, r"0 of its 2 trainable parameters bound"),
    (lambda s: {"lora_A": s["lora_A"]}, r"1 of its 2 .* none sent for 'lora_B'"),  # a partial bind
    (lambda s: {**s, "lora_C": torch.zeros(1)}, r"2 of its 2 .* from the 3 sent; no parameter named 'lora_C'"),
    (lambda s: {}, r"0 of its 2 trainable parameters bound from the 0 sent"),
])
def test_a_bind_of_other_names_stops_the_run(plant, match):
    state = plant(sent_state())
    with pytest.raises(PoolError, match=r"rank 2 binding policy version 3: " + match):
        bind(Adapted(), state, weight_digests(state), version=3, rank=2)


def test_another_dtype_or_shape_stops_the_run():
    state = sent_state()
    state["lora_B"] = state["lora_B"].double()
    with pytest.raises(PoolError, match=r"'lora_B' was sent as torch.float64 \(4, 2\), the replica holds "
                                        r"torch.float32"):
        bind(Adapted(), state, weight_digests(state), version=0, rank=2)


def test_bytes_that_differ_from_the_senders_digest_stop_the_run():
    state = sent_state()
    digests = weight_digests(state)
    state["lora_A"][0, 0] += 1e-6  # changed after the sender's digest: in transit, or in a bad copy
    with pytest.raises(PoolError, match=r"'lora_A' read back other than sent"):
        bind(Adapted(), state, digests, version=0, rank=2)


# ---------------------------------------------------------------------- the trainer's checks of a rollout
def link_and_rollout_end(k: int = 1):
    """A trainer's link (trainer 0 of one, served by rank 1) and the rollout rank's end of the same bridge."""
    trainer_end, rollout_end = pair()
    member = PoolMember("trainer", 0, Layout(2, 1), trainer_end)
    dist = SimpleNamespace(pool=member, rank=0, is_main=True, device=torch.device("cpu"),
                           broadcast_object=lambda x: x)
    cfg = SimpleNamespace(pools=SimpleNamespace(max_staleness=k), train=SimpleNamespace(steps=10))
    link = TrainerLink(cfg, dist, engine=None)
    return link, rollout_end


def rollout_message(step, version, bound, prompts):
    traj = Trajectories(latents=torch.randn(3, 2, 4), velocities=torch.randn(2, 2, 4), log_probs=torch.randn(2, 2),
                        sigmas=torch.linspace(1, 0, 3))
    parts = {"r": ComponentScores(torch.randn(4).double(), torch.ones(4, dtype=torch.bool))}
    meta = {"step": step, "version": version, "bound": bound, "prompts": prompts_digest(prompts), "first": 0}
    return meta, pack_rollout(traj, parts), traj


def test_a_rollout_as_sent_is_received_whole():
    link, end = link_and_rollout_end(k=1)
    link.sent[4] = "d4"
    meta, tensors, traj = rollout_message(5, 4, "d4", ["a", "b"])
    _, (got, parts, _) = both(lambda: (end.send(0, "rollout", meta, tensors), end.flush()),
                              lambda: link.receive(5, ["a", "b"], ["r"]))
    assert torch.equal(got.latents, traj.latents) and torch.equal(got.log_probs, traj.log_probs)
    assert got.ref_velocities is None and parts["r"].valid.all()


@pytest.mark.parametrize("step, version, bound, prompts, match", [
    (5, 5, "d5", ["a", "b"], r"of step 5 sampled with policy version 5, expected step 5 with version 4"),
    (4, 3, "d3", ["a", "b"], r"of step 4 sampled with policy version 3, expected step 5 with version 4"),
    (5, 4, "other", ["a", "b"], r"digest other is not that of version 4 as sent \(d4\)"),
    (5, 4, "d4", ["b", "a"], r"other prompts than this step's rows"),
])
def test_a_rollout_of_another_step_version_weights_or_prompts_stops_the_trainer(step, version, bound, prompts, match):
    link, end = link_and_rollout_end(k=1)
    link.sent.update({3: "d3", 4: "d4", 5: "d5"})
    meta, tensors, _ = rollout_message(step, version, bound, prompts)
    with pytest.raises(PoolError, match=r"trainer 0, step 5: the rollout from rank 1 .*" + match):
        both(lambda: (end.send(0, "rollout", meta, tensors), end.flush()), lambda: link.receive(5, ["a", "b"], ["r"]))


def test_a_resume_without_a_version_its_next_rollouts_sample_with_stops_every_trainer():
    link, _ = link_and_rollout_end(k=2)
    link.history = {3: {"lora_A": torch.zeros(1)}}  # a checkpoint at step 5 holding version 3 only, not 4
    with pytest.raises(PoolError, match=r"policy version 4 is not in the checkpoint resumed .* holds versions \[3\]"):
        link._send(4, link.history.get(4))


# ---------------------------------------------------------------------- a version in parts
def rollout_worker(end, model):
    """The rollout rank's binding, as RolloutWorker runs it, over the rollout end of a bridge."""
    from jagg_scale.pools.rollout_pool import RolloutWorker

    worker = RolloutWorker.__new__(RolloutWorker)  # its _bind alone: no model build, prompts or reward
    worker.model, worker.bridge, worker.version, worker.bound = model, end, -1, ""
    worker.member = SimpleNamespace(rank=1)
    worker.cfg = SimpleNamespace(pools=SimpleNamespace(timeout_s=60))
    return worker


def test_a_version_larger_than_a_part_is_sent_in_parts_and_bound_whole(monkeypatch):
    import jagg_scale.pools.messages as messages

    monkeypatch.setattr(messages, "WEIGHT_PART_BYTES", 40)  # lora_A and lora_B: 32 bytes each, one a part
    link, end = link_and_rollout_end(k=1)
    model, state = Adapted(), sent_state()
    worker, recv, metas = rollout_worker(end, model), end.recv, []

    def spy(*a, **kw):
        meta, tensors = recv(*a, **kw)
        metas.append(meta)
        return meta, tensors

    end.recv = spy
    both(lambda: (link._send(3, state), link.bridge.flush()), lambda: worker._bind(3))
    assert [(m["part"], m["parts"], sorted(m["digests"])) for m in metas] == [(0, 2, ["lora_A"]), (1, 2, ["lora_B"])]
    assert worker.version == 3 and worker.bound == link.sent[3] == combined(weight_digests(state))
    assert torch.equal(model.lora_A, state["lora_A"]) and torch.equal(model.lora_B, state["lora_B"])


def test_a_part_of_another_version_or_out_of_order_stops_the_rollout_rank():
    link, end = link_and_rollout_end(k=1)
    state = sent_state()
    with pytest.raises(PoolError, match=r"rank 1 received policy version 4 while binding version 3: the sync is out"):
        both(lambda: (link._send(4, state), link.bridge.flush()), lambda: rollout_worker(end, Adapted())._bind(3))
    binder = Binder(Adapted(), version=3, rank=1)
    one = {"lora_A": state["lora_A"]}
    binder.add(one, weight_digests(one), 0, 2)
    with pytest.raises(PoolError, match=r"part 0 of 2 arrived after 1 of 2: the sync is out of order"):
        binder.add(one, weight_digests(one), 0, 2)
    with pytest.raises(PoolError, match=r"'lora_A' was sent twice"):
        binder.add(one, weight_digests(one), 1, 2)
