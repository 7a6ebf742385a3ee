"""Table files: the one loader of ``{name, rows, dim, features?, pooling_factor?, sharding_types?,
compute_kernels?, min_partition?}`` lists (JSON, or YAML with PyYAML), as a list or as
``{"tables": [...]}``.

``sparselift plan --tables FILE`` and the DLRM example's ``--table-file`` both read table files
with :func:`load_table_file`, so every file one accepts the other accepts (``tests/test_table_files.py``
runs every file under ``examples/tables/`` through both). Files are read by the strict loader
(:mod:`torchrec_sparselift.files`: not UTF-8, invalid JSON/YAML, duplicate keys); problems raise
:class:`~torchrec_sparselift.errors.FileFormatError` (a ``ValueError``) on one line naming the
file, the field path (``tables[3].rows``) and the fix; callers turn it into their own usage error.

Importing this module needs only ``attrs`` (no torch): a launcher can validate a table file
cheaply. :meth:`TableEntry.constraints` imports TorchRec when called.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple

import attrs

from torchrec_sparselift.vocabulary import COMPUTE_KERNELS, SHARDING_TYPES
from torchrec_sparselift.files import Fields, field_path, load_structured

__all__ = [
    "SHARDING_TYPES",
    "COMPUTE_KERNELS",
    "TABLE_KEYS",
    "CONSTRAINT_KEYS",
    "TableEntry",
    "parse_table_entries",
    "read_structured",
    "load_table_file",
]

TABLE_KEYS = ("name", "rows", "dim", "features", "pooling_factor", "sharding_types",
              "compute_kernels", "min_partition")
CONSTRAINT_KEYS = ("name", "pooling_factor", "sharding_types", "compute_kernels", "min_partition")
_INT64_MAX = 2**63 - 1


def _str_tuple(value: Any) -> Tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@attrs.frozen
class TableEntry:
    """One table of a table file: shape, features, pooling and optional constraints.

    ``pooling_factor`` holds one value per feature (ids per sample looked up by that feature).
    ``sharding_types``/``compute_kernels``/``min_partition`` become TorchRec
    ``ParameterConstraints`` when given. For constraint-only entries (``--constraints``) rows and
    dim are 0.
    """

    name: str
    rows: int
    dim: int
    features: Tuple[str, ...] = attrs.field(converter=_str_tuple)
    pooling_factor: Optional[Tuple[float, ...]] = None
    sharding_types: Optional[Tuple[str, ...]] = None
    compute_kernels: Optional[Tuple[str, ...]] = None
    min_partition: Optional[int] = None

    def constraints(self, pooling: Optional[Sequence[float]] = None) -> Any:
        from torchrec.distributed.planner.types import ParameterConstraints

        kw: Dict[str, Any] = {}
        pf = self.pooling_factor or (tuple(pooling) if pooling else None)
        if pf:
            kw["pooling_factors"] = [float(x) for x in pf]
        if self.sharding_types:
            kw["sharding_types"] = list(self.sharding_types)
        if self.compute_kernels:
            kw["compute_kernels"] = list(self.compute_kernels)
        if self.min_partition:
            kw["min_partition"] = int(self.min_partition)
        return ParameterConstraints(**kw)

    def pooling(self, default: float = 1.0) -> Tuple[float, ...]:
        """Ids per sample for each feature (``default`` for each when the file gives none)."""
        return self.pooling_factor if self.pooling_factor else (float(default),) * len(self.features)

    def bag_sizes(self, default: float = 1.0) -> Tuple[int, ...]:
        """:meth:`pooling` as whole bag sizes (rounded, at least 1): a fixed-size multi-hot bag
        per feature, as synthetic data and MLPerf-style inputs use."""
        return tuple(max(1, int(round(p))) for p in self.pooling(default))

    def to_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"name": self.name}
        if self.rows:
            d.update(rows=self.rows, dim=self.dim, features=list(self.features))
        for k in ("pooling_factor", "sharding_types", "compute_kernels"):
            v = getattr(self, k)
            if v is not None:
                d[k] = list(v)
        if self.min_partition is not None:
            d["min_partition"] = self.min_partition
        return d


def _count(f: Any, key: str, value: Any) -> int:
    """A positive int64 (rows, dim, min_partition), refused with the key, the value and the fix."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _INT64_MAX:
        got = f"{value!r}"[:40]
        raise f.fail(key, f"{key} must be a positive integer (1..{_INT64_MAX}, the int64 range), got {got} "
                          f"({type(value).__name__})", "write a whole number without quotes or a decimal point")
    return value


def _choice_list(f: Any, key: str, value: Any, choices: Sequence[str]) -> Tuple[str, ...]:
    vals = [value] if isinstance(value, str) else value
    if not isinstance(vals, list) or not vals or not all(isinstance(v, str) for v in vals):
        raise f.fail(key, f"{key} must be a non-empty list of names from {list(choices)}, got {value!r}"[:300],
                     f'write e.g. "{key}": ["{choices[0]}"]')
    bad = [v for v in vals if v not in choices]
    if bad:
        raise f.fail(key, f"unknown {key} {bad}; choose from {list(choices)}", "correct the spelling")
    return tuple(vals)


def _entry(f: Any, constraint_only: bool) -> TableEntry:
    allowed = CONSTRAINT_KEYS if constraint_only else TABLE_KEYS
    f.only(allowed)
    raw = f.data
    required = ("name",) if constraint_only else ("name", "rows", "dim")
    missing = [k for k in required if k not in raw]
    if missing:
        raise f.fail(None, f"missing {', '.join(missing)}", f"add {', '.join(repr(k) for k in missing)}")
    name = raw["name"]
    if not isinstance(name, str) or not name:
        raise f.fail("name", f"name must be a non-empty string, got {name!r}"[:200], 'write e.g. "name": "t0"')
    if "." in name:
        raise f.fail("name", f"table name {name!r} contains '.', which torch reserves for module paths "
                             "(TorchRec fails with a KeyError on such a table)",
                     f"rename the table, e.g. {name.replace('.', '_')!r}")
    rows = 0 if constraint_only else _count(f, "rows", raw["rows"])
    dim = 0 if constraint_only else _count(f, "dim", raw["dim"])
    features = raw.get("features", [name])
    features = [features] if isinstance(features, str) else features
    if not isinstance(features, list) or not features or not all(isinstance(x, str) and x for x in features):
        raise f.fail("features", f"features must be a non-empty list of names, got {raw.get('features')!r}"[:300],
                     f'write e.g. "features": ["{name}"]')
    pf = raw.get("pooling_factor")
    pooling: Optional[Tuple[float, ...]] = None
    if pf is not None:
        vals = pf if isinstance(pf, list) else [pf] * len(features)
        if len(vals) != len(features) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and _finite_positive(v) for v in vals
        ):
            raise f.fail(
                "pooling_factor",
                f"pooling_factor must be a finite positive number (ids per sample, for each feature) or a "
                f"list with one per feature ({len(features)}), got {pf!r}"[:300],
                "write e.g. 2.5, or one number per feature",
            )
        pooling = tuple(float(v) for v in vals)
    st = raw.get("sharding_types")
    ck = raw.get("compute_kernels")
    mp = raw.get("min_partition")
    return TableEntry(
        name=name, rows=rows, dim=dim, features=tuple(features), pooling_factor=pooling,
        sharding_types=None if st is None else _choice_list(f, "sharding_types", st, SHARDING_TYPES),
        compute_kernels=None if ck is None else _choice_list(f, "compute_kernels", ck, COMPUTE_KERNELS),
        min_partition=None if mp is None else _count(f, "min_partition", mp),
    )


def _finite_positive(v: Any) -> bool:
    try:
        return math.isfinite(float(v)) and v > 0
    except OverflowError:
        return False


def parse_table_entries(data: Any, where: Optional[str], constraint_only: bool = False,
                        what: str = "", base: str = "") -> Tuple[TableEntry, ...]:
    """Validate parsed table-file data: a list of table objects, or ``{"tables": [...]}``.

    Raises :class:`~torchrec_sparselift.errors.FileFormatError` (a ``ValueError``) naming
    ``what where`` (the file), the field path (``tables[3].rows``) and the fix: for a wrong key
    or value, a table name with a dot, rows or dims beyond int64, duplicate table names, or a
    feature used by two tables. ``base``: the field path of ``data`` inside its file, when the
    tables are one field of a larger document (``planner_info.inputs.tables``).
    """
    top = Fields({}, file=where, what=what, path=base)  # reports problems of the file as a whole
    if isinstance(data, dict) and "tables" in data:
        top = Fields(data, file=where, what=what, path=base)
        extra = sorted(str(k) for k in data if k != "tables")
        if extra:
            raise top.fail(None, f"unknown top-level key(s) {extra}; the file holds {{\"tables\": [...]}}",
                           "remove them")
        data = data["tables"]
        base = field_path(base, "tables")
    if not isinstance(data, list) or not data:
        raise top.fail(None, f"expected a non-empty list of tables (or {{\"tables\": [...]}}), got "
                             f"{type(data).__name__}", "list at least one table")
    items = [Fields(e, file=where, what=what, path=field_path(base, i)) for i, e in enumerate(data)]
    entries = tuple(_entry(f, constraint_only) for f in items)
    names: Dict[str, int] = {}
    features: Dict[str, str] = {}
    for i, e in enumerate(entries):
        if e.name in names:
            raise items[i].fail("name", f"table {e.name!r} appears twice (entries {names[e.name]} and {i})",
                                "give each table its own name")
        names[e.name] = i
        if not constraint_only:
            for x in e.features:
                if x in features:
                    raise items[i].fail("features", f"feature {x!r} is used by tables {features[x]!r} and "
                                                    f"{e.name!r}; each feature looks up one table",
                                        "rename one of the features")
                features[x] = e.name
    return entries


def read_structured(path: str, what: str = "file") -> Any:
    """The parsed content of a JSON or (``.yaml``/``.yml``, with PyYAML) YAML file, read by the
    strict loader (:func:`torchrec_sparselift.files.load_structured`)."""
    return load_structured(path, what=what)


def load_table_file(path: str, constraint_only: bool = False) -> Tuple[TableEntry, ...]:
    """Tables (or, with ``constraint_only``, per-table constraints) from a JSON or YAML file."""
    what = "constraints file" if constraint_only else "table file"
    return parse_table_entries(read_structured(path, what), path, constraint_only, what)
