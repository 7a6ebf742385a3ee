"""How far a rewrite's training drifts from the unrewritten pipeline's, and how far the training
drifts from itself under rounding-sized noise: two models of one regime-run plan trained side by
side, step by step, on the same batches.

    torchrun --standalone --nproc_per_node 2 -m benchmarks.split_rounding --from runs/r12.json \\
        --regime R2 --workload hot_skewed --row torchrec --against 3 [--steps 25] [--resync] \\
        [--dense-optimizer adagrad|sgd] [--out R.json]

The first model is the row's plan under the unsplit ``overlap`` pipeline. ``--against K``: the
second is the same plan batch split into K chunks; ``--against noise:REL``: the same unsplit
pipeline with every weight multiplied by ``1 + REL * N(0, 1)`` once before the first step (the
training's own sensitivity to a difference of that size). ``--resync``: after every step the
second model takes the first's weights and optimizer state, so each step is compared from the
same state (a rewrite must then agree within rounding every step). Prints per step the loss
difference and the largest weight difference (which state-dict entry). The embedding tables
train with row-wise AdaGrad, the rest with ``--dense-optimizer`` (AdaGrad, as the regime
benchmark trains, or SGD). Not a timing benchmark.
"""

from __future__ import annotations

import argparse
import copy
import json
import warnings
from typing import Any, Dict, List, Tuple

import torch

from benchmarks.harness import exit_now, worker, write_report
from benchmarks.real_runs import BATCH_SEED, _workloads
from benchmarks.regimes import lift_run
from benchmarks.rewrite_pairs import replay_of, variant_spec
from torchrec_sparselift.cost.batch_split import MAX_CHUNKS
from torchrec_sparselift.measure.probe import prebuilt_batches
from torchrec_sparselift.plan.serialization import sharding_plan_from_dict

__all__ = ["parse_against", "local_values", "state_tensors", "copy_training_state", "largest_difference",
           "largest_entry", "main"]


def parse_against(text: str) -> Tuple[str, float]:
    """``"3"`` -> ``("split", 3)``; ``"noise:1e-6"`` -> ``("noise", 1e-6)``. ``ValueError`` naming
    what is wrong."""
    if text.startswith("noise:"):
        try:
            rel = float(text[len("noise:"):])
        except ValueError:
            rel = -1.0
        if not 0 < rel < 1:
            raise ValueError(f"--against {text!r}: noise:REL needs 0 < REL < 1 (e.g. noise:1e-6)")
        return "noise", rel
    if text.isdigit() and 2 <= int(text) <= MAX_CHUNKS:
        return "split", int(text)
    raise ValueError(f"--against {text!r}: give a chunk count K in 2..{MAX_CHUNKS} or noise:REL (e.g. 3, noise:1e-6)")


def local_values(value: Any) -> torch.Tensor:
    """This rank's values of a state-dict entry, flattened (a ShardedTensor's local shards, a
    DTensor's local part, a plain tensor)."""
    if hasattr(value, "local_shards"):
        shards = value.local_shards()
        return torch.cat([s.tensor.flatten() for s in shards]) if shards else torch.zeros(0)
    if hasattr(value, "to_local"):
        return value.to_local().flatten()
    return value.detach().flatten()


def state_tensors(tree: Any) -> List[torch.Tensor]:
    """Every tensor of a (model or optimizer) state dict, this rank's values, in key order."""
    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in state_tensors(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in state_tensors(v)]
    if isinstance(tree, torch.Tensor) or hasattr(tree, "local_shards"):
        return [local_values(tree).float()]
    return []


def largest_entry(a: Dict[str, Any], b: Dict[str, Any]) -> Tuple[float, str]:
    """``(difference, key)``: the largest elementwise difference between two model state dicts of one
    plan, and the entry where it is (``(0.0, "")`` when every entry is empty)."""
    return max(((float((local_values(b[n]) - local_values(v)).abs().max()), n)
                for n, v in a.items() if local_values(v).numel()), default=(0.0, ""))


def largest_difference(a: Any, b: Any) -> float:
    """The largest elementwise difference between two state dicts of one layout (0.0 when equal)."""
    ta, tb = state_tensors(a), state_tensors(b)
    if len(ta) != len(tb) or any(x.shape != y.shape for x, y in zip(ta, tb)):
        raise ValueError("the two states hold different tensors: compare states of one plan")
    return max((float((x - y).abs().max()) for x, y in zip(ta, tb) if x.numel()), default=0.0)


def copy_training_state(src_model: torch.nn.Module, src_opt: Any, dst_model: torch.nn.Module, dst_opt: Any) -> float:
    """``dst`` takes ``src``'s weights (sharded tables' local shards and every parameter) and
    optimizer state, both of one plan; returns the largest difference left, weights and
    optimizer state alike (0.0 when the copy took)."""
    with torch.no_grad():
        src, dst = src_model.state_dict(), dst_model.state_dict()
        for name, value in src.items():
            if hasattr(value, "local_shards"):
                for a, b in zip(value.local_shards(), dst[name].local_shards()):
                    b.tensor.copy_(a.tensor)
        for (na, pa), (nb, pb) in zip(src_model.named_parameters(), dst_model.named_parameters()):
            if na != nb:
                raise ValueError(f"copy_training_state: the models differ ({na} against {nb})")
            pb.copy_(pa)
    state = src_opt.state_dict()
    if not state_tensors(state):
        raise ValueError("copy_training_state: the optimizer holds no state to copy")
    dst_opt.load_state_dict(copy.deepcopy(state))
    return max(largest_difference(src_model.state_dict(), dst_model.state_dict()),
               largest_difference(src_opt.state_dict(), dst_opt.state_dict()))


def _perturb(model: torch.nn.Module, rel: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for value in model.state_dict().values():
            for t in ([s.tensor for s in value.local_shards()] if hasattr(value, "local_shards") else [value]):
                if t.is_floating_point():
                    t.mul_(1 + rel * torch.randn(t.shape, generator=gen))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="source", required=True, help="a benchmarks.regimes result JSON")
    p.add_argument("--regime", required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--row", default="torchrec", help="the run (row) whose plan both models train")
    p.add_argument("--against", default="3", help="K (batch split) or noise:REL (default 3)")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--resync", action="store_true", help="compare every step from the same state")
    p.add_argument("--dense-optimizer", choices=("adagrad", "sgd"), default="adagrad")
    p.add_argument("--out", help="JSON file for the results (rank 0)")
    args = p.parse_args()
    try:
        kind, value = parse_against(args.against)
        with open(args.source, encoding="utf-8") as f:
            replay = replay_of(json.load(f), args.regime, args.workload, args.row)
        if args.workload not in _workloads():
            raise ValueError(f"--workload {args.workload}: not a benchmark workload ({sorted(_workloads())})")
    except (OSError, ValueError) as e:
        p.error(str(e))
    if args.steps < 1:
        p.error("--steps must be >= 1")
    warnings.filterwarnings("ignore")
    w, alpha = _workloads()[args.workload]
    plan = sharding_plan_from_dict(replay["plan"])
    dense = torch.optim.SGD if args.dense_optimizer == "sgd" else torch.optim.Adagrad
    with worker() as c:
        batches = prebuilt_batches(w, 8, seed=BATCH_SEED, rank=c.rank, alpha=alpha)
        models = []
        for chunks in (1, int(value) if kind == "split" else 1):
            spec = dict(variant_spec(replay, plan, chunks, False, []), pipeline="overlap")
            models.append(lift_run(w, spec, c.device, dense_optimizer=dense))
        if kind == "noise":
            _perturb(models[1].model, value, seed=7 + c.rank)
        its = [iter([batches[i % len(batches)] for i in range(args.steps)]) for _ in models]
        rows: List[Dict[str, Any]] = []
        for step in range(args.steps):
            losses = [float(m.pipeline.progress(it)[0].detach().mean()) for m, it in zip(models, its)]
            diff, name = largest_entry(models[0].model.state_dict(), models[1].model.state_dict())
            rows.append(dict(step=step, loss_diff=losses[1] - losses[0], weight_diff=diff, worst=name))
            c.say(f"[split_rounding] {args.workload} {args.row} against {args.against} step {step}: loss "
                  f"{losses[0]:.6f}, difference {losses[1] - losses[0]:+.1e}; largest weight difference "
                  f"{diff:.2e} ({name})")
            if args.resync:
                left = copy_training_state(models[0].model, models[0].optimizer, models[1].model,
                                           models[1].optimizer)
                if left:
                    raise RuntimeError(f"--resync: the state copy left a difference of {left:.2e}")
        if args.out and c.rank == 0:
            write_report(args.out, {"steps": rows, "settings": vars(args)})
    return 0


if __name__ == "__main__":
    exit_now(main)
