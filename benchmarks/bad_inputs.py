"""Bad inputs and faults, tried as a new user would: does each give one clear error?

    python -m benchmarks.bad_inputs [--only SUBSTRING] [--json OUT]

Each case feeds one bad input or fault to the public API (``SparseLiftPlanner``,
``evaluate_sharding_plan``, ``HardwareProfile.load``, ``ProfileStore``, ``PlanCache``), the
``sparselift`` command line (its ``main``, in this process) or the DLRM example
(``examples/dlrm/train.py``, as its own process), and records the outcome: a plan, an exception
type with its message, or an exit code with stderr.

"clear" means: one error (one line, or one short paragraph listing all problems) that names the
culprit (the argument, file or field) and says how to fix it; no traceback; no internal exception
type (KeyError, IndexError, AttributeError, TypeError, NotAnAttrsClassError, UnicodeDecodeError,
JSONDecodeError); no data lost; no hang (every case runs under a timeout). Cases about concurrency,
cached plans and file modes are judged by what happened (records kept, a re-plan with one log line,
the file mode). Prints one table row per case and "N of M clear". Small models on the meta device;
the whole run takes a few minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from benchmarks.harness import write_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "dlrm")
TRAIN = os.path.join(EXAMPLE, "train.py")

warnings.filterwarnings("ignore")
GiB = 1024**3

INTERNAL = ("KeyError", "IndexError", "AttributeError", "TypeError", "NotAnAttrsClassError",
            "UnicodeDecodeError", "JSONDecodeError")
#: words of a fix: an error that says none of them does not say what to do
FIX_WORDS = ("must", "use ", "give", "pass", "set ", "lower", "raise", "remove", "delete", "fix", "pad ",
             "choose", "allow", "wait", "build", "rerun", "re-run", "write", "rename", "expected", "one of",
             "e.g.", "add ", "drop", "keep", "should", "at most", "at least", "try", "replace", "calibrate")
SHORT = 700  # characters: "one short paragraph"


class Outcome:
    def __init__(self, kind: str, text: str, clear: bool = False, why: str = "") -> None:
        self.kind, self.text, self.clear, self.why = kind, text, clear, why


class CaseTimeout(Exception):
    pass


def judge_error(kind: str, text: str, culprit: Sequence[str], fix: Sequence[str] = ()) -> Outcome:
    """An error outcome judged clear or not: ``culprit`` words (any) must appear; a fix word too."""
    why = []
    if "Traceback" in text:
        why.append("traceback")
    if any(t in kind or f"{t}:" in text for t in INTERNAL):
        why.append("internal exception type")
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if len(lines) > 1 and len(text) > SHORT:
        why.append(f"{len(lines)} lines")
    elif len(text) > SHORT * 2:
        why.append(f"{len(text)} characters")
    low = text.lower()
    if culprit and not any(c.lower() in low for c in culprit):
        why.append(f"names none of {list(culprit)}")
    fixes = tuple(fix) or FIX_WORDS
    if not any(f.lower() in low for f in fixes):
        why.append("no fix")
    return Outcome(kind, text, not why, "; ".join(why) or "names the culprit and the fix")


def api_error(fn: Callable[[], Any], culprit: Sequence[str], fix: Sequence[str] = ()) -> Outcome:
    try:
        fn()
    except CaseTimeout:
        raise
    except BaseException as e:  # noqa: BLE001 - every outcome is recorded
        return judge_error(type(e).__name__, str(e), culprit, fix)
    return Outcome("plan", "accepted", False, "accepted a bad input")


def cli(argv: Sequence[str]) -> Tuple[int, str]:
    from torchrec_sparselift import cli as cli_mod

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = cli_mod.main(list(argv))
        except SystemExit as e:  # argparse
            code = int(e.code or 0)
        except CaseTimeout:
            raise
        except BaseException:  # noqa: BLE001 - escaped main: recorded as the traceback it is
            traceback.print_exc(file=err)
            code = -1
    return code, err.getvalue()


def cli_error(argv: Sequence[str], culprit: Sequence[str], fix: Sequence[str] = ()) -> Outcome:
    code, err = cli(argv)
    err = "\n".join(ln for ln in err.splitlines() if not ln.startswith(("planning ", "  ")) or "error" in ln)
    if code == 0:
        return Outcome("exit 0", err, False, "accepted a bad input")
    o = judge_error(f"exit {code}", err, culprit, fix)
    if not [ln for ln in err.splitlines() if "error" in ln]:
        o.clear, o.why = False, "no error line"
    return o


# -- shared inputs ---------------------------------------------------------------------------


def topo(world_size=2, device="cuda", **kw):
    from torchrec.distributed.planner import Topology

    kw.setdefault("hbm_cap", 80 * GiB)
    kw.setdefault("ddr_cap", 256 * GiB)
    return Topology(world_size=world_size, local_world_size=world_size, compute_device=device, **kw)


def ebc(n=2, rows=1000, dim=16):
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows * (i + 1),
                                   feature_names=[f"f{i}"]) for i in range(n)],
        device=torch.device("meta"))


def plan(module=None, **kw):
    from torchrec.distributed.sharding_plan import get_default_sharders

    from torchrec_sparselift import SparseLiftPlanner

    kw.setdefault("topology", topo())
    kw.setdefault("batch_size", 64)
    kw.setdefault("time_budget_s", 1)
    kw.setdefault("debug", False)
    return SparseLiftPlanner(**kw).plan_with_result(module or ebc(), get_default_sharders())


def PC(**kw):
    from torchrec.distributed.planner.types import ParameterConstraints

    return ParameterConstraints(**kw)


# -- 1. arguments of the wrong type or shape --------------------------------------------------


def _named_none(options):
    return None


def _drop_last(options):
    return options[:-1]


def api_cases(tmp: str) -> Dict[str, Callable[[], Outcome]]:
    def evaluate_bad():
        from torchrec_sparselift import evaluate_sharding_plan

        good = plan().sharding_plan
        return evaluate_sharding_plan(ebc(), good, topo(), 64, constraints=[1], hardware={}, pipeline="nope")

    return {
        "api: constraints as a list": lambda: api_error(lambda: plan(constraints=[PC()]), ["constraints"]),
        "api: sharding_types as a string": lambda: api_error(
            lambda: plan(constraints={"t0": PC(sharding_types="table_wise")}), ["sharding_types"]),
        "api: pipelines=[]": lambda: api_error(lambda: plan(pipelines=[]), ["pipelines"]),
        "api: hardware as a dict": lambda: api_error(lambda: plan(hardware={"name": "x"}), ["hardware"]),
        "api: workload as a dict": lambda: api_error(lambda: plan(workload={"f0": 3.0}), ["workload"]),
        "api: callback returns None": lambda: api_error(lambda: plan(callbacks=[_named_none]), ["_named_none"]),
        "api: callback drops a table": lambda: api_error(lambda: plan(callbacks=[_drop_last]), ["_drop_last", "t1"]),
        "api: 3 pooling factors, 1 feature": lambda: api_error(
            lambda: plan(constraints={"t0": PC(pooling_factors=[1.0, 2.0, 3.0])}), ["pooling_factors"]),
        "api: NaN hbm_cap": lambda: api_error(lambda: plan(topology=topo(hbm_cap=float("nan"))), ["hbm_cap"]),
        "api: evaluate_sharding_plan bad args": lambda: api_error(
            evaluate_bad, ["constraints", "hardware", "pipeline"]),
        "api: absurd batch size": lambda: api_error(lambda: plan(batch_size=10**12), ["batch_size", "buffers"]),
        "api: absurd pooling factor": lambda: api_error(
            lambda: plan(constraints={"t0": PC(pooling_factors=[1e12])}), ["pooling", "buffers"]),
    }


# -- 2. stored files ----------------------------------------------------------------------------

FAULTS = ("truncated", "non-UTF-8", "top-level list", "wrong field type", "missing field", "duplicate key",
          "table name with a dot", "rows beyond int64")


def write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def faulty(doc: Any, fault: str, field: Tuple[Any, ...], wrong: Any = "many") -> bytes:
    """``doc`` as JSON bytes with ``fault``; ``field`` is the path of the field a field fault hits."""
    text = json.dumps(doc, indent=1)
    if fault == "truncated":
        return text[: len(text) // 2].encode()
    if fault == "non-UTF-8":
        return text.replace('"', '"\xff', 1).encode("latin-1")
    if fault == "top-level list":
        return json.dumps([doc]).encode()
    d = copy.deepcopy(doc)
    node = d
    for k in field[:-1]:
        node = node[k]
    last = field[-1]
    if fault == "wrong field type":
        node[last] = wrong
    elif fault == "missing field":
        del node[last]
    elif fault == "duplicate key":
        text = json.dumps(d)
        # the field written twice, the second time with another value: last would win in json.loads
        marker = json.dumps(last) + ": " + json.dumps(node[last])
        return text.replace(marker, marker + ", " + json.dumps(last) + ": " + json.dumps(wrong), 1).encode()
    elif fault == "table name with a dot":
        node[last] = "emb.t0"
    elif fault == "rows beyond int64":
        node[last] = 2**70
    return json.dumps(d).encode()


def table_doc():
    return [{"name": "t0", "rows": 1000, "dim": 16}, {"name": "t1", "rows": 2000, "dim": 16}]


def file_cases(tmp: str) -> Dict[str, Callable[[], Outcome]]:
    from torchrec_sparselift.cost.hardware import PRESETS, HardwareProfile

    cases: Dict[str, Callable[[], Outcome]] = {}
    hw = {"schema": "sparselift.hardware_profile/1", **PRESETS["cpu-gloo"].to_dict()}

    # hardware profile: through the API and through the CLI's --topology
    for fault in FAULTS[:6]:
        field = "name" if fault == "missing field" else "hbm_bw"  # name: the field a profile must have

        def case(fault=fault, field=field):
            p = write(os.path.join(tmp, "profile.json"), faulty(hw, fault, (field,), wrong=7.0 if fault ==
                                                                   "duplicate key" else "fast"))
            return api_error(lambda: HardwareProfile.load(p), ["profile.json"] + (
                [field] if "field" in fault or "key" in fault else []))
        cases[f"file: hardware profile {fault} (API)"] = case

    def missing_measured_field():
        # every field but name has a default, so profiles written before a field existed still load;
        # a measured field left out takes the built-in default without a word
        p = write(os.path.join(tmp, "profile.json"), faulty(hw, "missing field", ("hbm_bw",)))
        o = api_error(lambda: HardwareProfile.load(p), ["profile.json", "hbm_bw"])
        if o.kind == "plan":
            got = HardwareProfile.load(p).hbm_bw
            o.text = f"loaded with hbm_bw={got:g} (the built-in default; the file's preset has {hw['hbm_bw']:g})"
            o.why = "a missing measured field silently takes its default"
        return o

    cases["file: hardware profile missing hbm_bw (API)"] = missing_measured_field
    cases["file: hardware profile wrong field type (CLI --topology)"] = lambda: cli_error(
        ["plan", "--tables", write(os.path.join(tmp, "ok.json"), json.dumps(table_doc()).encode()),
         "--topology", write(os.path.join(tmp, "prof2.json"), faulty(hw, "wrong field type", ("hbm_bw",), "fast")),
         "--out", os.path.join(tmp, "never.json")], ["prof2.json"])

    # table file: the CLI's --tables
    table_field = {"wrong field type": (0, "rows"), "missing field": (0, "dim"), "duplicate key": (0, "rows"),
                   "table name with a dot": (0, "name"), "rows beyond int64": (0, "rows")}
    for fault in FAULTS:
        def case(fault=fault):
            wrong = 5_000_000 if fault == "duplicate key" else "many"
            p = write(os.path.join(tmp, "tables.json"), faulty(table_doc(), fault, table_field.get(fault, (0, "rows")),
                                                              wrong))
            field = table_field.get(fault, (None, None))[1]
            return cli_error(["plan", "--tables", p, "--topology", "cpu-gloo", "--world-size", "2",
                              "--time-budget", "1", "--out", os.path.join(tmp, "never.json")],
                             ["tables.json"] + ([field] if field else []))
        cases[f"file: table file {fault} (CLI)"] = case

    # calibration records: sparselift calibrate kernels --from-records
    from torchrec_sparselift.calibration.records import CollectiveRecord, LookupRecord, MicrobenchRecords

    recs = MicrobenchRecords(
        lookups=[LookupRecord(kernel="fbgemm_tbe", device="cpu", phase="fwd", rows=1000, dim=16, batch_size=64,
                              pooling=4, seconds=1e-4)],
        collectives=[CollectiveRecord(op="all_to_all", backend="gloo", world_size=2, bytes=4096,
                                      seconds=1e-4)]).to_dict()
    for fault, field in [("truncated", None), ("non-UTF-8", None), ("wrong field type", ("lookups", 0, "seconds")),
                         ("missing field", ("lookups", 0, "dim")), ("rows beyond int64", ("lookups", 0, "rows"))]:
        def case(fault=fault, field=field):
            p = write(os.path.join(tmp, "records.json"), faulty(recs, fault, field or ("lookups",)))
            return cli_error(["calibrate", "kernels", "--from-records", p, "--device", "cpu",
                              "--out", os.path.join(tmp, "fitted.json")],
                             ["records.json"] + ([field[-1]] if field else []))
        cases[f"file: calibration records {fault} (CLI)"] = case

    # stored CLI inputs in a plan, and the plan itself: sparselift explain PLAN
    def stored_plan() -> Dict[str, Any]:
        p = os.path.join(tmp, "good-plan.json")
        if not os.path.exists(p):
            code, err = cli(["plan", "--tables", write(os.path.join(tmp, "ok.json"), json.dumps(table_doc()).encode()),
                             "--topology", "cpu-gloo", "--world-size", "2", "--time-budget", "1", "--out", p])
            assert code == 0, err
        with open(p, encoding="utf-8") as f:
            return json.load(f)

    for fault, field, wrong in [
        ("wrong field type", ("planner_info", "inputs", "batch_size"), "big"),
        ("duplicate key", ("planner_info", "inputs", "batch_size"), 99),
        ("rows beyond int64", ("planner_info", "inputs", "tables", 0, "rows"), None),
        ("table name with a dot", ("planner_info", "inputs", "tables", 0, "name"), None),
    ]:
        def case(fault=fault, field=field, wrong=wrong):
            p = write(os.path.join(tmp, "plan-inputs.json"), faulty(stored_plan(), fault, field, wrong))
            return cli_error(["explain", p], ["plan-inputs.json"] + [str(field[-1])])
        cases[f"file: stored CLI inputs {fault} (CLI explain)"] = case
    for fault, field in [("truncated", None), ("non-UTF-8", None), ("top-level list", None),
                         ("missing field", ("sharding_plan",))]:
        def case(fault=fault, field=field):
            p = write(os.path.join(tmp, "plan-bad.json"), faulty(stored_plan(), fault, field or ("x",)))
            return cli_error(["explain", p], ["plan-bad.json"] + ([field[-1]] if field else []))
        cases[f"file: execution plan {fault} (CLI explain)"] = case

    def corrupt_own_profile():
        from torchrec_sparselift.calibration import store as store_mod

        d = os.path.join(tmp, "store")
        os.environ[store_mod.PROFILE_STORE_ENV] = d
        try:
            fp = store_mod.current_fingerprint("cpu", 2)
            path = store_mod.ProfileStore(d).save(PRESETS["cpu-gloo"], fp)
            with open(path, "r+b") as f:
                f.truncate(60)
            return api_error(lambda: plan(topology=topo(device="cpu", hbm_cap=8 * GiB), hardware="auto"),
                             [os.path.basename(path)], ["delete", "calibrate"])
        finally:
            os.environ.pop(store_mod.PROFILE_STORE_ENV, None)

    cases["file: corrupt stored profile of this machine (hardware='auto')"] = corrupt_own_profile
    return cases


# -- 3. cached plans ----------------------------------------------------------------------------


def cache_cases(tmp: str) -> Dict[str, Callable[[], Outcome]]:
    ROWS, DIM, RANKS = 40_000, 64, 4

    def model():
        import torch
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        return EmbeddingBagCollection(tables=[EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS * (i + 1), feature_names=[f"f{i}"])
            for i in range(3)], device=torch.device("meta"))

    def planner(cache_dir, budget=1.0):
        from torchrec.distributed.planner import Topology

        from torchrec_sparselift import SparseLiftPlanner

        return SparseLiftPlanner(
            topology=Topology(world_size=RANKS, local_world_size=2, compute_device="cuda", hbm_cap=16 * GiB),
            batch_size=512, debug=False, cache_dir=cache_dir, solver="heuristic", time_budget_s=budget,
            constraints={"t0": PC(sharding_types=["table_wise"])})

    def row_wise(rows):
        cut = rows // RANKS
        return {"sharding_type": "row_wise", "compute_kernel": "fused", "ranks": list(range(RANKS)),
                "sharding_spec": {"kind": "enumerable", "shards": [
                    {"offsets": [i * cut, 0], "sizes": [cut if i < RANKS - 1 else rows - i * cut, DIM],
                     "placement": f"rank:{i}/cuda:{i % 2}"} for i in range(RANKS)]}}

    def edited(name, table, damage):
        from torchrec.distributed.sharding_plan import get_default_sharders

        from torchrec_sparselift.plan import PlanCache

        d = os.path.join(tmp, f"cache-{name}")
        first = planner(d).plan_execution(model(), get_default_sharders())
        path = PlanCache(d).path_for(first.fingerprint)
        with open(path) as f:
            data = json.load(f)
        damage(data["sharding_plan"]["modules"][""]["params"][table])
        with open(path, "w") as f:
            json.dump(data, f)
        logs = _capture("torchrec_sparselift.plan.cache")
        p = planner(d)
        again = p.plan_execution(model(), get_default_sharders())
        replans = [m for m in logs.getvalue().splitlines() if "re-planning" in m]
        if p.last_cache_hit:
            return Outcome("plan (cache hit)", "edited plan reused", False, "reused a plan that breaks the request")
        ok = again.sharding_plan == first.sharding_plan and len(replans) == 1
        return Outcome("re-plan", replans[0] if replans else "(no log line)", ok,
                       "re-planned with one log line naming the table" if ok else "no single re-plan log line")

    def shrink(ps):
        ps.update(row_wise(ROWS * 2))
        ps["sharding_spec"]["shards"][0]["sizes"][0] -= 1

    def held_lock():
        from torchrec.distributed.sharding_plan import get_default_sharders

        from torchrec_sparselift.plan import PlanCache

        d = os.path.join(tmp, "cache-lock")
        p = planner(d, budget=1.0)
        fp = p.fingerprint(model(), get_default_sharders())
        lock_path = PlanCache(d).path_for(fp)[: -len(".json")] + ".lock"
        os.makedirs(d, exist_ok=True)
        holder = subprocess.Popen([sys.executable, "-c",
                                   "import fcntl, os, sys, time\n"
                                   f"fd = os.open({lock_path!r}, os.O_RDWR | os.O_CREAT)\n"
                                   "fcntl.flock(fd, fcntl.LOCK_EX)\n"
                                   "os.write(fd, f'{os.getpid()}\\n'.encode())\n"
                                   "print('held', flush=True)\ntime.sleep(120)\n"],
                                  stdout=subprocess.PIPE, text=True)
        try:
            holder.stdout.readline()
            logs = _capture("torchrec_sparselift.plan.cache")
            start = time.monotonic()
            p.plan(model(), get_default_sharders())
            took = time.monotonic() - start
        finally:
            holder.kill()
            holder.wait()
        msgs = [m for m in logs.getvalue().splitlines() if f"pid {holder.pid}" in m]
        ok = took < 60 and len(msgs) >= 1
        return Outcome("plan", f"planned in {took:.1f} s; " + (msgs[0] if msgs else "(no log line)"), ok,
                       "bounded wait, log line names the holder" if ok else "long wait or no log line")

    return {
        "cache: shards no longer cover a table": lambda: edited("cover", "t1", shrink),
        "cache: table_wise-constrained table made row_wise": lambda: edited(
            "tw", "t0", lambda ps: ps.update(row_wise(ROWS))),
        "cache: lock held by another process, budget 1 s": held_lock,
    }


def _capture(logger: str) -> io.StringIO:
    buf = io.StringIO()
    log = logging.getLogger(logger)
    for h in list(log.handlers):
        if getattr(h, "_audit", False):
            log.removeHandler(h)
    h = logging.StreamHandler(buf)
    h._audit = True  # type: ignore[attr-defined]
    log.addHandler(h)
    log.setLevel(logging.INFO)
    return buf


# -- 4. concurrency, mismatches, file modes ----------------------------------------------------

ADD_RECORDS = r"""
import sys
from types import SimpleNamespace
from torchrec_sparselift.calibration import feedback
from torchrec_sparselift.calibration.store import MachineFingerprint, ProfileStore
from torchrec_sparselift.calibration.step_fit import FitRecord
from torchrec_sparselift.cost.hardware import PRESETS
fp = MachineFingerprint(device="cpu", processor="audit cpu", cores=2, devices=0, backend="gloo", ranks=2,
                        torch="2.x", fbgemm_gpu="1.x", torchrec="1.x")
feedback.current_fingerprint = lambda device, ranks, **kw: fp
store = ProfileStore(sys.argv[1])
for i in range(8):
    rec = FitRecord(label=f"guard/{sys.argv[2]}-{i}", quantities={"step_overhead_s": 1.0}, fixed_s=0.01,
                    measured_s=0.02 + 1e-4 * i)
    feedback.add_feedback([rec], PRESETS["cpu-gloo"], SimpleNamespace(compute_device="cpu", local_world_size=2),
                          store=store)
"""

SAVER = r"""
import os, sys, time
import torch, torch.distributed as dist
from torchrec_sparselift.dlrm.checkpoint import claim_checkpoint_dir, save_checkpoint
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
lock = claim_checkpoint_dir(sys.argv[1])
model = torch.nn.Linear(4, 2)
save_checkpoint(sys.argv[1], 1, model, torch.optim.SGD(model.parameters(), lr=0.1), {"seed": 0})
print("SAVED1", flush=True)
sys.stdin.read()
"""

TINY = ["--tables", "kaggle", "--scale", "0.0001", "--embedding-dim", "16", "--batch-size", "64",
        "--warmup-steps", "1", "--no-progress", "--no-plan-cache", "--device", "cpu"]


def env() -> Dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def example(args: Sequence[str], timeout: float = 240, world_size: Optional[int] = None) -> subprocess.CompletedProcess:
    e = env()
    if world_size is not None:
        e["WORLD_SIZE"] = str(world_size)
    return subprocess.run([sys.executable, TRAIN, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=e)


def example_error(proc: subprocess.CompletedProcess, culprit: Sequence[str], fix: Sequence[str] = ()) -> Outcome:
    if proc.returncode == 0:
        return Outcome("exit 0", proc.stderr[-300:], False, "accepted a bad input")
    err_lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    shown = "\n".join(err_lines) if err_lines and "Traceback" not in proc.stderr else proc.stderr[-1500:]
    o = judge_error(f"exit {proc.returncode}", shown, culprit, fix)
    if len(err_lines) != 1 and o.clear:
        o.clear, o.why = False, f"{len(err_lines)} error lines"
    return o


def tree(d: str) -> List[str]:
    return sorted(os.path.relpath(os.path.join(a, f), d) for a, _, fs in os.walk(d) for f in fs)


def other_cases(tmp: str) -> Dict[str, Callable[[], Outcome]]:
    def store_records():
        from torchrec_sparselift.calibration.step_fit import STEP_MODEL_VERSION
        from torchrec_sparselift.calibration.store import MachineFingerprint, ProfileStore
        from torchrec_sparselift.cost.hardware import PRESETS

        import attrs

        d = os.path.join(tmp, "store-concurrent")
        fp = MachineFingerprint(device="cpu", processor="audit cpu", cores=2, devices=0, backend="gloo", ranks=2,
                                torch="2.x", fbgemm_gpu="1.x", torchrec="1.x")
        store = ProfileStore(d)
        store.save(attrs.evolve(PRESETS["cpu-gloo"], name="fitted"), fp,
                   info={"fit": {"values": {"step_overhead_s": 1e-3}}, "fit_records": [],
                         "model_version": STEP_MODEL_VERSION})
        procs = [subprocess.Popen([sys.executable, "-c", ADD_RECORDS, d, f"p{i}"], stderr=subprocess.PIPE,
                                  text=True, env=env()) for i in range(2)]
        errs = [p.communicate(timeout=240)[1] for p in procs]
        info = store.lookup(fp)[0].step_fit
        kept = sum(1 for r in info.fit_records if r.label.startswith("guard/"))
        ok = kept == 16 and all(p.returncode == 0 for p in procs)
        return Outcome("records", f"{kept} of 16 records kept" + ("" if ok else " " + errs[0][-300:]), ok,
                       "no record lost" if ok else "records lost or a writer failed")

    def checkpoint_dir_in_use():
        ck = os.path.join(tmp, "ck-shared")
        holder = subprocess.Popen([sys.executable, "-c", SAVER, ck], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env())
        try:
            holder.stdout.readline()
            before = tree(ck)
            proc = example([*TINY, "--steps", "2", "--checkpoint-dir", ck])
            after = tree(ck)
        finally:
            holder.stdin.close()
            holder.wait(timeout=60)
        o = example_error(proc, ["in use", ck], ["wait", "another --checkpoint-dir"])
        if after != before:
            o.clear, o.why = False, f"data lost: {before} -> {after}"
        return o

    def corrupt_shard():
        ck = os.path.join(tmp, "ck-corrupt")
        first = example([*TINY, "--steps", "2", "--checkpoint-dir", ck, "--checkpoint-every", "2"])
        if first.returncode != 0:
            return Outcome(f"exit {first.returncode}", first.stderr[-500:], False, "the first run failed")
        step = os.path.join(ck, "step_00000002")
        shard = sorted(f for f in os.listdir(step) if f.endswith(".distcp"))[0]
        with open(os.path.join(step, shard), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(step, shard)) // 2)
        proc = example([*TINY, "--steps", "4", "--checkpoint-dir", ck, "--checkpoint-every", "2"])
        return example_error(proc, ["step_00000002"], ["remove"])

    def check_dim6():
        proc = example(["--embedding-dim", "6", "--device", "cpu", "--check"], world_size=2, timeout=180)
        return example_error(proc, ["embedding_dim", "embedding-dim"], ["pad"])

    def topology_vs_group():
        import torch.distributed as dist
        from torchrec.distributed.sharding_plan import get_default_sharders

        from torchrec_sparselift import SparseLiftPlanner

        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        try:
            p = SparseLiftPlanner(topology=topo(world_size=2, device="cpu"), batch_size=8, debug=False,
                                  time_budget_s=1)
            return api_error(lambda: p.collective_plan(ebc(), get_default_sharders(), dist.GroupMember.WORLD),
                             ["world_size", "process group"])
        finally:
            dist.destroy_process_group()

    def umask_mode(what: str, write_fn: Callable[[str], str]) -> Callable[[], Outcome]:
        def case():
            old = os.umask(0o022)
            try:
                path = write_fn(os.path.join(tmp, f"umask-{what}"))
            finally:
                os.umask(old)
            mode = stat.S_IMODE(os.stat(path).st_mode)
            return Outcome("file", f"{path}: {mode:04o}", mode == 0o644, "0644" if mode == 0o644 else "not 0644")
        return case

    def cli_plan_out(d):
        os.makedirs(d, exist_ok=True)
        out = os.path.join(d, "plan.json")
        code, err = cli(["plan", "--tables", write(os.path.join(d, "t.json"), json.dumps(table_doc()).encode()),
                         "--topology", "cpu-gloo", "--world-size", "2", "--time-budget", "1", "--out", out])
        assert code == 0, err
        return out

    def cache_entry(d):
        from torchrec.distributed.sharding_plan import get_default_sharders

        from torchrec_sparselift import SparseLiftPlanner
        from torchrec_sparselift.plan import PlanCache

        p = SparseLiftPlanner(topology=topo(), batch_size=64, debug=False, time_budget_s=1, cache_dir=d)
        ep = p.plan_execution(ebc(), get_default_sharders())
        return PlanCache(d).path_for(ep.fingerprint)

    def stored_profile(d):
        from torchrec_sparselift.calibration.store import MachineFingerprint, ProfileStore
        from torchrec_sparselift.cost.hardware import PRESETS

        fp = MachineFingerprint(device="cpu", processor="audit cpu", cores=2, devices=0, backend="gloo", ranks=2,
                                torch="2.x", fbgemm_gpu="1.x", torchrec="1.x")
        return ProfileStore(d).save(PRESETS["cpu-gloo"], fp)

    return {
        "concurrency: 2 processes add guard records to one store": store_records,
        "concurrency: 2 runs on one --checkpoint-dir (example)": checkpoint_dir_in_use,
        "mismatch: 2-rank topology on a 1-rank process group": topology_vs_group,
        "example: corrupt checkpoint shard": corrupt_shard,
        "example: --check --embedding-dim 6": check_dim6,
        "umask 022: sparselift plan --out": umask_mode("cli", cli_plan_out),
        "umask 022: plan cache entry": umask_mode("cache", cache_entry),
        "umask 022: stored profile": umask_mode("store", stored_profile),
    }


# -- running -------------------------------------------------------------------------------------


# -- 4. options that do not apply, names, records read late, the testbed, faults in training ---

TINY_RUN = ["--tables", "kaggle", "--scale", "0.0001", "--embedding-dim", "16", "--batch-size", "64", "--steps", "8",
            "--warmup-steps", "1", "--no-progress", "--pipeline", "sparse_dist", "--device", "cpu"]


def _ranks(args: Sequence[str], world_size: int = 2, timeout: float = 240) -> List[subprocess.CompletedProcess]:
    """The example as ``world_size`` rank processes with torchrun's environment, one per emulated
    host (no launcher: a lost rank is seen by the others, not by an agent that stops them)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for r in range(world_size):
        e = dict(env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world_size),
                 LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        procs.append(subprocess.Popen([sys.executable, TRAIN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, cwd=ROOT, env=e))
    out = []
    try:
        o, err = procs[0].communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(procs[0].args, procs[0].returncode, o, err))
        for p in procs[1:]:  # a rank stopped (SIGSTOP) never exits by itself: killed after the first is done
            try:
                o, err = p.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                o, err = p.communicate()
            out.append(subprocess.CompletedProcess(p.args, p.returncode, o, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def option_cases(tmp: str) -> Dict[str, Callable[[], Outcome]]:
    def unknown_term():
        from torchrec_sparselift.plan.baseline import TermErrors

        return plan(model_errors=TermErrors({"1/a2a_bandwidth": 0.1}, 0.1, "typo"))

    def reservation_and_percentage():
        from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation

        return plan(storage_reservation=HeuristicalStorageReservation(0.2), heuristical_storage_reservation_percentage=0.3)

    def damaged_link_record():
        from torchrec_sparselift.calibration.link import LinkRates
        from torchrec_sparselift.calibration.store import ProfileStore, current_fingerprint
        from torchrec_sparselift.cost.hardware import PRESETS

        d = os.path.join(tmp, "store-link")
        link = LinkRates(intra_bw=400e6, intra_latency_s=1e-4, inter_bw=None, inter_latency_s=None, spread=0.1,
                         allreduce_bw=200e6, allreduce_latency_s=2e-4, latency_spread_s=2e-5, hosts=1, ranks_per_host=2)
        path = ProfileStore(d).save(PRESETS["cpu-gloo"], current_fingerprint("cpu", 2), {"fit": {}}, link=link)
        doc = json.loads(open(path).read())
        doc["info"]["link"]["intra_bw"] = "fast"
        open(path, "w").write(json.dumps(doc))
        proc = subprocess.run([sys.executable, "-m", "torchrec_sparselift", "calibrate", "check", "--store", d],
                              capture_output=True, text=True, timeout=120, cwd=ROOT, env=dict(env(), LOCAL_WORLD_SIZE="2"))
        text = (proc.stdout + proc.stderr).strip()
        if proc.returncode == 0:
            return Outcome("exit 0", text, False, "a damaged link record passed the check")
        return judge_error(f"exit {proc.returncode}", text, ["info.link"], ["delete", "calibrate"])

    def testbed(args: Sequence[str], culprit: Sequence[str]) -> Callable[[], Outcome]:
        def case() -> Outcome:
            proc = subprocess.run([sys.executable, "-m", "torchrec_sparselift.measure.testbed", *args, "--", "-c", "pass"],
                                  capture_output=True, text=True, timeout=120, cwd=ROOT, env=env())
            if proc.returncode == 0:
                return Outcome("exit 0", proc.stderr[-300:], False, "accepted a bad input")
            o = judge_error(f"exit {proc.returncode}", proc.stderr.strip(), culprit)
            if proc.returncode != 2 and o.clear:
                o.clear, o.why = False, f"exit {proc.returncode}, not 2 (a bad option)"
            return o
        return case

    def lost_rank(how: str, step: str = "3") -> Callable[[], Outcome]:
        def case() -> Outcome:
            procs = _ranks([*TINY_RUN, "--plan-cache", os.path.join(tmp, f"plans-{how}-{step}"), "--fail-at-step", step,
                            "--fail-how", how, "--fail-rank", "1", "--collective-timeout", "10"])
            survivor = procs[0]
            if survivor.returncode == 0:
                return Outcome("exit 0", survivor.stderr[-300:], False, "the survivor did not notice the lost rank")
            return example_error(survivor, ["lost rank 1"], ["resume", "checkpoint"])
        return case

    def testbed_job_exit() -> Outcome:
        # torchrun exits 1 whatever its worker's code: the testbed reports and returns the job's own
        job = write(os.path.join(tmp, "exit3.py"), b"import os, sys\nsys.exit(3 if os.environ['SPARSELIFT_TESTBED_HOST']"
                                                   b" == '1' else 0)\n")
        proc = subprocess.run([sys.executable, "-m", "torchrec_sparselift.measure.testbed", "--hosts", "2",
                               "--grace", "3", "--", job], capture_output=True, text=True, timeout=120, cwd=ROOT,
                              env=env())
        text = "\n".join(ln for ln in proc.stderr.splitlines() if ln.startswith(("testbed:", "error:")))
        if proc.returncode != 3 or "job exit 3" not in text:
            return Outcome(f"exit {proc.returncode}", text or proc.stderr[-300:], False,
                           "the job's own exit code (3) is not what the testbed reports")
        return Outcome("exit 3", text, True, "the job's own exit code, reported and returned")

    def module_two_d(module_type: Any, **kw: Any) -> Callable[[], Any]:
        def make() -> Any:
            from torchrec.distributed.types import ShardingPlan

            from torchrec_sparselift.runtime.two_d import ModuleTwoD

            return ModuleTwoD(module_type, ShardingPlan({}), **{"sharding_group_size": 2, **kw})
        return make

    def stored_inputs_check() -> Any:
        from torchrec_sparselift.files import load_json
        from torchrec_sparselift.plan import PlanInputs

        doc = {"schema": "sparselift.cli_inputs/1", "topology": {"hardware": "cpu-gloo", "world_size": 2},
               "batch_size": 64, "tables": None, "workload": None, "model": None}
        p = write(os.path.join(tmp, "stored_inputs.json"), json.dumps(doc).encode())
        return PlanInputs.from_dict(load_json(p), file=p)

    def truncated_checkpoint_marker() -> Any:
        from torchrec_sparselift.dlrm.checkpoint import latest_checkpoint

        d = os.path.join(tmp, "ck-truncated")
        os.makedirs(os.path.join(d, "step_00000004"), exist_ok=True)
        write(os.path.join(d, "latest.json"), b'{"schema": "dlrm_example.checkpoint/1", "step": 4, "pa')
        return latest_checkpoint(d, {"seed": 1})

    def hang_case() -> Outcome:
        # the silent rank never exits by itself: _ranks kills it once the survivor is done
        return lost_rank("hang")()

    return {
        "options: sync_interval for a 1D plan": lambda: api_error(lambda: plan(sync_interval=2),
                                                                   ["sync_interval", "sharding_group_size"]),
        "options: allow_fp8 without allow_lossy_comm": lambda: api_error(lambda: plan(allow_fp8=True),
                                                                          ["allow_fp8", "allow_lossy_comm"]),
        "options: drift_tolerance without cache_dir": lambda: api_error(lambda: plan(drift_tolerance=0.3),
                                                                         ["drift_tolerance", "cache_dir"]),
        "options: timeout_seconds and time_budget_s differ": lambda: api_error(
            lambda: plan(timeout_seconds=5, time_budget_s=1), ["timeout_seconds", "time_budget_s"]),
        "options: a storage reservation and a percentage": lambda: api_error(
            reservation_and_percentage, ["heuristical_storage_reservation_percentage"]),
        "names: model_errors with an unknown term": lambda: api_error(unknown_term, ["1/a2a_bandwidth"]),
        "cli: --layout-2d for a 1D plan": lambda: cli_error(
            ["plan", "--workload", "dcnv2", "--world-size", "8", "--layout-2d", "strided", "--quiet",
             "--out", os.path.join(tmp, "p.json")], ["--layout-2d", "--sharding-group-size"]),
        "cli: --max-sync-interval for a 1D plan": lambda: cli_error(
            ["plan", "--workload", "dcnv2", "--world-size", "8", "--max-sync-interval", "4", "--quiet",
             "--out", os.path.join(tmp, "p.json")], ["--max-sync-interval"]),
        "example: --sync-interval for a 1D plan": lambda: example_error(
            example(["--sync-interval", "2", "--check", "--device", "cpu"]), ["--sync-interval"]),
        "example: --fail-how without --fail-at-step": lambda: example_error(
            example(["--fail-how", "kill", "--check", "--device", "cpu"]), ["--fail-how", "--fail-at-step"]),
        "records: a damaged link record, plain calibrate check": damaged_link_record,
        "testbed: --rate 1gb (tc reads gb as gigabytes)": testbed(["--hosts", "2", "--rate", "1gb"], ["rate", "1gb"]),
        "testbed: --hosts 0": testbed(["--hosts", "0"], ["hosts"]),
        "fault: a rank killed mid-run": lost_rank("kill"),
        "fault: a rank that stops answering": hang_case,
        "fault: a rank killed at the last step (after the loop)": lost_rank("kill", TINY_RUN[TINY_RUN.index("--steps") + 1]),
        "testbed: a failed job's own exit code": testbed_job_exit,
        "names: ModuleTwoD with an unknown module type name": lambda: api_error(
            module_two_d("EmbeddingCollections"), ["EmbeddingCollections", "EmbeddingCollection"], ["valid"]),
        "config: ModuleTwoD sharding_group_size '2' (a string)": lambda: api_error(
            module_two_d("EmbeddingCollection", sharding_group_size="2"), ["sharding_group_size", "EmbeddingCollection"]),
        "file: stored plan inputs that fail their own check name the file": lambda: api_error(
            stored_inputs_check, ["stored_inputs.json"]),
        "file: a truncated checkpoint marker": lambda: api_error(truncated_checkpoint_marker, ["ck-truncated",
                                                                                              "latest.json"]),
    }


def run_case(fn: Callable[[], Outcome], timeout_s: int) -> Outcome:
    def alarm(signum, frame):
        raise CaseTimeout()

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(timeout_s)
    try:
        return fn()
    except CaseTimeout:
        return Outcome("hang", f"no outcome within {timeout_s} s", False, "hang")
    except subprocess.TimeoutExpired as e:
        return Outcome("hang", str(e), False, "hang")
    except BaseException as e:  # noqa: BLE001 - a case that could not run is not clear
        return Outcome(f"audit error {type(e).__name__}", f"{e} {traceback.format_exc()[-600:]}", False,
                       "the case itself failed")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    ap.add_argument("--json", default=None, help="also write the outcomes here")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per case")
    args = ap.parse_args(argv)
    logging.getLogger("torchrec").setLevel(logging.ERROR)

    start = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cases: Dict[str, Callable[[], Outcome]] = {}
        for group in (api_cases, file_cases, cache_cases, other_cases, option_cases):
            cases.update(group(tmp))
        for name, fn in cases.items():
            if args.only and args.only not in name:
                continue
            t0 = time.monotonic()
            o = run_case(fn, args.timeout)
            rows.append({"case": name, "outcome": o.kind, "message": o.text.strip(), "clear": o.clear,
                         "why": o.why, "seconds": round(time.monotonic() - t0, 1)})
            print(f"{'yes' if o.clear else 'NO ':3}  {name}  [{o.kind}, {rows[-1]['seconds']} s]", file=sys.stderr,
                  flush=True)

    width = max(len(r["case"]) for r in rows)
    print(f"\n{'case':{width}}  {'clear':5}  outcome / why / message")
    for r in rows:
        msg = " ".join(r["message"].split())
        msg = msg if len(msg) <= 240 else msg[:237] + "..."
        print(f"{r['case']:{width}}  {'yes' if r['clear'] else 'NO':5}  {r['outcome']} / {r['why']}")
        print(f"{'':{width}}         {msg}")
    n = sum(r["clear"] for r in rows)
    print(f"\n{n} of {len(rows)} clear ({time.monotonic() - start:.0f} s)")
    if args.json:
        write_report(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
