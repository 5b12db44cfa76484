"""Sequence parallelism (parallel.sequence_parallel: N): the tokens of every transformer pass split over N ranks.

A video row (Wan2.1 at 480p: 32k tokens) or a 1024 px+ image does not fit one GPU's activations, and JAGG's joint
pass holds two endpoints per row. With N-way sequence parallelism the ranks of an sp group hold the same rows and
each runs 1/N of every pass's tokens; the attention sees the whole sequence through Ulysses all-to-alls (heads
<-> sequence), and the transformer's output is gathered back, so everything outside the transformer (the SDE, JAGG,
the loss, the rewards) runs unchanged and identically on the group's ranks.

Implementation: diffusers' own context parallelism (`ContextParallelConfig(ulysses_degree=N)`, the model's
`_cp_plan`: which inputs split on which dim, where the output gathers), maintained with the transformers it plans
(FLUX.1, Wan, Qwen-Image, ...) and dispatching to the attention kernels those use. Chosen over yunchang (what xDiT and
FastVideo use) because it needs no patching of each family's attention processor, and over PyTorch's
context_parallel API because that one shards SDPA calls but not a diffusers model's inputs and outputs.

SD3's MMDiT has no plan in diffusers 0.42 and its joint attention calls SDPA directly: here it gets both (SD3_PLAN:
every block's image and text tokens split after the patch embedding, the output gathered before unpatchifying;
JointContextParallelProcessor: its attention through the same Ulysses dispatch). The ranks' [image | text] slices
meet in an order other than [image | text], which joint attention cannot see (it has no positional term: SD3's
positions are added at the patch embedding). Any other family without a plan is refused, naming the key, and so is
any attention module whose processor the exchange would skip (xformers' on SD3, say): it would attend to its rank's
tokens alone.

Layout (`data_rank`): world = D x N; ranks r = d N + s (d the data rank, s the sequence rank); the rows of a step
are dealt by data rank (train/rows.py), so an sp group samples, scores and trains the same rows. The gathered
output's backward hands each rank the gradient of its own tokens, so each rank's parameter gradients are its tokens'
share and their sum over the group is the full gradient: FSDP2 (over all ranks) reduce-scatters with the divide
factor D, not D N (engine), making the step the data-parallel mean over the D groups, as on D ranks without it.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["apply_sequence_parallel", "data_rank", "data_world", "sequence_split"]


def data_world(world_size: int, sp: int) -> int:
    return world_size // sp


def data_rank(rank: int, sp: int) -> int:
    return rank // sp


def apply_sequence_parallel(transformer: nn.Module, sp: int, rank: int, world_size: int,
                            device: torch.device) -> nn.Module:
    """Ulysses context parallelism of degree `sp` on a diffusers transformer, in place (before FSDP2 wraps it). A
    module of several experts (Wan2.2 A14B's, models/wan_experts.py: its `experts`) has each split as it would be
    alone, every rank in the same order."""
    experts = getattr(transformer, "experts", None)
    if experts is not None:
        for expert in experts:
            apply_sequence_parallel(expert, sp, rank, world_size, device)
        return transformer
    from diffusers import ContextParallelConfig
    from diffusers.models._modeling_parallel import ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    from ..models.registry import family_of_transformer

    name = type(transformer).__name__
    plan, fam = None, family_of_transformer(name)
    if fam is not None and fam.context_parallel is not None:  # the family's own plan where diffusers has none
        plan = fam.context_parallel(transformer)
    elif getattr(transformer, "_cp_plan", None) is None:
        raise ValueError(f"config key 'parallel.sequence_parallel' {sp}: {name} has no context-parallel plan in "
                         "diffusers (its _cp_plan), so its sequence cannot be split; use 1")
    _check_processors(transformer, sp)
    heads = getattr(transformer.config, "num_attention_heads", None)
    if heads is not None and heads % sp:
        raise ValueError(f"config key 'parallel.sequence_parallel' {sp} must divide {name}'s {heads} attention heads "
                         "(Ulysses gives each rank whole heads)")
    mesh = init_device_mesh(device.type, (world_size // sp, 1, sp), mesh_dim_names=("data", "ring", "ulysses"))
    cp_mesh = mesh["ring", "ulysses"]

    def resolve(config):
        # diffusers' own resolver takes the device as rank % the accelerator count, which fails where there is none
        # (CPU, gloo): the same resolution with this run's device and mesh
        config = ParallelConfig(context_parallel_config=config) if isinstance(config, ContextParallelConfig) else config
        config.setup(rank, world_size, device, mesh=cp_mesh)
        transformer._parallel_config = config
        return config

    transformer._resolve_parallel_config = resolve
    plan = plan if plan is not None else transformer._cp_plan
    _check_even_splits(transformer, plan, sp)
    transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=sp, mesh=cp_mesh), cp_plan=plan)
    return transformer


def sd3_context_parallel(transformer: nn.Module | None) -> dict:
    """SD3's plan (sd3_plan); on a transformer (not None: the estimator asks for the plan alone) its joint attention
    (attn) and SD3.5's image-only attention (attn2) go through the Ulysses exchange (JointContextParallelProcessor)."""
    for module in transformer.modules() if transformer is not None else ():
        if type(getattr(module, "processor", None)).__name__ == "JointAttnProcessor2_0":
            module.processor = JointContextParallelProcessor()
    return sd3_plan()


def _check_processors(transformer: nn.Module, sp: int) -> None:
    """Every attention module's processor takes part in the exchange, by diffusers' own rule (enable_parallelism,
    diffusers 0.42 models/modeling_utils.py:1816-1823): it hands the parallel config to the processors of its
    attention classes that have a `_parallel_config` attribute and silently skips the others, while the plan still
    splits the tokens, so a skipped processor (xformers', a custom one) would attend to this rank's tokens alone."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention, MochiAttention

    for name, module in transformer.named_modules():
        processor = getattr(module, "processor", None)
        if isinstance(module, (Attention, MochiAttention, AttentionModuleMixin)) and not hasattr(
                processor, "_parallel_config"):
            raise ValueError(f"config key 'parallel.sequence_parallel' {sp}: {name}'s attention processor "
                             f"{type(processor).__name__} takes no part in the context-parallel exchange (diffusers "
                             "passes it only to processors with a _parallel_config), so each rank would attend to its "
                             "own tokens alone: use model.attention sdpa, or parallel.sequence_parallel 1")


def _check_even_splits(transformer: nn.Module, plan: dict, sp: int) -> None:
    """Ulysses splits a sequence in equal parts (diffusers' uneven variant has no backward): a pre-hook on each module
    the plan splits names the input whose tokens `sp` does not divide, before diffusers' split fails on it."""
    from diffusers.hooks.context_parallel import _get_submodule_by_name

    for name, inputs in plan.items():
        if not isinstance(inputs, dict):
            continue
        # a plan names a module, or the items of a ModuleList by a wildcard (Qwen-Image's "transformer_blocks.*"):
        # resolved as diffusers resolves it, so not their submodules (a block's attention gets the split mask)
        modules = _get_submodule_by_name(transformer, name)
        for module in modules if isinstance(modules, list) else [modules]:
            _check_splits_of(module, inputs, sp, name or type(transformer).__name__)


def _check_splits_of(module: nn.Module, inputs: dict, sp: int, where: str) -> None:
    import inspect

    from diffusers.models._modeling_parallel import ContextParallelInput

    params = list(inspect.signature(module.forward).parameters)

    def check(mod, args, kwargs):
        for key, spec in inputs.items():
            if not isinstance(spec, ContextParallelInput) or spec.split_output:
                continue
            value = kwargs.get(key) if isinstance(key, str) else None
            if value is None and isinstance(key, str) and key in params and params.index(key) < len(args):
                value = args[params.index(key)]
            # a tensor of another rank than planned is not split (diffusers' hook skips it too: Wan's 1-D timestep)
            n = value.shape[spec.split_dim] if isinstance(value, torch.Tensor) and value.ndim == spec.expected_dims \
                else None
            if n is not None and n % sp:
                raise ValueError(f"config key 'parallel.sequence_parallel' {sp} must divide the {n} tokens of "
                                 f"{where}'s {key} (Ulysses splits a sequence evenly): change the resolution, "
                                 "the prompt length (model.max_sequence_length) or the size")

    module.register_forward_pre_hook(check, with_kwargs=True)


def sd3_plan() -> dict:
    """SD3Transformer2DModel's context-parallel plan: block 0's image and text tokens split on the sequence (every
    later block gets the local tokens from the one before), proj_out's output gathered (module docstring)."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    split = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
    return {"transformer_blocks.0": {"hidden_states": split, "encoder_hidden_states": split},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3)}


class JointContextParallelProcessor:
    """SD3's joint attention (diffusers' JointAttnProcessor2_0, or its image-only self-attention without
    encoder_hidden_states) with the attention itself through diffusers' dispatch, so that context parallelism runs it
    as Ulysses over the sequence group: the same projections, norms and output split, [B, S, H, D] layout."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        heads = lambda t: t.unflatten(-1, (attn.heads, -1))  # noqa: E731 - [B, S, H, D]
        query, key, value = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(
            attn.to_v(hidden_states))
        if attn.norm_q is not None:
            query, key = attn.norm_q(query), attn.norm_k(key)
        if encoder_hidden_states is not None:
            q, k, v = (heads(f(encoder_hidden_states)) for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            if attn.norm_added_q is not None:
                q, k = attn.norm_added_q(q), attn.norm_added_k(k)
            query, key, value = torch.cat([query, q], 1), torch.cat([key, k], 1), torch.cat([value, v], 1)
        out = dispatch_attention_fn(query, key, value, backend=self._attention_backend,
                                    parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](out))
        out, context = out[:, :hidden_states.shape[1]], out[:, hidden_states.shape[1]:]
        if not attn.context_pre_only:
            context = attn.to_add_out(context)
        return attn.to_out[1](attn.to_out[0](out)), context


def sequence_split(transformer: nn.Module) -> int:
    """The number of ranks diffusers' context parallelism splits this transformer's sequences over (1: none): a
    sequence the plan splits must be a multiple of it (a prompt cut to its length is padded up to one, masked)."""
    config = getattr(getattr(transformer, "_parallel_config", None), "context_parallel_config", None)
    return 1 if config is None else (config.ring_degree or 1) * (config.ulysses_degree or 1)
