"""The rollout stores each prediction in the compute dtype (grpo/rollout.py): lossless because every adapter returns
its transformer's bf16 / fp16 output only upcast (reshapes, a sign), no float32 arithmetic after it. Checked per
family on its tiny pipeline (and the built-in DiT) under bf16 and fp16 autocast, as Policy.model_fn runs it: the float32
velocity round-trips through the compute dtype exactly."""

import pytest
import torch
from extras import need

need("diffusers")
need("transformers")

from jagg_scale.models.registry import family  # noqa: E402

KINDS = {"sd3": {}, "flux": {}, "flux2": {"resolution": 32}, "qwenimage": {"resolution": 16},
         "zimage": {"resolution": 16}, "wan": {"resolution": 16, "num_frames": 5}}


def _lossless(model, dtype):
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(["a red apple", "a cat"])
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        v = model(x, torch.tensor([0.9, 0.4]), cond)
    assert v.dtype == torch.float32 and v.abs().sum() > 0
    assert torch.equal(v.to(dtype).float(), v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_pipelines_prediction_is_stored_in_its_compute_dtype_without_loss(kind, dtype, request):
    path = request.getfixturevalue(f"{kind}_dir")
    model = family(kind).velocity.from_pretrained(path, dtype=torch.float32, max_sequence_length=32, **KINDS[kind])
    _lossless(model.eval(), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_dits_prediction_is_stored_in_its_compute_dtype_without_loss(dtype):
    from jagg_scale.models.dit import DiT, DiTConfig

    model = DiT(DiTConfig(image_size=8, patch_size=2, hidden_size=32, depth=2, num_heads=2))
    model.init_weights(zero_out=False)
    _lossless(model.eval(), dtype)
