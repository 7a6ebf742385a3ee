"""The plan request: everything one ``plan()`` call is asked to decide, as one value.

A :class:`PlanRequest` holds the tables the planner recovered from the model (as
:class:`~torchrec_sparselift.semantics.tables.TableSpec` values, which already carry what the
sharders offer: sharding types and kernels per table) and every option that can change the plan:
topology, batch size, constraints, workload statistics, hardware profile, dense work, storage
reservation, callbacks, pipelines, communication precisions, the accuracy guards
(``allow_lossy_comm``, ``allow_fp8``, ``allow_staleness``), the solver and its time budget, and the
2D settings (``sharding_group_size``, ``sync_interval``).

``SparseLiftPlanner`` builds exactly one request per ``plan()``; the plan cache, the planner's
``fingerprint()``, the rank-agreement check and the :class:`~.execution_plan.ExecutionPlan` all
read it:

- :meth:`PlanRequest.fingerprint` is the cache fingerprint. Its ``cache_key()`` covers every
  field except the statistics (which are compared after loading, within a drift tolerance);
  :meth:`PlanRequest.digest` covers every field.
- :meth:`PlanRequest.refuses` says why a stored plan must not be handed to this request (a
  pipeline, precision or 2D layout the request does not allow, another world size, a missing
  table), so the cache re-plans instead of bypassing a guard.

Extending it: add an ``attrs.field`` with a JSON-able default (or a ``metadata={"describe": f}``
that turns the value into JSON-able data). Every field that is not one of :data:`_CORE_FIELDS`
goes into the fingerprint's ``options_digest`` on its own, and ``tests/test_plan_request.py``
fails until the new field has a strategy there (so that "every field changes the key" stays true).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import attrs

from torchrec_sparselift import defaults
from torchrec_sparselift.cost.hardware import HardwareProfile
from torchrec_sparselift.cost.model import DenseWork
from torchrec_sparselift.cost.step_terms import TWO_D_ONLY_FIELDS
from torchrec_sparselift.plan.baseline import TermErrors
from torchrec_sparselift.plan.execution_plan import (
    ExecutionPlan,
    Fingerprint,
    Versions,
    topology_description,
)
from torchrec_sparselift.files import canonical_digest
from torchrec_sparselift.plan.rewrites import REWRITES, rewrite_names
from torchrec_sparselift.semantics.tables import TableHandle, TableSpec
from torchrec_sparselift.semantics.workload import WorkloadStats
from torchrec_sparselift.vocabulary import (
    COMM_PRECISIONS, PIPELINES, SOLVERS, STRATEGY_2D_CHOICES, SYNC_PIPELINES, comm_precision_pairs,
)

__all__ = ["PlanRequest", "LIVE_FIELDS", "describe_callbacks", "describe_sharders", "describe_reservation"]

#: Fields with their own digest in :class:`Fingerprint`; every other field is an "option".
_CORE_FIELDS = ("tables", "topology", "batch_size", "constraints", "stats", "hardware", "handles")

_PRIMITIVES = (type(None), bool, int, float, str)
_LIVE = {"live": True}


def _type_name(obj: Any) -> str:
    t = obj if isinstance(obj, type) else type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def describe_sharders(sharders: Sequence[Any]) -> Tuple[str, ...]:
    """The sharders' types, sorted: what the fingerprint records of them beyond the per-table
    sharding types and kernels they offer (which are in the tables)."""
    return tuple(sorted(_type_name(s) for s in sharders))


def describe_callbacks(callbacks: Sequence[Callable[..., Any]]) -> Tuple[str, ...]:
    """Callbacks by qualified name, in order (they run in order on the final options). Their
    code is not hashed: two lambdas of one scope, or an edited function, look alike; give
    callbacks distinct names and clear ``cache_dir`` after changing one."""
    return tuple(f"{getattr(c, '__module__', '?')}.{getattr(c, '__qualname__', type(c).__qualname__)}"
                 for c in callbacks)


def describe_reservation(reservation: Any) -> Dict[str, Any]:
    """A storage reservation by type and configuration: its plain-valued attributes that are
    set (the percentage, multipliers, estimates), not the state ``reserve()`` leaves behind
    (storages and topologies, ``None`` before the first call)."""
    if reservation is None:
        return {"__type__": None}
    config = {
        k: v for k, v in sorted(vars(reservation).items())
        if v is not None and isinstance(v, _PRIMITIVES) or (
            isinstance(v, (list, tuple)) and all(isinstance(x, _PRIMITIVES) for x in v))
    }
    return {"__type__": _type_name(reservation), **config}


def _table_key(spec: TableSpec) -> Dict[str, Any]:
    """A table as the key sees it: everything but the pooling factor, which is derived from the
    constraints (keyed) and the statistics (compared within the drift tolerance)."""
    d = attrs.asdict(spec, recurse=False)
    d.pop("pooling_factor")
    return d


def _describe(value: Any) -> Any:
    return value


def _key(describe: Callable[[Any], Any]) -> Callable[[Any], str]:
    """An attrs ``eq`` key comparing (and hashing) a live object by its description's digest."""
    return lambda value: canonical_digest(describe(value))


def _tables(value: Any) -> Tuple[TableSpec, ...]:
    return tuple(sorted(value, key=lambda s: (s.module_path, s.name)))


def _pairs(value: Any) -> Tuple[Tuple[str, str], ...]:
    return tuple((str(a), str(b)) for a, b in value)


def _constraints(value: Any) -> Dict[str, Any]:
    return dict(value or {})


_member = attrs.validators.deep_iterable
_bool = attrs.validators.instance_of(bool)
_opt_pos_int = attrs.validators.optional([attrs.validators.instance_of(int), attrs.validators.ge(1)])


def _precision_pair(instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    for pair in value:
        if len(pair) != 2 or any(p not in COMM_PRECISIONS for p in pair):
            raise ValueError(
                f"PlanRequest.precisions: {pair!r} is not a (forward, backward) pair of {COMM_PRECISIONS}"
            )


def _group_size(instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    if value is None or value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"PlanRequest.sharding_group_size must be None (1D), 'auto' or an int >= 1, got {value!r}")


@attrs.frozen(kw_only=True)
class PlanRequest:
    """What one ``plan()`` call is asked to decide. See the module docstring.

    Live objects the planner needs (the TorchRec ``Topology``, the storage reservation, the
    callbacks, the table handles) travel inside the request but compare by their description,
    so two requests are equal exactly when their fingerprints are.
    """

    tables: Tuple[TableSpec, ...] = attrs.field(
        converter=_tables, validator=_member(attrs.validators.instance_of(TableSpec)))
    topology: Any = attrs.field(eq=_key(topology_description), repr=False,
                                metadata={"describe": topology_description})
    batch_size: int = attrs.field(validator=[attrs.validators.instance_of(int), attrs.validators.ge(1)])
    constraints: Dict[str, Any] = attrs.field(factory=dict, converter=_constraints,
                                              eq=_key(_describe), repr=False)
    stats: Optional[WorkloadStats] = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(WorkloadStats)),
        eq=_key(lambda s: None if s is None else s.digest()), repr=False)
    hardware: HardwareProfile = attrs.field(validator=attrs.validators.instance_of(HardwareProfile))
    dense: DenseWork = attrs.field(factory=DenseWork, validator=attrs.validators.instance_of(DenseWork))
    sharders: Tuple[str, ...] = attrs.field(default=(), converter=tuple)
    storage_reservation: Any = attrs.field(default=None, eq=_key(describe_reservation), repr=False,
                                           metadata={"describe": describe_reservation})
    callbacks: Tuple[Any, ...] = attrs.field(default=(), converter=tuple, eq=_key(describe_callbacks),
                                             repr=False, metadata={"describe": describe_callbacks})
    pipelines: Tuple[str, ...] = attrs.field(
        default=SYNC_PIPELINES, converter=tuple,
        validator=_member(attrs.validators.in_(PIPELINES)))
    precisions: Tuple[Tuple[str, str], ...] = attrs.field(
        default=comm_precision_pairs(), converter=_pairs, validator=_precision_pair)
    allow_lossy_comm: bool = attrs.field(default=False, validator=_bool)
    allow_fp8: bool = attrs.field(default=False, validator=_bool)
    allow_staleness: bool = attrs.field(default=False, validator=_bool)
    solver: str = attrs.field(default=defaults.SOLVER, validator=attrs.validators.in_(SOLVERS))
    time_budget_s: float = attrs.field(default=defaults.TIME_BUDGET_S, converter=float,
                                       validator=attrs.validators.gt(0))
    sharding_group_size: Union[None, int, str] = attrs.field(default=None, validator=_group_size)
    sync_interval: Optional[int] = attrs.field(default=None, validator=_opt_pos_int)
    # Options other issues add (defaults keep today's behaviour):
    cost_model: str = attrs.field(default="sparselift", validator=attrs.validators.instance_of(str))
    max_sync_interval: Optional[int] = attrs.field(default=None, validator=_opt_pos_int)
    layout_2d: str = attrs.field(default=defaults.LAYOUT_2D, validator=attrs.validators.instance_of(str))
    strategy_2d: str = attrs.field(default=defaults.STRATEGY_2D, validator=attrs.validators.in_(STRATEGY_2D_CHOICES))
    measured_guard: Any = attrs.field(default=None)
    never_slower: Union[bool, str] = attrs.field(default=defaults.NEVER_SLOWER,
                                                 validator=attrs.validators.in_(defaults.NEVER_SLOWER_CHOICES))
    #: The rewrites the planner may choose (``plan.rewrites.REWRITES`` order; ``()``: none).
    rewrites: Tuple[str, ...] = attrs.field(default=REWRITES, converter=rewrite_names)
    #: The user declares the model's dense part per-sample (batch split need not prove it).
    per_sample: bool = attrs.field(default=False, validator=_bool)
    #: The live objects behind ``tables`` (for building TorchRec ``ShardingOption`` s); not part
    #: of the request's identity.
    handles: Tuple[TableHandle, ...] = attrs.field(default=(), converter=tuple, eq=False, repr=False)
    # -- what the plan reads beyond its identity (:data:`LIVE_FIELDS`) -----------------------
    #: The model the tables came from (the storage reservation and TorchRec's planner read it).
    module: Any = attrs.field(default=None, eq=False, repr=False, metadata=_LIVE)
    #: The sharders themselves (``sharders`` holds their description).
    sharder_objects: Tuple[Any, ...] = attrs.field(default=(), converter=tuple, eq=False, repr=False,
                                                   metadata=_LIVE)
    #: With ``cost_model="torchrec"``: the ``ShardEstimator`` (or list) replacing TorchRec's defaults
    #: (``cost_model`` records its identity).
    estimator: Any = attrs.field(default=None, eq=False, repr=False, metadata=_LIVE)
    #: The model's relative error per term for the never-slower rule (None: the rule does not run,
    #: ``never_slower=False``, a 2D plan or TorchRec's objective).
    model_errors: Optional[TermErrors] = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(TermErrors)),
        eq=False, repr=False, metadata=_LIVE)

    def __attrs_post_init__(self) -> None:
        if self.handles and tuple(h.spec for h in self.handles) != self.tables:
            raise ValueError("PlanRequest.handles must carry the request's tables, in the same order")

    # -- identity ---------------------------------------------------------------------------
    def options(self) -> Dict[str, Any]:
        """Every field outside the core digests, as JSON-able data (the ``options_digest`` input)."""
        out: Dict[str, Any] = {}
        for f in attrs.fields(PlanRequest):
            if f.name in _CORE_FIELDS or f.metadata.get("live"):
                continue
            out[f.name] = f.metadata.get("describe", _describe)(getattr(self, f.name))
        return out

    def fingerprint(self, versions: Optional[Versions] = None) -> Fingerprint:
        """The cache fingerprint of this request (``versions`` default to the installed ones)."""
        return Fingerprint(
            tables_digest=canonical_digest([_table_key(t) for t in self.tables]),
            topology_digest=canonical_digest(topology_description(self.topology)),
            batch_size=self.batch_size,
            constraints_digest=canonical_digest(self.constraints),
            stats_digest=None if self.stats is None else self.stats.digest(),
            hardware_digest=canonical_digest(self._hardware_key()),
            options_digest=canonical_digest(self.options()),
            versions=versions if versions is not None else Versions.current(),
        )

    def _hardware_key(self) -> Dict[str, Any]:
        """The profile as the fingerprint hashes it: a 1D request without the fields that price
        only 2D plans (:data:`~torchrec_sparselift.cost.step_terms.TWO_D_ONLY_FIELDS`)."""
        d = self.hardware.to_dict()
        if not self.is_2d:
            for name in TWO_D_ONLY_FIELDS:
                d.pop(name, None)
        return d

    def cache_key(self) -> str:
        """Names the cache file: every field but the statistics."""
        return self.fingerprint().cache_key()

    def digest(self) -> str:
        """sha256 over every field, statistics and library versions included (what ranks compare)."""
        return self.fingerprint().digest()

    @property
    def world_size(self) -> int:
        return int(self.topology.world_size)

    @property
    def is_2d(self) -> bool:
        return self.sharding_group_size is not None

    # -- guards -----------------------------------------------------------------------------
    def refuses(self, plan: ExecutionPlan) -> Optional[str]:
        """Why ``plan`` must not be returned for this request, or ``None`` if it may.

        Checks the plan against the guards (pipeline, precisions) and the shape (1D or 2D and
        the group size, the sync interval when pinned, ranks within the world or group, every
        table of the request placed and no other)."""
        o = plan.optimizations
        if o.pipeline not in self.pipelines:
            return f"its pipeline {o.pipeline!r} is not allowed here (allowed: {list(self.pipelines)})"
        if (o.fwd_comm_precision, o.bwd_comm_precision) not in self.precisions:
            return (f"its communication precision {o.fwd_comm_precision}/{o.bwd_comm_precision} is not "
                    f"allowed here (allowed: {['/'.join(p) for p in self.precisions]})")
        W = self.world_size
        g = o.sharding_group_size
        if self.sharding_group_size is None and g is not None:
            return f"it is a 2D plan (groups of {g} ranks) and a 1D plan was asked for"
        if isinstance(self.sharding_group_size, int):
            want = None if self.sharding_group_size >= W else self.sharding_group_size
            if g != want:
                return f"its layout ({_layout(g)}) is not the {_layout(want)} asked for"
        if g is not None and (g >= W or W % g):
            return f"its sharding group size {g} does not divide the world size {W} into several groups"
        if g is not None and self.sync_interval is not None and o.sync_interval != self.sync_interval:
            return f"its sync interval {o.sync_interval} is not the pinned {self.sync_interval}"
        if g is not None and self.max_sync_interval is not None and o.sync_interval > self.max_sync_interval:
            return f"its sync interval {o.sync_interval} exceeds max_sync_interval {self.max_sync_interval}"
        lay = getattr(o, "layout_2d", None)
        if g is not None and self.layout_2d != "auto" and (lay is None or lay.kind != self.layout_2d):
            return f"its rank layout is {lay.kind if lay else 'not stored'}, not the {self.layout_2d} asked for"
        strategy = getattr(o, "strategy", None)
        if g is not None and self.strategy_2d != "auto" and strategy != self.strategy_2d:
            return f"its 2D strategy is {strategy}, not the {self.strategy_2d} asked for"
        if lay is not None and lay.world_size != W:
            return f"its 2D layout is for {lay.world_size} ranks, not {W}"
        ranks = g or W
        placed: List[Tuple[str, str]] = []
        for path, module_plan in plan.sharding_plan.plan.items():
            for name, ps in module_plan.items():
                placed.append((path, name))
                bad = [r for r in (ps.ranks or ()) if not 0 <= r < ranks]
                if bad or not ps.ranks:
                    return f"table {name!r} is placed on ranks {ps.ranks} outside 0..{ranks - 1}"
        want_tables = {(t.module_path, t.name) for t in self.tables}
        missing = sorted(want_tables - set(placed))
        if missing:
            return f"it does not place tables {[_fqn(p, n) for p, n in missing][:10]}"
        extra = sorted(set(placed) - want_tables)
        if extra or len(placed) != len(set(placed)):
            return f"it places tables the model does not have: {[_fqn(p, n) for p, n in extra][:10]}"
        return None


#: The fields the plan reads that are not part of the request's identity (live objects and the
#: rule's errors): left out of :meth:`PlanRequest.options`, the fingerprint and the digest.
LIVE_FIELDS = tuple(f.name for f in attrs.fields(PlanRequest) if f.metadata.get("live"))


def _layout(group: Optional[int]) -> str:
    return "1D layout" if group is None else f"2D layout with groups of {group}"


def _fqn(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
