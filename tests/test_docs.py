"""The manual agrees with the code: README.md and docs/*.md are parsed, and each fact they state in
a recognisable form is checked against the code it describes.

What counts as a stated fact (and so what a doc must use to state one):

* **Defaults.** A table whose header starts ``| setting | default |`` (docs/concepts.md,
  "Defaults"): the first code span of a row names a setting (a key of :data:`DEFAULTS`, or a
  command and its flag such as ``sparselift plan --time-budget``), the first code span of the
  second cell is its value. Also a code span ``name = value`` (spaces around ``=``) and a code
  span ``name=value`` followed by "the default" / "by default", for a key of :data:`DEFAULTS`;
  and "default (sync) bound N" in prose, the 2D sync interval's bound.
* **Registries.** A table preceded by ``<!-- registry: pipelines -->`` or
  ``<!-- registry: comm_precisions -->`` lists the registry's names in its order (and, where the
  table has such a column, whether each kind is exact / each precision's bytes). Outside code
  blocks, four or more pipeline names in one run of code spans (`a`, `b`, `c` and `d`) list every
  pipeline kind or every exact one, in the registry's order; three or more comm precisions, every
  precision or those offered on CPU; "N pipeline kinds" and "N comm precisions" count the registry.
* **Commands.** Every command in a ``bash``/``sh``/``console`` block or in an inline code span
  (``sparselift ...``, ``python [-m] ...``, ``torchrun ... X``, ``bash scripts/x.sh ...``, and the
  emulated-host testbed's ``-- SCRIPT ...``) must name an existing script or module, and each
  ``--flag`` must be one that command's parser accepts: ``sparselift``'s own parsers, torchrun's,
  and for scripts the ``add_argument`` strings of the script and of the repository modules it
  imports (read with ``ast``: nothing runs). A table preceded by ``<!-- flags: COMMAND -->`` lists
  flags of COMMAND in its first column.
* **Keyword arguments.** Every keyword of a call of ``SparseLiftPlanner``, ``lift``,
  ``build_2d_model_parallel`` or ``evaluate_sharding_plan`` in a Python block or a code span is
  one its signature accepts (:data:`CALLABLES`).
* **Code references.** A code span ``module.name`` or ``module.Class.member`` naming a module of
  the package (``semantics.tables.embedding_modules``) names something that module defines.
* **Links.** Every relative link names an existing file, and its ``#anchor`` a heading there.
* **README.** Its "Known limits" has at most 15 lines, each item linking to its page; every term
  of :data:`GLOSSARY_TERMS` that README or a doc uses is defined in docs/concepts.md's glossary.

``test_checker_flags_planted_contradictions`` plants one contradiction of each kind in a copy of
the docs and checks that the checker reports it.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shlex
import shutil
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import attrs
import pytest

from torchrec_sparselift import defaults, vocabulary
from torchrec_sparselift.cost import two_d

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
PACKAGE = "torchrec_sparselift"


# ---------------------------------------------------------------- what the code says


def _function_default(relpath: str, function: str, argument: str) -> Any:
    """The literal default of ``argument`` of ``function`` in a repository file (read with ast)."""
    tree = _parse(os.path.join(REPO, relpath))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            for arg, default in pairs:
                if arg.arg == argument:
                    return ast.literal_eval(default)
    raise LookupError(f"{relpath}: no function {function}({argument}=...) with a literal default; "
                      f"update DEFAULTS in tests/test_docs.py to where the default lives now")


def _field_default(relpath: str, cls: str, field: str) -> Any:
    """The literal default of an attrs class's field (``x: int = 3`` or ``attrs.field(default=3)``)."""
    tree = _parse(os.path.join(REPO, relpath))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == field and item.value:
                    value = item.value
                    if isinstance(value, ast.Call):
                        value = next((k.value for k in value.keywords if k.arg == "default"), value)
                    return ast.literal_eval(value)
    raise LookupError(f"{relpath}: no class {cls} with a field {field} = <literal>; update DEFAULTS in "
                      f"tests/test_docs.py to where the default lives now")


#: Settings the docs may state a default for, and where the code keeps it. A defaults table row
#: naming a setting not listed here fails: add it here, with the code it reads.
DEFAULTS: Dict[str, Callable[[], Any]] = {
    "max_sync_interval": lambda: two_d.DEFAULT_MAX_SYNC_INTERVAL,
    "time_budget_s": lambda: defaults.TIME_BUDGET_S,
    "batch_size": lambda: defaults.BATCH_SIZE,
    "pipeline": lambda: defaults.PIPELINE,
    "comm_precision": lambda: defaults.COMM_PRECISION,
    "never_slower": lambda: defaults.NEVER_SLOWER,
    "solver": lambda: defaults.SOLVER,
    "layout_2d": lambda: defaults.LAYOUT_2D,
    "strategy_2d": lambda: defaults.STRATEGY_2D,
    "sync_overhead": lambda: defaults.SYNC_OVERHEAD,
    "drift_tolerance": lambda: defaults.DRIFT_TOLERANCE,
    "storage_reservation_percentage": lambda: defaults.STORAGE_RESERVATION_PERCENTAGE,
    "uncalibrated_model_error": lambda: defaults.UNCALIBRATED_MODEL_ERROR,
    # the 2D replica merge: None is TorchRec's plain averaging
    "replica_sync": lambda: _function_default("torchrec_sparselift/runtime/two_d.py",
                                              "build_2d_model_parallel", "replica_sync"),
    # the opt-in 2D merge's own settings
    "MomentumScaledRowWiseAdagrad.momentum": lambda: _field_default(
        "torchrec_sparselift/optim/momentum_scaled.py", "MomentumScaledRowWiseAdagrad", "momentum"),
    "MomentumScaledRowWiseAdagrad.preconditioner": lambda: _field_default(
        "torchrec_sparselift/optim/momentum_scaled.py", "MomentumScaledRowWiseAdagrad", "preconditioner"),
    # the DLRM example's options (examples/dlrm/train.py's flags default to them)
    "TrainOptions.batch_size": lambda: _field_default("torchrec_sparselift/dlrm/options.py", "TrainOptions",
                                                      "batch_size"),
    "TrainOptions.replica_merge": lambda: _field_default("torchrec_sparselift/dlrm/options.py", "TrainOptions",
                                                         "replica_merge"),
    "TrainOptions.scale": lambda: _field_default("torchrec_sparselift/dlrm/options.py", "TrainOptions", "scale"),
}

#: Terms the docs use that README's readers need defined: each one that README.md or a doc uses
#: must be a term of docs/concepts.md's glossary (its first column, case-insensitive).
GLOSSARY_TERMS: Tuple[str, ...] = (
    "R1", "R2", "R3", "R4", "never-slower rule", "hand back", "measured guard", "A/A control",
    "probe plan", "overlap bound", "sharding group", "sync interval", "pipeline kind",
    "comm precision", "step fit", "profile", "link correction", "lower bound", "gap", "2D",
    "replica sync", "drift", "execution plan", "lossy comms", "stale", "fingerprint", "profile store",
    "probe model", "Spearman", "qcomm", "TBE", "MAPE", "headroom", "regimes", "replica",
)


def _name(value: Any) -> str:
    """A registry name, whether the vocabulary spells it as a string or an enum member."""
    return str(getattr(value, "value", value))


def _pipelines() -> Tuple[str, ...]:
    return tuple(_name(p) for p in vocabulary.PIPELINES)


def _exact_pipelines() -> Tuple[str, ...]:
    return tuple(n for n in _pipelines() if vocabulary.pipeline(n).exact)


def _precisions() -> Tuple[str, ...]:
    return tuple(_name(p) for p in vocabulary.COMM_PRECISIONS)


def _cpu_precisions() -> Tuple[str, ...]:
    offered = {_name(n) for pair in vocabulary.comm_precision_pairs(True, True, compute_device="cpu") for n in pair}
    return tuple(n for n in _precisions() if n in offered)


# ---------------------------------------------------------------- reading markdown


@attrs.frozen
class Problem:
    doc: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.what}"


@attrs.frozen
class Doc:
    """One markdown file: its lines, and which of them are inside fenced code blocks."""

    path: str  # relative to the docs root
    lines: Tuple[str, ...]
    fence: Tuple[str, ...]  # per line: the enclosing block's info string, "" outside, "?" unlabeled

    @classmethod
    def read(cls, root: str, path: str) -> "Doc":
        with open(os.path.join(root, path), encoding="utf-8") as f:
            lines = tuple(f.read().split("\n"))
        fence: List[str] = []
        inside: Optional[str] = None
        for line in lines:
            m = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", line)
            if m:
                if inside is None:
                    inside = m.group(2) or "?"
                    fence.append("")  # the fence line itself
                else:
                    inside = None
                    fence.append("")
                continue
            fence.append(inside or "")
        return cls(path, lines, tuple(fence))

    def prose(self) -> Iterator[Tuple[int, str]]:
        """(1-based line, text) of every line outside code blocks, HTML comments dropped."""
        for i, line in enumerate(self.lines):
            if not self.fence[i]:
                yield i + 1, re.sub(r"<!--.*?-->", "", line)

    def paragraphs(self) -> Iterator[Tuple[int, str]]:
        """(first line, text) of each paragraph outside code blocks (its lines joined, so a code
        span broken over two lines is one span); a table row is a paragraph of its own."""
        start, parts = 0, []
        for line, text in list(self.prose()) + [(len(self.lines) + 1, "")]:
            if not text.strip() or _is_row(text):
                if parts:
                    yield start, " ".join(parts)
                    parts = []
                if _is_row(text):
                    yield line, text
                continue
            if not parts:
                start = line
            parts.append(text.strip())

    def tables(self) -> Iterator[Tuple[int, str, List[List[str]]]]:
        """(line of the header, marker comment just above it or "", rows of cells incl. header)."""
        i, n = 0, len(self.lines)
        while i < n:
            if not self.fence[i] and _is_row(self.lines[i]) and i + 1 < n and re.match(
                    r"^\s*\|[\s:|-]+\|\s*$", self.lines[i + 1]):
                marker = ""
                j = i - 1
                while j >= 0 and not self.lines[j].strip():
                    j -= 1
                if j >= 0:
                    m = re.match(r"^\s*<!--\s*(.*?)\s*-->\s*$", self.lines[j])
                    marker = m.group(1) if m else ""
                rows = [_cells(self.lines[i])]
                k = i + 2
                while k < n and _is_row(self.lines[k]):
                    rows.append(_cells(self.lines[k]))
                    k += 1
                yield i + 1, marker, rows
                i = k
            else:
                i += 1


def _is_row(line: str) -> bool:
    s = line.strip()
    return s.startswith("|") and s.endswith("|") and len(s) > 1


def _cells(line: str) -> List[str]:
    s = line.strip()[1:-1]
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", s)]


CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _spans(text: str) -> List[str]:
    return [m.group(2).strip() for m in CODE_SPAN.finditer(text)]


def _doc_paths(root: str) -> List[str]:
    docs = sorted(f for f in os.listdir(os.path.join(root, "docs")) if f.endswith(".md"))
    return ["README.md"] + [f"docs/{f}" for f in docs]


# ---------------------------------------------------------------- (a) defaults


def _value(text: str) -> Any:
    text = text.strip()
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _same(stated: Any, actual: Any) -> bool:
    if isinstance(actual, bool) or isinstance(stated, bool):
        return stated is actual
    if isinstance(actual, (int, float)) and isinstance(stated, (int, float)):
        return abs(float(stated) - float(actual)) <= 1e-12 * max(1.0, abs(float(actual)))
    return stated == actual


def _flag_default(command: str) -> Any:
    """The default of ``CMD --flag`` from that command's parser."""
    words = shlex.split(command)
    flag = words[-1]
    entry = _entry_point(words[:-1])
    if entry is None:
        raise LookupError(f"{' '.join(words[:-1])!r} is not a command this test knows")
    return entry.default(flag)


#: "the default merge is X", "X (default)": the 2D replica merge a doc calls the default.
MERGE_DEFAULT = re.compile(r"\bdefault (?:replica )?(?:merge|replica sync)\s*(?:=|is|:)?\s*(?:the |TorchRec's )?"
                           r"(momentum-scaled|plain averaging|averaging)|(momentum-scaled|averaging)[^.;]{0,40}?"
                           r"\((?:the |lift's )?default\)", re.IGNORECASE)


def check_defaults(doc: Doc) -> List[Problem]:
    out = []

    def compare(line: int, key: str, text: str) -> None:
        try:
            actual = _flag_default(key) if key.split()[-1].startswith("-") else DEFAULTS[key]()
        except KeyError:
            out.append(Problem(doc.path, line, f"default of {key!r} stated, but tests/test_docs.py DEFAULTS "
                                               f"does not know where the code keeps it: add it there"))
            return
        except LookupError as e:
            out.append(Problem(doc.path, line, str(e)))
            return
        stated = _value(text)
        if not _same(stated, actual):
            out.append(Problem(doc.path, line, f"the docs state the default of {key} as {text!r}; "
                                               f"the code's is {actual!r}"))

    for line, _, rows in doc.tables():
        header = [c.lower() for c in rows[0]]
        if len(header) >= 2 and header[0] == "setting" and header[1] == "default":
            for k, row in enumerate(rows[1:], start=1):
                keys, values = _spans(row[0]), _spans(row[1]) if len(row) > 1 else []
                if not keys or not values:
                    out.append(Problem(doc.path, line + k + 1, "a defaults-table row needs a code span in "
                                                               "its setting and default cells"))
                    continue
                compare(line + k + 1, keys[0], values[0])
    for line, text in doc.prose():
        for m in CODE_SPAN.finditer(text):
            span = m.group(2).strip()
            spaced = re.fullmatch(r"([A-Za-z_][\w.]*) = (.+)", span)
            name = re.sub(r"^default_", "", spaced.group(1).split(".")[-1].lower()) if spaced else ""
            if name in DEFAULTS:
                compare(line, name, spaced.group(2))
                continue
            kw = re.fullmatch(r"([A-Za-z_]\w*)=(.+)", span)
            after = text[m.end():m.end() + 20]
            if kw and kw.group(1) in DEFAULTS and re.match(r"\s*[,(:]?\s*(the |by )?default\b", after):
                compare(line, kw.group(1), kw.group(2))
        for m in re.finditer(r"\bdefault (?:2D )?(?:sync(?:-interval)? )?bound (?:of |is |on the interval is )?(\d+)\b",
                             text):
            compare(line, "max_sync_interval", m.group(1))
        for m in MERGE_DEFAULT.finditer(text):
            named = next(g for g in m.groups() if g)
            stated = None if "averag" in named.lower() else "momentum_scaled"
            actual = DEFAULTS["replica_sync"]()
            if (stated is None) != (actual is None):
                out.append(Problem(doc.path, line, f"{m.group(0)!r}: the default replica merge is "
                                                   f"{'TorchRec averaging' if actual is None else repr(actual)}"))
    return out


# ---------------------------------------------------------------- (b) registries

NUMBERS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven "
                                      "twelve".split())}


def check_registries(doc: Doc) -> List[Problem]:
    out = []
    pipelines, precisions = _pipelines(), _precisions()
    registries = {
        "pipelines": (pipelines, {n: vocabulary.pipeline(n) for n in pipelines}),
        "comm_precisions": (precisions, {n: vocabulary.comm_precision(n) for n in precisions}),
    }
    for line, marker, rows in doc.tables():
        m = re.fullmatch(r"registry:\s*(\w+)", marker)
        if not m:
            continue
        if m.group(1) not in registries:
            out.append(Problem(doc.path, line, f"unknown registry {m.group(1)!r}; one of {sorted(registries)}"))
            continue
        names, by_name = registries[m.group(1)]
        listed = [(_spans(r[0]) or [r[0]])[0] for r in rows[1:]]
        if tuple(listed) != names:
            out.append(Problem(doc.path, line, f"the {m.group(1)} table lists {listed}; the registry "
                                               f"(torchrec_sparselift.vocabulary) has {list(names)}, in that order"))
            continue
        header = [c.lower() for c in rows[0]]
        for k, row in enumerate(rows[1:], start=1):
            entry, name = by_name[listed[k - 1]], listed[k - 1]
            for col, cell in zip(header, row):
                if col == "exact" or col.startswith("same losses"):
                    says = cell.lower().startswith("yes")
                    if says != entry.exact:
                        out.append(Problem(doc.path, line + k + 1, f"{name}: the table says exact={says}, "
                                                                   f"the registry {entry.exact}"))
                if col == "bytes" and _value(cell) != entry.bytes:
                    out.append(Problem(doc.path, line + k + 1, f"{name}: {cell} bytes stated, the registry "
                                                               f"has {entry.bytes}"))
    sep = r"(?:\s*,\s*(?:and\s+|or\s+)?|\s+(?:and|or)\s+|\s*/\s*)"
    run = re.compile(r"`?\b\w+\b`?(?:" + sep + r"`?\b\w+\b`?)+")  # code spans or bare words
    allowed_pipelines = {pipelines: "every pipeline kind", _exact_pipelines(): "every exact pipeline kind"}
    allowed_precisions = {precisions: "every comm precision", _cpu_precisions(): "the precisions offered on CPU"}
    for line, text in doc.paragraphs():
        # a code span that is not one name (a flag's value, a command, an expression) is opaque
        text = CODE_SPAN.sub(lambda c: c.group(0) if re.fullmatch(r"\w+", c.group(2).strip()) else " | ", text)
        for m in run.finditer(text):
            names = tuple(re.findall(r"\w+", m.group(0).replace(" and ", " ").replace(" or ", " ")))
            for known, allowed, least in ((pipelines, allowed_pipelines, 4), (precisions, allowed_precisions, 3)):
                mine = tuple(n for n in names if n in known)
                if len(mine) >= least and mine not in allowed:
                    out.append(Problem(doc.path, line, f"lists {', '.join(mine)}: a list of {least} or more names "
                                       f"is one of {[list(a) for a in allowed]} (torchrec_sparselift.vocabulary), "
                                       f"in that order"))
        for m in re.finditer(r"\b(?:all|the|its|every one of the)\s+(\d+|" + "|".join(NUMBERS)
                             + r")\s+(exact\s+)?(?:train\s+)?pipeline\s+kinds\b", text, re.IGNORECASE):
            n = int(m.group(1)) if m.group(1).isdigit() else NUMBERS[m.group(1).lower()]
            want = len(_exact_pipelines()) if m.group(2) else len(pipelines)
            if n != want:
                out.append(Problem(doc.path, line, f"{m.group(0)!r}: the registry has {want}"))
        for m in re.finditer(r"\b(?:all|the|its)\s+(\d+|" + "|".join(NUMBERS) + r")\s+comm\s+precisions\b", text,
                             re.IGNORECASE):
            n = int(m.group(1)) if m.group(1).isdigit() else NUMBERS[m.group(1).lower()]
            if n != len(precisions):
                out.append(Problem(doc.path, line, f"{m.group(0)!r}: the registry has {len(precisions)}"))
    return out


# ---------------------------------------------------------------- (c, d) commands


@functools.lru_cache(maxsize=None)
def _parse(path: str) -> ast.Module:
    return ast.parse(_text(path), filename=path)


def _module_file(module: str, near: str = "") -> Optional[str]:
    """The repository file of a dotted module (a module file, or a package's __init__/__main__)."""
    for base in ([near] if near else []) + [REPO]:
        stem = os.path.join(base, *module.split("."))
        for candidate in (stem + ".py", os.path.join(stem, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
    return None


@functools.lru_cache(maxsize=None)
def _text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


IMPORT = re.compile(r"^\s*(?:from\s+(\.*)([\w.]*)\s+import\s+\(?([\w\s,]+)|import\s+([\w.]+))", re.MULTILINE)


@functools.lru_cache(maxsize=None)
def _imported_files(path: str) -> Tuple[str, ...]:
    """Repository files ``path`` imports (absolute, relative, or a sibling script's module), read
    from its import lines (cheaper than parsing every module the package has)."""
    out = []
    here = os.path.dirname(path)
    for dots, module, names, plain in IMPORT.findall(_text(path)):
        if plain:
            candidates = [plain]
        else:
            if dots:
                parts = os.path.relpath(here, REPO).split(os.sep)
                parts = parts[: len(parts) - len(dots) + 1]
                module = ".".join([p for p in parts if p not in ("", ".")] + ([module] if module else []))
            candidates = [module] + [f"{module}.{n.strip()}" for n in names.split(",") if n.strip()]
        for name in candidates:
            f = _module_file(name, near=here) if name else None
            if f and f.startswith(REPO):
                out.append(f)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _own_flags(path: str) -> Dict[str, Any]:
    """option string -> literal default (or :data:`_NOT_LITERAL`) of each ``add_argument`` in a file."""
    flags: Dict[str, Any] = {}
    if "add_argument" not in _text(path):
        return flags
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            opts = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                    and a.value.startswith("-")]
            given = [kw for kw in node.keywords if kw.arg == "default"]
            if given:
                try:
                    default: Any = ast.literal_eval(given[0].value)
                except ValueError:
                    default = _NOT_LITERAL
            else:
                action = next((kw.value.value for kw in node.keywords if kw.arg == "action"
                               and isinstance(kw.value, ast.Constant)), None)
                default = False if action == "store_true" else True if action == "store_false" else None
            negated = any(kw.arg == "action" and isinstance(kw.value, ast.Attribute)
                          and kw.value.attr == "BooleanOptionalAction" for kw in node.keywords)
            for o in opts:
                flags.setdefault(o, default)
                if negated and o.startswith("--"):  # argparse.BooleanOptionalAction adds --no-FLAG
                    flags.setdefault("--no-" + o[2:], not default if isinstance(default, bool) else default)
    return flags


@functools.lru_cache(maxsize=None)
def _ast_flags(path: str) -> Dict[str, Any]:
    """The flags of ``path`` and of the repository modules it imports, transitively."""
    flags: Dict[str, Any] = {}
    seen: Set[str] = set()
    todo = [path]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for o, d in _own_flags(f).items():
            flags.setdefault(o, d)
        todo += _imported_files(f)
    return flags


@functools.lru_cache(maxsize=None)
def _wraps(path: str) -> bool:
    """The script runs another command after ``--`` (an ``argparse.REMAINDER`` positional)."""
    return "REMAINDER" in _text(path) and any(isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "add_argument"
               and any(isinstance(k.value, ast.Attribute) and k.value.attr == "REMAINDER" for k in n.keywords)
               for n in ast.walk(_parse(path)))


_NOT_LITERAL = object()


@attrs.frozen
class EntryPoint:
    """A command a doc runs: its name, and how it accepts flags."""

    name: str
    flags: Callable[[Sequence[str]], Tuple[Dict[str, Any], List[str]]]  # args -> (flags, problems)
    wraps: bool = False  # runs another command after ``--`` (the testbed)

    def default(self, flag: str) -> Any:
        known, problems = self.flags([])
        if problems or flag not in known:
            raise LookupError(f"{self.name} has no flag {flag}")
        value = known[flag]
        if value is _NOT_LITERAL:
            raise LookupError(f"{self.name} {flag}: its default is not a literal; state it another way")
        return value


def _script_entry(path: str, name: str) -> EntryPoint:
    flags = dict(_ast_flags(path), **{"-h": None, "--help": None})
    return EntryPoint(name, lambda args: (flags, []), _wraps(path))


def _option_defaults(parser: Any) -> Dict[str, Any]:
    return {o: a.default for a in parser._actions for o in a.option_strings}


def _subparsers(parser: Any) -> Dict[str, Any]:
    import argparse

    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


@functools.lru_cache(maxsize=None)
def _sparselift_parsers() -> Tuple[Any, Any]:
    from torchrec_sparselift.cli import build_parser
    from torchrec_sparselift.measure.commands import build_calibrate_parser

    return build_parser(), build_calibrate_parser()


def _sparselift_flags(args: Sequence[str]) -> Tuple[Dict[str, Any], List[str]]:
    top, calibrate = _sparselift_parsers()
    known = _option_defaults(top)
    words = [a for a in args if not a.startswith("-")]
    if not words:
        return known, []
    commands = _subparsers(top)
    if words[0] not in commands:
        return known, [f"sparselift has no command {words[0]!r} (one of {sorted(commands)})"]
    parser = calibrate if words[0] == "calibrate" else commands[words[0]]
    known.update(_option_defaults(parser))
    inner = _subparsers(parser)
    if inner:
        if len(words) < 2 or words[1] not in inner:
            return known, [f"sparselift {words[0]} needs one of {sorted(inner)}"]
        known.update(_option_defaults(inner[words[1]]))
    return known, []


def _entry_point(words: Sequence[str]) -> Optional[EntryPoint]:
    """The entry point a command's words name (``sparselift plan``, ``python -m X``, a script)."""
    words = list(words)
    if words and words[0] in ("sparselift",):
        return EntryPoint("sparselift", lambda args: _sparselift_flags(list(words[1:]) + list(args)))
    if words[:2] == ["python", "-m"] and len(words) > 2:
        return _module_entry(words[2], words[3:])
    if words and words[0] in ("python",) and len(words) > 1:
        path = os.path.join(REPO, words[1])
        return _script_entry(path, words[1]) if os.path.isfile(path) else None
    if words and words[0].endswith(".py") and os.path.isfile(os.path.join(REPO, words[0])):
        return _script_entry(os.path.join(REPO, words[0]), words[0])
    return None


def _module_entry(module: str, rest: Sequence[str] = ()) -> Optional[EntryPoint]:
    if module == PACKAGE:
        return EntryPoint(f"python -m {PACKAGE}", lambda args: _sparselift_flags(list(rest) + list(args)))
    f = _module_file(module)
    if f is None:
        return None
    if f.endswith("__init__.py"):
        main = os.path.join(os.path.dirname(f), "__main__.py")
        if not os.path.isfile(main):
            return None
        f = main
    return _script_entry(f, f"python -m {module}")


PYTHONS = {"python", "python3", ".venv/bin/python", "$PYTHON"}
TORCHRUNS = {"torchrun", ".venv/bin/torchrun"}
WRAPPERS = {"time", "/usr/bin/time", "env", "sudo", "nohup", "exec", "timeout"}
OTHER_TOOLS = {"pip", "pip3", "git", "cd", "export", "mkdir", "ls", "cat", "rm", "cp", "echo", "for", "do",
               "done", "if", "then", "fi", "unzip", "tar", "apt-get", "curl", "wget", "ip", "tc", "less",
               "head", "tail", "grep", "jq", "source", ".", "set", "nvidia-smi", "mypy", "pytest", "ps"}


@functools.lru_cache(maxsize=None)
def _torchrun_parser() -> Any:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def _commands(text: str) -> List[List[str]]:
    """The simple commands of a shell text: continuations joined, comments, redirections and
    ``[ ]`` option brackets dropped, split at ``|``, ``&&``, ``||``, ``;``."""
    text = re.sub(r"\\\n", " ", text)
    text = re.sub(r"<[\w .|/-]+>", "ARG", text)  # a <placeholder> is a word, not a redirection
    out: List[List[str]] = []
    for line in text.split("\n"):
        lex = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
        lex.whitespace_split = True
        lex.commenters = "#"
        try:
            tokens = list(lex)
        except ValueError:
            continue
        cur: List[str] = []
        skip = False
        for t in tokens:
            if skip:
                skip = False
                continue
            if t in ("|", "||", "&&", ";", "&"):
                out.append(cur)
                cur = []
            elif t in (">", ">>", "<", "2>", "&>", ">&"):
                skip = True
                if cur and cur[-1].isdigit():
                    cur.pop()
            else:
                t = t.strip("[]")
                if t:
                    cur.append(t)
        out.append(cur)
    return [c for c in out if c]


PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$|:$|[<>]|\bNAME\b|\.\.\.")


def check_command(words: List[str], fragment: bool = False) -> List[str]:
    """Problems of one simple command (empty if fine or not a command this test knows).
    ``fragment``: an inline code span, which may name a command without its required words
    (`sparselift calibrate`, `torchrun --nproc_per_node 2`)."""
    problems = _check_command(words)
    if fragment:
        problems = [p for p in problems if "needs one of" not in p and "without a" not in p]
    return problems


def _check_command(words: List[str]) -> List[str]:
    if any(PLACEHOLDER.search(w) for w in words[:4] if not w.startswith("-")):
        return []  # a command with a placeholder in its name: COMMAND, NAME, <script>
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words = words[1:]
    while words and words[0] in WRAPPERS:
        head = words.pop(0)
        if head == "/usr/bin/time" and words[:1] == ["-f"]:
            words = words[2:]
        if head == "timeout" and words:
            words = words[1:]
    if not words:
        return []
    head = words[0]
    if head in PYTHONS:
        opts = words[1:]
        while opts and opts[0] in ("-u", "-O", "-B", "-X") or (opts and opts[0].startswith("-X")):
            opts = opts[2:] if opts[0] == "-X" else opts[1:]
        if not opts or opts[0] == "-c":
            return []
        if opts[0] == "-m":
            return _check_module(opts[1], opts[2:]) if len(opts) > 1 else ["python -m without a module"]
        return _check_script(opts[0], opts[1:])
    if head in TORCHRUNS:
        return _check_torchrun(words[1:])
    if head == "sparselift":
        return _check_flags(_entry_point(["sparselift"]), words[1:])
    if head in ("bash", "sh"):
        if len(words) < 2 or words[1].startswith("-"):
            return []
        return _check_shell(words[1], words[2:])
    if head.endswith(".py"):
        return _check_script(head, words[1:])
    return []


def _check_flags(entry: Optional[EntryPoint], args: Sequence[str]) -> List[str]:
    assert entry is not None
    args = list(args)
    inner: List[str] = []
    if entry.wraps and "--" in args:
        k = args.index("--")
        args, inner = args[:k], args[k + 1:]
    known, problems = entry.flags([a for a in args if not a.startswith("-")])
    for a in args:
        if a == "--":
            break
        if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", a):
            flag = a.split("=", 1)[0]
            if flag not in known:
                problems.append(f"{entry.name} has no flag {flag}")
    if inner:
        if inner[0] == "-m":
            problems += _check_module(inner[1], inner[2:]) if len(inner) > 1 else ["-- -m without a module"]
        else:
            problems += _check_script(inner[0], inner[1:])
    return problems


def _check_module(module: str, args: Sequence[str]) -> List[str]:
    if module.split(".")[0] not in (PACKAGE, "benchmarks", "examples", "scripts", "tests"):
        import importlib.util

        try:
            found = importlib.util.find_spec(module.split(".")[0]) is not None
        except (ImportError, ValueError):
            found = False
        return [] if found else [f"python -m {module}: no such module"]
    entry = _module_entry(module)
    if entry is None:
        return [f"python -m {module}: no such module (or package without __main__.py) in the repository"]
    return _check_flags(entry, args)


def _check_script(path: str, args: Sequence[str]) -> List[str]:
    if path.startswith("$") or path.startswith("<"):
        return []
    full = os.path.join(REPO, path)
    if not os.path.isfile(full):
        return [f"{path}: no such file in the repository"]
    if not path.endswith(".py"):
        return []
    top = path.split("/")[0]
    text = _text(full)
    if "/" in path and re.search(r"^\s*(?:from|import)\s+" + re.escape(top) + r"[.\s]", text, re.MULTILINE) \
            and "sys.path" not in text:
        module = path[:-3].replace("/", ".")
        return [f"{path} imports the {top} package, so it runs only as a module: python -m {module}"]
    return _check_flags(_script_entry(full, path), args)


def _check_torchrun(args: List[str]) -> List[str]:
    parser = _torchrun_parser()
    actions = parser._option_string_actions
    i, module = 0, False
    while i < len(args) and args[i].startswith("-"):
        flag = args[i].split("=", 1)[0]
        if flag not in actions:
            return [f"torchrun has no flag {flag}"]
        action = actions[flag]
        if action.dest == "module":
            module = True
        i += 1 if (action.nargs == 0 or "=" in args[i]) else 2
    if i >= len(args):
        return ["torchrun without a script"]
    if module:
        return _check_module(args[i], args[i + 1:])
    return _check_script(args[i], args[i + 1:])


def _check_shell(path: str, args: Sequence[str]) -> List[str]:
    full = os.path.join(REPO, path)
    if not os.path.isfile(full):
        return [f"{path}: no such file in the repository"]
    with open(full, encoding="utf-8") as f:
        source = re.sub(r"\\\n", " ", f.read())
    flags = [a for a in args if a.startswith("-")]
    if not flags:
        return []
    for line in source.split("\n"):
        if '"$@"' not in line or "pytest" in line:
            continue
        m = re.search(r"(?:python\S*|torchrun)\s+(?:-m\s+([\w.]+)|(\S+\.py))", line)
        if m:
            entry = _module_entry(m.group(1)) if m.group(1) else _script_entry(os.path.join(REPO, m.group(2)),
                                                                                m.group(2))
            return _check_flags(entry, [a for a in args]) if entry else []
    return []


COMMAND_START = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:sparselift|python3?|torchrun|bash|\.venv/bin/\w+)\s"
                           r"|^[\w/.-]+\.py\s+-")  # a command, or a script shown with its flags


def check_commands(doc: Doc) -> List[Problem]:
    out = []
    i = 0
    while i < len(doc.lines):
        kind = doc.fence[i]
        if kind in ("bash", "sh", "shell", "console"):
            start = i
            block = []
            while i < len(doc.lines) and doc.fence[i] == kind:
                line = doc.lines[i]
                block.append(line[2:] if kind == "console" and line.startswith("$ ") else line)
                i += 1
            text = "\n".join(block)
            # keep line numbers: one command per physical line start
            offset = 0
            for chunk in re.split(r"(?<!\\)\n", text):
                for words in _commands(chunk):
                    for p in check_command(words):
                        out.append(Problem(doc.path, start + offset + 1, p))
                offset += chunk.count("\n") + 1
            continue
        if kind == "?" and doc.lines[i].startswith("$ "):  # an unlabeled block's shell prompt
            for words in _commands(doc.lines[i][2:]):
                for p in check_command(words):
                    out.append(Problem(doc.path, i + 1, p))
        i += 1
    for line, text in doc.paragraphs():  # inline spans, also those wrapped over two lines
        if text.startswith("#"):
            continue
        for span in _spans(text):
            if COMMAND_START.match(span):
                for words in _commands(span):
                    for p in check_command(words, fragment=True):
                        out.append(Problem(doc.path, line, p))
    for line, marker, rows in doc.tables():
        m = re.fullmatch(r"flags:\s*(.+)", marker)
        if not m:
            continue
        entry = _entry_point(shlex.split(m.group(1)))
        if entry is None:
            out.append(Problem(doc.path, line, f"flags table of {m.group(1)!r}: not a command this test knows"))
            continue
        for k, row in enumerate(rows[1:], start=1):
            for span in _spans(row[0]):
                flags = [w for w in span.split() if w.startswith("-")]
                for p in _check_flags(entry, flags):
                    out.append(Problem(doc.path, line + k + 1, p))
    return out


# ---------------------------------------------------------------- (c) keyword arguments in Python examples

#: Public callables whose keyword arguments the docs show: name -> "module:attribute".
CALLABLES = {
    "SparseLiftPlanner": "torchrec_sparselift.planner:SparseLiftPlanner",
    "lift": "torchrec_sparselift.runtime.model_parallel:lift",
    "build_2d_model_parallel": "torchrec_sparselift.runtime.two_d:build_2d_model_parallel",
    "evaluate_sharding_plan": "torchrec_sparselift.plan.evaluate:evaluate_sharding_plan",
}


@functools.lru_cache(maxsize=None)
def _keywords(name: str) -> Optional[Set[str]]:
    """The keyword arguments ``name`` accepts; None where it takes ``**kwargs`` (anything)."""
    import importlib
    import inspect

    module, attr = CALLABLES[name].split(":")
    obj = getattr(importlib.import_module(module), attr)
    params = inspect.signature(obj).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


CALL = re.compile(r"\b(" + "|".join(CALLABLES) + r")\(")


def _call_keywords(text: str) -> Iterator[Tuple[str, str]]:
    """(callable, keyword) of every call of a :data:`CALLABLES` name in ``text`` (Python or a span)."""
    for m in CALL.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        args = text[m.end():i - 1]
        # keywords at the call's own nesting level
        level, kw = 0, []
        for k in re.finditer(r"[()\[\]{}]|\b([A-Za-z_]\w*)\s*=(?!=)", args):
            tok = k.group(0)
            if tok in "([{":
                level += 1
            elif tok in ")]}":
                level -= 1
            elif level == 0:
                kw.append(k.group(1))
        for name in kw:
            yield m.group(1), name


def check_keywords(doc: Doc) -> List[Problem]:
    out = []
    i = 0
    while i < len(doc.lines):
        if doc.fence[i] in ("python", "py"):
            start = i
            while i < len(doc.lines) and doc.fence[i] in ("python", "py"):
                i += 1
            block = "\n".join(re.sub(r"#.*", "", line) for line in doc.lines[start:i])  # comments dropped
            for callable_, kw in _call_keywords(block):
                accepted = _keywords(callable_)
                if accepted is not None and kw not in accepted:
                    out.append(Problem(doc.path, start + 1, f"{callable_}() takes no keyword {kw!r}"))
            continue
        if not doc.fence[i]:
            for span in _spans(doc.lines[i]):
                for callable_, kw in _call_keywords(span):
                    accepted = _keywords(callable_)
                    if accepted is not None and kw not in accepted:
                        out.append(Problem(doc.path, i + 1, f"{callable_}() takes no keyword {kw!r}"))
        i += 1
    return out


# ---------------------------------------------------------------- code references


def _module_names(path: str) -> Dict[str, ast.AST]:
    """Names a module defines at its top level (functions, classes, assignments, imports), also
    inside top-level ``if``/``try`` blocks."""
    names: Dict[str, ast.AST] = {}
    todo: List[ast.stmt] = list(_parse(path).body)
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[n.name] = n
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                for x in ast.walk(t):
                    if isinstance(x, ast.Name):
                        names[x.id] = n
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names[n.target.id] = n
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            for a in n.names:
                names[(a.asname or a.name).split(".")[0]] = n
        elif isinstance(n, (ast.If, ast.Try)):
            todo += n.body + n.orelse + [h for x in getattr(n, "handlers", []) for h in x.body]
    return names


def _class_members(node: ast.ClassDef) -> Set[str]:
    out = set()
    for m in ast.walk(node):
        if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(m.name)
        elif isinstance(m, ast.AnnAssign) and isinstance(m.target, ast.Name):
            out.add(m.target.id)
        elif isinstance(m, ast.Assign):
            out.update(t.id for t in m.targets if isinstance(t, ast.Name))
        elif isinstance(m, ast.Attribute) and isinstance(m.value, ast.Name) and m.value.id == "self":
            out.add(m.attr)
    return out


#: Package root modules whose names are also the docs' usual variable names (``planner.last_result``).
VARIABLE_LIKE = {"planner", "plan"}


def _reference_problem(ident: str) -> Optional[str]:
    """Why a dotted reference to the package (``semantics.tables.embedding_modules``,
    ``vocabulary.Pipeline.conflict``) names nothing, or None (it resolves, or is not one)."""
    parts = ident.split(".")
    if parts[0] == PACKAGE:
        parts = parts[1:]
    root = os.path.join(REPO, PACKAGE)
    if not parts or not (os.path.isfile(os.path.join(root, parts[0] + ".py"))
                         or os.path.isdir(os.path.join(root, parts[0]))):
        return None
    for k in range(len(parts), 0, -1):
        f = _module_file(f"{PACKAGE}." + ".".join(parts[:k]))
        if f is None:
            continue
        rest = parts[k:]
        if not rest:
            return None
        names = _module_names(f)
        where = f"{PACKAGE}." + ".".join(parts[:k])
        if rest[0] not in names:
            return None if parts[0] in VARIABLE_LIKE and k == 1 else f"{ident}: {where} has no {rest[0]!r}"
        node = names[rest[0]]
        if len(rest) > 1 and isinstance(node, ast.ClassDef) and rest[1] not in _class_members(node):
            return f"{ident}: {where}.{rest[0]} has no {rest[1]!r}"
        return None
    return None


def check_references(doc: Doc) -> List[Problem]:
    out = []
    for line, text in doc.prose():
        for span in _spans(text):
            m = re.fullmatch(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?", span)
            if m:
                why = _reference_problem(m.group(1))
                if why:
                    out.append(Problem(doc.path, line, why))
    return out


# ---------------------------------------------------------------- links, README


def _slug(heading: str) -> str:
    text = re.sub(r"`|\*\*|\[|\]\([^)]*\)", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(doc: Doc) -> Set[str]:
    seen: Dict[str, int] = {}
    out = set()
    for i, line in enumerate(doc.lines):
        if doc.fence[i]:
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = _slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
        out.update(re.findall(r'<a (?:name|id)="([^"]+)"', line))
    return out


def check_links(doc: Doc, root: str) -> List[Problem]:
    out = []
    here = os.path.dirname(doc.path)
    for line, text in doc.prose():
        text = CODE_SPAN.sub("", text)
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            rel = os.path.normpath(os.path.join(here, path)) if path else doc.path
            if not os.path.exists(os.path.join(root, rel)) and not os.path.exists(os.path.join(REPO, rel)):
                out.append(Problem(doc.path, line, f"link to {target}: no such file"))
                continue
            if anchor and rel.endswith(".md"):
                if anchor not in _anchors(Doc.read(root if os.path.exists(os.path.join(root, rel)) else REPO, rel)):
                    out.append(Problem(doc.path, line, f"link to {target}: no heading with anchor #{anchor} in {rel}"))
    return out


def _section(doc: Doc, title: str) -> Tuple[int, List[str]]:
    """(line of the heading, lines until the next heading of the same or a higher level)."""
    for i, line in enumerate(doc.lines):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*$", line)
        if m and not doc.fence[i] and m.group(2).strip().lower() == title.lower():
            level = len(m.group(1))
            body = []
            for j in range(i + 1, len(doc.lines)):
                n = re.match(r"^(#{1,6})\s", doc.lines[j])
                if n and not doc.fence[j] and len(n.group(1)) <= level:
                    break
                body.append(doc.lines[j])
            return i + 1, body
    return 0, []


def glossary(root: str) -> Set[str]:
    """The terms of docs/concepts.md's glossary (first column of its table), lower case, with each
    term's alternative spellings ("term / other", "term (abbr)")."""
    doc = Doc.read(root, "docs/concepts.md")
    line, body = _section(doc, "Glossary")
    terms: Set[str] = set()
    for row in body:
        if _is_row(row) and not re.match(r"^\s*\|[\s:|-]+\|\s*$", row):
            cell = re.sub(r"<a [^>]*></a>", "", _cells(row)[0])
            cell = re.sub(r"[*`]", "", cell).strip()
            for part in re.split(r"\s+/\s+|\s*,\s*|\s*\(\s*|\s*\)\s*", cell):
                if part:
                    terms.add(part.lower())
    terms.discard("term")
    return terms


def check_readme(root: str) -> List[Problem]:
    out = []
    doc = Doc.read(root, "README.md")
    line, body = _section(doc, "Known limits")
    if not line:
        return [Problem("README.md", 1, "no '## Known limits' section")]
    text = [b for b in body if b.strip()]
    if len(text) > 15:
        out.append(Problem("README.md", line, f"Known limits has {len(text)} lines; at most 15"))
    items: List[str] = []
    for b in text:
        if re.match(r"^\s*[-*]\s", b):
            items.append(b)
        elif items:
            items[-1] += " " + b
    for item in items:
        if not re.search(r"\]\((?:docs/)?[\w./-]+\.md[^)]*\)", item):
            out.append(Problem("README.md", line, f"a known limit without a link to its page: {item.strip()[:60]!r}"))
    return out


def check_glossary(root: str, paths: Sequence[str]) -> List[Problem]:
    out = []
    terms = glossary(root)
    if not terms:
        return [Problem("docs/concepts.md", 1, "no '## Glossary' section with a table of terms")]
    for path in paths:
        doc = Doc.read(root, path)
        prose = "\n".join(t for _, t in doc.prose())
        for term in GLOSSARY_TERMS:
            pattern = r"(?<![\w-])" + re.escape(term) + r"(?:s|es)?(?![\w-])"
            flags = 0 if re.fullmatch(r"R\d|2D", term) else re.IGNORECASE
            if re.search(pattern, prose, flags) and term.lower() not in terms:
                out.append(Problem(path, 1, f"uses {term!r}, which docs/concepts.md's glossary does not define"))
    return out


def check_all(root: str = REPO, paths: Optional[Sequence[str]] = None) -> List[Problem]:
    paths = list(paths) if paths is not None else _doc_paths(root)
    problems: List[Problem] = []
    for path in paths:
        doc = Doc.read(root, path)
        problems += (check_defaults(doc) + check_registries(doc) + check_commands(doc) + check_keywords(doc)
                     + check_references(doc) + check_links(doc, root))
    if "README.md" in paths:
        problems += check_readme(root)
    problems += check_glossary(root, paths)
    return problems


# ---------------------------------------------------------------- the tests


def _report(problems: Sequence[Problem]) -> str:
    return f"{len(problems)} contradictions between the docs and the code:\n  " + "\n  ".join(map(str, problems))


def test_the_code_side_of_the_checks_is_consistent():
    assert two_d.DEFAULT_MAX_SYNC_INTERVAL == defaults.MAX_SYNC_INTERVAL
    assert len(_pipelines()) == len(set(_pipelines())) >= 1
    assert len(_precisions()) == len(set(_precisions())) >= 1
    for key, read in DEFAULTS.items():
        read()  # every default the docs may state is readable from the code


def test_docs_state_the_code_defaults_and_registries():
    problems = []
    for path in _doc_paths(REPO):
        doc = Doc.read(REPO, path)
        problems += check_defaults(doc) + check_registries(doc)
    assert not problems, _report(problems)


def test_docs_commands_name_existing_scripts_modules_and_flags():
    problems = [p for path in _doc_paths(REPO) for p in check_commands(Doc.read(REPO, path))]
    assert not problems, _report(problems)


def test_docs_python_examples_use_existing_keywords():
    problems = [p for path in _doc_paths(REPO) for p in check_keywords(Doc.read(REPO, path))]
    assert not problems, _report(problems)


def test_docs_code_references_resolve():
    problems = [p for path in _doc_paths(REPO) for p in check_references(Doc.read(REPO, path))]
    assert not problems, _report(problems)


def test_docs_links_resolve():
    problems = [p for path in _doc_paths(REPO) for p in check_links(Doc.read(REPO, path), REPO)]
    assert not problems, _report(problems)


def test_readme_known_limits_and_glossary():
    problems = check_readme(REPO) + check_glossary(REPO, _doc_paths(REPO))
    assert not problems, _report(problems)


def test_the_docs_state_the_facts_the_checks_read():
    """The checks above pass vacuously if the docs state nothing in the recognised forms."""
    concepts = Doc.read(REPO, "docs/concepts.md")
    stated = [rows for _, _, rows in concepts.tables() if [c.lower() for c in rows[0][:2]] == ["setting", "default"]]
    assert stated, "docs/concepts.md has no '| setting | default |' table"
    keys = {(_spans(r[0]) or [""])[0] for rows in stated for r in rows[1:]}
    for required in ("max_sync_interval", "time_budget_s", "batch_size", "pipeline", "never_slower", "replica_sync",
                     "MomentumScaledRowWiseAdagrad.momentum"):
        assert required in keys, f"docs/concepts.md's defaults table does not state {required}"
    markers = {m for path in _doc_paths(REPO) for _, m, _ in Doc.read(REPO, path).tables()}
    assert "registry: pipelines" in markers and "registry: comm_precisions" in markers
    assert len(glossary(REPO)) >= len(GLOSSARY_TERMS)


def _plant(tmp_path: Any, path: str, old: str, new: str) -> str:
    """A copy of the docs with ``old`` replaced by ``new`` in ``path`` (which must contain it)."""
    root = str(tmp_path / "docs_copy")
    if not os.path.exists(root):
        shutil.copytree(os.path.join(REPO, "docs"), os.path.join(root, "docs"))
        shutil.copy(os.path.join(REPO, "README.md"), os.path.join(root, "README.md"))
    full = os.path.join(root, path)
    with open(full, encoding="utf-8") as f:
        text = f.read()
    if old not in text:
        raise AssertionError(f"{path} no longer contains {old!r}: update the planted contradiction")
    with open(full, "w", encoding="utf-8") as f:
        f.write(text.replace(old, new, 1))
    return root


PLANTED_IDS = ["default-in-table", "default-inline", "merge-called-default", "pipeline-list-of-five",
               "pipeline-list-bare-words", "registry-table-row", "cli-flag", "example-flag", "flag-table",
               "planner-keyword", "removed-module", "missing-script", "code-reference", "link-anchor",
               "known-limits-length", "glossary-term"]


@pytest.mark.parametrize("path, old, new, expect", [
    # (a) a default in the defaults table
    ("docs/concepts.md", "| `max_sync_interval` | `2` |", "| `max_sync_interval` | `4` |",
     "default of max_sync_interval as '4'"),
    # (a) a default stated inline
    ("docs/optimizer.md", "`DEFAULT_MAX_SYNC_INTERVAL = 2`", "`DEFAULT_MAX_SYNC_INTERVAL = 8`", "the code's is 2"),
    # (a) the 2D replica merge called the default
    ("docs/benchmarks.md", "| momentum-scaled: loss - 1D", "| momentum-scaled (default): loss - 1D",
     "the default replica merge is TorchRec averaging"),
    # (b) a pipeline list of five kinds
    ("docs/concepts.md", "<!-- registry: pipelines -->",
     "`base`, `sparse_dist`, `fused`, `semi_sync`, `prefetch` are the kinds.\n\n<!-- registry: pipelines -->",
     "lists base, sparse_dist, fused, semi_sync, prefetch"),
    # (b) the same as bare words in a table cell
    ("docs/concepts.md", "| <a id=\"rank\"></a>**rank** |",
     "| pipeline | TorchRec train-pipeline kind: base, sparse_dist, fused, semi_sync, prefetch |\n"
     "| <a id=\"rank\"></a>**rank** |", "lists base, sparse_dist, fused, semi_sync, prefetch"),
    # (b) a registry table missing a row
    ("docs/concepts.md", "| `overlap_stale` |", "| `overlap_stale_gone` |", "the pipelines table lists"),
    # (c) a flag the command does not accept
    ("README.md", "sparselift plan --workload dcnv2", "sparselift plan --no-such-flag 1 --workload dcnv2",
     "sparselift has no flag --no-such-flag"),
    ("docs/quickstart.md", "examples/dlrm/train.py --scale", "examples/dlrm/train.py --scales", "has no flag --scales"),
    ("docs/quickstart.md", "| `--planner sparselift", "| `--plannerx sparselift", "has no flag --plannerx"),
    # (c) a keyword argument the planner does not take
    ("README.md", "SparseLiftPlanner(topology=topology, batch_size=batch_size, constraints=constraints)\nplan",
     "SparseLiftPlanner(topology=topology, batch_size=batch_size, constraints=constraints, no_such_option=1)\nplan",
     "SparseLiftPlanner() takes no keyword 'no_such_option'"),
    # (d) a module, a script that does not exist
    ("docs/testbed.md", "-m torchrec_sparselift calibrate steps", "-m torchrec_sparselift.step_calibration",
     "no such module"),
    ("README.md", "bash scripts/test.sh", "bash scripts/no_such.sh", "scripts/no_such.sh: no such file"),
    # a code reference to a name the package does not define
    ("docs/concepts.md", "`semantics.tables.embedding_modules`", "`semantics.tables.embedding_modules_gone`",
     "torchrec_sparselift.semantics.tables has no 'embedding_modules_gone'"),
    # links, README limits, glossary
    ("README.md", "(docs/concepts.md#glossary)", "(docs/concepts.md#no-such-heading)", "no heading with anchor"),
    ("README.md", "## Known limits\n", "## Known limits\n" + "- a limit [l](docs/memory.md)\n" * 16,
     "Known limits has"),
    ("docs/concepts.md", "**never-slower rule** |", "**never-slowest rule** |", "uses 'never-slower rule'"),
], ids=PLANTED_IDS)
def test_checker_flags_planted_contradictions(tmp_path, path, old, new, expect):
    root = _plant(tmp_path, path, old, new)
    problems = check_all(root, [path])
    assert any(expect in str(p) for p in problems), (
        f"planted {new!r} in {path}, expected a problem containing {expect!r}; got:\n  "
        + "\n  ".join(map(str, problems)))


def test_checker_flags_a_package_script_run_by_path(tmp_path, monkeypatch):
    """A benchmark that imports ``benchmarks.harness`` (no ``sys.path`` edit) runs only as
    ``python -m benchmarks.x``: the docs may not show ``python benchmarks/x.py``."""
    (tmp_path / "benchmarks" / "harness").mkdir(parents=True)
    (tmp_path / "benchmarks" / "__init__.py").write_text("")
    (tmp_path / "benchmarks" / "harness" / "__init__.py").write_text("")
    (tmp_path / "benchmarks" / "x.py").write_text(
        "import argparse\nfrom benchmarks.harness import run\n"
        "p = argparse.ArgumentParser()\np.add_argument('--rounds', type=int, default=4)\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    assert check_command(["python", "benchmarks/x.py", "--rounds", "2"]) == [
        "benchmarks/x.py imports the benchmarks package, so it runs only as a module: python -m benchmarks.x"]
    assert check_command(["python", "-m", "benchmarks.x", "--rounds", "2"]) == []
    assert check_command(["python", "-m", "benchmarks.x", "--round", "2"]) == ["python -m benchmarks.x has no flag --round"]
    assert check_command(["torchrun", "--nproc_per_node", "2", "-m", "benchmarks.x"]) == []
    assert check_command(["torchrun", "--nproc_per_node", "2", "-m", "benchmarks.y"]) == [
        "python -m benchmarks.y: no such module (or package without __main__.py) in the repository"]


def test_package_exports_are_visible_to_type_checkers():
    """``torchrec_sparselift/__init__.py`` imports lazily at run time (``_EXPORTS``); its
    ``if TYPE_CHECKING:`` block imports the same names from the same modules, so IDEs and mypy see
    them, and ``__all__`` lists them: the three agree."""
    import torchrec_sparselift

    tree = _parse(os.path.join(REPO, PACKAGE, "__init__.py"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    typed = {a.asname or a.name: n.module for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}
    lazy = dict(torchrec_sparselift._EXPORTS)
    assert typed == lazy, (f"TYPE_CHECKING imports {sorted(set(typed.items()) ^ set(lazy.items()))} differ from "
                           f"_EXPORTS: import each exported name from its module in both")
    assert set(torchrec_sparselift.__all__) == {"__version__", *lazy}
