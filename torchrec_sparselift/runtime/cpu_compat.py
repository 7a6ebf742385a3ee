"""CPU adaptations that let TorchRec's multi-stream train pipelines run on CPU with gloo.

This is the one place where the runtime bends TorchRec for the CPU; nothing here runs on CUDA,
and nothing is changed at import time.

TorchRec 1.8's ``TrainPipelineSemiSync``, ``TrainPipelineFusedSparseDist`` and
``PrefetchTrainPipelineSparseDist`` assume device streams:

* they create their side streams only for ``cuda``/``mtia`` and leave them ``None`` elsewhere, and
  then either dereference them (the prefetch pipeline never fills its prefetch buffers without a
  data-dist stream) or pass them on;
* they call ``record_stream`` on every batch and every input-dist result, which has no CPU kernel
  (``NotImplementedError`` for a ``torch.Stream("cpu")``, and a ``RuntimeError: unknown parameter
  type`` for the placeholder ``torch.cpu.Stream`` that ``torch.cpu.current_stream()`` returns).

On a CPU every op runs synchronously in program order, so a stream is only a label and
``record_stream`` (which tells the CUDA caching allocator that another stream still uses a block)
has nothing to protect. The adaptations are therefore exact, not approximations:

* :func:`cpu_record_stream_noop` makes ``Tensor.record_stream`` a no-op for CPU tensors while the
  context is open (reentrant, restored on exit; CUDA tensors still reach the real kernel);
* :class:`CpuStream` is a stream label for a CPU pipeline stage: ``torch.cpu.Stream`` (whose
  ``wait_stream``/``wait_event`` are no-ops) plus the ``.device`` TorchRec's pipelined forwards
  read. ``torch.Stream("cpu")`` does not do: its ``wait_stream`` raises "cpu backend doesn't
  support events";
* :class:`CpuStreamsMixin` gives a pipeline :class:`CpuStream` labels in place of the
  missing side streams, selects them with ``torch.cpu.stream`` and opens
  :func:`cpu_record_stream_noop` around each ``progress()`` call;
* :func:`cpu_pipeline_class` maps a TorchRec pipeline class to its CPU-adapted subclass.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, Type

import torch
from torchrec.distributed.train_pipeline import (
    PrefetchTrainPipelineSparseDist,
    TrainPipelineFusedSparseDist,
)
from torchrec.distributed.train_pipeline.train_pipelines import (
    TrainPipeline,
    TrainPipelineSemiSync,
)

__all__ = [
    "CpuStream",
    "CpuStreamsMixin",
    "CpuTrainPipelineSemiSync",
    "CpuTrainPipelineFusedSparseDist",
    "CpuPrefetchTrainPipelineSparseDist",
    "cpu_pipeline_class",
    "cpu_record_stream_noop",
    "needs_cpu_streams",
]

# The side-stream attributes TorchRec 1.8 pipelines keep (None when the device is not cuda/mtia).
_STREAM_ATTRIBUTES = ("_memcpy_stream", "_data_dist_stream", "_prefetch_stream", "_default_stream")

_patch_lock = threading.Lock()
_patch_depth = 0
_saved_record_stream: Dict[str, Any] = {}


def _install_record_stream_noop() -> None:
    had_own = "record_stream" in torch.Tensor.__dict__
    original = torch.Tensor.record_stream
    _saved_record_stream["had_own"] = had_own
    _saved_record_stream["original"] = torch.Tensor.__dict__.get("record_stream")

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if self.device.type == "cpu":
            return None
        return original(self, stream)

    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign]


def _restore_record_stream() -> None:
    if _saved_record_stream.pop("had_own"):
        torch.Tensor.record_stream = _saved_record_stream.pop("original")  # type: ignore[method-assign]
    else:
        _saved_record_stream.pop("original")
        del torch.Tensor.record_stream


@contextlib.contextmanager
def cpu_record_stream_noop() -> Iterator[None]:
    """While open, ``Tensor.record_stream`` returns immediately for CPU tensors.

    Promises: reentrant and thread-safe to open and close; on exit (also on error) the original
    ``torch.Tensor.record_stream`` is back exactly as it was; tensors on any other device keep
    calling the real kernel. Affects the whole process while open (``record_stream`` is a class
    attribute), so keep it around the pipeline step only.
    """
    global _patch_depth
    with _patch_lock:
        if _patch_depth == 0:
            _install_record_stream_noop()
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                _restore_record_stream()


class CpuStream(torch.cpu.Stream):
    """A stream label on CPU: synchronisation calls are no-ops, ``device`` is ``cpu``.

    Exact on CPU because every op already runs in program order on the calling thread.
    """

    device = torch.device("cpu")

    def __repr__(self) -> str:
        return "CpuStream()"


def needs_cpu_streams(pipeline_class: Type[TrainPipeline], device: torch.device) -> bool:
    """True when ``pipeline_class`` cannot run on ``device`` as shipped and needs the CPU adaptation."""
    return device.type == "cpu" and issubclass(
        pipeline_class,
        (TrainPipelineSemiSync, TrainPipelineFusedSparseDist, PrefetchTrainPipelineSparseDist),
    )


class CpuStreamsMixin:
    """Mix in before a TorchRec train pipeline class to run it on CPU.

    After the pipeline's own constructor, every side stream it left as ``None`` becomes a
    :class:`CpuStream`, streams are selected with ``torch.cpu.stream``, and
    ``progress()`` runs inside :func:`cpu_record_stream_noop`. Refuses any device but CPU, so it can
    never change GPU behaviour.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        device: torch.device = self._device  # type: ignore[attr-defined]
        if device.type != "cpu":
            raise ValueError(
                f"{type(self).__name__} is the CPU adaptation of a TorchRec pipeline; on device "
                f"{device} instantiate the TorchRec pipeline class itself."
            )
        for name in _STREAM_ATTRIBUTES:
            if hasattr(self, name) and getattr(self, name) is None:
                setattr(self, name, CpuStream())
        # The fused pipeline's embedding-lookup stream is None off-GPU for emb_lookup_stream
        # "data_dist" (the default: it aliases the then-None data-dist stream) and "new".
        if hasattr(self, "_emb_lookup_stream") and self._emb_lookup_stream is None:
            self._emb_lookup_stream = self._data_dist_stream  # type: ignore[attr-defined]
        self._stream_context = torch.cpu.stream

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """One step of the wrapped pipeline, with ``record_stream`` a no-op for CPU tensors."""
        with cpu_record_stream_noop():
            return super().progress(dataloader_iter)  # type: ignore[misc]


class CpuTrainPipelineSemiSync(CpuStreamsMixin, TrainPipelineSemiSync):
    """``TrainPipelineSemiSync`` on CPU (see :class:`CpuStreamsMixin`)."""


class CpuTrainPipelineFusedSparseDist(CpuStreamsMixin, TrainPipelineFusedSparseDist):
    """``TrainPipelineFusedSparseDist`` on CPU (see :class:`CpuStreamsMixin`)."""


class CpuPrefetchTrainPipelineSparseDist(CpuStreamsMixin, PrefetchTrainPipelineSparseDist):
    """``PrefetchTrainPipelineSparseDist`` on CPU (see :class:`CpuStreamsMixin`)."""


_CPU_CLASSES: Dict[Type[TrainPipeline], Type[TrainPipeline]] = {
    TrainPipelineSemiSync: CpuTrainPipelineSemiSync,
    TrainPipelineFusedSparseDist: CpuTrainPipelineFusedSparseDist,
    PrefetchTrainPipelineSparseDist: CpuPrefetchTrainPipelineSparseDist,
}


def cpu_pipeline_class(
    pipeline_class: Type[TrainPipeline], device: torch.device
) -> Type[TrainPipeline]:
    """The class to instantiate for ``pipeline_class`` on ``device``.

    Promises: ``pipeline_class`` itself for any non-CPU device and for pipelines that run on CPU
    as shipped (``TrainPipelineBase``, ``TrainPipelineSparseDist``); the CPU-adapted subclass for
    the multi-stream pipelines on CPU. Raises ``ValueError`` for a multi-stream pipeline class
    without a CPU adaptation (e.g. a user subclass), naming what to do.
    """
    if not needs_cpu_streams(pipeline_class, device):
        return pipeline_class
    if pipeline_class in _CPU_CLASSES:
        return _CPU_CLASSES[pipeline_class]
    if pipeline_class in _CPU_CLASSES.values():
        return pipeline_class
    raise ValueError(
        f"{pipeline_class.__name__} needs device streams, which the CPU lacks, and has no CPU "
        f"adaptation; on CPU derive it from CpuStreamsMixin first, e.g. "
        f"class MyPipeline(CpuStreamsMixin, {pipeline_class.__name__})."
    )
