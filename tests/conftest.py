"""Shared fixtures: the tiny offline diffusers pipelines of tools/make_tiny_pipeline.py, built once per session
(read-only for the tests that use them)."""

import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _maker(name: str):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    import make_tiny_pipeline

    return getattr(make_tiny_pipeline, name)


@pytest.fixture(scope="session")
def sd3_dir(tmp_path_factory):
    return _maker("make_tiny_sd3")(tmp_path_factory.mktemp("tiny_sd3") / "pipe", seed=0)


@pytest.fixture(scope="session")
def flux_dir(tmp_path_factory):
    return _maker("make_tiny_flux")(tmp_path_factory.mktemp("tiny_flux") / "pipe", seed=0)
