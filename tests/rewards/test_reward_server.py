"""Remote rewards over loopback: `jagg-reward-server` + the `remote` client agree with local scoring, and every
failure mode (auth, size limit, bad input, unknown reward, crashing reward, NaN, dead server) surfaces as the
documented status/message, retried only when retrying can help. What a client with the token can cost the server
is bounded: pixel limits read from the PNG headers (413 before decoding), decode slots, a fixed worker pool, a listen
backlog that holds 64 waiting clients, a JSON depth limit (400, not a dropped connection), JSON bodies only (415);
the peak memory under 16 concurrent worst-case requests (docs/reward_server.md). What a client WITHOUT the token, or
a hostile one, can cost it (issue 26): slowloris connections cut at a total header deadline while others are served,
the token refused before any body byte is read (even with every worker busy), a JSON value budget (64 MB of `{}`
used to parse into GBs), chunked bodies counted as they stream, connection caps per client IP and in all, a body
deadline. Every test runs the real server: uvicorn on a loopback socket."""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hang_guard import POLL_S, WAIT_S
from jagg_scale.rewards import Reward, RewardOutput, build_reward, register, score_safely
from jagg_scale.rewards.remote import RemoteRewardError
from jagg_scale.rewards.server import encode_images, serve
from extras import need

need("uvicorn")  # the [server] extra: the server runs on uvicorn + starlette
need("starlette")


# ----------------------------------------------------------------------------- test-only rewards


class _Counting(Reward):
    calls = 0

    def __call__(self, images, prompts, metadata):
        type(self).calls += 1
        return self.score(images, prompts, metadata)


@register("_test_server_mean")
class _Mean(_Counting):
    """Mean pixel value plus metadata["bias"]: checks images, prompts and metadata all arrive intact."""

    def score(self, images, prompts, metadata):
        s = images.mean(dim=(1, 2, 3)) + torch.tensor([float(m.get("bias", 0.0)) for m in metadata])
        return RewardOutput(scores=s, info={"n_prompts": len(prompts), "per_sample": s.tolist()})


@register("_test_server_raises")
class _Raises(_Counting):
    def score(self, images, prompts, metadata):
        raise RuntimeError("detector exploded")


@register("_test_server_nan")
class _Nan(_Counting):
    def score(self, images, prompts, metadata):
        return RewardOutput(scores=torch.tensor([1.0, float("nan"), 3.0, float("inf")]), info={"x": float("nan")})


@register("_test_server_slow")
class _Slow(_Counting):
    def score(self, images, prompts, metadata):
        time.sleep(0.4)
        return RewardOutput(scores=torch.zeros(images.shape[0]))


# -------------------------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def start():
    """start(rewards, **serve_kwargs) -> running server (shut down after the test)."""
    servers = []

    def _start(rewards, **kw):
        srv = serve(rewards, **kw)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv

    yield _start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _photos(size: int = 48) -> torch.Tensor:
    """[4, 3, size, size]: scikit-image's astronaut and coffee photos, resized, plus their flips."""
    skdata = need("skimage.data")
    photos = (skdata.astronaut(), skdata.coffee())
    arrs = [np.asarray(Image.fromarray(a).resize((size, size), Image.BILINEAR)) for a in photos]
    x = torch.from_numpy(np.stack(arrs)).permute(0, 3, 1, 2).float() / 255.0
    return torch.cat([x, x.flip(-1)])


def _meta(n: int) -> tuple[list[str], list[dict]]:
    return [f"prompt {i}" for i in range(n)], [{"bias": i} for i in range(n)]


def _remote(srv, reward: str, **kw):
    # the request timeout is a hang guard (tests/hang_guard.py); test_timeout_is_retried sets a short one on purpose
    kw = {"retries": 2, "backoff_s": 0.001, "timeout_s": float(WAIT_S), **kw}
    r = build_reward("remote", url=srv.url if hasattr(srv, "url") else srv, reward=reward, **kw)
    r.sleeps = []
    r._sleep = r.sleeps.append  # record the backoff, do not wait
    return r


def _raw(url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers=headers or {}, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=WAIT_S) as r:  # a hang guard only (tests/hang_guard.py)
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


JSON = {"Content-Type": "application/json"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------- tests


def test_remote_jpeg_matches_local_on_photos(start):
    images = _photos()
    prompts, meta = _meta(4)
    srv = start({"jpeg_compressibility": build_reward("jpeg_compressibility", quality=90)})
    local = build_reward("jpeg_compressibility", quality=90)(images, prompts, meta)
    remote = _remote(srv, "jpeg_compressibility")(images, prompts, meta)
    assert remote.scores.dtype == torch.float32
    torch.testing.assert_close(remote.scores, local.scores, rtol=0, atol=0)
    assert remote.scores.min() < -1.0  # real photos, real kB
    assert remote.info["jpeg_kb_mean"] == pytest.approx(local.info["jpeg_kb_mean"])
    assert remote.info["remote_retries"] == 0


def test_max_batch_splits_requests_and_merges(start):
    images = _photos(16).repeat(2, 1, 1, 1)[:7]
    prompts, meta = _meta(7)
    srv = start({"mean": _Mean()})
    expected = images.mean(dim=(1, 2, 3)) + torch.arange(7.0)
    one = _remote(srv, "mean")(images, prompts, meta)
    n0 = srv.request_count
    split = _remote(srv, "mean", max_batch=3)(images, prompts, meta)
    assert srv.request_count - n0 == 3  # 3 + 3 + 1
    torch.testing.assert_close(split.scores, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(split.scores, one.scores)
    assert split.info["per_sample"] == pytest.approx(expected.tolist(), abs=1e-6)  # lists concatenated
    assert split.info["n_prompts"] == pytest.approx((3 * 3 + 3 * 3 + 1 * 1) / 7)  # size-weighted mean


def test_bearer_token(start, monkeypatch):
    srv = start({"mean": _Mean()}, token="s3cret")
    images, (prompts, meta) = _photos(8)[:2], _meta(2)
    with pytest.raises(RemoteRewardError, match="HTTP 401.*bearer token") as e:
        _remote(srv, "mean")(images, prompts, meta)
    assert e.value.status == 401
    monkeypatch.setenv("JAGG_TEST_TOKEN", "wrong")
    n0 = srv.request_count
    with pytest.raises(RemoteRewardError, match="HTTP 401"):
        _remote(srv, "mean", token_env="JAGG_TEST_TOKEN")(images, prompts, meta)
    assert srv.request_count - n0 == 1  # 4xx is not retried
    monkeypatch.setenv("JAGG_TEST_TOKEN", "s3cret")
    assert _remote(srv, "mean", token_env="JAGG_TEST_TOKEN")(images, prompts, meta).scores.shape == (2,)
    assert _raw(srv.url + "/health")[0] == 401
    assert _raw(srv.url + "/health", headers={"Authorization": "Bearer s3cret"}) == (200, {"rewards": ["mean"]})
    monkeypatch.delenv("JAGG_TEST_TOKEN")
    with pytest.raises(ValueError, match="JAGG_TEST_TOKEN"):  # a missing token fails at build time
        build_reward("remote", url=srv.url, reward="mean", token_env="JAGG_TEST_TOKEN")


def test_oversized_request_413_not_retried(start):
    _Mean.calls = 0
    srv = start({"mean": _Mean()}, max_request_bytes=4000)
    r = _remote(srv, "mean", retries=3)
    with pytest.raises(RemoteRewardError, match="HTTP 413.*exceeds the server limit of 4000 bytes") as e:
        r(_photos(64), *_meta(4))
    assert e.value.status == 413 and srv.request_count == 1 and r.sleeps == [] and _Mean.calls == 0
    small = _photos(16)  # one 16x16 photo per request stays under the limit
    assert _remote(srv, "mean", max_batch=1)(small, *_meta(4)).scores.shape == (4,)


def test_bad_requests_400_name_the_field(start):
    srv = start({"mean": _Mean()})
    url = srv.url + "/score/mean"
    good, other_size = encode_images(_photos(8)[:1])[0], encode_images(_photos(4)[:1])[0]
    cases = {
        b"{not json": "not valid JSON",
        b"[1, 2]": "JSON object",
        json.dumps({"prompts": "p", "images": [good]}).encode(): "'prompts'",
        json.dumps({"prompts": ["p"], "images": [good], "metadata": [1]}).encode(): "'metadata'",
        json.dumps({"prompts": ["p", "q"], "images": [good]}).encode(): "length mismatch",
        json.dumps({"prompts": ["p", "q"], "images": [good, "@@not b64@@"]}).encode(): r"images\[1\]: not valid base64",
        json.dumps({"prompts": ["p"], "images": ["aGVsbG8="]}).encode(): r"images\[0\]: not a decodable PNG",
        json.dumps({"prompts": ["p", "q"], "images": [good, other_size]}).encode(): r"images\[1\]: size",
    }
    for body, pattern in cases.items():
        status, reply = _raw(url, body, JSON)
        assert status == 400, (body[:40], reply)
        assert re.search(pattern, reply["error"]), (pattern, reply)


def test_unknown_reward_404_lists_served(start):
    srv = start({"mean": _Mean(), "jpeg": build_reward("jpeg_compressibility")})
    with pytest.raises(RemoteRewardError, match=r"HTTP 404: unknown reward 'nope'; served: \['jpeg', 'mean'\]"):
        _remote(srv, "nope")(_photos(8)[:1], *_meta(1))
    assert srv.request_count == 1
    assert _raw(srv.url + "/elsewhere")[0] == 404
    assert _raw(srv.url + "/health") == (200, {"rewards": ["jpeg", "mean"]})


def test_raising_reward_500_retried_then_masked(start):
    _Raises.calls = 0
    srv = start({"boom": _Raises(), "mean": _Mean()})
    r = _remote(srv, "boom", retries=2, backoff_s=0.5)
    msg = r"failed after 3 attempt.*HTTP 500.*RuntimeError: detector exploded"
    with pytest.raises(RemoteRewardError, match=msg) as e:
        r(_photos(8), *_meta(4))
    assert srv.url in str(e.value) and e.value.status == 500
    assert _Raises.calls == 3 and len(r.sleeps) == 2
    assert 0.25 <= r.sleeps[0] < 0.5 and 0.5 <= r.sleeps[1] < 1.0  # exponential with jitter in [0.5, 1)
    r2 = _remote(srv, "boom", retries=2, backoff_s=0.5)
    with pytest.raises(RemoteRewardError):
        r2(_photos(8), *_meta(4))
    assert r2.sleeps == r.sleeps  # jitter is seeded deterministically
    scores, valid, n_failed = score_safely(_remote(srv, "boom", retries=1), _photos(8), *_meta(4), max_fail_frac=1.0)
    assert n_failed == 4 and not valid.any() and (scores == 0).all()
    assert _remote(srv, "mean")(_photos(8)[:1], *_meta(1)).scores.shape == (1,)  # server still alive


def test_nan_scores_travel_as_null_and_are_masked(start):
    srv = start({"nan": _Nan()})
    body = json.dumps({"prompts": ["p"] * 4, "images": encode_images(_photos(8))}).encode()
    status, reply = _raw(srv.url + "/score/nan", body, JSON)
    assert status == 200 and reply["scores"] == [1.0, None, 3.0, None] and reply["info"] == {"x": None}
    out = _remote(srv, "nan")(_photos(8), *_meta(4))
    assert out.scores[0] == 1.0 and out.scores[1].isnan() and out.scores[3].isnan()
    scores, valid, n_failed = score_safely(_remote(srv, "nan"), _photos(8), *_meta(4), max_fail_frac=0.5)
    assert valid.tolist() == [True, False, True, False] and n_failed == 2 and scores.tolist() == [1.0, 0.0, 3.0, 0.0]


def test_server_down_connection_error_retried(start):
    url = f"http://127.0.0.1:{_free_port()}"
    r = _remote(url, "mean", retries=3)
    msg = rf"'mean' at {url}/score/mean failed after 4 attempt.*connection error"
    with pytest.raises(RemoteRewardError, match=msg):
        r(_photos(8)[:2], *_meta(2))
    assert len(r.sleeps) == 3
    _, valid, n_failed = score_safely(r, _photos(8)[:2], *_meta(2), max_fail_frac=1.0)
    assert n_failed == 2
    with pytest.raises(RuntimeError, match="failed on 2/2"):
        score_safely(r, _photos(8)[:2], *_meta(2), max_fail_frac=0.5)


def test_timeout_is_retried(start):
    _Slow.calls = 0
    srv = start({"slow": _Slow()})
    r = _remote(srv, "slow", retries=1, timeout_s=0.1)
    with pytest.raises(RemoteRewardError, match="failed after 2 attempt.*timed out"):
        r(_photos(8)[:1], *_meta(1))
    assert len(r.sleeps) == 1


def test_cli_main_subprocess(tmp_path, monkeypatch):
    (tmp_path / "jagg_test_plugin.py").write_text(
        "import torch\n"
        "from jagg_scale.rewards import Reward, RewardOutput, register\n"
        "@register('_test_cli_plugin')\n"
        "class P(Reward):\n"
        "    def __call__(self, images, prompts, metadata):\n"
        "        return RewardOutput(scores=torch.full((images.shape[0],), 7.0))\n"
    )
    script = Path(sys.executable).parent / "jagg-reward-server"
    fallback = [sys.executable, "-c", "from jagg_scale.rewards.server import main; raise SystemExit(main())"]
    cmd = [str(script)] if script.exists() else fallback
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "JAGG_CLI_TOKEN": "tok"}
    for var in ("http_proxy", "HTTP_PROXY"):
        env.pop(var, None)
    proc = subprocess.Popen(
        cmd + ["--reward", 'jpeg_compressibility:{"quality": 80}', "--reward", "_test_cli_plugin",
               "--plugin", "jagg_test_plugin", "--port", "0", "--token-env", "JAGG_CLI_TOKEN",
               "--max-metadata-kb", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
        try:
            first = lines.get(timeout=WAIT_S)  # waits for the first line; the timeout is only a hang guard
        except queue.Empty:
            pytest.fail(f"server printed nothing within {WAIT_S} s")
        assert first.startswith("listening on http://127.0.0.1:"), (first, proc.poll())
        url = first.split()[-1]
        monkeypatch.setenv("JAGG_CLI_TOKEN", "tok")
        images, (prompts, meta) = _photos(32), _meta(4)
        remote = _remote(url, "jpeg_compressibility", token_env="JAGG_CLI_TOKEN")(images, prompts, meta)
        plugin = _remote(url, "_test_cli_plugin", token_env="JAGG_CLI_TOKEN")(images, prompts, meta)
        local = build_reward("jpeg_compressibility", quality=80)(images, prompts, meta)
        torch.testing.assert_close(remote.scores, local.scores)
        assert plugin.scores.tolist() == [7.0] * 4
        # --max-metadata-kb 1: one image's 2 KB of metadata is refused (413) before anything is decoded
        body = json.dumps({"prompts": ["p"], "metadata": [{"note": "x" * 2048}],
                           "images": encode_images(_photos(8)[:1])}).encode()
        req = urllib.request.Request(f"{url}/score/_test_cli_plugin", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer tok"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=WAIT_S)  # a hang guard only
        assert refused.value.code == 413
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=WAIT_S)  # a hang guard: the server exits on SIGINT at once
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert proc.returncode == 0, err
    assert "reward=jpeg_compressibility batch=4 status=200" in err


def test_cli_rejects_bad_specs(monkeypatch):
    from jagg_scale.rewards.server import main

    monkeypatch.delenv("JAGG_NO_SUCH_TOKEN", raising=False)
    for argv in (["--reward", "no_such_reward"], ["--reward", "jpeg_compressibility:{bad"],
                 ["--reward", 'jpeg_compressibility:{"qualty": 3}'],
                 ["--reward", "jpeg_compressibility", "--token-env", "JAGG_NO_SUCH_TOKEN"],
                 ["--reward", "jpeg_compressibility", "--plugin", "no_such_module_xyz"]):
        with pytest.raises(SystemExit) as e:
            main(argv + ["--port", "0"])
        assert e.value.code == 2, argv


# ------------------------------------------------------------------ limits: what a client with the token can cost


def _png_b64(side: int, mode: str = "1") -> str:
    """A side x side PNG of one colour: a few KB of body for side^2 pixels (a decompression bomb)."""
    buf = io.BytesIO()
    Image.new(mode, (side, side), 0).save(buf, format="PNG", optimize=True)
    return base64.b64encode(buf.getvalue()).decode()


def _score_body(images: list[str], metadata=None) -> bytes:
    req = {"prompts": ["p"] * len(images), "images": images}
    if metadata is not None:
        req["metadata"] = metadata
    return json.dumps(req).encode()


def test_pixel_bomb_is_refused_from_its_header_413(start, monkeypatch):
    """8000 x 8000 in 7.8 KB: over the per-image limit (4096^2 by default), refused before any pixel is decoded."""
    from jagg_scale.rewards import server_limits

    decoded = []
    monkeypatch.setattr(server_limits, "pixels", lambda img, where: decoded.append(where))
    _Mean.calls = 0
    srv = start({"mean": _Mean()})
    bomb = _png_b64(8000)
    assert len(base64.b64decode(bomb)) < 10_000
    status, reply = _raw(srv.url + "/score/mean", _score_body([bomb]), JSON)
    assert status == 413, reply
    assert re.search(r"images\[0\]: image of 8000x8000 exceeds the per-image limit of 16777216 pixels",
                     reply["error"])
    assert decoded == [] and _Mean.calls == 0


def test_per_image_pixel_limit_is_configurable(start):
    srv = start({"mean": _Mean()}, max_image_pixels=48 * 48)
    assert _remote(srv, "mean")(_photos(48), *_meta(4)).scores.shape == (4,)
    status, reply = _raw(srv.url + "/score/mean", _score_body([_png_b64(49)]), JSON)
    assert status == 413 and "49x49 exceeds the per-image limit of 2304 pixels" in reply["error"]
    r = _remote(srv, "mean", retries=3)
    with pytest.raises(RemoteRewardError, match="HTTP 413"):
        r(_photos(64), *_meta(4))
    assert r.sleeps == []  # a 4xx: not retried


def test_request_pixel_budget_413_before_decoding(start, monkeypatch):
    """Images each under the per-image limit but over the per-request budget together: 413, nothing decoded."""
    from jagg_scale.rewards import server_limits

    decoded = []
    monkeypatch.setattr(server_limits, "pixels", lambda img, where: decoded.append(where))
    srv = start({"mean": _Mean()})  # defaults: 4096^2 per image, 2^25 = two 4096^2 images per request
    status, reply = _raw(srv.url + "/score/mean", _score_body([_png_b64(4096)] * 3), JSON)
    assert status == 413, reply
    assert "3 images of 50331648 pixels in all exceed the per-request budget of 33554432 pixels" in reply["error"]
    assert decoded == []
    monkeypatch.undo()
    small = start({"mean": _Mean()}, max_request_pixels=3 * 16 * 16)
    assert _remote(small, "mean", max_batch=3)(_photos(16), *_meta(4)).scores.shape == (4,)  # 3 + 1 images
    with pytest.raises(RemoteRewardError, match="HTTP 413.*per-request budget of 768 pixels"):
        _remote(small, "mean")(_photos(16), *_meta(4))


def test_decoding_is_bounded_by_the_slots_under_16_concurrent_requests(start, monkeypatch):
    """16 clients at once: only `decode_slots` (2) requests decode at a time, the others wait for a slot (before,
    every request decoded at once, before the per-reward lock: N clients, N decoded batches in memory)."""
    inside, most, gate, lock = [0], [0], threading.Event(), threading.Lock()
    convert = Image.Image.convert

    def blocking_convert(img, *args, **kw):  # every decode passes here, and waits until the test lets it go
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            gate.wait(WAIT_S)  # a hang guard only
            return convert(img, *args, **kw)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(Image.Image, "convert", blocking_convert)
    srv = start({"mean": _Mean()})
    body = _score_body(encode_images(_photos(8)))
    results: list = []
    clients = [threading.Thread(target=lambda: results.append(_raw(srv.url + "/score/mean", body, JSON)))
               for _ in range(16)]
    for c in clients:
        c.start()
    slots = getattr(srv, "slots", None)
    deadline = time.monotonic() + WAIT_S  # a hang guard: 8 workers take 8 requests; 2 decode, 6 wait for a slot
    try:
        while not (slots and slots.held == 2 and slots.waiting == 6 and inside[0] == 2):
            assert most[0] <= 2, f"{most[0]} requests decoding at once"
            assert time.monotonic() < deadline
            time.sleep(POLL_S)
        assert most[0] == 2
    finally:
        gate.set()
    for c in clients:
        c.join(WAIT_S)
    assert [s for s, _ in results] == [200] * 16 and most[0] == 2


def test_deeply_nested_json_400_with_a_json_error(start):
    """100k nested arrays used to raise RecursionError in the handler: the connection closed with no reply."""
    _Mean.calls = 0
    srv = start({"mean": _Mean()})
    url = srv.url + "/score/mean"
    deep = b'{"prompts": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, reply = _raw(url, deep, JSON)
    assert status == 400 and "deeper than the limit of 32 levels" in reply["error"], reply
    nested: dict = {}
    for _ in range(40):  # parses fine, but no metadata needs 40 levels
        nested = {"a": nested}
    good = encode_images(_photos(8)[:1])
    status, reply = _raw(url, _score_body(good, [nested]), JSON)
    assert status == 400 and "deeper than the limit of 32 levels" in reply["error"], reply
    assert _Mean.calls == 0
    assert _raw(url, _score_body(good, [{"include": [{"class": "dog", "count": 2}]}]), JSON)[0] == 200


def test_a_body_that_is_not_json_415(start):
    _Mean.calls = 0
    srv = start({"mean": _Mean()})
    url = srv.url + "/score/mean"
    body = _score_body(encode_images(_photos(8)[:1]))
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        status, reply = _raw(url, body, {"Content-Type": ctype})
        assert status == 415 and "Content-Type must be application/json" in reply["error"], (ctype, reply)
    host, port = srv.server_address[:2]
    import http.client

    conn = http.client.HTTPConnection(host, port, timeout=WAIT_S)  # no Content-Type header at all
    conn.putrequest("POST", "/score/mean")
    conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body)
    r = conn.getresponse()
    assert r.status == 415 and "got 'none'" in json.loads(r.read())["error"]
    conn.close()
    assert _Mean.calls == 0
    assert _raw(url, body, {"Content-Type": "Application/JSON; charset=utf-8"})[0] == 200


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
    srv = serve({"mean": _Mean()}, max_connections_per_client=64)
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
class _Threads(_Counting):
    names: set = set()

    def score(self, images, prompts, metadata):
        type(self).names.add(threading.current_thread().name)
        return RewardOutput(scores=torch.zeros(images.shape[0]))


def test_a_fixed_pool_of_worker_threads_scores_64_connections(start):
    """A thread per connection meant 64 threads (and 64 bodies in memory) for 64 clients; now 8 workers score."""
    _Threads.names = set()
    srv = start({"threads": _Threads()}, max_connections_per_client=64)
    body = _score_body(encode_images(_photos(8)[:1]))
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
    (1.6 KB of body, 8.4 MP). The server's peak RSS (VmHWM) stays within its two decode slots' worth of pixels; the
    old server decoded all 16 at once (+1354 MB measured vs +250 MB now)."""
    from tools import server_memory

    side, slots = 2048, 2  # the server's defaults: decode_slots 2; 8.4 MP is within both pixel limits
    per_request = 2 * side * side
    r = server_memory.measure(clients=16, images=2, side=side, kind="bomb")
    assert r["statuses"] == {"200": 16}, r
    # one request in a slot: a uint8 batch (3 B/px) + the float batch (12 B/px) + one image's decode transient
    bound_mb = (slots * 15 * per_request + 2 * 7 * side * side) / 2**20 + 64  # + 64 MB for the allocator's slack
    assert r["peak_over_before_mb"] < bound_mb, (r, bound_mb)


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


def _wait_for(condition) -> None:
    deadline = time.monotonic() + WAIT_S  # a hang guard only
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(POLL_S)


def test_slowloris_is_cut_at_the_header_deadline_while_others_are_served(start, monkeypatch):
    """8 connections sending one header byte every 5 s stopped the old server from answering anyone: headers were read
    by its 8 worker threads, before the token, under a 60 s socket timeout that restarted with every byte. 16 such
    connections (a byte every 0.5 s) now cost the event loop a few KB each: a request with the token is scored
    meanwhile, and every slow connection is closed at the total header deadline (2 s here), bytes or not."""
    monkeypatch.setenv("JAGG_TEST_TOKEN", "s3cret")
    srv = start({"mean": _Mean()}, token="s3cret", header_timeout_s=2.0)
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
        _wait_for(lambda: len(started) == 16)
        out = _remote(srv, "mean", token_env="JAGG_TEST_TOKEN")(_photos(8)[:2], *_meta(2))
        assert out.scores.shape == (2,)
        for t in threads:  # each ends when the server closes its connection (the join's timeout is a hang guard)
            t.join(WAIT_S)
    finally:
        stop.set()
    assert sorted(closed) == list(range(16)), f"the server closed {len(closed)} of 16 slow connections"


@register("_test_server_gated")
class _Gated(_Counting):
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
    score = lambda: results.append(_remote(srv, "gated", token_env="JAGG_TEST_TOKEN")(_photos(8)[:1], *_meta(1)))
    busy = [threading.Thread(target=score, daemon=True) for _ in range(2)]
    try:
        for t in busy:
            t.start()
        _wait_for(lambda: srv.slots.held == 2 and _Gated.inside == 1)  # one in the reward, one at its lock
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
    srv = start({"mean": _Mean()})
    url = srv.url + "/score/mean"
    good = encode_images(_photos(8)[:1])[0]
    body = b'{"prompts": ["p"], "images": ["' + good.encode() + b'"], "metadata": [' + b"{}," * 1_500_000 + b"{}]}"
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak RSS, to the current RSS
        before = _vm("VmRSS")
    except OSError:  # not Linux, or not allowed: the refusal is still checked
        before = None
    status, reply = _raw(url, body, JSON)
    assert status == 413 and "more than the budget of 262144 JSON values" in reply["error"], reply
    if before is not None:
        grown = _vm("VmHWM") - before
        assert grown < 40 << 20, f"peak RSS grew by {grown >> 20} MB refusing a {len(body) >> 20} MB body"
    status, reply = _raw(url, _score_body([good], [{"text": "x" * 70_000}]), JSON)
    assert status == 413 and "metadata[0]: 70011 bytes of JSON exceed the per-image limit of 65536" in reply["error"]
    geneval = {"tag": "counting", "include": [{"class": "dog", "count": 2}], "exclude": [{"class": "dog", "count": 3}]}
    assert _raw(url, _score_body([good] * 4, [geneval] * 4), JSON)[0] == 200
    small = start({"mean": _Mean()}, max_json_values=20)  # the budget is the server's to set
    status, reply = _raw(small.url + "/score/mean", _score_body([good] * 4, [geneval] * 4), JSON)
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
    srv = start({"mean": _Mean()}, max_request_bytes=100_000)
    body = _score_body(encode_images(_photos(8)[:1]))
    status, reply = _post_chunked(srv, [body[:100], body[100:]])
    assert status == 200 and len(reply["scores"]) == 1, reply
    status, reply = _post_chunked(srv, [b"[" + b" " * (1 << 20)] * 4)
    assert status == 413 and "request body exceeds the server limit of 100000 bytes" in reply["error"], reply
    status, reply = _raw(srv.url + "/score/mean", b" " * (8 << 20), JSON)
    assert status == 413 and "body of 8388608 bytes exceeds the server limit of 100000 bytes" in reply["error"]


def test_a_stalled_body_is_answered_408_at_the_body_deadline(start):
    """The old server waited 60 s per byte, and then closed without a reply."""
    srv = start({"mean": _Mean()}, body_timeout_s=1.0)
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
    srv = start({"mean": _Mean()}, max_connections=6, max_connections_per_client=4, header_timeout_s=float(WAIT_S))
    held = [_connect(srv, "127.0.0.2") for _ in range(4)]
    _wait_for(lambda: srv.guard.total == 4)
    status, reply = _read_response(_connect(srv, "127.0.0.2"))
    assert status == 503 and "127.0.0.2 holds the per-client limit of 4 connections" in reply["error"], reply
    assert _health_from(srv, "127.0.0.3") == 200
    held += [_connect(srv, "127.0.0.3") for _ in range(2)]
    _wait_for(lambda: srv.guard.total == 6)
    status, reply = _read_response(_connect(srv, "127.0.0.4"))
    assert status == 503 and "limit of 6 connections" in reply["error"], reply
    held.pop(0).close()
    _wait_for(lambda: srv.guard.total == 5)
    assert _health_from(srv, "127.0.0.4") == 200
    for s in held:
        s.close()
    assert srv.guard.refused == 2
