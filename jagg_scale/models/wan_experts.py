"""Wan2.2 A14B's two experts as one module: the adapter's `transformer` (models/wan.py) when the WanPipeline has a
`transformer_2`, so that everything that sees "the transformer" (the optimizer, the engines' blocks, LoRA, the
KL reference copy, checkpoints) sees both experts, and the rollout and the training passes call it as one.

diffusers' WanPipeline (0.42.1, pipelines/wan/pipeline_wan.py:585-604) runs `transformer` (here `high`) while its
timestep t >= boundary_ratio x num_train_timesteps and `transformer_2` (`low`) below; `forward` applies that rule
per row (jagg/experts.py ExpertSwitch), so a pass whose rows sit on both sides runs each expert on its own rows.
Only the active expert computes, both are held. Parameter names: `high.<...>` and `low.<...>`; a LoRA target
matches in both (peft matches target names by their ending: models/lora.py), so both experts' adapters train.

Fail closed: the two experts must agree on what the adapter reads from one (patch, channels, text width).
"""

from __future__ import annotations

import torch
from torch import nn

from ..jagg.experts import ExpertSwitch

__all__ = ["ExpertsError", "WanExperts", "expert_switch", "split_state"]


class ExpertsError(ValueError):
    """A pipeline whose two experts cannot be run as the pipeline runs them (models/wan.py: a ConfigError naming
    model.pretrained when the run config loads it)."""

# the WanTransformer3DModel config entries both experts must share: the latents and prompts one adapter feeds both
SHARED_CONFIG = ("patch_size", "in_channels", "out_channels", "text_dim")


def expert_switch(pipe) -> ExpertSwitch | None:
    """The pipeline's expert switch (None: one transformer). A `transformer_2` the pipeline never runs (no
    boundary_ratio: pipeline_wan.py:585-588 keeps `transformer` throughout) or no `transformer` at all is refused,
    in one line naming what is wrong."""
    if getattr(pipe, "transformer_2", None) is None:
        return None
    ratio = pipe.config.get("boundary_ratio") if hasattr(pipe.config, "get") else None
    if getattr(pipe, "transformer", None) is None:
        raise ExpertsError("this WanPipeline has a transformer_2 but no transformer (the high-noise expert): "
                         "model.pretrained must hold both Wan2.2 A14B experts")
    if ratio is None:
        raise ExpertsError("this WanPipeline has a transformer_2 but no boundary_ratio in model_index.json, so the "
                         "pipeline never runs it (pipeline_wan.py:585-588); remove transformer_2 or set the ratio")
    sched = type(pipe.scheduler).from_config(pipe.scheduler.config)
    sched.set_timesteps(2)
    return ExpertSwitch(boundary_ratio=float(ratio), num_train_timesteps=int(pipe.scheduler.config.num_train_timesteps),
                        integer_timesteps=not torch.is_floating_point(sched.timesteps))


class WanExperts(nn.Module):
    """`high` (the pipeline's transformer) and `low` (its transformer_2) behind one WanTransformer3DModel call."""

    components = {"high.": "transformer", "low.": "transformer_2"}  # each expert's pipeline directory (meta_load)

    def __init__(self, high: nn.Module, low: nn.Module, switch: ExpertSwitch):
        super().__init__()
        for key in SHARED_CONFIG:
            a, b = high.config.get(key), low.config.get(key)
            if (list(a) if isinstance(a, (list, tuple)) else a) != (list(b) if isinstance(b, (list, tuple)) else b):
                raise ExpertsError(f"Wan2.2 experts disagree on {key}: transformer {a}, transformer_2 {b}")
        self.high, self.low = high, low
        self.switch = switch

    @property
    def experts(self) -> tuple[nn.Module, nn.Module]:
        return self.high, self.low

    @property
    def config(self):
        """The high-noise expert's config: what the adapter reads (patch, channels) is the same in both."""
        return self.high.config

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                return_dict: bool = False, **kwargs):
        """Each row through the expert the pipeline would run at its timestep; returns (velocity,)."""
        high = self.switch.high_at_timestep(timestep)

        def run(expert, rows):
            return expert(hidden_states=hidden_states[rows], timestep=timestep[rows],
                          encoder_hidden_states=encoder_hidden_states[rows], return_dict=False, **kwargs)[0]

        n_high = int(high.sum())  # one host read a pass: which expert(s) to run is a host decision
        if n_high in (0, high.numel()):
            expert = self.high if n_high else self.low
            out = expert(hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                         return_dict=False, **kwargs)[0]
        else:  # rows on both sides of the switch: each expert on its own rows, put back in order
            idx_high, idx_low = torch.nonzero(high).flatten(), torch.nonzero(~high).flatten()
            a, b = run(self.high, idx_high), run(self.low, idx_low)
            out = a.new_empty((hidden_states.shape[0], *a.shape[1:]))
            out = out.index_copy(0, idx_high, a).index_copy(0, idx_low, b)
        return (out,)

    # ------------------------------------------------------------------ what the adapter and lora.py call on "the
    # transformer", on both experts
    def enable_gradient_checkpointing(self):
        for expert in self.experts:
            expert.enable_gradient_checkpointing()

    def disable_gradient_checkpointing(self):
        for expert in self.experts:
            expert.disable_gradient_checkpointing()

    def add_adapter(self, config, adapter_name: str = "default"):
        """peft's LoRA (diffusers' PeftAdapterMixin.add_adapter) on each expert with the same config."""
        for expert in self.experts:
            expert.add_adapter(config, adapter_name=adapter_name)

    @property
    def peft_config(self) -> dict:
        return self.high.peft_config

    def disable_adapters(self):
        for expert in self.experts:
            expert.disable_adapters()

    def enable_adapters(self):
        for expert in self.experts:
            expert.enable_adapters()


def split_state(state: dict, prefix: str = "transformer.") -> dict[str, dict]:
    """A gathered state dict of the adapter ("transformer.high.<...>", "transformer.low.<...>") as each expert's
    own ({"high": {"transformer.<...>": ...}, "low": {...}}), the layout a one-transformer adapter's state has."""
    out: dict[str, dict] = {"high": {}, "low": {}}
    for key, value in state.items():
        for name in out:
            if key.startswith(f"{prefix}{name}."):
                out[name][prefix + key[len(prefix) + len(name) + 1:]] = value
    return out
