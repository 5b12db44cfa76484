"""Two experts switched by noise level (jagg/experts.py, Wan2.2 A14B) and the planners cut at the switch
(jagg/planners.py with_switch): the rule is the pipeline's on its schedulers' own timesteps, and no knot segment
holds steps of both experts, for one sigma per step and for a sigma per row."""

import pytest
import torch
from extras import need

from jagg_scale.jagg.experts import ExpertSwitch
from jagg_scale.jagg.planners import (BudgetPlanner, ExactPlanner, PlannerSettingError, SharedKnotPlanner,
                                      WindowPlanner, planner_keys, with_switch)
from jagg_scale.jagg.plans import check_plan

SWITCH = ExpertSwitch(boundary_ratio=0.875)
# 8 steps of a shifted schedule: positions 0-2 above 0.875 (the high-noise expert), 3-7 below
SIGMAS = torch.tensor([1.0, 0.948, 0.883, 0.801, 0.694, 0.548, 0.338, 0.009])


def one_expert_each(plan, sigmas, switch=SWITCH):
    """Whether every segment's steps (ends and interior) run one expert, for every row."""
    high = switch.high(sigmas)
    high = high[:, None] if high.ndim == 1 else high
    return all(bool((high[a:b + 1] == high[a]).all()) for a, b in plan)


@pytest.mark.parametrize("integer", [False, True])
def test_the_rule_is_the_pipelines_on_its_schedulers_timesteps(integer):
    """WanPipeline runs transformer while its scheduler's t >= boundary_ratio x 1000 (pipeline_wan.py:597): t is
    float for FlowMatchEulerDiscreteScheduler and int64 for UniPC's flow sigmas. The switch, reading the float32
    sigmas the rollout holds, picks the pipeline's expert at every step of 1 .. 60-step schedules at several shifts
    and boundaries (a rule on the untruncated t would differ from UniPC's at e.g. t = 875.4 vs 0.8755)."""
    need("diffusers")
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    checked = 0
    for shift in (1.0, 3.0, 5.0, 12.0):
        sched = (UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift)
                 if integer else FlowMatchEulerDiscreteScheduler(shift=shift))
        for n in range(1, 61):
            sched.set_timesteps(n)
            assert torch.is_floating_point(sched.timesteps) != integer
            for ratio in (0.875, 0.9, 0.5):
                switch = ExpertSwitch(ratio, integer_timesteps=integer)
                pipeline = sched.timesteps >= ratio * 1000
                assert torch.equal(switch.high(sched.sigmas[:n].float()), pipeline), (shift, n, ratio)
                checked += int(pipeline.sum()) * int((~pipeline).sum()) > 0  # both experts in this schedule
    assert checked > 100  # the schedules cross the switch, so a wrong side would show


def test_truncated_timesteps_compare_as_the_integer_the_pipeline_sees():
    # t = 875.9 is 875 as UniPC's int64 (>= 875: high) and as a float >= 875 too; t = 874.99 is 874 / 874.99 (low);
    # a boundary of 875.5 puts 875.9 low once truncated (875 < 875.5) but high as a float
    t = torch.tensor([875.9, 874.99])
    assert ExpertSwitch(0.875, integer_timesteps=True).high_at_timestep(t).tolist() == [True, False]
    assert ExpertSwitch(0.8755, integer_timesteps=True).high_at_timestep(t).tolist() == [False, False]
    assert ExpertSwitch(0.8755, integer_timesteps=False).high_at_timestep(t).tolist() == [True, False]
    with pytest.raises(ValueError, match="boundary_ratio must be in \\(0, 1\\)"):
        ExpertSwitch(1.0)


def test_cuts_and_spans_per_step_and_per_row():
    assert SWITCH.cuts(SIGMAS) == [3] and SWITCH.spans(SIGMAS) == [(0, 2), (3, 7)]
    # per row ([K, B]): row 1 switches after position 1, row 0 after position 2: both are cuts, so every span is
    # within one expert for both rows
    rows = torch.stack([SIGMAS, torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])], 1)
    assert SWITCH.cuts(rows) == [2, 3] and SWITCH.spans(rows) == [(0, 1), (2, 2), (3, 7)]
    assert SWITCH.spans(torch.tensor([0.5, 0.4])) == [(0, 1)]  # all low: one span


def test_a_window_across_the_switch_is_split_and_every_window_lies_within_one_expert():
    """Windows of 4 over 8 steps are [0-3] [4-7] without the switch, the first holding steps of both experts; with
    it [0-2] [3-6] [7]: one JAGG segment per window, each within one expert."""
    v = torch.randn(8, 2, 4)
    plain = WindowPlanner(window=4).plan(v, SIGMAS)
    assert plain.windows == [[0, 1, 2, 3], [4, 5, 6, 7]] and not one_expert_each(plain.plan, SIGMAS)
    cut = with_switch(WindowPlanner(window=4), SWITCH).plan(v, SIGMAS)
    assert cut.windows == [[0, 1, 2], [3, 4, 5, 6], [7]] and cut.plan == [(0, 2), (3, 6), (7, 7)]
    assert one_expert_each(cut.plan, SIGMAS) and check_plan(cut.plan, 8) == cut.plan
    # routed windows (jagg_frac) are chosen among the cut ones
    half = with_switch(WindowPlanner(window=4, jagg_frac=0.5), SWITCH).plan(v, SIGMAS)
    assert half.windows == cut.windows and one_expert_each(half.plan, SIGMAS)
    # per-row sigmas: the union of the rows' switches is cut
    rows = torch.stack([SIGMAS, torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])], 1)
    per_row = with_switch(WindowPlanner(window=4), SWITCH).plan(v, rows)
    assert per_row.windows == [[0, 1], [2], [3, 4, 5, 6], [7]] and one_expert_each(per_row.plan, rows)


@pytest.mark.parametrize("window", [2, 3, 4, 6])
def test_shared_knot_segments_stop_at_the_switch(window):
    v = torch.randn(8, 2, 4)
    plain = SharedKnotPlanner(window=window).plan(v, SIGMAS).plan
    cut = with_switch(SharedKnotPlanner(window=window), SWITCH).plan(v, SIGMAS).plan
    assert not one_expert_each(plain, SIGMAS)  # a segment of the uncut plan spans positions 2 and 3
    assert one_expert_each(cut, SIGMAS) and check_plan(cut, 8) == cut
    assert (2, 3) not in cut and any(a == 3 for a, _ in cut)  # the low-noise span starts its own segment


def test_what_the_switch_changes_about_a_planner():
    # a plan cut at the switch depends on the sampled sigmas: none is fixed before the rollout
    assert WindowPlanner(window=4).fixed_plan(8) is not None
    assert with_switch(WindowPlanner(window=4), SWITCH).fixed_plan(8) is None
    assert with_switch(SharedKnotPlanner(window=4), SWITCH).fixed_plan(8) is None
    assert with_switch(ExactPlanner(), SWITCH) == ExactPlanner()  # one step a segment never crosses
    assert with_switch(WindowPlanner(), None) == WindowPlanner()
    with pytest.raises(PlannerSettingError, match="budget planner cannot cut its segments"):
        with_switch(BudgetPlanner(), SWITCH)
    assert "switch" not in planner_keys("window") + planner_keys("shared")  # the model sets it, no config key
