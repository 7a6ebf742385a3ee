"""The options of one DLRM training run (:func:`torchrec_sparselift.dlrm.run.run`), validated on
construction.

Each field is a flag of ``examples/dlrm/train.py`` (the field name is the flag's with ``-`` as
``_``; ``--2d-strategy`` is ``strategy_2d``), with the same default, so a benchmark or a test
builds ``TrainOptions(steps=20, planner="torchrec")`` where a user types the flags. A value the
run cannot use raises :class:`UsageError` naming the flag and the fix. Needs no torch.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Union

import attrs

from torchrec_sparselift.cost.batch_split import MAX_CHUNKS
from torchrec_sparselift.cost.wire_ids import ID_DTYPES, narrow_refusal
from torchrec_sparselift.defaults import STRATEGY_2D as DEFAULT_STRATEGY_2D
from torchrec_sparselift.dlrm.tables import (
    TableSpec, check_uniform_dim, feature_names, load_table_file, preset_tables, scale_tables,
)
from torchrec_sparselift.validation import option_problems
from torchrec_sparselift.vocabulary import PIPELINES, STALE_PIPELINES, STRATEGY_2D_CHOICES

__all__ = ["UsageError", "TrainOptions", "FAIL_HOWS", "PLANNERS", "TABLE_PRESETS", "MODELS", "ARCHS", "DENSE_OPTIMIZERS",
           "DEVICES", "REPLICA_MERGES", "ID_DTYPES", "DEDUP_ALL", "DEDUP_NONE", "model_kind", "resolve_tables", "rewrite_overrides"]

PLANNERS = ("sparselift", "torchrec")
TABLE_PRESETS = ("dcnv2", "kaggle")
MODELS = ("auto", "dcn", "dlrm")
ARCHS = ("mlperf", "small")
DENSE_OPTIMIZERS = ("adagrad", "sgd")
DEVICES = ("auto", "cpu", "cuda")
REPLICA_MERGES = ("average", "momentum_scaled")
#: ``--dedup all``: every feature of the tables; ``--dedup none``: no feature
DEDUP_ALL = "all"
DEDUP_NONE = "none"


class UsageError(ValueError):
    """The options ask for something the run cannot do; the message says what to change."""


def _group_size(value: Any) -> Union[None, str, int]:
    """``--sharding-group-size``: None (1D), "auto" or a number of ranks >= 1."""
    if value is None or value == "auto":
        return value
    try:
        g = int(value)
    except (TypeError, ValueError):
        g = 0
    if g < 1 or (isinstance(value, float) and value != g):
        raise UsageError(f"--sharding-group-size must be auto or a number of ranks >= 1, got {value!r}")
    return g


def _one_of(flag: str, choices: tuple):
    def check(_self: Any, _attribute: Any, value: Any) -> None:
        if value not in choices:
            raise UsageError(f"{flag} must be one of {list(choices)}, got {value!r}")
    return check


def _pipeline(_self: Any, _attribute: Any, value: Optional[str]) -> None:
    if value is not None and value not in PIPELINES:
        raise UsageError(f"--pipeline must be one of {list(PIPELINES)}, got {value!r}")


#: How ``--fail-at-step`` fails (testing faults): raise an error on the rank, kill it (SIGKILL: its
#: connections close), or hang it (SIGSTOP: its connections stay open, as a host or link gone).
FAIL_HOWS = ("raise", "kill", "hang")

#: The planner option each of the example's flags sets (for messages that name the flag).
FLAG_OF_OPTION = {"sharding_group_size": "--sharding-group-size", "strategy_2d": "--2d-strategy",
                  "sync_interval": "--sync-interval", "allow_lossy_comm": "--allow-lossy-comm",
                  "allow_staleness": "--allow-staleness", "batch_split": "--batch-split", "id_dtype": "--id-dtype",
                  "dedup_features": "--dedup", "pipeline": "--pipeline", "per_sample": "--per-sample"}


def _optional_one_of(flag: str, choices: tuple):
    def check(_self: Any, _attribute: Any, value: Any) -> None:
        if value is not None and value not in choices:
            raise UsageError(f"{flag} must be one of {list(choices)}, got {value!r}")
    return check


def _dedup(value: Any) -> Optional[str]:
    """``--dedup``: None (the plan's), ``all``, ``none`` or comma-separated feature names (spaces dropped)."""
    if value is None:
        return None
    names = [n.strip() for n in str(value).split(",") if n.strip()]
    if not names:
        raise UsageError(f"--dedup takes feature names separated by commas, 'all' or 'none', got {value!r}")
    return ",".join(names)


@attrs.frozen(kw_only=True)
class TrainOptions:
    """What to train and how: one field per flag of ``examples/dlrm/train.py`` (its ``--help``
    says what each does)."""

    planner: str = attrs.field(default="sparselift", validator=_one_of("--planner", PLANNERS))
    tables: str = attrs.field(default="dcnv2", validator=_one_of("--tables", TABLE_PRESETS))
    table_file: Optional[str] = None
    constraints: Optional[str] = None
    scale: float = 1.0
    embedding_dim: Optional[int] = None
    model: str = attrs.field(default="auto", validator=_one_of("--model", MODELS))
    arch: str = attrs.field(default="small", validator=_one_of("--arch", ARCHS))
    batch_size: int = 256
    steps: int = 100
    warmup_steps: int = 10
    lr: float = 0.05
    dense_lr: float = 0.005
    dense_optimizer: str = attrs.field(default="adagrad", validator=_one_of("--dense-optimizer", DENSE_OPTIMIZERS))
    seed: int = 0
    zipf_alpha: float = 1.05
    signal: float = 3.0
    criteo_dir: Optional[str] = None
    device: str = attrs.field(default="auto", validator=_one_of("--device", DEVICES))
    hardware: str = "auto"
    plan_cache: str = ".sparselift_cache"
    no_plan_cache: bool = False
    pipeline: Optional[str] = attrs.field(default=None, validator=_pipeline)
    allow_lossy_comm: bool = False
    allow_staleness: bool = False
    sharding_group_size: Union[None, str, int] = attrs.field(default=None, converter=_group_size)
    strategy_2d: str = attrs.field(default=DEFAULT_STRATEGY_2D, validator=_one_of("--2d-strategy", STRATEGY_2D_CHOICES))
    sync_interval: Optional[int] = None
    replica_merge: str = attrs.field(default="average", validator=_one_of("--replica-merge", REPLICA_MERGES))
    measured_guard: int = 0
    guard_steps: int = 16
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 100
    fail_at_step: Optional[int] = None
    batch_split: Optional[int] = None
    id_dtype: Optional[str] = attrs.field(default=None, validator=_optional_one_of("--id-dtype", ID_DTYPES))
    dedup: Optional[str] = attrs.field(default=None, converter=_dedup)
    per_sample: bool = False
    fail_how: str = attrs.field(default="raise", validator=_one_of("--fail-how", FAIL_HOWS))
    fail_rank: Optional[int] = None
    collective_timeout: float = 120.0
    out: Optional[str] = None
    attribute: int = 0
    attribution_out: Optional[str] = None
    no_progress: bool = False
    no_pin: bool = False
    debug: bool = False
    check: bool = False

    def __attrs_post_init__(self) -> None:
        if self.batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.steps < 1:
            raise UsageError(f"--steps must be >= 1, got {self.steps}")
        if not 0 <= self.warmup_steps < self.steps:
            raise UsageError(f"--warmup-steps must be in [0, --steps), got {self.warmup_steps} with --steps {self.steps}")
        if self.embedding_dim is not None and self.embedding_dim < 1:
            raise UsageError(f"--embedding-dim must be >= 1, got {self.embedding_dim}")
        if not (self.lr > 0 and self.dense_lr > 0):
            raise UsageError("--lr and --dense-lr must be > 0")
        if self.checkpoint_every < 1:
            raise UsageError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")
        if self.fail_at_step is not None and not 1 <= self.fail_at_step <= self.steps:
            raise UsageError(f"--fail-at-step must be in [1, --steps], got {self.fail_at_step}")
        if self.fail_at_step is None and (self.fail_how != "raise" or self.fail_rank is not None):
            raise UsageError("--fail-how and --fail-rank have no effect here: they need --fail-at-step K; drop them "
                             "or add --fail-at-step K")
        if self.fail_rank is not None and self.fail_rank < 0:
            raise UsageError(f"--fail-rank must be a rank >= 0, got {self.fail_rank}")
        if not (self.collective_timeout > 0 and math.isfinite(self.collective_timeout)):
            raise UsageError(f"--collective-timeout must be a number of seconds > 0, got {self.collective_timeout}")
        if self.pipeline is not None and self.planner != "sparselift":
            raise UsageError("--pipeline applies to --planner sparselift (--planner torchrec trains with sparse_dist)")
        if self.pipeline in STALE_PIPELINES and not self.allow_staleness:
            raise UsageError(f"--pipeline {self.pipeline} trains on one-step-stale embeddings; add --allow-staleness")
        if self.allow_staleness and self.planner != "sparselift":
            raise UsageError("--allow-staleness applies to --planner sparselift (--planner torchrec trains with "
                             "sparse_dist)")
        if self.allow_staleness and self.measured_guard:
            raise UsageError("--allow-staleness does not combine with --measured-guard (the guard measures exact "
                             "plans only); force a stale pipeline with --pipeline, or leave out one of the two")
        if self.zipf_alpha <= 0:
            raise UsageError(f"--zipf-alpha must be > 0, got {self.zipf_alpha}")
        if self.attribute < 0:
            raise UsageError(f"--attribute must be >= 0 steps, got {self.attribute}")
        if self.measured_guard < 0 or self.guard_steps < 1:
            raise UsageError("--measured-guard must be >= 0 and --guard-steps >= 1")
        if self.measured_guard and self.planner != "sparselift":
            raise UsageError("--measured-guard applies to --planner sparselift (it measures TorchRec's plan too)")
        self._check_2d()
        self._check_rewrites()

    def _check_rewrites(self) -> None:
        """The sparse-path rewrite flags: each needs the sparselift planner; ``--batch-split`` the
        overlap pipeline and 1D, ``--id-dtype``/``--dedup`` 1D (validation.OPTION_NEEDS)."""
        k = self.batch_split
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_CHUNKS):
            raise UsageError(f"--batch-split must be a number of chunks in 1..{MAX_CHUNKS}, got {k!r}")
        if k is not None and k > self.batch_size:
            raise UsageError(f"--batch-split {k} cannot split a batch of {self.batch_size} samples per rank: use at "
                             f"most --batch-split {self.batch_size} (or a larger --batch-size)")
        if self.planner != "sparselift":
            for flag, given in (("--batch-split", k is not None), ("--id-dtype", self.id_dtype is not None),
                                ("--dedup", self.dedup is not None), ("--per-sample", self.per_sample)):
                if given:
                    raise UsageError(f"{flag} applies to --planner sparselift (--planner torchrec trains TorchRec's "
                                     "sparse path as it is)")
        errors, _ = option_problems(
            dict(batch_split=k, pipeline=self.pipeline, id_dtype=self.id_dtype,
                 dedup_features=None if self.dedup == DEDUP_NONE else self.dedup,
                 per_sample=self.per_sample, sharding_group_size=self.sharding_group_size),
            spell=lambda name: FLAG_OF_OPTION.get(name, name))
        if errors:
            raise UsageError(errors[0])

    def _check_2d(self) -> None:
        """The 2D flags: the others need ``--sharding-group-size``; it needs the sparselift planner."""
        g = self.sharding_group_size
        if self.sync_interval is not None and self.sync_interval < 1:
            raise UsageError(f"--sync-interval must be >= 1 step, got {self.sync_interval}")
        # the planner's rule for options that do not apply (validation.OPTION_NEEDS), in the flags' words
        errors, _ = option_problems(
            dict(sharding_group_size=g, strategy_2d=self.strategy_2d, sync_interval=self.sync_interval,
                 allow_lossy_comm=self.allow_lossy_comm, allow_staleness=self.allow_staleness),
            spell=lambda name: FLAG_OF_OPTION.get(name, name))
        if errors:
            raise UsageError(errors[0])
        if g is None:
            if self.replica_merge != "average":  # the example's own 2D flag
                raise UsageError("--replica-merge needs --sharding-group-size auto|N (a 2D plan); without it the "
                                 "plan is 1D")
            return
        if self.planner != "sparselift":
            raise UsageError("--sharding-group-size plans 2D with --planner sparselift (TorchRec's planner has no 2D)")
        if self.sync_interval is not None and self.strategy_2d == "fully_sharded":
            raise UsageError("--sync-interval does not apply to --2d-strategy fully_sharded (it syncs every step)")
        if self.replica_merge != "average" and self.strategy_2d == "fully_sharded":
            raise UsageError("--replica-merge applies to the periodic sync (--2d-strategy default), not fully_sharded")
        for flag, value in (("--measured-guard", self.measured_guard), ("--checkpoint-dir", self.checkpoint_dir),
                            ("--attribute", self.attribute)):
            if value:
                raise UsageError(f"{flag} is not supported with --sharding-group-size (2D) in this example; drop one")

    @property
    def cache_dir(self) -> Optional[str]:
        """Where the sparselift planner stores and reuses execution plans (None: it always plans)."""
        return None if (self.no_plan_cache or self.planner != "sparselift") else self.plan_cache

    def two_d_options(self) -> dict:
        """``make_planner``'s 2D keywords (empty for 1D)."""
        if self.sharding_group_size is None:
            return {}
        return dict(sharding_group_size=self.sharding_group_size, strategy_2d=self.strategy_2d,
                    sync_interval=self.sync_interval)


def rewrite_overrides(options: TrainOptions, tables: Sequence[TableSpec]) -> Dict[str, Any]:
    """``runtime.lift``'s keywords for the rewrite flags given (``batch_split``, ``id_dtype``,
    ``dedup_features``; a flag left out keeps the execution plan's choice), checked against
    ``tables`` as the run checks them: ``--id-dtype int32`` needs every table within int32 rows,
    ``--dedup`` names features of the tables (``all``: every one; ``none``: no feature). Raises
    UsageError."""
    out: Dict[str, Any] = {}
    if options.batch_split is not None:
        out["batch_split"] = options.batch_split
    if options.id_dtype is not None:
        if options.id_dtype == "int32":
            why = narrow_refusal((t.name, t.rows) for t in tables)
            if why:
                raise UsageError("--id-dtype int32: " + why.replace("id_dtype='int64'", "--id-dtype int64"))
        out["id_dtype"] = options.id_dtype
    if options.dedup is not None:
        every = feature_names(tables)
        if options.dedup == DEDUP_ALL:
            out["dedup_features"] = tuple(every)
        elif options.dedup == DEDUP_NONE:
            out["dedup_features"] = ()
        else:
            names = options.dedup.split(",")
            unknown = [n for n in names if n not in every]
            if unknown:
                shown = ", ".join(every[:8]) + (", ..." if len(every) > 8 else "")
                raise UsageError(f"--dedup names {unknown}, which no table reads; the features are {shown} "
                                 f"(or --dedup {DEDUP_ALL} or {DEDUP_NONE})")
            out["dedup_features"] = tuple(names)
    return out


def model_kind(options: TrainOptions) -> str:
    """``--model auto``: ``dcn`` for the dcnv2 preset, else ``dlrm``."""
    if options.model != "auto":
        return options.model
    return "dcn" if options.tables == "dcnv2" and not options.table_file else "dlrm"


def resolve_tables(options: TrainOptions) -> List[TableSpec]:
    """The tables the run trains: ``--table-file`` or the ``--tables`` preset, then
    ``--embedding-dim`` and ``--scale``; raises TableSetError naming what is wrong."""
    if options.table_file:
        tables = load_table_file(options.table_file)
        if options.embedding_dim is not None:
            tables = [attrs.evolve(t, dim=options.embedding_dim) for t in tables]
    else:
        tables = preset_tables(options.tables, options.embedding_dim)
    tables = scale_tables(tables, options.scale)
    check_uniform_dim(tables)
    return tables
