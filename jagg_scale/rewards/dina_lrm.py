"""`dina_lrm`: DiNa-LRM (HKUST-C4G/diffusion-rm at af485b4, Apache-2.0), a latent reward model: it scores the
rollout's final latents without the VAE decode (Reward.on_latents).

    x_s   = (1 - s) x0 + s eps          the latents noised to the scheduler sigma nearest `sigma` (their inference
                                        default 0.1; README's example 0.4), eps drawn per row from the row's own bytes
    feats = SD3.5's first N blocks      pos_embed, time_text_embed(t, pooled), context_embedder, then N joint blocks
                                        with the model's LoRA merged (r 64, alpha 128 on to_q/k/v, to_out.0, add_q/k/v,
                                        to_add_out), image and text tokens kept after blocks visual_head_idx /
                                        text_head_idx (SD3-M 12-layer: 4, 8, 12)
    score = head(feats, temb)           per kept layer a FiLM adapter (temb's scale and shift, a layer embedding, a
                                        projection to width / 4), concatenated and projected to width; 4 learned
                                        queries cross-attend to image + text tokens (token-wise sigmoid gates on the
                                        values), then to image tokens, then an FFN; a linear head, mean over queries;
                                        then (score + offset) * scale (README's example: offset 10, scale 0.1)

The prompt is encoded by the same pipeline's CLIP-L, CLIP-G and T5 at `max_sequence_length` tokens (its model's
encode_prompt: 128), as diffusers' StableDiffusion3Pipeline.encode_prompt does. Files: `path` holds config.json
(the model section) and checkpoint/backbone_lora (peft's adapter_config.json + adapter_model.safetensors) and
checkpoint/rm_head.pt (read weights-only); `pipeline` a local SD3.5-medium pipeline directory (its transformer, text
encoders, tokenizers and scheduler). The backbone is the base model's, not the policy being trained.

Departures: the noise is drawn per row from a generator seeded by the row's latents (theirs: torch.randn_like,
unseeded), so a score is a function of its latents and a resumed run scores as the uninterrupted one; the LoRA is
merged into the backbone's weights once (peft applies it at every forward: the same function, up to float order).
Checked against the reference's own code on a tiny SD3 (docs/rewards.md)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .base import Reward, RewardOutput, register

__all__ = ["DiNaLRM", "RewardHead", "load_head_config"]

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


class _FiLM(nn.Module):
    """One kept layer's tokens, modulated by the time embedding: (x (1 + gamma) + beta + layer_embed) -> proj."""

    def __init__(self, in_dim: int, emb_dim: int, width: int, out_dim: int, use_proj_in: bool):
        super().__init__()
        self.proj_in = nn.Linear(in_dim, width) if (in_dim != width or use_proj_in) else nn.Identity()
        self.layer_embed = nn.Parameter(torch.zeros(1, 1, width))
        self.cond_mlp = nn.Sequential(nn.Linear(emb_dim, 2 * width), nn.SiLU(), nn.Linear(2 * width, 2 * width))
        self.proj = nn.Linear(width, out_dim)

    def forward(self, x, temb):
        gamma, beta = self.cond_mlp(temb)[:, None].chunk(2, dim=-1)
        return self.proj(self.proj_in(x) * (1 + gamma) + beta + self.layer_embed)


class _CrossAttn(nn.Module):
    """Queries attend to image tokens (and text tokens, a second attention whose output is added), values gated per
    token by sigmoid(MLP(token)) when `gated`; pre-norms (RMS), a residual."""

    def __init__(self, dim: int, heads: int, text: bool, gated: bool):
        super().__init__()
        self.heads = heads
        self.norm_q, self.norm_v = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.norm_t = nn.RMSNorm(dim) if text else None
        self.to_q, self.to_k_vis, self.to_v_vis = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_k_text = nn.Linear(dim, dim) if text else None
        self.to_v_text = nn.Linear(dim, dim) if text else None
        self.to_out = nn.Sequential(nn.Linear(dim, dim), nn.Dropout(0.0))
        gate = lambda: nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, 1))  # noqa: E731
        self.gate_vis = gate() if gated else None
        self.gate_text = gate() if gated and text else None

    def _attend(self, q, k, v):
        b, n, d = q.shape
        split = lambda x: x.view(b, x.shape[1], self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        return F.scaled_dot_product_attention(split(q), split(k), split(v)).transpose(1, 2).reshape(b, n, d)

    def _branch(self, q, ctx, to_k, to_v, gate):
        v = to_v(ctx)
        if gate is not None:
            v = v * torch.sigmoid(gate(ctx))
        return self._attend(q, to_k(ctx), v)

    def forward(self, queries, visual, text=None):
        q = self.to_q(self.norm_q(queries))
        h = self._branch(q, self.norm_v(visual), self.to_k_vis, self.to_v_vis, self.gate_vis)
        if self.norm_t is not None and text is not None:
            h = h + self._branch(q, self.norm_t(text), self.to_k_text, self.to_v_text, self.gate_text)
        return queries + self.to_out(h)


class RewardHead(nn.Module):
    """DiNa-LRM's head (module docstring); parameter names as its rm_head.pt stores them."""

    def __init__(self, token_dim: int, n_visual: int, n_text: int, t_embed_dim: int, *, width: int = -1,
                 out_dim: int = 1, num_queries: int = 4, num_attn_heads: int = 8, use_proj_in: bool = False):
        super().__init__()
        width = token_dim if width == -1 else width
        if width % num_attn_heads or width % 4:
            raise ValueError(f"dina_lrm: width {width} must divide by num_attn_heads {num_attn_heads} and by 4")
        film = lambda: _FiLM(token_dim, t_embed_dim, width, width // 4, use_proj_in)  # noqa: E731
        self.layer_adapters_visual = nn.ModuleList(film() for _ in range(n_visual))
        self.layer_adapters_text = nn.ModuleList(film() for _ in range(n_text))
        self.agg_visual = nn.Linear(n_visual * (width // 4), width)
        self.agg_text = nn.Linear(n_text * (width // 4), width) if n_text else None
        self.query_tokens = nn.Parameter(torch.zeros(1, num_queries, width))
        self.attn1 = _CrossAttn(width, num_attn_heads, text=n_text > 0, gated=True)
        self.attn2 = _CrossAttn(width, num_attn_heads, text=False, gated=False)
        self.norm_ff = nn.RMSNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(0.0))
        self.head = nn.Linear(width, out_dim)

    def forward(self, visual: list[torch.Tensor], text: list[torch.Tensor], temb: torch.Tensor) -> torch.Tensor:
        vis = self.agg_visual(torch.cat([a(x, temb) for a, x in zip(self.layer_adapters_visual, visual)], -1))
        txt = (self.agg_text(torch.cat([a(x, temb) for a, x in zip(self.layer_adapters_text, text)], -1))
               if self.agg_text is not None else None)
        q = self.query_tokens.expand(vis.shape[0], -1, -1)
        q = self.attn2(self.attn1(q, vis, txt), vis)
        q = q + self.ff(self.norm_ff(q))
        return self.head(q).mean(dim=1)


def load_head_config(path: Path) -> dict:
    """The `model` section of a DiNa-LRM config.json, checked: what this port implements, nothing else."""
    try:
        model = json.loads(path.read_text(encoding="utf-8"))["model"]
        m = {k: model[k] for k in ("num_transformer_layers", "visual_head_idx", "text_head_idx", "use_t_embed",
                                   "use_lora", "reward_head")}
        m["use_logistic"] = bool(model.get("use_logistic", False))
        ok = (isinstance(m["num_transformer_layers"], int) and 1 <= m["num_transformer_layers"] <= 64
              and all(isinstance(i, int) and 0 <= i <= m["num_transformer_layers"]
                      for i in m["visual_head_idx"] + m["text_head_idx"]) and 1 <= len(m["visual_head_idx"]) <= 16
              and len(m["text_head_idx"]) <= 16 and m["use_t_embed"] is True and not m["use_logistic"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"dina_lrm: {path} is not a DiNa-LRM config ({type(err).__name__}: {err})") from None
    if not ok:
        raise ValueError(f"dina_lrm: {path}: layers / head indices out of range, or use_t_embed off or use_logistic "
                         "on (not implemented here)")
    return m


def _merge_lora(backbone: nn.Module, adapter: Path) -> int:
    """W += (alpha / r) B A for every module the peft adapter names (its keys relative to the backbone); the count."""
    from safetensors.torch import load_file

    cfg = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    if cfg.get("use_rslora") or cfg.get("use_dora"):
        raise ValueError(f"dina_lrm: {adapter}: rsLoRA / DoRA adapters are not supported")
    scale = float(cfg["lora_alpha"]) / float(cfg["r"])
    state = load_file(adapter / "adapter_model.safetensors")
    modules = dict(backbone.named_modules())
    merged = 0
    with torch.no_grad():
        for key, a in state.items():
            if not key.endswith(".lora_A.weight"):
                continue
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = state.get(key.replace(".lora_A.", ".lora_B."))
            module = modules.get(name)
            if b is None or not isinstance(module, nn.Linear) or not name.endswith(LORA_TARGETS):
                raise ValueError(f"dina_lrm: {adapter}: {key!r} names no LoRA target of the backbone")
            module.weight += (scale * b.float() @ a.float()).to(module.weight.dtype)
            merged += 1
    if not merged:
        raise ValueError(f"dina_lrm: {adapter} holds no LoRA weights")
    return merged


@register("dina_lrm")
class DiNaLRM(Reward):
    on_latents = True

    def __init__(self, *, path: str, pipeline: str, sigma: float = 0.1, max_sequence_length: int = 128,
                 offset: float = 0.0, scale: float = 1.0, dtype: str = "bfloat16", device: str = "auto",
                 batch_size: int = 16):
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

        from ..checkpoint.pickles import load_torch
        from .base import resolve_device

        dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
        if not 0.0 <= sigma < 1.0:
            raise ValueError(f"dina_lrm: sigma must be in [0, 1), got {sigma}")
        if dtype not in dtypes or not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"dina_lrm: dtype must be one of {sorted(dtypes)} and batch_size an int >= 1, got "
                             f"{dtype!r}, {batch_size!r}")
        root, pipe_dir = Path(path), Path(pipeline)
        for what, need in (("path", root / "checkpoint" / "rm_head.pt"), ("pipeline", pipe_dir / "model_index.json")):
            if not need.is_file():
                raise ValueError(f"dina_lrm: option {what}={str(root if what == 'path' else pipe_dir)!r} holds no "
                                 f"{need.relative_to(root if what == 'path' else pipe_dir)}")
        cfg = load_head_config(root / "config.json")
        self.dtype = dtypes[dtype]
        self.device = resolve_device(device)
        self.offset, self.scale, self.batch_size = float(offset), float(scale), int(batch_size)
        self.max_sequence_length = int(max_sequence_length)
        transformer = SD3Transformer2DModel.from_pretrained(pipe_dir / "transformer", dtype=torch.float32,
                                                            local_files_only=True)
        n = cfg["num_transformer_layers"]
        if n > len(transformer.transformer_blocks):
            raise ValueError(f"dina_lrm: {n} layers, the transformer has {len(transformer.transformer_blocks)}")
        transformer.transformer_blocks = transformer.transformer_blocks[:n]  # the rest is never run: dropped
        transformer.norm_out = transformer.proj_out = None
        if cfg["use_lora"]:
            _merge_lora(transformer, root / "checkpoint" / "backbone_lora")
        self.backbone = transformer.to(self.device, self.dtype).eval().requires_grad_(False)
        self.visual_idx, self.text_idx = set(cfg["visual_head_idx"]), set(cfg["text_head_idx"])
        head = {k: v for k, v in cfg["reward_head"].items()
                if k in ("width", "out_dim", "num_queries", "num_attn_heads", "use_proj_in")}
        dim = transformer.inner_dim
        self.head = RewardHead(dim, len(cfg["visual_head_idx"]), len(cfg["text_head_idx"]), dim, **head)
        self.head.load_state_dict(load_torch(root / "checkpoint" / "rm_head.pt"))
        self.head.to(self.device, self.dtype).eval().requires_grad_(False)
        self.encoder = StableDiffusion3Pipeline.from_pretrained(pipe_dir, transformer=None, vae=None,
                                                                dtype=self.dtype, local_files_only=True)
        self.encoder.to(self.device)
        sched = FlowMatchEulerDiscreteScheduler.from_pretrained(pipe_dir / "scheduler", local_files_only=True)
        i = int(torch.argmin((sched.sigmas - sigma).abs()))  # the scheduler's sigma nearest `sigma` (theirs too)
        self.sigma, self.timestep = float(sched.sigmas[i]), float(sched.timesteps[i])

    def _noise(self, latents: torch.Tensor) -> torch.Tensor:
        rows = []
        for x in latents:  # each row's own draw, from its bytes: a score is a function of its latents
            seed = zlib.crc32(x.detach().float().cpu().numpy().tobytes())
            g = torch.Generator().manual_seed(seed)
            rows.append(torch.randn(x.shape, generator=g))
        return torch.stack(rows).to(latents.device)

    @torch.no_grad()
    def features(self, x: torch.Tensor, cond: torch.Tensor, pooled: torch.Tensor):
        t = torch.full((len(x),), self.timestep, device=x.device)
        bb = self.backbone
        h, temb, ctx = bb.pos_embed(x), bb.time_text_embed(t, pooled), bb.context_embedder(cond)
        visual, text = ([h] if 0 in self.visual_idx else []), ([ctx] if 0 in self.text_idx else [])
        for i, block in enumerate(bb.transformer_blocks, start=1):
            ctx, h = block(hidden_states=h, encoder_hidden_states=ctx, temb=temb)
            if i in self.visual_idx:
                visual.append(h)
            if i in self.text_idx:
                text.append(ctx)
        return visual, text, temb

    @torch.no_grad()
    def __call__(self, latents: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> RewardOutput:
        out = []
        for i in range(0, len(prompts), self.batch_size):
            x0 = latents[i: i + self.batch_size].to(self.device, torch.float32)
            x = ((1 - self.sigma) * x0 + self.sigma * self._noise(x0)).to(self.dtype)
            cond, _, pooled, _ = self.encoder.encode_prompt(
                prompt=[str(p) for p in prompts[i: i + self.batch_size]], prompt_2=None, prompt_3=None,
                device=self.device, do_classifier_free_guidance=False,
                max_sequence_length=self.max_sequence_length)
            visual, text, temb = self.features(x, cond.to(self.dtype), pooled.to(self.dtype))
            out.append(self.head(visual, text, temb).float()[:, 0])
        scores = (torch.cat(out) + self.offset) * self.scale
        return RewardOutput(scores=scores.cpu())
