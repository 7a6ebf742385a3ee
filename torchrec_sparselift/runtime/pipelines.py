"""Train-pipeline kinds: from the plan's pipeline name to a TorchRec train pipeline.

Kinds (the names ``ExecutionPlan.optimizations.pipeline`` uses; each one's TorchRec class and
properties are its entry in :data:`torchrec_sparselift.vocabulary.PIPELINE_REGISTRY`):

==============  ==================================  ===================================================
kind            TorchRec class                      what it overlaps with step i's forward/backward
==============  ==================================  ===================================================
``base``        ``TrainPipelineBase``               host-to-device copy of batch i+1
``sparse_dist`` ``TrainPipelineSparseDist``         + input_dist (ids/lengths all-to-all) of batch i+1
``fused``       ``TrainPipelineFusedSparseDist``    + lookup and output_dist of batch i run on a side
                                                    stream, overlapping step i-1's dense optimizer
``prefetch``    ``PrefetchTrainPipelineSparseDist`` + cache prefetch (UVM caching kernels) of batch i+1
``overlap``     ``TrainPipelineOverlap`` (package)  as ``sparse_dist``, + the output/gradient all-to-alls
                                                    beside the dense work independent of the
                                                    embeddings, the dense all-reduce beside the
                                                    embedding backward (:mod:`.overlap`)
``semi_sync``   ``TrainPipelineSemiSync``           + lookup of batch i+1 before step i's embedding
                                                    update: one step stale embeddings (not exact)
==============  ==================================  ===================================================

``overlap_stale`` (``TrainPipelineOverlapStale``, :mod:`.stale`) is one step stale like ``semi_sync``
and puts the output all-to-all of batch i+1 beside step i's dense backward and step i's gradient
all-to-all beside step i+1's dense forward.

All but ``semi_sync`` and ``overlap_stale`` compute exactly what a plain forward/backward/step loop computes. On CPU the
multi-stream kinds (``fused``, ``prefetch``, ``semi_sync``) run through the adaptations in
:mod:`torchrec_sparselift.runtime.cpu_compat`; on CUDA the TorchRec classes are used unchanged.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Type

import torch
from torchrec.distributed.train_pipeline import (
    PrefetchTrainPipelineSparseDist,
    TrainPipelineBase,
    TrainPipelineFusedSparseDist,
    TrainPipelineSparseDist,
)
from torchrec.distributed.train_pipeline.train_pipelines import (
    TrainPipeline,
    TrainPipelineSemiSync,
)

from torchrec_sparselift.runtime.batch_split import BATCH_SPLIT_OPTIONS, BATCH_SPLIT_PIPELINE, TrainPipelineBatchSplit
from torchrec_sparselift.runtime.cpu_compat import cpu_pipeline_class
from torchrec_sparselift.runtime.overlap import TrainPipelineOverlap
from torchrec_sparselift.runtime.stale import TrainPipelineOverlapStale
from torchrec_sparselift.vocabulary import PIPELINE_REGISTRY, PIPELINES, PIPELINES_2D

__all__ = [
    "pipeline_class",
    "make_train_pipeline",
]

_TORCHREC_CLASSES: Dict[str, Type[TrainPipeline]] = {
    c.__name__: c
    for c in (TrainPipelineBase, TrainPipelineSparseDist, TrainPipelineFusedSparseDist,
              PrefetchTrainPipelineSparseDist, TrainPipelineSemiSync, TrainPipelineOverlap,
              TrainPipelineOverlapStale)
}
#: The TorchRec class of every pipeline kind (its registry entry's ``torchrec_class``).
_CLASSES: Dict[str, Type[TrainPipeline]] = {p.name: _TORCHREC_CLASSES[p.torchrec_class] for p in PIPELINE_REGISTRY}

# Kinds whose constructor takes ``dmp_collection_sync_interval_batches`` (2D replica sync).
_SYNC_INTERVAL_KINDS = PIPELINES_2D


def _check_kind(kind: str) -> None:
    if kind not in _CLASSES:
        raise ValueError(f"unknown train-pipeline kind {kind!r}: use one of {', '.join(PIPELINES)}")


def pipeline_class(kind: str, device: torch.device) -> Type[TrainPipeline]:
    """The class :func:`make_train_pipeline` instantiates for ``kind`` on ``device``.

    The class itself on any accelerator and, on CPU, for ``base``/``sparse_dist``/``overlap``; the
    CPU-adapted subclass for TorchRec's multi-stream kinds on CPU.
    """
    _check_kind(kind)
    return cpu_pipeline_class(_CLASSES[kind], device)


def make_train_pipeline(
    kind: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    sync_interval: Optional[int] = None,
    options: Optional[Mapping[str, Any]] = None,
    batch_split: int = 1,
) -> TrainPipeline:
    """A ready-to-``progress()`` train pipeline of ``kind`` over ``model`` (a DMP or DMPCollection).

    ``sync_interval``: steps between 2D replica syncs (``dmp_collection_sync_interval_batches``);
    only ``sparse_dist`` and ``semi_sync`` run the sync, so any other kind refuses a 2D interval.
    ``options``: extra keyword arguments for the TorchRec constructor (e.g. ``start_batch`` for
    ``semi_sync``, whose TorchRec default keeps the first 900 steps synchronous; ``per_sample`` for
    a batch split).
    ``batch_split``: chunks of the ``overlap`` pipeline's all-to-alls (> 1 builds
    :class:`~torchrec_sparselift.runtime.batch_split.TrainPipelineBatchSplit`; at 1 its options,
    ``per_sample`` and ``chain_chunks``, are dropped, so a model declared per-sample runs any plan).
    """
    cls = pipeline_class(kind, device)
    kwargs: Dict[str, Any] = dict(options or {})
    if batch_split != 1:
        if kind != BATCH_SPLIT_PIPELINE or sync_interval is not None:
            raise ValueError(
                f"batch_split={batch_split} splits the {BATCH_SPLIT_PIPELINE!r} pipeline's all-to-alls (1D), not "
                f"{kind!r}{' with 2D replica sync' if sync_interval is not None else ''}: choose pipeline "
                f"{BATCH_SPLIT_PIPELINE!r} or batch_split=1")
        return TrainPipelineBatchSplit(model, optimizer, device, chunks=batch_split, **kwargs)
    for option in BATCH_SPLIT_OPTIONS:  # a declaration made for a split the plan did not choose
        kwargs.pop(option, None)
    if sync_interval is not None:
        if kind not in _SYNC_INTERVAL_KINDS:
            raise ValueError(
                f"pipeline {kind!r} never syncs 2D replicas (TorchRec passes "
                f"dmp_collection_sync_interval_batches only through {' and '.join(_SYNC_INTERVAL_KINDS)}): "
                f"plan a 2D model with one of those pipelines"
            )
        if sync_interval < 1:
            raise ValueError(f"sync_interval must be >= 1 step, got {sync_interval}")
        kwargs["dmp_collection_sync_interval_batches"] = sync_interval
    return cls(model, optimizer, device, **kwargs)
