"""jagg-bench: one command that measures what JAGG buys, side by side, on the machine it runs on.

    python -m tools.bench                                  # the full run (< 15 min on a 2-core CPU)
    python -m tools.bench --quick --out /tmp/bench          # every part at toy sizes (< 1 min): a smoke test
    python -m tools.bench --parts window_speed,memory --out /tmp/bench

Parts (a module each, window_speed and cfg one together in window.py; every figure is a ratio of two
measurements from the same run):

    window_speed  one window of W steps on an SD3-shaped DiT: per-step vs eff_grpo-style vs jagg_backward
    memory        peak memory of the joint 2B-row pass vs a per-step B-row pass, +- activation checkpointing
    cfg           training under CFG 4.5: Flow-GRPO's batched cond+uncond step vs the cached uncond, per-step and JAGG

Studies (run only when named in --parts; they train for longer than the whole default run):

    time_to_reward  held-out reward vs wall-clock on digits: Flow-GRPO, JAGG, the planner, SDE windows, the
                    compressed ODE rollout (python -m tools.bench --parts time_to_reward --merge)
    whole_step      one rank's share of sd35m_pickscore's step at production proportions, phase by phase:
                    Flow-GRPO as its train_sd3.py runs it, the shipped recipe, one step a rollout, the fast recipe;
                    the step-time model priced with passes measured here (python -m tools.bench --parts whole_step
                    --merge; --set gpus=32 at 32 GPUs' proportions)

Outputs (--out OUT, default docs/results/benchmarks): OUT.json (every number), OUT_<part>.png (plots) and the
generated report (docs/benchmarks.md; OUT.md for an OUT outside a results/ folder).
"""

import importlib

DEFAULT_PARTS = ("window_speed", "memory", "cfg")
STUDIES = ("time_to_reward", "whole_step")
PARTS = DEFAULT_PARTS + STUDIES
MODULES = {"window_speed": "window", "cfg": "window"}  # parts that share one timing loop


def part(name: str):
    """A part's run / markdown / plot (and parse_settings where it takes --set): its module, or its class in a module
    of several parts (window.PARTS)."""
    module = importlib.import_module(f"tools.bench.{MODULES.get(name, name)}")
    return getattr(module, "PARTS", {}).get(name, module)
