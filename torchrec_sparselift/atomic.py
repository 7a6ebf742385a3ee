"""Atomic file writes: a reader sees the old file or the new one, never a partial one.

The one place that writes JSON results, plans, profiles and records (``write_json`` /
``write_text`` / ``write_bytes``): the content goes to a temporary file in the target's
directory, then ``os.replace``-s the target; on any failure the temporary file is removed and the
error propagates. The file gets the permissions any new file of this process gets
(``0o666 & ~umask``, and the directory's default ACL where there is one), like ``open(path,
"w")`` would give it: the temporary file is created with mode ``0o666`` and the kernel applies
the umask, so the umask is never changed or read (``tempfile.mkstemp`` would create it ``0o600``
whatever the umask). Like ``errors`` and ``validation``, every layer may use it (it imports
nothing of the package).
"""

from __future__ import annotations

import contextlib
import json
import os
import errno
import secrets
import time
from typing import Any, Callable, Optional, Tuple

__all__ = ["write_json", "write_text", "write_bytes", "create_temp", "lock_holder", "flock_until"]

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def create_temp(directory: str, prefix: str = ".tmp-", suffix: str = "") -> Tuple[int, str]:
    """A new, empty file in ``directory`` opened for writing: ``(fd, path)``.

    Created exclusively with mode ``0o666`` so the umask decides its permissions (unlike
    ``tempfile.mkstemp``, which creates ``0o600`` files)."""
    for _ in range(100):
        path = os.path.join(directory, f"{prefix}{secrets.token_hex(6)}{suffix}")
        try:
            return os.open(path, _FLAGS, 0o666), path
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a unique temporary file in {directory!r}")


def write_bytes(path: str, data: bytes, prefix: str = ".tmp-", suffix: str = ".json", fsync: bool = False) -> None:
    """Write ``data`` to ``path`` atomically (creating its directory if needed). With ``fsync``
    the content and the directory entry are flushed to disk before returning."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = create_temp(directory, prefix=prefix, suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        with contextlib.suppress(OSError):
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)


def write_text(path: str, text: str, prefix: str = ".tmp-", suffix: str = ".json", fsync: bool = False) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`write_bytes`)."""
    write_bytes(path, text.encode("utf-8"), prefix=prefix, suffix=suffix, fsync=fsync)


def write_json(path: str, data: Any, prefix: str = ".tmp-", indent: int = 1, sort_keys: bool = False,
               fsync: bool = False) -> None:
    """Write ``data`` as JSON to ``path`` atomically (see :func:`write_bytes`)."""
    write_text(path, json.dumps(data, indent=indent, sort_keys=sort_keys), prefix=prefix, fsync=fsync)


def lock_holder(fd: int) -> str:
    """Who holds a lock file, from the pid its holder wrote into it: ``pid N``, or ``pid
    unknown`` (the plan cache's and the profile store's locks write their pid)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return f"pid {text}" if text.isdigit() else "pid unknown"


def flock_until(fd: int, deadline: float, on_wait: Optional[Callable[[], None]] = None,
                first_delay_s: float = 0.01, max_delay_s: float = 0.5) -> bool:
    """Take an exclusive ``fcntl.flock`` on ``fd``, retrying with a growing sleep until
    ``deadline`` (``time.monotonic()``): True once held, False at the deadline. ``on_wait`` is
    called once, when the lock is found busy. An error other than "held by another process"
    propagates (``OSError``). On success the holder's pid is written into the lock file (see
    :func:`lock_holder`)."""
    import fcntl

    delay, waiting = first_delay_s, False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            if not waiting and on_wait is not None:
                on_wait()
            waiting = True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, max_delay_s)
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return True
