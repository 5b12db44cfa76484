"""The bridge between the pools (jagg_scale/pools/bridge.py) on a real gloo group: messages arrive whole and in order,
sizes are bounded before allocation, a silent or vanished peer stops the waiting rank with one line naming it."""

from __future__ import annotations

import json
import time

import pytest
import torch

from jagg_scale.pools.bridge import MAGIC, TAGS, PoolError, digest
from bridge_pair import both, pair


def test_a_message_of_every_dtype_arrives_whole_and_in_order():
    a, b = pair()
    sent = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).bfloat16(), "f64": torch.randn(2, 2).double(),
            "mask": torch.tensor([True, False, True]), "i64": torch.arange(5), "empty": torch.zeros(0, 4),
            "scalar": torch.tensor(2.5)}

    def send():
        a.send(1, "rollout", {"step": 3}, sent)
        a.send(1, "rollout", {"step": 4}, {"x": torch.ones(2)})
        a.flush()

    def recv():
        return b.recv(0, "rollout"), b.recv(0, "rollout")

    _, ((meta, got), (meta2, got2)) = both(send, recv)
    assert meta == {"step": 3} and meta2 == {"step": 4}
    assert got.keys() == sent.keys()
    for k, t in sent.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k
    assert torch.equal(got2["x"], torch.ones(2))


def test_kinds_do_not_mix():
    a, b = pair()

    def send():
        a.send(1, "weights", {"version": 1})
        a.send(1, "rollout", {"step": 0})
        a.flush()

    _, (rollout, weights) = both(send, lambda: (b.recv(0, "rollout")[0], b.recv(0, "weights")[0]))
    assert rollout == {"step": 0} and weights == {"version": 1}


def _raw(bridge, dst, sizes, header=b"", payload=b""):
    """A message written by hand (another program's bytes): sizes, then header and payload as given, not waited for
    (the receiver refuses it part-way); the works and buffers returned, kept alive."""
    parts = [torch.tensor(sizes, dtype=torch.int64)]
    parts += [torch.frombuffer(bytearray(x), dtype=torch.uint8) for x in (header, payload) if x]
    return [(bridge.group.send([p], dst, TAGS["rollout"]), p) for p in parts]


def test_an_oversized_payload_is_refused_before_it_is_allocated():
    a, b = pair(limit_bytes=1024)
    with pytest.raises(PoolError, match=r"payload of 1099511627776 .*limits .* 1024.*refused before allocating"):
        both(lambda: _raw(a, 1, [MAGIC, 10, 1 << 40]), lambda: b.recv(0, "rollout"))


@pytest.mark.parametrize("sizes", [[0x1234, 10, 0], [MAGIC, 1 << 30, 0], [MAGIC, 0, 0], [MAGIC, 10, -1]])
def test_a_bad_size_header_is_refused(sizes):
    a, b = pair()
    with pytest.raises(PoolError, match="refused before allocating"):
        both(lambda: _raw(a, 1, sizes), lambda: b.recv(0, "rollout"))


@pytest.mark.parametrize("spec, payload, match", [
    ([["x", "float32", [4]]], 32, "describes 16 bytes"),  # the payload is not what the header says
    ([["x", "complex64", [1]]], 16, "unreadable header"),  # a dtype outside the list
    ([["x", "float32", [-1]]], 16, "unreadable header"),
    ([["x", "float32", [1]], ["x", "float32", [1]]], 32, "unreadable header"),  # a name twice
])
def test_a_header_that_does_not_match_its_payload_is_refused(spec, payload, match):
    a, b = pair()
    header = json.dumps({"meta": {}, "tensors": spec}).encode()
    with pytest.raises(PoolError, match=match):
        both(lambda: _raw(a, 1, [MAGIC, len(header), payload], header, bytes(payload)), lambda: b.recv(0, "rollout"))


def test_a_silent_peer_stops_the_waiting_rank_within_the_timeout_naming_it():
    _, b = pair(timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(PoolError, match=r"rank 1 waiting for the rollout message from rank 0: nothing within "
                                        r"1 s: rank 0 is hung or stopped"):
        b.recv(0, "rollout")
    assert time.monotonic() - t0 < 60  # a hang guard: the bound is the timeout, not the suite's


def test_digest_names_dtype_shape_and_bytes():
    x = torch.arange(6.0)
    assert digest(x) == digest(x.clone())
    assert digest(x) != digest(x.reshape(2, 3))
    assert digest(x) != digest(x.double())
    y = x.clone()
    y[3] = 3.0000002
    assert digest(x) != digest(y)
