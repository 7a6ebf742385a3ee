"""Hardware profiles: the resource rates the cost model divides quantities by.

A :class:`HardwareProfile` is a small immutable value. Presets describe common nodes; the
``calibrate`` step (:mod:`torchrec_sparselift.calibration.kernel_fit`) fits one on the machine at hand
and saves it as JSON, which :func:`HardwareProfile.load` reads back.

Vocabulary (used across the package): a *rank* is one process/device; a *host* holds
``local_world_size`` ranks; *intra-host* traffic stays on one host (NVLink, loopback), *inter-host*
traffic crosses the NIC. Bandwidths are per rank, in bytes per second, one direction.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, Mapping, Optional, Tuple

import attrs

from torchrec_sparselift.atomic import write_json
from torchrec_sparselift.files import Fields, field_path, load_json
from torchrec_sparselift.vocabulary import PIPELINES
__all__ = ["HardwareProfile", "RATE_FALLBACK", "PRESETS", "get_profile", "profile_for_topology",
           "COMPUTE_RATE_FIELDS", "COMPUTE_TIME_FIELDS", "UNSET_OMITTED_FIELDS", "with_slower_compute"]

GiB = 1024**3
GB = 1e9


def _positive(instance: Any, attribute: "attrs.Attribute[Any]", value: float) -> None:
    if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
        raise ValueError(
            f"HardwareProfile.{attribute.name} must be a positive finite number, got {value!r}"
        )


def _non_negative(instance: Any, attribute: "attrs.Attribute[Any]", value: float) -> None:
    if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
        raise ValueError(
            f"HardwareProfile.{attribute.name} must be a non-negative finite number, got {value!r}"
        )


def _optional_non_negative(instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
        raise ValueError(
            f"HardwareProfile.{attribute.name} must be None (not calibrated) or a non-negative finite number "
            f"of seconds, got {value!r}; calibrate it with "
            + ("`torchrun --standalone --nproc_per_node 2 -m torchrec_sparselift calibrate steps` (real "
               "batch-split steps)" if attribute.name == "chunk_feature_s"
               else "`torchrun --standalone --nproc_per_node 2 -m torchrec_sparselift calibrate steps` (its link "
               "measurement)" if attribute.name == "link_latency_s" else "`sparselift calibrate kernels`")
        )


def _pairs(value: Any) -> Tuple[Tuple[str, float], ...]:
    """``pipeline_factors`` from a mapping or a sequence of pairs (a JSON file's list of lists)."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        value = value.items()
    if isinstance(value, (str, bytes)):
        return value  # the validator names it
    try:
        return tuple(tuple(p) if isinstance(p, (list, tuple)) else p for p in value)
    except TypeError:
        return value  # not iterable: the validator names it


def _pipeline_factors(instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in value):
        raise ValueError(f"HardwareProfile.pipeline_factors must be (pipeline, factor) pairs, got {value!r}")
    names = [p for p, _f in value]
    for name, factor in value:
        if name not in PIPELINES:
            raise ValueError(f"HardwareProfile.pipeline_factors: unknown pipeline {name!r}; choose from {list(PIPELINES)}")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (factor > 0 and math.isfinite(factor)):
            raise ValueError(f"HardwareProfile.pipeline_factors[{name!r}] must be a positive finite number, got {factor!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"HardwareProfile.pipeline_factors names a pipeline twice: {names}")


#: Optional rates and the field each falls back to when it is None.
RATE_FALLBACK = {"dense_update_bw": "hbm_bw", "interaction_flops": "dense_flops", "dense_mem_bw": "hbm_bw"}


@attrs.frozen(kw_only=True)
class HardwareProfile:
    """Resource rates of one kind of node.

    Attributes:
        name: preset or calibration name, shown in plans and logs.
        compute_device: "cuda" or "cpu" (what TorchRec's ``Topology.compute_device`` says).
        local_world_size: ranks per host.
        hbm_cap_bytes / ddr_cap_bytes: device memory and host memory per rank.
        hbm_bw: effective bandwidth of embedding row reads from device memory (TBE forward).
        ddr_bw: effective bandwidth of row reads from host memory (UVM kernels, CPU training).
        uvm_bw: device-to-host-memory bandwidth for UVM rows (PCIe / C2C); also what a
            key-value (virtual-table) lookup that misses its HBM cache pays for a DRAM row.
        ssd_bw: effective random-read bandwidth of an ``ssd_virtual_table`` row that misses
            both caches (an assumption, 1 GB/s NVMe-class; calibrate it on the machine).
        row_granularity_bytes: memory transaction size; a row read costs at least this much.
        bwd_factor: backward + fused optimizer update cost relative to the forward lookup
            (gradient read, weight read-modify-write, optimizer-state read-modify-write).
        lookup_overhead_s: fixed cost of one TBE kernel call (launch, index bookkeeping).
        intra_host_bw / inter_host_bw: per-rank all-to-all bandwidth within a host / across hosts.
        allreduce_bw: per-rank ring all-reduce bus bandwidth (dense gradients, replica sync).
        collective_latency_s: fixed cost of one collective call.
        dense_flops: sustained FLOP/s of the dense (MLP) part.
        cache_hit_rate: row hit rate assumed for UVM-caching kernels when no statistics say better.
        supports_overlap: whether communication really overlaps compute (separate streams and
            copy engines). False makes every pipeline kind cost the same as a plain loop, except
            a kind that overlaps between hosts (``Pipeline.overlaps_between_hosts``: ``overlap``)
            when the ranks span hosts (``cost.pipelines.effective_pipeline``; docs/overlap.md).
        id_overhead_bytes: per-id cost of a forward lookup that does not depend on the row
            width (index and offset reads, bag bookkeeping), as equivalent bytes.
        bwd_id_overhead_bytes: per-id cost of the backward + optimizer that does not depend on
            the row width (sorting ids, de-duplication, per-row optimizer bookkeeping). These two
            make splitting a hot table into narrow column shards cost what it costs: every
            column shard processes every id.
        step_overhead_s: fixed work of every training step outside the sparse path's nodes
            (pipeline bookkeeping, loss, optimizer calls, Python), fitted from real steps.
        feature_overhead_s: per feature and step, on every rank, for each sharded (not
            data-parallel) shard the feature feeds: KJT permute, split and length handling of
            the input distribution and the per-feature pooled-output bookkeeping.
        table_overhead_s: per sharded table shard and step on the rank that holds it (its slice
            in the output distribution, per-table splits in the backward).
        dp_table_overhead_s: per data-parallel table and step on every rank (the replica's dense
            gradient, its slot in the gradient all-reduce and the dense optimizer step).
        dense_update_bw: bandwidth of the dense optimizer pass over a data-parallel table
            (weight, gradient and state); None: the device memory bandwidth (``hbm_bw``).
        bucketize_id_s: per id and step on every rank for row-wise tables (bucketize the ids
            by row range and permute them into per-rank buckets).
        interaction_flops: FLOP/s of the dense part's parameter-free batched products (DLRM's
            pairwise dot interaction: many small matrices); None: ``dense_flops``.
        dense_mem_bw: bytes/s at which the dense forward writes its activations (and the
            backward reads them and writes their gradients: priced twice);
            None: the device memory bandwidth (``hbm_bw``).
        bwd_row_s: per distinct row a fused kernel's backward updates in a step, on the rank that
            holds the shard (fbgemm deduplicates the ids, then reads, updates and writes each
            row and its optimizer state once; on CPU ~0.6-0.9 us per row against ~40 ns per id).
        reduce_scatter_factor: cost of a byte of a pooled row-wise output's reduce-scatter (and of
            its backward all-gather) relative to an all-to-all byte on the same link (measured
            alone on 2 gloo ranks: reduce-scatter ~4.5x, all-gather ~2x an all-to-all's per byte);
            1.0 in the presets.
        inter_reduce_scatter_factor: the same for the bytes of a reduce-scatter (all-gather) that
            cross hosts; None: ``reduce_scatter_factor``. The link correction sets it when the
            job's inter-host link is slower than the calibration's (the factor's CPU seconds per
            byte stay, the slower link's are added once: ``1 + (f - 1) new / old``), and leaves
            ``reduce_scatter_factor`` to the intra-host bytes (table-row-wise's stage), whose
            link did not slow.
        cold_row_s: per id looked up (forward and backward together) in a shard larger than
            ``lookup_cache_bytes``, times the share of the shard beyond it (``1 - cache / shard
            bytes``): the rows a lookup reads and writes back come from memory instead of the
            cache (:func:`torchrec_sparselift.cost.terms.cold_row_seconds`). Measured on the 2-core
            CPU: ~70 ns per id at a 1 MiB cache (``profiles/cpu-2core-gloo.records.json``'s lookups);
            0 in the GPU presets (a GPU's row gathers are bandwidth-bound at every table size,
            which ``hbm_bw`` prices).
        lookup_cache_bytes: the cache one rank's lookups share (bytes); a shard within it pays no
            ``cold_row_s``. Not fitted (the step time is not linear in it): the CPU value is the
            one the kernel records support best (1 MiB, the per-core L2 of the 2-core machine;
            of 1, 4, 16 and 32 MiB).
        pipeline_factors: ``(pipeline, factor)`` pairs measured by the step calibration: the step
            of the same plan under that pipeline over its step under ``sparse_dist`` (the pipeline
            the probe plans are fitted under). Applied where the model prices the pipeline as
            ``base`` (hardware without overlap, CPU gloo: ``cost.pipelines.step_factor``), where
            the pipelines still differ in what they cost per step (TorchRec's ``fused`` ran
            0.77-0.96x ``sparse_dist`` on the 2-core CPU); 1.0 for a pipeline not listed, and
            empty in the presets.
        host_link_shared: whether the ranks of a host share one inter-host link (one NIC per
            host, or the testbed's one veth per emulated host), so that what crosses it is the
            sum of the host's ranks' inter-host bytes however they are spread over the ranks.
            ``inter_host_bw`` stays the per-rank rate with every rank of the host sending at once
            (as measured); with a shared link the model prices each rank's inter-host bytes at
            its host's mean (``cost.model.shared_link_columns``, ``host_mean_rows``). False (a link per rank: GPU
            hosts with a NIC per GPU) in the presets; set from the link measurement
            (``LinkRates.host_link_shared``).
        replica_intra_bw / replica_inter_bw: bus bandwidth (all-reduce equation) of a 2D plan's
            replica sync within a host / across hosts: ``DMPCollection``'s ``allreduce_coalesced``
            of the shards' weights and optimizer state, every replica group at once, as the job's
            link measurement times it (:class:`~torchrec_sparselift.calibration.link.LinkRates`;
            on gloo the call copies the tensors into one buffer and back, so within a host it runs
            at about half a plain all-reduce's rate). None (presets, a profile without a link
            measurement): ``intra_host_bw`` / ``inter_host_bw``.
        codec_byte_s: seconds per fp32 byte of an all-to-all payload (the graph's link bytes, sent
            plus received) that a rank spends in the quantized-comm codec when a phase's comm
            precision is lossy: encoding what it sends, decoding what it receives
            (``cost.model.lossy_byte_s``). Measured alone on the machine with TorchRec's fp16
            codec (``measure.microbench.bench_codec_byte_s``; bf16 on gloo is fp16): on the 2-core
            CPU ~0.1 ns per byte (fp16 encodes at ~4 GB/s and decodes at ~12 GB/s), against the
            ~0.13 ns per byte fp16 saves of its loopback all-to-all's wire. 0 in the GPU presets
            (the codec runs at device-memory speed, far beyond the links).
        a2a_host_byte_s: seconds per link byte of the all-to-all phases' work on the rank that runs
            at full precision whatever the comm precision (gathering the pooled embeddings into the
            send buffer and splitting what arrives, at fp32 on both sides of the codec): the part
            of ``1/intra_host_bw`` (and ``1/inter_host_bw``) above the bare collective. A lossy
            precision shrinks the rest, the bytes on the wire (``cost.model.lossy_byte_s``). Set by
            the step calibration: the fitted all-to-all cost per byte minus the bare
            ``all_to_all_single``'s measured alone (its floor; ``calibration.step_fit.with_a2a_host_split``);
            a link correction keeps it (it moves only the link's own seconds). 0 in the presets
            (every all-to-all byte on the wire).
        chunk_overhead_s: seconds one more batch chunk adds to a step (``cost.batch_split``) beside
            its collectives' latency, whatever the model's feature count: the dense model's calls run
            once more per chunk (kernel launches, the framework's per-call work, the cut of the batch
            and the merge of the outputs). Measured by the step calibration on real batch-split
            steps of probe plans of several feature counts (``measure.steps.measure_chunk_times``,
            the fit's intercept, ``calibration.rewrite_fit.step_chunk_cost``; at least the dense
            calls alone, ``measure.microbench.bench_chunk_steps``, which ``sparselift calibrate
            kernels`` measures). None: not calibrated on this profile (the planner does not split
            the batch, and says why).
        chunk_feature_s: seconds one more batch chunk adds per feature of the split module (its
            keyed embeddings are cut into per-feature tensors, concatenated and their gradients
            split once more per chunk: ``KeyedTensor.to_dict``, the interaction's input): the
            per-chunk price is ``chunk_overhead_s + chunk_feature_s * features``. Measured with
            ``chunk_overhead_s`` by the step calibration (the fit's slope over the probe plans'
            feature counts). None: not calibrated (priced as 0: the per-chunk price is
            ``chunk_overhead_s`` alone).
        dedup_id_s: seconds per id of the id-deduplication kernels (``cost.wire_ids``): the
            sender's ``torch.unique`` with its inverse index and the receiver's rebuild
            (``unique[inverse]``) and merge of the sources' distinct ids, as ``runtime.wire_ids``
            runs them. Measured with ``chunk_overhead_s``
            (``measure.microbench.bench_dedup_kernels``; the per-id slope over id counts and unique
            ratios, ``calibration.rewrite_fit.fit_dedup_id_s``). None: not calibrated (the planner
            does not deduplicate ids, and says why).
        link_latency_s: seconds the link itself takes per collective call: a bare
            ``all_to_all_single``'s latency as the calibration's link measurement reads it
            (``calibration.link.LinkRates``: the inter-host one on several hosts, else the intra-host
            one; set by the step calibration, ``calibration.link.with_link_latency``, and moved with
            a link correction, ``correct_link_terms``). ``collective_latency_s`` (fitted on
            whole steps) also holds each call's work on the rank's own thread (TorchRec's collective
            wrappers, their autograd nodes); a batch split's extra chunk puts only this part on the
            link, the rest is in the per-chunk price ``chunk_overhead_s`` the step calibration
            measures (``cost.batch_split.chunk_link_latency_s``). None: not measured (an extra
            chunk puts all of ``collective_latency_s`` on the link).
        The terms from ``step_overhead_s`` on are 0 (or None; ``reduce_scatter_factor`` 1.0) in the
        presets; :mod:`torchrec_sparselift.calibration.step_fit` fits them from measured steps
        (all but ``lookup_cache_bytes``; ``codec_byte_s`` is measured by the host microbenchmarks
        and ``a2a_host_byte_s`` derived from the fit and them).
    """

    name: str
    compute_device: str = attrs.field(default="cuda")
    local_world_size: int = attrs.field(default=8)
    hbm_cap_bytes: int = attrs.field(default=80 * GiB)
    ddr_cap_bytes: int = attrs.field(default=256 * GiB)
    hbm_bw: float = attrs.field(default=1.6e12, validator=_positive)
    ddr_bw: float = attrs.field(default=50e9, validator=_positive)
    uvm_bw: float = attrs.field(default=25e9, validator=_positive)
    ssd_bw: float = attrs.field(default=1e9, validator=_positive)
    row_granularity_bytes: int = attrs.field(default=32)
    bwd_factor: float = attrs.field(default=2.5, validator=_positive)
    lookup_overhead_s: float = attrs.field(default=20e-6, validator=_non_negative)
    intra_host_bw: float = attrs.field(default=300e9, validator=_positive)
    inter_host_bw: float = attrs.field(default=45e9, validator=_positive)
    allreduce_bw: float = attrs.field(default=200e9, validator=_positive)
    collective_latency_s: float = attrs.field(default=30e-6, validator=_non_negative)
    dense_flops: float = attrs.field(default=400e12, validator=_positive)
    cache_hit_rate: float = attrs.field(default=0.9)
    supports_overlap: bool = attrs.field(default=True)
    id_overhead_bytes: float = attrs.field(default=64.0, validator=_non_negative)
    bwd_id_overhead_bytes: float = attrs.field(default=256.0, validator=_non_negative)
    step_overhead_s: float = attrs.field(default=0.0, validator=_non_negative)
    feature_overhead_s: float = attrs.field(default=0.0, validator=_non_negative)
    table_overhead_s: float = attrs.field(default=0.0, validator=_non_negative)
    dp_table_overhead_s: float = attrs.field(default=0.0, validator=_non_negative)
    dense_update_bw: Optional[float] = attrs.field(default=None)
    bucketize_id_s: float = attrs.field(default=0.0, validator=_non_negative)
    interaction_flops: Optional[float] = attrs.field(default=None)
    dense_mem_bw: Optional[float] = attrs.field(default=None)
    bwd_row_s: float = attrs.field(default=0.0, validator=_non_negative)
    reduce_scatter_factor: float = attrs.field(default=1.0, validator=_positive)
    cold_row_s: float = attrs.field(default=0.0, validator=_non_negative)
    lookup_cache_bytes: int = attrs.field(default=1 << 20)
    pipeline_factors: Tuple[Tuple[str, float], ...] = attrs.field(default=(), converter=_pairs,
                                                                  validator=_pipeline_factors)
    host_link_shared: bool = attrs.field(default=False)
    inter_reduce_scatter_factor: Optional[float] = attrs.field(default=None)
    replica_intra_bw: Optional[float] = attrs.field(default=None)
    replica_inter_bw: Optional[float] = attrs.field(default=None)
    codec_byte_s: float = attrs.field(default=0.0, validator=_non_negative)
    a2a_host_byte_s: float = attrs.field(default=0.0, validator=_non_negative)
    chunk_overhead_s: Optional[float] = attrs.field(default=None, validator=_optional_non_negative)
    chunk_feature_s: Optional[float] = attrs.field(default=None, validator=_optional_non_negative)
    dedup_id_s: Optional[float] = attrs.field(default=None, validator=_optional_non_negative)
    link_latency_s: Optional[float] = attrs.field(default=None, validator=_optional_non_negative)

    def __attrs_post_init__(self) -> None:
        if self.compute_device not in ("cuda", "cpu", "mtia"):
            raise ValueError(
                f"HardwareProfile.compute_device must be 'cuda', 'cpu' or 'mtia', got {self.compute_device!r}"
            )
        if self.local_world_size < 1:
            raise ValueError("HardwareProfile.local_world_size must be >= 1")
        if self.hbm_cap_bytes <= 0 or self.ddr_cap_bytes < 0:
            raise ValueError("HardwareProfile memory capacities must be positive")
        if not 0.0 <= self.cache_hit_rate <= 1.0:
            raise ValueError("HardwareProfile.cache_hit_rate must be within [0, 1]")
        if self.lookup_cache_bytes < 1:
            raise ValueError(f"HardwareProfile.lookup_cache_bytes must be >= 1, got {self.lookup_cache_bytes!r}")
        if self.row_granularity_bytes < 1:
            raise ValueError("HardwareProfile.row_granularity_bytes must be >= 1")
        v = self.inter_reduce_scatter_factor
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise ValueError(f"HardwareProfile.inter_reduce_scatter_factor must be None or a positive finite number, got {v!r}")
        for name in RATE_FALLBACK:
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ValueError(f"HardwareProfile.{name} must be None or a positive finite number, got {v!r}")
        for name in ("replica_intra_bw", "replica_inter_bw"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ValueError(f"HardwareProfile.{name} must be None or a positive finite number, got {v!r}")

    def pipeline_factor(self, name: str) -> float:
        """The measured step factor of pipeline ``name`` (``pipeline_factors``; 1.0 when not measured)."""
        for p, f in self.pipeline_factors:
            if p == name:
                return float(f)
        return 1.0

    def rs_factor(self, inter_host: bool) -> float:
        """All-to-all bytes one reduce-scatter (all-gather) byte costs on the inter-host link
        (``inter_host``) or within a host (``inter_reduce_scatter_factor`` / ``reduce_scatter_factor``)."""
        if inter_host and self.inter_reduce_scatter_factor is not None:
            return float(self.inter_reduce_scatter_factor)
        return float(self.reduce_scatter_factor)

    def link_bw(self, inter_host: bool) -> float:
        """The per-rank all-to-all rate of the link across hosts (``inter_host``) or within one:
        ``inter_host_bw`` / ``intra_host_bw`` (what ``fully_sharded``'s per-step reduce-scatter
        and all-gather of a 2D plan are priced at)."""
        return float(self.inter_host_bw if inter_host else self.intra_host_bw)

    def replica_bw(self, inter_host: bool) -> float:
        """Bus bandwidth of the 2D replica sync across hosts (``inter_host``) or within one:
        ``replica_inter_bw`` / ``replica_intra_bw`` where measured, else the all-to-all rate of
        the same link (:meth:`link_bw`)."""
        v = self.replica_inter_bw if inter_host else self.replica_intra_bw
        if v is not None:
            return float(v)
        return self.link_bw(inter_host)

    def rate(self, name: str) -> float:
        """The value of field ``name``; an optional rate that is None gives the field it falls
        back to (:data:`RATE_FALLBACK`)."""
        v = getattr(self, name)
        return float(v if v is not None else getattr(self, RATE_FALLBACK[name]))

    # -- derived rates -------------------------------------------------------------------
    def row_bytes(self, dim: int, elem_bytes: int) -> int:
        """Bytes one row read really moves: rounded up to the memory transaction size."""
        g = self.row_granularity_bytes
        return -(-dim * elem_bytes // g) * g

    def a2a_bw(self, group_ranks: int, spans_hosts: bool) -> float:
        """Effective per-rank all-to-all bandwidth for a group of ``group_ranks`` ranks.

        Within one host every byte goes over the intra-host link. Across hosts a fraction
        ``(group - local) / group`` of the bytes leaves the host; the time is set by the slower
        of the two paths, which is how a flat all-to-all behaves on NVLink + NIC fabrics.
        """
        if group_ranks <= 1:
            return float("inf")
        if not spans_hosts:
            return self.intra_host_bw
        local = min(self.local_world_size, group_ranks)
        remote_frac = (group_ranks - local) / group_ranks
        local_frac = 1.0 - remote_frac
        t_per_byte = max(remote_frac / self.inter_host_bw, local_frac / self.intra_host_bw)
        return 1.0 / t_per_byte

    # -- serialization --------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """Every field; an :data:`UNSET_OMITTED_FIELDS` field that is None (not calibrated) is left
        out, so a profile without it has the record (and digest) it had before the field existed."""
        d = attrs.asdict(self)
        for name in UNSET_OMITTED_FIELDS:
            if d.get(name, 0) is None:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "HardwareProfile":
        known = {f.name for f in attrs.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"unknown HardwareProfile fields {sorted(unknown)}; known fields are {sorted(known)}"
            )
        return cls(**dict(data))

    def save(self, path: str) -> None:
        """Write the profile as JSON, atomically (write to a temp file, then rename)."""
        write_json(path, {"schema": "sparselift.hardware_profile/1", **self.to_dict()}, prefix=".profile-",
                   indent=2)

    @classmethod
    def from_fields(cls, f: Fields) -> "HardwareProfile":
        """A profile from a file's object read by ``f`` (the ``schema`` key, if any, is skipped):
        unknown keys, missing required fields, values of the wrong type, NaN/Infinity and values the
        profile's own checks refuse are errors naming the file and the field."""
        fields = attrs.fields(cls)
        f.only([a.name for a in fields] + ["schema"], "remove or rename them (a typo?); the profile was "
               "written by another version, or by hand")
        kw: Dict[str, Any] = {}
        for a in fields:
            kind, optional = _FIELD_KINDS.get(str(a.type), (None, False))
            if a.name not in f.data and a.default is not attrs.NOTHING and a.name not in PROFILE_CORE_FIELDS:
                continue  # a term added after the profile was written: its default
            if kind is None:  # a structured field: its own validator checks it (inside build below)
                kw[a.name] = f.data.get(a.name)
                continue
            value = f.data.get(a.name)
            if value is None and optional:
                kw[a.name] = None
                continue
            if kind is int and isinstance(value, float) and math.isfinite(value) and value.is_integer():
                value = int(value)  # a whole number written as 8589934592.0
                f.check(value, int, field_path(f.path, a.name))
            else:
                value = f.req(a.name, kind)
            kw[a.name] = value
        return f.build(None, lambda _d: cls(**kw), fix="write a value in the range the message names")

    @classmethod
    def load(cls, path: str) -> "HardwareProfile":
        """Read a profile written by :meth:`save`; :class:`~torchrec_sparselift.errors.FileFormatError`
        naming the file and the field for anything else."""
        f = Fields(load_json(path, "hardware profile", top=dict), file=path, what="hardware profile")
        schema = f.data.get("schema")
        if schema != "sparselift.hardware_profile/1":
            raise f.fail("schema", f"is {schema!r}, not 'sparselift.hardware_profile/1': this is not a "
                         "sparselift hardware profile", "create one with `sparselift calibrate`")
        return cls.from_fields(f)


#: The rates of the work a rank does on its own cores (embedding row reads, the dense part, its
#: optimizer pass) and the seconds of it (per call, step, feature, table, id, row): what slows when
#: more ranks share a machine's cores than its profile was measured with. The link terms are not
#: among them (a job measures its link under its own load: ``measure.link``), nor ``uvm_bw`` and
#: ``ssd_bw`` (transfers from another device).
COMPUTE_RATE_FIELDS = ("hbm_bw", "ddr_bw", "dense_flops", "interaction_flops", "dense_mem_bw", "dense_update_bw")
COMPUTE_TIME_FIELDS = ("lookup_overhead_s", "step_overhead_s", "feature_overhead_s", "table_overhead_s",
                       "dp_table_overhead_s", "bucketize_id_s", "bwd_row_s", "cold_row_s", "codec_byte_s",
                       "chunk_overhead_s", "chunk_feature_s", "dedup_id_s")

#: Optional terms :meth:`HardwareProfile.to_dict` leaves out while they are None (not calibrated):
#: profiles, plan fingerprints and cache keys without them keep their digests.
UNSET_OMITTED_FIELDS = ("chunk_overhead_s", "chunk_feature_s", "dedup_id_s", "link_latency_s")


def with_slower_compute(profile: HardwareProfile, factor: float) -> HardwareProfile:
    """``profile`` with every compute term ``factor`` times slower: the rates of
    :data:`COMPUTE_RATE_FIELDS` divided by it (an optional rate left None still falls back to its
    now slower field), the seconds of :data:`COMPUTE_TIME_FIELDS` multiplied by it (one that is None stays None). ``factor`` 1
    returns ``profile`` itself; a factor below 1 (more cores per rank) speeds the terms up."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"with_slower_compute: factor={factor!r}: give a positive finite number")
    if factor == 1:
        return profile
    changes: Dict[str, Any] = {}
    for name in COMPUTE_RATE_FIELDS:
        v = getattr(profile, name)
        if v is not None:
            changes[name] = float(v) / factor
    for name in COMPUTE_TIME_FIELDS:
        v = getattr(profile, name)
        if v is not None:  # an uncalibrated term (None) stays None
            changes[name] = float(v) * factor
    return attrs.evolve(profile, **changes)


#: Fields every stored profile must name: the machine's capacities, bandwidths and base costs
#: (every profile ever written has them). A profile without one is refused, naming the field,
#: instead of silently taking the class default (a GPU figure). Terms added to the model later
#: keep their defaults when an older profile lacks them.
PROFILE_CORE_FIELDS = frozenset({
    "name", "compute_device", "hbm_bw", "ddr_bw", "uvm_bw", "intra_host_bw", "inter_host_bw",
    "allreduce_bw", "dense_flops", "collective_latency_s", "hbm_cap_bytes", "ddr_cap_bytes",
    "local_world_size", "bwd_factor", "lookup_overhead_s", "row_granularity_bytes",
})

#: The JSON kind of each HardwareProfile field type (and whether null is allowed).
_FIELD_KINDS = {"str": (str, False), "int": (int, False), "float": (float, False), "bool": (bool, False),
                "Optional[float]": (float, True)}


# Presets. GPU numbers are datasheet peaks derated to what TBE kernels and NCCL all-to-all
# sustain in practice (about 50-60% of HBM peak for random row gathers, ~70-80% of link peak).
PRESETS: Dict[str, HardwareProfile] = {
    "h100": HardwareProfile(
        name="h100",
        compute_device="cuda",
        local_world_size=8,
        hbm_cap_bytes=80 * GiB,
        ddr_cap_bytes=256 * GiB,
        hbm_bw=1.8e12,  # HBM3 3.35 TB/s peak
        ddr_bw=60e9,
        uvm_bw=40e9,  # PCIe gen5 x16
        intra_host_bw=350e9,  # NVLink4 450 GB/s per direction
        inter_host_bw=40e9,  # 400 Gb/s NIC per GPU
        allreduce_bw=250e9,
        collective_latency_s=25e-6,
        dense_flops=500e12,
    ),
    "h200": HardwareProfile(
        name="h200",
        compute_device="cuda",
        local_world_size=8,
        hbm_cap_bytes=141 * GiB,
        ddr_cap_bytes=256 * GiB,
        hbm_bw=2.6e12,  # HBM3e 4.8 TB/s peak
        ddr_bw=60e9,
        uvm_bw=40e9,
        intra_host_bw=350e9,
        inter_host_bw=40e9,
        allreduce_bw=250e9,
        collective_latency_s=25e-6,
        dense_flops=550e12,
    ),
    "a100": HardwareProfile(
        name="a100",
        compute_device="cuda",
        local_world_size=8,
        hbm_cap_bytes=80 * GiB,
        ddr_cap_bytes=128 * GiB,
        hbm_bw=1.1e12,  # HBM2e 2.0 TB/s peak
        ddr_bw=40e9,
        uvm_bw=20e9,  # PCIe gen4 x16
        intra_host_bw=200e9,  # NVLink3 300 GB/s per direction
        inter_host_bw=20e9,  # 200 Gb/s NIC per GPU
        allreduce_bw=150e9,
        collective_latency_s=30e-6,
        dense_flops=200e12,
    ),
    # CPU ranks talking over gloo on loopback (measured on the 2-core dev machine; see
    # docs/benchmarks.md). Memory reads are the lookup; there is no separate device memory.
    "cpu-gloo": HardwareProfile(
        name="cpu-gloo",
        compute_device="cpu",
        local_world_size=2,
        hbm_cap_bytes=8 * GiB,
        ddr_cap_bytes=8 * GiB,
        hbm_bw=4e9,
        ddr_bw=4e9,
        uvm_bw=4e9,
        row_granularity_bytes=64,
        bwd_factor=3.0,
        lookup_overhead_s=150e-6,
        intra_host_bw=1.2e9,
        inter_host_bw=1.2e9,
        allreduce_bw=1.0e9,
        collective_latency_s=1.3e-3,
        dense_flops=30e9,
        cache_hit_rate=1.0,
        supports_overlap=False,  # measured: TorchRec's pipelines gain nothing; see effective_pipeline
    ),
}


def get_profile(name: str) -> HardwareProfile:
    """Return a preset by name, or load a calibrated profile from a ``.json`` path."""
    if name.endswith(".json") or os.path.sep in name:
        return HardwareProfile.load(name)
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown hardware profile {name!r}; choose one of {sorted(PRESETS)} "
            "or pass the path of a calibrated profile JSON"
        ) from None


def profile_for_topology(topology: Any, base: Optional[HardwareProfile] = None) -> HardwareProfile:
    """Pick a profile that matches a TorchRec ``Topology``: device kind, ranks per host, memory.

    Without ``base`` a CUDA topology gets the H100-class preset, a CPU one the gloo preset.
    Memory capacities and ranks per host always come from the topology (it is the user's word).
    """
    device = topology.compute_device
    if base is None:
        base = PRESETS["cpu-gloo"] if device == "cpu" else PRESETS["h100"]
    dev0 = topology.devices[0]
    hbm = int(dev0.storage.hbm) if device != "cpu" else int(dev0.storage.ddr)
    ddr = int(dev0.storage.ddr)
    return attrs.evolve(
        base,
        compute_device=device,
        local_world_size=int(topology.local_world_size),
        hbm_cap_bytes=max(hbm, 1),
        ddr_cap_bytes=max(ddr, 0),
    )
