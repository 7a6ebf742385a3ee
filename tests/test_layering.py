"""The package imports one way and has no import cycle (parsed with ``ast``, so function-level
imports count too).

    errors, validation, atomic, vocabulary, defaults    (base: every layer may use them)
      < semantics < cost < search < plan < calibration < runtime
      < planner, explain, pictures        (package root modules)
      < measure, dlrm (the DLRM model library) < cli < __main__
    optim: standalone (only the base modules); the runtime and everything above it may use it

A module may import its own rank and any rank below it. ``calibration`` is pure fitting and the
profile store (the planner reads ``hardware="auto"`` from it); ``measure`` runs kernels, probe plans
and guard trials and may plan with the planner. Nothing may import the package root's lazy exports
(``from torchrec_sparselift import SparseLiftPlanner`` counts as importing ``planner``) from below
``planner``; ``import torchrec_sparselift`` (for ``__version__``) is fine. A module at the package
root must be given a rank here. On top of the ranks, the module graph (a module imports another
anywhere in its file) must have no cycle at all, within a rank too.

A module imports the package's own modules at its top, not inside a function: where an import
would make a cycle at the top, the shared thing belongs a layer further down. The exceptions are
named in :data:`LIGHT_PATHS` (paths that must not load torchrec on import: the package's
docstring promises the torchrec-free cost layer and calibration) and :data:`LEAD_FILES`.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from typing import Dict, Iterator, List, Optional, Set, Tuple


PACKAGE = "torchrec_sparselift"
ROOT = os.path.join(os.path.dirname(__file__), os.pardir, PACKAGE)

BASE = {"errors": 0, "validation": 0, "atomic": 0, "vocabulary": 0, "defaults": 0, "files": 0}
LAYERS = {"semantics": 1, "cost": 2, "search": 3, "plan": 4, "calibration": 5, "runtime": 6,
          "planner": 7, "explain": 7, "pictures": 7, "measure": 8, "dlrm": 8, "cli": 9, "__main__": 10}
OPTIM = "optim"

LIGHT_PATHS = {
    # (module, the package module it imports inside a function): why the import waits
    (f"{PACKAGE}.__main__", f"{PACKAGE}.cli"):
        "`python -m torchrec_sparselift calibrate ...` goes to measure.commands without loading the "
        "planner (torchrec)",
    (f"{PACKAGE}.measure.commands", f"{PACKAGE}.measure.steps"):
        "`calibrate kernels` needs no torchrec; `calibrate steps`/`check` train TorchRec models",
    (f"{PACKAGE}.measure.kernels", f"{PACKAGE}.runtime.process_group"):
        "`calibrate kernels` needs no torchrec; the runtime package's __init__ imports it",
}
"""Function-level imports kept so that a torchrec-free path does not load torchrec."""

NEEDS_TORCHREC = {
    f"{PACKAGE}.cost.torchrec_score",  # TorchRec's own estimators
    f"{PACKAGE}.calibration.pricer",  # prices a TorchRec ShardingPlan
    f"{PACKAGE}.calibration.term_error",  # reads the planner's TorchRec baseline
}
"""The cost and calibration modules that need torchrec; every other one imports without it."""

LEAD_FILES: Set[str] = set()
"""Modules whose function-level imports are not checked yet."""


def _modules() -> Iterator[Tuple[str, str]]:
    """(dotted module name, path) for every .py file of the package."""
    for dirpath, _, files in os.walk(ROOT):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, ROOT)[: -len(".py")].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            yield ".".join([PACKAGE] + rel), path


def _function_nodes(tree: ast.AST) -> List[ast.AST]:
    """Every node inside a function (or method) body of ``tree``."""
    inside: Dict[int, ast.AST] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for node in ast.walk(fn):
                if node is not fn:
                    inside[id(node)] = node
    return list(inside.values())


def _imports(module: str, path: str, in_functions: bool = False) -> List[Tuple[str, int]]:
    """Every package module ``module`` imports (anywhere in the file; only inside functions with
    ``in_functions``), with its line."""
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    is_package = path.endswith("__init__.py")
    out = []
    if module == PACKAGE:  # the root's ``if TYPE_CHECKING:`` imports are for type checkers only:
        tree.body = [n for n in tree.body if not _is_type_checking_block(n)]  # its names import lazily
    for node in (_function_nodes(tree) if in_functions else ast.walk(tree)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PACKAGE:
                continue
            out.append((target, node.lineno))
            if target == PACKAGE:  # its lazy exports are the top level's names
                out += [(f"{PACKAGE}.planner", node.lineno) for a in node.names if a.name != "__version__"
                        and not os.path.exists(os.path.join(ROOT, a.name + ".py"))
                        and not os.path.isdir(os.path.join(ROOT, a.name))]
            # ``from torchrec_sparselift import planner`` imports the submodule
            out += [(f"{target}.{a.name}", node.lineno) for a in node.names
                    if os.path.exists(os.path.join(ROOT, *f"{target}.{a.name}".split(".")[1:]) + ".py")]
    return out


def _function_level_imports() -> List[str]:
    """``module:line imports target`` for every package import inside a function, less the
    allowed ones (:data:`LIGHT_PATHS`, :data:`LEAD_FILES`)."""
    mods = dict(_modules())
    bad = []
    for module, path in mods.items():
        if module in LEAD_FILES:
            continue
        by_line: Dict[int, str] = {}
        for target, line in _imports(module, path, in_functions=True):
            parts = target.split(".")
            while len(parts) > 1 and ".".join(parts) not in mods:
                parts.pop()
            resolved = ".".join(parts)
            if len(resolved) > len(by_line.get(line, "")):
                by_line[line] = resolved  # ``from pkg.search import a`` imports pkg.search.a
        bad += [f"{module}:{line} imports {target} inside a function" for line, target in sorted(by_line.items())
                if (module, target) not in LIGHT_PATHS]
    return bad


def _is_type_checking_block(node: ast.stmt) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) with no ``else``."""
    if not isinstance(node, ast.If) or node.orelse:
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _rank(module: str) -> Optional[Tuple[str, int]]:
    """(layer name, rank) of a package module; ``None`` for the package itself; ``("unranked", -2)``
    for a module at the package root that has no rank yet."""
    parts = module.split(".")[1:]
    if not parts:
        return None
    head = parts[0]
    if head in BASE:
        return head, BASE[head]
    if head in LAYERS:
        return head, LAYERS[head]
    if head == OPTIM:
        return OPTIM, -1
    return "unranked", -2


def _violations() -> List[str]:
    bad = []
    for module, path in _modules():
        me = _rank(module)
        if me is None:
            continue
        if me[0] == "unranked":
            bad.append(f"{module} has no rank: add it to BASE or LAYERS in tests/test_layering.py")
            continue
        for target, line in _imports(module, path):
            other = _rank(target)
            if other is None:
                continue  # the root itself (``import torchrec_sparselift`` for __version__): lazy
            if other[0] == "unranked":
                continue  # reported as that module's own problem
            if me[0] == OPTIM:
                ok = other[0] == OPTIM or other[0] in BASE
            elif other[0] == OPTIM:
                ok = me[1] >= LAYERS["runtime"]  # the runtime builds the optimizer it applies
            else:
                ok = other[1] <= me[1]
            if not ok:
                bad.append(f"{module}:{line} ({me[0]}) imports {target} ({other[0]}): an upward import")
    return bad


def _import_graph() -> Dict[str, Dict[str, int]]:
    """module -> {module it imports: first line}, each import resolved to the package module it
    names (the longest dotted prefix that is a module: ``from pkg.mod import name`` is ``pkg.mod``)."""
    mods = dict(_modules())
    graph: Dict[str, Dict[str, int]] = {m: {} for m in mods}
    for module, path in mods.items():
        for target, line in _imports(module, path):
            parts = target.split(".")
            while parts and ".".join(parts) not in mods:
                parts.pop()
            resolved = ".".join(parts)
            if resolved and resolved != module:
                graph[module].setdefault(resolved, line)
    return graph


def _cycles() -> List[List[str]]:
    """Every import cycle of the package: the strongly connected components of more than one
    module (Tarjan's algorithm, iterative), each as the modules of one loop through it, with the
    lines of the imports that close it."""
    graph = _import_graph()
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack = set()
    comps: List[List[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    out = []
    for comp in comps:
        # one loop through the component, from its first module (breadth-first back to it)
        members, start = set(comp), comp[0]
        prev: Dict[str, str] = {}
        frontier, seen = [start], {start}
        while frontier and start not in prev:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w not in members:
                        continue
                    if w == start and start not in prev:
                        prev[start] = v
                    elif w not in seen:
                        seen.add(w)
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        loop, v = [start], prev[start]
        while v != start:
            loop.append(v)
            v = prev[v]
        loop.reverse()
        loop = [start] + loop[:-1] if loop[-1] == start else loop
        ring = loop + [loop[0]]
        out.append([f"{a}:{graph[a][b]} -> {b}" for a, b in zip(ring[:-1], ring[1:])])
    return out


def test_layers_import_downward_only():
    bad = _violations()
    assert not bad, "upward imports:\n  " + "\n  ".join(bad)


def test_no_import_cycle_anywhere_in_the_package():
    cycles = _cycles()
    assert not cycles, "import cycles:\n  " + "\n  ".join(" ; ".join(c) for c in cycles)


def test_package_modules_are_imported_at_the_top_of_the_module():
    bad = _function_level_imports()
    assert not bad, ("imports inside functions (move them to the top; where that makes a cycle, move "
                     "the shared thing a layer down):\n  " + "\n  ".join(bad))


def test_the_allowed_function_level_imports_are_still_there():
    """Every allowed entry names a module that still imports its target inside a function (an entry
    whose import moved up is removed, so the list stays the list of real exceptions)."""
    mods = dict(_modules())
    for module, target in LIGHT_PATHS:
        inside = {t for t, _ in _imports(module, mods[module], in_functions=True)}
        assert any(t == target or t.startswith(target + ".") for t in inside), (module, target)
    for module in LEAD_FILES:
        assert _imports(module, mods[module], in_functions=True), f"{module} imports nothing inside a function"


def test_the_cost_layer_and_the_calibration_import_without_torchrec():
    """The package's promise: hardware profiles, the cost model and the calibration fits work where
    torch is installed and torchrec is not (torchrec is made unimportable in a fresh interpreter),
    and so does ``python -m torchrec_sparselift calibrate kernels`` (:data:`LIGHT_PATHS`)."""
    wanted = sorted(m for m, _ in _modules() if m.split(".")[1:2] in (["cost"], ["calibration"])
                    and m not in NEEDS_TORCHREC)
    script = textwrap.dedent(f"""
        import importlib, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torchrec" or name.startswith("torchrec."):
                    raise ImportError("torchrec is not installed here")
        sys.meta_path.insert(0, Block())
        for m in {wanted!r}:
            importlib.import_module(m)
        assert not [m for m in sys.modules if m.split(".")[0] == "torchrec"]
        import torchrec_sparselift
        print(torchrec_sparselift.get_profile("cpu-gloo").name)
        import torchrec_sparselift.measure.commands
        assert not [m for m in sys.modules if m.split(".")[0] == "torchrec"]
    """)
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, os.pardir))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "cpu-gloo", run.stdout
    # and the kernel calibration's command line (``python -m torchrec_sparselift calibrate kernels``)
    block = script.split("for m in")[0]
    command = block + textwrap.dedent("""
        import runpy
        sys.argv = ["torchrec_sparselift", "calibrate", "kernels", "--help"]
        try:
            runpy.run_module("torchrec_sparselift", run_name="__main__")
        except SystemExit as e:
            assert e.code in (0, None), e.code
        assert not [m for m in sys.modules if m.split(".")[0] == "torchrec"]
    """)
    run = subprocess.run([sys.executable, "-c", command], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "--out" in run.stdout and "calibrate kernels" in run.stdout, run.stdout[-2000:]


def test_the_function_level_checker_finds_an_import_in_a_method(tmp_path, monkeypatch):
    pkg = tmp_path / PACKAGE
    (pkg / "search").mkdir(parents=True)
    (pkg / "search" / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "search" / "a.py").write_text("x = 1\n")
    (pkg / "search" / "b.py").write_text(
        "import json\n"
        "from torchrec_sparselift.search import a\n"
        "class C:\n    def m(self):\n        import os\n        from . import a\n"
        "def f():\n    from torchrec_sparselift.errors import E\n"
        "g = lambda: __import__('json')\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(pkg))
    found = _function_level_imports()
    assert found == [f"{PACKAGE}.search.b:6 imports {PACKAGE}.search.a inside a function",
                     f"{PACKAGE}.search.b:8 imports {PACKAGE}.errors inside a function"], found


def test_the_checker_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    pkg = tmp_path / PACKAGE
    (pkg / "search").mkdir(parents=True)
    (pkg / "search" / "__init__.py").write_text("")
    (pkg / "planner.py").write_text("")
    (pkg / "search" / "bad.py").write_text(
        "def f():\n    from torchrec_sparselift.planner import x\n"
        "from .. import planner\n"
        "from torchrec_sparselift import SparseLiftPlanner\n"
        "import torchrec_sparselift\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(pkg))
    found = _violations()
    assert any("search.bad:2" in v and "planner" in v for v in found), found
    assert any("search.bad:3" in v and "planner" in v for v in found), found
    assert any("search.bad:4" in v for v in found), found
    assert not any("search.bad:5" in v for v in found), found



def test_the_cycle_checker_finds_a_loop_through_function_level_imports(tmp_path, monkeypatch):
    pkg = tmp_path / PACKAGE
    (pkg / "plan").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "plan" / "__init__.py").write_text("from torchrec_sparselift.plan.a import x\n")
    (pkg / "plan" / "a.py").write_text("x = 1\n")
    (pkg / "plan" / "b.py").write_text("def f():\n    from torchrec_sparselift.plan.c import y\n")
    (pkg / "plan" / "c.py").write_text("from . import b\ny = 2\n")
    (pkg / "planner.py").write_text("import torchrec_sparselift.plan.a\n")
    (pkg / "explain.py").write_text("import torchrec_sparselift.planner\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(pkg))
    assert _cycles() == [[f"{PACKAGE}.plan.b:2 -> {PACKAGE}.plan.c", f"{PACKAGE}.plan.c:1 -> {PACKAGE}.plan.b"]]
    # three root modules in a ring (one import through the package root's lazy exports)
    (pkg / "planner.py").write_text("from torchrec_sparselift import explain\n")
    (pkg / "explain.py").write_text("def g():\n    import torchrec_sparselift.cli\n")
    (pkg / "cli.py").write_text("from torchrec_sparselift import SparseLiftPlanner\n")
    (pkg / "plan" / "c.py").write_text("y = 2\n")
    found = _cycles()
    assert len(found) == 1 and len(found[0]) == 3, found
    assert {step.split(" -> ")[1] for step in found[0]} == {f"{PACKAGE}.{m}" for m in ("cli", "explain", "planner")}


def test_a_root_module_without_a_rank_is_reported(tmp_path, monkeypatch):
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helpers.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(pkg))
    assert any("helpers has no rank" in v for v in _violations())
