"""The launcher tests' stub executables as fixtures (the stubs themselves: tests/launch_stubs.py)."""

import pytest

from launch_stubs import NVIDIA_SMI, SCONTROL, SRUN, STUB_TRAIN, _stub


@pytest.fixture
def stubs(tmp_path):
    """A directory for PATH with stub nvidia-smi, scontrol and srun."""
    d = tmp_path / "bin"
    d.mkdir()
    _stub(d / "nvidia-smi", NVIDIA_SMI)
    _stub(d / "scontrol", SCONTROL)
    _stub(d / "srun", SRUN)
    return d


@pytest.fixture
def stub_train(tmp_path):
    return _stub(tmp_path / "jagg-train-stub", STUB_TRAIN)
