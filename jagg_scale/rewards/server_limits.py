"""What one connection and one request may cost the reward server, and the wire format's checks (`server.py` has
the protocol; `server_app.py` serves it and applies these; nothing here needs the [server] extra).

Connections (`ConnectionGuard`, applied by server_app's protocol, uvicorn's h11 one with total deadlines; uvicorn
itself bounds a request's header block, 16 KB by h11's default, and closes idle keep-alive connections after 5 s):
- a request's headers must arrive within `header_timeout_s` of the connection (or of the previous reply), in all:
  a client that sends one byte every few seconds is cut off at the deadline instead of being kept alive by each
  byte (a per-read socket timeout restarts with every byte: 8 such clients used to stop the old server);
- at most `max_connections` connections in all and `max_connections_per_client` from one IP address; one more is
  answered 503 and closed at once, before it can hold anything (`remote` retries a 5xx with backoff);
- a reply sent before the request's body was read (401, 404, 413, ...) is followed by a lingering close: the rest
  of the body is read and dropped for at most DRAIN_S, so a client still uploading sees the reply, not a reset.

Requests (`read_body`, `load_json`, `Request`), in the order the server applies them:
- the body is counted as it arrives, whatever Content-Length said (a chunked body has none): 413 at the byte limit,
  408 when it has not all arrived within `body_timeout_s` of the server starting to read it;
- it is also counted in JSON values before it is parsed: every '{', '[' and ',' (each container and each element
  after a container's first; an over-count when strings hold them, which real prompts barely do). 64 MB of `{},`
  parse into 21 M dicts, 1.5 GB; the budget refuses it (413) after its first ~0.8 MB;
- nesting deeper than MAX_JSON_DEPTH levels is a 400; so is any field of the wrong type or length;
- each image's metadata must serialize to at most MAX_METADATA_BYTES (413);
- PNGs are opened header only and refused (413) over the per-image or per-request pixel limits before any pixel
  is decoded, because a PNG's size says nothing about its decoded size (a 7.8 KB PNG holds 8000 x 8000 pixels,
  ~1 GB once decoded to the float batch a reward takes).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import math
import threading
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..data import bounded_json

DECODE_SLOTS = 2  # batches holding decoded pixels at once (one decodes while another is scored): server_batch.py
BATCH_ROWS = 64  # rows of one reward call at most, however many requests they come from (a judge's batch)
WORKERS = 8  # requests holding a body, and the threads that parse, decode and score them
# Decode cost (memory and time) follows pixels, not PNG bytes, so the limits count pixels. A float batch takes
# 12 bytes per pixel, plus the uint8 decode: 4096^2 is ~250 MB, four times a 2048^2 image, far above FLUX's 1024^2.
MAX_IMAGE_PIXELS = 4096 * 4096  # per image (was 8192^2: one 7.8 KB PNG then cost ~1 GB)
MAX_REQUEST_PIXELS = 1 << 25  # per request, all images together: 32 images of 1024^2, 128 of 512^2 (~0.5 GB)
MAX_JSON_DEPTH = 32  # nesting of arrays/objects in a request; real metadata is a few levels deep
# JSON values per request: parsed, 2^18 of them take at most ~30 MB besides their strings' own bytes (measured: 2^18
# `{}` 18 MB, a dict of 2^18 keys 28 MB); a request of 128 images with GenEval's metadata (~20 each) holds ~3000
MAX_JSON_VALUES = 1 << 18
MAX_METADATA_BYTES = 64 << 10  # one image's metadata, serialized; GenEval's or OCR's is a few hundred bytes
HEADER_TIMEOUT_S = 10.0  # a request's headers, from the connection or the previous reply (one packet, normally)
BODY_TIMEOUT_S = 60.0  # a request's body, from when the server reads it: 64 MB needs >= 1.1 MB/s
MAX_CONNECTIONS = 256  # open connections in all (each holds at most ~0.3 MB while it waits: h11's buffers)
MAX_CONNECTIONS_PER_CLIENT = 32  # from one IP: a node of 8 trainer ranks holds 8; raise it behind a NAT
DRAIN_S = 10.0  # how long a lingering close reads and drops a refused body


class RequestTooLarge(ValueError):
    """A request over a size limit (answered 413: a smaller batch, images or metadata will do)."""


class BodyTimeout(ValueError):
    """The body did not arrive in time (408)."""


class ClientGone(Exception):
    """The client closed the connection before its body arrived: there is no one to answer."""


# ------------------------------------------------------------------------------------------- connections


class ConnectionGuard:
    """Open connections per client IP and in all; the deadlines the protocol applies."""

    def __init__(self, max_connections: int, max_per_client: int, header_timeout_s: float):
        self.max_connections, self.max_per_client = max_connections, max_per_client
        self.header_timeout_s = header_timeout_s
        self.per_client: dict[str, int] = {}
        self.total = 0
        self.refused = 0  # connections answered 503 (tests and monitoring read it)

    def admit(self, host: str) -> str | None:
        """Count the connection in, or say why not (it is then not counted)."""
        if self.total >= self.max_connections:
            self.refused += 1
            return f"the server holds its limit of {self.max_connections} connections; retry later"
        if self.per_client.get(host, 0) >= self.max_per_client:
            self.refused += 1
            return f"{host} holds the per-client limit of {self.max_per_client} connections; retry later"
        self.total += 1
        self.per_client[host] = self.per_client.get(host, 0) + 1
        return None

    def release(self, host: str) -> None:
        self.total -= 1
        self.per_client[host] -= 1
        if not self.per_client[host]:
            del self.per_client[host]


# ----------------------------------------------------------------------------------------------- bodies


class ByteBudget:
    """The bytes of request bodies the server holds at once (arriving, queued for a worker, being parsed), taken as
    they arrive: a slow client holds what it sent, not a worker, so slow bodies cannot keep others' requests from
    being read and scored (the server's limit: `workers` x the largest body, what `workers` bodies cost before).
    Event-loop side only."""

    def __init__(self, limit: int):
        self.limit, self.held = int(limit), 0
        self._freed: asyncio.Condition | None = None  # made on the loop, at first use

    async def take(self, n: int, deadline: float) -> None:
        """Wait (until the loop's time `deadline`, else BodyTimeout) for `n` bytes of the budget."""
        loop = asyncio.get_running_loop()
        self._freed = self._freed or asyncio.Condition()
        async with self._freed:
            while self.held + n > self.limit:
                try:
                    await asyncio.wait_for(self._freed.wait(), max(deadline - loop.time(), 0.0))
                except asyncio.TimeoutError:
                    raise BodyTimeout("request body not read within the body deadline: the server holds its "
                                      f"limit of {self.limit} bytes of other requests' bodies; retry") from None
            self.held += n

    async def give(self, n: int) -> None:
        if n:
            self._freed = self._freed or asyncio.Condition()
            async with self._freed:
                self.held -= n
                self._freed.notify_all()


async def read_body(receive, *, max_bytes: int, max_values: int, timeout_s: float,
                    budget: ByteBudget | None = None) -> bytearray:
    """Read a request body from ASGI `receive`: counted in bytes and JSON values as it arrives, within a total
    deadline, each chunk taken from `budget` as it arrives (the caller gives back len(body) when done with it; on an
    error here what was taken is given back). Raises RequestTooLarge, BodyTimeout or ClientGone."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    body, values = bytearray(), 0
    try:
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise BodyTimeout(f"request body not received within {timeout_s:g} s ({len(body)} bytes "
                                  "arrived); a network this slow needs a higher --body-timeout") from None
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            if len(body) + len(chunk) > max_bytes:
                raise RequestTooLarge(f"request body exceeds the server limit of {max_bytes} bytes; "
                                      "send smaller batches (max_batch)")
            values += chunk.count(b"{") + chunk.count(b"[") + chunk.count(b",")
            if values > max_values:
                raise RequestTooLarge(f"request body holds more than the budget of {max_values} JSON values "
                                      "(counted as '{', '[' and ','); send smaller batches or less metadata")
            if budget is not None:
                await budget.take(len(chunk), deadline)
            body += chunk
            if not message.get("more_body", False):
                return body
    except BaseException:
        if budget is not None:
            await asyncio.shield(budget.give(len(body)))
        raise


def load_json(holder: list, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The body (popped from `holder`, so it is freed once decoded) -> JSON value; ValueError for invalid or too
    deeply nested JSON (checked without recursion: data/bounded_json.py)."""
    raw = holder.pop()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"body is not valid JSON ({e})") from None
    del raw
    return bounded_json.loads(text, "body", max_depth)


# ------------------------------------------------------------------------------------- images, replies


def b64(data: Any, where: str) -> bytes:
    if not isinstance(data, str):
        raise ValueError(f"{where}: expected a base64 string, got {type(data).__name__}")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{where}: not valid base64 ({e})") from None


def open_png(raw: bytes, where: str, max_pixels: int) -> Image.Image:
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


def pixels(img: Image.Image, where: str) -> np.ndarray:
    try:
        return np.asarray(img.convert("RGB"), dtype=np.uint8)
    except Exception as e:  # a valid header over corrupt data fails here
        raise ValueError(f"{where}: not a decodable PNG ({type(e).__name__}: {e})") from None
    finally:
        img.close()


def decode_image(data: Any, where: str, max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """One base64 PNG string -> uint8 [H, W, 3]; raises ValueError naming `where` (e.g. "images[2]")."""
    return pixels(open_png(b64(data, where), where, max_pixels), where)


def dump_json(payload: Any) -> bytes:
    """A reply body: strict JSON (a NaN or infinity raises ValueError; to_jsonable makes scores safe first)."""
    return json.dumps(payload, allow_nan=False).encode()


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


class Request:
    """A checked request: prompts, metadata and the PNGs opened (headers only) within the limits. An edit batch also
    carries `input_images` (one PNG per prompt, the outputs' size, counted in the pixel budget): the prompts reach
    the rewards as `data.EditPrompt`s carrying them, as in training. A video batch carries `videos` instead of
    `images`: one list of frame PNGs per prompt, every video as many frames of one size (all frames count in the
    pixel budget), decoded to [N, 3, F, H, W] as a video model's samples are."""

    def __init__(self, req: Any, max_image_pixels: int, max_request_pixels: int,
                 max_metadata_bytes: int = MAX_METADATA_BYTES):
        if not isinstance(req, dict):
            raise ValueError(f"body must be a JSON object, got {type(req).__name__}")
        prompts, images, videos = req.get("prompts"), req.get("images"), req.get("videos")
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise ValueError("field 'prompts' must be a list of strings")
        self.frames = 0  # frames per video: 0 for an image batch
        if videos is not None:
            if images is not None or not isinstance(videos, list) or not all(isinstance(v, list) for v in videos):
                raise ValueError("field 'videos' must be a list of lists of base64 PNG strings (and no 'images')")
            self.frames = len(videos[0]) if videos else 0
            if any(len(v) != self.frames for v in videos) or (videos and not self.frames):
                raise ValueError("field 'videos': every video must have the same number (>= 1) of frames")
            images = [frame for v in videos for frame in v]
        if not isinstance(images, list):
            raise ValueError("field 'images' must be a list of base64 PNG strings")
        metadata = req.get("metadata", [{} for _ in prompts])
        if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
            raise ValueError("field 'metadata' must be a list of objects")
        if not len(prompts) == len(images) // max(self.frames, 1) == len(metadata):
            raise ValueError(
                f"length mismatch: {len(images)} images, {len(prompts)} prompts, {len(metadata)} metadata entries"
            )
        for i, m in enumerate(metadata):
            if m and (n := len(json.dumps(m, separators=(",", ":")))) > max_metadata_bytes:
                raise RequestTooLarge(f"metadata[{i}]: {n} bytes of JSON exceed the per-image limit of "
                                      f"{max_metadata_bytes} bytes")
        inputs = req.get("input_images")
        if inputs is not None and (not isinstance(inputs, list) or len(inputs) != len(images)):
            raise ValueError(f"field 'input_images' must be a list of {len(images)} base64 PNG strings, one per image")
        self.prompts, self.metadata = prompts, metadata
        self.pngs: list[Image.Image] = []
        self.pixels = 0  # of every image of the request (edit inputs included): the batcher's budget counts these
        named = [(f"images[{i}]", data) for i, data in enumerate(images)]
        named += [(f"input_images[{i}]", data) for i, data in enumerate(inputs or [])]
        try:
            for i, (where, data) in enumerate(named):
                if self.frames and i < len(images):
                    where = f"videos[{i // self.frames}][{i % self.frames}]"
                raw = b64(data, where)
                if i < len(images):
                    images[i] = None  # the base64 text is no longer needed
                else:
                    inputs[i - len(images)] = None
                self.pngs.append(open_png(raw, where, max_image_pixels))
                if self.pngs[-1].size != self.pngs[0].size:
                    (w, h), (w0, h0) = self.pngs[-1].size, self.pngs[0].size
                    raise ValueError(f"{where}: size {w}x{h} differs from images[0] ({w0}x{h0}); "
                                     "a batch must share one size")
                self.pixels += self.pngs[-1].width * self.pngs[-1].height
                if self.pixels > max_request_pixels:  # every image counts: outputs, frames and edit inputs
                    raise RequestTooLarge(f"{i + 1} images of {self.pixels} pixels in all exceed the per-request "
                                          f"budget of {max_request_pixels} pixels at {where}; send smaller batches "
                                          "(max_batch)")
            if inputs is not None:  # the decoded pixels are made inside a slot, like the outputs' (decode)
                from ..data.images import EditPrompt

                n = len(images)
                self.prompts = [EditPrompt(p, png) for p, png in zip(prompts, self.pngs[n:])]
                self.pngs = self.pngs[:n]
                self._inputs = [p.image for p in self.prompts]
        except BaseException:
            self.close()
            raise

    def decode(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Float images [B, 3, H, W] in [0, 1] (videos [B, 3, F, H, W]): one uint8 batch filled image by image, then
        one float copy, into `out` when given (a batch's rows: server_batch.py decodes its requests in place)."""
        if not self.pngs:
            return torch.zeros(0, 3, 0, 0)
        w, h = self.pngs[0].size
        batch = np.empty((len(self.pngs), h, w, 3), dtype=np.uint8)
        for i in range(len(self.pngs)):
            batch[i] = pixels(self.pngs[i], f"images[{i}]")
        x = torch.from_numpy(batch).permute(0, 3, 1, 2)
        if self.frames:  # [N F, 3, H, W] -> videos [N, 3, F, H, W]
            x = x.view(-1, self.frames, *x.shape[1:]).transpose(1, 2)
        if out is None:
            return x.float().div_(255.0)
        return out.copy_(x).div_(255.0)

    def close(self) -> None:
        for img in self.pngs + getattr(self, "_inputs", []):
            img.close()


class Slots:
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
