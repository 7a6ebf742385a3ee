"""The one JSON report writer of the benchmarks: what ran (command line, date, git commit,
machine) and its results, written atomically.

The header's keys (``command``, ``date``, ``git_commit``, ``machine``) sit beside the
benchmark's own top-level keys, so a reader of an older report's keys reads a new one alike."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from typing import Any, Dict, Mapping, Optional, Sequence

from torchrec_sparselift.atomic import write_json

__all__ = ["REPO", "command_line", "git_commit", "machine", "report_header", "write_report"]

#: The repository the benchmarks run from.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Keys the header writes; a benchmark's results may not use them.
HEADER_KEYS = ("command", "date", "git_commit", "machine")


def git_commit(repo: str = REPO) -> Optional[str]:
    """The checked-out commit (with ``+dirty`` when the work tree has changes), None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=repo,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=repo, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "") if head else None


def command_line(argv: Optional[Sequence[str]] = None) -> str:
    """``argv`` joined, or this process's command line: ``python -m NAME ARGS`` for a module run
    with ``-m`` (also under torchrun, whose workers run it so), else ``sys.argv`` as given."""
    if argv is not None:
        return " ".join(argv)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return " ".join(["python", "-m", spec.name, *sys.argv[1:]])
    return " ".join(sys.argv)


def machine() -> Dict[str, Any]:
    """The machine a benchmark ran on: host, processor, cores usable, load, Python and library versions."""
    versions: Dict[str, Optional[str]] = {}
    for name in ("torch", "torchrec", "fbgemm_gpu"):
        module = sys.modules.get(name)  # never import torch only to name its version
        versions[name] = getattr(module, "__version__", None) if module is not None else None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ranks = os.environ.get("WORLD_SIZE")  # set under torchrun
    return dict(host=platform.node(), platform=platform.platform(), processor=platform.processor() or None,
                cpu_count=os.cpu_count(), usable_cores=cores, load_average=list(os.getloadavg()),
                ranks=int(ranks) if ranks and ranks.isdigit() else None, python=platform.python_version(),
                versions=versions)


def report_header(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """``command`` (:func:`command_line`), ``date`` (UTC), ``git_commit``, ``machine``."""
    return dict(command=command_line(argv), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                git_commit=git_commit(), machine=machine())


def write_report(path: str, results: Mapping[str, Any], argv: Optional[Sequence[str]] = None,
                 indent: int = 1) -> Dict[str, Any]:
    """Write the header and ``results`` to ``path`` as JSON, atomically (its folder made); returns
    what was written. Values JSON cannot hold are written as their ``str``."""
    clash = sorted(set(HEADER_KEYS) & set(results))
    if clash:
        raise ValueError(f"report results use the header's keys {clash}: rename them")
    out = dict(report_header(argv), **results)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json(path, _jsonable(out), indent=indent)
    return out


def _jsonable(value: Any) -> Any:
    """``value`` with every mapping key a string and anything JSON cannot hold as its ``str``."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        try:
            return value.item()
        except (TypeError, ValueError):
            pass
    return str(value)
