"""A run's checkpoints and exports (train/run_state.py) in one process: a resume hashes each file once, a
preemption checkpoints without exporting, run.export_every and run.export_dtype decide when and in which dtype the
weights are exported, and a run preempted at its last step still gets its final export. (Across ranks:
test_checkpoint_ranks.py.)"""

import json
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from jagg_scale.checkpoint import digests
from jagg_scale.models.dit import DiT, DiTConfig
from jagg_scale.parallel.dist import DistContext
from jagg_scale.parallel.config import ParallelConfig
from jagg_scale.parallel.local_engine import LocalEngine
from jagg_scale.train import Trainer, load_config
from jagg_scale.train.run_state import EXPORT_RECORD, RunState
from stand_ins import sigterm_at_step

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.image_size=8", "model.dit.patch_size=2", "model.dit.hidden_size=32", "model.dit.depth=2",
         "model.dit.num_heads=2", "sampling.num_steps=4", "train.prompts_per_step=2", "grpo.group_size=2",
         "train.minibatch_size=4", "log.progress=false", "run.checkpoint_every=0", "jagg.window=2"]


class Source:
    def state_dict(self):
        return {"index": 3}

    def load_state_dict(self, state):
        self.loaded = state


def fake_save(out, state):
    """What a diffusers backbone's save_full / save_lora write, in miniature: the state as one safetensors file."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / "weights.safetensors"))
    return out


def run_state(tmp_path, *overrides) -> RunState:
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", *overrides])
    torch.manual_seed(0)
    model = DiT(DiTConfig(image_size=8, in_channels=3, patch_size=4, hidden_size=32, depth=2, num_heads=2,
                          vocab_size=64, max_prompt_length=4))
    return RunState(cfg, DistContext(), LocalEngine(model, ParallelConfig(), cfg.train, DistContext()), tmp_path)


def counting(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = digests.sha256_file
    monkeypatch.setattr(digests, "sha256_file", lambda p: calls.append(Path(p).name) or real(p))
    return calls


@pytest.mark.parametrize("resume", ["auto", "path"])
def test_resume_hashes_every_file_of_the_checkpoint_once(tmp_path, monkeypatch, resume):
    rs = run_state(tmp_path)
    rs.save(1, Source())
    newest = rs.save(2, Source())
    calls = counting(monkeypatch)
    setting = "auto" if resume == "auto" else str(newest)
    again = run_state(tmp_path, f"run.resume={setting}")
    assert again.resume(Source()) == 2
    files = json.loads((newest / "manifest.json").read_text())["files"]
    assert sorted(calls) == sorted(Path(n).name for n in files)  # once each, the older checkpoint not at all


def test_a_preempted_step_checkpoints_but_does_not_export(tmp_path):
    rs = run_state(tmp_path, "run.export_every=2")
    exported = []
    rs.export = lambda model, step=None: exported.append(step)
    rs.after_step(2, Source(), None, last=False, preempted=True)  # export_every would have been due
    rs.after_step(3, Source(), None, last=True, preempted=True)  # the last step, preempted: the resumed run exports
    assert exported == []
    assert sorted(p.name for p in rs.ckpt_root.iterdir()) == ["step_00000002", "step_00000003"]
    rs.after_step(4, Source(), None, last=False, preempted=False)
    assert exported == [4]


@pytest.mark.parametrize("every,expected", [(0, [5]), (2, [2, 4, 5])])
def test_the_trainer_exports_every_n_steps_and_at_the_end(tmp_path, monkeypatch, every, expected):
    exported = []
    monkeypatch.setattr(RunState, "export", lambda self, model, step=None: exported.append(step))
    Trainer(load_config(TINY, SMALL + [f"run.output_dir={tmp_path}", "train.steps=5", f"run.export_every={every}",
                                       "run.checkpoint_every=2"])).fit()
    assert exported == expected
    # checkpoints are their own schedule (2, 4 and the last)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir())[-1] == "step_00000005"


def test_a_sigterm_in_the_trainer_saves_without_exporting_and_the_resumed_run_exports_at_the_end(tmp_path,
                                                                                                   monkeypatch):
    overrides = SMALL + [f"run.output_dir={tmp_path}", "train.steps=2", "run.export_every=1"]
    trainer = Trainer(load_config(TINY, overrides))
    trainer.model.save_full = trainer.model.save_lora = fake_save  # a backbone with a diffusers export
    sigterm_at_step(trainer, 1)
    with pytest.raises(SystemExit) as code:
        trainer.fit()
    assert code.value.code == 128 + signal.SIGTERM
    record = tmp_path / "transformer" / EXPORT_RECORD
    assert json.loads(record.read_text()) == {"step": 1, "dtype": "float32"}  # step 1's export, not the preempted 2
    assert (tmp_path / "checkpoints" / "step_00000002" / "COMPLETE").is_file()

    resumed = Trainer(load_config(TINY, overrides + ["run.resume=auto"]))
    resumed.model.save_full = resumed.model.save_lora = fake_save
    assert resumed.start_step == 2
    assert resumed.fit() == []  # nothing left to train ...
    assert json.loads(record.read_text()) == {"step": 2, "dtype": "float32"}  # ... but the final export is written
    mtime = record.stat().st_mtime_ns
    again = Trainer(load_config(TINY, overrides + ["run.resume=auto"]))
    again.model.save_full = again.model.save_lora = fake_save
    again.fit()
    assert record.stat().st_mtime_ns == mtime  # already there: not written again


def test_bfloat16_export_halves_the_bytes_and_rounds_the_weights(tmp_path):
    rs = run_state(tmp_path, "run.export_dtype=bfloat16")
    model = rs.engine.model
    model.save_full = model.save_lora = fake_save
    out = rs.export(model, 7)
    weights = load_file(str(out / "weights.safetensors"))
    live = rs.engine.full_state_dict()
    assert set(weights) == set(live)
    for name, value in weights.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, live[name].to(torch.bfloat16)), name
    assert live[name].dtype == torch.float32  # the model itself is untouched
    assert json.loads((out / EXPORT_RECORD).read_text()) == {"step": 7, "dtype": "bfloat16"}
    fp32 = run_state(tmp_path / "fp32")
    fp32.engine.model.save_full = fake_save
    full = fp32.export(fp32.engine.model, 7) / "weights.safetensors"
    assert 1.9 < full.stat().st_size / (out / "weights.safetensors").stat().st_size < 2.1


def test_export_dtype_auto_is_the_published_transformers_dtype(tmp_path, sd3_dir):
    """run.export_dtype auto: bfloat16 for a pipeline whose transformer safetensors hold bf16 (SD3.5, FLUX as
    published), float32 for a float32 one and for the built-in DiT; an explicit value wins."""
    import shutil

    from jagg_scale.train.run_state import export_dtype

    sd3 = ["model.kind=sd3", f"model.pretrained={sd3_dir}"]
    assert export_dtype(load_config(TINY, sd3)) == "float32"  # the tiny pipeline is saved in float32
    bf16 = tmp_path / "bf16"
    shutil.copytree(sd3_dir, bf16)
    for f in (bf16 / "transformer").glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()}, str(f))
    assert export_dtype(load_config(TINY, ["model.kind=sd3", f"model.pretrained={bf16}"])) == "bfloat16"
    assert export_dtype(load_config(TINY, ["model.kind=sd3", f"model.pretrained={bf16}",
                                           "run.export_dtype=float32"])) == "float32"
    assert export_dtype(load_config(TINY, [])) == "float32"  # the built-in DiT


@pytest.mark.slow
def test_a_preemption_during_an_evaluation_saves_the_step_and_the_resumed_run_finishes_it_exactly(tmp_path):
    """A signal between two evaluation batches (evaluate's stop(), agreed across ranks) ends the evaluation: this
    rank's batches so far are kept beside it, the state after the step is checkpointed (checkpoint_every 0 had not
    saved it), PREEMPTED is written, exit 128 + signal. The resumed run finishes that evaluation from its batches
    first, then trains on: every evaluation and every step is the uninterrupted run's."""
    common = SMALL + ["train.steps=3", "eval.enabled=true", "eval.at_start=false", "eval.every=1",
                      "eval.prompts=[a red apple, a blue sky, a green field, a cat]", "eval.num_per_prompt=2",
                      "eval.chunk_size=2"]  # 8 images, 4 batches per evaluation
    full = Trainer(load_config(TINY, common + [f"run.output_dir={tmp_path / 'full'}"]))
    rows = full.fit()

    cut = Trainer(load_config(TINY, common + [f"run.output_dir={tmp_path / 'cut'}"]))
    calls = []
    agree = cut._agree

    def signal_mid_eval(flag):  # _agree: once after each step, then once before each evaluation batch
        if cut.stops.phase is not None:  # inside a step (its preemption checks): not counted
            return agree(flag)
        calls.append(flag)
        if len(calls) == 1 + 1 + 2:  # step 0, its evaluation's batch 0, then batch 1 of it... stop before batch 2
            cut.preemption.signal_number = signal.SIGTERM
        return agree(cut.preemption.requested)

    cut._agree = signal_mid_eval
    with pytest.raises(SystemExit) as code:
        cut.fit()
    assert code.value.code == 128 + signal.SIGTERM
    cut_dir = tmp_path / "cut"
    assert (cut_dir / "PREEMPTED").is_file()
    assert (cut_dir / "checkpoints" / "step_00000001" / "COMPLETE").is_file()  # saved for the evaluation
    partial = cut_dir / "eval" / "step_00000001" / "partial_rank00000.pt"
    assert partial.is_file() and not (partial.parent / "eval.json").exists()
    assert torch.load(partial, weights_only=True)["batches"] == 2

    resumed = Trainer(load_config(TINY, common + [f"run.output_dir={cut_dir}", "run.resume=auto"]))
    assert resumed.start_step == 1
    resumed.fit()
    assert not partial.exists()
    for step in (1, 2, 3):
        a = json.loads((tmp_path / "full" / "eval" / f"step_{step:08d}" / "eval.json").read_text())
        b = json.loads((cut_dir / "eval" / f"step_{step:08d}" / "eval.json").read_text())
        assert a["per_prompt"] == b["per_prompt"] and a["reward_mean"] == b["reward_mean"], step
    later = [json.loads(line) for line in (cut_dir / "metrics.jsonl").read_text().splitlines()]
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time_")}  # noqa: E731
    assert [strip(r) for r in later] == [strip(r) for r in rows]
