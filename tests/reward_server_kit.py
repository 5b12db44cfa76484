"""What the reward-server tests share (tests/rewards/test_reward_server*.py): test-only rewards registered by name, the
scikit-image photos, a `remote` client that records its backoff, raw requests and request bodies. The `start`
fixture (a running server, shut down after the test) is in tests/rewards/conftest.py."""

from __future__ import annotations

import base64
import io
import json
import socket
import time
import urllib.error
import urllib.request

import numpy as np
import torch
from PIL import Image

from extras import need
from hang_guard import POLL_S, WAIT_S
from jagg_scale.rewards import Reward, RewardOutput, build_reward, register

class Counting(Reward):
    calls = 0

    def __call__(self, images, prompts, metadata):
        type(self).calls += 1
        return self.score(images, prompts, metadata)


@register("_test_server_mean")
class Mean(Counting):
    """Mean pixel value plus metadata["bias"]: checks images, prompts and metadata all arrive intact."""

    def score(self, images, prompts, metadata):
        s = images.mean(dim=(1, 2, 3)) + torch.tensor([float(m.get("bias", 0.0)) for m in metadata])
        return RewardOutput(scores=s, info={"n_prompts": len(prompts), "per_sample": s.tolist()})


@register("_test_server_raises")
class Raises(Counting):
    def score(self, images, prompts, metadata):
        raise RuntimeError("detector exploded")


@register("_test_server_nan")
class Nan(Counting):
    def score(self, images, prompts, metadata):
        return RewardOutput(scores=torch.tensor([1.0, float("nan"), 3.0, float("inf")]), info={"x": float("nan")})


@register("_test_server_slow")
class Slow(Counting):
    def score(self, images, prompts, metadata):
        time.sleep(0.4)
        return RewardOutput(scores=torch.zeros(images.shape[0]))



def wait_for(condition) -> None:
    """Poll until condition() holds (WAIT_S: a hang guard only)."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(POLL_S)


def photos(size: int = 48) -> torch.Tensor:
    """[4, 3, size, size]: scikit-image's astronaut and coffee photos, resized, plus their flips."""
    skdata = need("skimage.data")
    pics = (skdata.astronaut(), skdata.coffee())
    arrs = [np.asarray(Image.fromarray(a).resize((size, size), Image.BILINEAR)) for a in pics]
    x = torch.from_numpy(np.stack(arrs)).permute(0, 3, 1, 2).float() / 255.0
    return torch.cat([x, x.flip(-1)])


def prompts_meta(n: int) -> tuple[list[str], list[dict]]:
    return [f"prompt {i}" for i in range(n)], [{"bias": i} for i in range(n)]


def remote_reward(srv, reward: str, **kw):
    # the request timeout is a hang guard (tests/hang_guard.py); test_timeout_is_retried sets a short one on purpose
    kw = {"retries": 2, "backoff_s": 0.001, "timeout_s": float(WAIT_S), **kw}
    r = build_reward("remote", url=srv.url if hasattr(srv, "url") else srv, reward=reward, **kw)
    r.sleeps = []
    r.poster.sleep = r.sleeps.append  # record the backoff, do not wait
    return r


def post(url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers=headers or {}, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=WAIT_S) as r:  # a hang guard only (tests/hang_guard.py)
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


JSON = {"Content-Type": "application/json"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def png_b64(side: int, mode: str = "1") -> str:
    """A side x side PNG of one colour: a few KB of body for side^2 pixels (a decompression bomb)."""
    buf = io.BytesIO()
    Image.new(mode, (side, side), 0).save(buf, format="PNG", optimize=True)
    return base64.b64encode(buf.getvalue()).decode()


def score_body(images: list[str], metadata=None) -> bytes:
    req = {"prompts": ["p"] * len(images), "images": images}
    if metadata is not None:
        req["metadata"] = metadata
    return json.dumps(req).encode()


