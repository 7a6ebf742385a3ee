"""Table files: the one loader of ``{name, rows, dim, features?, pooling_factor?, sharding_types?,
compute_kernels?, min_partition?}`` lists (JSON, or YAML with PyYAML), as a list or as
``{"tables": [...]}``.

``sparselift plan --tables FILE`` and the DLRM example's ``--table-file`` both read table files
with :func:`load_table_file`, so every file one accepts the other accepts (``tests/test_table_files.py``
runs every file under ``examples/tables/`` through both). Problems raise ``ValueError`` naming the
file, the entry and the key to change; callers turn it into their own usage error.

Importing this module needs only ``attrs`` (no torch): a launcher can validate a table file
cheaply. :meth:`TableEntry.constraints` imports TorchRec when called.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional, Sequence, Tuple

import attrs

from torchrec_sparselift.vocabulary import COMPUTE_KERNELS, SHARDING_TYPES

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


def _positive_int(where: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _choice_list(where: str, key: str, value: Any, choices: Sequence[str]) -> Tuple[str, ...]:
    vals = [value] if isinstance(value, str) else value
    if not isinstance(vals, list) or not vals or not all(isinstance(v, str) for v in vals):
        raise ValueError(f"{where}: {key} must be a non-empty list of names from {list(choices)}, got {value!r}")
    bad = [v for v in vals if v not in choices]
    if bad:
        raise ValueError(f"{where}: unknown {key} {bad}; choose from {list(choices)}")
    return tuple(vals)


def _entry(i: int, raw: Any, where: str, constraint_only: bool) -> TableEntry:
    allowed = CONSTRAINT_KEYS if constraint_only else TABLE_KEYS
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: entry {i} must be an object with keys {list(allowed)}, got {raw!r}")
    name = raw.get("name")
    at = f"{where}: entry {i}" + (f" ({name!r})" if isinstance(name, str) else "")
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise ValueError(f"{at}: unknown key(s) {unknown}; allowed: {', '.join(allowed)}")
    required = ("name",) if constraint_only else ("name", "rows", "dim")
    missing = [k for k in required if k not in raw]
    if missing:
        raise ValueError(f"{at}: missing {', '.join(missing)}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{at}: name must be a non-empty string, got {name!r}")
    rows = 0 if constraint_only else _positive_int(at, "rows", raw["rows"])
    dim = 0 if constraint_only else _positive_int(at, "dim", raw["dim"])
    features = raw.get("features", [name])
    features = [features] if isinstance(features, str) else features
    if not isinstance(features, list) or not features or not all(isinstance(f, str) and f for f in features):
        raise ValueError(f"{at}: features must be a non-empty list of names, got {raw.get('features')!r}")
    pf = raw.get("pooling_factor")
    pooling: Optional[Tuple[float, ...]] = None
    if pf is not None:
        vals = pf if isinstance(pf, list) else [pf] * len(features)
        if len(vals) != len(features) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in vals
        ):
            raise ValueError(
                f"{at}: pooling_factor must be a positive number (ids per sample, for each feature) or a "
                f"list with one per feature ({len(features)}), got {pf!r}"
            )
        pooling = tuple(float(v) for v in vals)
    st = raw.get("sharding_types")
    ck = raw.get("compute_kernels")
    mp = raw.get("min_partition")
    return TableEntry(
        name=name, rows=rows, dim=dim, features=tuple(features), pooling_factor=pooling,
        sharding_types=None if st is None else _choice_list(at, "sharding_types", st, SHARDING_TYPES),
        compute_kernels=None if ck is None else _choice_list(at, "compute_kernels", ck, COMPUTE_KERNELS),
        min_partition=None if mp is None else _positive_int(at, "min_partition", mp),
    )


def parse_table_entries(data: Any, where: str, constraint_only: bool = False) -> Tuple[TableEntry, ...]:
    """Validate parsed table-file data: a list of table objects, or ``{"tables": [...]}``.

    Raises ``ValueError`` naming the file, the entry and the key that is wrong, and on
    duplicate table names or a feature used by two tables.
    """
    if isinstance(data, dict) and "tables" in data:
        extra = sorted(set(data) - {"tables"})
        if extra:
            raise ValueError(f"{where}: unknown top-level key(s) {extra}; the file holds {{\"tables\": [...]}}")
        data = data["tables"]
    if not isinstance(data, list) or not data:
        raise ValueError(f"{where}: expected a non-empty list of tables (or {{\"tables\": [...]}}), "
                       f"got {type(data).__name__}")
    entries = tuple(_entry(i, e, where, constraint_only) for i, e in enumerate(data))
    names: Dict[str, int] = {}
    features: Dict[str, str] = {}
    for i, e in enumerate(entries):
        if e.name in names:
            raise ValueError(f"{where}: table {e.name!r} appears twice (entries {names[e.name]} and {i})")
        names[e.name] = i
        if not constraint_only:
            for f in e.features:
                if f in features:
                    raise ValueError(f"{where}: feature {f!r} is used by tables {features[f]!r} and "
                                   f"{e.name!r}; each feature looks up one table")
                features[f] = e.name
    return entries


def read_structured(path: str) -> Any:
    """The parsed content of a JSON or (``.yaml``/``.yml``, with PyYAML) YAML file."""
    if not os.path.isfile(path):
        raise ValueError(f"file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError:
            raise ValueError(f"{path}: reading YAML needs PyYAML (pip install pyyaml); or use a .json file") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None


def load_table_file(path: str, constraint_only: bool = False) -> Tuple[TableEntry, ...]:
    """Tables (or, with ``constraint_only``, per-table constraints) from a JSON or YAML file."""
    return parse_table_entries(read_structured(path), path, constraint_only)
