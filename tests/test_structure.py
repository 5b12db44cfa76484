"""The shape of the house: dependencies point one way, with no import cycle in the library or the tools, the algorithm
packages at the bottom, and nothing outside tests/ importing a test module."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    out = {}
    for base in ("jagg_scale", "tools"):
        for path in (ROOT / base).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of `modules` that `name` imports, at module level or inside a function (a lazy import is an
    edge too: a cycle through it is still two modules that need each other)."""
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                deps.add(t)
    return deps


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan); a package and its own submodules are not a
    cycle (an __init__ re-exports what its modules define)."""
    related = lambda a, b: a.startswith(b + ".") or b.startswith(a + ".")  # noqa: E731
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if related(v, w):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_the_library_or_the_tools():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "jagg_scale.estimate.memory" in graph and "jagg_scale.train.rows" in graph["jagg_scale.estimate.memory"]
    assert _cycles(graph) == []
    # the check finds a cycle when there is one
    assert _cycles({"a.x": {"b.y"}, "b.y": {"a.x"}, "c": set()}) == [["a.x", "b.y"]]


def test_nothing_outside_tests_imports_a_test_module():
    modules = _modules()
    offenders = [name for name, path in modules.items()
                 if any(n.startswith("test_") for n in _imported_names(path))]
    assert offenders == []


def _imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[-1] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[-1])
    return names


def test_the_algorithm_packages_sit_at_the_bottom():
    """jagg/, grpo/ and nft/ import torch and jagg_scale.cond only: no model, reward, data, engine or trainer code."""
    code = ("import sys, jagg_scale.jagg, jagg_scale.grpo, jagg_scale.nft; "
            "print(sorted(m for m in sys.modules if m.startswith('jagg_scale')))")
    loaded = eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    allowed = ("jagg_scale", "jagg_scale.cond", "jagg_scale.jagg", "jagg_scale.grpo", "jagg_scale.nft")
    assert loaded and all(m in allowed or m.startswith(("jagg_scale.jagg.", "jagg_scale.grpo.", "jagg_scale.nft."))
                          for m in loaded), loaded


def test_a_components_config_section_imports_nothing_heavy():
    """The run config is read before anything is built (a bad key fails in a second): the engines' own section
    (parallel/config.py) and the planners it names load no torch.distributed, model or reward code."""
    code = ("import sys, jagg_scale.train.config; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch.distributed.fsdp', 'deepspeed', "
            "'diffusers', 'jagg_scale.models.sd3', 'jagg_scale.parallel.fsdp'))))")
    loaded = eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert loaded == []
