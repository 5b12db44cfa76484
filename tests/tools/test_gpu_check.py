"""tools/gpu_check.py (`python -m tools.gpu_check`) at toy scale on the CPU, so that the device check does not rot
between GPU sessions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hang_guard import RUN_S

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_check_runs_every_section_at_toy_scale(tmp_path):
    """Every section but `train` (two jagg-train subprocesses, half this test's time on a 2-core machine: the CLI runs
    that tests/cli/test_launchers.py makes); its command line is checked below without running it."""
    proc = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--tiny", "--device", "cpu",
                           "--out", str(tmp_path), "--sections", "env,window,memory,syncs,step,profile,families"],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_S)
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = result["sections"]
    failed = {k: v.get("error") for k, v in sections.items() if not v["ok"]}
    assert proc.returncode == 0 and not failed, f"{failed}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert list(sections) == ["env", "window", "memory", "syncs", "step", "profile", "families"]
    step = sections["step"]  # the whole step of one rank, three arms through the Trainer, every phase timed
    assert set(step["arms"]) == {"Flow-GRPO", "shipped", "fast recipe"}
    for arm, r in step["arms"].items():
        assert r["seconds"]["step"] > 0 and r["seconds"]["sampling"] > 0 and r["seconds"]["train"] > 0, arm
    fg, shipped = step["arms"]["Flow-GRPO"]["seconds"], step["arms"]["shipped"]["seconds"]
    assert fg["train_nograd"] == 0 and fg["backward_passes"] > shipped["backward_passes"]
    assert sum(sections["profile"]["eager"]["grad"]["by_class"].values()) > 99
    for W in (4, 8):  # JAGG's one joint pass against W per-step passes, on the same window
        case = sections["window"]["windows"][f"W{W}"]
        assert case["per_step"]["seconds"] > 0 and case["jagg_cached"]["seconds"] > 0 and case["speedup"] > 0
    assert sections["window"]["lora_parameters"] < sections["window"]["parameters"]
    for family, latent in (("qwen_image", [4, 8, 8]), ("z_image", [4, 8, 8]), ("wan", [4, 3, 8, 8])):
        fam = sections["families"][family]  # the newer families' windows, each through its family's velocity
        assert 0 < fam["lora_parameters"] < fam["parameters"] and fam["latent"] == latent
        for W in (4, 8):
            assert fam["windows"][f"W{W}"]["per_step"]["seconds"] > 0 and fam["windows"][f"W{W}"]["speedup"] > 0
    assert 0 < sections["syncs"]["host_syncs_per_step"] <= 25
    assert "== summary" in proc.stdout


def test_the_real_shape_passes_carry_the_production_configs_text_tokens():
    """The window's rows carry the tokens sd35m_pickscore encodes: CLIP's 77 + its model.max_sequence_length."""
    from jagg_scale.train import load_config
    from tools import gpu_common

    cfg = load_config(ROOT / "configs" / "sd35m_pickscore.yaml", check_files=False)
    assert gpu_common.TEXT_TOKENS == 77 + cfg.model.max_sequence_length


def test_the_train_sections_command_lines_are_valid_jagg_train_configs(sd3_dir, tmp_path):
    """The `train` section the toy run above leaves out: each of its command lines' config and overrides loads (the
    same check `jagg-train` runs first), the fsdp2 one on one process of torch.distributed.run."""
    import torch

    from jagg_scale.train import load_config
    from tools.gpu_check import train_commands

    commands = train_commands(sd3_dir, tmp_path, torch.device("cpu"))
    assert set(commands) == {"none", "fsdp2"}
    for name, cmd in commands.items():
        at = cmd.index("jagg_scale.cli")
        cfg = load_config(cmd[at + 1], cmd[at + 2:])
        assert cfg.parallel.engine == name and cfg.train.steps == 2 and str(cfg.model.pretrained) == str(sd3_dir)
    assert commands["fsdp2"][commands["fsdp2"].index("--nproc_per_node") + 1] == "1"
