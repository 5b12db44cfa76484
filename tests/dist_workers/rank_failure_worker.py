"""2-process gloo worker for tests/parallel/test_rank_failures.py: a step that fails on some ranks fails on every rank,
at once, with the same message. Each scenario records what this rank raised (type, message) or returned:

  verify      RunState.load of a corrupted checkpoint: rank 0 verifies and raises, the others must raise it too
              (before: they waited in a barrier, up to the NCCL timeout)
  load        RunState.load of a sound checkpoint whose engine load fails on rank 1 only
  load_ok     RunState.load where every rank loads: nobody raises
  on_main     DistContext.on_main's result reaches every rank
  in_step     one last all-gather: the ranks are still in step after the failures

    RANK=.. WORLD_SIZE=2 LOCAL_RANK=.. LOCAL_WORLD_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. \
        rank_failure_worker.py CORRUPT_CKPT SOUND_CKPT OUT_DIR TIMEOUT_S
"""

import json
import sys
from pathlib import Path

from jagg_scale.parallel.dist import init_distributed, leave_launch
from jagg_scale.train.run_state import RunState


class Engine:
    """What RunState.load asks of an engine: load(directory), failing on the ranks in `fail_on`, then check_loaded."""

    def __init__(self, rank: int, fail_on: set[int]):
        self.rank, self.fail_on, self.loaded = rank, fail_on, []

    def load(self, directory: Path) -> None:
        if self.rank in self.fail_on:
            raise OSError(f"rank {self.rank} cannot read {directory.name}/model.safetensors")
        self.loaded.append(directory.name)

    def check_loaded(self, directory: Path) -> None:  # the real engines' collective finiteness check: nothing here
        pass


def outcome(fn) -> dict:
    try:
        return {"returned": fn()}
    except Exception as e:
        return {"raised": type(e).__name__, "message": str(e)}


def main(corrupt: str, sound: str, out_dir: str, timeout_s: str) -> None:
    ctx = init_distributed("cpu", timeout_s=int(timeout_s))
    result = {}
    state = lambda fail_on: RunState(None, ctx, Engine(ctx.rank, fail_on), Path(out_dir))
    result["verify"] = outcome(lambda: state(set()).load(Path(corrupt)))
    result["load"] = outcome(lambda: state({1}).load(Path(sound)))
    ok = state(set())
    result["load_ok"] = {**outcome(lambda: ok.load(Path(sound))), "loaded": ok.engine.loaded}
    result["on_main"] = outcome(lambda: ctx.on_main(lambda: f"chosen by rank {ctx.rank}"))
    result["in_step"] = ctx.all_gather_object(ctx.rank)
    Path(out_dir, f"rank{ctx.rank}.json").write_text(json.dumps(result))
    ctx.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
    leave_launch(0)  # no interpreter teardown under the launcher (jagg_scale/parallel/dist.py)
