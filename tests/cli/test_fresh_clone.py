"""What a fresh clone tripped over (issue 17 item 6), each held in place: the README's commands run as written after
`make run` / `make test`, `jagg-eval` takes overrides anywhere and writes beside the run, input errors are one line
and exit 2, distributed metrics keep their integer counts, the repo states its algorithm itself, and the package
metadata installs without warnings. (A fresh start over an earlier run: test_run_dir.py; the prompt sets on the
committed samples: test_prompt_sets.py.)"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from jagg_scale.cli import eval_main, train_main
from jagg_scale.parallel.dist import DistContext

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.image_size=8", "model.dit.patch_size=2", "model.dit.hidden_size=32", "model.dit.depth=2",
         "model.dit.num_heads=2", "sampling.num_steps=4", "train.prompts_per_step=2", "grpo.group_size=2",
         "train.minibatch_size=4", "log.progress=false", "jagg.window=2"]

# programs that exist only inside the venv `make` creates: called bare, they are not found (or are another
# Python's, without torch) unless the venv is activated, which the README never asks for
VENV_ONLY = {"python", "python3", "pip", "pip3", "pytest", "torchrun", "deepspeed", "jagg-train", "jagg-eval",
             "jagg-reward-server"}


# ------------------------------------------------------------------------------------------------ the README


def _shell_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S)


def _commands(block: str) -> list[list[str]]:
    """Each simple command of a shell block as its words (continuation lines joined, comments dropped)."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        command: list[str] = []
        for word in words + [";"]:
            if word in (";", "&&", "||", "|"):
                if command:
                    out.append(command)
                command = []
            else:
                command.append(word)
    return out


def _program(command: list[str]) -> str:
    words = [w for w in command if not re.match(r"^[A-Z_]+=", w)]  # VAR=value prefixes
    return words[0] if words else ""


def test_readme_commands_call_the_venv_not_bare_programs():
    text = README.read_text()
    bare = [" ".join(c) for block in _shell_blocks(text) for c in _commands(block) if _program(c) in VENV_ONLY]
    bare += [w for block in _shell_blocks(text) for w in re.findall(r"\$\(which [\w-]+\)", block)]
    # inline commands in the prose too (a span of several words starting with such a program)
    bare += [span for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
             if len(span.split()) > 1 and span.split()[0] in VENV_ONLY]
    assert not bare, f"README commands that need an activated venv (use .venv/bin/...): {bare}"


def _training_runs(text: str) -> list[tuple[str, str, str]]:
    """(command, run directory, run.resume) of every README command that trains from a config of configs/."""
    runs = []
    for block in _shell_blocks(text):
        for command in _commands(block):
            trains = any(w.endswith("jagg-train") or w.startswith("launchers/") or w.endswith("jagg.sbatch")
                         for w in command)
            configs = [w for w in command if w.startswith("configs/") and w.endswith(".yaml")]
            if not trains or not configs:
                continue
            run = yaml.safe_load((ROOT / configs[0]).read_text()).get("run", {})
            overrides = dict(w.split("=", 1) for w in command if w.startswith("run."))
            out = overrides.get("run.output_dir", run.get("output_dir", "runs/default"))
            resume = overrides.get("run.resume", run.get("resume", "none"))
            if any(w.endswith("jagg.sbatch") for w in command) or overrides.get("run.overwrite") == "true":
                resume = "auto"  # the sbatch template resumes (a requeue continues); overwrite replaces by request
            runs.append((" ".join(command), out, resume))
    return runs


def test_readme_training_commands_each_train_into_their_own_run_directory():
    """After `make run` (runs/digits_cpu, continued by `run.resume=auto`), the training commands of the README and
    the usage, models and distributed pages run one after another as written: a fresh start (run.resume none) never
    lands in a directory an earlier one wrote, where it would be refused."""
    pages = [README, *(ROOT / "docs" / f"{name}.md" for name in ("usage", "models", "distributed"))]
    runs = _training_runs("\n".join(page.read_text() for page in pages))
    assert len(runs) >= 10
    written = {yaml.safe_load((ROOT / "configs/digits_cpu.yaml").read_text())["run"]["output_dir"]}  # make run
    clashes = []
    for command, out, resume in runs:
        if resume == "none" and out in written:
            clashes.append(command)
        written.add(out)
    assert not clashes, f"README commands refused after an earlier one (same run directory, run.resume none): {clashes}"


def test_make_run_continues_the_run_and_lets_args_override():
    proc = subprocess.run(["make", "--no-print-directory", "-n", "run", "ARGS=run.resume=none run.overwrite=true"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    line = proc.stdout.strip().splitlines()[-1].split()
    assert line[-4:] == ["configs/digits_cpu.yaml", "run.resume=auto", "run.resume=none", "run.overwrite=true"]


def test_the_algorithm_is_stated_in_the_repo():
    """The contract the code and the tests follow is a file of this repository, not a path outside it."""
    algorithm = (ROOT / "docs" / "algorithm.md").read_text()
    for topic in ("std_k", "log p_k", "a_k = (s_k - s_0) / (s_{W-1} - s_0)", "G_0", "jagg_frac", "route_by",
                  "from jagg_scale.jagg import jagg_backward", "cached_velocities", "knot_backward"):
        assert topic in algorithm, topic
    assert "docs/algorithm.md" in README.read_text()
    dead = []
    for path in [README, *ROOT.glob("docs/*.md"), *ROOT.glob("jagg_scale/**/*.py"), *ROOT.glob("tests/*.py")]:
        text = path.read_text()
        if path != Path(__file__).resolve() and ("design doc" in text or "shared/design" in text):
            dead.append(str(path.relative_to(ROOT)))
    assert not dead, f"references to a design document outside the repository: {dead}"


def test_only_the_digits_config_calls_itself_the_cpu_default():
    for path in ROOT.glob("configs/*.yaml"):
        header = path.read_text().split("\n", 1)[0]
        assert not header.startswith("# The CPU default") or path.name == "digits_cpu.yaml", path.name


def test_the_installed_package_carries_its_license_as_an_spdx_expression_with_its_file():
    """What the build wrote into the installed metadata (Metadata 2.4: License-Expression and License-File, which
    setuptools >= 77 writes from the PEP 639 fields), not what pyproject.toml's text looks like."""
    import importlib.metadata

    meta = importlib.metadata.metadata("jagg-scale")
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert meta.get("License") is None  # the deprecated free-text field is not written beside it
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()


# --------------------------------------------------------------------------------------------------- jagg-eval


def test_jagg_eval_takes_overrides_after_the_options_and_writes_beside_the_run(tmp_path, monkeypatch):
    run = tmp_path / "run"
    assert train_main([TINY, *SMALL, "train.steps=1", f"run.output_dir={run}"]) == 0
    checkpoint = run / "checkpoints" / "step_00000001"
    before = sorted(p.name for p in checkpoint.iterdir())
    monkeypatch.chdir(tmp_path)
    # tiny_cpu.yaml has no eval section: the prompts come from the command line, after --checkpoint
    assert eval_main([TINY, "--checkpoint", str(run), *SMALL, "eval.prompts=[a red apple, a blue sky]",
                      "eval.num_per_prompt=1"]) == 0
    assert (run / "jagg-eval" / "step_00000001" / "eval.json").is_file()
    assert sorted(p.name for p in checkpoint.iterdir()) == before  # nothing written into the checkpoint
    assert not (tmp_path / "eval").exists()
    # a checkpoint directory given directly: the same place
    assert eval_main([TINY, *SMALL, "--checkpoint", str(checkpoint), "eval.prompts=[a cat]",
                      "eval.num_per_prompt=1", "eval.grid_images=0"]) == 0
    assert len(json.loads((run / "jagg-eval" / "step_00000001" / "eval.json").read_text())["per_prompt"]) == 1


def test_jagg_eval_without_prompts_says_how_to_give_them(tmp_path, capsys):
    assert eval_main([TINY, "--checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "names no held-out prompts" in err and "eval.prompt_file=" in err and "eval.prompts=" in err
    assert "is required when eval.enabled" not in err  # the user never set eval.enabled: jagg-eval does


def test_jagg_eval_names_a_missing_checkpoint(tmp_path, capsys):
    assert eval_main([TINY, "eval.prompts=[a cat]", "--checkpoint", str(tmp_path / "nope")]) == 2
    assert f"--checkpoint {tmp_path / 'nope'} is not a directory" in capsys.readouterr().err


# ------------------------------------------------------------------------------- input errors: one line, exit 2


@pytest.mark.parametrize("content,message", [
    ("\n\n", "names a file with no prompt in it"),
    ('{broken\n{"text": "no prompt field"}\n', "no valid prompts"),  # every line a bad record
], ids=["blank", "bad-records"])
def test_a_prompt_file_without_prompts_is_exit_2(tmp_path, capsys, content, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    out = tmp_path / "run"
    assert train_main([TINY, *SMALL, f"data.prompt_file={prompts}", "data.prompts=null",
                       f"run.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jagg-train: config key 'data.prompt_file'") and message in err
    assert "Traceback" not in err and not (out / "metrics.jsonl").exists()
    assert eval_main([TINY, *SMALL, f"eval.prompt_file={prompts}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jagg-eval: config key 'eval.prompt_file'") and message in err


def test_a_missing_resume_path_is_exit_2(tmp_path, capsys):
    assert train_main([TINY, f"run.output_dir={tmp_path}", f"run.resume={tmp_path / 'nope'}"]) == 2
    assert "'run.resume'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- distributed metrics


class _TwoRanks(DistContext):
    """mean_over_ranks as two ranks run it, the all-gather answered with the given rows."""

    rows: list = []

    @property
    def active(self) -> bool:
        return True

    def all_gather_object(self, obj) -> list:
        return self.rows


def test_counts_stay_integers_when_averaged_over_ranks():
    ctx = _TwoRanks(rank=0, world_size=2)
    ctx.rows = [{"step": 3, "backward_passes": 6, "per_step_equiv": 10, "loss": 0.5, "ratio_max": 1.0,
                 "knots": "0 3", "reward_failed": 1},
                {"step": 3, "backward_passes": 6, "per_step_equiv": 10, "loss": 0.25, "ratio_max": 1.5,
                 "knots": "0 3", "reward_failed": 0}]
    out = ctx.mean_over_ranks(ctx.rows[0], {"ratio_max": "max"})
    assert out == {"step": 3, "backward_passes": 6, "per_step_equiv": 10, "loss": 0.375, "ratio_max": 1.5,
                   "knots": "0 3", "reward_failed": 0.5}
    assert type(out["step"]) is int and type(out["backward_passes"]) is int  # logged as 3 and 6/10, not 3.0
    assert f"{out['backward_passes']}/{out['per_step_equiv']}" == "6/10"
