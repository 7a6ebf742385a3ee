"""Reference workloads for benchmarks and tests (DESIGN.md section 3), built on the meta device.

* ``dcnv2``: MLPerf DLRM-DCNv2 (Criteo 1TB multi-hot) tables, dim 128, global batch 65536.
* ``kaggle``: Criteo Kaggle tables (dim 128 unless told otherwise), global batch 16384.
* ``production(n)``: ``n`` heavy-tailed tables (rows 1e3..1e9 log-uniform-ish, dims 16..512,
  pooling factors 1..200 with a few very hot tables), seeded and deterministic.
"""

from __future__ import annotations

import functools
import math
from typing import Dict, List, Tuple

import attrs
import numpy as np

__all__ = ["Workload", "dcnv2", "kaggle", "production", "by_name", "DCNV2_ROWS", "DCNV2_MULTI_HOT", "KAGGLE_ROWS"]

DCNV2_ROWS = [
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
    11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
]
DCNV2_MULTI_HOT = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
KAGGLE_ROWS = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]


@attrs.frozen
class Workload:
    """Tables as (name, rows, dim, pooling factor), plus a global batch size."""

    name: str
    tables: Tuple[Tuple[str, int, int, float], ...]
    global_batch: int
    dense_arch: Tuple[int, ...] = (512, 256, 128)
    over_arch: Tuple[int, ...] = (1024, 1024, 512, 256, 1)

    def module(self, device: str = "meta"):
        """An ``EmbeddingBagCollection`` with one feature per table (meta device: no memory).

        On the meta device the weight initializers are skipped: there is nothing to fill, and
        there they dispatch through ``torch._refs`` (5.5 s of CPU for the 10,000 tables of
        ``production-10000``, 0.9 s without)."""
        import contextlib
        from unittest import mock

        import torch
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        skip = contextlib.ExitStack()
        if torch.device(device).type == "meta":
            for cls in (torch.nn.EmbeddingBag, EmbeddingBagCollection):
                skip.enter_context(mock.patch.object(cls, "reset_parameters", lambda self: None))
        with skip:
            return EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"])
                    for n, r, d, _ in self.tables
                ],
                device=torch.device(device),
            )

    def constraints(self) -> Dict[str, object]:
        from torchrec.distributed.planner.types import ParameterConstraints

        return {n: ParameterConstraints(pooling_factors=[float(pf)]) for n, _, _, pf in self.tables}

    def per_rank_batch(self, world_size: int) -> int:
        return max(1, self.global_batch // world_size)


def dcnv2() -> Workload:
    return Workload(
        name="dlrm-dcnv2",
        tables=tuple((f"t{i}", r, 128, float(m)) for i, (r, m) in enumerate(zip(DCNV2_ROWS, DCNV2_MULTI_HOT))),
        global_batch=65536,
    )


def kaggle(dim: int = 128) -> Workload:
    return Workload(
        name="criteo-kaggle",
        tables=tuple((f"t{i}", r, dim, 1.0) for i, r in enumerate(KAGGLE_ROWS)),
        global_batch=16384,
        dense_arch=(512, 256, dim),
        over_arch=(1024, 1024, 512, 256, 1),
    )


def production(num_tables: int, seed: int = 0, global_batch: int = 65536) -> Workload:
    """Heavy-tailed production-like tables (Meta's public dlrm_datasets shape: ~16 lookups per
    table per sample on average, a few very hot tables)."""
    rng = np.random.default_rng(seed)
    tables: List[Tuple[str, int, int, float]] = []
    dims = np.array([16, 32, 64, 128, 256, 512])
    dim_p = np.array([0.15, 0.25, 0.3, 0.2, 0.07, 0.03])
    for i in range(num_tables):
        rows = int(10 ** rng.uniform(3, 8.3)) if rng.random() > 0.02 else int(10 ** rng.uniform(8.3, 9))
        dim = int(rng.choice(dims, p=dim_p))
        pf = float(np.clip(rng.lognormal(mean=math.log(8), sigma=1.0), 1, 200))
        if rng.random() < 0.01:
            pf = float(rng.uniform(100, 250))
        tables.append((f"p{i}", rows, dim, round(pf, 2)))
    return Workload(name=f"production-{num_tables}", tables=tuple(tables), global_batch=global_batch)


@functools.lru_cache(maxsize=8)
def by_name(name: str) -> Workload:
    """The reference workload ``name``; a :class:`Workload` is immutable, so one is built once per name
    (``production-10000`` draws its tables in ~0.2 s, and ``sparselift plan`` asks for it five times)."""
    if name in ("dcnv2", "dlrm-dcnv2"):
        return dcnv2()
    if name in ("kaggle", "criteo-kaggle"):
        return kaggle()
    if name.startswith("production-") or name.startswith("prod-"):
        return production(int(name.split("-", 1)[1]))
    raise ValueError(f"unknown workload {name!r}; use dcnv2, kaggle or production-N (e.g. production-856)")
