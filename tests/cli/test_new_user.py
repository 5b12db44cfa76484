"""What a new user met (issue 35 item 7), held in place: a second `make run` on a finished run prints and writes
the same summary (held-out eval, diversity, grids included: rebuilt from the run's files), and no rerun writes
summary.json with less than it held."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from jagg_scale.cli import train_main
from jagg_scale.extras import missing_extra
from train_runs import TINY, small_dit

ROOT = Path(__file__).resolve().parents[2]

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


def test_a_missing_prompt_set_is_one_line_naming_it_in_jagg_train_and_jagg_estimate(tmp_path, monkeypatch, capsys):
    """In a directory without data/prompt_sets (a clone before `make prompts`), the production config is refused
    by both commands with the file and how to fetch it; the estimator never prices the evaluation without it."""
    from jagg_scale.estimate.cli import main as estimate_main

    config = str(ROOT / "configs" / "sd35m_pickscore.yaml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("JAGG_PROMPT_SETS", raising=False)  # the test session's stand-in sets (tests/conftest.py)
    assert train_main([config]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'data.prompt_file'" in err[0]
    assert "data/prompt_sets/flow_grpo/dataset/pickscore/train.txt" in err[0] and "make prompts" in err[0]
    assert estimate_main([config]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'eval.prompt_file'" in err[0]
    assert "data/prompt_sets/flow_grpo/dataset/pickscore/test.txt" in err[0] and "make prompts" in err[0]


def test_the_prompt_sets_are_read_from_jagg_prompt_sets_when_it_is_set(tmp_path, monkeypatch):
    """A shared copy of the sets elsewhere: the configs' data/prompt_sets/ paths resolve under it, and only them."""
    from jagg_scale.data.fetch import missing_file_error, prompt_sets_dir
    from jagg_scale.paths import resolve_path

    rel = "flow_grpo/dataset/pickscore/test.txt"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JAGG_PROMPT_SETS", str(tmp_path / "sets"))
    assert missing_file_error("eval.prompt_file", f"data/prompt_sets/{rel}") is not None
    (tmp_path / "sets" / rel).parent.mkdir(parents=True)
    (tmp_path / "sets" / rel).write_text("a cat\n")
    assert missing_file_error("eval.prompt_file", f"data/prompt_sets/{rel}") is None
    assert resolve_path(f"data/prompt_sets/{rel}") == tmp_path / "sets" / rel
    assert resolve_path("data/prompts/x.txt") == Path("data/prompts/x.txt")  # other paths as given
    assert prompt_sets_dir() == tmp_path / "sets"


def test_a_job_needing_an_extra_the_core_lacks_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    """`make run` installs the core only: a diffusers family without the [models] extra says which extra to install
    (diffusers blocked here as if not installed; the pipeline directory need only look like one)."""
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    (pipe / "model_index.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` raises ModuleNotFoundError
    assert train_main([str(ROOT / "configs" / "sd3_tiny_cpu.yaml"), f"model.pretrained={pipe}",
                       f"run.output_dir={tmp_path / 'run'}", "log.progress=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "optional extra [models]" in err[0] and "-e '.[models]'" in err[0], err


def test_missing_extra_names_only_the_extras_packages():
    assert "[deepspeed]" in str(missing_extra(ModuleNotFoundError("x", name="deepspeed.runtime")))
    assert missing_extra(ModuleNotFoundError("x", name="no_such_package")) is None
