"""The reward server under 64 clients (issue 39): throughput and latency with batching (`--batch-rows 64`, the
default) against one request a call (`--batch-rows 1`, the server before batching), on the same server otherwise.

    python -m tools.bench.reward_load [--clients 64] [--requests 8] [--rows 4] [--fixed-s 0.1] [--per-row-s 0.002]

The server runs in its own process (`jagg-reward-server`, the real one) serving `judge` (tools/bench/slow_reward.py:
a batched judge's cost, fixed_s a call + per_row_s a row, slept: what a VLM judge on a GPU costs without its model);
each client thread sends `requests` requests of `rows` 64 x 64 PNGs in turn over its own connections, and checks the
scores it gets are its own images' (a client's images differ from every other's). Both arms: the same 64 workers, 2
decode slots, connection limits raised for 64 clients on one address. Results: docs/results/reward_load.json."""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]


def _body(client: int, rows: int) -> tuple[bytes, list[float]]:
    """A request of `rows` PNGs of this client's own colours, and the scores the judge gives them."""
    rng = np.random.default_rng(client)
    images, want = [], []
    for _ in range(rows):
        a = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format="PNG")
        images.append(base64.b64encode(buf.getvalue()).decode())
        want.append(float(a.astype(np.float64).mean() / 255.0))
    return json.dumps({"prompts": ["p"] * rows, "images": images}).encode(), want


def _post(url: str, body: bytes) -> dict:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)  # a hang guard
    try:
        conn.request("POST", u.path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        reply = json.loads(r.read())
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {reply}")
        return reply
    finally:
        conn.close()


def run_arm(batch_rows: int, args) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    judge = json.dumps({"fixed_s": args.fixed_s, "per_row_s": args.per_row_s})
    cmd = [sys.executable, "-m", "jagg_scale.rewards.server", "--plugin", "tools.bench.slow_reward", "--reward",
           f"judge:{judge}", "--port", "0", "--workers", str(args.clients), "--max-connections-per-client",
           str(2 * args.clients), "--batch-rows", str(batch_rows)]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        first = server.stdout.readline()
        if not first.startswith("listening on "):
            raise RuntimeError(f"the server did not start: {first!r}")
        url = first.split()[-1] + "/score/judge"
        bodies = [_body(c, args.rows) for c in range(args.clients)]
        _post(url, bodies[0][0])  # warm-up
        latencies: list[float] = []
        wrong: list[int] = []
        lock, go = threading.Lock(), threading.Barrier(args.clients + 1)

        def client(c: int) -> None:
            body, want = bodies[c]
            go.wait()
            for _ in range(args.requests):
                t0 = time.perf_counter()
                reply = _post(url, body)
                took = time.perf_counter() - t0
                with lock:
                    latencies.append(took)
                    if not np.allclose(reply["scores"], want, atol=1e-5):
                        wrong.append(c)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for t in threads:
            t.start()
        go.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(timeout=60)
    lat = np.array(latencies)
    rows = args.clients * args.requests * args.rows
    return {"batch_rows": batch_rows, "wall_s": round(wall, 2), "rows_per_s": round(rows / wall, 1),
            "p50_s": round(float(np.percentile(lat, 50)), 3), "p99_s": round(float(np.percentile(lat, 99)), 3),
            "requests": len(lat), "wrong_scores": len(wrong)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8, help="requests each client sends in turn")
    ap.add_argument("--rows", type=int, default=4, help="images a request")
    ap.add_argument("--fixed-s", type=float, default=0.1)
    ap.add_argument("--per-row-s", type=float, default=0.002)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "reward_load.json"))
    args = ap.parse_args(argv)
    arms = [run_arm(1, args), run_arm(64, args)]
    result = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "arms": arms,
              "throughput_gain": round(arms[1]["rows_per_s"] / arms[0]["rows_per_s"], 2),
              "p99_ratio": round(arms[1]["p99_s"] / arms[0]["p99_s"], 3)}
    print("| --batch-rows | rows / s | p50 s | p99 s | requests | wrong scores |\n|---|---|---|---|---|---|")
    for a in arms:
        print(f"| {a['batch_rows']} | {a['rows_per_s']} | {a['p50_s']} | {a['p99_s']} | {a['requests']} | "
              f"{a['wrong_scores']} |")
    print(f"throughput {result['throughput_gain']}x, p99 {result['p99_ratio']}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(a["wrong_scores"] == 0 for a in arms) else 1


if __name__ == "__main__":
    sys.exit(main())
