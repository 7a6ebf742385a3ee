"""The dense part of a model as the planner sees it: parameter bytes and forward FLOPs per sample.

What is *not* an embedding table is dense work: every rank holds it (data parallel), runs it each
step and all-reduces its gradients. :func:`dense_work` reads it off the module; the cost layer
prices it (:mod:`torchrec_sparselift.cost.model`).
"""

from __future__ import annotations

from typing import Sequence

import attrs
from torch import nn

from torchrec_sparselift.semantics.tables import TableHandle

__all__ = ["DenseWork", "dense_work"]


@attrs.frozen
class DenseWork:
    """The dense part of the model, per rank: parameters and FLOPs per sample (forward)."""

    param_bytes: float = 0.0
    fwd_flops_per_sample: float = 0.0


def dense_work(module: nn.Module, handles: Sequence[TableHandle]) -> DenseWork:
    """Dense parameters (bytes) and forward FLOPs per sample, from the module's non-embedding
    parameters (2 FLOPs per weight per sample: a multiply and an add) plus known parameter-free
    work (DLRM's dot interaction)."""
    sparse_ids = {id(h.tensor) for h in handles}
    sharded_modules = {id(h.module[1]) for h in handles}
    skip = set()
    for m in module.modules():
        if id(m) in sharded_modules:
            skip.update(id(p) for p in m.parameters())
    numel = 0
    nbytes = 0
    for p in module.parameters():
        if id(p) in skip or id(p) in sparse_ids:
            continue
        numel += p.numel()
        nbytes += p.numel() * p.element_size()
    flops = 2.0 * numel + _interaction_flops(module, handles)
    return DenseWork(param_bytes=float(nbytes), fwd_flops_per_sample=flops)


def _interaction_flops(module: nn.Module, handles: Sequence[TableHandle]) -> float:
    """FLOPs per sample of parameter-free dense work TorchRec models do: DLRM's pairwise dot
    interaction (``InteractionArch``: a batched ``(F+1) x D`` by ``D x (F+1)`` product)."""
    dims = [h.spec.embedding_dim for h in handles]
    if not dims:
        return 0.0
    dim = max(dims)
    total = 0.0
    for m in module.modules():
        if type(m).__name__ == "InteractionArch" and isinstance(getattr(m, "F", None), int):
            total += 2.0 * (m.F + 1) ** 2 * dim
    return total
