"""Qwen-Image-Edit (diffusers QwenImageEditPlusPipeline: Qwen-Image-Edit-2509 / -2511): instruction editing as a
`VelocityModel`, Qwen-Image's transformer (models/qwenimage.py) with the input image twice in its conditioning.

    cond = encode_prompts(prompts)     (Tokens, image latents [B, C, H, W]) of edit prompts (data.EditPrompt: text and
                                       input image): the prompt encoded by QwenImageEditPlusPipeline.encode_prompt
                                       with its input image resized to the pipeline's CONDITION_IMAGE_SIZE area
                                       (384 x 384: Qwen2.5-VL's vision tokens in the prompt, "Picture 1: ..."), one
                                       prompt at a time (the pipeline takes one image list per call); and the image's
                                       VAE latents at the model's size, normalised per channel (_encode_vae_image)
    v    = forward(x, sigma, cond)     the noisy latents' 2x2 tokens, then the input image's, with both grids in
                                       img_shapes; the output's first (noisy) tokens are the velocity
    img  = decode(x)                   as Qwen-Image

The pipeline's VAE image is at 1024 x 1024 area whatever the output size; here it is the model's size (the output's),
as Flow-Factory's recipe sets it (condition_image_size = resolution, examples/grpo/lora/qwen_image_edit_plus/
default.yaml:54-56). Guidance: Qwen-Image's true CFG (token_norm) with the negative prompt " " on the same image.

Processor: the pipeline's Qwen2VLProcessor is built here from its image processor (transformers'
Qwen2VLImageProcessorPil: no torchvision) and the tokenizer, so its video half (a torchvision video processor, whose
compiled ops do not load with every torch build) is never loaded; the edit pipeline feeds images only.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import torch

from ..cond import Tokens
from ..data.images import load_rgb
from . import qwenimage
from .qwenimage import QwenImageVelocity, pack_latents, unpack_latents
from .diffusers_common import latent_stats, load_pipeline, resolution_check, row_sigmas
from .registry import Family, register


def processor_class():
    """Qwen2VLProcessor with an image processor and a tokenizer only: ProcessorMixin reads a processor's parts from
    its __init__'s arguments, and Qwen2VLProcessor's own would check a video processor's class, which needs
    torchvision (a class made here: transformers is imported only when a pipeline is loaded)."""
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token, self.video_token_id = "<|video_pad|>", None
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageQwen2VLProcessor


def image_processor(path: Path):
    """The pipeline's `processor` without its video half (processor_class) over the saved image processor
    (processor/preprocessor_config.json, read by the PIL image processor) and tokenizer."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = path / "processor"
    tokenizer = AutoTokenizer.from_pretrained(str(folder if (folder / "tokenizer_config.json").is_file()
                                                  else path / "tokenizer"), local_files_only=True)
    return processor_class()(Qwen2VLImageProcessorPil.from_pretrained(str(folder), local_files_only=True), tokenizer)


class QwenImageEditVelocity(QwenImageVelocity):
    """v_theta(x, sigma, (Tokens, image latents)) of a QwenImageEditPlusPipeline's transformer."""

    pipeline_class = "QwenImageEditPlusPipeline"
    # Flow-Factory's Qwen-Image-Edit-Plus default (X-GenGroup/Flow-Factory a0b2bc5 src/flow_factory/models/qwen_image/
    # qwen_image_edit_plus.py:121-130), which configs/qwenimage_edit_pickscore.yaml follows: bare names, so both
    # streams' attention projections and both MLP Linears of every block
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                    "net.0.proj", "net.2")

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | dict = torch.float32, *, max_sequence_length: int | None = None,
                        resolution: int | None = None, local_files_only: bool = True) -> "QwenImageEditVelocity":
        """Load a saved QwenImageEditPlusPipeline directory (offline by default), its processor built without
        torchvision (image_processor); `dtype` as for SD3Velocity.from_pretrained."""
        from diffusers import QwenImageEditPlusPipeline

        path = Path(path)
        pipe = load_pipeline(QwenImageEditPlusPipeline, path, dtype, processor=image_processor(path),
                             local_files_only=local_files_only)
        latent_size = cls.latent_size_for(pipe, resolution, 2) if resolution is not None else None
        return cls(pipe, max_sequence_length=min(max_sequence_length or qwenimage.PROMPT_TOKENS,
                                                 qwenimage.PROMPT_LIMIT), latent_size=latent_size)

    @torch.no_grad()
    def encode_images(self, images: Sequence) -> torch.Tensor:
        """Input images (paths, encoded bytes, PIL images) -> VAE latents [B, C, H, W] at the model's size, as the
        pipeline's _encode_vae_image makes them (the posterior's mode, normalised per channel); transformer dtype."""
        vae = self.frozen["vae"]
        pixels = torch.stack([load_rgb(im, self.image_size) for im in images]).to(self.device, vae.dtype)
        latents = vae.encode((pixels * 2 - 1).unsqueeze(2)).latent_dist.mode()
        mean, std = latent_stats(vae, latents.device, self._latent_stats)
        return ((latents - mean) / std)[:, :, 0].to(self.dtype)

    def condition_image(self, image):
        """The input image as the pipeline shows it to Qwen2.5-VL: resized to CONDITION_IMAGE_SIZE's area at its
        aspect ratio (calculate_dimensions), a PIL image."""
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as P
        from PIL import Image

        img = image if isinstance(image, Image.Image) else _open(image)
        w, h = P.calculate_dimensions(P.CONDITION_IMAGE_SIZE, img.size[0] / img.size[1])
        return self.pipe.image_processor.resize(img, h, w)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence) -> tuple[Tokens, torch.Tensor]:
        """(Tokens of each prompt read with its input image, the input images' latents) of edit prompts."""
        missing = [p for p in prompts if getattr(p, "image", None) is None]
        if missing:
            raise ValueError(f"model.kind qwenimage_edit needs an input image per prompt (a jsonl 'image' field or a "
                             f"shard's image member); {len(missing)} prompt(s) have none, e.g. {str(missing[0])!r}")
        embeds, lengths = [], []
        for p in prompts:  # one call a prompt: the pipeline reads every image it is given into every prompt
            e, _ = self.pipe.encode_prompt(prompt=[str(p)], image=[self.condition_image(p.image)], device=self.device,
                                           num_images_per_prompt=1, max_sequence_length=self.max_sequence_length)
            e = e[:, :self.max_sequence_length]  # Flow-Factory's cut (qwen_image_edit_plus.py:240): the pipeline's
            embeds.append(e[0])  # own does not apply max_sequence_length to an edit prompt
            lengths.append(e.shape[1])
        longest = max(lengths)
        padded = torch.stack([torch.cat([e, e.new_zeros(longest - len(e), e.shape[1])]) for e in embeds])
        mask = torch.arange(longest, device=padded.device)[None] < torch.tensor(lengths, device=padded.device)[:, None]
        return (Tokens(padded.to(self.dtype), mask.to(torch.int64), tuple(lengths)),
                self.encode_images([p.image for p in prompts]))

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """Velocity v = e - d at unpacked latents x [N, C, H, W] given the input image's latents; in x's dtype."""
        tokens, image = cond
        return edit_velocity(self.transformer, x, sigma, tokens, image)


def _open(source):
    from PIL import Image
    import io

    return Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source).convert("RGB")


def edit_velocity(transformer, x: torch.Tensor, sigma, cond: Tokens, image: torch.Tensor) -> torch.Tensor:
    """QwenImageEditPlusPipeline's transformer call: [noisy | input image] tokens with both grids in img_shapes, the
    prompt at its rows' longest with its mask (none where nothing is padding), timestep = sigma; the noisy tokens'
    output unpacked, in x's dtype."""
    dtype = next(transformer.parameters()).dtype
    embeds, mask = cond.to_length(max(cond.lengths))
    n, _, h, w = x.shape
    grid = (1, h // 2, w // 2)
    out = transformer(
        hidden_states=torch.cat([pack_latents(x.to(dtype)), pack_latents(image.to(dtype))], dim=1),
        timestep=row_sigmas(sigma, x).to(dtype),
        guidance=None,
        encoder_hidden_states=embeds.to(dtype),
        encoder_hidden_states_mask=None if cond.full else mask,
        img_shapes=[[grid, (1, image.shape[2] // 2, image.shape[3] // 2)]] * n,
        return_dict=False,
    )[0]
    return unpack_latents(out[:, :(h // 2) * (w // 2)], h, w).to(x.dtype)


# ------------------------------------------------------------------ the family record (models/registry.py)
def _build(cfg, path, dtypes):
    return QwenImageEditVelocity.from_pretrained(path, dtypes, resolution=cfg.resolution,
                                                 max_sequence_length=cfg.max_sequence_length)


def _geometry(cfg, tc, vae, tokens, prompt):
    """Qwen-Image's, with the input image's latents in the conditioning and its tokens in every pass; the prompt's
    tokens are the shape file's (its template, the condition image's vision tokens and the instruction)."""
    g = qwenimage.geometry(cfg, tc, vae, tokens, prompt)
    return dict(g, cond_row=g["cond_row"] + math.prod(g["latent"]), images_per_pass=2)


def _inputs(cfg, n, h, w, t, r, u, device, frames):
    """Qwen-Image's arguments with the input image's tokens after the noisy ones and its grid in img_shapes."""
    args = qwenimage.inputs(cfg, n, h, w, t, r, u, device, frames)
    args["hidden_states"] = torch.cat([args["hidden_states"], r(n, h * w, cfg["in_channels"])], dim=1)
    args["img_shapes"] = [[(1, h, w), (1, h, w)]] * n
    return args


FAMILY = register(Family(
    name="qwenimage_edit", velocity=QwenImageEditVelocity, build=_build, pipeline="QwenImageEditPlusPipeline",
    transformer="QwenImageTransformer2DModel", text="qwen", prompt_tokens=qwenimage.PROMPT_TOKENS,
    prompt_limit=qwenimage.PROMPT_LIMIT,
    checkpoints={"qwen-image-edit-2509": "qwen_image_edit", "qwen-image-edit-2511": "qwen_image_edit"},
    geometry=_geometry, inputs=_inputs, blocks=qwenimage.blocks, tiny="build_tiny_qwenimage_edit",
    check=resolution_check()))
