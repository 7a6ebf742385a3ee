"""Which TorchRec qcomm precisions run on gloo, forward and backward, and how close to fp32.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 -m benchmarks.gloo_comm_precisions [--out F.json]

For a table-wise table (pooled all-to-all) and a row-wise table (reduce-scatter), every
(forward, backward) pair of fp32/fp16/bf16/fp8, one forward and backward on the dense kernel
(so the embedding gradient is visible) against fp32: the relative error of the pooled output and
of the table gradient, or the error raised. "registry" installs TorchRec's
``get_qcomm_codecs_registry(..., device=cpu)`` (what ``runtime.lift`` installs: it substitutes
fp16 for bf16 on CPU and falls back from fp8 on the reduce-scatter); "direct" builds the codecs
with ``get_qcomm_codecs`` (what the precision itself does on gloo). The result is declared in
``torchrec_sparselift.vocabulary.COMM_PRECISION_REGISTRY``; docs/benchmarks.md has the numbers.
"""

import argparse
import itertools
import logging

import torch
import torch.distributed as dist

from benchmarks.harness import write_report

PRECISIONS = ("fp32", "fp16", "bf16", "fp8")


def build(registry, sharding):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=50, feature_names=[f"f{i}"])
              for i in range(2)]
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry)
    if sharding == "table_wise":
        spec = {"t0": table_wise(rank=0, compute_kernel="dense"), "t1": table_wise(rank=1, compute_kernel="dense")}
    else:
        spec = {"t0": row_wise(compute_kernel="dense"), "t1": row_wise(compute_kernel="dense")}
    mp = construct_module_sharding_plan(ebc, spec, sharder=sharder, local_size=2, world_size=2, device_type="cpu")
    return DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                    device=torch.device("cpu"), plan=ShardingPlan({"": mp}), sharders=[sharder])


def step(model, rank):
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(10 + rank)
    kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.randint(0, 50, (16,), generator=g),
                            lengths=torch.full((8,), 2))
    out = model(kjt).values()
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(99 + rank))).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def measure(rank):
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs, get_qcomm_codecs_registry
    from torchrec.distributed.types import CommOp

    res = {}
    for sharding in ("table_wise", "row_wise"):
        ref_out, ref_g = step(build(None, sharding), rank)
        for fwd, bwd in itertools.product(PRECISIONS, repeat=2):
            if fwd == bwd == "fp32":
                continue
            cfg = QCommsConfig(forward_precision=CommType(fwd), backward_precision=CommType(bwd))
            for mode in ("registry", "direct"):
                key = f"{sharding} {fwd}/{bwd} {mode}"
                try:
                    if mode == "registry":
                        reg = get_qcomm_codecs_registry(cfg, device=torch.device("cpu"))
                    else:
                        c = get_qcomm_codecs(cfg)
                        reg = {op.name: c for op in (CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL,
                                                     CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER,
                                                     CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL)}
                    out, g = step(build(reg, sharding), rank)
                    fe = float((out - ref_out).abs().max() / ref_out.abs().max())
                    ge = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(g, ref_g))
                    res[key] = {"ok": True, "fwd_rel_err": fe, "grad_rel_err": ge}
                except Exception as e:  # noqa: BLE001 - the error is the measurement
                    res[key] = {"ok": False, "error": (type(e).__name__ + ": " + str(e)).splitlines()[0][:200]}
                dist.barrier()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write every rank's results here (rank 0)")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res = measure(rank)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, res)
    if rank == 0:
        for key in res:
            worst = every[0][key]
            if all(r[key]["ok"] for r in every):
                worst = {"fwd_rel_err": max(r[key]["fwd_rel_err"] for r in every),
                         "grad_rel_err": max(r[key]["grad_rel_err"] for r in every)}
                print(f"{key:36s} forward {worst['fwd_rel_err']:.2e}  gradient {worst['grad_rel_err']:.2e}")
            else:
                print(f"{key:36s} FAILS: {next(r[key]['error'] for r in every if not r[key]['ok'])}")
        if args.out:
            write_report(args.out, {"ranks": every})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
