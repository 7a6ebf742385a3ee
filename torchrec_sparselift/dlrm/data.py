"""Input data for the DLRM example: synthetic batches generated on the fly, or Criteo ``.npy`` files.

Synthetic data (the default) is a fresh batch every step, drawn from a generator seeded by
``(seed, rank, step)``: no cycle of batches for the model to memorize, and any run is reproducible.
Each feature's bag holds its ``pooling_factor`` (``TableSpec.bag_sizes()``) ids drawn from a power law over the table's rows
(rank ``k`` has probability ~ ``k**-alpha``; ranks are scattered over the id space by a fixed
bijection so hot rows are not all at the start of the table). Labels carry a planted signal:
``P(label=1) = sigmoid(strength * (0.8 * sparse_signal + 0.6 * dense_signal))`` where
``sparse_signal`` averages a hidden weight in [-1, 1] per (feature, id) over each bag, and
``dense_signal`` is a fixed unit direction dotted with the dense features. Both parts have unit
variance, so the loss of a model that learns them falls well below ln 2 = 0.693.
"""

from __future__ import annotations

import collections
import glob
import itertools
import os
import re
from typing import Iterator, List, Optional, Sequence

import numpy as np
import torch
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, DEFAULT_CAT_NAMES, InMemoryBinaryCriteoIterDataPipe
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_sparselift.dlrm.tables import TableSetError, TableSpec

__all__ = [
    "NUM_DENSE_FEATURES",
    "hidden_id_weight",
    "power_law_ids",
    "synthetic_batch",
    "synthetic_batches",
    "criteo_batches",
]

NUM_DENSE_FEATURES = 13  # Criteo's integer features
_PRIME = np.uint64(2147483647)  # > any table's rows, so id -> id * P mod rows is a bijection
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit hash of each element of the uint64 array ``x`` (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def hidden_id_weight(ids: np.ndarray, feature_index: int, seed: int) -> np.ndarray:
    """The planted per-id weight in [-1, 1) of each id of feature ``feature_index`` (a pure
    function of its arguments: the same on every rank and step)."""
    salt = _splitmix64(np.array([seed * 1_000_003 + feature_index], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        z = _splitmix64(ids.astype(np.uint64) ^ salt)
    return (z >> np.uint64(11)).astype(np.float64) * (2.0 / 2.0**53) - 1.0


def power_law_ids(rng: np.random.Generator, rows: int, n: int, alpha: float, salt: int) -> np.ndarray:
    """``n`` ids in [0, rows) with popularity rank ``k`` drawn with probability ~ ``k**-alpha``
    (continuous inverse-CDF approximation), then scattered by the bijection ``k*P + salt mod rows``."""
    u = rng.random(n)
    if abs(alpha - 1.0) < 1e-9:
        k = np.exp(u * np.log(rows + 1.0))
    else:
        e = 1.0 - alpha
        k = ((np.power(rows + 1.0, e) - 1.0) * u + 1.0) ** (1.0 / e)
    k = np.clip(np.floor(k).astype(np.int64) - 1, 0, rows - 1).astype(np.uint64)
    with np.errstate(over="ignore"):
        return ((k * _PRIME + np.uint64(salt)) % np.uint64(rows)).astype(np.int64)


def _dense_direction(seed: int) -> np.ndarray:
    v = np.random.default_rng([seed, 0xD5]).standard_normal(NUM_DENSE_FEATURES)
    return v / np.linalg.norm(v)


def synthetic_batch(tables: Sequence[TableSpec], batch_size: int, seed: int, rank: int, step: int,
                    alpha: float = 1.05, strength: float = 3.0) -> Batch:
    """Rank ``rank``'s batch for ``step``: ``batch_size`` samples, 13 dense features, one bag of
    ``pooling_factor`` power-law ids per feature of ``tables`` (KJT keys in table order), and
    labels drawn from the planted model described in the module docstring."""
    rng = np.random.default_rng([seed, rank, step])
    dense = rng.standard_normal((batch_size, NUM_DENSE_FEATURES)).astype(np.float32)
    keys: List[str] = []
    values: List[np.ndarray] = []
    lengths: List[np.ndarray] = []
    sparse_signal = np.zeros(batch_size)
    num_features = 0
    for t in tables:
        for f, bag in zip(t.features, t.bag_sizes()):
            fi = num_features
            num_features += 1
            ids = power_law_ids(rng, t.rows, batch_size * bag, alpha, salt=seed + 7919 * fi)
            w = hidden_id_weight(ids, fi, seed).reshape(batch_size, bag)
            # a bag mean of pf weights uniform in [-1, 1) has variance 1/(3 pf): rescale to 1
            sparse_signal += w.mean(axis=1) * np.sqrt(3.0 * bag)
            keys.append(f)
            values.append(ids)
            lengths.append(np.full(batch_size, bag, dtype=np.int32))
    sparse_signal /= np.sqrt(num_features)
    dense_signal = dense.astype(np.float64) @ _dense_direction(seed)
    logit = strength * (0.8 * sparse_signal + 0.6 * dense_signal)
    labels = (rng.random(batch_size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    return Batch(
        dense_features=torch.from_numpy(dense),
        sparse_features=KeyedJaggedTensor(
            keys=keys,
            values=torch.from_numpy(np.concatenate(values)),
            lengths=torch.from_numpy(np.concatenate(lengths)),
        ),
        labels=torch.from_numpy(labels),
    )


def synthetic_batches(tables: Sequence[TableSpec], batch_size: int, seed: int, rank: int, steps: int,
                      alpha: float = 1.05, strength: float = 3.0, start: int = 0) -> Iterator[Batch]:
    """The synthetic batches of steps ``start .. steps - 1`` for ``rank`` (see ``synthetic_batch``);
    a run resumed at ``start`` sees exactly the batches an uninterrupted run sees from there."""
    for step in range(start, steps):
        yield synthetic_batch(tables, batch_size, seed, rank, step, alpha, strength)


class PrefetchedBatches:
    """An iterator over ``source`` that keeps up to ``depth`` batches built ahead of the training
    step, the way a ``DataLoader`` with workers hands a training loop ready batches.

    ``next()`` only pops a batch that is already built; :meth:`top_up` builds the next ones and
    is called between steps, outside the timed region (``train_loop``'s ``after_step``), so the
    measured step time is the model's, not the data generator's. ``refill_below`` (default
    ``depth``): :meth:`top_up` builds only once fewer than that many are ready, then a whole
    ``depth`` at once; the example pre-builds its run's batches in chunks this way (building one
    batch between every two steps still slows the next step down by evicting its working set from
    the caches: docs/calibration.md). The batches and their order are exactly ``source``'s (losses
    and checkpoint resume are unchanged). When the buffer runs dry (a pipeline that pulls more than
    ``depth`` ahead), ``next()`` builds inline rather than fail.
    """

    def __init__(self, source: Iterator[Batch], depth: int = 4, refill_below: Optional[int] = None) -> None:
        if depth < 1:
            raise ValueError(f"PrefetchedBatches(depth=...) must be >= 1, got {depth}")
        self._refill_below = depth if refill_below is None else refill_below
        if not 1 <= self._refill_below <= depth:
            raise ValueError(f"PrefetchedBatches(refill_below=...) must be in 1..depth ({depth}), got {refill_below}")
        self._source = iter(source)
        self._depth = depth
        self._ready: "collections.deque[Batch]" = collections.deque()
        self._done = False
        self.top_up(depth)

    def __iter__(self) -> "PrefetchedBatches":
        return self

    def __next__(self) -> Batch:
        if not self._ready:
            self.top_up(1)
        if not self._ready:
            raise StopIteration
        return self._ready.popleft()

    def top_up(self, n: Optional[int] = None) -> None:
        """Build batches until ``n`` are ready or the source ends; without ``n``: nothing while
        ``refill_below`` or more are ready, else up to ``depth``."""
        if n is None:
            if len(self._ready) >= self._refill_below:
                return
            n = self._depth
        while not self._done and len(self._ready) < n:
            try:
                self._ready.append(next(self._source))
            except StopIteration:
                self._done = True


def _criteo_day_files(criteo_dir: str) -> List[int]:
    days = []
    for path in glob.glob(os.path.join(criteo_dir, "day_*_dense.npy")):
        m = re.fullmatch(r"day_(\d+)_dense\.npy", os.path.basename(path))
        if m:
            days.append(int(m.group(1)))
    return sorted(days)


def criteo_batches(
    criteo_dir: str,
    tables: Sequence[TableSpec],
    batch_size: int,
    rank: int,
    world_size: int,
    steps: int,
    start: int = 0,
) -> Iterator[Batch]:
    """``steps`` batches of rank ``rank``'s share of the Criteo ``.npy`` files in ``criteo_dir``
    (``day_{i}_dense.npy`` float32 [N, 13], ``day_{i}_sparse.npy`` int64 [N, 26],
    ``day_{i}_labels.npy`` int32 [N, 1], as written by TorchRec's ``npy_preproc_criteo.py``),
    repeating the files when ``steps`` outlasts them. Ids are hashed modulo each table's rows;
    the tables must be the 26 one-feature tables ``cat_0..cat_25`` (the presets). With ``start``
    the first ``start`` batches are read and skipped (a resumed run continues where it stopped)."""
    features = [f for t in tables for f in t.features]
    if features != DEFAULT_CAT_NAMES:
        raise TableSetError(
            f"--criteo-dir needs the {CAT_FEATURE_COUNT} features cat_0..cat_25, one per table in order "
            "(use --tables dcnv2 or kaggle)"
        )
    if not os.path.isdir(criteo_dir):
        raise TableSetError(f"--criteo-dir {criteo_dir!r} is not a directory")
    days = _criteo_day_files(criteo_dir)
    if not days:
        raise TableSetError(f"--criteo-dir {criteo_dir!r} holds no day_<i>_dense.npy files")
    paths = {
        kind: [os.path.join(criteo_dir, f"day_{d}_{kind}.npy") for d in days] for kind in ("dense", "sparse", "labels")
    }
    missing = [p for ps in paths.values() for p in ps if not os.path.isfile(p)]
    if missing:
        raise TableSetError(f"--criteo-dir is missing {missing[:3]} (each day needs _dense, _sparse, _labels)")
    pipe = InMemoryBinaryCriteoIterDataPipe(
        stage="train",
        dense_paths=paths["dense"],
        sparse_paths=paths["sparse"],
        labels_paths=paths["labels"],
        batch_size=batch_size,
        rank=rank,
        world_size=world_size,
        drop_last=True,
        mmap_mode=True,
        hashes=[t.rows for t in tables],
    )
    if len(pipe) == 0:
        raise TableSetError(
            f"--criteo-dir {criteo_dir!r} has fewer than {batch_size * world_size} samples: "
            "lower --batch-size or add files"
        )
    return itertools.islice(_repeat(pipe, steps), start, None)


def _repeat(pipe, steps: int) -> Iterator[Batch]:
    produced = 0
    while produced < steps:
        for batch in pipe:
            yield Batch(
                dense_features=batch.dense_features,
                sparse_features=batch.sparse_features,
                labels=batch.labels.long(),
            )
            produced += 1
            if produced == steps:
                return
