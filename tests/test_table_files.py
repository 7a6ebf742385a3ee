"""Every table file under examples/tables/ works in both places that read table files, through the
one loader (torchrec_sparselift/semantics/table_file.py): ``sparselift plan --tables`` and the DLRM
example's ``--table-file`` (arguments, tables, constraints, synthetic data and a plan)."""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import sys

import pytest

from torchrec_sparselift.cli import main as cli_main
from torchrec_sparselift.dlrm.data import synthetic_batch
from torchrec_sparselift.dlrm.model import arch_spec, build_model, make_planner, planner_constraints
from torchrec_sparselift.dlrm.options import TrainOptions, resolve_tables
from torchrec_sparselift.dlrm.tables import TableSetError
from torchrec_sparselift.dlrm.tables import load_table_file as dlrm_load_table_file
from torchrec_sparselift.semantics.table_file import load_table_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "dlrm")

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
    options = TrainOptions(table_file=path, embedding_dim=16, scale=0.001, batch_size=8, steps=2, warmup_steps=1)
    tables = resolve_tables(options)
    entries = load_table_file(path)
    assert [t.name for t in tables] == [e.name for e in entries]
    assert [t.features for t in tables] == [e.features for e in entries]
    # the file's constraints and per-feature pooling reach the planner
    cons = planner_constraints(tables, [])
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

    model = build_model(tables, "dlrm", arch_spec(options.arch, 16))
    planner = make_planner("sparselift", 2, 2, "cpu", 8, cons, hardware="cpu-gloo")
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


# -- broken table files: one FileFormatError naming the file, the field and the fix -------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from torchrec_sparselift.errors import FileFormatError  # noqa: E402
from torchrec_sparselift.semantics.table_file import parse_table_entries  # noqa: E402


@pytest.mark.parametrize("content, says", [
    (b'[{"name": "t0", "rows": 1000, "dim": 8, "rows": 5000000}]', "duplicate key 'rows' in the object with name 't0'"),
    (b'[{"name": "a.b", "rows": 10, "dim": 8}]', "[0].name: table name 'a.b' contains '.'"),
    (b'{"tables": [{"name": "a", "rows": 10, "dim": 8}, {"name": "b", "rows": 9223372036854775808, "dim": 8}]}',
     "tables[1].rows: rows must be a positive integer (1..9223372036854775807, the int64 range)"),
    (b'[{"name": "a", "rows": 10.5, "dim": 8}]', "[0].rows: rows must be a positive integer"),
    (b'[{"name": "a", "rows": 10, "dim": "8"}]', "[0].dim: dim must be a positive integer"),
    (b'[{"name": "a", "rows": 10, "dim": 8, "pooling_factor": Infinity}]', "[0].pooling_factor: pooling_factor must be a finite"),
    (b'[{"name": "a", "rows": 10, "dim": 8, "pooling_factor": NaN}]', "[0].pooling_factor"),
    (b'[{"name": "a", "rows": 10, "dim": 8', "is not valid JSON"),
    (b'[{"name": "\xff", "rows": 10, "dim": 8}]', "is not UTF-8 text: byte 0xff at offset 11"),
    (b'{"name": "a", "rows": 10, "dim": 8}', "expected a non-empty list of tables"),
    (b'[3]', "[0]: must be an object"),
    (b'[{"name": "a", "rows": 10, "dim": 8, "sharding_types": "row_wize"}]', "unknown sharding_types ['row_wize']"),
])
def test_broken_table_file_gives_one_line_naming_file_and_field(tmp_path, content, says):
    path = tmp_path / "t.json"
    path.write_bytes(content)
    with pytest.raises(FileFormatError) as e:
        load_table_file(str(path))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"table file {path}: ") and says in msg, msg
    assert "to fix:" in msg
    assert e.value.path == str(path)


def test_broken_constraints_file_is_named_as_such(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('[{"name": "a", "rows": 5}]')
    with pytest.raises(FileFormatError, match=r"^constraints file .*c.json: \[0\]: unknown key\(s\) \['rows'\]"):
        load_table_file(str(path), constraint_only=True)


def test_duplicate_key_in_a_yaml_table_file_is_refused(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "t.yaml"
    path.write_text("- name: t0\n  rows: 1000\n  dim: 8\n  rows: 5000000\n")
    with pytest.raises(FileFormatError, match=r"t.yaml: duplicate key 'rows' at line 4"):
        load_table_file(str(path))


def test_the_dlrm_example_reports_a_dotted_table_name_as_a_table_set_error(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('[{"name": "user.id", "rows": 10, "dim": 8}]')
    with pytest.raises(TableSetError, match=r"table name 'user.id' contains '.'.*rename the table, e.g. 'user_id'"):
        dlrm_load_table_file(str(path))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6)
    | st.sampled_from(["a", "b.c", "row_wise", "fused", "f"]),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(
        ["name", "rows", "dim", "features", "pooling_factor", "sharding_types", "compute_kernels",
         "min_partition", "tables", "x"]), c, max_size=5),
    max_leaves=10,
)
_FIELD_VALUES = st.one_of(_JSON, st.integers(min_value=2**62, max_value=2**65))


@settings(max_examples=400, deadline=None)
@given(data=_JSON, constraint_only=st.booleans())
def test_any_parsed_content_gives_tables_or_a_file_format_error(data, constraint_only):
    try:
        entries = parse_table_entries(data, "t.json", constraint_only, "table file")
    except FileFormatError as e:
        assert "\n" not in str(e) and str(e).startswith("table file t.json: ")
        return
    assert entries and all(e.rows <= 2**63 - 1 and "." not in e.name for e in entries)


@settings(max_examples=400, deadline=None)
@given(key=st.sampled_from(["name", "rows", "dim", "features", "pooling_factor", "sharding_types",
                            "compute_kernels", "min_partition"]), value=_FIELD_VALUES)
def test_any_value_in_any_field_gives_a_table_or_a_file_format_error(key, value):
    entry = {"name": "t0", "rows": 100, "dim": 8, "features": ["f0", "f1"]}
    entry[key] = value
    try:
        (e,) = parse_table_entries([entry], "t.json", False, "table file")
    except FileFormatError as err:
        assert f"[0].{key}" in str(err) or "[0]: missing" in str(err), str(err)
        return
    assert 1 <= e.rows <= 2**63 - 1 and 1 <= e.dim <= 2**63 - 1
    assert all(math.isfinite(p) and p > 0 for p in e.pooling())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=120) | st.sampled_from([
    b'[{"name": "t0", "rows": 10, "dim": 8}]', b'{"tables": [{"name": "t0", "rows": 10, "dim": 8}]}'])
    .flatmap(lambda good: st.integers(0, len(good)).map(lambda n: good[:n])))
def test_arbitrary_or_truncated_bytes_give_tables_or_a_file_format_error(tmp_path, raw):
    path = tmp_path / "t.json"
    path.write_bytes(raw)
    try:
        load_table_file(str(path))
    except FileFormatError as e:
        assert str(path) in str(e)
