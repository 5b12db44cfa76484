"""Bad input is one line on stderr and exit 2, and a refused start leaves nothing behind (issue 26 defects 4, 5, 9,
10, 11): each case runs `jagg-train` (its entry point, in this process) on real files in a fresh directory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jagg_scale.cli import train_main
from jagg_scale.train import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.image_size=8", "model.dit.patch_size=2", "model.dit.hidden_size=32", "model.dit.depth=2",
         "model.dit.num_heads=2", "sampling.num_steps=4", "train.prompts_per_step=2", "grpo.group_size=2",
         "train.minibatch_size=4", "log.progress=false", "train.steps=1", "jagg.window=2"]


def refused(capsys, config: str, *overrides: str, code: int = 2) -> str:
    rc = train_main([config, *SMALL, *overrides])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jagg-train:")]
    assert rc == code and len(err) == 1, (rc, err)
    return err[0]


def test_an_anchor_bomb_is_refused_before_anything_walks_it(tmp_path, capsys):
    levels = ['a0: &a0 [x, x, x, x, x, x, x, x, x]']
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]  # 9**9 = 387M values
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("parallel:\n  deepspeed:\n" + textwrap.indent("\n".join(levels), "    ") + "\n")
    line = refused(capsys, str(bomb), f"run.output_dir={tmp_path / 'run'}")
    assert "bomb.yaml expands to" in line and "aliases" in line
    assert not (tmp_path / "run").exists()


def test_deep_yaml_is_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.yaml"
    deep.write_text("model: " + "[" * 5000 + "]" * 5000 + "\n")
    assert "deep.yaml is nested too deeply" in refused(capsys, str(deep), f"run.output_dir={tmp_path / 'run'}")


@pytest.mark.parametrize("override, key", [("run.seed=100000000000000000000", "run.seed"),
                                           ("data.prompts=['a cat', '   ']", "data.prompts"),
                                           ("eval.prompts=['']", "eval.prompts"),
                                           ("data.shards='pipe:touch PWNED'", "data.shards")])
def test_bad_values_name_their_key_and_leave_no_run_dir(tmp_path, capsys, override, key):
    run = tmp_path / "run"
    extra = ["data.source=wds", "data.prompts=null"] if key == "data.shards" else []
    line = refused(capsys, TINY, f"run.output_dir={run}", override, *extra)
    assert f"'{key}'" in line
    assert not run.exists() and not (tmp_path / "PWNED").exists()


def test_pipe_urls_need_allow_pipe():
    cfg = load_config(TINY, ["data.source=wds", "data.prompts=null", "data.shards=pipe:cat shard.tar",
                            "data.allow_pipe=true"],
                      check_files=False)
    assert cfg.data.shards.startswith("pipe:")
    with pytest.raises(ConfigError, match="data.allow_pipe=true"):
        load_config(TINY, ["data.source=wds", "data.prompts=null", "data.shards= pipe:cat shard.tar"],
                    check_files=False)


def test_an_output_dir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("mine")
    assert "'run.output_dir'" in refused(capsys, TINY, f"run.output_dir={tmp_path / 'f'}")
    assert (tmp_path / "f").read_text() == "mine"


def test_a_missing_reward_model_leaves_no_lock(tmp_path, capsys):
    run = tmp_path / "run"
    line = refused(capsys, TINY, f"run.output_dir={run}", "reward.name=clip_score",
                   f"reward.options={{path: {tmp_path / 'no_such_clip'}}}")
    assert "'reward'" in line and "no_such_clip" in line
    assert not run.exists()  # the lock file and the directory the refused start made are gone


def test_a_foreign_config_yaml_is_not_overwritten(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my: own config\n")
    line = refused(capsys, TINY, f"run.output_dir={mine}")
    assert "config.yaml that no run wrote" in line
    assert (mine / "config.yaml").read_text() == "my: own config\n" and sorted(os.listdir(mine)) == ["config.yaml"]


def test_a_lock_that_is_a_link_is_not_written_through(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    (run / ".lock").symlink_to(target)
    assert "symbolic link" in refused(capsys, TINY, f"run.output_dir={run}")
    assert target.read_text() == "keep me\n"


def test_a_run_dir_held_by_another_job_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from jagg_scale.train.run_lock import RunLock; "
         f"RunLock.acquire({str(run)!r}); print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        line = refused(capsys, TINY, f"run.output_dir={run}")
        assert f"pid {holder.pid}" in line and "in use" in line
    finally:
        holder.kill()
        holder.wait(timeout=60)


def test_a_full_disk_while_saving_is_exit_1_naming_the_file(tmp_path, capsys, monkeypatch):
    import errno

    real = os.fsync

    def full(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("optimizer.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", full)
    line = refused(capsys, TINY, f"run.output_dir={tmp_path / 'run'}", "run.checkpoint_every=1", code=1)
    assert "No space left on device" in line and "optimizer.pt" in line
