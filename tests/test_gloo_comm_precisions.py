"""The comm precisions the planner offers on gloo run there, as themselves, forward and backward.

One source of truth: :data:`torchrec_sparselift.vocabulary.COMM_PRECISION_REGISTRY` says how each
precision runs on CPU/gloo; :func:`~torchrec_sparselift.vocabulary.comm_precision_pairs` with
``compute_device="cpu"`` offers only those that run as themselves. This test runs every offered
pair through the runtime's codecs on 2 gloo ranks (a table-wise table: pooled all-to-all; a
row-wise table: reduce-scatter), one forward and backward, against fp32: it fails if an offered
precision raises, is replaced by TorchRec, or returns values off by more than its rounding.
"""

import pytest
import torch

from torchrec_sparselift import vocabulary as v

OFFERED = v.comm_precision_pairs(allow_lossy_comm=True, allow_fp8=True, compute_device="cpu")


def test_gloo_offers_only_precisions_that_run_there_as_themselves():
    assert OFFERED == (("fp32", "fp32"), ("fp16", "fp16"))
    for name in v.COMM_PRECISIONS:
        p = v.comm_precision(name)
        assert p.runs_as_itself_on("cuda")
        assert p.runs_as_itself_on("cpu") == any(name in pair for pair in OFFERED)


def _model(registry, sharding):
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    tables = [EmbeddingBagConfig(name="t", embedding_dim=16, num_embeddings=50, feature_names=["f"])]
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry)
    spec = table_wise(rank=1, compute_kernel="dense") if sharding == "tw" else row_wise(compute_kernel="dense")
    plan = construct_module_sharding_plan(ebc, {"t": spec}, sharder=sharder, local_size=2, world_size=2,
                                          device_type="cpu")
    return DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                    device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder])


def _step(model, rank):
    from torchrec import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(10 + rank)
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.randint(0, 50, (16,), generator=gen),
                            lengths=torch.full((8,), 2))
    out = model(kjt).values()
    (out * torch.randn(out.shape, generator=gen)).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _worker(rank, world):
    from torchrec_sparselift.runtime.model_parallel import comm_codecs_registry

    out = {}
    for sharding in ("tw", "rw"):
        ref, ref_grads = _step(_model(None, sharding), rank)
        for fwd, bwd in OFFERED:
            registry = comm_codecs_registry(fwd, bwd, torch.device("cpu"))
            used = sorted({(c.forward._comm_precision.value, c.backward._comm_precision.value)
                           for c in (registry or {}).values()})
            q, grads = _step(_model(registry, sharding), rank)
            err = float((q - ref).abs().max() / ref.abs().max())
            gerr = max([float((a - b).abs().max() / b.abs().max()) for a, b in zip(grads, ref_grads)] or [0.0])
            out[f"{sharding} {fwd}/{bwd}"] = (used, err, gerr, len(grads) == len(ref_grads))
    return out


@pytest.mark.slow  # ~80 s on 2 cores: `pytest -m slow tests/test_gloo_comm_precisions.py`
@pytest.mark.multiprocess
def test_every_precision_offered_on_gloo_runs_forward_and_backward_as_itself():
    from launcher import run_ranks

    for res in run_ranks(_worker, 2, timeout_s=240):
        for key, (used, err, gerr, same_grads) in res.items():
            fwd, bwd = key.split()[1].split("/")
            if (fwd, bwd) != ("fp32", "fp32"):
                assert used == [(fwd, bwd)], f"{key}: TorchRec installed {used} instead"
            assert same_grads, key
            tol = 0.0 if fwd == "fp32" else 1e-2  # fp16 measured 4.5e-4 (forward), 2.9e-4 (gradient)
            assert err <= tol, (key, err)
            assert gerr <= (0.0 if bwd == "fp32" else 1e-2), (key, gerr)
