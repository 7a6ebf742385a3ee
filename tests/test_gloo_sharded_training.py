"""2 gloo ranks: an EmbeddingBagCollection planned by SparseLiftPlanner and sharded by
DistributedModelParallel computes what the unsharded module computes, and trains."""

from __future__ import annotations

from typing import Dict, List

import pytest

from launcher import run_ranks

pytestmark = pytest.mark.multiprocess

WORLD_SIZE = 2
BATCH = 8
# name -> (rows, dim, sharding type forced through ParameterConstraints, or None: planner's choice)
TABLES = {
    "t_row": (96, 16, "row_wise"),
    "t_twrw": (80, 16, "table_row_wise"),
    "t_col": (64, 32, "column_wise"),
    "t_tw": (50, 16, "table_wise"),
    "t_dp": (40, 16, "data_parallel"),
    "t_free": (120, 16, None),
}


def _configs():
    from torchrec import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"])
        for n, (r, d, _) in TABLES.items()
    ]


def _batch(rank: int, step: int = 0):
    """Rank-local KJT with bags of 0-3 ids per sample for every feature (deterministic)."""
    import torch
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 * rank + step)
    keys, lengths, values = [], [], []
    for n, (rows, _, _) in TABLES.items():
        ln = torch.randint(0, 4, (BATCH,), generator=g)
        keys.append(f"f_{n}")
        lengths.append(ln)
        values.append(torch.randint(0, rows, (int(ln.sum()),), generator=g))
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def _planner(constrain: bool):
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    from torchrec_sparselift import SparseLiftPlanner

    constraints = None
    if constrain:
        constraints = {
            n: ParameterConstraints(sharding_types=[st], min_partition=8 if st == "column_wise" else None)
            for n, (_, _, st) in TABLES.items()
            if st is not None
        }
    topology = Topology(world_size=WORLD_SIZE, local_world_size=WORLD_SIZE, compute_device="cpu")
    return SparseLiftPlanner(topology=topology, batch_size=BATCH, constraints=constraints)


def _copy_weights_in(dmp, reference: Dict[str, "object"]) -> None:
    """Write the unsharded reference weights into every local shard of ``dmp``."""
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    with torch.no_grad():
        for fqn, t in dmp.state_dict().items():
            table = fqn.split(".")[-2]
            full = reference[table]
            if isinstance(t, ShardedTensor):
                for shard in t.local_shards():
                    (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(full[r0 : r0 + nr, c0 : c0 + nc])
            else:
                t.copy_(full)


def _sharded_vs_reference(rank: int, world_size: int, constrain: bool) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.manual_seed(0)  # the same reference weights on every rank
    reference = EmbeddingBagCollection(tables=_configs(), device=torch.device("cpu"))
    ref_weights = {n: reference.embedding_bags[n].weight.detach().clone() for n in TABLES}

    sharded = EmbeddingBagCollection(tables=_configs(), device=torch.device("meta"))
    plan = _planner(constrain).collective_plan(sharded, get_default_sharders(), dist.GroupMember.WORLD)
    module_plan = plan.plan[""]
    summary = {n: (ps.sharding_type, ps.compute_kernel, sorted(set(ps.ranks or []))) for n, ps in module_plan.items()}

    lr = 0.1
    apply_optimizer_in_backward(torch.optim.SGD, sharded.parameters(), {"lr": lr})
    dmp = DistributedModelParallel(sharded, device=torch.device("cpu"), plan=plan, sharders=get_default_sharders())
    _copy_weights_in(dmp, ref_weights)

    kjt = _batch(rank)
    expected = reference(kjt)
    got = dmp(kjt)
    if hasattr(got, "wait"):
        got = got.wait()
    max_err = {k: float((got[k] - expected[k]).detach().abs().max()) for k in expected.keys()}

    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))  # data-parallel tables
    optimizers = [dmp.fused_optimizer]
    if dense_params:
        optimizers.append(KeyedOptimizerWrapper(dense_params, lambda ps: torch.optim.SGD(ps, lr=lr)))
    optimizer = CombinedOptimizer(optimizers)
    target = 1.0
    losses: List[float] = []
    before = {k: got[k].detach().clone() for k in got.keys()}
    for step in range(5):
        optimizer.zero_grad()
        out = dmp(kjt)
        if hasattr(out, "wait"):
            out = out.wait()
        loss = sum(((out[k].sum(dim=1) - target) ** 2).mean() for k in out.keys())
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        after = dmp(kjt)
        if hasattr(after, "wait"):
            after = after.wait()
    # a feature whose bags are all empty on this rank has nothing to learn here
    changed = {
        k: bool((after[k] - before[k]).abs().max() > 1e-6) for k in before.keys() if kjt[k].values().numel() > 0
    }
    return dict(summary=summary, max_err=max_err, losses=losses, changed=changed)


def _both_variants(rank: int, world_size: int) -> dict:
    """One process group for both plans: with every CPU sharding type forced, and unconstrained."""
    return dict(constrained=_sharded_vs_reference(rank, world_size, True), free=_sharded_vs_reference(rank, world_size, False))


@pytest.fixture(scope="module")
def runs() -> List[dict]:
    # the plans hold data-parallel tables: TorchRec 1.8's dense kernel sometimes aborts in native code
    # on CPU ranks (tests/launcher.py; it did once in a fresh-clone CI run, 2026-12-03)
    return run_ranks(_both_variants, WORLD_SIZE, timeout_s=120, retry_native_abort=True)


@pytest.fixture(scope="module")
def constrained_run(runs) -> List[dict]:
    return [r["constrained"] for r in runs]


def test_planner_honors_every_cpu_sharding_type(constrained_run):
    summary = constrained_run[0]["summary"]
    for name, (_, _, forced) in TABLES.items():
        if forced is not None:
            assert summary[name][0] == forced, f"{name}: planned {summary[name]}, constraint asked {forced}"


def test_every_rank_receives_the_identical_plan(constrained_run):
    assert constrained_run[0]["summary"] == constrained_run[1]["summary"]


def test_sharded_forward_matches_unsharded_reference(constrained_run):
    for rank, res in enumerate(constrained_run):
        assert set(res["max_err"]) == {f"f_{n}" for n in TABLES}
        for key, err in res["max_err"].items():
            assert err < 1e-5, f"rank {rank} {key}: sharded pooled embedding differs by {err}"


def test_sharded_training_lowers_loss_and_updates_every_table(constrained_run):
    for rank, res in enumerate(constrained_run):
        losses = res["losses"]
        assert all(l == l and abs(l) < float("inf") for l in losses), f"rank {rank}: non-finite loss {losses}"
        assert losses[-1] < losses[0], f"rank {rank}: loss did not fall {losses}"
        unchanged = [k for k, c in res["changed"].items() if not c]
        assert not unchanged, f"rank {rank}: tables not updated by training: {unchanged}"


def test_unconstrained_plan_matches_reference_and_trains(runs):
    results = [r["free"] for r in runs]
    assert results[0]["summary"] == results[1]["summary"]
    for res in results:
        assert max(res["max_err"].values()) < 1e-5
        assert res["losses"][-1] < res["losses"][0]
