"""`remote`: score with a reward served by `jagg-reward-server` on another machine.

Heavy scorers (object detectors, VLM judges) run where their GPUs and environments are; the trainer only
holds a URL. Networks and servers fail transiently, so connection errors, timeouts and 5xx answers are
retried with exponential backoff; a 4xx answer means the request itself is wrong (bad token, unknown
reward, batch too large) and retrying cannot help, so it raises at once with the server's message. When
retries run out the error names the URL and the last cause; `score_safely` then masks the batch and
counts it against `max_fail_frac`, so a dead server stops the run instead of training on nothing.

Only the stdlib (urllib) is used, so the client adds no dependency to the trainer.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import time
import urllib.error
import urllib.request
import zlib
from http.client import HTTPException
from typing import Sequence
from urllib.parse import quote

import torch

from .base import Reward, RewardOutput, cancelled, register
from .server import encode_images

__all__ = ["RemoteReward", "RemoteRewardError", "retry_budget_problem", "worst_case_s"]

_MAX_BACKOFF_S = 60.0


def worst_case_s(timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 1.0) -> float:
    """The longest one request (one max_batch chunk) can keep a rank waiting by these options: every attempt timing
    out, and the longest backoff before each retry (the jitter factor < 1 taken as 1). timeout_s bounds each socket
    wait (connect, each read), so a server that keeps sending a byte now and then is cut by the reward's deadline,
    not by this."""
    return (retries + 1) * timeout_s + sum(min(backoff_s * 2**k, _MAX_BACKOFF_S) for k in range(retries))


def retry_budget_problem(cls: type, options: dict, deadline_s: float) -> str | None:
    """For a reward class that retries requests (remote, vlm_judge: `retries_requests`): the refusal when one
    request's worst case by its options overruns the reward's deadline (its rows would be masked while it still
    retries, the budget spent for nothing), else None. The config checks it at start-up (train/config.py)."""
    import inspect

    if not getattr(cls, "retries_requests", False):
        return None
    defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    o = {k: options.get(k, defaults[k]) for k in ("timeout_s", "retries", "backoff_s")}
    budget = worst_case_s(**o)
    if budget <= deadline_s:
        return None
    return (f"{cls.name}: timeout_s {o['timeout_s']:g} x {o['retries'] + 1} attempts + up to "
            f"{budget - (o['retries'] + 1) * o['timeout_s']:g} s of backoff = {budget:g} s, beyond reward.deadline_s = "
            f"{deadline_s:g} s (its rows would be masked while it still retries): lower timeout_s or retries, or raise "
            "reward.deadline_s")


class RemoteRewardError(RuntimeError):
    """A remote scoring request failed; `status` is the HTTP status (None for connection errors/timeouts)."""

    def __init__(self, message: str, status: int | None = None, retryable: bool = False):
        super().__init__(message)
        self.status = status
        self.retryable = retryable


class JsonPoster:
    """POST a JSON body to one endpoint with retries: connection errors, timeouts and 5xx answers are retried with
    exponential backoff (before retry k: backoff_s * 2**k times a jitter factor in [0.5, 1), capped at 60 s; the
    jitter from a generator seeded by `seed`, reproducible per rank), a 4xx raises at once with the server's message.
    worst_case_s(timeout_s, retries, backoff_s) bounds one post. Shared by `remote` and `vlm_judge`."""

    def __init__(self, endpoint: str, *, timeout_s: float, retries: int, backoff_s: float, token: str | None,
                 seed: str, what: str):
        self.endpoint, self.timeout_s, self.retries, self.backoff_s = endpoint, timeout_s, retries, backoff_s
        self.token, self.what = token, what
        self._rng = random.Random(zlib.crc32(f"{seed}|{os.environ.get('RANK', '0')}".encode()))
        self.sleep = time.sleep  # tests swap this to observe backoff without waiting

    def post(self, body: bytes) -> tuple[dict, int]:
        """POST with retries -> (parsed JSON reply, number of retries used)."""
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        last: RemoteRewardError | None = None
        for attempt in range(self.retries + 1):
            if cancelled():  # the chunk is past the reward's deadline: its rows are masked, stop asking
                raise RemoteRewardError(f"{self.what} at {self.endpoint}: given up after {attempt} attempt(s), past "
                                        "reward.deadline_s")
            if attempt:
                delay = min(self.backoff_s * 2 ** (attempt - 1), _MAX_BACKOFF_S) * (0.5 + 0.5 * self._rng.random())
                self.sleep(delay)
            try:
                return self._post_once(body, headers), attempt
            except RemoteRewardError as e:
                if not e.retryable:
                    raise
                last = e
        raise RemoteRewardError(
            f"{self.what} at {self.endpoint} failed after {self.retries + 1} attempt(s); last error: {last}",
            status=last.status if last else None) from last

    def _post_once(self, body: bytes, headers: dict) -> dict:
        req = urllib.request.Request(self.endpoint, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            msg = _error_message(e)
            raise RemoteRewardError(f"{self.endpoint}: HTTP {e.code}: {msg}", status=e.code,
                                    retryable=e.code >= 500) from None
        except urllib.error.URLError as e:  # connection refused, DNS, timeout while connecting or sending
            kind = "timed out" if isinstance(e.reason, (TimeoutError, socket.timeout)) else "connection error"
            raise RemoteRewardError(f"{self.endpoint}: {kind}: {e.reason}", retryable=True) from None
        except (TimeoutError, socket.timeout) as e:
            msg = f"{self.endpoint}: timed out after {self.timeout_s} s ({e})"
            raise RemoteRewardError(msg, retryable=True) from None
        except (ConnectionError, HTTPException, OSError) as e:  # reset / dropped mid-response
            raise RemoteRewardError(f"{self.endpoint}: connection error: {type(e).__name__}: {e}",
                                    retryable=True) from None
        try:
            reply = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RemoteRewardError(f"{self.endpoint}: reply is not JSON ({e}): {raw[:200]!r}") from None
        if not isinstance(reply, dict):
            raise RemoteRewardError(f"{self.endpoint}: reply is not a JSON object: {raw[:200]!r}")
        return reply


@register("remote")
class RemoteReward(Reward):
    """Proxy for the reward `reward` served at `url` (e.g. url="http://scorer:8000", reward="geneval").

    `retries` is the number of *extra* attempts after the first (retries=3 -> at most 4 requests per chunk).
    The backoff before retry k (0-based) is backoff_s * 2**k times a jitter factor in [0.5, 1), capped at
    60 s; the jitter comes from a generator seeded by (url, reward, RANK) so runs are reproducible while
    ranks hitting one server do not retry in lockstep. `max_batch` splits a batch into several requests
    (keeps bodies under the server's size limit and its per-call memory bounded). `token_env` names the
    environment variable holding the bearer token; it is read once, at build time, so a missing token fails
    when the config is loaded rather than on the first batch.
    """

    retries_requests = True  # its timeout_s / retries / backoff_s are checked against reward.deadline_s
    inputs = "any"  # images or videos: the server it calls decides (jagg-reward-server: 422 naming why)

    def __init__(self, *, url: str, reward: str, timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 1.0,
                 token_env: str | None = None, max_batch: int | None = None):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"remote: url must start with http:// or https://, got {url!r}")
        if not isinstance(reward, str) or not reward:
            raise ValueError(f"remote: reward must be a non-empty name, got {reward!r}")
        if not timeout_s > 0:
            raise ValueError(f"remote: timeout_s must be > 0, got {timeout_s!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"remote: retries must be an int >= 0, got {retries!r}")
        if not backoff_s >= 0:
            raise ValueError(f"remote: backoff_s must be >= 0, got {backoff_s!r}")
        if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
            raise ValueError(f"remote: max_batch must be an int >= 1 or None, got {max_batch!r}")
        self.url = url.rstrip("/")
        self.remote_name = reward
        self.endpoint = f"{self.url}/score/{quote(reward, safe='')}"
        self.timeout_s = float(timeout_s)
        self.retries = retries
        self.backoff_s = float(backoff_s)
        self.max_batch = max_batch
        self._token = None
        if token_env:
            self._token = os.environ.get(token_env)
            if not self._token:
                raise ValueError(f"remote: token_env {token_env!r} is unset or empty")
        self.poster = JsonPoster(self.endpoint, timeout_s=self.timeout_s, retries=retries, backoff_s=self.backoff_s,
                                 token=self._token, seed=f"{self.url}|{reward}",
                                 what=f"remote reward {reward!r}")

    def __repr__(self) -> str:
        return f"RemoteReward(url={self.url!r}, reward={self.remote_name!r})"

    # ------------------------------------------------------------------------------------------ scoring

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> RewardOutput:
        b = int(images.shape[0])
        if len(prompts) != b or len(metadata) != b:
            raise ValueError(f"batch mismatch: {b} images, {len(prompts)} prompts, {len(metadata)} metadata entries")
        if b == 0:
            return RewardOutput(scores=torch.zeros(0, dtype=torch.float32))
        step = self.max_batch or b
        scores, infos, sizes, n_retries = [], [], [], 0
        for i in range(0, b, step):
            body = self._body(images[i : i + step], prompts[i : i + step], metadata[i : i + step])
            resp, tries = self.poster.post(body)
            n_retries += tries
            chunk = resp.get("scores")
            n = min(step, b - i)
            if not isinstance(chunk, list) or len(chunk) != n:
                raise RemoteRewardError(f"{self.endpoint}: expected {n} scores, got {str(chunk)[:200]}")
            scores += [math.nan if s is None else float(s) for s in chunk]
            infos.append(resp.get("info") or {})
            sizes.append(n)
        info = _merge_info(infos, sizes)
        info["remote_retries"] = n_retries
        return RewardOutput(scores=torch.tensor(scores, dtype=torch.float32), info=info)

    def _body(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> bytes:
        body = {"prompts": [str(p) for p in prompts], "metadata": list(metadata)}
        if images.ndim == 5:  # videos [N, 3, F, H, W]: each one's frames, in order (VideoAlign-style judges)
            frames = images.transpose(1, 2)
            body["videos"] = [encode_images(v) for v in frames]
        else:
            body["images"] = encode_images(images)
        if any(getattr(p, "image", None) is not None for p in prompts):  # edits: the judge sees input and output
            from .edit import input_images

            body["input_images"] = encode_images(input_images(prompts, images.shape[-1], "remote"))
        try:
            return json.dumps(body, allow_nan=False).encode()
        except (TypeError, ValueError) as e:
            raise ValueError(f"remote: prompts/metadata must be JSON-serializable: {e}") from None

def _error_message(e: urllib.error.HTTPError) -> str:
    """The server's {"error": ...} text, else the start of whatever body a proxy sent, else the reason."""
    try:
        raw = e.read()
    except OSError:
        return str(e.reason)
    try:
        return str(json.loads(raw)["error"])
    except (ValueError, KeyError, TypeError):
        text = raw.decode("utf-8", "replace").strip()[:300]
        return text or str(e.reason)


def _merge_info(infos: list[dict], sizes: list[int]) -> dict:
    """Combine per-request info: per-sample lists are concatenated, numbers averaged weighted by request size,
    anything else keeps the first request's value."""
    if len(infos) == 1:
        return dict(infos[0])
    out: dict = {}
    for key in dict.fromkeys(k for info in infos for k in info):
        vals = [info.get(key) for info in infos]
        if all(isinstance(v, list) and len(v) == n for v, n in zip(vals, sizes)):
            out[key] = [x for v in vals for x in v]
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[key] = sum(v * n for v, n in zip(vals, sizes)) / sum(sizes)
        else:
            out[key] = next(v for v in vals if v is not None) if any(v is not None for v in vals) else None
    return out
