"""The reward server's HTTP side: uvicorn + Starlette (the [server] extra), on a socket bound at construction.

Why these: uvicorn + Starlette is the maintained ASGI stack inference servers such as vLLM's run on; one event loop
holds every connection for a few KB (uvicorn's h11 parser bounds a header block and times idle keep-alive
connections out), so slow clients cost no threads. What uvicorn lacks is added here on its own protocol class:
total header deadlines, connection caps in all and per client IP, and a lingering close after an early reply
(server_limits.py says why each). The CPU-heavy part of a request (JSON, PNG decode, the reward) runs in `workers`
threads, off the event loop, so the loop keeps answering while rewards run.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import queue
import socket
import threading
import time
from typing import Any

import h11
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from . import server_limits as lim
from .base import Reward
from .server_batch import Batcher
from .server_limits import RequestTooLarge

__all__ = ["RewardServer"]

logger = logging.getLogger("jagg_scale.rewards.server")  # one logger for the server, whichever module logs

LISTEN_BACKLOG = 128  # connections the kernel queues before accept (socketserver's default of 5 overflowed)
GRACEFUL_S = 5  # on shutdown, how long requests in flight may finish before they are cancelled


# ------------------------------------------------------------------------------------------- connections


class _Transport:
    """The transport uvicorn sees: `close()` becomes the protocol's lingering close; everything else passes."""

    def __init__(self, real: asyncio.Transport, protocol: _GuardedH11):
        self._real, self._protocol = real, protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def close(self) -> None:
        self._protocol.close_lingering()

    def is_closing(self) -> bool:
        return self._protocol.closing or self._real.is_closing()


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the connection caps, a total header deadline and lingering close.

    All of it runs on the event loop, so the guard's counters need no lock."""

    guard: lim.ConnectionGuard  # set per server by `guarded_protocol`

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.real_transport, self.closing, self.stopping, self.admitted = transport, False, False, False
        self._timer: asyncio.TimerHandle | None = None
        super().connection_made(_Transport(transport, self))
        self.host = self.client[0] if self.client else "?"
        refusal = self.guard.admit(self.host)
        if refusal:  # written at once: a client that has sent nothing yet reads it before the close
            body = lim.dump_json({"error": refusal})
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                            b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            self.closing = True
            transport.close()
            return
        self.admitted = True
        self._track()

    def connection_lost(self, exc) -> None:
        self._cancel()
        if self.admitted:
            self.admitted = False
            self.guard.release(self.host)
        self.closing = True
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.closing:  # lingering: drop what is left of a body already answered (DRAIN_S bounds it)
            return
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # a reply before the body, on a connection kept alive: uvicorn would read and drop the rest without end
        if not self.closing and self.conn.their_state is h11.SEND_BODY:
            self.close_lingering()
        self._track()

    def shutdown(self) -> None:
        self.stopping = True  # the server stops: close without lingering
        super().shutdown()

    def _track(self) -> None:
        """Arm the header deadline when a request's headers are awaited, disarm it once they are in. It is armed
        once per request, so bytes arriving do not move it (as a socket timeout's restart does)."""
        if self.closing:
            return
        if self.conn.their_state is h11.IDLE:
            if self._timer is None:
                self._timer = self.loop.call_later(self.guard.header_timeout_s, self._expire)
        else:
            self._cancel()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        self.closing = True
        self.real_transport.close()

    def close_lingering(self) -> None:
        """uvicorn closes after a reply with `Connection: close`. If the client is still sending the body (the
        reply refused it before reading it), closing now would make the client's kernel reset the connection and
        drop the reply unread: half-close instead, drop what still arrives, and close at EOF or after DRAIN_S."""
        if self.closing or self.stopping or self.conn.their_state is not h11.SEND_BODY:
            self.closing = True
            self._cancel()
            self.real_transport.close()
            return
        self.closing = True
        self._cancel()
        if self.real_transport.is_closing():  # the client reset it meanwhile: nothing to drain
            return
        self._timer = self.loop.call_later(lim.DRAIN_S, self._expire)
        self.real_transport.resume_reading()
        if self.real_transport.can_write_eof():
            try:
                self.real_transport.write_eof()
            except OSError:  # reset by the client between the reply and now: closed, not logged as a server error
                self._cancel()
                self.real_transport.close()


def guarded_protocol(guard: lim.ConnectionGuard) -> type[H11Protocol]:
    """The protocol class for one server (uvicorn instantiates it per connection with its own arguments)."""
    return type("GuardedH11Protocol", (_GuardedH11,), {"guard": guard})


# --------------------------------------------------------------------------------------------- requests


def _has_body(request: HttpRequest) -> bool:
    return request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers


def _error(status: int, message: str, request: HttpRequest, headers=None) -> Response:
    """An error reply before the body was (all) read. With a body it asks to close the connection: the protocol
    then reads and drops the rest for a while (a lingering close) instead of parsing it as a next request."""
    headers = dict(headers or {})
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if _has_body(request):
        headers["Connection"] = "close"
    return Response(lim.dump_json({"error": message}), status, headers, media_type="application/json")


class _Workers:
    """`n` daemon threads for the CPU-heavy part of requests. Not a ThreadPoolExecutor: its threads are joined at
    interpreter exit, so a reward call stuck forever would keep the process alive."""

    def __init__(self, n: int):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._run, name=f"reward-worker-{i}", daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    async def call(self, fn, *args):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((loop, future, fn, args))
        return await future

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            loop, future, fn, args = item
            del item
            try:
                result, error = fn(*args), None
            except BaseException as e:  # handed to the awaiting request, which answers 500
                result, error = None, e
            del fn, args
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the loop has closed: no one waits
                pass

    def stop(self) -> None:
        for _ in self.threads:
            self._queue.put(None)


def _settle(future: asyncio.Future, result, error) -> None:
    if not future.done():  # cancelled when the server stopped waiting
        future.set_exception(error) if error is not None else future.set_result(result)


class _Gate:
    """ASGI middleware before routing: counts and logs every request, and checks the bearer token from the headers
    before anything reads the body."""

    def __init__(self, app, server: RewardServer):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.server.request_count += 1  # on the event loop: counted before replying, so a client sees it
        t0 = time.perf_counter()
        state = scope.setdefault("state", {})
        state.update(reward="-", batch=0, status=0)

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            await send(message)

        try:
            request = HttpRequest(scope)
            if not self.server.authorized(request.headers.get("authorization", "")):
                reply = _error(401, "missing or wrong bearer token (Authorization: Bearer <token>)", request)
                return await reply(scope, receive, send_status)
            await self.app(scope, receive, send_status)
        finally:
            logger.info("%s %s reward=%s batch=%d status=%d %.1f ms", scope["method"], scope["path"],
                        state["reward"], state["batch"], state["status"], (time.perf_counter() - t0) * 1e3)


class RewardServer:
    """The rewards, their batch queues and limits, served by uvicorn on a socket bound (and listening) at construction.

    `serve_forever()` serves until `shutdown()` (from another thread) or SIGINT/SIGTERM (in the main thread);
    `server_close()` frees the socket and the worker threads."""

    def __init__(self, address, rewards: dict[str, Reward], token: str | None, max_request_bytes: int, *,
                 max_image_pixels: int = lim.MAX_IMAGE_PIXELS, max_request_pixels: int = lim.MAX_REQUEST_PIXELS,
                 decode_slots: int = lim.DECODE_SLOTS, workers: int = lim.WORKERS,
                 header_timeout_s: float = lim.HEADER_TIMEOUT_S, body_timeout_s: float = lim.BODY_TIMEOUT_S,
                 max_connections: int = lim.MAX_CONNECTIONS,
                 max_connections_per_client: int = lim.MAX_CONNECTIONS_PER_CLIENT,
                 max_json_values: int = lim.MAX_JSON_VALUES, max_metadata_bytes: int = lim.MAX_METADATA_BYTES,
                 batch_rows: int = lim.BATCH_ROWS, batch_wait_s: float = 0.0):
        if not rewards:
            raise ValueError("serve at least one reward")
        for name, value in (("max_image_pixels", max_image_pixels), ("max_request_pixels", max_request_pixels),
                            ("decode_slots", decode_slots), ("workers", workers),
                            ("max_connections", max_connections),
                            ("max_connections_per_client", max_connections_per_client),
                            ("max_json_values", max_json_values), ("max_metadata_bytes", max_metadata_bytes),
                            ("batch_rows", batch_rows)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name, value in (("header_timeout_s", header_timeout_s), ("body_timeout_s", body_timeout_s)):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if not (isinstance(batch_wait_s, (int, float)) and 0 <= batch_wait_s <= 10):
            raise ValueError(f"batch_wait_s must be in [0, 10], got {batch_wait_s!r}")
        self.rewards = dict(rewards)
        self.token = token or None
        self.max_request_bytes = int(max_request_bytes)
        self.max_image_pixels, self.max_request_pixels = max_image_pixels, max_request_pixels
        self.max_json_values, self.max_metadata_bytes = max_json_values, max_metadata_bytes
        self.body_timeout_s = float(body_timeout_s)
        self.slots = lim.Slots(decode_slots)
        # each reward's queue: concurrent requests scored as one batch, one batch at a time (server_batch.py)
        self.batchers = {name: Batcher(name, reward, self.slots, batch_rows=batch_rows, max_pixels=max_request_pixels,
                                       wait_s=float(batch_wait_s)) for name, reward in self.rewards.items()}
        self.request_count = 0  # every request answered (tests and monitoring use it)
        self.guard = lim.ConnectionGuard(max_connections, max_connections_per_client, float(header_timeout_s))
        # the bodies held at once, in bytes: what `workers` bodies of the largest size cost
        self._bodies = lim.ByteBudget(workers * self.max_request_bytes)
        self._workers = _Workers(workers)
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.socket = socket.create_server(address[:2], family=family, backlog=LISTEN_BACKLOG)  # clients may queue
        self.server_address = self.socket.getsockname()[:2]
        self.app = Starlette(
            routes=[Route("/health", self._health, methods=["GET"]),
                    Route("/score/{reward:path}", self._score, methods=["POST"])],
            middleware=[Middleware(_Gate, server=self)],
            exception_handlers={HTTPException: self._http_error, Exception: self._internal_error})
        config = uvicorn.Config(self.app, http=guarded_protocol(self.guard), lifespan="off", log_config=None,
                                access_log=False, backlog=LISTEN_BACKLOG, timeout_graceful_shutdown=GRACEFUL_S,
                                loop="asyncio", proxy_headers=False)
        self._uvicorn = uvicorn.Server(config)
        self._stopped = threading.Event()

    @property
    def url(self) -> str:
        host, port = self.server_address
        return f"http://{host}:{port}"

    def serve_forever(self) -> None:
        try:
            self._uvicorn.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop serve_forever (running in another thread) and wait for it to return."""
        self._uvicorn.should_exit = True
        self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()
        self._workers.stop()  # each worker ends after the requests handed to it before

    def authorized(self, header: str) -> bool:
        if self.token is None:
            return True
        scheme, _, cred = header.partition(" ")
        ok = hmac.compare_digest(cred.strip().encode(), self.token.encode())
        return scheme.lower() == "bearer" and ok

    # ------------------------------------------------------------------------- the endpoints (event loop)

    async def _health(self, request: HttpRequest) -> Response:
        return Response(lim.dump_json({"rewards": sorted(self.rewards)}), media_type="application/json")

    async def _http_error(self, request: HttpRequest, exc: HTTPException) -> Response:
        path = request.url.path
        if exc.status_code == 405:
            message = "use GET /health" if path == "/health" else f"use POST {path}"
        elif exc.status_code == 404:
            message = f"unknown path {path!r}; endpoints: GET /health, POST /score/<reward>"
        else:
            message = str(exc.detail)
        return _error(exc.status_code, message, request, headers=exc.headers)

    async def _internal_error(self, request: HttpRequest, exc: Exception) -> Response:
        # a bug here must still answer, not drop the connection without a reply (Starlette logs the traceback)
        return _error(500, f"internal server error: {type(exc).__name__}: {exc}", request)

    async def _score(self, request: HttpRequest) -> Response:
        name = request.state.reward = request.path_params["reward"]
        if name not in self.rewards:
            return _error(404, f"unknown reward {name!r}; served: {sorted(self.rewards)}", request)
        ctype = request.headers.get("content-type", "")
        if ctype.partition(";")[0].strip().lower() != "application/json":
            return _error(415, f"Content-Type must be application/json, got {ctype or 'none'!r}", request)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            return _error(413, f"request body of {length} bytes exceeds the server limit of "
                               f"{self.max_request_bytes} bytes; send smaller batches (max_batch)", request)
        try:  # the body first, holding no worker: a slow client holds the bytes it sent (lim.ByteBudget)
            body = await lim.read_body(request.receive, max_bytes=self.max_request_bytes,
                                       max_values=self.max_json_values, timeout_s=self.body_timeout_s,
                                       budget=self._bodies)
        except RequestTooLarge as e:
            return _error(413, str(e), request)
        except lim.BodyTimeout as e:
            return _error(408, str(e), request)
        except lim.ClientGone:
            return Response(status_code=400)  # goes nowhere: uvicorn drops a reply to a closed connection
        size, holder = len(body), [body]
        del body
        try:
            status, payload, request.state.batch = await self._workers.call(self._work, name, holder)
        finally:
            await self._bodies.give(size)
        return Response(payload, status, media_type="application/json")

    # ------------------------------------------------------------------------------ the work (a thread)

    def _work(self, name: str, holder: list) -> tuple[int, bytes, int]:
        """Parse, check, decode (in a slot) and score one request -> (status, reply body, batch size)."""
        try:
            req = lim.Request(lim.load_json(holder), self.max_image_pixels, self.max_request_pixels,
                              self.max_metadata_bytes)
        except RequestTooLarge as e:
            return 413, lim.dump_json({"error": str(e)}), 0
        except ValueError as e:
            return 400, lim.dump_json({"error": str(e)}), 0
        try:
            batch, accepts = len(req.prompts), getattr(self.rewards[name], "inputs", "images")
            sends = "videos" if req.frames else "images"
            if accepts not in ("any", sends):  # not a server fault: the client is told why, and does not retry
                return 422, lim.dump_json({"error": f"reward {name!r} scores {accepts}; this request sends {sends}"}), 0
            if batch == 0:
                return 200, lim.dump_json({"scores": [], "info": {}}), 0
            status, body = self.batchers[name].score(req)  # decoded and scored with the others queued
            return status, body, batch
        finally:
            req.close()
