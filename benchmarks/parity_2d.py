"""Quality parity of 2D sparse parallelism: 1D vs 2D plain averaging vs 2D momentum-scaled AdaGrad.

Synthetic CTR task with a planted, learnable signal: each sample has one id per table drawn from a
power law (Zipf exponent ``--alpha``) and a few dense features; the true click logit is the sum of
a hidden per-id effect for every table plus a linear dense term. Tail ids are seen rarely, which
is where plain replica averaging slows learning (docs/optimizer.md).

Every configuration trains the same model from the same initial weights on the same global
batches for the same number of steps on ``--world`` gloo ranks (CPU; default 4), then is scored
on the same held-out set (BCE loss and AUROC, overall and on tail ids; the Bayes-optimal values
from the true logits are printed alongside):

    1d              DistributedModelParallel, tables sharded over all ranks
    2d_avg          build_2d_model_parallel, sharding groups of L (--group-size), plain averaging
    2d_ms:interval  same, MomentumScaledRowWiseAdagrad() (the default "interval" denominator)
    2d_ms:end       same, preconditioner="end" (the one-step inversion)

(``--rules`` picks the 2D merges, ``--momentum β`` adds scaled runs with momentum β,
``--contiguous`` uses contiguous sharding groups.) ``--engine sim`` runs the same training in one
process without torchrec or gloo (:func:`simulate_config`; equivalence with the gloo run is
recorded in docs/benchmarks.md section 5b), which makes wide sweeps at 8 ranks affordable.

Usage (a few minutes on 2 cores)::

    python -m benchmarks.parity_2d --seeds 0 1 2 --steps 300 --sync-interval 1 4 --out parity.json
    python -m benchmarks.parity_2d --engine sim --world 8 --group-size 4 2 --seeds 0 1 2 \
        --sync-interval 1 4 16 64 100 --rules avg end interval --out parity_w8.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from typing import Dict, List

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.harness import exit_now, write_report

WORLD, GROUP = 4, 2  # default ranks and 2D sharding group size L (R = world / L replicas)
TABLE_ROWS = [20000, 8000, 2000, 500]
DIM, DENSE = 8, 4


# ----------------------------------------------------------------------------- data


class PowerLawCTR:
    """Deterministic synthetic CTR generator; ``batch(step)`` is the same global batch on every rank."""

    def __init__(self, seed: int, alpha: float, signal: float = 1.0) -> None:
        rng = np.random.default_rng(10_000 + seed)
        self.seed = seed
        self.effects = [rng.normal(0.0, signal, size=n) for n in TABLE_ROWS]
        self.perms = [rng.permutation(n) for n in TABLE_ROWS]  # hot ids spread over row shards
        self.cdfs = []
        for n in TABLE_ROWS:
            p = 1.0 / np.arange(1, n + 1) ** alpha
            self.cdfs.append(np.cumsum(p / p.sum()))
        self.dense_w = rng.normal(0.0, 0.5, size=DENSE)
        self.bias = -1.0

    def sample(self, rng: np.random.Generator, n: int):
        ids = [
            perm[np.minimum(np.searchsorted(cdf, rng.random(n)), len(cdf) - 1)]
            for perm, cdf in zip(self.perms, self.cdfs)
        ]
        dense = rng.normal(size=(n, DENSE))
        logit = self.bias + dense @ self.dense_w + sum(e[i] for e, i in zip(self.effects, ids))
        label = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return ids, dense.astype(np.float32), label, logit

    def batch(self, step: int, global_batch: int):
        return self.sample(np.random.default_rng((self.seed, 1, step)), global_batch)

    def heldout(self, n: int):
        return self.sample(np.random.default_rng((self.seed, 2)), n)


def bce(logit: np.ndarray, label: np.ndarray) -> float:
    return float(np.mean(np.logaddexp(0.0, logit) - label * logit))


def auroc(score: np.ndarray, label: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties)."""
    order = np.argsort(score, kind="mergesort")
    s = score[order]
    ranks = np.empty(len(score))
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    pos = label == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


# ----------------------------------------------------------------------------- model


def make_model():
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=DIM, num_embeddings=n, feature_names=[f"f{i}"]
        )
        for i, n in enumerate(TABLE_ROWS)
    ]

    class CTRNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
            self.mlp = torch.nn.Sequential(
                torch.nn.Linear(DIM * len(tables) + DENSE, 32),
                torch.nn.ReLU(),
                torch.nn.Linear(32, 1),
            )

        def forward(self, kjt, dense):
            kt = self.ebc(kjt)
            x = torch.cat([kt[f"f{i}"] for i in range(len(TABLE_ROWS))] + [dense], dim=1)
            return self.mlp(x).squeeze(1)

    return CTRNet()


def make_plan(net, sharder, world: int):
    """Table-wise over ``world`` ranks, the largest table row-wise; fused kernels."""
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan

    per_param = {"t0": row_wise(compute_kernel="fused")}
    for i in range(1, len(TABLE_ROWS)):
        per_param[f"t{i}"] = table_wise(rank=i % world, compute_kernel="fused")
    module_plan = construct_module_sharding_plan(
        net.ebc, per_param, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
    )
    return ShardingPlan({"ebc": module_plan})


def init_state(seed: int) -> Dict[str, torch.Tensor]:
    """Initial weights shared by every configuration (embeddings and MLP)."""
    g = torch.Generator().manual_seed(20_000 + seed)
    state = {f"ebc.embedding_bags.t{i}.weight": torch.randn(n, DIM, generator=g) * 0.01 for i, n in enumerate(TABLE_ROWS)}
    ref = make_model().mlp
    for name, p in ref.named_parameters():
        bound = 1.0 / np.sqrt(p.shape[-1] if p.dim() > 1 else 32)
        state[f"mlp.{name}"] = (torch.rand(p.shape, generator=g) * 2 - 1) * bound
    return state


def to_kjt(ids: List[np.ndarray]):
    from torchrec import KeyedJaggedTensor

    n = len(ids[0])
    return KeyedJaggedTensor(
        keys=[f"f{i}" for i in range(len(ids))],
        values=torch.from_numpy(np.concatenate(ids).astype(np.int64)),
        lengths=torch.ones(n * len(ids), dtype=torch.long),
    )


# ----------------------------------------------------------------------------- one run


def run_config(name: str, seed: int, args, rank: int) -> Dict[str, float]:
    WORLD = args.world
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from torchrec_sparselift.optim import MomentumScaledRowWiseAdagrad
    from torchrec_sparselift.runtime.two_d import build_2d_model_parallel
    from torchrec_sparselift.runtime import copy_full_state

    kind, group, interval, momentum = name.split("|")
    group, interval, momentum = int(group), int(interval), float(momentum)
    rule = kind.split(":")[1] if ":" in kind else "interval"
    data = PowerLawCTR(seed, args.alpha)
    sharder = EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": args.lr,
            "eps": 1e-8,
        }
    )
    net = make_model()
    if kind == "1d":
        env = ShardingEnv.from_process_group(dist.group.WORLD)
        model = DistributedModelParallel(
            net, env=env, device=torch.device("cpu"), plan=make_plan(net, sharder, WORLD), sharders=[sharder]
        )
    else:
        replica_sync = (MomentumScaledRowWiseAdagrad(momentum=momentum, preconditioner=rule)
                        if kind.startswith("2d_ms") else None)
        model = build_2d_model_parallel(
            net,
            make_plan(net, sharder, group),
            sharding_group_size=group,
            global_pg=dist.group.WORLD,
            device=torch.device("cpu"),
            sharders=[sharder],
            sync_interval=interval,
            replica_sync=None,
            use_inter_host_allreduce=args.contiguous,
        )
    copy_full_state(model, init_state(seed))
    if kind != "1d":  # bind the replica sync to the shared initial state
        model.install_replica_sync(replica_sync, interval)
    dense_params = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    opt = torch.optim.Adagrad(dense_params, lr=args.dense_lr)
    local = args.batch
    lo, hi = rank * local, (rank + 1) * local
    t0 = time.perf_counter()
    for step in range(args.steps):
        ids, dense, label, _ = data.batch(step, local * WORLD)
        logits = model(to_kjt([i[lo:hi] for i in ids]), torch.from_numpy(dense[lo:hi]))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(label[lo:hi]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if kind != "1d":
            model.step_done()
    if kind != "1d" and args.steps % interval != 0:
        model.sync()
    train_s = time.perf_counter() - t0
    # held-out evaluation: every rank scores its slice, rank 0 gathers
    ids, dense, label, true_logit = data.heldout(args.eval)
    per = args.eval // WORLD
    with torch.no_grad():
        pred = model(
            to_kjt([i[rank * per : (rank + 1) * per] for i in ids]),
            torch.from_numpy(dense[rank * per : (rank + 1) * per]),
        )
    parts = [torch.empty_like(pred) for _ in range(WORLD)]
    dist.all_gather(parts, pred)
    scores = torch.cat(parts).double().numpy()
    if kind == "1d":
        group = WORLD
    result = score_result(kind, group, interval, momentum, seed, scores, label, true_logit, ids, data, train_s)
    del model
    return result


def score_result(kind, group, interval, momentum, seed, scores, label, true_logit, ids, data, train_s):
    """Held-out loss and AUROC, overall and on tail samples, with the Bayes-optimal reference."""
    n = len(scores)
    label, true_logit = label[:n], true_logit[:n]
    # tail: held-out samples whose table-0 id is outside the 1000 hottest ids
    hot = set(data.perms[0][:1000].tolist())
    tail = np.array([i not in hot for i in ids[0][:n]])
    return {
        "config": kind,
        "sharding_group_size": group,
        "sync_interval": interval,
        "momentum": momentum,
        "seed": seed,
        "loss": bce(scores, label),
        "auroc": auroc(scores, label),
        "tail_loss": bce(scores[tail], label[tail]),
        "tail_auroc": auroc(scores[tail], label[tail]),
        "bayes_loss": bce(true_logit, label),
        "bayes_auroc": auroc(true_logit, label),
        "train_s": train_s,
    }


# ----------------------------------------------------------------------------- one process


def replica_of_rank(world: int, group: int, contiguous: bool) -> List[int]:
    """Replica (sharding group) index of every rank, as DMPCollection lays them out."""
    R = world // group
    return [j // group if contiguous else j % R for j in range(world)]


def simulate_config(name: str, seed: int, args) -> Dict[str, float]:
    """The same training as :func:`run_config`, in one process, without torchrec or gloo.

    Every replica's tables are a ``[R, rows, dim]`` tensor; the dense MLP is shared (DDP over
    all ranks averages its gradient, so every replica holds the same MLP). Each rank's share of
    the global batch looks up its replica's tables; the loss summed over ranks (each rank's
    local mean) gives every table row the sum of its ranks' gradients, as TorchRec's sharded
    backward does, and the MLP gets that sum divided by the world size (DDP's average). Tables
    step with exact row-wise AdaGrad (the reference rule of fbgemm's fused kernel); syncs run
    plain averaging or :func:`~torchrec_sparselift.optim.local_payload` summed over replicas
    then :func:`~torchrec_sparselift.optim.finish_merge`: the same functions the distributed
    sync calls, with the replica SUM done by a tensor sum instead of an all-reduce.
    """
    from torchrec_sparselift.optim import finish_merge, local_payload

    kind, group, interval, momentum = name.split("|")
    group, interval, momentum = int(group), int(interval), float(momentum)
    W = args.world
    if kind == "1d":
        group = W
    R = W // group
    rule = kind.split(":")[1] if ":" in kind else "interval"
    data = PowerLawCTR(seed, args.alpha)
    state = init_state(seed)
    tables = [
        state[f"ebc.embedding_bags.t{i}.weight"].unsqueeze(0).repeat(R, 1, 1).clone()
        for i in range(len(TABLE_ROWS))
    ]
    accs = [torch.zeros(R, n) for n in TABLE_ROWS]
    mlp = make_model().mlp
    with torch.no_grad():
        for pname, p in mlp.named_parameters():
            p.copy_(state[f"mlp.{pname}"])
    opt = torch.optim.Adagrad(list(mlp.parameters()), lr=args.dense_lr)
    lr, eps = args.lr, 1e-8
    local = args.batch
    rep = torch.tensor(replica_of_rank(W, group, args.contiguous)).repeat_interleave(local)
    anchors = [(t.clone(), a.clone()) for t, a in zip(tables, accs)]
    mbufs = [torch.zeros((), dtype=torch.float64) for _ in tables]
    t0 = time.perf_counter()

    def sync() -> None:
        for i in range(len(tables)):
            if kind == "2d_avg":
                tables[i][:] = tables[i].mean(0, keepdim=True)
                accs[i][:] = accs[i].mean(0, keepdim=True)
                continue
            aw, aa = anchors[i]
            summed = sum(local_payload(aw[r], aa[r], tables[i][r], accs[i][r], lr, eps, interval, rule)
                         for r in range(R))
            w, a, m, _ = finish_merge(aw[0], aa[0], mbufs[i], summed, lr, eps, interval, momentum, rule)
            if momentum > 0:
                mbufs[i] = m
            tables[i][:] = w.to(tables[i].dtype)
            accs[i][:] = a.to(accs[i].dtype)
            anchors[i] = (tables[i].clone(), accs[i].clone())

    for step in range(args.steps):
        ids, dense, label, _ = data.batch(step, local * W)
        flat = [rep * n + torch.from_numpy(i.astype(np.int64)) for n, i in zip(TABLE_ROWS, ids)]
        emb = [t.view(-1, DIM)[f].requires_grad_(True) for t, f in zip(tables, flat)]
        logits = mlp(torch.cat(emb + [torch.from_numpy(dense)], dim=1)).squeeze(1)
        per_sample = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, torch.from_numpy(label), reduction="none")
        total = per_sample.view(W, local).mean(1).sum()
        total.backward()
        with torch.no_grad():
            for p in mlp.parameters():
                p.grad /= W
            opt.step()
            opt.zero_grad()
            for i, (e, f) in enumerate(zip(emb, flat)):
                rows, inverse = torch.unique(f, return_inverse=True)
                g = torch.zeros(len(rows), DIM).index_add_(0, inverse, e.grad)
                w, a = tables[i].view(-1, DIM), accs[i].view(-1)
                a[rows] += g.pow(2).mean(dim=1)
                w[rows] -= lr * g / (a[rows].sqrt() + eps).unsqueeze(1)
        if kind != "1d" and (step + 1) % interval == 0:
            sync()
    if kind != "1d" and args.steps % interval != 0:
        sync()
    train_s = time.perf_counter() - t0
    ids, dense, label, true_logit = data.heldout(args.eval)
    with torch.no_grad():
        emb = [t[0][torch.from_numpy(i.astype(np.int64))] for t, i in zip(tables, ids)]
        scores = mlp(torch.cat(emb + [torch.from_numpy(dense)], dim=1)).squeeze(1).double().numpy()
    return score_result(kind, group, interval, momentum, seed, scores, label, true_logit, ids, data, train_s)


def config_names(args) -> List[str]:
    configs = [f"1d|{args.world}|1|0"]
    for group in args.group_size:
        for n in args.sync_interval:
            configs += [f"2d_avg|{group}|{n}|0"] if "avg" in args.rules else []
            configs += [f"2d_ms:{r}|{group}|{n}|0" for r in ("end", "interval") if r in args.rules]
            configs += [f"2d_ms:interval|{group}|{n}|{m}" for m in args.momentum]
    return configs


def worker(rank: int, port: int, args, queue) -> None:
    WORLD = args.world
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(WORLD))
        import logging
        import warnings

        logging.getLogger().setLevel(logging.ERROR)
        warnings.filterwarnings("ignore")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        configs = config_names(args)
        for seed in args.seeds:
            for name in configs:
                res = run_config(name, seed, args, rank)
                if rank == 0:
                    queue.put(res)
                    print(json.dumps(res), flush=True)
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        queue.put({"error": f"rank {rank}: {traceback.format_exc()}"})
        raise


def summarize(results: List[Dict]) -> str:
    key = lambda r: (r["config"], r["sharding_group_size"], r["sync_interval"], r["momentum"])
    keys = sorted({key(r) for r in results}, key=lambda k: (k[0] != "1d", -k[1], k[2], k[0], k[3]))
    base = {r["seed"]: r for r in results if r["config"] == "1d"}
    lines = [
        "| config | L | N | momentum | held-out loss | AUROC | tail loss | tail AUROC "
        "| loss - 1D (paired, mean ± sd) | seeds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k in keys:
        kind, group, n, m = k
        rs = [r for r in results if key(r) == k]
        f = lambda name: f"{np.mean([r[name] for r in rs]):.4f}"
        diff = [r["loss"] - base[r["seed"]]["loss"] for r in rs if r["seed"] in base]
        lines.append(
            f"| {kind} | {group} | {n if kind != '1d' else '-'} | {m if kind == '2d_ms' else '-'} "
            f"| {f('loss')} | {f('auroc')} | {f('tail_loss')} | {f('tail_auroc')} "
            f"| {np.mean(diff):+.5f} ± {np.std(diff):.5f} | {len(rs)} |"
        )
    lines.append(
        f"Bayes-optimal (true logits): loss {np.mean([r['bayes_loss'] for r in results]):.4f}, "
        f"AUROC {np.mean([r['bayes_auroc'] for r in results]):.4f}"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=128, help="per-rank batch size")
    p.add_argument("--sync-interval", type=int, nargs="+", default=[1])
    p.add_argument("--group-size", type=int, nargs="+", default=[GROUP], help="2D sharding group sizes L")
    p.add_argument("--momentum", type=float, nargs="*", default=[], help="extra 2d_ms runs with these momenta")
    p.add_argument("--alpha", type=float, default=1.1, help="Zipf exponent of the ids")
    p.add_argument("--lr", type=float, default=0.05, help="row-wise AdaGrad learning rate")
    p.add_argument("--dense-lr", type=float, default=0.05)
    p.add_argument("--eval", type=int, default=32768, help="held-out samples")
    p.add_argument("--world", type=int, default=WORLD, help="ranks (gloo processes, or simulated)")
    p.add_argument("--engine", choices=["gloo", "sim"], default="gloo",
                   help="gloo: TorchRec on gloo ranks; sim: the same training in one process (simulate_config)")
    p.add_argument("--rules", nargs="+", default=["avg", "interval"], choices=["avg", "end", "interval"],
                   help="2D merges: TorchRec plain averaging, momentum-scaled with the 'end' or 'interval' preconditioner")
    p.add_argument("--contiguous", action="store_true",
                   help="contiguous sharding groups (DMPCollection use_inter_host_allreduce=True)")
    p.add_argument("--out", default=None, help="write the per-run results as JSON here")
    args = p.parse_args(argv)
    if args.engine == "sim":
        torch.set_num_threads(1)
        results = []
        for seed in args.seeds:
            for name in config_names(args):
                res = simulate_config(name, seed, args)
                results.append(res)
                print(json.dumps(res), flush=True)
        print(summarize(results))
        if args.out:
            write_report(args.out, {"args": vars(args), "results": results}, indent=2)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker, args=(r, port, args, queue)) for r in range(args.world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    results = []
    while not queue.empty():
        results.append(queue.get())
    errors = [r["error"] for r in results if "error" in r]
    if errors or any(proc.exitcode != 0 for proc in procs):
        print("\n".join(errors), file=sys.stderr)
        return 1
    print(summarize(results))
    if args.out:
        write_report(args.out, {"args": vars(args), "results": results}, indent=2)
    return 0


if __name__ == "__main__":
    exit_now(main)
