"""Whether a model's dense part is per-sample: every sample's output depends on that sample alone
and the loss is the batch's mean, so splitting the batch into chunks changes nothing but the order
of floating-point sums (batch-split pipelining, ``runtime.batch_split``; the planner's rewrite
stage, ``plan.rewrites``, asks before it chooses a split).

:func:`per_sample_violation` inspects the module (a DMP, a DDP or the bare model; its embedding
modules are skipped) and names the first module that is not, with the fix.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.types import ShardedModule
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

__all__ = ["per_sample_violation"]

#: module types whose forward treats every sample (dim 0) independently in training
_PER_SAMPLE_TORCH: Tuple[type, ...] = (
    nn.Linear, nn.Bilinear, nn.Identity, nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.LayerNorm,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid,
    nn.Tanh, nn.Softplus, nn.Hardswish, nn.Hardsigmoid, nn.Embedding, nn.EmbeddingBag,
    nn.ParameterList, nn.ParameterDict,  # containers of weights (no forward; TorchRec's CrossNets hold them)
)
#: loss modules: per-sample with ``reduction="mean"`` (the chunk weighting assumes a mean)
_MEAN_LOSSES: Tuple[type, ...] = (
    nn.BCEWithLogitsLoss, nn.BCELoss, nn.MSELoss, nn.L1Loss, nn.CrossEntropyLoss, nn.NLLLoss,
    nn.SmoothL1Loss, nn.HuberLoss,
)
#: TorchRec's DLRM family and its blocks (every one per-sample; DLRMTrain's loss a BCE mean)
_PER_SAMPLE_TORCHREC = (
    "torchrec.models.dlrm.DLRM", "torchrec.models.dlrm.DLRM_DCN", "torchrec.models.dlrm.DLRM_Projection",
    "torchrec.models.dlrm.DLRMTrain", "torchrec.models.dlrm.DenseArch", "torchrec.models.dlrm.SparseArch",
    "torchrec.models.dlrm.InteractionArch", "torchrec.models.dlrm.InteractionDCNArch",
    "torchrec.models.dlrm.InteractionProjectionArch", "torchrec.models.dlrm.OverArch",
    "torchrec.modules.mlp.MLP", "torchrec.modules.mlp.Perceptron", "torchrec.modules.activation.SwishLayerNorm",
    "torchrec.modules.crossnet.CrossNet", "torchrec.modules.crossnet.LowRankCrossNet",
    "torchrec.modules.crossnet.VectorCrossNet", "torchrec.modules.crossnet.LowRankMixtureCrossNet",
)


def _qualname(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _inner_model(model: nn.Module) -> nn.Module:
    inner = getattr(model, "_dmp_wrapped_module", model)
    return inner.module if isinstance(inner, DistributedDataParallel) else inner


def _is_embedding_module(module: nn.Module) -> bool:
    return isinstance(module, (ShardedModule, EmbeddingBagCollection, EmbeddingCollection))


def per_sample_violation(model: nn.Module, declared: bool = False) -> Optional[str]:
    """Why the dense part of ``model`` (a DMP, a DDP or the bare module; its embedding modules are
    skipped) may not be split along the batch, or None where it may.

    Always refused (the pipeline trains): a BatchNorm (in training it normalizes over the batch,
    so a chunk's statistics differ from the batch's) and a dropout with p > 0 (its random masks are
    drawn per chunk, not as in the unsplit step). Refused unless ``declared``: a module whose
    type is not known to be per-sample (``torch.nn``'s layers, activations and LayerNorm; loss
    modules with ``reduction="mean"``; TorchRec's DLRM family and MLP/CrossNet blocks), and a loss
    with another reduction. ``declared``: the user states every sample's output depends on that
    sample alone and the loss is the mean over the batch's samples."""
    inner = _inner_model(model)
    skip: List[str] = []
    unknown: List[str] = []
    for name, m in inner.named_modules():
        if any(name.startswith(p + ".") for p in skip):
            continue
        where = name or "(the model)"
        if _is_embedding_module(m):
            skip.append(name)
            continue
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            return (f"batch split needs a per-sample dense model, but {where} ({type(m).__name__}) normalizes "
                    "over the batch in training, so a chunk's statistics are not the batch's: keep batch_split=1 "
                    "for this model (or replace the BatchNorm by a LayerNorm)")
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return (f"batch split is exact only without random per-sample masks, but {where} "
                    f"({type(m).__name__}, p={m.p}) draws its masks per chunk: keep batch_split=1 for this model")
        if isinstance(m, _MEAN_LOSSES):
            if getattr(m, "reduction", "mean") != "mean" and not declared:
                return (f"batch split weights the chunk losses by chunk size, which is the batch's loss only "
                        f"for a mean, but {where} ({type(m).__name__}) has reduction={m.reduction!r}: use "
                        "reduction='mean' or keep batch_split=1")
            continue
        if isinstance(m, _PER_SAMPLE_TORCH) or _qualname(m) in _PER_SAMPLE_TORCHREC:
            continue
        if isinstance(m, nn.modules.dropout._DropoutNd):
            continue  # p == 0
        unknown.append(f"{where} ({type(m).__name__})")
    if unknown and not declared:
        return (f"batch split cannot prove {', '.join(unknown[:4])}{', ...' if len(unknown) > 4 else ''} "
                "per-sample (an op that mixes samples, such as in-batch negatives, would change the results): "
                "declare the model per-sample (per_sample=True) if every sample's output depends on that "
                "sample alone and the loss is the mean over the batch's samples, or keep batch_split=1")
    return None
