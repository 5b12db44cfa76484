"""Which signals each launch path passes on to the workers, measured (docs/launchers.md, "Signals: what each launch
path forwards").

    python tools/signal_matrix.py [--paths torchrun,torchrun.sh,deepspeed.sh,mpirun.sh] [--signals TERM,USR1,INT,HUP]
                                  [--hold 45] [--group] [--out docs/results/signal_matrix.jsonl]

For each launch path and signal: two workers of a stub trainer (plain Python, no torch) are started through the
launcher, the signal is sent to the launcher's process once both are up (what `kill PID`, Slurm or a scheduler
does; --group: to its process group, what Ctrl-C in a terminal does), and each worker records what reached it. A
worker that gets a signal keeps "saving" for --hold seconds and then exits 0, so a launcher that kills its workers
after a grace period shows that period. Reported per case: the signal each worker got (or none), how the launcher
ended, whether the workers outlived it (orphaned: they go on training with nobody to stop them), and how the workers
ended (finished the save, or killed after N s).

The paths: `torchrun` is plain `torchrun --nproc-per-node 2 --no-python STUB` (the README's one-line command, torch's
defaults); `torchrun.sh`, `deepspeed.sh` and `mpirun.sh` are this repository's launchers with JAGG_TRAIN=STUB.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
START_S = 300  # a hang guard for the launcher to start both workers (DeepSpeed imports for a while)

STUB = """#!{python}
import os, signal, sys, time
log = open(os.path.join(os.environ["SIGMAT_DIR"], "w%d.log" % os.getpid()), "a", buffering=1)
log.write("start %f\\n" % time.time())
got = []
def handler(signum, frame):
    got.append(signum)
    log.write("sig %d %f\\n" % (signum, time.time()))
for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
    signal.signal(getattr(signal, name), handler)
end = time.time() + {run}
while time.time() < end and not got:
    time.sleep(0.05)
if got:  # "save a checkpoint" for HOLD seconds, showing that it is alive
    end = time.time() + {hold}
    while time.time() < end:
        log.write("alive %f\\n" % time.time())
        time.sleep(0.2)
log.write("exit %f\\n" % time.time())
"""


def _command(path: str, stub: Path) -> tuple[list[str], dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT", "CUDA_VISIBLE_DEVICES")}
    env.update(JAGG_TRAIN=str(stub), TORCHRUN=str(BIN / "torchrun"), DEEPSPEED=str(BIN / "deepspeed"),
               MPIRUN=str(BIN / "mpirun"))  # the launchers look next to JAGG_TRAIN otherwise
    config = str(ROOT / "configs" / "tiny_cpu.yaml")
    if path == "torchrun":
        return [str(BIN / "torchrun"), "--nproc-per-node", "2", "--standalone", "--no-python", str(stub)], env
    if path == "torchrun.sh":
        return ["bash", str(ROOT / "launchers" / "torchrun.sh"), config], {**env, "NPROC_PER_NODE": "2"}
    if path == "deepspeed.sh":
        return ["bash", str(ROOT / "launchers" / "deepspeed.sh"), config], {**env, "NUM_GPUS": "2"}
    if path == "mpirun.sh":
        return ["bash", str(ROOT / "launchers" / "mpirun.sh"), config], {**env, "NP": "2"}
    raise ValueError(f"unknown launch path {path!r}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _logs(d: Path) -> dict[int, list[list[str]]]:
    return {int(p.stem[1:]): [line.split() for line in p.read_text().splitlines() if line.strip()]
            for p in d.glob("w*.log")}


def run_case(path: str, sig: signal.Signals, hold: float, work: Path, group: bool = False) -> dict:
    d = work / f"{path}-{sig.name}{'-group' if group else ''}"
    d.mkdir(parents=True)
    stub = d / "stub-train"
    stub.write_text(STUB.format(python=sys.executable, run=hold + 120, hold=hold))
    stub.chmod(0o755)
    cmd, env = _command(path, stub)
    env["SIGMAT_DIR"] = str(d)
    out = open(d / "launcher.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + START_S
        while len(_logs(d)) < 2:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{path}: the workers did not start (see {d / 'launcher.log'})")
            time.sleep(0.1)
        time.sleep(1.0)  # let the launcher settle into its monitoring loop
        workers = sorted(_logs(d))
        t0 = time.time()
        if group:  # the launcher's process group: what Ctrl-C in a terminal does
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        launcher_end = None
        orphaned = False
        end = time.monotonic() + hold + 60
        while time.monotonic() < end:
            if launcher_end is None and proc.poll() is not None:
                launcher_end = time.time() - t0
                orphaned = any(_alive(w) for w in workers)
            if launcher_end is not None and not any(_alive(w) for w in workers):
                break
            signalled = any(x[0] == "sig" for lines in _logs(d).values() for x in lines)
            if launcher_end is not None and not signalled and time.time() - t0 > launcher_end + 5:
                break  # orphans that got nothing: they would train on to the end
            time.sleep(0.05)
        logs = _logs(d)
        per_worker = []
        for w in workers:
            lines = logs.get(w, [])
            got = [signal.Signals(int(x[1])).name for x in lines if x[0] == "sig"]
            stamps = [float(x[-1]) for x in lines if x[0] in ("sig", "alive", "exit")]
            ended = "finished the save" if any(x[0] == "exit" for x in lines) else (
                "still running" if _alive(w) else f"killed after {max(stamps, default=t0) - t0:.0f} s")
            per_worker.append({"signals": got, "end": ended})
        rc = proc.poll()
        return {"path": path, "signal": sig.name, "to": "group" if group else "launcher", "workers": per_worker,
                "launcher": "still running" if rc is None else (f"killed by {signal.Signals(-rc).name}" if rc < 0
                                                                 else f"exit {rc}") + f" after {launcher_end:.1f} s",
                "orphaned": orphaned}
    finally:
        for w in _logs(d):
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        out.close()


def _summary(case: dict) -> str:
    got = sorted({", ".join(w["signals"]) or "nothing" for w in case["workers"]})
    ends = sorted({w["end"] for w in case["workers"]})
    return f"workers got {' / '.join(got)}; launcher {case['launcher']}; " + \
        ("workers orphaned; " if case["orphaned"] else "") + f"workers {' / '.join(ends)}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--paths", default="torchrun,torchrun.sh,deepspeed.sh,mpirun.sh")
    p.add_argument("--signals", default="TERM,USR1,INT,HUP")
    p.add_argument("--hold", type=float, default=45.0, help="seconds a signalled worker keeps 'saving'")
    p.add_argument("--group", action="store_true", help="signal the launcher's process group, not its process")
    p.add_argument("--out", help="append the cases here, one JSON line each")
    args = p.parse_args(argv)
    cases = []
    with tempfile.TemporaryDirectory(prefix="signal_matrix_") as work:
        for path in args.paths.split(","):
            for name in args.signals.split(","):
                case = run_case(path, getattr(signal, "SIG" + name.strip()), args.hold, Path(work), args.group)
                print(f"{path:13s} SIG{name:5s} {_summary(case)}", flush=True)
                cases.append(case)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps({"hold_s": args.hold, **case}) + "\n" for case in cases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
