"""Serve registered rewards over HTTP, so a trainer can score with models that live on other machines.

Scorers such as GenEval's object detectors or a VLM judge need their own GPUs, environments and
weights; the trainer should only need a URL (see `remote.py`). The wire format is plain JSON with
images as base64 PNG (lossless for the uint8 images every reward already sees), never pickle, so a
server cannot be made to run code by a request and clients need nothing but the stdlib:

    POST /score/<reward>  {"prompts": [str], "metadata": [dict] (optional), "images": [base64 PNG]}
                      ->  {"scores": [float | null], "info": {...}}      (non-finite scores -> null)
    GET  /health      ->  {"rewards": [names served]}

Errors are `{"error": "..."}` with 400 (bad request; names the field/index), 401 (bearer token),
404 (unknown reward; lists the served ones), 411/413 (missing length / body over the limit, decided
from Content-Length before the body is read), 500 (the reward raised; the server keeps running).
Models are not assumed thread-safe, so each reward is called under its own lock; requests for
different rewards still run in parallel.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hmac
import importlib
import io
import json
import logging
import math
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence
from urllib.parse import unquote, urlsplit

import numpy as np
import torch
from PIL import Image

from .base import Reward, RewardOutput, build_reward

__all__ = ["RewardServer", "serve", "main", "encode_images", "decode_image", "to_jsonable"]

logger = logging.getLogger(__name__)

PNG_COMPRESS_LEVEL = 1  # PNG is lossless at any level; 1 trades a somewhat bigger body for much faster encoding
MAX_IMAGE_PIXELS = 8192 * 8192  # refuse decompression bombs before decoding the pixels
_DRAIN_SECONDS = 10.0  # how long to keep reading an unwanted body so the client sees the error, not a reset


# ------------------------------------------------------------------------------------------ wire format


def encode_images(images: torch.Tensor) -> list[str]:
    """Float images [B, 3, H, W] in [0, 1] -> base64 PNG strings (quantised to uint8 exactly as local rewards do)."""
    from .jpeg import to_uint8_hwc  # the one float -> uint8 rule, so remote and local scores agree

    out = []
    for arr in to_uint8_hwc(images):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


def decode_image(data: Any, where: str) -> np.ndarray:
    """One base64 PNG string -> uint8 [H, W, 3]; raises ValueError naming `where` (e.g. "images[2]")."""
    if not isinstance(data, str):
        raise ValueError(f"{where}: expected a base64 string, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{where}: not valid base64 ({e})") from None
    try:
        with Image.open(io.BytesIO(raw), formats=["PNG"]) as img:
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise ValueError(f"{where}: image of {img.width}x{img.height} exceeds {MAX_IMAGE_PIXELS} pixels")
            return np.asarray(img.convert("RGB"), dtype=np.uint8)
    except ValueError:
        raise
    except Exception as e:  # PIL raises assorted types for bad data (UnidentifiedImageError, OSError, SyntaxError)
        raise ValueError(f"{where}: not a decodable PNG ({type(e).__name__}: {e})") from None


def to_jsonable(value: Any) -> Any:
    """Make reward output strict-JSON safe: tensors/arrays -> lists, non-finite floats -> None."""
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        value = value.tolist() if not isinstance(value, torch.Tensor) else value.detach().cpu().tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    return str(value)


def _parse_request(body: bytes) -> tuple[torch.Tensor, list[str], list[dict]]:
    """JSON body -> (images float [B, 3, H, W], prompts, metadata); ValueError with a field-level message."""
    try:
        req = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"body is not valid JSON ({e})") from None
    if not isinstance(req, dict):
        raise ValueError(f"body must be a JSON object, got {type(req).__name__}")
    prompts, images = req.get("prompts"), req.get("images")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError("field 'prompts' must be a list of strings")
    if not isinstance(images, list):
        raise ValueError("field 'images' must be a list of base64 PNG strings")
    metadata = req.get("metadata", [{} for _ in prompts])
    if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
        raise ValueError("field 'metadata' must be a list of objects")
    if not len(prompts) == len(images) == len(metadata):
        raise ValueError(
            f"length mismatch: {len(images)} images, {len(prompts)} prompts, {len(metadata)} metadata entries"
        )
    arrays = [decode_image(d, f"images[{i}]") for i, d in enumerate(images)]
    for i, a in enumerate(arrays[1:], start=1):
        if a.shape != arrays[0].shape:
            raise ValueError(f"images[{i}]: size {a.shape[1]}x{a.shape[0]} differs from images[0] "
                             f"({arrays[0].shape[1]}x{arrays[0].shape[0]}); a batch must share one size")
    if not arrays:
        return torch.zeros(0, 3, 0, 0), prompts, metadata
    x = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float().div_(255.0)
    return x, prompts, metadata


# ----------------------------------------------------------------------------------------------- server


class RewardServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer that carries the rewards, their locks and the request limits."""

    daemon_threads = True  # a stuck reward call must not block shutdown

    def __init__(self, address, rewards: dict[str, Reward], token: str | None, max_request_bytes: int):
        if not rewards:
            raise ValueError("serve at least one reward")
        self.rewards = dict(rewards)
        self.locks = {name: threading.Lock() for name in self.rewards}
        self.token = token or None
        self.max_request_bytes = int(max_request_bytes)
        self.request_count = 0  # every request answered (tests and monitoring use it)
        self._count_lock = threading.Lock()
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer
    server_version = "jagg-reward-server/1"
    timeout = 60  # socket timeout: a client that stalls mid-request must not hold a thread forever

    def log_message(self, format, *args):  # noqa: A002 - our own one-line log replaces http.server's
        logger.debug("%s - " + format, self.address_string(), *args)

    def _send(self, status: int, payload: dict, headers: Sequence[tuple[str, str]] = ()) -> None:
        body = json.dumps(payload, allow_nan=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)
        self._status = status

    def _error(self, status: int, message: str, unread_body: int = 0) -> None:
        self._send(status, {"error": message}, [("WWW-Authenticate", "Bearer")] if status == 401 else ())
        if unread_body:
            self._drain(unread_body)

    def _drain(self, n: int) -> None:
        """Read and discard an unread body (bounded in time, constant memory). Closing with the client still
        sending makes its kernel reset the connection, and it would see a connection error, not our reply."""
        self.close_connection = True
        deadline = time.monotonic() + _DRAIN_SECONDS
        try:
            self.connection.settimeout(1.0)
            while n > 0 and time.monotonic() < deadline:
                chunk = self.rfile.read1(min(n, 1 << 16))
                if not chunk:
                    break
                n -= len(chunk)
        except OSError:
            pass

    def _authorized(self) -> bool:
        if self.server.token is None:
            return True
        got = self.headers.get("Authorization", "")
        scheme, _, cred = got.partition(" ")
        ok = hmac.compare_digest(cred.strip().encode(), self.server.token.encode())
        return scheme.lower() == "bearer" and ok

    def _handle(self, method: str) -> None:
        t0 = time.perf_counter()
        self._status, reward_name, batch = 0, "-", 0
        with self.server._count_lock:  # counted before replying, so a client that has its reply sees the count
            self.server.request_count += 1
        try:
            path = urlsplit(self.path).path
            length_hdr = self.headers.get("Content-Length")
            unread = int(length_hdr) if length_hdr and length_hdr.isdigit() else 0
            if not self._authorized():
                return self._error(401, "missing or wrong bearer token (Authorization: Bearer <token>)", unread)
            if path == "/health":
                if method != "GET":
                    return self._error(405, "use GET /health", unread)
                return self._send(200, {"rewards": sorted(self.server.rewards)})
            if not path.startswith("/score/"):
                return self._error(404, f"unknown path {path!r}; endpoints: GET /health, POST /score/<reward>", unread)
            reward_name = unquote(path[len("/score/"):])
            if method != "POST":
                return self._error(405, f"use POST /score/{reward_name}", unread)
            reward = self.server.rewards.get(reward_name)
            if reward is None:
                served = sorted(self.server.rewards)
                return self._error(404, f"unknown reward {reward_name!r}; served: {served}", unread)
            if length_hdr is None:
                self.close_connection = True
                return self._error(411, "Content-Length is required")
            if not length_hdr.isdigit():
                return self._error(400, f"bad Content-Length {length_hdr!r}")
            if unread > self.server.max_request_bytes:
                limit = self.server.max_request_bytes
                return self._error(413, f"request body of {unread} bytes exceeds the server limit of {limit} bytes; "
                                        "send smaller batches (max_batch)", unread)
            try:
                images, prompts, metadata = _parse_request(self.rfile.read(unread))
            except ValueError as e:
                return self._error(400, str(e))
            batch = len(prompts)
            if batch == 0:
                return self._send(200, {"scores": [], "info": {}})
            try:
                with self.server.locks[reward_name]:
                    out = reward(images, prompts, metadata)
                scores, info = (out.scores, out.info) if isinstance(out, RewardOutput) else (out, {})
                scores = torch.as_tensor(scores).detach().float().cpu().reshape(-1)
                if scores.numel() != batch:
                    raise ValueError(f"reward returned {scores.numel()} scores for a batch of {batch}")
                payload = {"scores": to_jsonable(scores.tolist()), "info": to_jsonable(info or {})}
            except Exception as e:
                logger.exception("reward %r raised on a batch of %d", reward_name, batch)
                return self._error(500, f"reward {reward_name!r} raised {type(e).__name__}: {e}")
            self._send(200, payload)
        finally:
            logger.info("%s %s reward=%s batch=%d status=%d %.1f ms", method, self.path, reward_name, batch,
                        self._status, (time.perf_counter() - t0) * 1e3)

    def do_GET(self):  # noqa: N802 - http.server naming
        self._handle("GET")

    def do_POST(self):  # noqa: N802
        self._handle("POST")


def serve(rewards: dict[str, Reward], host: str = "127.0.0.1", port: int = 0, token: str | None = None,
          max_request_bytes: int = 64 << 20) -> RewardServer:
    """Bind (port 0 = ephemeral; see `.url`) and return the server; call `serve_forever()` (e.g. in a thread)."""
    return RewardServer((host, port), rewards, token, max_request_bytes)


# -------------------------------------------------------------------------------------------------- CLI


def _parse_reward_spec(spec: str) -> tuple[str, dict]:
    """"NAME" or "NAME:{json options}" -> (name, options)."""
    name, sep, opts = spec.partition(":")
    if not name:
        raise ValueError(f"--reward {spec!r}: empty reward name")
    if not sep:
        return name, {}
    try:
        options = json.loads(opts)
    except json.JSONDecodeError as e:
        raise ValueError(f"--reward {spec!r}: options after ':' are not valid JSON ({e})") from None
    if not isinstance(options, dict):
        raise ValueError(f"--reward {spec!r}: options must be a JSON object")
    return name, options


def main(argv: Sequence[str] | None = None) -> int:
    """`jagg-reward-server`: build the rewards once, print "listening on http://host:port", serve until interrupted."""
    p = argparse.ArgumentParser(prog="jagg-reward-server", description=__doc__.split("\n\n")[0])
    p.add_argument("--reward", action="append", required=True, metavar="NAME[:JSON_OPTIONS]",
                   help='reward to serve, repeatable; e.g. jpeg_compressibility:{"quality": 90}')
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="module to import first, so rewards it registers with @register can be served")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on the first line)")
    p.add_argument("--token-env", metavar="VAR", help="env var holding the bearer token clients must send")
    p.add_argument("--max-request-mb", type=float, default=64.0)
    args = p.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    for mod in args.plugin:
        try:
            importlib.import_module(mod)
        except ImportError as e:
            p.error(f"--plugin {mod!r}: {e}")
    token = None
    if args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            p.error(f"--token-env {args.token_env}: environment variable is unset or empty")
    rewards: dict[str, Reward] = {}
    for spec in args.reward:
        try:
            name, options = _parse_reward_spec(spec)
            if name in rewards:
                raise ValueError(f"reward {name!r} given twice")
            rewards[name] = build_reward(name, **options)
        except (ValueError, TypeError, KeyError) as e:
            p.error(str(e))

    server = serve(rewards, args.host, args.port, token, int(args.max_request_mb * (1 << 20)))
    print(f"listening on {server.url}", flush=True)
    logger.info("serving %s (auth %s, max request %.1f MB)", sorted(rewards), "on" if token else "off",
                args.max_request_mb)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
