"""Embedding table sets for the DLRM model library: MLPerf DLRM-DCNv2 and Criteo Kaggle presets, or a file.

Importing this module needs only ``attrs`` and the repository's table-file loader (no torch), so a
launcher can validate arguments cheaply.

Vocabulary: a *table* holds ``rows`` x ``dim`` weights; each of its *features* (a KJT key) looks up
a bag of ``pooling_factor`` ids per sample in it. The presets give one feature per table, named
``cat_0`` .. ``cat_25`` like TorchRec's Criteo datasets, so the same tables serve synthetic and
Criteo ``.npy`` data.
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Tuple

import attrs

from torchrec_sparselift.errors import FileFormatError
from torchrec_sparselift.files import Fields, load_json
from torchrec_sparselift.semantics.table_file import TableEntry
from torchrec_sparselift.semantics.table_file import load_table_file as _load_table_file

__all__ = [
    "TableSpec",
    "TableSetError",
    "DCNV2_ROWS",
    "DCNV2_MULTI_HOT",
    "KAGGLE_ROWS",
    "MIN_SCALED_ROWS",
    "preset_tables",
    "scale_tables",
    "load_table_file",
    "check_uniform_dim",
    "feature_names",
    "ConstraintSpec",
    "load_constraints_file",
]

# MLPerf DLRM-DCNv2 on Criteo 1TB multi-hot (DESIGN.md section 3).
DCNV2_ROWS: Tuple[int, ...] = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)  # fmt: skip
DCNV2_MULTI_HOT: Tuple[int, ...] = (
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
)  # fmt: skip
DCNV2_DIM = 128
# Criteo Kaggle (Display Advertising Challenge), one-hot.
KAGGLE_ROWS: Tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
    14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
KAGGLE_DIM = 64

# --scale never shrinks a table below this many rows (tables already smaller keep their size).
MIN_SCALED_ROWS = 100


class TableSetError(ValueError):
    """A table set (preset, scale or file) that cannot be used; the message says what to change."""


#: One embedding table: ``rows`` x ``dim`` weights, looked up by ``features``, each with a bag of
#: ``pooling_factor`` ids per sample (``bag_sizes()``: those as fixed whole bag sizes). The value
#: the repository's table-file loader returns (:mod:`torchrec_sparselift.semantics.table_file`),
#: so a table file means the same here as in ``sparselift plan --tables``.
TableSpec = TableEntry


def preset_tables(preset: str, embedding_dim: Optional[int] = None) -> List[TableSpec]:
    """The 26 tables of ``preset`` ("dcnv2" or "kaggle") at full size, features ``cat_0..cat_25``.

    ``embedding_dim`` overrides the preset's dim (dcnv2: 128, kaggle: 64)."""
    if preset == "dcnv2":
        rows, bags, dim = DCNV2_ROWS, DCNV2_MULTI_HOT, DCNV2_DIM
    elif preset == "kaggle":
        rows, bags, dim = KAGGLE_ROWS, (1,) * len(KAGGLE_ROWS), KAGGLE_DIM
    else:
        raise TableSetError(f"unknown table preset {preset!r}: use 'dcnv2', 'kaggle' or a --table-file")
    dim = embedding_dim if embedding_dim is not None else dim
    return [
        TableSpec(name=f"t_cat_{i}", rows=r, dim=dim, features=(f"cat_{i}",), pooling_factor=(float(b),))
        for i, (r, b) in enumerate(zip(rows, bags))
    ]


def scale_tables(tables: Sequence[TableSpec], scale: float, min_rows: int = MIN_SCALED_ROWS) -> List[TableSpec]:
    """Tables with ``rows`` multiplied by ``scale`` (rounded up), never below ``min_rows`` unless the
    table was already smaller. ``scale`` must lie in (0, 1]; 1 returns the tables unchanged."""
    if not (isinstance(scale, (int, float)) and 0.0 < scale <= 1.0):
        raise TableSetError(f"--scale must be in (0, 1], got {scale!r} (e.g. 0.001 for a laptop)")
    return [
        attrs.evolve(t, rows=max(min(t.rows, min_rows), math.ceil(t.rows * scale))) for t in tables
    ]


def check_uniform_dim(tables: Sequence[TableSpec]) -> int:
    """The single embedding dim shared by ``tables`` (TorchRec's DLRM models require one)."""
    dims = sorted({t.dim for t in tables})
    if len(dims) != 1:
        by_dim = {d: [t.name for t in tables if t.dim == d][:3] for d in dims}
        raise TableSetError(
            f"DLRM needs one embedding dim for all tables, found {dims} (e.g. {by_dim}); "
            "set the same dim everywhere or pass --embedding-dim to override"
        )
    return dims[0]


def load_table_file(path: str) -> List[TableSpec]:
    """Tables from a table file (JSON, or YAML with PyYAML), read by the repository's one
    table-file loader (:func:`torchrec_sparselift.semantics.table_file.load_table_file`): the
    same keys as ``sparselift plan --tables`` (``name, rows, dim, features?, pooling_factor?``
    (one number, or one per feature), ``sharding_types?, compute_kernels?, min_partition?``).

    Raises TableSetError naming the file, entry and key when something is wrong."""
    try:
        return list(_load_table_file(path))
    except ValueError as e:
        raise TableSetError(str(e)) from None


def feature_names(tables: Sequence[TableSpec]) -> List[str]:
    """All features of ``tables`` in table order (the KJT key order the example uses)."""
    return [f for t in tables for f in t.features]


@attrs.frozen
class ConstraintSpec:
    """What ``--constraints`` forces on one table (None: the planner chooses). Values are checked
    against TorchRec's enums where the run starts (this module does not import torch)."""

    table: str
    sharding_types: Optional[Tuple[str, ...]] = None
    compute_kernels: Optional[Tuple[str, ...]] = None
    min_partition: Optional[int] = None


_CONSTRAINT_KEYS = ("sharding_types", "compute_kernels", "min_partition")


def _string_list(entry: Any, key: str) -> Optional[Tuple[str, ...]]:
    """Field ``key`` of a constraints entry: a non-empty list of strings (one string: a one-item
    list); None when absent."""
    if key not in entry.data:
        return None
    value = entry.data[key]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise entry.fail(key, f"must be a non-empty list of strings, got {value!r}",
                         'a list of names, e.g. ["row_wise"] or ["fused"]')
    return tuple(value)


def load_constraints_file(path: str, tables: Sequence[TableSpec]) -> List[ConstraintSpec]:
    """Per-table planner constraints from a JSON object ``{table name: {sharding_types?,
    compute_kernels?, min_partition?}}`` (a string is taken as a one-item list).

    Read by the repository's strict loader (:mod:`torchrec_sparselift.files`: a duplicate key is
    refused). Raises TableSetError naming the file, the table and the key when the file is missing
    or malformed, a key is unknown, or a table is not one of ``tables``."""
    try:
        data = load_json(path, "constraints file", top=dict)
        top = Fields(data, file=path, what="constraints file")
        names = {t.name for t in tables}
        specs = []
        for name, value in top.data.items():
            if name not in names:
                known = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
                raise top.fail(name, f"table {name!r} is not one of the run's tables ({known})",
                               "use a table name of --tables/--preset")
            entry = top.child(value, name)
            entry.only(_CONSTRAINT_KEYS)
            specs.append(ConstraintSpec(
                table=name,
                sharding_types=_string_list(entry, "sharding_types"),
                compute_kernels=_string_list(entry, "compute_kernels"),
                min_partition=entry.opt("min_partition", int, lo=1,
                                        fix="min_partition must be a positive integer (or leave it out)"),
            ))
        return specs
    except FileFormatError as e:
        raise TableSetError(str(e)) from None
