"""A GRPO step and a DiffusionNFT step each read top to bottom in at most 4 orchestration files (issue 35).

How a step is traced (`trace_step`): sys.setprofile records every Python call made while `Trainer.train_step` runs
(the main thread; the reward scores in it, reward.background false). A call is charged to the nearest frame of a
jagg_scale file up the stack (torch's nn.Module.__call__ between a policy closure and a model's forward is not a
project frame), so an edge A -> B says "code in file A ran code in file B", A != B.

Which edges make a file an orchestrator: A -> B is a *descent* when A's own source imports B (a module, or a name
defined in B, re-exports resolved; lazy imports inside functions count too): A chose to call into B. Any other
edge reached B through an object A was handed (a callback: the velocity function, the model, the reward, the
engine, the algorithm behind the registry) and climbs or dispatches, it does not decide. Descents into a file of
A's own package (the same folder) are that package's internals and do not count either: a leaf package (grpo/, jagg/,
nft/) is one leaf called through its public API.

An *orchestration file* descends into >= 2 files of other packages. The assertion: the orchestration files of each
step are at most 4 and all among trainer, the algorithm's unit (algorithm.py and its module), the runner, the policy.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import sys
import types
from pathlib import Path

import pytest

import jagg_scale
from jagg_scale.train import Trainer, load_config
from train_runs import TINY, small_dit

PACKAGE = Path(jagg_scale.__file__).resolve().parent
ALLOWED = {"train/trainer.py", "train/algorithm.py", "train/update.py", "train/nft.py", "train/runner.py",
           "train/policy.py"}


@functools.cache
def _rel(filename: str) -> str | None:
    """The path of a project file relative to the package (None: not one); cached: the profiler asks per call."""
    try:
        return Path(filename).resolve().relative_to(PACKAGE).as_posix()
    except (ValueError, OSError):
        return None


def _module_file(name: str) -> str | None:
    module = sys.modules.get(name)
    if module is None:
        try:
            module = importlib.import_module(name)
        except ImportError:
            return None
    return _rel(getattr(module, "__file__", "") or "")


def imported_files(rel: str) -> set[str]:
    """The project files `rel`'s source imports from, anywhere in it: the modules, and for `from m import x` the
    file that defines x (a re-export resolved to its definition)."""
    path = PACKAGE / rel
    module = "jagg_scale." + rel[: -len(".py")].replace("/", ".").removesuffix(".__init__")
    package = module if rel.endswith("__init__.py") else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                else node.module
            names = [(base, a.name) for a in node.names]
        else:
            continue
        for base, attr in names:
            if not base or not base.startswith("jagg_scale"):
                continue
            target = _module_file(base)
            if attr is None:
                out.add(target)
                continue
            obj = getattr(sys.modules.get(base), attr, None)
            if obj is None:
                obj = sys.modules.get(f"{base}.{attr}")
            if isinstance(obj, types.ModuleType):
                out.add(_rel(obj.__file__ or ""))
            elif obj is not None and getattr(inspect.getmodule(obj), "__file__", None):
                out.add(_rel(inspect.getmodule(obj).__file__))
            else:
                out.add(target)
    return {f for f in out if f}


def trace_step(trainer: Trainer, step: int = 0) -> dict:
    """The project files one training step visits, its cross-file edges, and each file's descents (docstring)."""
    edges: set[tuple[str, str]] = set()
    hops: set[tuple[str, str, str, str]] = set()  # (file, function) -> (file, function) across files
    visited: set[str] = set()

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = _rel(frame.f_code.co_filename)
        if callee is None:
            return
        visited.add(callee)
        caller = frame.f_back
        while caller is not None and _rel(caller.f_code.co_filename) is None:
            caller = caller.f_back
        if caller is not None:
            src = _rel(caller.f_code.co_filename)
            if src != callee:
                edges.add((src, callee))
                hops.add((src, caller.f_code.co_name, callee, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        trainer.train_step(step)
    finally:
        sys.setprofile(None)
    imports = {f: imported_files(f) for f in visited}
    descents: dict[str, set[str]] = {}
    for a, b in edges:
        if b in imports.get(a, ()) and Path(a).parent != Path(b).parent:
            descents.setdefault(a, set()).add(b)
    orchestration = sorted(f for f, targets in descents.items() if len(targets) >= 2)
    return {"files": sorted(visited), "edges": sorted(edges), "hops": sorted(hops), "descents": descents,
            "orchestration": orchestration}


def _trainer(tmp_path, *extra):
    cfg = load_config(TINY, small_dit(4, 3) + ["reward.background=false", f"run.output_dir={tmp_path}", *extra])
    return Trainer(cfg)


def _check(trace: dict, unit: str) -> None:
    orch = set(trace["orchestration"])
    assert len(orch) <= 4 and orch <= ALLOWED, trace["orchestration"]
    assert {"train/trainer.py", "train/runner.py", unit} <= orch, trace["orchestration"]  # the step is traced
    # the trainer shapes no rollout and computes no algorithm math: it descends into no grpo/, jagg/ or nft/ file
    assert not {f for f in trace["descents"]["train/trainer.py"] if f.split("/")[0] in ("grpo", "jagg", "nft")}
    # it enters the algorithm through the contract only, once per phase
    entered = {(callee, fn) for src, _, callee, fn in trace["hops"] if src == "train/trainer.py"
               and callee in ("train/algorithm.py", unit)}
    assert {fn for _, fn in entered} == {"rollout_spec", "advantages", "update"}, entered
    # the advantages are the unit's: grpo/advantages.py is reached from the algorithm alone, not via the reward
    assert {src for src, callee in trace["edges"] if callee == "grpo/advantages.py"} == {"train/algorithm.py"}


@pytest.mark.slow  # a whole step under the profiler: ~4 s of CPU alone
def test_a_grpo_step_reads_in_at_most_four_orchestration_files(tmp_path):
    trainer = _trainer(tmp_path, "grpo.kl_beta=0.04", "train.micro_batch_size=2")
    try:
        trace = trace_step(trainer)
    finally:
        trainer.close()
    _check(trace, "train/update.py")
    assert "train/nft.py" not in trace["files"]


@pytest.mark.slow
def test_an_nft_step_reads_in_at_most_four_orchestration_files(tmp_path):
    trainer = _trainer(tmp_path, "train.algorithm=nft", "nft.kl_beta=0.01", "grpo.timestep_fraction=0.75",
                       "train.micro_batch_size=2")
    try:
        trace = trace_step(trainer)
    finally:
        trainer.close()
    _check(trace, "train/nft.py")
    assert "train/update.py" not in trace["files"]  # NFT borrows nothing of GRPO's unit
