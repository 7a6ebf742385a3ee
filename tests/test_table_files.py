"""Every table file under examples/tables/ works in both places that read table files, through the
one loader (torchrec_sparselift/semantics/table_file.py): ``sparselift plan --tables`` and the DLRM
example's ``--table-file`` (arguments, tables, constraints, synthetic data and a plan)."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import sys

import pytest

from torchrec_sparselift.cli import main as cli_main
from torchrec_sparselift.semantics.table_file import load_table_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "dlrm")
sys.path.insert(0, EXAMPLE)

import train  # noqa: E402
from dlrm_data import synthetic_batch  # noqa: E402

_HAS_YAML = importlib.util.find_spec("yaml") is not None
FILES = sorted(glob.glob(os.path.join(ROOT, "examples", "tables", "*.json"))
               + glob.glob(os.path.join(ROOT, "examples", "tables", "*.y*ml")))


def _needs(path: str) -> None:
    if path.endswith((".yaml", ".yml")) and not _HAS_YAML:
        pytest.skip("reading YAML needs PyYAML")


def test_the_examples_directory_holds_table_files():
    assert len(FILES) >= 3 and any(f.endswith("cpu_tiny.json") for f in FILES)


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_sparselift_plan_accepts_every_example_table_file(path, tmp_path, capsys):
    _needs(path)
    out = tmp_path / "plan.json"
    rc = cli_main(["plan", "--tables", path, "--topology", "cpu-gloo", "--world-size", "2",
                   "--time-budget", "1", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    plan = json.loads(out.read_text())
    assert plan["sharding_plan"], "the plan places the tables"


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_dlrm_example_accepts_every_example_table_file(path):
    _needs(path)
    args = train.parse_args(["--table-file", path, "--embedding-dim", "16", "--scale", "0.001",
                             "--batch-size", "8", "--steps", "2", "--warmup-steps", "1"])
    tables = train.resolve_tables(args)
    entries = load_table_file(path)
    assert [t.name for t in tables] == [e.name for e in entries]
    assert [t.features for t in tables] == [e.features for e in entries]
    # the file's constraints and per-feature pooling reach the planner
    cons = train.planner_constraints(tables, [])
    for e in entries:
        c = cons[e.name]
        assert c.pooling_factors == [float(b) for b in e.bag_sizes()]
        assert c.sharding_types == (list(e.sharding_types) if e.sharding_types else None)
        assert c.min_partition == e.min_partition
    # the synthetic data has one bag of the file's size per feature
    kjt = synthetic_batch(tables, 8, seed=0, rank=0, step=0).sparse_features
    for t in tables:
        for f, bag in zip(t.features, t.bag_sizes()):
            assert kjt[f].lengths().tolist() == [bag] * 8
    # and the planner plans the example's model for 2 CPU ranks under those constraints
    from torchrec.distributed.sharding_plan import get_default_sharders

    model = train.build_model(tables, "dlrm", train.arch_spec(args.arch, 16))
    planner = train.make_planner("sparselift", 2, 2, "cpu", 8, cons, hardware="cpu-gloo")
    plan = planner.plan(model, get_default_sharders())
    placed = {name: ps for module_plan in plan.plan.values() for name, ps in module_plan.items()}
    assert set(placed) == {t.name for t in tables}
    for e in entries:
        if e.sharding_types:
            assert placed[e.name].sharding_type in e.sharding_types


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dlrm_example_trains_two_ranks_on_the_tiny_table_file(tmp_path):
    import subprocess

    out = tmp_path / "r.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         os.path.join(EXAMPLE, "train.py"), "--table-file", os.path.join(ROOT, "examples", "tables", "cpu_tiny.json"),
         "--embedding-dim", "16", "--batch-size", "32", "--steps", "6", "--warmup-steps", "2",
         "--no-plan-cache", "--no-progress", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert {r["table"] for r in res["plan"]} == {"t0", "t1", "t2", "t3"}


def test_planner_and_fingerprint_walk_the_same_tables():
    """One walker (semantics.tables.embedding_modules): the planner's tables and the fingerprint's
    table_specs name the same tables at the same module paths, wrappers at the wrapper's path."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    from torchrec_sparselift.plan.execution_plan import table_specs
    from torchrec_sparselift.semantics.tables import extract_tables

    meta = torch.device("meta")

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
                name="x", embedding_dim=8, num_embeddings=100, feature_names=["fx"])], device=meta)
            self.inner = torch.nn.Sequential(torch.nn.Linear(3, 3), EmbeddingCollection(tables=[EmbeddingConfig(
                name="s", embedding_dim=8, num_embeddings=50, feature_names=["fs"])], device=meta))
            ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
                name="p", embedding_dim=8, num_embeddings=30, feature_names=["fp"])], device=meta, is_weighted=True)
            self.fp = FeatureProcessedEmbeddingBagCollection(ebc, PositionWeightedModuleCollection({"fp": 10}, device=meta))
            self.shared = self.a  # one module registered twice is one unit

    model = Model()
    specs = table_specs(model)
    assert [(s[0], s[1], s[5]) for s in specs] == [("a", "x", True), ("inner.1", "s", False), ("fp", "p", True)]
    handles = extract_tables(model, get_default_sharders(), "cuda", 64)
    assert sorted((h.spec.module_path, h.spec.name) for h in handles) == sorted((s[0], s[1]) for s in specs)
