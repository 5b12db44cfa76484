"""What clients can cost `jagg-reward-server`, connection by connection: a listen backlog that holds 64 waiting
clients, a fixed worker pool, the peak memory under 16 concurrent worst-case requests (docs/reward_server.md); and
what a client WITHOUT the token, or a hostile one, can cost it (issue 26): slowloris connections cut at a total header
deadline while others are served, the token refused before any body byte is read (even with every worker busy), a
JSON value budget (64 MB of `{}` used to parse into GBs), chunked bodies counted as they stream, connection caps per
client IP and in all, a body deadline. Every test runs the real server: uvicorn on a loopback socket."""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from hang_guard import POLL_S, WAIT_S
from jagg_scale.rewards import RewardOutput, register
from jagg_scale.rewards.server import encode_images, serve
from extras import need
from reward_server_kit import (JSON, Counting, Mean, photos, post, prompts_meta, remote_reward, score_body,
                               wait_for)

need("uvicorn")  # the [server] extra: the server runs on uvicorn + starlette
need("starlette")



def _tcp_state(s: socket.socket) -> tuple[int, int]:
    """(tcpi_state, tcpi_retransmits) from TCP_INFO: 1 = ESTABLISHED, 2 = SYN_SENT."""
    info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
    return info[0], info[2]


def _pending_connections(srv, n: int) -> list[socket.socket]:
    """n connections to a server that is not accepting yet (serve_forever not started): each must complete its
    handshake into the listen queue. A full queue drops the SYN, and the client retransmits it after ~1 s."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(srv.server_address[:2])
        socks.append(s)
    deadline = time.monotonic() + WAIT_S  # a hang guard only
    while True:
        states = [_tcp_state(s) for s in socks]
        dropped = [i for i, (st, retrans) in enumerate(states) if st == 2 and retrans > 0]
        assert not dropped, f"the listen queue dropped the SYN of {len(dropped)} of {n} connections"
        if all(st == 1 for st, _ in states):
            break
        assert time.monotonic() < deadline
        time.sleep(POLL_S)
    for s in socks:
        s.setblocking(True)
        s.settimeout(WAIT_S)
    return socks


def _read_reply(s: socket.socket) -> int:
    data = b""
    while chunk := s.recv(65536):  # the server closes after one reply (HTTP/1.0)
        data += chunk
    s.close()
    return int(data.split(b" ", 2)[1])


@pytest.mark.skipif(not hasattr(socket, "TCP_INFO"), reason="TCP_INFO is Linux-only")
def test_listen_backlog_holds_64_waiting_connections():
    """socketserver's backlog of 5 overflowed under 16 clients (listen overflows, connections reset): 64 clients
    connecting while the server is busy now wait in the kernel's queue, and every one is answered."""
    srv = serve({"mean": Mean()}, max_connections_per_client=64)
    try:
        socks = _pending_connections(srv, 64)
    except BaseException:
        srv.server_close()  # never served: shutdown() would wait for a serve_forever that never ran
        raise
    for s in socks:
        s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert [_read_reply(s) for s in socks] == [200] * 64
    finally:
        srv.shutdown()
        srv.server_close()


@register("_test_server_threads")
class _Threads(Counting):
    names: set = set()

    def score(self, images, prompts, metadata):
        type(self).names.add(threading.current_thread().name)
        return RewardOutput(scores=torch.zeros(images.shape[0]))


def test_a_fixed_pool_of_worker_threads_scores_64_connections(start):
    """A thread per connection meant 64 threads (and 64 bodies in memory) for 64 clients; now 8 workers score."""
    _Threads.names = set()
    srv = start({"threads": _Threads()}, max_connections_per_client=64)
    body = score_body(encode_images(photos(8)[:1]))
    head = b"POST /score/threads HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    socks = []
    for _ in range(64):
        s = socket.create_connection(srv.server_address, timeout=WAIT_S)
        s.sendall(head % len(body) + body)
        socks.append(s)
    assert [_read_reply(s) for s in socks] == [200] * 64
    assert 1 <= len(_Threads.names) <= 8 and all(n.startswith("reward-worker-") for n in _Threads.names), _Threads.names


@pytest.mark.slow
def test_server_peak_memory_under_16_concurrent_worst_case_requests(monkeypatch):
    """The measurement of docs/reward_server.md at a small scale: 16 clients at once, each sending two 2048^2 PNG bombs
    (1.6 KB of body, 8.4 MP). The server's peak RSS (VmHWM) stays within its two decode slots' worth of pixels: a slot
    holds one batch, whose requests together stay within the per-request pixel budget (32 MP: three of these), and
    with --batch-rows 1 one request (the old server decoded all 16 at once: +1354 MB measured)."""
    from tools import server_memory

    side, slots = 2048, 2  # the server's defaults: decode_slots 2; 8.4 MP is within both pixel limits
    per_request = 2 * side * side
    for args, per_slot in (((), 3 * per_request), (("--batch-rows", "1"), per_request)):
        r = server_memory.measure(clients=16, images=2, side=side, kind="bomb", server_args=args)
        assert r["statuses"] == {"200": 16}, r
        # a batch in a slot: uint8 pixels (3 B/px) + the float batch (12 B/px) + one image's decode transient
        bound_mb = (slots * 15 * per_slot + 2 * 7 * side * side) / 2**20 + 64  # + 64 MB for the allocator's slack
        assert r["peak_over_before_mb"] < bound_mb, (args, r, bound_mb)


# ------------------------------------------------------- hostile clients (issue 26): what they can no longer cost


def _connect(srv, source: str = "127.0.0.1") -> socket.socket:
    """A connection from `source`: every 127.0.0.0/8 address is loopback on Linux, so each is a client IP of its own."""
    return socket.create_connection(srv.server_address, timeout=WAIT_S, source_address=(source, 0))


def _closed(s: socket.socket) -> bool:
    """Whether the server has closed `s` (EOF or reset), without waiting."""
    if not select.select([s], [], [], 0)[0]:
        return False
    try:
        return s.recv(65536) == b""
    except OSError:
        return True


def _read_response(s: socket.socket) -> tuple[int, dict]:
    r = http.client.HTTPResponse(s)
    r.begin()
    body = r.read()
    s.close()
    return r.status, json.loads(body)


def test_slowloris_is_cut_at_the_header_deadline_while_others_are_served(start, monkeypatch):
    """8 connections sending one header byte every 5 s stopped the old server from answering anyone: headers were read
    by its 8 worker threads, before the token, under a 60 s socket timeout that restarted with every byte. 16 such
    connections (a byte every 0.5 s) now cost the event loop a few KB each: a request with the token is scored
    meanwhile, and every slow connection is closed at the total header deadline (2 s here), bytes or not."""
    monkeypatch.setenv("JAGG_TEST_TOKEN", "s3cret")
    srv = start({"mean": Mean()}, token="s3cret", header_timeout_s=2.0)
    head = b"POST /score/mean HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 10_000  # 10k bytes: never complete
    stop, started, closed = threading.Event(), [], []

    def slowloris(i: int) -> None:
        s = _connect(srv)
        try:
            for k, byte in enumerate(head):
                if _closed(s):
                    return closed.append(i)
                s.sendall(bytes([byte]))
                if k == 0:
                    started.append(i)
                if stop.wait(0.5):
                    return
        except OSError:  # reset or broken pipe: the server closed it
            closed.append(i)
        finally:
            s.close()

    threads = [threading.Thread(target=slowloris, args=(i,), daemon=True) for i in range(16)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: len(started) == 16)
        out = remote_reward(srv, "mean", token_env="JAGG_TEST_TOKEN")(photos(8)[:2], *prompts_meta(2))
        assert out.scores.shape == (2,)
        for t in threads:  # each ends when the server closes its connection (the join's timeout is a hang guard)
            t.join(WAIT_S)
    finally:
        stop.set()
    assert sorted(closed) == list(range(16)), f"the server closed {len(closed)} of 16 slow connections"


@register("_test_server_gated")
class _Gated(Counting):
    """Blocks in the reward until the test opens the gate: keeps workers busy."""

    gate, inside, lock = threading.Event(), 0, threading.Lock()

    def score(self, images, prompts, metadata):
        with type(self).lock:
            type(self).inside += 1
        type(self).gate.wait(WAIT_S)  # a hang guard only
        return RewardOutput(scores=torch.zeros(images.shape[0]))


def test_the_token_is_refused_from_the_headers_with_every_worker_busy(start, monkeypatch):
    """401 from the headers alone: a client announcing 50 MB it never sends is refused at once, while both workers
    are busy in a reward (the old server queued it behind them) and without the server waiting for a body byte."""
    _Gated.gate.clear()
    _Gated.inside = 0
    monkeypatch.setenv("JAGG_TEST_TOKEN", "s3cret")
    srv = start({"gated": _Gated()}, token="s3cret", workers=2, decode_slots=2)
    results: list = []
    score = lambda: results.append(
        remote_reward(srv, "gated", token_env="JAGG_TEST_TOKEN")(photos(8)[:1], *prompts_meta(1)))
    busy = [threading.Thread(target=score, daemon=True) for _ in range(2)]
    try:
        for t in busy:
            t.start()
        wait_for(lambda: srv.slots.held == 2 and _Gated.inside == 1)  # one in the reward, one at its lock
        for auth in (b"", b"Authorization: Bearer wrong\r\n"):
            s = _connect(srv)
            s.sendall(b"POST /score/gated HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
                      + b"Content-Length: 50000000\r\n\r\n")
            status, reply = _read_response(s)
            assert status == 401 and "bearer token" in reply["error"], reply
            assert not _Gated.gate.is_set() and srv.slots.held == 2  # answered while both workers were busy
    finally:
        _Gated.gate.set()
    for t in busy:
        t.join(WAIT_S)
    assert [r.scores.shape for r in results] == [(1,), (1,)]


def _vm(key: str) -> int:
    """VmRSS / VmHWM of this process (the server runs in it) in bytes."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def test_a_body_of_empty_objects_is_refused_by_the_json_value_budget(start):
    """4.5 MB of `{},` in metadata parse into 1.5 M dicts, ~110 MB (64 MB of them took the old server to 3.3 GB,
    three such requests to 9.3 GB). The server counts '{', '[' and ',' as the body streams and refuses it, 413 naming
    the budget, before parsing: the process's peak RSS grows by a few MB. Each image's metadata is capped too."""
    srv = start({"mean": Mean()})
    url = srv.url + "/score/mean"
    good = encode_images(photos(8)[:1])[0]
    body = b'{"prompts": ["p"], "images": ["' + good.encode() + b'"], "metadata": [' + b"{}," * 1_500_000 + b"{}]}"
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak RSS, to the current RSS
        before = _vm("VmRSS")
    except OSError:  # not Linux, or not allowed: the refusal is still checked
        before = None
    status, reply = post(url, body, JSON)
    assert status == 413 and "more than the budget of 262144 JSON values" in reply["error"], reply
    if before is not None:
        grown = _vm("VmHWM") - before
        assert grown < 40 << 20, f"peak RSS grew by {grown >> 20} MB refusing a {len(body) >> 20} MB body"
    status, reply = post(url, score_body([good], [{"text": "x" * 70_000}]), JSON)
    assert status == 413 and "metadata[0]: 70011 bytes of JSON exceed the per-image limit of 65536" in reply["error"]
    geneval = {"tag": "counting", "include": [{"class": "dog", "count": 2}], "exclude": [{"class": "dog", "count": 3}]}
    assert post(url, score_body([good] * 4, [geneval] * 4), JSON)[0] == 200
    small = start({"mean": Mean()}, max_json_values=20)  # the budget is the server's to set
    status, reply = post(small.url + "/score/mean", score_body([good] * 4, [geneval] * 4), JSON)
    assert status == 413 and "budget of 20 JSON values" in reply["error"], reply


def _post_chunked(srv, chunks) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(*srv.server_address, timeout=WAIT_S)
    conn.request("POST", "/score/mean", body=iter(chunks), headers=JSON)  # an iterator: Transfer-Encoding: chunked
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def test_bodies_are_counted_as_they_stream(start):
    """A chunked body announces no length (the old server refused it, 411, and trusted Content-Length otherwise): one
    within the limit is scored, one over it is refused 413 once the limit streams past. A body over the limit that
    Content-Length announced and the client sends in full still gets its 413, not a reset (a lingering close)."""
    srv = start({"mean": Mean()}, max_request_bytes=100_000)
    body = score_body(encode_images(photos(8)[:1]))
    status, reply = _post_chunked(srv, [body[:100], body[100:]])
    assert status == 200 and len(reply["scores"]) == 1, reply
    status, reply = _post_chunked(srv, [b"[" + b" " * (1 << 20)] * 4)
    assert status == 413 and "request body exceeds the server limit of 100000 bytes" in reply["error"], reply
    status, reply = post(srv.url + "/score/mean", b" " * (8 << 20), JSON)
    assert status == 413 and "body of 8388608 bytes exceeds the server limit of 100000 bytes" in reply["error"]


def test_a_stalled_body_is_answered_408_at_the_body_deadline(start):
    """The old server waited 60 s per byte, and then closed without a reply."""
    srv = start({"mean": Mean()}, body_timeout_s=1.0)
    s = _connect(srv)
    s.sendall(b"POST /score/mean HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n"
              b"\r\n{")
    status, reply = _read_response(s)
    assert status == 408 and "not received within 1 s (1 bytes arrived)" in reply["error"], reply


def _health_from(srv, source: str) -> int:
    conn = http.client.HTTPConnection(*srv.server_address, timeout=WAIT_S, source_address=(source, 0))
    conn.request("GET", "/health")
    r = conn.getresponse()
    r.read()
    conn.close()
    return r.status


def test_connections_are_capped_per_client_ip_and_in_all(start):
    """One connection over a cap is answered 503 (retried by `remote`) and closed at once; other clients are served,
    and a freed connection lets the next one in."""
    srv = start({"mean": Mean()}, max_connections=6, max_connections_per_client=4, header_timeout_s=float(WAIT_S))
    held = [_connect(srv, "127.0.0.2") for _ in range(4)]
    wait_for(lambda: srv.guard.total == 4)
    status, reply = _read_response(_connect(srv, "127.0.0.2"))
    assert status == 503 and "127.0.0.2 holds the per-client limit of 4 connections" in reply["error"], reply
    assert _health_from(srv, "127.0.0.3") == 200
    held += [_connect(srv, "127.0.0.3") for _ in range(2)]
    wait_for(lambda: srv.guard.total == 6)
    status, reply = _read_response(_connect(srv, "127.0.0.4"))
    assert status == 503 and "limit of 6 connections" in reply["error"], reply
    held.pop(0).close()
    wait_for(lambda: srv.guard.total == 5)
    assert _health_from(srv, "127.0.0.4") == 200
    for s in held:
        s.close()
    assert srv.guard.refused == 2
