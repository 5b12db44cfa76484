"""What hostile or heavy clients cost `jagg-reward-server`: peak memory and latency (docs/reward_server.md).

    python -m tools.server_memory [--clients 16] [--images 2] [--side 4096] [--kind bomb|noise|meta]
                                  [--repo DIR] [--out FILE.json] [-- SERVER OPTIONS...]
    python -m tools.server_memory --slowloris 64 [--seconds 25] [--repo DIR] [--out FILE.json]
    python -m tools.server_memory --suite [--out docs/results/reward_server_memory.jsonl]  # docs/reward_server.md

Starts the server (this repository's, or the one under --repo, e.g. an older checkout) in a child process serving
`_memory_probe` (the mean of the float batch: reads every pixel, allocates nothing of its own) and sends one small
request to warm it up.

Memory: then CLIENTS requests at once, each of IMAGES PNGs of SIDE x SIDE, and reads the server's VmRSS before and
VmHWM (peak resident set) after from /proc/PID/status. `bomb` images are mode-1 PNGs of a few KB (the cheapest
bytes per decoded pixel: the worst case the pixel limits are for); `noise` images are random RGB, incompressible
(the worst case for the body limit); `meta` is one small image whose metadata is `{}` objects up to 1 MB under
the body limit (parsed, 64 MB of them are 21 M dicts, ~1.5 GB: the worst case for the JSON value budget). Each
client connects from an address of its own (127.0.x.y, all loopback), as clients on as many hosts would, so the
per-client connection cap does not refuse them.

Slowloris: N connections, each from its own address (in a process of their own), send one header byte every 0.5 s
and reconnect when the server closes them; legitimate requests (one 64 x 64 PNG each, one after another, 20 ms
apart) are timed for SECONDS with the server idle, then as long under the attack: p50 and p99 latency.

Options after `--` go to the server, e.g. `-- --decode-slots 4 --max-request-pixels 67108864`.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
START_S = 600  # a hang guard for the server to start and for the requests (a busy 2-core machine is slow)
BODY_LIMIT = 64 << 20  # the server's default --max-request-mb
PACE_S = 0.02  # between legitimate requests in the latency phases


def _child(argv: list[str]) -> int:
    """The server process: register the probe reward, then run jagg-reward-server's main."""
    import torch

    from jagg_scale.rewards import Reward, RewardOutput, register
    from jagg_scale.rewards.server import main

    @register("_memory_probe")
    class _Probe(Reward):
        def __call__(self, images, prompts, metadata):
            return RewardOutput(scores=images.mean(dim=(1, 2, 3)).to(torch.float32))

    return main(argv)


def png(side: int, kind: str) -> bytes:
    import numpy as np
    from PIL import Image

    if kind == "bomb":
        img = Image.new("1", (side, side), 0)
    else:
        img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=kind == "bomb", compress_level=9 if kind == "bomb" else 1)
    return buf.getvalue()


def body(kind: str, images: int, side: int) -> bytes:
    if kind == "meta":  # one image, and `{}` up to 1 MB under the body limit
        head = b'{"prompts": ["p"], "images": ["' + base64.b64encode(png(8, "noise")) + b'"], "metadata": ['
        return head + b"{}," * ((BODY_LIMIT - (1 << 20) - len(head)) // 3) + b"{}]}"
    return json.dumps({"prompts": ["p"] * images,
                       "images": [base64.b64encode(png(side, kind)).decode()] * images}).encode()


def _status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM of pid in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(val.split()[0]) * 1024
    return out


def _address(i: int, net: int = 0) -> str:
    """The i-th client's own loopback address (127.0.0.0/8 is all loopback on Linux)."""
    return f"127.{net}.{1 + i // 250}.{1 + i % 250}"


def _post(url: str, data: bytes, source: str = "127.0.0.1", timeout: float = START_S) -> int:
    """POST -> HTTP status; -1 for a reset, -2 for another connection error, -3 for a timeout."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout, source_address=(source, 0))
    try:
        conn.request("POST", u.path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        return r.status
    except (TimeoutError, socket.timeout):
        return -3
    except (OSError, http.client.HTTPException) as e:  # reset, refused: reported as a status of its own
        return -1 if "reset" in str(e).lower() else -2
    finally:
        conn.close()


class _Server:
    """The server in a child process (a context manager)."""

    def __init__(self, repo: Path, server_args: list[str]):
        env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
            env.pop(var, None)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--reward", "_memory_probe", "--port", "0",
               *server_args]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def __enter__(self) -> _Server:
        first = self.proc.stdout.readline()  # the server prints its URL once it listens
        if not first.startswith("listening on "):
            raise RuntimeError(f"the server did not start (exit {self.proc.wait(timeout=START_S)}): {first!r}")
        self.url = first.split()[-1] + "/score/_memory_probe"
        self.small = json.dumps({"prompts": ["p"], "images": [base64.b64encode(png(64, "noise")).decode()]}).encode()
        assert _post(self.url, self.small) == 200  # warm-up
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=START_S)


def measure(clients: int = 16, images: int = 2, side: int = 4096, kind: str = "bomb", repo: Path = ROOT,
            server_args: list[str] = ()) -> dict:
    data = body(kind, images, side)
    with _Server(repo, list(server_args)) as srv:
        before = _status(srv.proc.pid)
        statuses: list[int] = []
        gate = threading.Barrier(clients)

        def client(i: int) -> None:
            gate.wait()
            statuses.append(_post(srv.url, data, _address(i)))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(START_S)
        seconds = time.perf_counter() - t0
        after = _status(srv.proc.pid)
    counts = {str(s): statuses.count(s) for s in sorted(set(statuses))}
    pixels = images * side * side if kind != "meta" else 64
    return {"clients": clients, "images": images if kind != "meta" else 1, "side": side if kind != "meta" else 8,
            "kind": kind, "body_bytes": len(data), "request_pixels": pixels, "server_args": list(server_args),
            "repo": str(repo), "statuses": counts, "seconds": round(seconds, 2),
            "rss_before_mb": round(before["VmRSS"] / 2**20), "peak_rss_mb": round(after["VmHWM"] / 2**20),
            "peak_over_before_mb": round((after["VmHWM"] - before["VmRSS"]) / 2**20)}


def _latencies(url: str, data: bytes, seconds: float, timeout: float, max_failures: int = 3) -> tuple[list, int]:
    """Legitimate requests one after another, PACE_S apart, for `seconds` -> (latencies of the 200s, failures)."""
    out, failures, end = [], 0, time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        if _post(url, data, timeout=timeout) == 200:
            out.append(time.perf_counter() - t0)
        else:
            failures += 1
            if failures >= max_failures:  # the server is not answering: enough said
                break
        time.sleep(PACE_S)
    return out, failures


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(1e3 * xs[min(len(xs) - 1, int(q * len(xs)))], 2)


def _attack(connections: int, host: str, port: int, path: str) -> int:
    """The slowloris process (its own interpreter, so its threads do not slow the timed client): prints "ready"
    once every connection has sent its first byte, and at stdin's EOF how many connections the server cut."""
    stop, started, cut = threading.Event(), set(), [0]

    def dribble(i: int) -> None:
        while not stop.is_set():
            try:
                s = socket.create_connection((host, port), timeout=5, source_address=(_address(i, 1), 0))
            except OSError:
                stop.wait(0.5)
                continue
            try:
                s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\n")
                started.add(i)
                while not stop.wait(0.5):
                    s.sendall(b"X")  # one header byte at a time, never a complete header block
            except OSError:  # the server closed it: count the cut and come back, as an attacker would
                cut[0] += 1
            finally:
                s.close()

    threads = [threading.Thread(target=dribble, args=(i,), daemon=True) for i in range(connections)]
    for t in threads:
        t.start()
    while len(started) < connections:
        time.sleep(0.05)
    print("ready", flush=True)
    sys.stdin.read()
    stop.set()
    for t in threads:
        t.join(10)
    print(cut[0], flush=True)
    return 0


def slowloris(connections: int = 64, seconds: float = 25.0, repo: Path = ROOT, server_args: list[str] = (),
              timeout: float = 30.0) -> dict:
    with _Server(repo, list(server_args)) as srv:
        u = urlsplit(srv.url)
        idle, idle_failed = _latencies(srv.url, srv.small, seconds, timeout)
        attacker = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--attack", str(connections),
                                     u.hostname, str(u.port), u.path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    text=True)
        try:
            assert attacker.stdout.readline().strip() == "ready"
            attacked, attacked_failed = _latencies(srv.url, srv.small, seconds, timeout)
        finally:
            out, _ = attacker.communicate("", timeout=START_S)
    return {"slowloris": connections, "seconds": seconds, "repo": str(repo), "server_args": list(server_args),
            "idle_requests": len(idle), "idle_p50_ms": _pct(idle, 0.5), "idle_p99_ms": _pct(idle, 0.99),
            "idle_failed": idle_failed, "attack_requests": len(attacked), "attack_p50_ms": _pct(attacked, 0.5),
            "attack_p99_ms": _pct(attacked, 0.99), "attack_failed": attacked_failed,
            "connections_cut_by_server": int(out.split()[-1])}


SUITE = [("measure", dict(clients=16, images=2, side=4096, kind="bomb")),
         ("measure", dict(clients=64, images=2, side=4096, kind="bomb")),
         ("measure", dict(clients=16, kind="meta")),
         ("measure", dict(clients=64, kind="meta")),
         ("measure", dict(clients=16, images=2, side=2800, kind="noise")),
         ("measure", dict(clients=64, images=2, side=2800, kind="noise")),
         ("slowloris", dict(connections=64, seconds=25.0))]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return _child(argv[1:])
    if argv[:1] == ["--attack"]:
        return _attack(int(argv[1]), argv[2], int(argv[3]), argv[4])
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--images", type=int, default=2, help="PNGs per request")
    p.add_argument("--side", type=int, default=4096, help="each PNG is SIDE x SIDE")
    p.add_argument("--kind", choices=("bomb", "noise", "meta"), default="bomb")
    p.add_argument("--slowloris", type=int, metavar="N", help="time legitimate requests under N slow connections")
    p.add_argument("--seconds", type=float, default=25.0,
                   help="length of each latency phase, idle and attacked (default 25: the attack spans two 10 s "
                        "header deadlines, so the server cuts and the attacker reconnects)")
    p.add_argument("--suite", action="store_true", help="every measurement of docs/reward_server.md")
    p.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose jagg_scale serves (default: this one)")
    p.add_argument("--out", type=Path, help="append each result as one JSON line")
    args = p.parse_args(argv)
    if args.suite:
        runs = SUITE
    elif args.slowloris:
        runs = [("slowloris", dict(connections=args.slowloris, seconds=args.seconds))]
    else:
        runs = [("measure", dict(clients=args.clients, images=args.images, side=args.side, kind=args.kind))]
    for fn, kw in runs:
        result = (slowloris if fn == "slowloris" else measure)(repo=args.repo.resolve(), server_args=server_args, **kw)
        print(json.dumps(result), flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
