"""Bad input, second round (issue 41), against the real server (uvicorn on a loopback socket): slow authenticated
bodies hold no worker (a normal request is scored while they trickle), a request the reward cannot take is a 422
the client does not retry, edit input images count toward the request's pixel budget, a connection the client
resets after an early reply is closed without an ERROR traceback, and every bad `jagg-reward-server` value is one
line and exit 2."""

from __future__ import annotations

import json
import logging
import select
import socket
import struct
import threading

import pytest
import torch

from hang_guard import WAIT_S
from jagg_scale.rewards import RewardOutput, register
from jagg_scale.rewards.remote import RemoteRewardError
from jagg_scale.rewards.server import encode_images, main
from extras import need
from reward_server_kit import JSON, Counting, Mean, photos, png_b64, post, prompts_meta, remote_reward, wait_for

need("uvicorn")
need("starlette")


def test_slow_authenticated_bodies_hold_no_worker_and_a_normal_request_is_scored_meanwhile(start, monkeypatch):
    """8 clients with the token announce 100 kB and send a byte every 0.2 s. They used to hold the 8 workers for the
    whole body deadline (a normal request waited 18-38 s); now they hold only the bytes they sent: a normal request
    is scored while every one of them is still sending, and the server holds a few hundred bytes for them."""
    monkeypatch.setenv("JAGG_TEST_TOKEN", "s3cret")
    srv = start({"mean": Mean()}, token="s3cret", workers=8)
    stop, sent = threading.Event(), [0] * 8
    head = (b"POST /score/mean HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\nContent-Type: application/json"
            b"\r\nContent-Length: 100000\r\n\r\n")
    socks = [socket.create_connection(srv.server_address, timeout=WAIT_S) for _ in range(8)]

    def trickle(i: int) -> None:
        socks[i].sendall(head)
        while not stop.wait(0.2):
            socks[i].sendall(b" ")
            sent[i] += 1

    threads = [threading.Thread(target=trickle, args=(i,), daemon=True) for i in range(8)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: min(sent) >= 3 and srv._bodies.held >= 8)  # every slow body is being read
        out = remote_reward(srv, "mean", token_env="JAGG_TEST_TOKEN")(photos(8)[:2], *prompts_meta(2))
        assert out.scores.shape == (2,)
        # scored while all 8 bodies were still arriving: none of them has had a reply (a 408 at the deadline) or a close
        assert not select.select(socks, [], [], 0)[0] and all(n < 100_000 for n in sent)
        assert srv._bodies.held <= sum(sent) + 8  # the bytes they sent, not 8 x 100 kB nor 8 workers
    finally:
        stop.set()
        for t in threads:
            t.join(WAIT_S)
        for s in socks:
            s.close()


@register("_test_round2_videos")
class _Videos(Counting):
    inputs = "videos"

    def score(self, videos, prompts, metadata):
        return RewardOutput(scores=videos.mean(dim=(1, 2, 3, 4)))


def test_a_request_the_reward_cannot_take_is_422_and_is_not_retried(start):
    """Videos to an image reward, images to a video reward: 422 naming both kinds, one request (no retry: 4xx)."""
    srv = start({"mean": Mean(), "videos": _Videos()})
    frames = [encode_images(photos(8)[:3])] * 2  # 2 videos of 3 frames
    status, reply = post(f"{srv.url}/score/mean", json.dumps(
        {"prompts": ["a", "b"], "videos": frames}).encode(), JSON)
    assert status == 422 and reply["error"] == "reward 'mean' scores images; this request sends videos", reply
    before = srv.request_count
    with pytest.raises(RemoteRewardError, match="HTTP 422.*'videos' scores videos; this request sends images"):
        remote_reward(srv, "videos")(photos(8)[:2], *prompts_meta(2))
    assert srv.request_count == before + 1  # asked once: a 4xx is not retried


@register("_test_round2_refuses")
class _Refuses(Counting):
    def score(self, images, prompts, metadata):
        raise ValueError("this reward takes square images only")


def test_a_reward_refusing_its_input_is_422_and_not_retried(start):
    srv = start({"refuses": _Refuses()})
    before = srv.request_count
    with pytest.raises(RemoteRewardError, match="HTTP 422.*cannot take this request: this reward takes square"):
        remote_reward(srv, "refuses")(photos(8)[:2], *prompts_meta(2))
    assert srv.request_count == before + 1


def test_edit_input_images_count_toward_the_request_pixel_budget(start):
    """2 outputs of 16 x 16 fit a 600-pixel budget (512); with their edit inputs they do not (768 at the first):
    413 naming the input image that crossed it, nothing scored."""
    srv = start({"mean": Mean()}, max_request_pixels=600)
    Mean.calls = 0
    outputs = [png_b64(16, "RGB")] * 2
    status, _ = post(f"{srv.url}/score/mean", json.dumps({"prompts": ["a", "b"], "images": outputs}).encode(), JSON)
    assert status == 200
    body = {"prompts": ["a", "b"], "images": outputs, "input_images": [png_b64(16, "RGB")] * 2}
    status, reply = post(f"{srv.url}/score/mean", json.dumps(body).encode(), JSON)
    assert status == 413 and "exceed the per-request budget of 600 pixels at input_images[0]" in reply["error"]
    assert Mean.calls == 1


def test_a_connection_reset_after_an_early_reply_is_closed_without_an_error(start, caplog):
    """An early reply (413 from the announced length) asks to close while the client still owes its body; clients
    that reset right then made uvicorn log a ~40-line ERROR traceback each (160 -> 111). 40 of them: none."""
    srv = start({"mean": Mean()}, max_request_bytes=1000)
    caplog.set_level(logging.INFO)
    for _ in range(40):
        s = socket.create_connection(srv.server_address, timeout=WAIT_S)
        s.sendall(b"POST /score/mean HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 50000\r\n\r\n" + b" " * 1000)
        assert s.recv(12).startswith(b"HTTP/1.1 413")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        s.close()
    status, _ = post(f"{srv.url}/score/mean", json.dumps({"prompts": ["a"], "images": [png_b64(8, "RGB")]}).encode(),
                     JSON)
    assert status == 200  # the server is fine
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors][:3]


@pytest.mark.parametrize("args,message", [
    (["--max-request-mb", "inf"], "argument --max-request-mb: inf is out of range: (0, 4096]"),
    (["--max-request-mb", "0"], "argument --max-request-mb: 0 is out of range"),
    (["--max-request-mb", "-5"], "argument --max-request-mb: -5 is out of range"),
    (["--port", "99999"], "argument --port: 99999 is out of range: [0, 65535]"),
    (["--port", "x"], "argument --port: 'x' is not an integer"),
    (["--body-timeout", "nan"], "argument --body-timeout: nan is out of range"),
    (["--host", "256.1.1.1", "--port", "0"], "--host 256.1.1.1 --port 0: cannot listen there"),
    (["--workers", "0"], "workers must be an int >= 1, got 0"),
])
def test_every_bad_server_value_is_one_line_and_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as code:
        main(["--reward", "jpeg_compressibility", *args])
    err = capsys.readouterr().err
    assert code.value.code == 2 and message in err and "Traceback" not in err, err


def test_a_latent_reward_is_not_served(capsys):
    with pytest.raises(SystemExit) as code:
        main(["--reward", "_test_round2_latents"])
    assert code.value.code == 2 and "scores a diffusion model's latents" in capsys.readouterr().err


@register("_test_round2_latents")
class _Latents(Counting):
    on_latents = True

    def score(self, latents, prompts, metadata):
        return RewardOutput(scores=torch.zeros(len(prompts)))
