"""Serve registered rewards over HTTP, so a trainer can score with models that live on other machines.

Scorers such as GenEval's object detectors or a VLM judge need their own GPUs, environments and
weights; the trainer should only need a URL (see `remote.py`). The wire format is plain JSON with
images as base64 PNG (lossless for the uint8 images every reward already sees), never pickle, so a
server cannot be made to run code by a request and clients need nothing but the stdlib:

    POST /score/<reward>  {"prompts": [str], "metadata": [dict] (optional), "images": [base64 PNG]}
                      ->  {"scores": [float | null], "info": {...}}      (non-finite scores -> null)
    GET  /health      ->  {"rewards": [names served]}

Errors are `{"error": "..."}` with 400 (bad request; names the field/index, JSON nested deeper than
MAX_JSON_DEPTH), 401 (bearer token; checked from the headers, before any body byte is read), 404 (unknown
reward; lists the served ones), 405 (wrong method), 408 (the body did not arrive within --body-timeout), 413
(body over the byte limit, from Content-Length or counted as it streams; more JSON values than the budget;
metadata over its per-image size; an image over the per-image pixel limit or a request over the per-request
pixel budget, from the PNG headers before any pixel is decoded), 415 (Content-Type is not application/json),
500 (the reward raised; the server keeps running), 503 (too many connections, in all or from the client's IP;
`remote` retries it). A chunked body needs no Content-Length (it used to be a 411): it is counted as it arrives.

The server (`server_app.py`) runs on uvicorn + Starlette, the maintained ASGI stack inference servers such as
vLLM's use: one event loop holds every connection for a few KB, so slow clients cost no threads, and uvicorn's
protocol class is the one place a connection's whole life can be timed, where total header deadlines and
connection caps are added (server_limits.py). It is the optional [server] extra; this module, the wire format
the `remote` client imports, needs only the stdlib, torch and PIL.

Memory is bounded by construction (server_limits.py has the per-request limits):
- `workers` requests at a time hold a body (max_request_bytes at most) and its parsed JSON, and run their
  CPU-heavy part (JSON, PNG decode, the reward) in one of `workers` threads, off the event loop; the others
  wait with their bodies unread (the kernel and uvicorn buffer ~0.3 MB each);
- decoded pixels exist only inside one of `decode_slots` slots, held from the first decode to the reply:
  at most decode_slots x max_request_pixels pixels are in memory at once, however many clients send.
docs/reward_server.md has the measured peak. Models are not assumed thread-safe, so each reward is called
under its own lock (inside a slot); requests for different rewards still run in parallel when there are
slots for them.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import importlib
import io
import json
import logging
import math
import os
import sys
from typing import Any, Sequence

import torch
from PIL import Image

from . import server_limits as lim
from .base import Reward, build_reward
from .server_limits import (  # noqa: F401  (re-exported: the wire format and its limits)
    DECODE_SLOTS, MAX_IMAGE_PIXELS, MAX_JSON_DEPTH, MAX_REQUEST_PIXELS, WORKERS, RequestTooLarge, decode_image,
    to_jsonable,
)

__all__ = ["RewardServer", "serve", "main", "encode_images", "decode_image", "to_jsonable"]  # noqa: F822 (lazy)

logger = logging.getLogger(__name__)

PNG_COMPRESS_LEVEL = 1  # PNG is lossless at any level; 1 trades a somewhat bigger body for much faster encoding
_EXTRA = ("the reward server needs the [server] extra (uvicorn, starlette): "
          "pip install -c constraints.txt -e '.[server]'")


def encode_images(images: torch.Tensor) -> list[str]:
    """Float images [B, 3, H, W] in [0, 1] -> base64 PNG strings (quantised to uint8 exactly as local rewards do)."""
    from .jpeg import to_uint8_hwc  # the one float -> uint8 rule, so remote and local scores agree

    out = []
    for arr in to_uint8_hwc(images):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


def _server_class():
    try:
        from .server_app import RewardServer
    except ImportError as e:
        raise ImportError(f"{_EXTRA} ({e})") from e
    return RewardServer


def __getattr__(name: str) -> Any:
    """`RewardServer` on first use: importing this module (as `remote` does) needs no [server] extra."""
    if name == "RewardServer":
        return _server_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def serve(rewards: dict[str, Reward], host: str = "127.0.0.1", port: int = 0, token: str | None = None,
          max_request_bytes: int = 64 << 20, **limits):
    """Bind (port 0 = ephemeral; see `.url`) and return the RewardServer; call `serve_forever()` (e.g. in a thread),
    and `shutdown()` + `server_close()` to stop. `limits`: RewardServer's keyword arguments (pixels, decode slots,
    workers, header/body timeouts, connection caps, JSON and metadata budgets; defaults in server_limits.py)."""
    return _server_class()((host, port), rewards, token, max_request_bytes, **limits)


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


def _number(kind, low, high, *, low_open: bool = False):
    """An argparse type: a finite `kind` in [low, high] ((low, high] with `low_open`), else a one-line error."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not math.isfinite(value) or value < low or (low_open and value == low) or value > high:
            raise argparse.ArgumentTypeError(f"{text} is out of range: {'(' if low_open else '['}{low:g}, {high:g}]")
        return value

    return parse


MAX_BODY_MB = 4096.0  # --max-request-mb: a body is held whole (and `workers` of them): beyond this, a typo


def main(argv: Sequence[str] | None = None) -> int:
    """`jagg-reward-server`: build the rewards once, print "listening on http://host:port", serve until interrupted."""
    p = argparse.ArgumentParser(prog="jagg-reward-server", description=__doc__.split("\n\n")[0])
    p.add_argument("--reward", action="append", required=True, metavar="NAME[:JSON_OPTIONS]",
                   help='reward to serve, repeatable; e.g. jpeg_compressibility:{"quality": 90}')
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="module to import first, so rewards it registers with @register can be served")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_number(int, 0, 65535), default=8000,
                   help="0 picks a free port (printed on the first line)")
    p.add_argument("--token-env", metavar="VAR", help="env var holding the bearer token clients must send")
    p.add_argument("--max-request-mb", type=_number(float, 0, MAX_BODY_MB, low_open=True), default=64.0,
                   help=f"request body limit (default 64, at most {MAX_BODY_MB:g})")
    p.add_argument("--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS,
                   help=f"pixels per image, checked from the PNG header (default {MAX_IMAGE_PIXELS} = 4096^2)")
    p.add_argument("--max-request-pixels", type=int, default=MAX_REQUEST_PIXELS,
                   help=f"pixels per request, all images together (default {MAX_REQUEST_PIXELS} = 32 x 1024^2)")
    p.add_argument("--decode-slots", type=int, default=DECODE_SLOTS,
                   help=f"batches holding decoded images at once (default {DECODE_SLOTS}); peak pixel memory "
                        "is about decode-slots x max-request-pixels x 15 bytes")
    p.add_argument("--batch-rows", type=int, default=lim.BATCH_ROWS,
                   help=f"rows one reward call scores at most, from as many queued requests as fit (default "
                        f"{lim.BATCH_ROWS}; 1: one request at a time, as before batching)")
    p.add_argument("--batch-wait-ms", type=_number(float, 0, 10_000), default=0.0,
                   help="how long a batch waits for more requests before it is scored (default 0: it takes what "
                        "queued while the reward was busy)")
    p.add_argument("--workers", type=int, default=WORKERS,
                   help=f"requests holding a body at once, and threads scoring them (default {WORKERS})")
    p.add_argument("--header-timeout", type=_number(float, 0, 3600, low_open=True),
                   default=lim.HEADER_TIMEOUT_S,
                   help=f"seconds a request's headers may take in all (default {lim.HEADER_TIMEOUT_S:g})")
    p.add_argument("--body-timeout", type=_number(float, 0, 3600, low_open=True), default=lim.BODY_TIMEOUT_S,
                   help=f"seconds a request's body may take in all, once read (default {lim.BODY_TIMEOUT_S:g})")
    p.add_argument("--max-connections", type=int, default=lim.MAX_CONNECTIONS,
                   help=f"open connections in all (default {lim.MAX_CONNECTIONS})")
    p.add_argument("--max-connections-per-client", type=int, default=lim.MAX_CONNECTIONS_PER_CLIENT,
                   help=f"open connections from one IP (default {lim.MAX_CONNECTIONS_PER_CLIENT})")
    p.add_argument("--max-json-values", type=int, default=lim.MAX_JSON_VALUES,
                   help=f"JSON values (objects, arrays, items) a request may hold (default {lim.MAX_JSON_VALUES})")
    p.add_argument("--max-metadata-kb", type=_number(float, 0, 1 << 20, low_open=True),
                   default=lim.MAX_METADATA_BYTES / 1024,
                   help=f"one image's metadata, serialized, in KB (default {lim.MAX_METADATA_BYTES / 1024:g})")
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
        if getattr(rewards[name], "on_latents", False):
            p.error(f"--reward {name}: it scores a diffusion model's latents, and a request carries images: serve it "
                    "in the trainer's own process instead")

    _unmap_freed_buffers()
    try:
        server = serve(rewards, args.host, args.port, token, int(args.max_request_mb * (1 << 20)),
                       max_image_pixels=args.max_image_pixels, max_request_pixels=args.max_request_pixels,
                       decode_slots=args.decode_slots, workers=args.workers, header_timeout_s=args.header_timeout,
                       body_timeout_s=args.body_timeout, max_connections=args.max_connections,
                       max_connections_per_client=args.max_connections_per_client,
                       max_json_values=args.max_json_values, max_metadata_bytes=int(args.max_metadata_kb * 1024),
                       batch_rows=args.batch_rows, batch_wait_s=args.batch_wait_ms / 1000)
    except ValueError as e:
        p.error(str(e))
    except OSError as e:  # a host that does not resolve or is not this machine's, a port taken or not ours
        p.error(f"--host {args.host} --port {args.port}: cannot listen there: {e.strerror or e}")
    print(f"listening on {server.url}", flush=True)
    logger.info("serving %s (auth %s, max request %.1f MB / %d pixels, %d per image; %d workers, %d decode slots; "
                "batches of <= %d rows, waiting %g ms; %d connections, %d per client)", sorted(rewards),
                "on" if token else "off", args.max_request_mb, args.max_request_pixels, args.max_image_pixels,
                args.workers, args.decode_slots, args.batch_rows, args.batch_wait_ms, args.max_connections,
                args.max_connections_per_client)
    try:
        server.serve_forever()  # uvicorn stops gracefully on SIGINT/SIGTERM, then raises the signal again
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
