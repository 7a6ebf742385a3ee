"""The measured guard keeps the plan that measures fastest."""

import json
import time

import pytest

from torchrec_sparselift.measure.guard import Candidate, GuardResult, MeasuredGuard, choose_measured
from torchrec_sparselift.runtime.timing import StepTimer


def _timed_trial(step_cost_s):
    """A trial that runs steps through a real StepTimer: each plan's step sleeps for its cost (on
    the test's fake clock, conftest.fake_clock, so the durations are exact under any load)."""

    def trial(label, plan):
        timer = StepTimer("cpu", warmup_steps=1)
        for _ in range(6):
            with timer.step():
                time.sleep(step_cost_s[plan])
        return timer.record().measured_s

    return trial


def test_guard_picks_the_measured_faster_plan_even_against_the_prediction(fake_clock):
    # the model ranks "slow" first (predicted faster), the measurement says otherwise
    cands = [Candidate("sparselift", "sparselift", "slow", predicted_s=0.001),
             Candidate("torchrec", "torchrec", "fast", predicted_s=0.010)]
    chosen, res = choose_measured(cands, _timed_trial({"slow": 0.012, "fast": 0.003}),
                                  settings=MeasuredGuard(candidates=1).to_dict())
    assert chosen.label == "torchrec"
    assert res.chosen == "torchrec"
    assert res.trial("sparselift").measured_s == pytest.approx(0.012)
    assert res.trial("torchrec").measured_s == pytest.approx(0.003)
    assert res.torchrec_over_chosen() == pytest.approx(1.0)
    # round trip through the ExecutionPlan's JSON
    again = GuardResult.from_dict(res.to_dict())
    assert again == res
    assert "<- kept" in res.format().splitlines()[1]


def test_guard_keeps_the_first_on_a_tie_and_checks_trials():
    cands = [Candidate("a", "sparselift", 1), Candidate("b", "torchrec", 2)]
    chosen, _ = choose_measured(cands, lambda label, plan: 0.005)
    assert chosen.label == "a"
    with pytest.raises(ValueError, match="positive step time"):
        choose_measured(cands, lambda label, plan: float("nan"))
    with pytest.raises(ValueError, match="unique"):
        choose_measured([cands[0], cands[0]], lambda label, plan: 1.0)
    with pytest.raises(ValueError, match="MeasuredGuard.candidates must be an int >= 1"):
        MeasuredGuard(candidates=0)


def test_a_candidate_with_the_same_plan_is_measured_once_and_shares_the_trials():
    """TorchRec's plan equal to SparseLift's: one plan, one set of trials, the earlier kept."""
    calls = []

    def trial(label, plan):
        calls.append(label)
        return {"p": 0.004, "q": 0.003}[plan] * (1.0 if len(calls) < 3 else 1.5)

    cands = [Candidate("sparselift", "sparselift", "p"), Candidate("sparselift:b", "sparselift", "q"),
             Candidate("torchrec", "torchrec", "p")]
    chosen, res = choose_measured(cands, trial, rounds=2, key=lambda plan: plan)
    assert calls == ["sparselift", "sparselift:b", "sparselift", "sparselift:b"]
    assert chosen.label == "sparselift:b"
    tr = res.trial("torchrec")
    assert tr.same_as == "sparselift" and tr.runs_s == res.trial("sparselift").runs_s
    assert res.trial("sparselift").same_as is None
    assert "the same plan as sparselift" in res.format()
    assert GuardResult.from_dict(res.to_dict()) == res
    # on a tie between a plan and itself the earlier candidate (SparseLift's) is kept
    same, res2 = choose_measured([cands[0], cands[2]], lambda label, plan: 0.002, key=lambda plan: plan)
    assert same.label == "sparselift" and res2.torchrec_over_chosen() == pytest.approx(1.0)
    # an older stored result (no same_as) still reads
    old = res.to_dict()
    for t in old["trials"]:
        t.pop("same_as")
    assert GuardResult.from_dict(old).trial("torchrec").same_as is None


def test_sharding_plan_digest_is_plan_identity_whatever_the_dict_order():
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

    from torchrec_sparselift.plan import sharding_plan_digest

    def plan(order, rank_of_b=1):
        ps = {"a": ParameterSharding(sharding_type="table_wise", compute_kernel="fused", ranks=[0]),
              "b": ParameterSharding(sharding_type="table_wise", compute_kernel="fused", ranks=[rank_of_b])}
        return ShardingPlan(plan={"ebc": EmbeddingModuleShardingPlan({k: ps[k] for k in order})})

    assert sharding_plan_digest(plan("ab")) == sharding_plan_digest(plan("ba"))
    assert sharding_plan_digest(plan("ab")) != sharding_plan_digest(plan("ab", rank_of_b=0))


def test_guarded_plans_have_their_own_cache_key_stable_under_profile_refits():
    import warnings

    import attrs
    import torch
    from torchrec.distributed.planner import Topology
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_sparselift import SparseLiftPlanner
    from torchrec_sparselift.cost.hardware import PRESETS
    from torchrec_sparselift.measure.guard import guard_fingerprint

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=100,
                                                            feature_names=["f0"])], device=torch.device("meta"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        topo = Topology(world_size=2, local_world_size=2, compute_device="cpu")

    def planner(profile):
        return SparseLiftPlanner(topology=topo, batch_size=64, hardware=profile)

    base = PRESETS["cpu-gloo"]
    refit = attrs.evolve(base, step_overhead_s=0.01, feature_overhead_s=1e-3)
    g3, g2 = MeasuredGuard(candidates=3), MeasuredGuard(candidates=2)
    from torchrec.distributed.sharding_plan import get_default_sharders

    sh = get_default_sharders()
    a = guard_fingerprint(planner(base), ebc, sh, g3).digest()
    assert a == guard_fingerprint(planner(refit), ebc, sh, g3).digest()  # feedback refits keep the key
    assert a != guard_fingerprint(planner(base), ebc, sh, g2).digest()  # guard settings change it
    assert a != planner(base).fingerprint(ebc, sh).digest()  # never the unguarded plan's key


def test_guard_rounds_are_interleaved_and_keep_each_candidates_fastest_round():
    # round 0 disturbs "b" (a slow trial), round 1 shows it is the faster plan
    times = {("a", 0): 0.010, ("b", 0): 0.030, ("a", 1): 0.011, ("b", 1): 0.008}
    calls = []

    def trial(label, plan):
        r = sum(1 for c in calls if c == label)
        calls.append(label)
        return times[(label, r)]

    cands = [Candidate("a", "sparselift", 1), Candidate("b", "torchrec", 2)]
    chosen, res = choose_measured(cands, trial, rounds=2)
    assert calls == ["a", "b", "a", "b"]
    assert chosen.label == "b"
    assert res.trial("b").measured_s == 0.008 and res.trial("b").runs_s == (0.030, 0.008)
    assert GuardResult.from_dict(res.to_dict()) == res
    assert json.loads(json.dumps(res.to_dict())) == res.to_dict()  # plain JSON (the ExecutionPlan stores it)
    # one round would have kept "a"
    calls.clear()
    assert choose_measured(cands, trial, rounds=1)[0].label == "a"


def test_guard_alternatives_remove_only_the_named_sharding_types():
    from torchrec.distributed.planner.types import ParameterConstraints

    from torchrec_sparselift.measure.guard import _restricted
    from torchrec_sparselift.semantics.table_file import SHARDING_TYPES

    out = _restricted({"u": ParameterConstraints(sharding_types=["row_wise", "data_parallel"])}, ["t", "u"],
                      ("data_parallel",))
    assert set(out["t"].sharding_types) == set(SHARDING_TYPES) - {"data_parallel", "grid_shard"}
    assert out["u"].sharding_types == ["row_wise"]  # the user's own restriction, minus the removed type
    assert _restricted(None, ["t"], None)["t"].sharding_types == ["table_wise"]


def _reuse_worker(rank, world_size, cache_dir):
    import warnings

    import attrs
    import torch
    import torch.distributed as dist
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_sparselift import SparseLiftPlanner
    from torchrec_sparselift.atomic import write_text
    from torchrec_sparselift.cost.hardware import PRESETS
    from torchrec_sparselift.measure.guard import guard_cache_path, guard_fingerprint, guarded_execution_plan
    from torchrec_sparselift.plan.evaluate import evaluate_sharding_plan
    from torchrec_sparselift.measure.guard import GuardTrial

    def model():
        return EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100,
                                                                 feature_names=[f"f{i}"]) for i in range(3)],
                                      device=torch.device("meta"))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        topo = Topology(world_size=world_size, local_world_size=world_size, compute_device="cpu")
    old, new = PRESETS["cpu-gloo"], attrs.evolve(PRESETS["cpu-gloo"], step_overhead_s=0.02)
    guard, sh = MeasuredGuard(candidates=1, torchrec=False), get_default_sharders()
    # what an earlier run stored: a guarded plan priced under the old profile, with its trials
    # (the guard plans its candidates with never_slower=False: it measures TorchRec's plan itself)
    ep = SparseLiftPlanner(topology=topo, batch_size=32, hardware=old, never_slower=False).plan_execution(model(), sh)
    trial = GuardTrial("sparselift", "sparselift", ep.prediction.step_time_s, 0.005, (0.005,))
    info = dict(ep.planner_info, measured_guard=GuardResult("sparselift", (trial,), guard.to_dict()).to_dict())
    planner = SparseLiftPlanner(topology=topo, batch_size=32, hardware=new, never_slower=False)
    path = guard_cache_path(cache_dir, guard_fingerprint(planner, model(), sh, guard), guard)
    write_text(path, attrs.evolve(ep, planner_info=info).to_json(indent=1))

    got, res, reused = guarded_execution_plan(model, dist.group.WORLD, torch.device("cpu"), [], topology=topo,
                                              batch_size=32, hardware=new, guard=guard, cache_dir=cache_dir,
                                              sharders=sh)
    want = evaluate_sharding_plan(model(), got.sharding_plan, topo, 32, hardware=new, sharders=sh,
                                  pipeline=got.optimizations.pipeline).step_time_s
    return dict(reused=reused, old=ep.prediction.step_time_s, got=got.prediction.step_time_s, want=want,
                measured=res.chosen_trial.measured_s)


def test_a_cached_guarded_plan_is_repriced_under_the_current_profile(tmp_path):
    """The trials are reused, not re-measured; the printed prediction is the current profile's
    (regression: a recalibrated machine printed measured/predicted against the old profile)."""
    from launcher import run_ranks

    (r,) = run_ranks(_reuse_worker, 1, str(tmp_path), timeout_s=120)
    assert r["reused"] and r["measured"] == 0.005
    assert r["got"] == pytest.approx(r["want"], rel=1e-9)
    assert r["got"] > r["old"] + 0.019  # the new profile's 20 ms step overhead is in it


def test_a_kept_plan_is_priced_as_it_runs_with_the_plans_optimizations():
    """The guard prices a cached plan and TorchRec's kept plan the same way: under the run's
    sharders, pipeline and comm precisions (regression: TorchRec's kept plan was priced with fp32
    comm while it ran with the SparseLift plan's fp16)."""
    import warnings

    import torch
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_sparselift.cost.hardware import PRESETS
    from torchrec_sparselift.measure.guard import _prediction
    from torchrec_sparselift.plan import Optimizations
    from torchrec_sparselift.plan.evaluate import evaluate_sharding_plan

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=64, num_embeddings=1000,
                                                            feature_names=[f"f{i}"]) for i in range(4)],
                                 device=torch.device("meta"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        topo = Topology(world_size=2, local_world_size=2, compute_device="cpu")
        sh = get_default_sharders()
        tplan = EmbeddingShardingPlanner(topology=topo, batch_size=512).plan(ebc, sh)
    profile = PRESETS["cpu-gloo"]
    opt = Optimizations(pipeline="sparse_dist", fwd_comm_precision="fp16", bwd_comm_precision="fp16")
    got = _prediction(ebc, tplan, opt, topo, 512, None, profile, sh)
    want = evaluate_sharding_plan(ebc, tplan, topo, 512, hardware=profile, sharders=sh, pipeline="sparse_dist",
                                  fwd_precision="fp16", bwd_precision="fp16").prediction()
    fp32 = evaluate_sharding_plan(ebc, tplan, topo, 512, hardware=profile, sharders=sh,
                                  pipeline="sparse_dist").prediction()
    assert got.step_time_s == pytest.approx(want.step_time_s, rel=1e-12)
    assert got.step_time_s < fp32.step_time_s  # the comm precision is in the price


def test_a_cached_or_kept_plan_is_priced_with_the_runs_workload_statistics():
    """The guard re-prices a cached plan (and TorchRec's kept plan) with the run's ``workload=``,
    as the planner priced it: the distinct ids price the fused backward (regression: the DLRM
    example's cached plan printed 81.8 ms against the planner's 67.8 ms for the same plan and profile)."""
    import warnings

    import torch
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_sparselift import SparseLiftPlanner
    from torchrec_sparselift.cost.hardware import PRESETS
    from torchrec_sparselift.measure.guard import _prediction
    from torchrec_sparselift.semantics.workload import observe

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=64, num_embeddings=100_000,
                                                            feature_names=[f"f{i}"]) for i in range(4)],
                                 device=torch.device("meta"))
    B, L = 512, 8  # every sample's 8 ids drawn from 16 hot rows: few distinct rows per batch
    g = torch.Generator().manual_seed(0)
    batches = [KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(4)], values=torch.randint(0, 16, (4 * B * L,), generator=g),
        lengths=torch.full((4 * B,), L, dtype=torch.int32)) for _ in range(3)]
    stats = observe(batches)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        topo = Topology(world_size=2, local_world_size=2, compute_device="cpu")
        sh = get_default_sharders()
        profile = PRESETS["cpu-gloo"]
        ep = SparseLiftPlanner(topology=topo, batch_size=B, hardware=profile, workload=stats).plan_execution(ebc, sh)
        got = _prediction(ebc, ep.sharding_plan, ep.optimizations, topo, B, None, profile, sh, stats)
        blind = _prediction(ebc, ep.sharding_plan, ep.optimizations, topo, B, None, profile, sh)
    assert got.step_time_s == pytest.approx(ep.prediction.step_time_s, rel=1e-9)
    assert blind.step_time_s != pytest.approx(got.step_time_s, rel=1e-3)  # the statistics are in the price
