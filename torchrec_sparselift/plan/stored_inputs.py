"""Stored planning inputs: what ``sparselift plan``/``compare`` planned from, as one JSON-able
value that travels in the plan (``planner_info["inputs"]``), so ``sparselift explain`` can rebuild
the module, constraints and topology and re-price the plan without re-planning.

- :class:`TopologySpec`: a topology as the user names it (hardware preset or calibrated profile
  JSON, world size, optional per-host ranks and memory sizes), resolved to a TorchRec
  ``Topology`` and a hardware profile.
- :class:`PlanInputs`: exactly one input (a table file's entries, a reference workload, or a
  ``module:factory`` model) with per-table constraints, batch size, planner options and the
  topology; :meth:`PlanInputs.to_dict`/:meth:`PlanInputs.from_dict` are the stored form
  (schema :data:`INPUTS_SCHEMA`), :meth:`PlanInputs.build` the module and constraints.

Problems are :class:`~torchrec_sparselift.errors.CliError` (the user's input; exit code 2 in the
command line), each naming the flag or file to change. TorchRec is imported only when a topology
or module is built.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import attrs

from torchrec_sparselift import defaults
from torchrec_sparselift.errors import CliError
from torchrec_sparselift.semantics import table_file
from torchrec_sparselift.semantics.table_file import TableEntry
from torchrec_sparselift.cost.hardware import PRESETS, get_profile
from torchrec_sparselift.errors import FileFormatError
from torchrec_sparselift.files import Fields
from torchrec_sparselift.semantics.reference_workloads import by_name

__all__ = [
    "INPUTS_SCHEMA",
    "DEFAULT_BATCH_SIZE",
    "TopologySpec",
    "PlanInputs",
    "parse_table_entries",
    "load_table_file",
    "reference_workload",
    "tables_module",
    "load_model",
]

DEFAULT_BATCH_SIZE = defaults.BATCH_SIZE
INPUTS_SCHEMA = "sparselift.cli_inputs/1"


def parse_table_entries(data: Any, where: Optional[str], constraint_only: bool = False, what: str = "",
                        base: str = "") -> Tuple[TableEntry, ...]:
    """:func:`torchrec_sparselift.semantics.table_file.parse_table_entries`, problems as :class:`CliError`."""
    try:
        return table_file.parse_table_entries(data, where, constraint_only, what, base)
    except ValueError as e:
        raise CliError(str(e)) from None


def load_table_file(path: str, constraint_only: bool = False) -> Tuple[TableEntry, ...]:
    """Tables (or, with ``constraint_only``, per-table constraints) from a JSON or YAML file, read
    by the one table-file loader (:mod:`torchrec_sparselift.semantics.table_file`)."""
    try:
        return table_file.load_table_file(path, constraint_only)
    except ValueError as e:
        raise CliError(str(e)) from None


@attrs.frozen
class TopologySpec:
    """A topology as the user names it: hardware preset (or calibrated profile JSON) and sizes.

    ``local_world_size``, ``hbm_gib`` and ``ddr_gib`` default to the profile's values. On CPU
    the rank's memory is host memory: ``hbm_gib`` (if given) is used as it.
    """

    hardware: str
    world_size: int
    local_world_size: Optional[int] = None
    hbm_gib: Optional[float] = None
    ddr_gib: Optional[float] = None

    def profile(self) -> Any:
        try:
            return get_profile(self.hardware)
        except (ValueError, OSError, KeyError, TypeError) as e:
            if self.hardware.endswith(".json") or os.path.sep in self.hardware:
                raise CliError(f"cannot load hardware profile {self.hardware!r}: {e}") from None
            raise CliError(
                f"unknown topology {self.hardware!r}; choose one of {', '.join(sorted(PRESETS))} "
                "or pass a calibrated profile .json (from `sparselift calibrate`)"
            ) from None

    def resolved(self) -> Tuple[str, int, int, int, int]:
        """(compute device, world size, ranks per host, device bytes, host bytes per rank)."""
        p = self.profile()
        if self.world_size < 1:
            raise CliError(f"--world-size must be >= 1, got {self.world_size}")
        local = self.local_world_size or min(p.local_world_size, self.world_size)
        if local < 1 or self.world_size % local:
            raise CliError(
                f"--world-size {self.world_size} is not a multiple of --local-world-size {local}; "
                "set --local-world-size to the ranks per host"
            )
        for flag, v in (("--hbm-gib", self.hbm_gib), ("--ddr-gib", self.ddr_gib)):
            if v is not None and not v > 0:
                raise CliError(f"{flag} must be positive, got {v}")
        gib = 2**30
        ddr = int(self.ddr_gib * gib) if self.ddr_gib else int(p.ddr_cap_bytes)
        if p.compute_device == "cpu":
            ddr = int(self.hbm_gib * gib) if self.hbm_gib else ddr
            return "cpu", self.world_size, local, 0, ddr
        hbm = int(self.hbm_gib * gib) if self.hbm_gib else int(p.hbm_cap_bytes)
        return p.compute_device, self.world_size, local, hbm, ddr

    def topology(self) -> Any:
        """A TorchRec ``Topology`` (TorchRec's default bandwidth constants; our profile prices)."""
        from torchrec.distributed.planner.types import Topology

        device, world, local, hbm, ddr = self.resolved()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if device == "cpu":
                return Topology(world_size=world, local_world_size=local, compute_device="cpu", ddr_cap=ddr)
            return Topology(world_size=world, local_world_size=local, compute_device=device,
                            hbm_cap=hbm, ddr_cap=ddr)

    def describe(self) -> str:
        device, world, local, hbm, ddr = self.resolved()
        mem = f"{ddr / 2**30:.0f} GiB/rank" if device == "cpu" else f"{hbm / 2**30:.0f} GiB HBM/rank"
        return f"{self.hardware}: {world} {device} rank(s), {local} per host, {mem}"


@attrs.frozen
class PlanInputs:
    """Everything ``plan``/``compare`` planned from, as JSON-able values.

    Exactly one of ``tables`` (from a table file), ``workload`` (a reference workload name) or
    ``model`` (``module:factory``) is set. ``constraints`` override per-table constraints.
    """

    topology: TopologySpec
    tables: Optional[Tuple[TableEntry, ...]] = None
    workload: Optional[str] = None
    model: Optional[str] = None
    constraints: Tuple[TableEntry, ...] = ()
    batch_size: Optional[int] = None
    global_batch_size: Optional[int] = None
    allow_lossy_comm: bool = False
    allow_staleness: bool = False
    time_budget_s: float = defaults.TIME_BUDGET_S
    source: str = ""
    #: 2D sparse parallelism: None (1D), "auto" or a group size; the sync-interval bound; layout
    sharding_group_size: Union[None, int, str] = None
    max_sync_interval: Optional[int] = None
    layout_2d: str = defaults.LAYOUT_2D
    strategy_2d: str = defaults.STRATEGY_2D
    #: the sparse-path rewrites the planner may choose (None: every one; () none) and the
    #: dense model's per-sample declaration (the planner's ``rewrites=`` and ``per_sample=``)
    rewrites: Optional[Tuple[str, ...]] = attrs.field(default=None,
                                                      converter=lambda v: None if v is None else tuple(v))
    per_sample: bool = False

    def __attrs_post_init__(self) -> None:
        given = [x for x in (self.tables, self.workload, self.model) if x]
        if len(given) != 1:
            raise CliError("give exactly one input: --tables FILE, --workload NAME or --model MODULE:FACTORY")
        if self.batch_size is not None and self.batch_size < 1:
            raise CliError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise CliError(f"--global-batch-size must be >= 1, got {self.global_batch_size}")

    def per_rank_batch(self) -> int:
        if self.batch_size:
            return self.batch_size
        world = self.topology.world_size
        if self.global_batch_size:
            return max(1, self.global_batch_size // world)
        if self.workload:
            return reference_workload(self.workload).per_rank_batch(world)
        return DEFAULT_BATCH_SIZE

    def describe(self) -> str:
        if self.tables:
            return f"{len(self.tables)} tables from {self.source or 'a table file'}"
        if self.workload:
            return f"workload {self.workload}"
        return f"model {self.model}"

    def build(self) -> Tuple[Any, Dict[str, Any]]:
        """(module on the meta device or as the factory made it, constraints by table name)."""
        constraints: Dict[str, Any] = {}
        if self.tables:
            module = tables_module(self.tables)
            constraints = {e.name: e.constraints() for e in self.tables
                           if e.pooling_factor or e.sharding_types or e.compute_kernels or e.min_partition}
        elif self.workload:
            wl = reference_workload(self.workload)
            module = wl.module()
            constraints = dict(wl.constraints())
        else:
            module = load_model(self.model or "")
        for c in self.constraints:
            prev = constraints.get(c.name)
            pooling = getattr(prev, "pooling_factors", None) if prev is not None else None
            constraints[c.name] = c.constraints(pooling)
        return module, constraints

    def to_dict(self) -> Dict[str, Any]:
        return {
            "schema": INPUTS_SCHEMA,
            "topology": attrs.asdict(self.topology),
            "tables": None if self.tables is None else [e.to_dict() for e in self.tables],
            "workload": self.workload,
            "model": self.model,
            "constraints": [c.to_dict() for c in self.constraints],
            "batch_size": self.per_rank_batch(),
            "allow_lossy_comm": self.allow_lossy_comm,
            "allow_staleness": self.allow_staleness,
            "time_budget_s": self.time_budget_s,
            "source": self.source,
            "sharding_group_size": self.sharding_group_size,
            "max_sync_interval": self.max_sync_interval,
            "layout_2d": self.layout_2d,
            "strategy_2d": self.strategy_2d,
            "rewrites": None if self.rewrites is None else list(self.rewrites),
            "per_sample": self.per_sample,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], file: Optional[str] = None) -> "PlanInputs":
        """The inputs :meth:`to_dict` wrote (``file``: the plan they came from, named in errors).
        Any problem is a :class:`CliError` naming the field (``planner_info.inputs.batch_size``)."""
        if not isinstance(data, Mapping) or data.get("schema") != INPUTS_SCHEMA:
            where = "" if file is None else f"{file}: "
            raise CliError(f"{where}the plan's planner_info.inputs is not a {INPUTS_SCHEMA} record")
        try:
            f = Fields(dict(data), file=file, what="the plan's stored inputs", path="planner_info.inputs")
            t = f.obj("topology")
            t.only([a.name for a in attrs.fields(TopologySpec)])
            topology = TopologySpec(
                hardware=t.req("hardware", str, nonempty=True), world_size=t.req("world_size", int, lo=1),
                local_world_size=t.opt("local_world_size", int, lo=1), hbm_gib=t.opt("hbm_gib", float, gt=0),
                ddr_gib=t.opt("ddr_gib", float, gt=0))
            rewrites = f.data.get("rewrites")
            if rewrites is not None and not (isinstance(rewrites, list) and all(isinstance(n, str) for n in rewrites)):
                raise f.fail("rewrites", f"must be null (every rewrite) or a list of rewrite names, got {rewrites!r}",
                             "write null or a list such as [\"id_dtype\"]")
            group = f.data.get("sharding_group_size")
            if group is not None and group != "auto":
                f.check(group, int, "planner_info.inputs.sharding_group_size", lo=1,
                        fix="write null (1D), \"auto\" or a group size >= 1")
            return cls(
                topology=topology,
                tables=None if f.data.get("tables") is None else parse_table_entries(
                    f.data["tables"], file, what=f.what, base="planner_info.inputs.tables"),
                workload=f.opt("workload", str),
                model=f.opt("model", str),
                constraints=parse_table_entries(f.data["constraints"], file, True, what=f.what,
                                                base="planner_info.inputs.constraints")
                if f.data.get("constraints") else (),
                batch_size=f.req("batch_size", int, lo=1),
                allow_lossy_comm=f.opt("allow_lossy_comm", bool, False),
                allow_staleness=f.opt("allow_staleness", bool, False),
                sharding_group_size=group,
                max_sync_interval=f.opt("max_sync_interval", int, lo=1),
                layout_2d=f.opt("layout_2d", str, defaults.LAYOUT_2D),
                strategy_2d=f.opt("strategy_2d", str, defaults.STRATEGY_2D),
                time_budget_s=f.opt("time_budget_s", float, defaults.TIME_BUDGET_S, lo=0.0),
                source=f.opt("source", str, ""),
                rewrites=rewrites,
                per_sample=f.opt("per_sample", bool, False),
            )
        except FileFormatError as e:
            raise CliError(str(e)) from None
        except CliError as e:  # the inputs' own checks: name the file they came from
            if file is None or file in str(e):
                raise
            raise CliError(f"{file}: the plan's stored inputs: {e}") from None


def reference_workload(name: str) -> Any:
    """The reference workload ``name`` (:func:`~torchrec_sparselift.semantics.reference_workloads.by_name`),
    an unknown name as :class:`CliError`."""
    try:
        return by_name(name)
    except ValueError as e:
        raise CliError(str(e)) from None


def tables_module(entries: Sequence[TableEntry]) -> Any:
    """An ``EmbeddingBagCollection`` of ``entries`` on the meta device (no memory allocated)."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    try:
        return EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=e.name, embedding_dim=e.dim, num_embeddings=e.rows,
                                       feature_names=list(e.features)) for e in entries],
            device=torch.device("meta"),
        )
    except (ValueError, AssertionError) as e:
        raise CliError(f"TorchRec rejected the tables: {e}") from None


def load_model(spec: str) -> Any:
    """The ``nn.Module`` that ``package.module:factory`` returns (the working directory is
    importable, as for ``python -m``)."""
    from torch import nn

    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        raise CliError(f"--model must look like package.module:factory, got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise CliError(f"cannot import {mod_name!r} for --model: {e}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise CliError(f"{mod_name!r} has no callable {fn_name!r} for --model")
    model = fn()
    if not isinstance(model, nn.Module):
        raise CliError(f"--model {spec} returned {type(model).__name__}, not a torch nn.Module")
    return model
