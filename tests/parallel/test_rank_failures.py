"""A step that fails on some ranks fails on every rank, at once, with the same message: 2 gloo processes
(tests/dist_workers/rank_failure_worker.py says what each scenario does), started directly rather than by torchrun,
which would kill the other rank as soon as one fails and so hide what that rank would have done. The rules
themselves in one process: DistContext.on_main / on_every_rank with a single rank just run the function."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hang_guard import RUN_S, WAIT_S
from once import once
from jagg_scale.checkpoint.local import save_checkpoint_dir
from jagg_scale.parallel.dist import DistContext
from jagg_scale.parallel.ranks import free_port, launcher_env

pytestmark = [pytest.mark.dist]

WORKER = Path(__file__).resolve().parents[1] / "dist_workers" / "rank_failure_worker.py"


def _write(tmp: Path) -> list[Path]:
    (tmp / "model.safetensors").write_bytes(b"w" * 64)
    return [tmp / "model.safetensors"]  # what this rank wrote (hashed into the manifest)


def _checkpoint(root: Path) -> Path:
    return save_checkpoint_dir(root, 1, write=_write, state={"step": 1})


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return once(tmp_path_factory, "rank_failures", _launch)[1]


def _launch(tmp: Path) -> list[dict]:
    corrupt, sound = _checkpoint(tmp / "corrupt"), _checkpoint(tmp / "sound")
    (corrupt / "model.safetensors").write_bytes(b"x" * 64)  # same size, other bytes: a sha256 mismatch
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = launcher_env() | {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(corrupt), str(sound), str(tmp), str(WAIT_S)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=RUN_S)[0] for p in procs]  # a hang guard only (tests/hang_guard.py)
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_rank_0s_verification_error_is_raised_on_every_rank(ranks):
    errors = [r["verify"] for r in ranks]
    assert errors[0]["raised"] == "CheckpointError" and "sha256 mismatch" in errors[0]["message"]
    assert errors[1] == errors[0]  # the same type and message, not a wait in a barrier


def test_one_ranks_load_error_is_raised_on_every_rank(ranks):
    errors = [r["load"] for r in ranks]
    assert errors[1] == {"raised": "OSError", "message": "rank 1 cannot read step_00000001/model.safetensors"}
    assert errors[0] == errors[1]


def test_when_nothing_fails_every_rank_loads_and_stays_in_step(ranks):
    assert all(r["load_ok"] == {"returned": None, "loaded": ["step_00000001"]} for r in ranks)
    assert [r["on_main"] for r in ranks] == [{"returned": "chosen by rank 0"}] * 2
    assert [r["in_step"] for r in ranks] == [[0, 1]] * 2


def test_one_process_just_runs_the_function():
    ctx = DistContext()
    assert ctx.on_main(lambda: 7) == 7 and ctx.on_every_rank(lambda: 8) == 8
    with pytest.raises(ValueError, match="bad"):
        ctx.on_every_rank(lambda: (_ for _ in ()).throw(ValueError("bad")))
