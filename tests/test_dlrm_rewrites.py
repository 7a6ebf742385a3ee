"""The sparse-path rewrites through the DLRM example (examples/dlrm/train.py): ``--batch-split K``,
``--per-sample``, ``--id-dtype``, ``--dedup`` force what the execution plan would choose; each is
exact (the losses and the final checkpoint equal the unrewritten run's), and ``--check`` refuses
what the run refuses, with the same one rule (``validation.OPTION_NEEDS``) and messages in flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch
from launcher import start_script
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from torchrec_sparselift.dlrm.options import TrainOptions, UsageError, rewrite_overrides
from torchrec_sparselift.dlrm.tables import TableSpec, preset_tables, scale_tables
from torchrec_sparselift.dlrm.run import _per_sample_refusal, describe_rewrites, rewrites_record
from torchrec_sparselift.runtime.batch_split import NotPerSample, per_sample_violation
from torchrec_sparselift.runtime.model_parallel import resolve_settings
from torchrec_sparselift.plan.execution_plan import Optimizations

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "dlrm", "train.py")

TINY = ["--tables", "kaggle", "--scale", "0.0001", "--embedding-dim", "16", "--batch-size", "64"]
STEPS = 20
# every sharding type a rewrite treats: row-, column-, table-row- and table-wise outputs split
# along the batch and send narrow / deduplicated ids; a data-parallel table sends nothing
SHARDING = {
    "t_cat_0": {"sharding_types": ["row_wise"]},
    "t_cat_1": {"sharding_types": ["data_parallel"], "compute_kernels": ["dense"]},
    "t_cat_2": {"sharding_types": ["column_wise"], "min_partition": 8},
    "t_cat_3": {"sharding_types": ["table_row_wise"]},
    "t_cat_4": {"sharding_types": ["table_wise"]},
}
# the unrewritten run: every rewrite forced off (the planner may choose them; docs/wire_ids.md)
OFF = ["--batch-split", "1", "--id-dtype", "int64", "--dedup", "none"]
REWRITES = {
    "batch_split": ["--batch-split", "4", "--per-sample"],
    "id_dtype": ["--id-dtype", "int32"],
    "dedup": ["--dedup", "all"],
    "all": ["--batch-split", "4", "--per-sample", "--id-dtype", "int32", "--dedup", "all"],
}


def _env():
    no_profiles = os.path.join(tempfile.gettempdir(), "sparselift-test-no-profiles")
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHREC_SPARSELIFT_PROFILE_DIR=no_profiles)
    env.pop("RANK", None)
    return env


def _final_state(directory):
    """The checkpoint after the last step as one flat dict of tensors (DCP's shards gathered)."""
    marker = json.loads(open(os.path.join(directory, "latest.json")).read())
    assert marker["step"] == STEPS
    out = os.path.join(directory, "final.pt")
    dcp_to_torch_save(os.path.join(directory, f"step_{STEPS:08d}"), out)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value
    walk("", torch.load(out, weights_only=False))
    return flat


def test_each_rewrite_trains_the_losses_and_weights_of_the_unrewritten_run(tmp_path):
    """2 gloo ranks, 20 steps of the ``overlap`` pipeline (the one a batch split splits), every
    sharding type: the unrewritten run against ``--batch-split 4 --per-sample``, ``--id-dtype
    int32``, ``--dedup all`` and all three together. Each rewrite is exact: the same lookups and
    the same embedding update, the dense gradient summed in another order (the batch split's
    chunks), so the losses agree step for step within float rounding and so does every tensor of
    the final checkpoint (the sharded tables, their fused AdaGrad state, the dense weights and
    their optimizer state). A rewrite that dropped or duplicated an id, or a chunk weighted
    wrongly, changes the loss at the first step."""
    constraints = tmp_path / "constraints.json"
    constraints.write_text(json.dumps(SHARDING))
    common = [*TINY, "--steps", str(STEPS), "--warmup-steps", "1", "--no-progress", "--pipeline", "overlap",
              "--plan-cache", str(tmp_path / "plans"), "--constraints", str(constraints),
              "--checkpoint-every", str(STEPS)]
    # one plan for every run: planned once here (the runs then reuse it from the cache)
    base = start_script(TRAIN, [*common, *OFF, "--checkpoint-dir", str(tmp_path / "ck_base"),
                                "--out", str(tmp_path / "base.json")], 2, env=_env(), timeout_s=600).wait()
    assert base.ok, base.tail()
    runs = {name: start_script(TRAIN, [*common, *OFF, *flags, "--checkpoint-dir", str(tmp_path / f"ck_{name}"),
                                       "--out", str(tmp_path / f"{name}.json")], 2, env=_env(), timeout_s=600)
            for name, flags in REWRITES.items()}
    done = {name: r.wait() for name, r in runs.items()}
    for name, r in done.items():
        assert r.ok, (name, r.tail())

    want = json.loads((tmp_path / "base.json").read_text())
    assert want["rewrites"] == dict(batch_split=1, id_dtype="int64", dedup_features=[], per_sample=False,
                                    forced=["batch_split", "dedup_features", "id_dtype"])
    assert {r["sharding_type"] for r in want["plan"] if r["table"] in SHARDING} == {
        "row_wise", "data_parallel", "column_wise", "table_row_wise", "table_wise"}
    weights = _final_state(str(tmp_path / "ck_base"))
    assert weights
    for name in REWRITES:
        got = json.loads((tmp_path / f"{name}.json").read_text())
        rw = got["rewrites"]
        assert rw["batch_split"] == (4 if name in ("batch_split", "all") else 1), (name, rw)
        assert rw["id_dtype"] == ("int32" if name in ("id_dtype", "all") else "int64"), (name, rw)
        assert len(rw["dedup_features"]) == (26 if name in ("dedup", "all") else 0), (name, rw)
        assert got["plan"] == want["plan"]
        assert len(got["losses"]) == len(want["losses"]) == STEPS
        np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5, atol=1e-7, err_msg=name)
        assert "rewrites: " in done[name].stdout
        if name == "id_dtype":  # the same ids, only narrower on the wire: bit for bit the same run
            assert got["losses"] == want["losses"]
        state = _final_state(str(tmp_path / f"ck_{name}"))
        assert state.keys() == weights.keys(), name
        for key, w in weights.items():
            # AdaGrad divides by the root of the summed squared gradients: a last-bit difference in a
            # gradient moves a weight by ~1e-6 (measured: at most 5.4e-6 over 20 steps)
            torch.testing.assert_close(state[key], w, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{name} {k}: {m}")
    # the exactness above is not vacuous: the batch split changes the summation order, so its
    # dense weights differ in the last bits from the unsplit run's somewhere
    split = _final_state(str(tmp_path / "ck_batch_split"))
    assert any(not torch.equal(split[k], w) for k, w in weights.items() if w.is_floating_point())


# ------------------------------------------------------------------ the flags' rule, without torchrun


def _tables():
    return scale_tables(preset_tables("kaggle", 16), 0.0001)


@pytest.mark.parametrize("kwargs,message", [
    (dict(batch_split=4), "--batch-split has no effect here: it needs --pipeline overlap"),
    (dict(batch_split=4, pipeline="sparse_dist"), "--batch-split has no effect here: it needs --pipeline overlap"),
    (dict(batch_split=2, pipeline="overlap", sharding_group_size=1), "and a 1D plan (no --sharding-group-size)"),
    (dict(id_dtype="int32", sharding_group_size="auto"), "--id-dtype has no effect here: it needs a 1D plan"),
    (dict(dedup="all", sharding_group_size=2), "--dedup has no effect here: it needs a 1D plan"),
    (dict(batch_split=17, pipeline="overlap"), "--batch-split must be a number of chunks in 1..16"),
    (dict(batch_split=0, pipeline="overlap"), "--batch-split must be a number of chunks in 1..16"),
    (dict(batch_split=8, pipeline="overlap", batch_size=4), "use at most --batch-split 4"),
    (dict(id_dtype="int16"), "--id-dtype must be one of ['int64', 'int32']"),
    (dict(dedup=" , "), "--dedup takes feature names"),
    (dict(planner="torchrec", per_sample=True), "--per-sample applies to --planner sparselift"),
    (dict(planner="torchrec", id_dtype="int32"), "--id-dtype applies to --planner sparselift"),
    (dict(per_sample=True, sharding_group_size=2), "--per-sample has no effect here: it needs the batch split"),
])
def test_a_rewrite_flag_that_cannot_apply_is_refused_naming_it(kwargs, message):
    with pytest.raises(UsageError) as e:
        TrainOptions(**kwargs)
    assert message in str(e.value)


def test_the_flags_become_lifts_keywords_and_nothing_given_keeps_the_plans_choice():
    tables = _tables()
    assert rewrite_overrides(TrainOptions(), tables) == {}
    assert rewrite_overrides(TrainOptions(batch_split=1, pipeline="overlap"), tables) == {"batch_split": 1}
    got = rewrite_overrides(TrainOptions(batch_split=4, pipeline="overlap", id_dtype="int32", dedup="all"), tables)
    assert got == dict(batch_split=4, id_dtype="int32", dedup_features=tuple(f"cat_{i}" for i in range(26)))
    assert rewrite_overrides(TrainOptions(dedup="cat_3, cat_1"), tables) == {"dedup_features": ("cat_3", "cat_1")}
    assert rewrite_overrides(TrainOptions(dedup="none", sharding_group_size=2), tables) == {"dedup_features": ()}
    with pytest.raises(UsageError, match=r"--dedup names \['cat_99'\], which no table reads"):
        rewrite_overrides(TrainOptions(dedup="cat_1,cat_99"), tables)
    big = [TableSpec(name="huge", rows=2**31 + 1, dim=16, features=("f",), pooling_factor=(1.0,))]
    with pytest.raises(UsageError, match=r"--id-dtype int32: .*huge .*keep --id-dtype int64"):
        rewrite_overrides(TrainOptions(id_dtype="int32"), big)


class _Plan:
    """An execution plan as lift reads it (``.sharding_plan``, ``.optimizations``)."""

    def __init__(self, optimizations):
        from torchrec.distributed.types import ShardingPlan

        self.sharding_plan = ShardingPlan(plan={})
        self.optimizations = optimizations


def test_without_the_flags_the_run_applies_the_plans_rewrites():
    # what run.py passes lift for no flags ({}) leaves the plan's Optimizations in force
    plan = _Plan(Optimizations(pipeline="overlap", batch_split=4, id_dtype="int32", dedup_features=("cat_2", "cat_1")))
    _, settings = resolve_settings(plan, pipeline=None, **rewrite_overrides(TrainOptions(), _tables()))
    assert (settings.batch_split, settings.id_dtype, settings.dedup_features) == (4, "int32", ("cat_1", "cat_2"))
    rec = rewrites_record(settings, TrainOptions())
    assert rec["forced"] == [] and describe_rewrites(rec) == "batch split 4, ids int32, dedup cat_1,cat_2 (the plan's)"
    # a flag replaces the plan's choice, the others stay the plan's
    opts = TrainOptions(batch_split=1, pipeline="overlap")
    _, settings = resolve_settings(plan, pipeline="overlap", **rewrite_overrides(opts, _tables()))
    assert (settings.batch_split, settings.id_dtype) == (1, "int32")
    assert describe_rewrites(rewrites_record(settings, opts)).endswith("(forced: batch_split; the rest the plan's)")
    every = TrainOptions(batch_split=1, pipeline="overlap", id_dtype="int64", dedup="none")
    assert describe_rewrites(rewrites_record(settings, every)).endswith(
        "(forced: batch_split, dedup_features, id_dtype)")


def _check(*args):
    return subprocess.run([sys.executable, TRAIN, *TINY, "--no-plan-cache", "--check", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=_env())


def test_check_refuses_what_the_run_refuses_in_the_examples_flags(dlrm_main):
    """``--check`` runs the rule the run applies: the flags' needs, the tables' rows and
    features, and the batch split's per-sample rule on the model the run would build. One
    command line as a process (its exit code and stderr); the rest through the example's
    ``main`` in this process (``dlrm_main``), which is what that command line runs."""
    r = _check("--batch-split", "4")
    assert r.returncode == 2 and "--batch-split has no effect here: it needs --pipeline overlap" in r.stderr

    def check(*args):
        return dlrm_main([*TINY, "--no-plan-cache", "--check", *args], OMP_NUM_THREADS=1)

    code, err = check("--dedup", "cat_0,nope")
    assert code == 2 and "--dedup names ['nope']" in err, err
    # both of the example's models pass the per-sample rule as they are: DLRM, and DLRM_DCN (the
    # dcnv2 preset's, whose CrossNet keeps its weights in ParameterLists)
    code, err = check("--tables", "dcnv2", "--batch-split", "2", "--pipeline", "overlap")
    assert code == 0, err
    code, err = check("--batch-split", "4", "--pipeline", "overlap", "--id-dtype", "int32", "--dedup", "all")
    assert code == 0, err


def test_the_per_sample_refusal_is_said_in_the_examples_flags():
    # no model of the example is refused; a model that is (an unknown module) gets the rule's
    # reason with the example's flags, and says where the split came from
    why = per_sample_violation(torch.nn.Sequential(torch.nn.Conv1d(1, 1, 1)))
    assert why is not None and "(per_sample=True)" in why
    forced = str(_per_sample_refusal(NotPerSample(why), TrainOptions(batch_split=2, pipeline="overlap")))
    assert "declare the model per-sample (--per-sample)" in forced and "or use --batch-split 1" in forced
    assert "per_sample=True" not in forced and "the execution plan chose" not in forced
    planned = str(_per_sample_refusal(NotPerSample(why), TrainOptions()))
    assert planned.endswith("(the execution plan chose the batch split)")
