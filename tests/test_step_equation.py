"""One step equation for every solver: a cost term added in one place (a load column in
cost.terms.LOAD_COLUMNS) reaches the evaluator, the LP and integral-choice bounds and the MILP,
and they keep agreeing: bound <= evaluated step, MILP optimum == the evaluator on its plan and ==
the exhaustive optimum, and all of them move by the added term."""

import itertools
import warnings

import attrs
import numpy as np
import pytest

from torchrec_sparselift.cost import terms
from torchrec_sparselift.cost.hardware import PRESETS
from torchrec_sparselift.cost.model import CostContext, DenseWork, phase_table
from torchrec_sparselift.cost.pipelines import PHASE_NAMES
from torchrec_sparselift.search.choice_bound import choice_bound
from torchrec_sparselift.search.equation import Equation, load_maxima, step_vars
from torchrec_sparselift.search.lp import analytic_bound, solve_lp
from torchrec_sparselift.search.milp import solve_milp
from torchrec_sparselift.search.problem import build_problem
from torchrec_sparselift.search.solve import new_evaluator, solve
from search_helpers import _placements, exhaustive_optimum, table_spec

warnings.filterwarnings("ignore", category=FutureWarning)

#: seconds the synthetic term puts on a rank per shard it holds
PER_SHARD_S = 0.4e-3
SYNTHETIC = terms.LoadColumn("synthetic_s", "time", ("lookup",),
                             shard_load=lambda spec, cand, ctx: PER_SHARD_S,
                             doc="a test term: a fixed cost per shard on its rank")


def _problem(seed, W=4, L=2):
    rng = np.random.default_rng(seed)
    specs = [table_spec(i, int(rng.integers(10**3, 10**6)), int(rng.choice([32, 64])), float(rng.uniform(1, 20)))
             for i in range(int(rng.integers(2, 4)))]
    # no TBE group fixed cost: the placement MILP then prices exactly what the evaluator does
    profile = attrs.evolve(PRESETS["h100"], lookup_overhead_s=0.0)
    ctx = CostContext(profile=profile, world_size=W, local_world_size=L, batch_size=512,
                      dense=DenseWork(1e9, 4e6))
    cap = np.full(W, 1e12)
    return build_problem(specs, ctx, cap, cap.copy(), pipelines=("base", "sparse_dist"))


def _plans(prob, rng, n):
    per_table = [[(c, rk) for c in ids for rk in _placements(prob, c)] for ids in prob.candidates]
    allplans = list(itertools.product(*per_table))
    return [allplans[i] for i in rng.choice(len(allplans), size=min(n, len(allplans)), replace=False)]


def _numbers(prob, plans):
    """Per pipeline: every solver's number on ``prob``, and each sampled plan's evaluated step
    and its largest shard count on one rank."""
    out = {}
    for pl in ("base", "sparse_dist"):
        ev = new_evaluator(prob, pl)
        steps, most = [], []
        for plan in plans:
            for t, (c, rk) in enumerate(plan):
                ev.assign(t, c, rk)
            steps.append(ev.objective())
            count = np.zeros(prob.ctx.world_size)
            for c, rk in plan:
                count[list(rk)] += 1
            most.append(count.max())
        m = solve_milp(prob, pl, time_limit_s=60)
        mev = new_evaluator(prob, pl)
        for t, (c, rk) in enumerate(m.assignment):
            mev.assign(t, c, rk)
        out[pl] = {
            "steps": np.array(steps), "most": np.array(most), "opt": exhaustive_optimum(prob, pl),
            "lp": solve_lp(prob, pl).lower_bound_s, "cb": choice_bound(prob, pl, time_limit_s=30),
            "analytic": analytic_bound(prob, pl), "milp": m.objective_s, "milp_status": m.status,
            "milp_plan": mev.objective(), "solve": solve(prob, time_budget_s=1.0, pipeline=pl).step.total_s,
        }
    return out


def _agree(n):
    """The solvers agree with the evaluator on one problem."""
    for pl, v in n.items():
        assert v["milp_status"] == "optimal", pl
        assert v["milp"] == pytest.approx(v["milp_plan"], rel=1e-6), pl  # MILP == evaluator on its plan
        assert v["milp"] == pytest.approx(v["opt"], rel=2e-4), pl  # and == the exhaustive optimum
        for b in ("lp", "cb", "analytic"):
            assert v[b] <= v["opt"] * (1 + 1e-6), (pl, b)  # bounds below every plan
        assert v["solve"] >= v["opt"] * (1 - 1e-9), pl


@pytest.mark.parametrize("seed", range(3))
def test_a_term_registered_in_one_place_moves_evaluator_bounds_and_milp_alike(seed, monkeypatch):
    prob0 = _problem(seed)
    plans = _plans(prob0, np.random.default_rng(seed), 40)
    before = _numbers(prob0, plans)
    _agree(before)

    monkeypatch.setattr(terms, "LOAD_COLUMNS", terms.LOAD_COLUMNS + (SYNTHETIC,))
    prob1 = _problem(seed)  # the same tables and options, priced with the extra column
    assert [c for c in prob1.cands] == [c for c in prob0.cands]
    j = terms.layout().index["synthetic_s"]
    assert all(c.owner[j] == PER_SHARD_S for c in prob1.costs)
    after = _numbers(prob1, plans)
    _agree(after)

    b, a = before["base"], after["base"]
    # base runs every phase in sequence: each plan's step grows by the term's maximum over ranks
    np.testing.assert_allclose(a["steps"] - b["steps"], PER_SHARD_S * b["most"], rtol=1e-9, atol=1e-15)
    for pl in ("base", "sparse_dist"):
        b, a = before[pl], after[pl]
        assert np.all(a["steps"] >= b["steps"] - 1e-15)
        # every plan has a shard somewhere: optimum, MILP and bounds all rise by at least the term
        # (on base, where the lookup is on every path)
        if pl == "base":
            assert a["opt"] >= b["opt"] + PER_SHARD_S * (1 - 1e-9)
            assert a["milp"] >= b["milp"] + PER_SHARD_S * (1 - 1e-4)
            assert a["lp"] >= b["lp"] + PER_SHARD_S * (1 - 1e-5)
            assert a["cb"] >= (b["cb"] + PER_SHARD_S) * (1 - 2e-4)
            assert a["analytic"] >= b["analytic"] + PER_SHARD_S * (1 - 1e-9)


def test_the_term_is_a_named_column_of_every_solver(monkeypatch):
    """The builder declares ``z[synthetic_s]`` and the evaluator's lookup phase adds its maximum."""
    monkeypatch.setattr(terms, "LOAD_COLUMNS", terms.LOAD_COLUMNS + (SYNTHETIC,))
    lay = terms.layout()
    j = lay.index["synthetic_s"]
    assert j in lay.time and lay.phase_columns["lookup"] == (lay.index["fwd_s"], j)
    eq = Equation()
    sv = step_vars(eq, load_maxima(eq))
    assert eq.name_of(sv.z[j]) == "z[synthetic_s]"
    assert eq.name_of(sv.total) == "total"
    ctx = _problem(0).ctx
    cm = np.zeros(lay.width)
    cm[j] = 2e-3
    base = phase_table(np.zeros(lay.width), 0.0, 0, ctx)[0]
    with_term = phase_table(cm, 0.0, 0, ctx)[0]
    assert with_term[PHASE_NAMES.index("lookup")] - base[PHASE_NAMES.index("lookup")] == pytest.approx(2e-3)
    assert np.count_nonzero(with_term - base) == 1


def test_a_malformed_column_is_refused_naming_it():
    with pytest.raises(ValueError, match="needs the phase"):
        terms.LoadColumn("orphan_s", "time")
    with pytest.raises(ValueError, match="bandwidth"):
        terms.LoadColumn("wire_bytes", "link", ("input_dist",))


@pytest.mark.parametrize("profile,W,L", [("h100", 4, 2), ("cpu-gloo", 2, 1)])
def test_the_overlap_kind_s_rows_equal_the_evaluator(profile, W, L):
    """The ``overlap`` kind (split dense phases, three side-by-side blocks) through the one
    builder: the MILP's optimum equals the evaluator on its plan and the exhaustive optimum, the
    bounds stay below it; on CPU gloo across two hosts too, where only this kind overlaps."""
    rng = np.random.default_rng(11)
    specs = [table_spec(i, int(rng.integers(10**3, 10**6)), int(rng.choice([32, 64])), float(rng.uniform(1, 20)))
             for i in range(3)]
    prof = attrs.evolve(PRESETS[profile], lookup_overhead_s=0.0)
    ctx = CostContext(profile=prof, world_size=W, local_world_size=L, batch_size=512,
                      dense=DenseWork(1e7, 4e6, indep_fwd_flops_per_sample=1.5e6))
    cap = np.full(W, 1e12)
    prob = build_problem(specs, ctx, cap, cap.copy(), pipelines=("sparse_dist", "overlap"))
    opt = {pl: exhaustive_optimum(prob, pl) for pl in ("sparse_dist", "overlap")}
    assert opt["overlap"] < opt["sparse_dist"]  # the dense all-reduce and bottom MLP hide something
    m = solve_milp(prob, "overlap", time_limit_s=60)
    assert m.status == "optimal"
    mev = new_evaluator(prob, "overlap")
    for t, (c, rk) in enumerate(m.assignment):
        mev.assign(t, c, rk)
    assert m.objective_s == pytest.approx(mev.objective(), rel=1e-6)
    assert m.objective_s == pytest.approx(opt["overlap"], rel=2e-4)
    for bound in (solve_lp(prob, "overlap").lower_bound_s, choice_bound(prob, "overlap", time_limit_s=30),
                  analytic_bound(prob, "overlap")):
        assert bound <= opt["overlap"] * (1 + 1e-6)


def _lossy_numbers(prob, plans, fwd, bwd):
    """Per pipeline, at comm precisions ``fwd``/``bwd``: the sampled plans' evaluated steps, the
    exhaustive optimum, the bounds and the MILP (objective and its plan evaluated)."""
    out = {}
    for pl in ("base", "sparse_dist"):
        ev = new_evaluator(prob, pl, fwd, bwd)
        steps, best = [], float("inf")
        per_table = [[(c, rk) for c in ids for rk in _placements(prob, c)] for ids in prob.candidates]
        for combo in itertools.product(*per_table):
            for t, (c, rk) in enumerate(combo):
                ev.assign(t, c, rk)
            if ev.memory_ok():
                best = min(best, ev.objective())
        for plan in plans:
            for t, (c, rk) in enumerate(plan):
                ev.assign(t, c, rk)
            steps.append(ev.objective())
        m = solve_milp(prob, pl, fwd, bwd, time_limit_s=60)
        mev = new_evaluator(prob, pl, fwd, bwd)
        for t, (c, rk) in enumerate(m.assignment):
            mev.assign(t, c, rk)
        out[pl] = {"steps": np.array(steps), "opt": best, "milp": m.objective_s, "milp_status": m.status,
                   "milp_plan": mev.objective(), "lp": solve_lp(prob, pl, fwd, bwd).lower_bound_s,
                   "cb": choice_bound(prob, pl, fwd, bwd, time_limit_s=30),
                   "analytic": analytic_bound(prob, pl, fwd, bwd),
                   "solve": solve(prob, time_budget_s=1.0, pipeline=pl, precision=(fwd, bwd)).step.total_s}
    return out


def _with_lossy_terms(prob, codec_byte_s, a2a_host_byte_s):
    ctx = attrs.evolve(prob.ctx, profile=attrs.evolve(prob.ctx.profile, codec_byte_s=codec_byte_s,
                                                      a2a_host_byte_s=a2a_host_byte_s))
    cap = np.full(ctx.world_size, 1e12)
    return build_problem([s for s in prob.specs], ctx, cap, cap.copy(), pipelines=("base", "sparse_dist"))


@pytest.mark.parametrize("seed", range(2))
def test_what_lossy_comms_cost_on_the_rank_reaches_the_evaluator_bounds_and_milp_alike(seed):
    """``cost.model.lossy_byte_s`` (the fp16 codec, ``codec_byte_s``, and the all-to-all's
    full-precision host work, ``a2a_host_byte_s``, per link byte) is priced once, in
    cost.model.phase_table and search.equation.phase_forms: at fp16 every solver still agrees with
    the evaluator, each plan's step rises by it (on ``base``, where both link phases are on the
    path: per link column, its per-byte cost times the column's bytes on the slowest rank), and at
    fp32 nothing moves."""
    from torchrec_sparselift.cost.model import lossy_byte_s

    prob0 = _problem(seed)
    # the h100 preset's links move a byte in 2.9 ps (intra) and 25 ps (inter): a host share of
    # 10 ps is capped at the intra-host link's whole per-byte time
    prob1 = _with_lossy_terms(prob0, 2e-11, 1e-11)
    p1 = prob1.ctx.profile
    assert lossy_byte_s(p1, "fp16", p1.intra_host_bw) == pytest.approx(2e-11 + 0.5 / p1.intra_host_bw)
    assert lossy_byte_s(p1, "fp16", p1.inter_host_bw) == pytest.approx(2e-11 + 0.5 * 1e-11)
    assert lossy_byte_s(p1, "fp8", p1.inter_host_bw) == pytest.approx(2e-11 + 0.75 * 1e-11)
    assert lossy_byte_s(p1, "fp32", p1.inter_host_bw) == 0.0
    plans = _plans(prob0, np.random.default_rng(seed), 30)
    before, after = _lossy_numbers(prob0, plans, "fp16", "fp16"), _lossy_numbers(prob1, plans, "fp16", "fp16")
    _agree(before)
    _agree(after)
    lay = terms.layout()
    out_cols = dict(lay.link_groups)[("output_dist", "grad_dist")]
    ev = new_evaluator(prob1, "base", "fp16", "fp16")
    for k, plan in enumerate(plans):
        for t, (c, rk) in enumerate(plan):
            ev.assign(t, c, rk)
        cm = ev.colmax()
        added = sum(lossy_byte_s(p1, "fp16", getattr(p1, lay.columns[j].bandwidth)) * cm[j] for j in out_cols)
        # both lossy link phases (output_dist and grad_dist) pay it on base's one path
        assert after["base"]["steps"][k] - before["base"]["steps"][k] == pytest.approx(2 * added, rel=1e-6, abs=1e-15)
    assert np.all(after["sparse_dist"]["steps"] >= before["sparse_dist"]["steps"] - 1e-15)
    assert after["base"]["opt"] > before["base"]["opt"]
    fp32_0 = _lossy_numbers(prob0, plans, "fp32", "fp32")["base"]
    fp32_1 = _lossy_numbers(prob1, plans, "fp32", "fp32")["base"]
    np.testing.assert_allclose(fp32_1["steps"], fp32_0["steps"], rtol=1e-12)
    assert fp32_1["milp"] == pytest.approx(fp32_0["milp"], rel=1e-6)
