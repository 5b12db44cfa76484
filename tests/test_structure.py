"""The shape of the house: dependencies point one way, with no import cycle in the library or the tools, the algorithm
packages at the bottom, and nothing outside tests/ importing a test module."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for base in ("jagg_scale", "tools"):
        for path in (root / base).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of `modules` that `name` imports, at module level or inside a function (a lazy import is an
    edge too: a cycle through it is still two modules that need each other). In tools/ a bare name is also looked up
    beside the importing file (`import gpu_step` in tools/gpu_check.py is tools.gpu_step: what a script run as
    `python tools/x.py`, its own folder on sys.path, imports; the package's imports are absolute), and
    importlib.import_module("literal") counts."""
    deps = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        else:
            continue
        if package[0] == "tools" and not (isinstance(node, ast.ImportFrom) and node.level):
            targets += [".".join(package + [t]) for t in targets if t]  # the bare name, beside the importer
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


def test_a_bare_import_circle_between_two_tools_is_found(tmp_path):
    """`import b` in tools/a.py and a lazy `from a import f` in tools/b.py (the old gpu_check <-> gpu_step circle)."""
    (tmp_path / "jagg_scale").mkdir()
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "a.py").write_text("import b\n")
    (tmp_path / "tools" / "b.py").write_text("def g():\n    from a import f\n")
    (tmp_path / "tools" / "c.py").write_text("import importlib\nimportlib.import_module('a')\n")
    modules = _modules(tmp_path)
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph == {"tools.a": {"tools.b"}, "tools.b": {"tools.a"}, "tools.c": {"tools.a"}}
    assert _cycles(graph) == [["tools.a", "tools.b"]]


def test_the_tools_are_a_package_that_leaves_sys_path_alone():
    """Tools run as `python -m tools.NAME` from the repository root and import each other as `tools.NAME`: none puts
    a folder on sys.path (twelve did, which is how a circle between two of them went unseen)."""
    assert (ROOT / "tools" / "__init__.py").exists()
    edits = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in sorted((ROOT / "tools").rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
             and node.value.id == "sys"]
    assert edits == []


# Files over the limit whose split is pending with their owners, at most at their length today: a ratchet (a split
# passes whatever order the branches merge in, growth fails); an entry leaves the list once its file is split.
LONG_FILES_PENDING: dict[str, int] = {}  # none pending: every file is at most MAX_LINES
MAX_LINES = 500


def _too_long(lines: dict[str, int], pending: dict[str, int]) -> dict[str, int]:
    return {name: n for name, n in lines.items() if n > MAX_LINES and n > pending.get(name, MAX_LINES)}


def test_no_file_over_500_lines():
    lines = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
             for base in ("jagg_scale", "tools", "tests") for path in (ROOT / base).rglob("*.py")}
    assert _too_long(lines, LONG_FILES_PENDING) == {}, f"over {MAX_LINES} lines (or longer than LONG_FILES_PENDING " \
        "allows): split them"
    # the check finds a new long file and a pending one that grew, and lets a pending one shrink
    assert _too_long({"a.py": 501, "b.py": 601, "c.py": 500, "d.py": 520}, {"b.py": 600, "d.py": 561}) == {
        "a.py": 501, "b.py": 601}


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
    """jagg/, grpo/, nft/ and dppo/ import torch and jagg_scale.cond only: no model, reward, data, engine or trainer
    code."""
    code = ("import sys, jagg_scale.jagg, jagg_scale.grpo, jagg_scale.nft, jagg_scale.dppo; "
            "print(sorted(m for m in sys.modules if m.startswith('jagg_scale')))")
    loaded = eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    allowed = ("jagg_scale", "jagg_scale.cond", "jagg_scale.jagg", "jagg_scale.grpo", "jagg_scale.nft",
               "jagg_scale.dppo")
    assert loaded and all(m in allowed or m.startswith(("jagg_scale.jagg.", "jagg_scale.grpo.", "jagg_scale.nft.",
                                                        "jagg_scale.dppo.")) for m in loaded), loaded


def test_a_components_config_section_imports_nothing_heavy():
    """The run config is read before anything is built (a bad key fails in a second): the engines' own section
    (parallel/config.py) and the planners it names load no torch.distributed, model or reward code."""
    code = ("import sys, jagg_scale.train.config; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch.distributed.fsdp', 'deepspeed', "
            "'diffusers', 'jagg_scale.models.sd3', 'jagg_scale.parallel.fsdp'))))")
    loaded = eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert loaded == []
