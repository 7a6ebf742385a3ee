"""The sparse-path rewrites in the one step equation: narrow ids and dedup in every option's
input-dist columns (cost.wire_ids.table_wire -> cost.model.rewrite_wire), read alike by the
evaluator, the LP, the integral-choice bound and the MILP; the batch split priced by the search at
its best k (search.solve.split_price) with bound rows that hold at every k; and the rewrite stage
(plan.rewrites.choose_rewrites) pricing a plan exactly as the search did."""

import itertools
import sys
import warnings
from pathlib import Path

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchrec_sparselift.cost.batch_split import split_step_s
from torchrec_sparselift.cost.hardware import PRESETS
from torchrec_sparselift.cost.model import IN_INTER, IN_INTRA, CostContext, DenseWork, rewrite_wire
from torchrec_sparselift.cost.pipelines import PHASE_NAMES, terms as exposed_terms
from torchrec_sparselift.cost.wire_ids import WireRule, table_wire
from torchrec_sparselift.search.choice_bound import choice_bound
from torchrec_sparselift.search.equation import split_floor_s
from torchrec_sparselift.search.lp import analytic_bound, solve_lp
from torchrec_sparselift.search.milp import solve_milp
from torchrec_sparselift.search.problem import build_problem
from torchrec_sparselift.search.solve import new_evaluator, priced_split, solve, split_terms

sys.path.insert(0, str(Path(__file__).parent))
from search_helpers import _placements, table_spec  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)


def _ctx(W=4, L=2, profile="h100", bw_div=1.0, **dense):
    prof = attrs.evolve(PRESETS[profile], lookup_overhead_s=0.0)
    prof = attrs.evolve(prof, intra_host_bw=prof.intra_host_bw / bw_div, inter_host_bw=prof.inter_host_bw / bw_div)
    return CostContext(profile=prof, world_size=W, local_world_size=L, batch_size=512,
                       dense=DenseWork(dense.get("flops", 1e9), 4e6,
                                       indep_fwd_flops_per_sample=dense.get("indep", 0.0)))


def _specs(seed, n=None, ratio=True):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n or int(rng.integers(2, 4))):
        s = table_spec(i, int(rng.integers(10**3, 10**6)), int(rng.choice([32, 64])), float(rng.uniform(1, 20)))
        if ratio:
            s = attrs.evolve(s, unique_ratio=float(rng.uniform(0.05, 0.9)))
        out.append(s)
    return out


def _rule(ctx, id_dtype="int32", dedup_id_s=None):
    bw = ctx.profile.inter_host_bw if ctx.world_size > ctx.local_world_size else ctx.profile.intra_host_bw
    return WireRule(id_dtype=id_dtype, dedup_id_s=dedup_id_s, bandwidth=bw, batch_size=ctx.batch_size,
                    world_size=ctx.world_size, local_world_size=ctx.local_world_size)


def _problem(specs, ctx, wire=None, split=None, pipelines=("base", "sparse_dist")):
    cap = np.full(ctx.world_size, 1e12)
    return build_problem(specs, ctx, cap, cap.copy(), pipelines=pipelines, wire=wire, split_overhead_s=split)


def _all_plans(prob):
    per_table = [[(c, rk) for c in ids for rk in _placements(prob, c)] for ids in prob.candidates]
    return list(itertools.product(*per_table))


def _optimum(prob, pipeline, split=False):
    """The best price over every plan: the evaluator's objective, or with ``split`` the search's
    split price (search.solve.priced_split)."""
    ev = new_evaluator(prob, pipeline)
    best = float("inf")
    for plan in _all_plans(prob):
        for t, (c, rk) in enumerate(plan):
            ev.assign(t, c, rk)
        best = min(best, priced_split(ev, prob)[1] if split else ev.objective())
    return best


# -- narrow ids and dedup: one source for every solver -----------------------------------------

def test_every_option_s_input_columns_are_the_wire_function_s():
    ctx = _ctx()
    specs = _specs(0)
    rule = _rule(ctx, "int32", 1e-12)
    prob = _problem(specs, ctx, rule)
    assert prob.wire == rule and prob.plain_costs is not None
    for i, (cand, cost, plain) in enumerate(zip(prob.cands, prob.costs, prob.plain_costs)):
        tw = table_wire(rule, specs[cand.table], cand.sharding_type, cand.num_shards)
        want = rewrite_wire(plain, tw.factor, tw.kernel_s, cand.num_shards, ctx)
        np.testing.assert_array_equal(cost.owner, want.owner)
        np.testing.assert_array_equal(cost.peers, want.peers)
        assert prob.dedup_of[i] == tw.dedup_features
        if cand.sharding_type == "data_parallel":
            assert tw.factor == 1.0 and not tw.dedup_features
        else:  # narrow ids never send more; int32 lengths and ids: at least a third off the ids' bytes
            assert tw.factor < 1.0
            for j in (IN_INTRA, IN_INTER):
                assert cost.owner[j] <= plain.owner[j] + 1e-9
    assert any(prob.dedup_of)  # low distinct-id ratios at a small kernel cost: some feature pays


def test_an_inactive_rule_leaves_the_problem_as_torchrec_sends_it():
    ctx = _ctx()
    prob = _problem(_specs(1), ctx, _rule(ctx, "int64", None))
    assert prob.wire is None and prob.plain_costs is None and prob.dedup_of == ()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), id_dtype=st.sampled_from(["int32", "int64"]),
       dedup=st.sampled_from([None, 1e-12, 2e-11]), hosts=st.sampled_from([1, 2]))
def test_with_the_wire_terms_the_milp_equals_the_evaluator_and_the_bounds_stay_below(seed, id_dtype, dedup, hosts):
    """On random small problems with the wire rewrites priced: the MILP's optimum equals the
    evaluator on its plan and the exhaustive optimum (the rows price what the evaluator prices),
    the LP, integral-choice and analytic bounds stay below it, and the search's plan is never
    better than it; narrowing or deduplicating never raises the optimum."""
    ctx = _ctx(W=4, L=4 // hosts)
    specs = _specs(seed)
    rule = _rule(ctx, id_dtype, dedup)
    prob = _problem(specs, ctx, rule)
    plain = _problem(specs, ctx)
    for pl in ("base", "sparse_dist"):
        opt = _optimum(prob, pl)
        m = solve_milp(prob, pl, time_limit_s=60)
        assert m.status == "optimal"
        mev = new_evaluator(prob, pl)
        for t, (c, rk) in enumerate(m.assignment):
            mev.assign(t, c, rk)
        assert m.objective_s == pytest.approx(mev.objective(), rel=1e-6)
        assert m.objective_s == pytest.approx(opt, rel=2e-4)
        for bound in (solve_lp(prob, pl).lower_bound_s, choice_bound(prob, pl, time_limit_s=30),
                      analytic_bound(prob, pl)):
            assert bound <= opt * (1 + 1e-6)
        assert solve(prob, time_budget_s=1.0, pipeline=pl).step.total_s >= opt * (1 - 1e-9)
        if rule.active:
            assert opt <= _optimum(plain, pl) * (1 + 1e-9)


def _narrow_changes_the_sharding():
    """A problem where int32 ids change the optimal sharding: one table whose data-parallel
    replica's all-reduce roughly ties its table-wise option's id traffic at int64."""
    ctx = _ctx(W=2, L=1, flops=1e6, bw_div=20)
    spec = table_spec(0, 580_000, 16, 30.0, types=("table_wise", "data_parallel"))
    return ctx, [spec]


def test_narrow_ids_change_the_chosen_sharding():
    ctx, specs = _narrow_changes_the_sharding()
    wide, narrow = _problem(specs, ctx), _problem(specs, ctx, _rule(ctx, "int32"))

    def best_type(prob):
        ev = new_evaluator(prob, "base")
        scored = []
        for plan in _all_plans(prob):
            for t, (c, rk) in enumerate(plan):
                ev.assign(t, c, rk)
            scored.append((ev.objective(), prob.cands[plan[0][0]].sharding_type))
        return min(scored)[1]

    assert best_type(wide) == "data_parallel"
    assert best_type(narrow) == "table_wise"
    assert solve(narrow, time_budget_s=1.0, pipeline="base").assignment[0][0] in [
        i for i, c in enumerate(narrow.cands) if c.sharding_type == "table_wise"]


# -- the batch split in the search -------------------------------------------------------------

def _split_problem(seed, overhead=2e-6, W=4, L=2, bw_div=30.0, id_dtype=None):
    ctx = _ctx(W=W, L=L, bw_div=bw_div, flops=3e8, indep=5e7)
    wire = _rule(ctx, id_dtype, 1e-12) if id_dtype else None
    return _problem(_specs(seed, ratio=wire is not None), ctx, wire, overhead, pipelines=("sparse_dist", "overlap"))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), overhead=st.sampled_from([0.0, 2e-6, 2e-4]),
       id_dtype=st.sampled_from([None, "int32", "int64"]))
def test_the_bound_stays_below_the_split_optimum_at_every_k(seed, overhead, id_dtype):
    """With the split allowed (and the wire rewrites, where drawn), the search prices ``overlap``
    at its best k; the LP, choice, analytic and MILP bounds stay at or below the exhaustive
    optimum of that price, and that price is never above the unsplit one."""
    prob = _split_problem(seed, overhead, id_dtype=id_dtype)
    opt = _optimum(prob, "overlap", split=True)
    assert opt <= _optimum(prob, "overlap") * (1 + 1e-12)
    m = solve_milp(prob, "overlap", time_limit_s=60)
    for bound in (solve_lp(prob, "overlap").lower_bound_s, choice_bound(prob, "overlap", time_limit_s=30),
                  analytic_bound(prob, "overlap"), m.bound_s):
        assert bound <= opt * (1 + 1e-6)
    res = solve(prob, time_budget_s=1.0)
    assert res.lower_bound_s <= res.priced_step_s * (1 + 1e-12)
    if res.pipeline == "overlap":
        assert res.priced_step_s >= opt * (1 - 1e-9)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), overhead=st.sampled_from([0.0, 2e-6, 2e-4]), bw_div=st.sampled_from([1.0, 30.0]))
def test_the_split_price_is_between_the_floor_rows_and_the_unsplit_step(seed, overhead, bw_div):
    """On random plans: the floor the bound's rows take (search.equation.split_floor_s on the
    exposed phases) <= the search's split price <= the unsplit step, and the price at the chosen
    k is the split schedule's saving taken off the unsplit step (where the floor does not bind)."""
    prob = _split_problem(seed % 7, overhead, bw_div=bw_div)
    rng = np.random.default_rng(seed)
    plans = _all_plans(prob)
    ev = new_evaluator(prob, "overlap")
    for i in rng.choice(len(plans), size=min(5, len(plans)), replace=False):
        for t, (c, rk) in enumerate(plans[i]):
            ev.assign(t, c, rk)
        unsplit = ev.objective()
        k, price = priced_split(ev, prob)
        ph = ev.phases()
        floor = split_floor_s(exposed_terms(ph, prob.ctx.profile.supports_overlap))
        assert floor <= price * (1 + 1e-12) and price <= unsplit * (1 + 1e-12)
        terms = split_terms(ev, overhead)
        saved = split_step_s(terms, 1) - split_step_s(terms, k)
        assert price == pytest.approx(max(unsplit - saved, min(unsplit, floor)), rel=1e-12, abs=1e-15)


def test_a_problem_without_the_split_prices_overlap_unsplit():
    ctx = _ctx(bw_div=30.0, flops=3e8, indep=5e7)
    prob = _problem(_specs(3, ratio=False), ctx, None, None, pipelines=("overlap",))
    ev = new_evaluator(prob, "overlap")
    for t, (c, rk) in enumerate(_all_plans(prob)[0]):
        ev.assign(t, c, rk)
    assert priced_split(ev, prob) == (1, ev.objective())
    assert PHASE_NAMES  # the phases the floor reads are the cost model's


# -- the rewrite stage prices what the search priced ----------------------------------------------

@pytest.mark.parametrize("pipelines", [["overlap"], ["sparse_dist"], ["overlap", "sparse_dist", "fused"]])
def test_the_stage_prices_the_search_s_plan_as_the_search_did(pipelines):
    """For the plan the search chose, the rewrite stage's step equals the search's priced step
    (the wire terms in its loads, the split at the same k), its id dtype is the one the search
    priced, and the plan's prediction is that step."""
    from test_rewrite_stage import COMM_HEAVY, _plan, _profile

    _planner, res = _plan(_profile(**COMM_HEAVY), pipelines=pipelines)
    s, r = res.search, res.rewrites
    assert res.problem.wire is not None and r.id_dtype == res.problem.wire.id_dtype == "int32"
    assert r.step_s == pytest.approx(s.priced_step_s, rel=1e-12)
    assert r.batch_split == s.split_chunks
    assert res.step_time_s == pytest.approx(r.step_s, rel=1e-12)
    # the step without the rewrites is the same plan on TorchRec's int64 input dist, unsplit
    assert r.step_without_s >= s.step.total_s * (1 - 1e-12) and r.input_dist_saved_s > 0


def test_explain_shows_the_rewrites_as_the_search_priced_them():
    """The stored choice says which rewrites the search priced; a stored plan explained again
    draws its timeline on the phases with its wire rewrites, the ones its step was priced on."""
    from test_rewrite_stage import COMM_HEAVY, TABLES, _model, _plan, _profile
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    from torchrec_sparselift.explain import format_rewrites, reprice_plan
    from torchrec_sparselift.plan.planning import execution_plan

    planner, res = _plan(_profile(**COMM_HEAVY))
    assert set(res.rewrites.in_search) == {"batch_split", "id_dtype", "dedup"}
    ep = execution_plan(planner.last_request, res)
    lines = format_rewrites(ep.planner_info)
    assert any("priced in the search's step equation: id_dtype, dedup, batch_split" in line for line in lines)
    topo = Topology(world_size=8, local_world_size=8, compute_device="cuda", hbm_cap=80 << 30)
    cons = {f"t{i}": ParameterConstraints(sharding_types=["table_wise"]) for i in range(TABLES)}
    repriced = reprice_plan(ep, planner, _model(), cons, topo, 2048, planner.profile(), top=2)
    rw = repriced.evaluated.rewrites
    assert rw.phases["input_dist"] == pytest.approx(res.rewrites.phases["input_dist"], rel=1e-9)
    assert rw.phases["input_dist"] < repriced.evaluated.search.step.phases["input_dist"]
    drawn = [s for s in repriced.segments if s.phase == "input_dist"]
    assert drawn and sum(s.duration_s for s in drawn) == pytest.approx(rw.phases["input_dist"], rel=1e-9)


# -- the rows, evaluated at a plan, are the evaluator's price ----------------------------------------

def _form_value(form, values):
    entries, const = form
    return sum(a * values.get(v, 0.0) for v, a in entries) + const


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), id_dtype=st.sampled_from(["int32", "int64"]),
       dedup=st.sampled_from([None, 1e-12]), hosts=st.sampled_from([1, 2]),
       pipeline=st.sampled_from(["base", "sparse_dist", "overlap"]), split=st.booleans())
def test_the_rows_with_the_rewrites_equal_the_evaluator_on_random_plans(seed, id_dtype, dedup, hosts, pipeline, split):
    """At a random plan's column maxima, every phase form of the step equation (search.equation:
    the input dist with the wire terms in its columns) equals the evaluator's phase, and the
    pipeline's rows give the evaluator's step; for ``overlap`` with the split allowed the floor
    rows give ``min(1, factor)`` times the split's floor, never above the search's split price."""
    from torchrec_sparselift.search.equation import (
        MS, Equation, column_scale, composition_rows, fixed_terms, lossy_coefficients, phase_forms,
        precision_scales, split_floor_rows, step_vars, load_maxima,
    )
    from torchrec_sparselift.cost.terms import layout

    ctx = _ctx(W=4, L=4 // hosts, flops=3e8, indep=5e7)
    ctx = attrs.evolve(ctx, profile=attrs.evolve(ctx.profile, collective_latency_s=0.0))  # no latency vars
    rule = _rule(ctx, id_dtype, dedup)
    prob = _problem(_specs(seed), ctx, rule, 2e-6 if split else None, pipelines=("base", "sparse_dist", "overlap"))
    rng = np.random.default_rng(seed)
    plans = _all_plans(prob)
    ev = new_evaluator(prob, pipeline)
    for t, (c, rk) in enumerate(plans[int(rng.integers(len(plans)))]):
        ev.assign(t, c, rk)
    eq = Equation()
    sv = step_vars(eq, load_maxima(eq))
    lay = layout()
    zval = ev.colmax() * column_scale(ctx.profile)
    values = {sv.z[j]: float(zval[j]) for j in lay.time}
    for phases, cols in lay.link_groups:
        values[sv.link[phases]] = max(float(zval[j]) for j in cols)
    exposed = exposed_terms(ev.phases(), ctx.profile.supports_overlap)
    values[sv.allreduce] = MS * float(exposed["allreduce"])
    ft = fixed_terms(ctx, split=split)
    forms = phase_forms(sv, ft.constants(), precision_scales(), latency=0.0,
                        lossy=lossy_coefficients(ft.lossy_per_z))
    for name in PHASE_NAMES:
        if name in ("dense_fwd", "dense_bwd"):
            continue  # the split parts carry them
        assert _form_value(forms[name], values) == pytest.approx(MS * float(exposed[name]), rel=1e-9, abs=1e-12), name
    factor = ft.step_factors.get(pipeline, 1.0)
    itot = sv.total
    if split and pipeline == "overlap":
        rows = split_floor_rows(forms, itot, factor)
    else:
        rows = composition_rows(pipeline, forms, itot, ft.overlap, ft.spans_hosts, factor)
    # each row: entries - total <= rhs, i.e. total >= entries - rhs
    need = max(sum(a * values.get(v, 0.0) for v, a in e if v != itot) - rhs for e, rhs in rows)
    if split and pipeline == "overlap":
        assert need == pytest.approx(MS * min(1.0, factor) * split_floor_s(exposed), rel=1e-9)
        assert need <= MS * priced_split(ev, prob)[1] * (1 + 1e-9)
    else:
        assert need == pytest.approx(MS * ev.objective(), rel=1e-9)
