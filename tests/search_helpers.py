"""What the search tests share: the ``TableSpec`` their small problems are built from and the
exhaustive optimum their bounds are checked against, and random batch-split terms (one copy,
not one per test file)."""

import itertools

from hypothesis import strategies as st

from torchrec_sparselift.cost.batch_split import SplitTerms
from torchrec_sparselift.search.solve import new_evaluator
from torchrec_sparselift.semantics.tables import TableSpec

TYPES = ("table_wise", "column_wise", "row_wise", "table_row_wise", "data_parallel")


_T = st.floats(0.0, 0.2, allow_nan=False, allow_infinity=False)


@st.composite
def split_terms_st(draw) -> SplitTerms:  # type: ignore[no-untyped-def]
    """Random batch-split terms (phase times up to 0.2 s, a chunk latency within the smaller
    collective), for the split pricing's hypothesis tests."""
    out, grad = draw(_T), draw(_T)
    lat = draw(st.floats(0.0, 1.0)) * min(out, grad)
    return SplitTerms(
        input_dist_s=draw(_T), uvm_fetch_s=draw(_T), lookup_s=draw(_T), output_dist_s=out,
        dense_fwd_indep_s=draw(_T), dense_fwd_rest_s=draw(_T), dense_bwd_rest_s=draw(_T),
        dense_bwd_indep_s=draw(_T), grad_dist_s=grad, backward_update_s=draw(_T), allreduce_s=draw(_T),
        step_overhead_s=draw(_T), chunk_latency_s=lat, chunk_overhead_s=draw(st.floats(0.0, 0.01)),
        chunk_feature_s=draw(st.floats(0.0, 1e-4)), features=draw(st.integers(0, 200)),
    )


def table_spec(i, rows, dim, pf, types=TYPES, *, pooled=True, batch_size=512):
    """Table ``t{i}`` read by feature ``f{i}``: ``rows`` x ``dim`` fp32, pooling factor ``pf``,
    offered ``types`` (data-parallel with the dense kernel, the others fused)."""
    return TableSpec(
        module_path="m", name=f"t{i}", num_embeddings=rows, embedding_dim=dim,
        feature_names=(f"f{i}",), pooling_factor=pf, is_pooled=pooled, elem_bytes=4,
        sharding_types=types,
        compute_kernels=tuple((t, ("dense",) if t == "data_parallel" else ("fused",)) for t in types),
        batch_size=batch_size,
    )


def _placements(prob, cand):
    c = prob.cands[cand]
    W = prob.ctx.world_size
    if c.placement == "all":
        return [tuple(range(c.num_shards))]
    if c.placement == "host":
        L = c.num_shards
        return [tuple(range(h * L, (h + 1) * L)) for h in range(W // L)]
    return list(itertools.combinations(range(W), c.num_shards))


def exhaustive_optimum(prob, pipeline):
    """The best step time over every option choice and placement (the evaluator's objective,
    per-rank memory enforced); inf when nothing fits."""
    per_table = [[(c, rk) for c in ids for rk in _placements(prob, c)] for ids in prob.candidates]
    ev = new_evaluator(prob, pipeline)
    best = float("inf")
    for combo in itertools.product(*per_table):
        for t, (c, rk) in enumerate(combo):
            ev.assign(t, c, rk)
        if ev.memory_ok():
            best = min(best, ev.objective())
    return best


def meta_ebc(n, rows, dim=64):
    """An ``EmbeddingBagCollection`` of ``n`` tables on the meta device (plan-only tests): table
    ``t{i}`` has ``rows * (i + 1)`` rows of ``dim`` and one feature ``f{i}``."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows * (i + 1),
                                   feature_names=[f"f{i}"]) for i in range(n)],
        device=torch.device("meta"))


def random_ranks(rng, prob, cand):
    """Random valid ranks for candidate ``cand``'s shards (its placement rule)."""
    c = prob.cands[cand]
    W = prob.ctx.world_size
    if c.placement == "all":
        return tuple(range(c.num_shards))
    if c.placement == "host":
        h = int(rng.integers(0, W // c.num_shards))
        return tuple(range(h * c.num_shards, (h + 1) * c.num_shards))
    return tuple(int(r) for r in rng.choice(W, size=c.num_shards, replace=False))


def random_moves(ev, prob, rng, n):
    """``n`` random steps on evaluator ``ev``: unassign a placed table (30%) or place a table with
    a random option at random ranks; after each placement yields the objective
    ``ev.move_objective`` predicted for it (the incremental evaluator's property tests)."""
    for _ in range(n):
        t = int(rng.integers(0, prob.num_tables))
        if t in ev.assignment and rng.random() < 0.3:
            ev.unassign(t)
            continue
        cand = int(rng.choice(prob.candidates[t]))
        ranks = random_ranks(rng, prob, cand)
        predicted = ev.move_objective(t, cand, ranks)
        ev.assign(t, cand, ranks)
        yield predicted
