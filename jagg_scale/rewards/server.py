"""Serve registered rewards over HTTP, so a trainer can score with models that live on other machines.

Scorers such as GenEval's object detectors or a VLM judge need their own GPUs, environments and
weights; the trainer should only need a URL (see `remote.py`). The wire format is plain JSON with
images as base64 PNG (lossless for the uint8 images every reward already sees), never pickle, so a
server cannot be made to run code by a request and clients need nothing but the stdlib:

    POST /score/<reward>  {"prompts": [str], "metadata": [dict] (optional), "images": [base64 PNG]}
                      ->  {"scores": [float | null], "info": {...}}      (non-finite scores -> null)
    GET  /health      ->  {"rewards": [names served]}

Errors are `{"error": "..."}` with 400 (bad request; names the field/index, JSON nested deeper than
MAX_JSON_DEPTH), 401 (bearer token), 404 (unknown reward; lists the served ones), 411/413 (missing length
/ body over the byte limit, decided from Content-Length before the body is read), 413 (an image over the
per-image pixel limit, or a request over the per-request pixel budget, decided from the PNG headers before
any pixel is decoded), 415 (Content-Type is not application/json), 500 (the reward raised; the server keeps
running).

Memory is bounded by construction, because a PNG's size says nothing about its decoded size (a 7.8 KB PNG
can hold 8000 x 8000 pixels, ~1 GB once decoded to the float batch a reward takes):
- `workers` threads serve requests (a fixed pool, not a thread per connection); more connections wait,
  accepted, in a queue, and beyond that in the listen backlog (LISTEN_BACKLOG);
- each worker holds at most one body (max_request_bytes) and its parsed JSON;
- decoded pixels exist only inside one of `decode_slots` slots, held from the first decode to the reply:
  at most decode_slots x max_request_pixels pixels are in memory at once, however many clients send.
docs/reward_server.md has the measured peak. Models are not assumed thread-safe, so each reward is called
under its own lock (inside a slot); requests for different rewards still run in parallel when there are
slots for them.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import ctypes
import hmac
import importlib
import io
import json
import logging
import math
import os
import queue
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Sequence
from urllib.parse import unquote, urlsplit

import numpy as np
import torch
from PIL import Image

from .base import Reward, RewardOutput, build_reward

__all__ = ["RewardServer", "serve", "main", "encode_images", "decode_image", "to_jsonable"]

logger = logging.getLogger(__name__)

PNG_COMPRESS_LEVEL = 1  # PNG is lossless at any level; 1 trades a somewhat bigger body for much faster encoding
# Decode cost (memory and time) follows pixels, not PNG bytes, so the limits count pixels. A float batch takes
# 12 bytes per pixel, plus the uint8 decode: 4096^2 is ~250 MB, four times a 2048^2 image, far above FLUX's 1024^2.
MAX_IMAGE_PIXELS = 4096 * 4096  # per image (was 8192^2: one 7.8 KB PNG then cost ~1 GB)
MAX_REQUEST_PIXELS = 1 << 25  # per request, all images together: 32 images of 1024^2, 128 of 512^2 (~0.5 GB)
DECODE_SLOTS = 2  # requests holding decoded pixels at once (one decodes while another is scored)
WORKERS = 8  # threads serving requests; each holds at most one body of max_request_bytes
LISTEN_BACKLOG = 128  # connections the kernel queues before accept (socketserver's default of 5 overflowed)
MAX_JSON_DEPTH = 32  # nesting of arrays/objects in a request; real metadata is a few levels deep
_DRAIN_SECONDS = 10.0  # how long to keep reading an unwanted body so the client sees the error, not a reset


class RequestTooLarge(ValueError):
    """A request over a pixel limit (answered 413: a smaller batch or smaller images will do)."""


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


def _b64(data: Any, where: str) -> bytes:
    if not isinstance(data, str):
        raise ValueError(f"{where}: expected a base64 string, got {type(data).__name__}")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{where}: not valid base64 ({e})") from None


def _open_png(raw: bytes, where: str, max_pixels: int) -> Image.Image:
    """Open a PNG, reading its header only, and refuse it if its pixels exceed max_pixels."""
    try:
        img = Image.open(io.BytesIO(raw), formats=["PNG"])
    except Image.DecompressionBombError as e:  # PIL's own limit (2 x Image.MAX_IMAGE_PIXELS), above a raised ours
        raise RequestTooLarge(f"{where}: {e}") from None
    except Exception as e:  # PIL raises assorted types for bad data (UnidentifiedImageError, OSError, SyntaxError)
        raise ValueError(f"{where}: not a decodable PNG ({type(e).__name__}: {e})") from None
    if img.width * img.height > max_pixels:
        img.close()
        raise RequestTooLarge(f"{where}: image of {img.width}x{img.height} exceeds the per-image limit of "
                              f"{max_pixels} pixels")
    return img


def _pixels(img: Image.Image, where: str) -> np.ndarray:
    try:
        return np.asarray(img.convert("RGB"), dtype=np.uint8)
    except Exception as e:  # a valid header over corrupt data fails here
        raise ValueError(f"{where}: not a decodable PNG ({type(e).__name__}: {e})") from None
    finally:
        img.close()


def decode_image(data: Any, where: str, max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """One base64 PNG string -> uint8 [H, W, 3]; raises ValueError naming `where` (e.g. "images[2]")."""
    return _pixels(_open_png(_b64(data, where), where, max_pixels), where)


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


def _load_json(body: bytes) -> Any:
    """Bytes -> JSON value; ValueError for invalid or too deeply nested JSON (checked without recursion)."""
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"body is not valid JSON ({e})") from None
    except RecursionError:  # the parser recurses per level: thousands of '[' exhaust the stack
        raise ValueError(f"body nests arrays/objects deeper than the limit of {MAX_JSON_DEPTH} levels") from None
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"body nests arrays/objects deeper than the limit of {MAX_JSON_DEPTH} levels")
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return value


class _Request:
    """A checked request: prompts, metadata and the PNGs opened (headers only) within the pixel limits."""

    def __init__(self, req: Any, max_image_pixels: int, max_request_pixels: int):
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
        self.prompts, self.metadata = prompts, metadata
        self.pngs: list[Image.Image] = []
        try:
            for i, data in enumerate(images):
                where = f"images[{i}]"
                raw = _b64(data, where)
                images[i] = None  # the base64 text is no longer needed
                self.pngs.append(_open_png(raw, where, max_image_pixels))
                if self.pngs[-1].size != self.pngs[0].size:
                    (w, h), (w0, h0) = self.pngs[-1].size, self.pngs[0].size
                    raise ValueError(f"{where}: size {w}x{h} differs from images[0] ({w0}x{h0}); "
                                     "a batch must share one size")
            total = sum(img.width * img.height for img in self.pngs)
            if total > max_request_pixels:
                raise RequestTooLarge(f"{len(self.pngs)} images of {total} pixels in all exceed the per-request "
                                      f"budget of {max_request_pixels} pixels; send smaller batches (max_batch)")
        except BaseException:
            self.close()
            raise

    def decode(self) -> torch.Tensor:
        """Float images [B, 3, H, W] in [0, 1]: one uint8 batch filled image by image, then one float copy."""
        if not self.pngs:
            return torch.zeros(0, 3, 0, 0)
        w, h = self.pngs[0].size
        batch = np.empty((len(self.pngs), h, w, 3), dtype=np.uint8)
        for i in range(len(self.pngs)):
            batch[i] = _pixels(self.pngs[i], f"images[{i}]")
        return torch.from_numpy(batch).permute(0, 3, 1, 2).float().div_(255.0)

    def close(self) -> None:
        for img in self.pngs:
            img.close()


# ----------------------------------------------------------------------------------------------- server


class _Slots:
    """A counting semaphore that also says how many hold it and how many wait (tests and monitoring read them)."""

    def __init__(self, n: int):
        self._sem = threading.BoundedSemaphore(n)
        self._lock = threading.Lock()
        self.size, self.held, self.waiting = n, 0, 0

    @contextmanager
    def take(self):
        with self._lock:
            self.waiting += 1
        self._sem.acquire()
        with self._lock:
            self.waiting -= 1
            self.held += 1
        try:
            yield
        finally:
            with self._lock:
                self.held -= 1
            self._sem.release()


class RewardServer(HTTPServer):
    """An HTTP server with a fixed pool of worker threads that carries the rewards, their locks and the limits.

    socketserver's ThreadingMixIn starts a thread per connection, so N clients meant N concurrent bodies and
    decodes; here `serve_forever` only accepts, and `workers` threads take the connections from a queue.
    """

    request_queue_size = LISTEN_BACKLOG  # listen(2) backlog (the kernel caps it at net.core.somaxconn)

    def __init__(self, address, rewards: dict[str, Reward], token: str | None, max_request_bytes: int, *,
                 max_image_pixels: int = MAX_IMAGE_PIXELS, max_request_pixels: int = MAX_REQUEST_PIXELS,
                 decode_slots: int = DECODE_SLOTS, workers: int = WORKERS):
        if not rewards:
            raise ValueError("serve at least one reward")
        for name, value in (("max_image_pixels", max_image_pixels), ("max_request_pixels", max_request_pixels),
                            ("decode_slots", decode_slots), ("workers", workers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.rewards = dict(rewards)
        self.locks = {name: threading.Lock() for name in self.rewards}
        self.token = token or None
        self.max_request_bytes = int(max_request_bytes)
        self.max_image_pixels, self.max_request_pixels = max_image_pixels, max_request_pixels
        self.slots = _Slots(decode_slots)
        self.request_count = 0  # every request answered (tests and monitoring use it)
        self._count_lock = threading.Lock()
        super().__init__(address, _Handler)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # daemon threads: a reward call stuck forever must not block interpreter exit
        self._workers = [threading.Thread(target=self._work, name=f"reward-worker-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._workers:
            t.start()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def process_request(self, request, client_address) -> None:  # called by serve_forever's accept loop
        self._queue.put((request, client_address))

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            request, client_address = item
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)

    def server_close(self) -> None:
        super().server_close()
        for _ in self._workers:  # each worker ends after the connections queued before it
            self._queue.put(None)


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer
    server_version = "jagg-reward-server/1"
    timeout = 60  # socket timeout: a client that stalls mid-request must not hold a thread forever

    def log_message(self, format, *args):
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
        self._status, self._reward_name, self._batch = 0, "-", 0
        with self.server._count_lock:  # counted before replying, so a client that has its reply sees the count
            self.server.request_count += 1
        try:
            self._route(method)
        except Exception as e:  # a bug here must still answer, not drop the connection without a reply
            logger.exception("%s %s failed", method, self.path)
            if not self._status:
                self._error(500, f"internal server error: {type(e).__name__}: {e}")
        finally:
            logger.info("%s %s reward=%s batch=%d status=%d %.1f ms", method, self.path, self._reward_name,
                        self._batch, self._status, (time.perf_counter() - t0) * 1e3)

    def _route(self, method: str) -> None:
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
        reward_name = self._reward_name = unquote(path[len("/score/"):])
        if method != "POST":
            return self._error(405, f"use POST /score/{reward_name}", unread)
        if reward_name not in self.server.rewards:
            served = sorted(self.server.rewards)
            return self._error(404, f"unknown reward {reward_name!r}; served: {served}", unread)
        ctype = self.headers.get("Content-Type", "")
        if ctype.partition(";")[0].strip().lower() != "application/json":
            return self._error(415, f"Content-Type must be application/json, got {ctype or 'none'!r}", unread)
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
            req = _Request(self._read_json(unread), self.server.max_image_pixels, self.server.max_request_pixels)
        except RequestTooLarge as e:
            return self._error(413, str(e))
        except ValueError as e:
            return self._error(400, str(e))
        try:
            self._score(reward_name, req)
        finally:
            req.close()

    def _read_json(self, n: int) -> Any:
        body = self.rfile.read(n)
        return _load_json(body)  # the body's bytes are freed on return: only the parsed strings stay

    def _score(self, reward_name: str, req: _Request) -> None:
        batch = self._batch = len(req.prompts)
        if batch == 0:
            return self._send(200, {"scores": [], "info": {}})
        with self.server.slots.take():  # the decoded pixels live only inside a slot: memory is bounded
            try:
                images = req.decode()
            except ValueError as e:
                return self._error(400, str(e))
            try:
                with self.server.locks[reward_name]:
                    out = self.server.rewards[reward_name](images, req.prompts, req.metadata)
                del images
                scores, info = (out.scores, out.info) if isinstance(out, RewardOutput) else (out, {})
                scores = torch.as_tensor(scores).detach().float().cpu().reshape(-1)
                if scores.numel() != batch:
                    raise ValueError(f"reward returned {scores.numel()} scores for a batch of {batch}")
                payload = {"scores": to_jsonable(scores.tolist()), "info": to_jsonable(info or {})}
            except Exception as e:
                logger.exception("reward %r raised on a batch of %d", reward_name, batch)
                return self._error(500, f"reward {reward_name!r} raised {type(e).__name__}: {e}")
        self._send(200, payload)

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")


def serve(rewards: dict[str, Reward], host: str = "127.0.0.1", port: int = 0, token: str | None = None,
          max_request_bytes: int = 64 << 20, **limits) -> RewardServer:
    """Bind (port 0 = ephemeral; see `.url`) and return the server; call `serve_forever()` (e.g. in a thread).
    `limits`: max_image_pixels, max_request_pixels, decode_slots, workers (RewardServer; defaults above)."""
    return RewardServer((host, port), rewards, token, max_request_bytes, **limits)


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


def _unmap_freed_buffers() -> None:
    """Make glibc return large freed buffers to the system at once (the server process only).

    glibc serves a request below its mmap threshold from a per-thread arena and keeps it there after free, and the
    threshold rises (up to 32 MB) each time a mapped buffer is freed. Decoding buffers are tens of MB, so each of
    the worker threads came to keep its own, and the peak grew with the workers although only `decode_slots`
    requests hold pixels at once (measured: 583 MB vs 180 MB for 16 concurrent requests of 8.4 MP). A fixed 1 MB
    threshold maps every large buffer on its own and unmaps it on free."""
    try:
        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (glibc); elsewhere a no-op
    except (OSError, AttributeError, TypeError):
        pass


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
    p.add_argument("--max-request-mb", type=float, default=64.0, help="request body limit (default 64)")
    p.add_argument("--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS,
                   help=f"pixels per image, checked from the PNG header (default {MAX_IMAGE_PIXELS} = 4096^2)")
    p.add_argument("--max-request-pixels", type=int, default=MAX_REQUEST_PIXELS,
                   help=f"pixels per request, all images together (default {MAX_REQUEST_PIXELS} = 32 x 1024^2)")
    p.add_argument("--decode-slots", type=int, default=DECODE_SLOTS,
                   help=f"requests holding decoded images at once (default {DECODE_SLOTS}); peak pixel memory "
                        "is about decode-slots x max-request-pixels x 15 bytes")
    p.add_argument("--workers", type=int, default=WORKERS,
                   help=f"threads serving requests (default {WORKERS}); each holds at most one request body")
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

    _unmap_freed_buffers()
    try:
        server = serve(rewards, args.host, args.port, token, int(args.max_request_mb * (1 << 20)),
                       max_image_pixels=args.max_image_pixels, max_request_pixels=args.max_request_pixels,
                       decode_slots=args.decode_slots, workers=args.workers)
    except ValueError as e:
        p.error(str(e))
    print(f"listening on {server.url}", flush=True)
    logger.info("serving %s (auth %s, max request %.1f MB / %d pixels, %d per image; %d workers, %d decode slots)",
                sorted(rewards), "on" if token else "off", args.max_request_mb, args.max_request_pixels,
                args.max_image_pixels, args.workers, args.decode_slots)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
