"""The planners (jagg_scale/jagg/planners.py) as typed objects built from the `jagg` section: each takes its own
settings and nothing else, so a key the chosen planner would ignore is an error naming it; what each planner tells the
memory estimate about its passes; and the README's table of which keys belong to which planner."""

import re
from pathlib import Path

import pytest
import torch

from jagg_scale.jagg import (PLANNERS, BudgetPlanner, ExactPlanner, PlannerSettingError, SharedKnotPlanner,
                             WindowPlanner, build_planner, knots_from_windows, plan_knots, plan_uniform, planner_keys,
                             split_windows)
from jagg_scale.train.config import ConfigError, JAGGConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_cpu.yaml"  # its jagg section sets mode only: every planner starts from its defaults


@pytest.mark.parametrize("overrides,keys,planner", [
    # the combinations a review found silently ignored, each now refused naming the key
    (["jagg.rows_per_pass=3"], ["jagg.rows_per_pass"], "window"),
    (["jagg.share_knots=true", "jagg.jagg_frac=0.5"], ["jagg.jagg_frac"], "shared"),
    (["jagg.share_knots=true", "jagg.route_by=weighted"], ["jagg.route_by"], "shared"),
    (["jagg.share_knots=true", "jagg.min_cos=0.5"], ["jagg.min_cos"], "shared"),
    (["jagg.planner=budget", "jagg.window=8"], ["jagg.window"], "budget"),
    (["jagg.planner=budget", "jagg.route_by=vcos"], ["jagg.route_by"], "budget"),
    (["jagg.speedup=3"], ["jagg.speedup"], "window"),
    (["jagg.error_model=cosine"], ["jagg.error_model"], "window"),
    (["jagg.share_knots=true", "jagg.speedup=3"], ["jagg.speedup"], "shared"),
    # several at once: one error naming them all, with the override that unsets each
    (["jagg.planner=budget", "jagg.window=4", "jagg.jagg_frac=1.0"], ["jagg.window", "jagg.jagg_frac"], "budget"),
])
def test_a_key_the_chosen_planner_would_ignore_is_an_error_naming_it(overrides, keys, planner):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    msg = str(info.value)
    assert msg.startswith("config key")
    for key in keys:
        assert f"'{key}'" in msg and f"{key}=null" in msg
    assert f"the {planner} planner does not use" in msg
    unset = overrides + [f"{k}=null" for k in keys]  # the way out the message names works
    assert load_config(TINY, unset).jagg.planner_kind == planner


def test_set_even_to_its_default_a_foreign_key_is_refused():
    """What decides is whether a key is set, not its value: window 4 (the window planner's default) under the budget
    planner would do nothing, so it is refused too."""
    with pytest.raises(ConfigError, match="'jagg.window'"):
        load_config(TINY, ["jagg.planner=budget", "jagg.window=4"])
    with pytest.raises(ConfigError, match="'jagg.share_knots' is a setting of jagg.planner uniform"):
        load_config(TINY, ["jagg.planner=budget", "jagg.share_knots=true"])


def test_the_section_chooses_one_planner_with_the_keys_it_sets():
    assert JAGGConfig().make_planner() == WindowPlanner()
    assert JAGGConfig(window=6, jagg_frac=0.5, route_by="weighted").make_planner() == WindowPlanner(6, 0.5, "weighted")
    assert JAGGConfig(share_knots=True, window=5, rows_per_pass=3).make_planner() == SharedKnotPlanner(5, 3)
    assert JAGGConfig(planner="budget", speedup=2.67).make_planner() == BudgetPlanner(speedup=2.67)
    # mode exact is JAGG off: the plan keys are not used (as lora's are with lora.enabled false)
    assert JAGGConfig(mode="exact", window=8, speedup=3.0).make_planner() == ExactPlanner()
    # ... and a config that sets one with mode exact is refused naming it (a choice owns its keys)
    with pytest.raises(ConfigError, match=r"'jagg.window' is set, but jagg.mode is exact .*\(jagg.window=null\)"):
        load_config(TINY, ["jagg.mode=exact", "jagg.window=8"])
    assert load_config(TINY, ["jagg.window=8", "jagg=null", "jagg.mode=exact"]).jagg.make_planner() == ExactPlanner()
    with pytest.raises(ConfigError, match="'jagg.probe_every' compares a plan's gradient with the exact one"):
        load_config(TINY, ["jagg.mode=exact", "jagg.probe_every=1"])


@pytest.mark.parametrize("kind,key,value,message", [
    ("window", "window", 0, "must be >= 1"),
    ("window", "jagg_frac", 1.5, "must be in [0, 1]"),
    ("window", "min_cos", 2.0, "must be in [-1, 1]"),
    ("shared", "rows_per_pass", 0, "must be >= 1"),
    ("budget", "speedup", 0.5, "must be >= 1"),
    ("budget", "error_model", "l2", "must be one of residual, cosine"),
])
def test_a_setting_out_of_range_names_its_key(kind, key, value, message):
    with pytest.raises(PlannerSettingError, match=re.escape(message)) as info:
        build_planner(kind, **{key: value})
    assert info.value.keys == [key] and info.value.owners is None


def test_each_planner_knows_its_passes():
    """rows_per_pass is what knot_backward takes; knots_per_pass the knots one with-grad pass stacks (the memory
    estimate's rows per pass over the micro-batch); max_interior the longest segment's interior steps."""
    assert (ExactPlanner.rows_per_pass, ExactPlanner().knots_per_pass, ExactPlanner().max_interior(9)) == (None, 1, 0)
    w = WindowPlanner(window=4)
    assert (w.rows_per_pass, w.knots_per_pass, w.max_interior(9), w.max_interior(3)) == (None, 2, 2, 1)
    assert WindowPlanner(jagg_frac=0.0).knots_per_pass == 1 and WindowPlanner(window=1).knots_per_pass == 1
    s = SharedKnotPlanner(window=5, rows_per_pass=3)
    assert (s.rows_per_pass, s.knots_per_pass, s.max_interior(16)) == (3, 3, 3)
    b = BudgetPlanner(speedup=4.0, rows_per_pass=2)
    assert (b.rows_per_pass, b.knots_per_pass, b.max_interior(16)) == (2, 2, 12)  # 4 knots: one segment may span 12


def test_the_planners_plan_what_the_trainer_always_ran():
    T, B = 9, 3
    g = torch.Generator().manual_seed(0)
    velocities, sigmas = torch.randn(T, B, 2, 4, 4, generator=g), torch.linspace(1.0, 0.2, T)
    assert ExactPlanner().plan(velocities, sigmas).plan == [(k, k) for k in range(T)]
    windows = split_windows(range(T), 4)
    every = WindowPlanner(window=4).plan(velocities, sigmas)
    assert every.plan == knots_from_windows(windows) and every.windows == windows and every.jagg_windows == 3
    none = WindowPlanner(window=4, jagg_frac=0.0).plan(velocities, sigmas)
    assert none.plan == [(k, k) for k in range(T)] and none.jagg_windows == 0  # jagg_frac 0 is Flow-GRPO
    shared = SharedKnotPlanner(window=4).plan(velocities, sigmas)
    assert shared.plan == plan_uniform(T, 4, share=True) and shared.windows is None
    norms = [1.0 + k for k in range(T)]
    calls = []
    budget = BudgetPlanner(speedup=3.0).plan(velocities, sigmas, grad_norms=lambda: calls.append(1) or norms)
    assert len(plan_knots(budget.plan)) <= 3 and calls == [1]  # |g_k| asked for once, only by who ranks by it
    WindowPlanner().plan(velocities, sigmas, grad_norms=lambda: calls.append(1) or norms)
    assert calls == [1]
    with pytest.raises(ValueError, match="grad_norms"):
        WindowPlanner(route_by="weighted").plan(velocities, sigmas)


def test_the_docs_say_which_keys_belong_to_which_planner():
    """docs/usage.md's planner table lists each planner's settings exactly (its dataclass fields)."""
    readme = (ROOT / "docs" / "usage.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(exact|window|shared|budget)` \|[^|]*\|([^|]*)\|",
                                                           readme, re.M)}
    assert set(rows) == set(PLANNERS)
    for kind, cell in rows.items():
        listed = re.findall(r"`(\w+)`", cell)
        assert sorted(listed) == sorted(planner_keys(kind)), (kind, listed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_endpoint_cosines_in_row_chunks_are_the_whole_batchs_float64_cosines(monkeypatch, dtype):
    """Routing's statistics without a float64 copy of every window endpoint: a chunk of rows at a time (here 2 of 5
    rows a chunk) gives each row's float64 cosine, so the means are the whole-batch computation's."""
    import jagg_scale.jagg.planners as P

    v = torch.randn(6, 5, 3, 4, 4, generator=torch.Generator().manual_seed(0)).to(dtype)
    windows = [[0, 1, 2], [3, 4, 5], [1, 4]]
    first = torch.stack([v[w[0]] for w in windows]).flatten(2).double()
    last = torch.stack([v[w[-1]] for w in windows]).flatten(2).double()
    whole = torch.nn.functional.cosine_similarity(first, last, dim=2, eps=1e-12).mean(1).tolist()
    monkeypatch.setattr(P, "COSINE_CHUNK", 2 * 48)
    chunked = P.endpoint_cosines(v, windows)
    assert chunked == pytest.approx(whole, rel=1e-14, abs=1e-15) and len(set(chunked)) == 3
