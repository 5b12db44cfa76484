"""Shared fixtures: the tiny offline diffusers pipelines of jagg_scale/models/tiny.py, built once per session
(read-only for the tests that use them), and the production configs' prompt files copied into data/prompt_sets
from the peers' sets beside the repo (`jagg_scale.data.shared_prompts_dir()`) when they are there.

The tests live in folders named after the packages they cover (tests/jagg, tests/train, ...); the helpers they
share (minibatch.py, toy_velocity.py, extras.py, ...) sit here, on the import path. Under JAGG_REQUIRE_EXTRAS=1
(`make test`, CI) the session refuses to start when an optional extra is missing (extras.py)."""

import os
import shutil
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:  # the shared helpers
    sys.path.insert(0, str(TESTS))

from extras import missing, need, required  # noqa: E402 - after the helpers' directory is on the path
from once import once  # noqa: E402


def pytest_configure(config):
    # the venv's executables first on PATH, for this process and every one it starts, as the launchers' tests put
    # them: torch JIT-builds DeepSpeed's CPU collectives with the first `ninja` on PATH, and the venv's (1.13, a
    # DeepSpeed dependency) and the system's (1.11) keep different build logs, so each switch between them rebuilt
    # the op from scratch (25-60 s, four times a suite run); the Makefile builds it with the same PATH
    venv_bin = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != venv_bin:
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    # make test runs the suite in pytest-xdist workers, one per core: each worker, and every process it starts,
    # runs one torch thread (two workers of two OpenMP threads each on 2 cores spin at every barrier; a step ran
    # 6x slower so). The trainers keep an OMP_NUM_THREADS they find (parallel/dist.py).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_sessionstart(session):
    # the production configs' prompt files (data/prompt_sets, `make prompts`) from a local copy of the peers' sets
    # when there is one: the suite never downloads (copies are checked against the pinned digests; atomic, so the
    # xdist workers doing the same at once is harmless)
    from jagg_scale.data import shared_prompts_dir
    from jagg_scale.data.fetch import DEST, fill_from

    if shared_prompts_dir().is_dir():
        fill_from(shared_prompts_dir(), TESTS.parent / DEST)
    _stand_in_prompt_sets()
    gone = missing() if required() else []
    if gone:
        raise pytest.UsageError("JAGG_REQUIRE_EXTRAS=1, but these optional extras are not installed: "
                                f"{', '.join(gone)} "
                                "(rm .venv/bin/.installed-extras && make setup-extras installs them)")


def _stand_in_prompt_sets() -> None:
    """A clone without the peers' sets (no `make prompts`, no copy beside the repo): the production configs'
    data/prompt_sets/ paths read the small licensed subsets committed in data/prompts/ (same layout) through
    $JAGG_PROMPT_SETS, set here for this session and the processes it starts; data/prompt_sets itself is left
    alone, so a later production run never trains on a subset. A set with no committed subset (a training split,
    DanceGRPO's list) reads the subset of the same format. Figures that depend on a set's size or longest prompt
    (the estimator's evaluation share) are then the subset's."""
    import tempfile

    from jagg_scale.data.fetch import DEST, PROMPT_FILES
    from jagg_scale.paths import PROMPT_SETS_ENV

    repo = TESTS.parent
    if os.environ.get(PROMPT_SETS_ENV) or all((repo / DEST / f.rel).is_file() for f in PROMPT_FILES):
        return
    subsets = repo / "data" / "prompts"
    same_format = {".jsonl": subsets / "flow_grpo/dataset/geneval/test_metadata.jsonl",
                   ".txt": subsets / "flow_grpo/dataset/pickscore/test.txt", "": subsets / "flow_grpo/LICENSE"}
    root = Path(tempfile.mkdtemp(prefix="jagg_prompt_sets_"))
    for f in PROMPT_FILES:
        src = subsets / f.rel
        if not src.is_file():
            split = subsets / f.rel.replace("/train", "/test")
            src = split if split.is_file() else same_format[Path(f.rel).suffix]
        (root / f.rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, root / f.rel)
    os.environ[PROMPT_SETS_ENV] = str(root)
    _STAND_INS.append(root)


_STAND_INS: list[Path] = []  # the stand-in sets this process made (the xdist workers inherit the controller's)


def pytest_sessionfinish(session):
    for root in _STAND_INS:
        shutil.rmtree(root, ignore_errors=True)


def _maker(name: str):
    need("diffusers")
    need("transformers")
    from jagg_scale.models import tiny

    return getattr(tiny, name)


def _tiny_pipeline(kind: str):
    """A session fixture `<kind>_dir`: the tiny random pipeline of a diffusers family (jagg_scale/models/tiny.py),
    built once per session (and shared by the xdist workers: once.py)."""
    @pytest.fixture(scope="session", name=f"{kind}_dir")
    def fixture(tmp_path_factory):
        make = _maker(f"make_tiny_{kind}")
        return Path(once(tmp_path_factory, f"tiny_{kind}", lambda d: str(make(d / "pipe", seed=0)))[1])

    return fixture


(sd3_dir, flux_dir, qwenimage_dir, flux2_dir, zimage_dir, flux_kontext_dir, flux2_dev_dir, wan_dir,
 qwenimage_edit_dir) = (_tiny_pipeline(k) for k in ("sd3", "flux", "qwenimage", "flux2", "zimage", "flux_kontext",
                                                     "flux2_dev", "wan", "qwenimage_edit"))
