"""``python -m torchrec_sparselift.bench <benchmark> [args]``.

Benchmarks:
    planners   SparseLift vs TorchRec's EmbeddingShardingPlanner (:mod:`.planner_bench`)
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

BENCHMARKS = {"planners": "torchrec_sparselift.bench.planner_bench"}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m torchrec_sparselift.bench {{{','.join(BENCHMARKS)}}} [args] (--help per benchmark)",
              file=sys.stderr)
        return 2
    from importlib import import_module

    return int(import_module(BENCHMARKS[argv[0]]).main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
