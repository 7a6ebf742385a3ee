"""The command line is a thin layer over public APIs: ``cli.py`` (parsed with ``ast``) reaches no
private name of TorchRec or of another module of ours.

Refused: ``from x import _y``; ``import x._y`` or ``from x._y import z`` (a private module);
``name._y`` on anything but ``self`` (a private attribute of an imported module or of another
object); ``getattr(obj, "_y")`` (the same, spelled as a string). Dunder names (``__file__``) are
public.
"""

from __future__ import annotations

import ast
import os
from typing import List

CLI = os.path.join(os.path.dirname(__file__), os.pardir, "torchrec_sparselift", "cli.py")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(source: str, filename: str = "cli.py") -> List[str]:
    """Every use of a private name of another module or object in ``source``, with its line."""
    bad = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if any(_private(part) for part in module.split(".")):
                bad.append(f"{filename}:{node.lineno}: imports from the private module {module}")
            bad += [f"{filename}:{node.lineno}: imports the private name {a.name} from {module}"
                    for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Import):
            bad += [f"{filename}:{node.lineno}: imports the private module {a.name}"
                    for a in node.names if any(_private(part) for part in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                bad.append(f"{filename}:{node.lineno}: reads the private attribute .{node.attr} of "
                           f"{ast.unparse(node.value)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            bad.append(f"{filename}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r}) reaches "
                       "a private attribute")
    return bad


def test_cli_uses_no_private_name_of_torchrec_or_of_our_other_modules():
    with open(CLI, encoding="utf-8") as f:
        bad = private_uses(f.read(), "torchrec_sparselift/cli.py")
    assert not bad, ("the CLI must call public APIs only (make the library function public, or "
                     "move the logic into the library):\n  " + "\n  ".join(bad))


def test_the_checker_sees_every_way_to_reach_a_private_name():
    source = (
        "from torchrec_sparselift.planner import _sub_topology\n"
        "import torchrec.distributed._private_mod\n"
        "from torchrec.distributed.planner._impl import thing\n"
        "def f(planner, torchrec_sparselift):\n"
        "    best = getattr(planner, '_best_plan', None)\n"
        "    n = planner._num_proposals\n"
        "    return torchrec_sparselift.planner._default_topology()\n"
        "class Ok:\n"
        "    def g(self):\n"
        "        return self._mine, __file__, getattr(self, 'public'), planner.__class__\n"
    )
    found = private_uses(source, "x.py")
    for line in (1, 2, 3, 5, 6, 7):
        assert any(f"x.py:{line}:" in v for v in found), (line, found)
    assert not any("x.py:10:" in v for v in found), found
    assert len(found) == 6, found
