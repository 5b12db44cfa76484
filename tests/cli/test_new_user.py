"""What a new user met (issue 35 item 7), held in place: a second `make run` on a finished run prints and writes
the same summary (held-out eval, diversity, grids included: rebuilt from the run's files), and no rerun writes
summary.json with less than it held."""

from __future__ import annotations

import json
import shutil

import pytest

from jagg_scale.cli import train_main
from train_runs import TINY, small_dit

# the smallest run with a held-out eval: 2 training steps, the base model's eval and the last step's
RUN = [*small_dit(2, 6), "train.steps=2", "jagg.window=2", "eval.enabled=true", "eval.prompts=[a cat, a dog]",
       "eval.num_per_prompt=2", "eval.grid_images=4", "run.resume=auto"]


def _summary_block(out: str) -> str:
    return out[out.index("== jagg-train summary"):]


@pytest.mark.slow  # three jagg-train runs (~8 s)
def test_rerun_of_a_finished_run_prints_and_writes_the_same_summary(tmp_path, capsys):
    args = [TINY, *RUN, f"run.output_dir={tmp_path}"]
    assert train_main(args) == 0
    first = _summary_block(capsys.readouterr().out)
    written = (tmp_path / "summary.json").read_bytes()
    assert "held-out eval" in first and "within-prompt diversity" in first and "grids:" in first
    assert {"eval_before", "eval_after", "diversity_ratio", "wall_seconds"} <= json.loads(written).keys()

    assert train_main(args) == 0  # run.resume=auto on a finished run: nothing to train, the summary again
    assert _summary_block(capsys.readouterr().out) == first
    assert (tmp_path / "summary.json").read_bytes() == written

    # a rerun that cannot rebuild the evaluations (their files gone, no eval asked for) keeps what summary.json held
    shutil.rmtree(tmp_path / "eval")
    assert train_main([*args, "eval.enabled=false"]) == 0
    again = capsys.readouterr().out
    assert "held-out eval" not in again
    assert json.loads((tmp_path / "summary.json").read_bytes()) == json.loads(written)
