"""Strict reading of the files the package reads: one loader, one error type.

Every stored input (table files, execution plans, hardware profiles, calibration records, stored
command-line inputs) is read with :func:`load_json` (or :func:`load_structured`, which also reads
YAML when PyYAML is installed) and its fields are taken with a :class:`Fields` reader. Whatever is
wrong, the caller gets one :class:`~torchrec_sparselift.errors.FileFormatError` (a
``ValueError``) on one line that names the file, the field path and the fix::

    table file t.json: tables[3].rows: must be an integer in 1..9223372036854775807, got 1e+30 (a float); to fix: write the row count as a whole number

What is refused, and how it is named:

- a missing file, a directory, an unreadable file (the OS reason);
- bytes that are not UTF-8 (the byte offset and line of the first bad byte);
- invalid or truncated JSON / YAML (line and column);
- a duplicate key in one object (JSON would silently keep the last one; the key is named);
- a top level of the wrong type (a list where an object is expected);
- a field that is missing, of the wrong type, or out of range (non-finite numbers, negative
  counts, integers beyond int64), by its path (``tables[3].rows``, ``modules["sparse.ebc"]``).

What the package keys stored things by (plan fingerprints, the plan cache, the machine a profile
was fitted on, guard results) is :func:`canonical_digest`: the sha256 of an object's canonical
JSON (:func:`canonical_form`), the same in any process.

Every record's ``from_dict`` reads through the same :class:`Fields` (:func:`record_reader`,
:func:`read_attrs`): a dict in memory gets the errors a file gets, named by the record
(``StepRecord: measured_s: ...``), and a file's loader hands its own reader to ``from_dict`` so the
error names the file and the field path (``step records runs.json: records[2].measured_s: ...``).

Like ``errors`` and ``atomic`` this module is a base module every layer may use: it imports
nothing of the package but ``errors``, and nothing outside the standard library and attrs
(PyYAML only when a YAML file is read).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import os
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Type

import attrs

from torchrec_sparselift.errors import FileFormatError

__all__ = [
    "FileFormatError",
    "INT64_MAX",
    "Fields",
    "read_bytes",
    "decode_utf8",
    "parse_json",
    "parse_yaml",
    "load_json",
    "load_structured",
    "field_path",
    "record_reader",
    "read_attrs",
    "canonical_form",
    "canonical_digest",
]

#: Largest value an int64 tensor dimension (rows, columns, sizes, offsets) can hold.
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)

_YAML_SUFFIXES = (".yaml", ".yml")


# ----------------------------------------------------------------------------------------------
# messages
# ----------------------------------------------------------------------------------------------


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _show(value: Any, limit: int = 60) -> str:
    """A value as a message shows it: its repr, shortened, and its JSON kind."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a value from a file must never break the message
        text = f"<{type(value).__name__}>"
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{text} ({_kind(value)})"


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def _source(what: str, path: Optional[str]) -> str:
    if path is None:
        return what
    return f"{what} {path}" if what else str(path)


def _error(source: str, field: str, problem: str, fix: str = "",
           error: Type[FileFormatError] = FileFormatError, path: Optional[str] = None) -> FileFormatError:
    head = ": ".join(p for p in (source, field) if p)
    msg = f"{head}: {problem}" if head else problem
    if fix:
        msg += f"; to fix: {fix}"
    return error(_one_line(msg), path=path)


def field_path(base: str, key: Any) -> str:
    """``base`` extended by one step: ``tables[3]``, ``tables[3].rows``, ``modules["sparse.ebc"]``."""
    if isinstance(key, int) and not isinstance(key, bool):
        return f"{base}[{key}]"
    if isinstance(key, str) and key.isidentifier():
        return f"{base}.{key}" if base else key
    try:
        shown = json.dumps(key) if isinstance(key, str) else repr(key)
    except Exception:  # noqa: BLE001
        shown = f"<{type(key).__name__}>"
    return f"{base}[{shown}]"


# ----------------------------------------------------------------------------------------------
# bytes -> text -> data
# ----------------------------------------------------------------------------------------------


def read_bytes(path: str, what: str = "file", error: Type[FileFormatError] = FileFormatError) -> bytes:
    """The content of ``path``; a missing, directory or unreadable path is a ``FileFormatError``."""
    src = _source(what, path)
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise _error(src, "", "does not exist", "check the path", error, path) from None
    except IsADirectoryError:
        raise _error(src, "", "is a directory, not a file", "name the file inside it", error, path) from None
    except PermissionError:
        raise _error(src, "", "cannot be read (permission denied)",
                     "make it readable by this user (chmod u+r)", error, path) from None
    except OSError as e:
        raise _error(src, "", f"cannot be read: {e.strerror or e}", "", error, path) from None


def decode_utf8(raw: bytes, path: Optional[str] = None, what: str = "file",
                error: Type[FileFormatError] = FileFormatError) -> str:
    """``raw`` as UTF-8 text (a leading byte-order mark is dropped); names the first bad byte."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise _error(
            _source(what, path), "",
            f"is not UTF-8 text: byte 0x{raw[e.start]:02x} at offset {e.start} (line {line}) "
            f"cannot be decoded", "save the file as UTF-8 (or restore it: is it a binary or truncated copy?)",
            error, path,
        ) from None
    return text[1:] if text.startswith("\ufeff") else text


def _no_duplicates(source: str, error: Type[FileFormatError], path: Optional[str]
                   ) -> Callable[[List[Tuple[str, Any]]], Dict[str, Any]]:
    def hook(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                name = out.get("name")
                inside = f" in the object with name {name!r}" if isinstance(name, str) else ""
                raise _error(
                    source, "", f"duplicate key {key!r}{inside} (JSON readers keep only the last value)",
                    f"keep one {key!r} in that object", error, path,
                )
            out[key] = value
        return out

    return hook


def parse_json(text: str, path: Optional[str] = None, what: str = "file",
               error: Type[FileFormatError] = FileFormatError) -> Any:
    """Parse JSON ``text`` refusing duplicate keys; errors name ``what path`` and line:column."""
    src = _source(what, path)
    if not text.strip():
        raise _error(src, "", "is empty", "restore it from where it came from, or remove it", error, path)
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates(src, error, path))
    except FileFormatError:
        raise
    except json.JSONDecodeError as e:
        truncated = " (the file ends early: truncated?)" if e.pos >= len(text.rstrip()) else ""
        raise _error(src, "", f"is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}{truncated}",
                     "fix the JSON syntax there", error, path) from None
    except RecursionError:
        raise _error(src, "", "is not usable: JSON nested too deeply", "", error, path) from None
    except ValueError as e:  # e.g. an integer literal with more digits than Python converts
        raise _error(src, "", f"is not usable JSON: {e}", "", error, path) from None


def parse_yaml(text: str, path: Optional[str] = None, what: str = "file",
               error: Type[FileFormatError] = FileFormatError) -> Any:
    """Parse YAML ``text`` (safe types only) refusing duplicate keys; needs PyYAML."""
    src = _source(what, path)
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        raise _error(src, "", "is YAML, and reading YAML needs PyYAML",
                     "pip install pyyaml, or use a .json file", error, path) from None
    loader = _strict_yaml_loader(yaml)
    if not text.strip():
        raise _error(src, "", "is empty", "restore it from where it came from, or remove it", error, path)
    try:
        return yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateYamlKey as e:
        raise _error(src, "", f"duplicate key {e.key!r} at line {e.line} (YAML readers keep only the last value)",
                     f"keep one {e.key!r} in that mapping", error, path) from None
    except yaml.YAMLError as e:
        raise _error(src, "", f"is not valid YAML: {e}", "fix the YAML syntax there", error, path) from None
    except RecursionError:
        raise _error(src, "", "is not usable: YAML nested too deeply", "", error, path) from None
    except (ValueError, TypeError, OverflowError) as e:  # a tagged scalar PyYAML cannot build
        raise _error(src, "", f"is not usable YAML: {e}", "", error, path) from None


class _DuplicateYamlKey(Exception):
    def __init__(self, key: Any, line: int) -> None:
        super().__init__(key, line)
        self.key, self.line = key, line


_YAML_LOADER: Any = None


def _strict_yaml_loader(yaml: Any) -> Any:
    global _YAML_LOADER
    if _YAML_LOADER is not None:
        return _YAML_LOADER

    class StrictSafeLoader(yaml.SafeLoader):  # type: ignore[misc, name-defined]
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen: List[Any] = []
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue  # "<<" merges are allowed to be overridden
                    key = self.construct_object(key_node, deep=True)
                    if key in seen:
                        raise _DuplicateYamlKey(key, key_node.start_mark.line + 1)
                    seen.append(key)
            return super().construct_mapping(node, deep=deep)

    _YAML_LOADER = StrictSafeLoader
    return _YAML_LOADER


def _check_top(data: Any, top: Optional[type], src: str, error: Type[FileFormatError], path: Optional[str]) -> Any:
    if top is None or isinstance(data, top):
        return data
    want = {dict: "an object ({...})", list: "a list ([...])"}.get(top, f"a {top.__name__}")
    raise _error(src, "", f"top level must be {want}, got {_kind(data)}",
                 "check that this is the right file", error, path)


def load_json(path: "os.PathLike[str] | str", what: str = "file", top: Optional[type] = None,
              error: Type[FileFormatError] = FileFormatError) -> Any:
    """The parsed JSON content of ``path`` (``top``: the type the top level must have, e.g. ``dict``).

    Raises ``error`` (a :class:`FileFormatError`) naming ``what path`` when the file is missing,
    unreadable, not UTF-8, not valid JSON, holds a duplicate key, or its top level is not ``top``.
    """
    p = os.fspath(path)
    src = _source(what, p)
    data = parse_json(decode_utf8(read_bytes(p, what, error), p, what, error), p, what, error)
    return _check_top(data, top, src, error, p)


def load_structured(path: "os.PathLike[str] | str", what: str = "file", top: Optional[type] = None,
                    error: Type[FileFormatError] = FileFormatError) -> Any:
    """Like :func:`load_json`, and ``.yaml``/``.yml`` files are read as YAML (needs PyYAML)."""
    p = os.fspath(path)
    if not p.endswith(_YAML_SUFFIXES):
        return load_json(p, what, top, error)
    data = parse_yaml(decode_utf8(read_bytes(p, what, error), p, what, error), p, what, error)
    return _check_top(data, top, _source(what, p), error, p)


# ----------------------------------------------------------------------------------------------
# fields
# ----------------------------------------------------------------------------------------------

_MISSING = object()
_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean (true/false)",
               list: "a list", dict: "an object"}


class Fields:
    """Typed access to one object of a parsed file; every error names the file and field path.

    ``Fields(data, file=path, what="table file", path="tables[3]")``; then ``req(name, kind, ...)``
    for a required field, ``opt(name, kind, default, ...)`` for an optional one (absent or
    ``null`` gives the default), ``obj``/``objs`` for nested objects and lists of objects,
    ``values`` for lists of scalars, ``only`` to refuse unknown keys. ``kind`` is one of ``int``,
    ``float`` (an int is accepted and returned as float), ``str``, ``bool``, ``list``, ``dict``.

    Range rules (keywords): ``lo``/``hi`` inclusive bounds, ``gt`` exclusive lower bound,
    ``choices`` allowed values, ``nonempty`` for strings and lists, ``finite`` (default True
    for numbers). Integers are always within int64. ``fix`` replaces the default fix text.
    """

    def __init__(self, data: Any, *, file: Optional[str] = None, what: str = "file", path: str = "",
                 error: Type[FileFormatError] = FileFormatError) -> None:
        self.file = None if file is None else os.fspath(file)
        self.what = what
        self.path = path
        self.error = error
        if not isinstance(data, dict):
            raise self._fail(path or "top level", f"must be an object ({{...}}), got {_show(data)}",
                             "check that this is the right file")
        self.data: Dict[Any, Any] = data

    def __repr__(self) -> str:
        return f"Fields({_source(self.what, self.file)}: {self.path or 'top level'})"

    # -- errors --------------------------------------------------------------------------------
    def _fail(self, field: str, problem: str, fix: str = "") -> FileFormatError:
        return _error(_source(self.what, self.file), field, problem, fix, self.error, self.file)

    def fail(self, name: Any, problem: str, fix: str = "") -> FileFormatError:
        """An error about field ``name`` of this object (``None``: the object itself)."""
        return self._fail(self.path if name is None else field_path(self.path, name), problem, fix)

    def child(self, value: Any, key: Any) -> "Fields":
        """A reader for ``value``, found at ``key`` below this object."""
        return Fields(value, file=self.file, what=self.what, path=field_path(self.path, key), error=self.error)

    # -- keys ----------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def only(self, allowed: Iterable[str], fix: str = "") -> None:
        """Refuse keys outside ``allowed`` (the message lists both)."""
        allowed = list(allowed)
        unknown = sorted(repr(k) if not isinstance(k, str) else k for k in self.data if k not in allowed)
        if unknown:
            raise self.fail(None, f"unknown key(s) {unknown}; allowed: {', '.join(allowed)}",
                            fix or "remove or rename them (a typo?)")

    # -- scalars -------------------------------------------------------------------------------
    def req(self, name: str, kind: type, **rules: Any) -> Any:
        """Field ``name``, which must be present and not null, checked against ``kind`` and ``rules``."""
        value = self.data.get(name, _MISSING)
        if value is _MISSING or value is None:
            raise self.fail(name, "is missing" if value is _MISSING else "is null",
                            rules.get("fix") or f"add {name!r}: {_KIND_NAMES.get(kind, kind.__name__)}")
        return self.check(value, kind, field_path(self.path, name), **rules)

    def opt(self, name: str, kind: type, default: Any = None, **rules: Any) -> Any:
        """Field ``name`` checked like :meth:`req`, or ``default`` when absent or null."""
        value = self.data.get(name)
        if value is None:
            return default
        return self.check(value, kind, field_path(self.path, name), **rules)

    def check(self, value: Any, kind: type, field: str, *, lo: Any = None, hi: Any = None, gt: Any = None,
              choices: Optional[Sequence[Any]] = None, nonempty: bool = False, finite: bool = True,
              fix: str = "") -> Any:
        """``value`` (found at ``field``) checked against ``kind`` and the range rules."""
        def bad() -> FileFormatError:
            desc = _describe(kind, lo, hi, gt, choices, nonempty, finite)
            return self._fail(field, f"must be {desc}, got {_show(value)}", fix or _default_fix(kind, desc))

        if kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad()
            low = INT64_MIN if lo is None else max(lo, INT64_MIN)
            high = INT64_MAX if hi is None else min(hi, INT64_MAX)
            if value < low or value > high or (gt is not None and value <= gt):
                raise bad()
        elif kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad()
            try:
                value = float(value)
            except OverflowError:
                raise bad() from None
            if math.isnan(value) or (finite and math.isinf(value)):
                raise bad()
            if (lo is not None and value < lo) or (hi is not None and value > hi) or (gt is not None and value <= gt):
                raise bad()
        elif kind is str:
            if not isinstance(value, str) or (nonempty and not value):
                raise bad()
        elif kind is bool:
            if not isinstance(value, bool):
                raise bad()
        elif kind is list:
            if not isinstance(value, list) or (nonempty and not value):
                raise bad()
            return value
        elif kind is dict:
            if not isinstance(value, dict) or (nonempty and not value):
                raise bad()
            return value
        else:  # pragma: no cover - a programming error, not a file problem
            raise TypeError(f"Fields: unsupported kind {kind!r}")
        if choices is not None and value not in choices:
            raise bad()
        return value

    def build(self, name: Any, fn: Callable[[Any], Any], *, required: bool = True, default: Any = None,
              fix: str = "") -> Any:
        """``fn(value of field name)``; a ``KeyError``/``TypeError``/``ValueError``/... that ``fn``
        raises on a malformed value becomes this reader's error naming the field (``name``: ``None``
        for this object itself). A :class:`FileFormatError` from ``fn`` of this reader's error type
        passes through; one of another type (a nested record's ``from_dict`` reading a dict) becomes
        this reader's error, its message kept."""
        if name is None:
            value = self.data
        else:
            value = self.data.get(name)
            if value is None:
                if required:
                    raise self.fail(name, "is missing" if name not in self.data else "is null",
                                    fix or f"add {name!r}")
                return default
        try:
            return fn(value)
        except FileFormatError as e:
            if isinstance(e, self.error):
                raise
            raise self.fail(name, f"is malformed: {e}", fix or "restore the file or write it again") from None
        except KeyError as e:
            raise self.fail(name, f"is malformed: key {e} is missing", fix or "restore the file or write it again"
                            ) from None
        except (TypeError, ValueError, AttributeError, IndexError, OverflowError, ArithmeticError) as e:
            raise self.fail(name, f"is malformed: {type(e).__name__}: {e}",
                            fix or "restore the file or write it again") from None

    # -- nested --------------------------------------------------------------------------------
    def obj(self, name: str, required: bool = True) -> Optional["Fields"]:
        """Field ``name`` as a nested object's reader (``None`` when optional and absent)."""
        value = self.data.get(name)
        if value is None:
            if required:
                raise self.fail(name, "is missing" if name not in self.data else "is null",
                                f"add {name!r}: an object")
            return None
        return self.child(value, name)

    def objs(self, name: str, required: bool = True, nonempty: bool = False) -> List["Fields"]:
        """Field ``name``, a list of objects, as one reader per element (``name[i]``)."""
        value = self.req(name, list, nonempty=nonempty) if required else self.opt(name, list, [], nonempty=nonempty)
        base = field_path(self.path, name)
        return [Fields(v, file=self.file, what=self.what, path=field_path(base, i), error=self.error)
                for i, v in enumerate(value)]

    def mapping(self, name: str, required: bool = True) -> List[Tuple[str, "Fields"]]:
        """Field ``name``, an object of objects, as ``(key, reader)`` pairs in file order."""
        value = self.req(name, dict) if required else self.opt(name, dict, {})
        base = field_path(self.path, name)
        out = []
        for key, v in value.items():
            if not isinstance(key, str):
                raise self._fail(field_path(base, key), f"key must be a string, got {_show(key)}", "quote the key")
            out.append((key, Fields(v, file=self.file, what=self.what, path=field_path(base, key), error=self.error)))
        return out

    def values(self, name: str, kind: type, required: bool = True, nonempty: bool = False,
               length: Optional[int] = None, **rules: Any) -> Optional[List[Any]]:
        """Field ``name``, a list whose elements are each checked against ``kind`` and ``rules``
        (``length``: the exact number of elements); ``None`` when optional and absent."""
        value = self.req(name, list, nonempty=nonempty) if required else self.opt(name, list, None, nonempty=nonempty)
        if value is None:
            return None
        base = field_path(self.path, name)
        if length is not None and len(value) != length:
            raise self._fail(base, f"must have {length} element(s), got {len(value)}", rules.get("fix", ""))
        return [self.check(v, kind, field_path(base, i), **rules) for i, v in enumerate(value)]


def _describe(kind: type, lo: Any, hi: Any, gt: Any, choices: Optional[Sequence[Any]], nonempty: bool,
              finite: bool) -> str:
    if choices is not None:
        return f"one of {list(choices)}"
    if kind is int:
        low = gt + 1 if gt is not None else (INT64_MIN if lo is None else lo)
        high = INT64_MAX if hi is None else hi
        return f"an integer in {low}..{high}"
    if kind is float:
        parts = ["a finite number" if finite else "a number"]
        if gt is not None:
            parts.append(f"> {gt:g}")
        elif lo is not None:
            parts.append(f">= {lo:g}")
        if hi is not None:
            parts.append(f"<= {hi:g}")
        return " ".join(parts)
    if kind in (str, list, dict) and nonempty:
        return {str: "a non-empty string", list: "a non-empty list", dict: "a non-empty object"}[kind]
    return _KIND_NAMES.get(kind, kind.__name__)


def _default_fix(kind: type, desc: str) -> str:
    if kind is int:
        return "write a whole number in that range (no quotes, no decimal point)"
    if kind is float:
        return "write a plain number in that range (no quotes, no NaN/Infinity)"
    return f"write {desc} there"


# ----------------------------------------------------------------------------------------------
# records
# ----------------------------------------------------------------------------------------------


def record_reader(record: type, data: Any, error: Type[FileFormatError] = FileFormatError) -> Fields:
    """The reader a ``record``'s ``from_dict`` reads ``data`` with: ``data`` itself when it is a
    :class:`Fields` (a file's loader hands over its reader, so errors name the file and the field
    path), else a reader of the dict whose errors name the record (``StepRecord: measured_s: ...``)."""
    if isinstance(data, Fields):
        return data
    return Fields(data, what=record.__name__, error=error)


def read_attrs(record: type, data: Any, *, kinds: Optional[Dict[str, type]] = None, ignore_unknown: bool = False,
               error: Type[FileFormatError] = FileFormatError, **read: Callable[[Fields], Any]) -> Any:
    """One attrs ``record`` from ``data`` (a dict or a :class:`Fields` reader, as :func:`record_reader`).

    Keys that are not the record's fields are refused (``ignore_unknown``: skipped, for records
    whose older files carry more); a field without a default must be present (null is passed on
    to the record: its validators say whether it may be), one with a default may be absent or
    null; ``kinds[name]`` checks a present value's type (:meth:`Fields.req`; ``float`` takes an int
    and gives a float); ``read[name](reader)`` builds a field from the reader (nested records).
    The record's own validators run last, and whatever they refuse is a
    :class:`FileFormatError` naming the record (or the file) and the object's path."""
    f = record_reader(record, data, error)
    fields = [a for a in attrs.fields(record) if a.init]
    names = [a.name for a in fields]
    if not ignore_unknown:
        f.only(names)
    values: Dict[str, Any] = {}
    for a in fields:
        has_default = a.default is not attrs.NOTHING
        if a.name in read:
            value = read[a.name](f)
        elif a.name not in f.data:
            if not has_default:
                raise f.fail(a.name, "is missing", f"add {a.name!r}")
            continue
        elif f.data[a.name] is None and has_default:
            continue
        elif kinds and a.name in kinds and f.data[a.name] is not None:
            value = f.req(a.name, kinds[a.name])
        else:
            value = f.data[a.name]
        values[a.alias if getattr(a, "alias", None) else a.name.lstrip("_")] = value
    return f.build(None, lambda _d: record(**values))


# ----------------------------------------------------------------------------------------------
# canonical JSON digests
# ----------------------------------------------------------------------------------------------


def canonical_form(obj: Any) -> Any:
    """``obj`` as plain JSON values that do not depend on dict or set order: mappings by key
    (keys as strings), sets sorted, tuples as lists, non-finite floats as their ``repr``, enums as
    ``Type.NAME``, and named tuples, dataclasses, attrs classes and other objects as their fields
    (public, non-callable attributes) under ``"__type__"``; an object with no readable state is
    its type's full name."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, enum.Enum):
        return f"{type(obj).__qualname__}.{obj.name}"
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if isinstance(obj, Mapping):
        return {str(k): canonical_form(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (frozenset, set)):
        return sorted((canonical_form(v) for v in obj), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(obj, tuple) and hasattr(obj, "_asdict"):
        return {"__type__": type(obj).__qualname__, **canonical_form(obj._asdict())}
    if isinstance(obj, (list, tuple)):
        return [canonical_form(v) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: canonical_form(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {"__type__": type(obj).__qualname__, **fields}
    attributes = getattr(type(obj), "__attrs_attrs__", None)  # an attrs class (attrs.has)
    if attributes is not None:
        return {"__type__": type(obj).__qualname__,
                **canonical_form({a.name: getattr(obj, a.name) for a in attributes})}
    if hasattr(obj, "__dict__"):
        public = {k: v for k, v in vars(obj).items() if not callable(v)}
        return {"__type__": type(obj).__qualname__, **canonical_form(public)}
    return {"__type__": f"{type(obj).__module__}.{type(obj).__qualname__}"}


def canonical_digest(obj: Any, *, chars: int = 64, spaced: bool = False) -> str:
    """sha256 hex of the canonical JSON of ``obj`` (:func:`canonical_form`, keys sorted): equal
    inputs give equal digests in any process. ``chars``: the digest's first characters (short
    keys in file names). ``spaced``: the JSON has ``json.dumps``'s default separators
    (``", "``, ``": "``) instead of none, the text the machine fingerprint
    (``calibration.store.MachineFingerprint.digest``) and the measured guard's cache keys hash,
    so profiles and guard results stored under those keys keep being found."""
    separators = (", ", ": ") if spaced else (",", ":")
    text = json.dumps(canonical_form(obj), sort_keys=True, separators=separators)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:chars]
