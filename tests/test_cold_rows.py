"""The per-id cost of lookups in shards beyond the cache (``cold_row_s``, cost/terms.py): the pure
cost math, where it lands in a plan's loads and step, how the kernel fit and the step fit recover
it, and that profiles written before it load with its prior."""

from __future__ import annotations

import json
import random

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrec_sparselift.calibration.kernel_fit import fit_lookups, predict_lookup
from torchrec_sparselift.calibration.records import LookupRecord
from torchrec_sparselift.calibration.step_fit import (
    CPU_STEP_TERMS,
    FitCase,
    StepFitInfo,
    fit_step_profile,
    fit_terms,
    linearize,
    with_terms,
)
from torchrec_sparselift.calibration.store import base_profile, stored_profile_problems, with_base_terms
from torchrec_sparselift.cost import terms
from torchrec_sparselift.cost.hardware import PRESETS, HardwareProfile
from torchrec_sparselift.cost.model import CostContext, shard_cost, step_time
from torchrec_sparselift.semantics.graph import candidate_for
from torchrec_sparselift.semantics.tables import TableSpec

from search_helpers import table_spec

MiB = 1 << 20
CPU = attrs.evolve(PRESETS["cpu-gloo"], cold_row_s=80e-9, lookup_cache_bytes=MiB)
COLD = terms.layout().index["cold_rows_s"]


def _spec(rows: int, dim: int = 64, pf: float = 2.0, batch: int = 512) -> TableSpec:
    return table_spec(rows, rows, dim, pf, batch_size=batch)


def test_cold_row_seconds_is_zero_within_the_cache_and_the_miss_share_beyond_it():
    assert terms.cold_row_seconds(1000, MiB, CPU) == 0.0
    assert terms.cold_row_seconds(1000, MiB // 2, CPU) == 0.0
    assert terms.cold_row_seconds(1000, 4 * MiB, CPU) == pytest.approx(1000 * 80e-9 * 0.75)
    assert terms.cold_row_seconds(0, 4 * MiB, CPU) == 0.0
    for name in ("h100", "h200", "a100", "cpu-gloo"):  # presets: the term is off
        assert PRESETS[name].cold_row_s == 0.0
        assert terms.cold_row_seconds(1e6, 1e12, PRESETS[name]) == 0.0


@settings(max_examples=200, deadline=None)
@given(ids=st.floats(1, 1e7), small=st.floats(1, 1e11), grow=st.floats(1.0, 1e3),
       cache=st.integers(1, 1 << 30), c=st.floats(0, 1e-6))
def test_cold_row_seconds_never_decreases_as_the_shard_grows_and_stays_below_the_per_id_rate(
        ids, small, grow, cache, c):
    p = attrs.evolve(CPU, cold_row_s=c, lookup_cache_bytes=cache)
    a = terms.cold_row_seconds(ids, small, p)
    b = terms.cold_row_seconds(ids, small * grow, p)
    assert 0.0 <= a <= b + 1e-18
    assert b <= ids * c * (1 + 1e-12)
    # linear in the ids it prices
    assert terms.cold_row_seconds(2 * ids, small, p) == pytest.approx(2 * a, abs=1e-18)


def test_a_large_table_puts_its_cold_lookups_on_its_owner_and_the_backward_phase():
    spec = _spec(200_000)  # 51 MB
    ctx = CostContext(profile=CPU, world_size=2, local_world_size=2, batch_size=512)
    tw = shard_cost(spec, candidate_for(0, spec, "table_wise", "fused", 2, 2), ctx)
    ids = 512 * 2 * 2.0  # the job's batch of ids, all looked up on the owner
    assert tw.owner[COLD] == pytest.approx(ids * 80e-9 * (1 - MiB / (200_000 * 64 * 4)))
    assert tw.peers[COLD] == 0.0
    # row-wise: each shard looks up its half of the ids in half the bytes, so the job pays less
    rw = shard_cost(spec, candidate_for(0, spec, "row_wise", "fused", 2, 2), ctx)
    assert 0 < rw.owner[COLD] < tw.owner[COLD] / 2
    # a table within the cache pays nothing
    small = _spec(2_000)
    assert shard_cost(small, candidate_for(0, small, "table_wise", "fused", 2, 2), ctx).owner[COLD] == 0.0
    # the step: the column adds to backward_update, once
    off = attrs.evolve(ctx, profile=attrs.evolve(CPU, cold_row_s=0.0))
    loads_off = shard_cost(spec, candidate_for(0, spec, "table_wise", "fused", 2, 2), off).owner
    on = step_time(tw.owner, 0.0, 1, ctx)
    before = step_time(loads_off, 0.0, 1, off)
    assert on.phases["backward_update"] - before.phases["backward_update"] == pytest.approx(tw.owner[COLD])
    assert on.total_s - before.total_s == pytest.approx(tw.owner[COLD])


def test_the_kernel_fit_recovers_the_cold_row_cost_from_lookups_of_growing_tables():
    truth = attrs.evolve(PRESETS["cpu-gloo"], hbm_bw=6e9, ddr_bw=6e9, uvm_bw=6e9, row_granularity_bytes=64,
                         lookup_overhead_s=120e-6, bwd_factor=2.2, cold_row_s=60e-9, lookup_cache_bytes=MiB)
    rng = random.Random(0)
    recs = []
    for rows in (1_000, 10_000, 100_000, 1_000_000):
        for dim in (16, 64, 128):
            for pooling in (1, 8, 64):
                for phase in ("fwd", "fwd_bwd"):
                    r = LookupRecord(kernel="fbgemm_tbe", device="cpu", phase=phase, rows=rows, dim=dim,
                                     batch_size=512, pooling=pooling, seconds=1.0)
                    recs.append(attrs.evolve(r, seconds=predict_lookup(truth, r) * (1 + rng.uniform(-0.01, 0.01))))
    params, _diag = fit_lookups(attrs.evolve(truth, cold_row_s=0.0), recs)
    assert params["cold_row_s"] == pytest.approx(60e-9, rel=0.1)
    # tables all within the cache: nothing to fit it from, it is left out
    within = [r for r in recs if r.rows * r.dim * 4 <= MiB]
    assert "cold_row_s" not in fit_lookups(truth, within)[0]


def _plan_pricer(rows_list, kind):
    """``profile -> step seconds`` of one table-wise or row-wise plan of tables ``rows_list``
    (the cost model itself, no torchrec)."""
    specs = [_spec(r, pf=1.0 + i % 3) for i, r in enumerate(rows_list)]

    def price(p: HardwareProfile) -> float:
        ctx = CostContext(profile=p, world_size=2, local_world_size=2, batch_size=512)
        loads = np.zeros((2, terms.layout().width))
        for i, s in enumerate(specs):
            c = shard_cost(s, candidate_for(i, s, kind, "fused", 2, 2), ctx)
            loads[i % 2] += c.owner
            loads += c.peers
        return step_time(loads.max(axis=0), 0.0, 1, ctx).total_s

    return price


def test_the_step_fit_recovers_cold_row_s_from_plans_with_large_and_small_tables():
    base = PRESETS["cpu-gloo"]
    truth = with_terms(base, {"cold_row_s": 90e-9, "1/lookup_bw": 1 / 3e9, "step_overhead_s": 4e-3},
                       CPU_STEP_TERMS)
    cases = []
    for tables in ([2_000, 3_000, 1_000, 500], [200_000, 100_000, 40_000, 2_000], [50_000, 30_000],
                   [400_000, 1_000], [8_000, 12_000, 16_000, 20_000]):
        for kind in ("table_wise", "row_wise"):
            pr = _plan_pricer(tables, kind)
            cases.append(FitCase(f"{tables}/{kind}", pr(truth), pr))
    fitted, fit = fit_step_profile(cases, base, CPU_STEP_TERMS, iterations=3, prior_weight=1e-8)
    assert fit.mape < 0.005
    assert fitted.cold_row_s == pytest.approx(90e-9, rel=0.05)
    # plans of tables within the cache (<= 768 KB) do not depend on it: a fit of them alone keeps
    # the term at its prior (not determined)
    small = [c for c in cases if c.label.startswith("[2000, ")]
    for c in small:
        assert linearize(c.predict, base, CPU_STEP_TERMS)[1]["cold_row_s"] == 0.0
    _p, fit_small = fit_step_profile(small, base, CPU_STEP_TERMS, iterations=1)
    assert "cold_row_s" not in fit_small.determined


def test_a_profile_written_before_the_term_loads_with_its_prior_and_is_flagged_for_calibration(tmp_path):
    d = {"schema": "sparselift.hardware_profile/1", **attrs.asdict(PRESETS["cpu-gloo"])}
    del d["cold_row_s"], d["lookup_cache_bytes"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(d))
    p = HardwareProfile.load(str(path))
    assert p.cold_row_s == 0.0 and p.lookup_cache_bytes == MiB
    # a step fit stored before the term: calibrate check / hardware="auto" name it
    values = {t.name: 1e-6 for t in CPU_STEP_TERMS if t.name != "cold_row_s"}
    info = StepFitInfo(fit={"values": values}, model_version=2)
    assert info.missing_terms() == ["cold_row_s"]
    assert any("cold_row_s" in m for m in stored_profile_problems(info))
    # hardware="auto" prices with the base profile's value of the term meanwhile (its prior), not 0
    base = base_profile("cpu")
    assert base.cold_row_s > 0
    assert with_base_terms(p, info, base).cold_row_s == base.cold_row_s
    fitted = StepFitInfo(fit={"values": {**values, "cold_row_s": 0.0}}, model_version=2)
    assert with_base_terms(p, fitted, base) == p  # a fitted value (even 0) is kept
    with pytest.raises(ValueError, match="lookup_cache_bytes"):
        attrs.evolve(CPU, lookup_cache_bytes=0)


def test_fit_terms_takes_the_cold_term_like_any_other():
    """Synthetic records: quantities of cold ids and bytes, the linear fit recovers both."""
    rng = np.random.default_rng(0)
    recs = []
    from torchrec_sparselift.calibration.step_fit import FitRecord

    for i in range(30):
        q = {"cold_row_s": float(rng.uniform(0, 5e4)), "1/lookup_bw": float(rng.uniform(1e6, 5e7))}
        m = 2e-3 + q["cold_row_s"] * 70e-9 + q["1/lookup_bw"] / 4e9
        recs.append(FitRecord(label=str(i), quantities=q, fixed_s=2e-3, measured_s=m))
    fit = fit_terms(recs, {"cold_row_s": 0.0, "1/lookup_bw": 1 / 1e9})
    assert fit.values["cold_row_s"] == pytest.approx(70e-9, rel=1e-3)
    assert fit.values["1/lookup_bw"] == pytest.approx(1 / 4e9, rel=1e-3)


def test_the_kernel_fit_leaves_the_cold_row_cost_out_of_gpu_records():
    truth = attrs.evolve(PRESETS["h100"], cold_row_s=0.0)
    recs = [LookupRecord(kernel="fbgemm_tbe", device="cuda", phase=ph, rows=rows, dim=dim, batch_size=4096,
                         pooling=pf, seconds=1.0)
            for rows in (10_000, 4_000_000) for dim in (64, 128) for pf in (1, 16) for ph in ("fwd", "fwd_bwd")]
    recs = [attrs.evolve(r, seconds=predict_lookup(truth, r)) for r in recs]
    assert "cold_row_s" not in fit_lookups(truth, recs)[0]
