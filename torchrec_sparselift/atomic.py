"""Atomic file writes: a reader sees the old file or the new one, never a partial one.

The one place that writes JSON results, profiles and records (``write_json`` / ``write_text``):
the content goes to a temporary file in the target's directory, then ``os.replace``-s the target;
on any failure the temporary file is removed and the error propagates. Like ``errors`` and
``validation``, every layer may use it (it imports nothing of the package).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

__all__ = ["write_json", "write_text"]


def write_text(path: str, text: str, prefix: str = ".tmp-", suffix: str = ".json") -> None:
    """Write ``text`` to ``path`` atomically (creating its directory if needed)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=suffix)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: str, data: Any, prefix: str = ".tmp-", indent: int = 1, sort_keys: bool = False) -> None:
    """Write ``data`` as JSON to ``path`` atomically (see :func:`write_text`)."""
    write_text(path, json.dumps(data, indent=indent, sort_keys=sort_keys), prefix=prefix)
