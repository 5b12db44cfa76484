"""Remote rewards over loopback: `jagg-reward-server` + the `remote` client agree with local scoring, and every
failure mode (auth, size limit, bad input, unknown reward, crashing reward, NaN, dead server) surfaces as the
documented status/message, retried only when retrying can help. What a client with the token can cost the server
is bounded: pixel limits read from the PNG headers (413 before decoding), decode slots, a JSON depth limit (400, not
a dropped connection), JSON bodies only (415). Every test runs the real server: uvicorn on a loopback socket
(its connections, workers and hostile clients: test_reward_server_clients.py)."""

from __future__ import annotations

import base64
import http.client
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from PIL import Image

from hang_guard import POLL_S, WAIT_S
from jagg_scale.rewards import build_reward, score_safely
from jagg_scale.rewards.remote import RemoteRewardError
from jagg_scale.rewards.server import encode_images
from extras import need
from reward_server_kit import (JSON, Mean, Nan, Raises, Slow, free_port, photos, png_b64, post, prompts_meta,
                               remote_reward, score_body)

need("uvicorn")  # the [server] extra: the server runs on uvicorn + starlette
need("starlette")


# ----------------------------------------------------------------------------------------------- tests


def test_remote_jpeg_matches_local_on_photos(start):
    images = photos()
    prompts, meta = prompts_meta(4)
    srv = start({"jpeg_compressibility": build_reward("jpeg_compressibility", quality=90)})
    local = build_reward("jpeg_compressibility", quality=90)(images, prompts, meta)
    remote = remote_reward(srv, "jpeg_compressibility")(images, prompts, meta)
    assert remote.scores.dtype == torch.float32
    torch.testing.assert_close(remote.scores, local.scores, rtol=0, atol=0)
    assert remote.scores.min() < -1.0  # real photos, real kB
    assert remote.info["jpeg_kb_mean"] == pytest.approx(local.info["jpeg_kb_mean"])
    assert remote.info["remote_retries"] == 0


def test_max_batch_splits_requests_and_merges(start):
    images = photos(16).repeat(2, 1, 1, 1)[:7]
    prompts, meta = prompts_meta(7)
    srv = start({"mean": Mean()})
    expected = images.mean(dim=(1, 2, 3)) + torch.arange(7.0)
    one = remote_reward(srv, "mean")(images, prompts, meta)
    n0 = srv.request_count
    split = remote_reward(srv, "mean", max_batch=3)(images, prompts, meta)
    assert srv.request_count - n0 == 3  # 3 + 3 + 1
    torch.testing.assert_close(split.scores, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(split.scores, one.scores)
    assert split.info["per_sample"] == pytest.approx(expected.tolist(), abs=1e-6)  # lists concatenated
    assert split.info["n_prompts"] == pytest.approx((3 * 3 + 3 * 3 + 1 * 1) / 7)  # size-weighted mean


def test_bearer_token(start, monkeypatch):
    srv = start({"mean": Mean()}, token="s3cret")
    images, (prompts, meta) = photos(8)[:2], prompts_meta(2)
    with pytest.raises(RemoteRewardError, match="HTTP 401.*bearer token") as e:
        remote_reward(srv, "mean")(images, prompts, meta)
    assert e.value.status == 401
    monkeypatch.setenv("JAGG_TEST_TOKEN", "wrong")
    n0 = srv.request_count
    with pytest.raises(RemoteRewardError, match="HTTP 401"):
        remote_reward(srv, "mean", token_env="JAGG_TEST_TOKEN")(images, prompts, meta)
    assert srv.request_count - n0 == 1  # 4xx is not retried
    monkeypatch.setenv("JAGG_TEST_TOKEN", "s3cret")
    assert remote_reward(srv, "mean", token_env="JAGG_TEST_TOKEN")(images, prompts, meta).scores.shape == (2,)
    assert post(srv.url + "/health")[0] == 401
    assert post(srv.url + "/health", headers={"Authorization": "Bearer s3cret"}) == (200, {"rewards": ["mean"]})
    monkeypatch.delenv("JAGG_TEST_TOKEN")
    with pytest.raises(ValueError, match="JAGG_TEST_TOKEN"):  # a missing token fails at build time
        build_reward("remote", url=srv.url, reward="mean", token_env="JAGG_TEST_TOKEN")


def test_oversized_request_413_not_retried(start):
    Mean.calls = 0
    srv = start({"mean": Mean()}, max_request_bytes=4000)
    r = remote_reward(srv, "mean", retries=3)
    with pytest.raises(RemoteRewardError, match="HTTP 413.*exceeds the server limit of 4000 bytes") as e:
        r(photos(64), *prompts_meta(4))
    assert e.value.status == 413 and srv.request_count == 1 and r.sleeps == [] and Mean.calls == 0
    small = photos(16)  # one 16x16 photo per request stays under the limit
    assert remote_reward(srv, "mean", max_batch=1)(small, *prompts_meta(4)).scores.shape == (4,)


def test_bad_requests_400_name_the_field(start):
    srv = start({"mean": Mean()})
    url = srv.url + "/score/mean"
    good, other_size = encode_images(photos(8)[:1])[0], encode_images(photos(4)[:1])[0]
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
        status, reply = post(url, body, JSON)
        assert status == 400, (body[:40], reply)
        assert re.search(pattern, reply["error"]), (pattern, reply)


def test_unknown_reward_404_lists_served(start):
    srv = start({"mean": Mean(), "jpeg": build_reward("jpeg_compressibility")})
    with pytest.raises(RemoteRewardError, match=r"HTTP 404: unknown reward 'nope'; served: \['jpeg', 'mean'\]"):
        remote_reward(srv, "nope")(photos(8)[:1], *prompts_meta(1))
    assert srv.request_count == 1
    assert post(srv.url + "/elsewhere")[0] == 404
    assert post(srv.url + "/health") == (200, {"rewards": ["jpeg", "mean"]})


def test_raising_reward_500_retried_then_masked(start):
    Raises.calls = 0
    srv = start({"boom": Raises(), "mean": Mean()})
    r = remote_reward(srv, "boom", retries=2, backoff_s=0.5)
    msg = r"failed after 3 attempt.*HTTP 500.*RuntimeError: detector exploded"
    with pytest.raises(RemoteRewardError, match=msg) as e:
        r(photos(8), *prompts_meta(4))
    assert srv.url in str(e.value) and e.value.status == 500
    assert Raises.calls == 3 and len(r.sleeps) == 2
    assert 0.25 <= r.sleeps[0] < 0.5 and 0.5 <= r.sleeps[1] < 1.0  # exponential with jitter in [0.5, 1)
    r2 = remote_reward(srv, "boom", retries=2, backoff_s=0.5)
    with pytest.raises(RemoteRewardError):
        r2(photos(8), *prompts_meta(4))
    assert r2.sleeps == r.sleeps  # jitter is seeded deterministically
    scores, valid, n_failed = score_safely(remote_reward(srv, "boom", retries=1), photos(8), *prompts_meta(4),
                                           max_fail_frac=1.0)
    assert n_failed == 4 and not valid.any() and (scores == 0).all()
    assert remote_reward(srv, "mean")(photos(8)[:1], *prompts_meta(1)).scores.shape == (1,)  # server still alive


def test_nan_scores_travel_as_null_and_are_masked(start):
    srv = start({"nan": Nan()})
    body = json.dumps({"prompts": ["p"] * 4, "images": encode_images(photos(8))}).encode()
    status, reply = post(srv.url + "/score/nan", body, JSON)
    assert status == 200 and reply["scores"] == [1.0, None, 3.0, None] and reply["info"] == {"x": None}
    out = remote_reward(srv, "nan")(photos(8), *prompts_meta(4))
    assert out.scores[0] == 1.0 and out.scores[1].isnan() and out.scores[3].isnan()
    scores, valid, n_failed = score_safely(remote_reward(srv, "nan"), photos(8), *prompts_meta(4), max_fail_frac=0.5)
    assert valid.tolist() == [True, False, True, False] and n_failed == 2 and scores.tolist() == [1.0, 0.0, 3.0, 0.0]


def test_server_down_connection_error_retried(start):
    url = f"http://127.0.0.1:{free_port()}"
    r = remote_reward(url, "mean", retries=3)
    msg = rf"'mean' at {url}/score/mean failed after 4 attempt.*connection error"
    with pytest.raises(RemoteRewardError, match=msg):
        r(photos(8)[:2], *prompts_meta(2))
    assert len(r.sleeps) == 3
    _, valid, n_failed = score_safely(r, photos(8)[:2], *prompts_meta(2), max_fail_frac=1.0)
    assert n_failed == 2
    with pytest.raises(RuntimeError, match="failed on 2/2"):
        score_safely(r, photos(8)[:2], *prompts_meta(2), max_fail_frac=0.5)


def test_timeout_is_retried(start):
    Slow.calls = 0
    srv = start({"slow": Slow()})
    r = remote_reward(srv, "slow", retries=1, timeout_s=0.1)
    with pytest.raises(RemoteRewardError, match="failed after 2 attempt.*timed out"):
        r(photos(8)[:1], *prompts_meta(1))
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
        images, (prompts, meta) = photos(32), prompts_meta(4)
        remote = remote_reward(url, "jpeg_compressibility", token_env="JAGG_CLI_TOKEN")(images, prompts, meta)
        plugin = remote_reward(url, "_test_cli_plugin", token_env="JAGG_CLI_TOKEN")(images, prompts, meta)
        local = build_reward("jpeg_compressibility", quality=80)(images, prompts, meta)
        torch.testing.assert_close(remote.scores, local.scores)
        assert plugin.scores.tolist() == [7.0] * 4
        # --max-metadata-kb 1: one image's 2 KB of metadata is refused (413) before anything is decoded
        body = json.dumps({"prompts": ["p"], "metadata": [{"note": "x" * 2048}],
                           "images": encode_images(photos(8)[:1])}).encode()
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


def test_pixel_bomb_is_refused_from_its_header_413(start, monkeypatch):
    """8000 x 8000 in 7.8 KB: over the per-image limit (4096^2 by default), refused before any pixel is decoded."""
    from jagg_scale.rewards import server_limits

    decoded = []
    monkeypatch.setattr(server_limits, "pixels", lambda img, where: decoded.append(where))
    Mean.calls = 0
    srv = start({"mean": Mean()})
    bomb = png_b64(8000)
    assert len(base64.b64decode(bomb)) < 10_000
    status, reply = post(srv.url + "/score/mean", score_body([bomb]), JSON)
    assert status == 413, reply
    assert re.search(r"images\[0\]: image of 8000x8000 exceeds the per-image limit of 16777216 pixels",
                     reply["error"])
    assert decoded == [] and Mean.calls == 0


def test_per_image_pixel_limit_is_configurable(start):
    srv = start({"mean": Mean()}, max_image_pixels=48 * 48)
    assert remote_reward(srv, "mean")(photos(48), *prompts_meta(4)).scores.shape == (4,)
    status, reply = post(srv.url + "/score/mean", score_body([png_b64(49)]), JSON)
    assert status == 413 and "49x49 exceeds the per-image limit of 2304 pixels" in reply["error"]
    r = remote_reward(srv, "mean", retries=3)
    with pytest.raises(RemoteRewardError, match="HTTP 413"):
        r(photos(64), *prompts_meta(4))
    assert r.sleeps == []  # a 4xx: not retried


def test_request_pixel_budget_413_before_decoding(start, monkeypatch):
    """Images each under the per-image limit but over the per-request budget together: 413, nothing decoded."""
    from jagg_scale.rewards import server_limits

    decoded = []
    monkeypatch.setattr(server_limits, "pixels", lambda img, where: decoded.append(where))
    srv = start({"mean": Mean()})  # defaults: 4096^2 per image, 2^25 = two 4096^2 images per request
    status, reply = post(srv.url + "/score/mean", score_body([png_b64(4096)] * 3), JSON)
    assert status == 413, reply
    assert "3 images of 50331648 pixels in all exceed the per-request budget of 33554432 pixels" in reply["error"]
    assert decoded == []
    monkeypatch.undo()
    small = start({"mean": Mean()}, max_request_pixels=3 * 16 * 16)
    assert remote_reward(small, "mean", max_batch=3)(photos(16), *prompts_meta(4)).scores.shape == (4,)  # 3 + 1 images
    with pytest.raises(RemoteRewardError, match="HTTP 413.*per-request budget of 768 pixels"):
        remote_reward(small, "mean")(photos(16), *prompts_meta(4))


def test_decoding_is_bounded_by_the_slots_under_16_concurrent_requests(start, monkeypatch):
    """16 clients at once: only `decode_slots` (2) batches decode at a time, the other requests wait for a slot or
    for the batch that took them (before the slots, every request decoded at once: N clients, N decoded batches in
    memory). Each request's rows are scored once, its own."""
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
    srv = start({"mean": Mean()})
    body = score_body(encode_images(photos(8)))
    results: list = []
    clients = [threading.Thread(target=lambda: results.append(post(srv.url + "/score/mean", body, JSON)))
               for _ in range(16)]
    for c in clients:
        c.start()
    slots = getattr(srv, "slots", None)
    deadline = time.monotonic() + WAIT_S  # a hang guard: 8 workers take 8 requests; 2 batches decode
    try:
        while not (slots and slots.held == 2 and inside[0] == 2):
            assert most[0] <= 2, f"{most[0]} batches decoding at once"
            assert time.monotonic() < deadline
            time.sleep(POLL_S)
        time.sleep(10 * POLL_S)  # the others have queued: still two
        assert most[0] == 2 and slots.held == 2
    finally:
        gate.set()
    for c in clients:
        c.join(WAIT_S)
    assert [s for s, _ in results] == [200] * 16 and most[0] == 2
    assert sum(srv.batchers["mean"].batches) == 16 * 4  # every request's 4 rows scored once
    expected = results[0][1]["scores"]
    assert len(expected) == 4 and all(b["scores"] == expected for _, b in results)  # its own rows' scores


def test_deeply_nested_json_400_with_a_json_error(start):
    """100k nested arrays used to raise RecursionError in the handler: the connection closed with no reply."""
    Mean.calls = 0
    srv = start({"mean": Mean()})
    url = srv.url + "/score/mean"
    deep = b'{"prompts": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, reply = post(url, deep, JSON)
    assert status == 400 and "deeper than the limit of 32 levels" in reply["error"], reply
    nested: dict = {}
    for _ in range(40):  # parses fine, but no metadata needs 40 levels
        nested = {"a": nested}
    good = encode_images(photos(8)[:1])
    status, reply = post(url, score_body(good, [nested]), JSON)
    assert status == 400 and "deeper than the limit of 32 levels" in reply["error"], reply
    assert Mean.calls == 0
    assert post(url, score_body(good, [{"include": [{"class": "dog", "count": 2}]}]), JSON)[0] == 200


def test_a_body_that_is_not_json_415(start):
    Mean.calls = 0
    srv = start({"mean": Mean()})
    url = srv.url + "/score/mean"
    body = score_body(encode_images(photos(8)[:1]))
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        status, reply = post(url, body, {"Content-Type": ctype})
        assert status == 415 and "Content-Type must be application/json" in reply["error"], (ctype, reply)
    host, port = srv.server_address[:2]

    conn = http.client.HTTPConnection(host, port, timeout=WAIT_S)  # no Content-Type header at all
    conn.putrequest("POST", "/score/mean")
    conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body)
    r = conn.getresponse()
    assert r.status == 415 and "got 'none'" in json.loads(r.read())["error"]
    conn.close()
    assert Mean.calls == 0
    assert post(url, body, {"Content-Type": "Application/JSON; charset=utf-8"})[0] == 200


# ------------------------------------------------------------------ batching (issue 39): many clients, few calls
class SlowMean(Mean):
    """Mean, 0.2 s a call whatever its size (a judge on a GPU), its first call 1 s: the requests that arrive meanwhile
    queue, every client's among them even on a loaded machine."""

    def __init__(self):
        self.scored = 0  # this server's calls (Counting's count is the class's, over every test)

    def score(self, images, prompts, metadata):
        self.scored += 1
        time.sleep(1.0 if self.scored == 1 else 0.2)
        return super().score(images, prompts, metadata)


def _truncated_png(side: int) -> str:
    """A PNG whose header is valid (size read, limits pass) and whose pixel data is cut off: it fails at decode."""
    raw = base64.b64decode(encode_images(photos(side)[:1])[0])
    return base64.b64encode(raw[: len(raw) // 2]).decode()


def test_concurrent_requests_are_scored_in_batches_each_request_its_own_rows(start):
    """12 clients at once, each its own bias (so its own scores), two image sizes: the reward is called a few
    times on batches of several requests of one size, each client gets exactly its local scores (and its rows of a
    per-row info list), a request whose pixels fail to decode is refused alone (400) within its batch, and
    --batch-rows 1 is one call per request (the old server)."""
    def body(k: int) -> bytes:
        if k == 5:
            return score_body([_truncated_png(16)] * 2, [{"bias": k}] * 2)
        side = 16 if k % 2 else 8
        return score_body(encode_images(photos(side)[:2]), [{"bias": k}, {"bias": k + 0.5}])

    def expect(k: int) -> list[float]:
        means = photos(16 if k % 2 else 8)[:2].mean(dim=(1, 2, 3))
        return (means + torch.tensor([k, k + 0.5])).tolist()

    for rows, calls in ((64, range(2, 9)), (1, range(11, 12))):
        srv = start({"mean": SlowMean()}, workers=16, decode_slots=2, batch_rows=rows)
        results: dict[int, tuple] = {}
        clients = [threading.Thread(target=lambda k=k, r=results, url=srv.url: r.__setitem__(
            k, post(url + "/score/mean", body(k), JSON))) for k in range(12)]
        for c in clients:
            c.start()
        for c in clients:
            c.join(WAIT_S)
        assert results[5][0] == 400 and "not a decodable PNG" in results[5][1]["error"]
        for k in set(range(12)) - {5}:
            status, reply = results[k]
            assert status == 200 and reply["scores"] == pytest.approx(expect(k), abs=1e-6), k
            assert reply["info"]["per_sample"] == pytest.approx(expect(k), abs=1e-6)  # a per-row list: its rows
        batches = srv.batchers["mean"].batches
        assert sum(batches) == 22 and len(batches) in calls, batches  # 11 requests of 2 rows
        assert max(batches) == 2 if rows == 1 else max(batches) > 2  # one request a call, or several
