"""What the exactness tests of the pipelines share: a model sharded per a plan with TorchRec's
fused row-wise AdaGrad on its embedding tables and Adagrad on the rest, and a rank's local values
of a state-dict entry (for comparing weights across runs)."""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

import torch


def sharded_with_optimizers(model: torch.nn.Module, plan: Any, fused_params: Iterable[torch.nn.Parameter],
                            state: Optional[Dict[str, Any]] = None, embedding_lr: float = 0.1,
                            dense_lr: float = 0.05) -> Tuple[Any, Any]:
    """``DistributedModelParallel(model, plan)`` on CPU with row-wise AdaGrad fused into the backward
    of ``fused_params`` and Adagrad on every other parameter; ``state`` loaded when given.
    Returns ``(dmp, optimizer)``."""
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    apply_optimizer_in_backward(RowWiseAdagrad, list(fused_params), {"lr": embedding_lr})
    dmp = DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan, sharders=get_default_sharders())
    if state is not None:
        dmp.load_state_dict(state)
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    opt = CombinedOptimizer([dmp.fused_optimizer,
                             KeyedOptimizerWrapper(dense, lambda params: torch.optim.Adagrad(params, lr=dense_lr))])
    return dmp, opt


def local_values(value: Any) -> torch.Tensor:
    """This rank's values of a state-dict entry, flattened (a ShardedTensor's local shards, a
    DTensor's local part, a plain tensor)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):
        return torch.cat([s.tensor.flatten() for s in value.local_shards()]) if value.local_shards() else torch.zeros(0)
    if hasattr(value, "to_local"):  # DTensor
        return value.to_local().flatten()
    return value.detach().flatten()
