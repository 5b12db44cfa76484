"""Sequence parallelism refuses what it would get silently wrong, in one process before any collective: an attention
processor that diffusers' context parallelism skips (no `_parallel_config`: xformers', AttnProcessor2_0) would attend
to its rank's tokens alone while the plan still splits them. SD3 + xformers is refused by key when the config is
loaded, and any skipped processor when parallel/sequence.py applies the plan."""

from pathlib import Path

import pytest
import torch
from extras import need

need("diffusers")
need("transformers")

from diffusers.models.attention_processor import AttnProcessor2_0, XFormersJointAttnProcessor  # noqa: E402

from jagg_scale.parallel.sequence import _check_processors, apply_sequence_parallel  # noqa: E402
from jagg_scale.train import ConfigError, load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SP = ["parallel.engine=fsdp2", "parallel.sequence_parallel=2"]


def test_sd3_with_xformers_and_sequence_parallelism_is_refused_by_key():
    sd3 = ROOT / "configs" / "sd3_tiny_cpu.yaml"
    with pytest.raises(ConfigError, match="'model.attention' xformers with parallel.sequence_parallel 2: its"):
        load_config(sd3, ["model.attention=xformers", *SP], check_files=False)
    assert load_config(sd3, ["model.attention=xformers"], check_files=False).model.attention == "xformers"
    assert load_config(sd3, SP, check_files=False).parallel.sequence_parallel == 2


def test_an_attention_processor_the_exchange_would_skip_is_refused_naming_it(sd3_dir, flux_dir):
    from jagg_scale.models.flux import FluxVelocity
    from jagg_scale.models.sd3 import SD3Velocity

    sd3 = SD3Velocity.from_pretrained(sd3_dir, resolution=16).transformer
    sd3.transformer_blocks[1].attn.set_processor(XFormersJointAttnProcessor())  # what model.attention xformers sets
    with pytest.raises(ValueError, match=r"^config key 'parallel.sequence_parallel' 2: transformer_blocks.1.attn's "
                                         r"attention processor XFormersJointAttnProcessor takes no part"):
        apply_sequence_parallel(sd3, 2, 0, 2, torch.device("cpu"))
    flux = FluxVelocity.from_pretrained(flux_dir, resolution=16).transformer
    _check_processors(flux, 2)  # every FLUX processor takes part (FluxAttnProcessor has the hook)
    flux.single_transformer_blocks[0].attn.processor = AttnProcessor2_0()
    with pytest.raises(ValueError, match="single_transformer_blocks.0.attn's attention processor AttnProcessor2_0"):
        apply_sequence_parallel(flux, 2, 0, 2, torch.device("cpu"))
