"""Layers import downward only (parsed with ``ast``, so function-level imports count too).

    errors, validation, atomic  <  semantics  <  cost  <  search  <  plan  <  runtime  <  top level
                                                                                  (planner, cli,
    optim: standalone (only the base modules)                                     explain, ...)

A module may import its own layer and any layer below it. ``errors`` and ``validation`` are the
base every layer may use (they import nothing of the package but ``errors``). Top-level modules
(``planner``, ``cli``, ``explain`` and the other modules at the package root) may import anything;
nothing below the top may import them, nor the package root's lazy exports (``from
torchrec_sparselift import SparseLiftPlanner``); ``import torchrec_sparselift`` (for
``__version__``) is fine. The runtime may use ``optim``.
"""

from __future__ import annotations

import ast
import os
import sys
from typing import Iterator, List, Optional, Tuple


PACKAGE = "torchrec_sparselift"
ROOT = os.path.join(os.path.dirname(__file__), os.pardir, PACKAGE)

BASE = {"errors": 0, "validation": 0, "atomic": 0, "vocabulary": 0, "defaults": 0}
LAYERS = {"semantics": 1, "cost": 2, "search": 3, "plan": 4, "runtime": 5}
TOP = 10
OPTIM = "optim"
BASE["files"] = 0  # the strict file loader (imports only ``errors``)


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


def _imports(module: str, path: str) -> List[Tuple[str, int]]:
    """Every package module ``module`` imports (anywhere in the file), with its line."""
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    is_package = path.endswith("__init__.py")
    out = []
    for node in ast.walk(tree):
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


def _rank(module: str) -> Optional[Tuple[str, int]]:
    """(layer name, rank) of a package module; ``None`` for the package itself."""
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
    return "top", TOP  # planner, cli, explain, __main__ and the other root modules


def _violations() -> List[str]:
    bad = []
    for module, path in _modules():
        me = _rank(module)
        if me is None or me[1] == TOP:
            continue
        for target, line in _imports(module, path):
            other = _rank(target)
            if other is None:
                continue  # the root itself (``import torchrec_sparselift`` for __version__): lazy
            if me[0] == OPTIM:
                ok = other[0] == OPTIM or other[0] in BASE
            elif other[0] == OPTIM:
                ok = me[1] >= LAYERS["runtime"]  # the runtime builds the optimizer it applies
            else:
                ok = other[1] <= me[1]
            if not ok:
                bad.append(f"{module}:{line} ({me[0]}) imports {target} ({other[0]}): an upward import")
    return bad


def test_layers_import_downward_only():
    bad = _violations()
    assert not bad, "upward imports:\n  " + "\n  ".join(bad)


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

