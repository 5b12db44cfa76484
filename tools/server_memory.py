"""Peak memory of `jagg-reward-server` under N concurrent worst-case requests (docs/reward_server.md).

    python tools/server_memory.py [--clients 16] [--images 2] [--side 4096] [--kind bomb|noise]
                                  [--repo DIR] [--out FILE.json] [-- SERVER OPTIONS...]

Starts the server (this repository's, or the one under --repo, e.g. an older checkout) in a child process serving
`_memory_probe` (the mean of the float batch: reads every pixel, allocates nothing of its own), sends one small
request to warm it up, then CLIENTS requests at once, each of IMAGES PNGs of SIDE x SIDE, and reads the server's
VmRSS before and VmHWM (peak resident set) after from /proc/PID/status. `bomb` images are mode-1 PNGs of a few KB
(the cheapest bytes per decoded pixel: the worst case the pixel limits are for); `noise` images are random RGB,
incompressible (the worst case for the body limit). Options after `--` go to the server, e.g.
`-- --decode-slots 4 --max-request-pixels 67108864`.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START_S = 600  # a hang guard for the server to start and for the requests (a busy 2-core machine is slow)


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


def _status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM of pid in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(val.split()[0]) * 1024
    return out


def _post(url: str, body: bytes) -> int:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=START_S) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code
    except OSError as e:  # reset, refused: reported as a status of its own
        return -1 if "reset" in str(e).lower() else -2


def measure(clients: int = 16, images: int = 2, side: int = 4096, kind: str = "bomb", repo: Path = ROOT,
            server_args: list[str] = ()) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        env.pop(var, None)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--reward", "_memory_probe", "--port", "0",
           *server_args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        first = proc.stdout.readline()  # the server prints its URL once it listens
        if not first.startswith("listening on "):
            raise RuntimeError(f"the server did not start (exit {proc.wait(timeout=START_S)}): {first!r}")
        url = first.split()[-1] + "/score/_memory_probe"
        small = base64.b64encode(png(8, "noise")).decode()
        assert _post(url, json.dumps({"prompts": ["p"], "images": [small]}).encode()) == 200  # warm-up
        before = _status(proc.pid)
        body = json.dumps({"prompts": ["p"] * images,
                           "images": [base64.b64encode(png(side, kind)).decode()] * images}).encode()
        statuses: list[int] = []
        gate = threading.Barrier(clients)

        def client():
            gate.wait()
            statuses.append(_post(url, body))

        threads = [threading.Thread(target=client) for _ in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(START_S)
        seconds = time.perf_counter() - t0
        after = _status(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=START_S)
    counts = {str(s): statuses.count(s) for s in sorted(set(statuses))}
    return {"clients": clients, "images": images, "side": side, "kind": kind, "body_bytes": len(body),
            "request_pixels": images * side * side, "server_args": list(server_args), "repo": str(repo),
            "statuses": counts, "seconds": round(seconds, 2), "rss_before_mb": round(before["VmRSS"] / 2**20),
            "peak_rss_mb": round(after["VmHWM"] / 2**20),
            "peak_over_before_mb": round((after["VmHWM"] - before["VmRSS"]) / 2**20)}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return _child(argv[1:])
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--images", type=int, default=2, help="PNGs per request")
    p.add_argument("--side", type=int, default=4096, help="each PNG is SIDE x SIDE")
    p.add_argument("--kind", choices=("bomb", "noise"), default="bomb")
    p.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose jagg_scale serves (default: this one)")
    p.add_argument("--out", type=Path, help="append the result as one JSON line")
    args = p.parse_args(argv)
    result = measure(args.clients, args.images, args.side, args.kind, args.repo.resolve(), server_args)
    print(json.dumps(result))
    if args.out:
        with args.out.open("a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
