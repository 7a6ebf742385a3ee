"""The dense part of a model as the planner sees it: parameter bytes, FLOPs and activation bytes
per sample.

What is *not* an embedding table is dense work: every rank holds it (data parallel), runs it each
step and all-reduces its gradients. :func:`dense_work` reads it off the module; the cost layer
prices it (:mod:`torchrec_sparselift.cost.model`):

- ``fwd_flops_per_sample``: 2 FLOPs per dense weight per sample (the MLPs' and cross layers'
  matrix products).
- ``interaction_flops_per_sample``: parameter-free batched products (DLRM's pairwise dot
  interaction ``InteractionArch``: a ``(F+1) x D`` by ``D x (F+1)`` product per sample). Small
  batched matrices run at a fraction of a large matmul's rate on CPU, so they are priced apart.
- ``activation_bytes_per_sample``: the tensors the dense forward writes that its FLOPs do not
  account for, each read again by the backward: the pooled embeddings gathered into the dense
  input (``F * D``), every linear layer's output and its activation, the interaction's concatenation,
  pairwise products and their upper triangle (DLRM), the cross layers' per-layer intermediates
  (DCN). Attribution of real CPU steps found these the larger part of the dense step
  (docs/cost_model.md, "Dense part").
- ``indep_fwd_flops_per_sample`` / ``indep_activation_bytes_per_sample``: the part of the two
  above done by modules whose inputs do not depend on a sharded module's output (DLRM's bottom
  MLP ``dense_arch``): work the ``overlap`` pipeline runs while the embeddings' all-to-alls are in
  flight. Found by tracing the model (``torch.fx``, every module without a sharded module inside
  it a leaf): a leaf call none of whose inputs is downstream of a sharded module's call is
  independent. A model ``torch.fx`` cannot trace has no independent part (0: the ``overlap``
  pipeline is then priced as hiding nothing behind dense work).
"""

from __future__ import annotations

import logging
from typing import List, Sequence, Set, Tuple

import attrs
import torch.fx
from torch import nn

from torchrec_sparselift.semantics.tables import TableHandle

__all__ = ["DenseWork", "dense_work", "independent_modules", "dlrm_interaction", "ACTIVATION_BYTES"]

#: Bytes of one activation element (fp32 training).
ACTIVATION_BYTES = 4


@attrs.frozen
class DenseWork:
    """The dense part of the model, per rank and sample (forward): parameter bytes, FLOPs of
    the weights' products, FLOPs of parameter-free batched products, activation bytes written;
    and the part of the FLOPs and activation bytes independent of the embeddings (included in the
    totals)."""

    param_bytes: float = 0.0
    fwd_flops_per_sample: float = 0.0
    interaction_flops_per_sample: float = 0.0
    activation_bytes_per_sample: float = 0.0
    indep_fwd_flops_per_sample: float = 0.0
    indep_activation_bytes_per_sample: float = 0.0


def dense_work(module: nn.Module, handles: Sequence[TableHandle]) -> DenseWork:
    """Dense parameters (bytes), FLOPs and activation bytes per sample, from the module's
    non-embedding parameters (2 FLOPs per weight per sample: a multiply and an add), the layers
    TorchRec's models are built of (``nn.Linear``, DLRM's ``InteractionArch``, DCN's cross nets)
    and the pooled embeddings the sharded modules hand to the dense part."""
    sparse_ids = {id(h.tensor) for h in handles}
    sharded_modules = {id(h.module[1]) for h in handles}
    skip = set()
    skip_modules = set()
    for m in module.modules():
        if id(m) in sharded_modules:
            skip.update(id(p) for p in m.parameters())
            skip_modules.update(id(s) for s in m.modules())
    numel = 0
    nbytes = 0
    for p in module.parameters():
        if id(p) in skip or id(p) in sparse_ids:
            continue
        numel += p.numel()
        nbytes += p.numel() * p.element_size()
    inter_flops, inter_elems = _interaction(module, handles)
    layer_elems = sum(2 * m.out_features for m in module.modules()
                      if isinstance(m, nn.Linear) and id(m) not in skip_modules)  # output + activation
    pooled_elems = sum(h.spec.embedding_dim * len(h.spec.feature_names) for h in handles if h.spec.is_pooled)
    indep = independent_modules(module, [h.module[1] for h in handles])
    seen: Set[int] = set()
    indep_numel = 0
    indep_elems = 0
    for leaf in indep:
        for p in leaf.parameters():
            if id(p) not in skip and id(p) not in sparse_ids and id(p) not in seen:
                seen.add(id(p))
                indep_numel += p.numel()
        indep_elems += sum(2 * m.out_features for m in leaf.modules() if isinstance(m, nn.Linear))
    return DenseWork(param_bytes=float(nbytes), fwd_flops_per_sample=2.0 * numel,
                     interaction_flops_per_sample=inter_flops,
                     activation_bytes_per_sample=float(ACTIVATION_BYTES * (pooled_elems + layer_elems + inter_elems)),
                     indep_fwd_flops_per_sample=2.0 * indep_numel,
                     indep_activation_bytes_per_sample=float(ACTIVATION_BYTES * indep_elems))


def independent_modules(module: nn.Module, sharded: Sequence[nn.Module]) -> List[nn.Module]:
    """The modules ``module``'s forward calls whose inputs do not depend on any of the
    ``sharded`` modules' outputs (DLRM's ``dense_arch``), in call order: ``torch.fx`` traces the
    forward with every module that holds no sharded module as a leaf and follows each sharded
    call's users. ``[]`` when there is no sharded module, when ``module`` is itself one of them (a
    bare ``EmbeddingBagCollection``: its forward is the sharded module's, not traced), or when the
    forward does not trace (data-dependent control flow): nothing is then counted independent."""
    ids = {id(m) for m in sharded}
    if not ids or id(module) in ids:  # no sharded module, or the model is one: nothing beside it
        return []
    holds = {id(m) for m in module.modules() if any(id(s) in ids for s in m.modules())}

    class _Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return id(m) in ids or id(m) not in holds

    log = logging.getLogger("torch.fx._symbolic_trace")  # its is_fx_tracing notice is not for our users
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        graph = _Tracer().trace(module)
    except Exception:  # noqa: BLE001 - any tracing failure means "not known to be independent"
        return []
    finally:
        log.setLevel(level)
    tainted: Set[torch.fx.Node] = set()
    out: List[nn.Module] = []
    for node in graph.nodes:
        if any(a in tainted for a in node.all_input_nodes):
            tainted.add(node)
            continue
        if node.op != "call_module":
            continue
        target = module.get_submodule(str(node.target))
        if id(target) in ids:
            tainted.add(node)
        elif any(True for _ in target.parameters()):
            out.append(target)
    return out


def dlrm_interaction(num_features: int, dim: int) -> Tuple[float, float]:
    """``(FLOPs, activation elements)`` per sample of DLRM's ``InteractionArch`` over ``F`` sparse
    features of width ``D``: the ``(F+1) x (F+1)`` dot products, and the concatenation
    ``(F+1) D``, the products ``(F+1)^2``, their upper triangle ``P = F (F+1) / 2`` and the output
    ``D + P`` written."""
    F, D = int(num_features), int(dim)
    pairs = F * (F + 1) // 2
    return 2.0 * (F + 1) ** 2 * D, float((F + 1) * D + (F + 1) ** 2 + pairs + (D + pairs))


def _interaction(module: nn.Module, handles: Sequence[TableHandle]) -> tuple:
    """``(FLOPs, activation elements)`` per sample of the parameter-free feature interactions
    TorchRec's models do: DLRM's ``InteractionArch`` (concatenate the dense and ``F`` sparse
    vectors, ``(F+1) x (F+1)`` dot products, gather their upper triangle ``P = F (F+1) / 2``,
    concatenate with the dense vector) and DCN's cross nets (``InteractionDCNArch``: concatenate
    to ``N = (F+1) D``; per layer a rank-``r`` projection, its ``N`` back-projection, the product
    with ``x0`` and the residual sum)."""
    dims = [h.spec.embedding_dim for h in handles]
    if not dims:
        return 0.0, 0.0
    dim = max(dims)
    flops = 0.0
    elems = 0.0
    for m in module.modules():
        name = type(m).__name__
        F = getattr(m, "F", None)
        if name == "InteractionArch" and isinstance(F, int):
            f, e = dlrm_interaction(F, dim)
            flops += f
            elems += e
        elif name == "InteractionDCNArch" and isinstance(F, int):
            n = (F + 1) * dim
            elems += n
            cross = getattr(m, "crossnet", None)
            layers = int(getattr(cross, "_num_layers", 0) or 0)
            rank = int(getattr(cross, "_low_rank", 0) or 0)
            elems += layers * (3 * n + rank)
    return flops, elems
