"""What the exactness tests of the pipelines share: a model sharded per a plan with TorchRec's
fused row-wise AdaGrad on its embedding tables and Adagrad on the rest, and a rank's local values
of a state-dict entry (for comparing weights across runs)."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from benchmarks.split_rounding import local_values  # noqa: F401  (the tests' one reading of a rank's values)


def sharded_with_optimizers(model: torch.nn.Module, plan: Any, fused_params: Iterable[torch.nn.Parameter],
                            state: Optional[Dict[str, Any]] = None, embedding_lr: float = 0.1,
                            dense_lr: float = 0.05, sgd: bool = False) -> Tuple[Any, Any]:
    """``DistributedModelParallel(model, plan)`` on CPU with row-wise AdaGrad fused into the backward
    of ``fused_params`` and Adagrad on every other parameter (``sgd``: SGD on both); ``state``
    loaded when given. Returns ``(dmp, optimizer)``."""
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    embedding_optimizer, dense_optimizer = (torch.optim.SGD, torch.optim.SGD) if sgd else (RowWiseAdagrad, torch.optim.Adagrad)
    apply_optimizer_in_backward(embedding_optimizer, list(fused_params), {"lr": embedding_lr})
    dmp = DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan, sharders=get_default_sharders())
    if state is not None:
        dmp.load_state_dict(state)
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    opt = CombinedOptimizer([dmp.fused_optimizer,
                             KeyedOptimizerWrapper(dense, lambda params: dense_optimizer(params, lr=dense_lr))])
    return dmp, opt


def plan_with_fused(ebc: Any, spec: Dict[str, Tuple[str, Optional[int]]], world: int) -> Tuple[Any, List[Any]]:
    """``(ShardingPlan, fused parameters)`` of the EBC at ``model.sparse_arch.embedding_bag_collection``
    with ``spec``: table -> (``"tw"`` with its rank, or ``"rw"``, ``"cw"``, ``"dp"``, ``"twrw"``);
    the fused parameters are every table's but the data-parallel ones."""
    from torchrec.distributed.sharding_plan import (
        column_wise, construct_module_sharding_plan, data_parallel, row_wise, table_row_wise,
        table_wise,
    )  # fmt: skip
    from torchrec.distributed.types import ShardingPlan

    make = {"tw": lambda r: table_wise(rank=r, compute_kernel="fused"),
            "rw": lambda r: row_wise(compute_kernel="fused"),
            "cw": lambda r: column_wise(ranks=list(range(world)), compute_kernel="fused"),
            "dp": lambda r: data_parallel(),
            "twrw": lambda r: table_row_wise(host_index=0)}
    plan = ShardingPlan({"model.sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc, {t: make[kind](r) for t, (kind, r) in spec.items()},
        world_size=world, local_size=world, device_type="cpu")})
    fused = [p for t, (kind, _r) in spec.items() if kind != "dp" for p in ebc.embedding_bags[t].parameters()]
    return plan, fused
