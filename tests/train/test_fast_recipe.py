"""configs/sd35m_pickscore_fast.yaml, the fast JAGG recipe: the faithful config (sd35m_pickscore) but for the keys its
header names, and one step of it end to end on the tiny SD3 pipeline."""

from __future__ import annotations

import pytest

from jagg_scale.train import Trainer, load_config
from recipe_paths import ROOT, recipe_paths
from extras import need

need("diffusers")


def test_the_fast_recipe_is_the_shipped_one_with_its_departures_alone(sd3_dir, tmp_path):
    """configs/sd35m_pickscore_fast.yaml = configs/sd35m_pickscore.yaml but for the keys its header names: a 4-step
    SDE window in [0, 5] trained whole, dpm2 on 2 ODE steps, one optimizer step a rollout (EMA every 4 of them); not
    the shared x_T (the header says why). Any other difference is a value the header does not say."""
    def flat(cfg):  # section.key -> value, from the config's own plain form (what resume compares)
        return {f"{name}.{key}": value for name, section in cfg.to_dict().items() if isinstance(section, dict)
                for key, value in section.items()}

    base, fast = (flat(load_config(ROOT / "configs" / f"{n}.yaml", recipe_paths(sd3_dir, tmp_path)))
                  for n in ("sd35m_pickscore", "sd35m_pickscore_fast"))
    diff = {k: fast[k] for k in base if base[k] != fast[k]}
    assert diff == {"grpo.sde_window": 4, "grpo.sde_window_range": [0, 5], "grpo.timestep_fraction": 1.0,
                    "sampling.ode_solver": "dpm2", "sampling.ode_steps": 2, "train.minibatch_size": 48 * 24,
                    "train.ema_every": 4}, diff  # (run.output_dir: recipe_paths sets both)


@pytest.mark.slow
def test_the_fast_recipe_trains_a_step_on_the_tiny_pipeline(sd3_dir, tmp_path):
    """One step as shipped on the tiny SD3 pipeline (FSDP2, one process): the window's 4 steps trained by one JAGG
    joint pass (2 backwards a sample's minibatch instead of 4), on-policy (ratio 1), one optimizer step; the rollout
    runs the ODE before the window (drawn at step 1 under run.seed 1) on every row, no group sharing it."""
    shrink = ["model.resolution=null", "grpo.group_size=4", "train.prompts_per_step=2", "train.minibatch_size=8",
              "train.micro_batch_size=8", "sampling.chunk_size=8", "train.steps=1", "eval.enabled=false",
              "log.wandb=false", "log.progress=false", "reward.name=jpeg_compressibility", "reward.options={}",
              "run.resume=none", "run.seed=1"]
    name = "sd35m_pickscore_fast"
    trainer = Trainer(load_config(ROOT / "configs" / f"{name}.yaml", recipe_paths(sd3_dir, tmp_path) + shrink))
    try:
        window = list(trainer.algorithm.rollout_spec(0).trained)
        (row,) = trainer.fit()
    finally:
        trainer.close()
    assert window == [1, 2, 3, 4] and row["sde_window_start"] == 1
    assert row["backward_passes"] == 2 and row["per_step_equiv"] == 4  # one minibatch: one window a sample
    assert row["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert row.get("rollout_prefix_rows", 0) == 0  # sampling.same_initial_noise off (the header)
