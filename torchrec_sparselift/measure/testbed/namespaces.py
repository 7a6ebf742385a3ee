"""The machine's side of the testbed: whether it can emulate hosts (root, iproute2, tbf, veth),
the namespaces this package names ``sltb<pid>x<token>-<role>``, and the removal of those a dead
run left behind."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from typing import List, Optional, Sequence

__all__ = ["PREFIX", "ETC_NETNS", "TestbedUnavailable", "TestbedError", "run_command", "unavailable_reason",
           "require_available", "leftover_namespaces", "kill_namespace_processes", "delete_namespace",
           "cleanup_stale"]

PREFIX = "sltb"
"""Every namespace this module creates is named ``sltb<pid>x<token>-<role>``."""

_NAME = re.compile(rf"^{PREFIX}(\d+)x([0-9a-f]+)-(\S+)")
ETC_NETNS = "/etc/netns"


class TestbedUnavailable(RuntimeError):
    """This machine cannot emulate hosts (not root, ``ip``/``tc`` missing, no tbf); the message
    says which and what to do."""


class TestbedError(RuntimeError):
    """A command that sets up the emulated network failed; the message holds the command and its
    error output."""



def run_command(argv: Sequence[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run ``argv`` (an ``ip``/``tc`` command), its output captured; :class:`TestbedError` with the
    command and its error output when it fails and ``check``."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise TestbedError(
            f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> Optional[str]:
    """Why this machine cannot run the testbed (``None``: it can). Checks root, ``ip`` and
    ``tc``, then creates a scratch namespace with a tbf qdisc on its loopback and removes it."""
    if sys.platform != "linux":
        return f"the testbed needs Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return (
            "the testbed needs root (it creates network namespaces with `ip netns` and shapes "
            "links with `tc`); run as root, e.g. `sudo -E python -m torchrec_sparselift.measure.testbed ...`"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found on PATH; install iproute2 (`apt-get install iproute2`)"
    probe = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}-probe"
    try:
        made = run_command(["ip", "netns", "add", probe], check=False)
        if made.returncode != 0:
            return f"`ip netns add` failed ({made.stderr.strip()}); the kernel or container forbids network namespaces"
        tbf = run_command(
            ["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1mbit",
             "burst", "128kb", "latency", "50ms"],
            check=False,
        )  # fmt: skip
        if tbf.returncode != 0:
            return (
                f"the tbf qdisc is unavailable ({tbf.stderr.strip()}); load it with `modprobe sch_tbf` "
                "or use a kernel built with CONFIG_NET_SCH_TBF"
            )
        veth = run_command(["ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"], check=False)
        if veth.returncode != 0:
            return f"veth links are unavailable ({veth.stderr.strip()}); load them with `modprobe veth`"
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot run iproute2: {e}"
    finally:
        run_command(["ip", "netns", "del", probe], check=False)
    return None


def require_available() -> None:
    """:class:`TestbedUnavailable`, with :func:`unavailable_reason`, when this machine cannot emulate hosts."""
    reason = unavailable_reason()
    if reason is not None:
        raise TestbedUnavailable(reason)


def _namespaces() -> List[str]:
    proc = run_command(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def leftover_namespaces() -> List[str]:
    """Every namespace of this module's naming that exists now (live runs' included), and every
    name with a leftover /etc/netns/NAME folder."""
    try:
        etc = os.listdir(ETC_NETNS)
    except OSError:
        etc = []
    return sorted({ns for ns in _namespaces() + etc if _NAME.match(ns)})


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_namespace_processes(ns: str) -> None:
    """SIGTERM, then SIGKILL, every process inside namespace ``ns``."""
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
        pids = [int(p) for p in run_command(["ip", "netns", "pids", ns], check=False).stdout.split() if p.isdigit()]
        pids = [p for p in pids if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.05)


def delete_namespace(ns: str) -> None:
    """Kill the processes inside namespace ``ns``, delete it and its /etc/netns folder."""
    kill_namespace_processes(ns)
    run_command(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)


def cleanup_stale() -> List[str]:
    """Remove the namespaces (and so their links and processes) left by runs whose process is
    dead, e.g. killed with SIGKILL. Returns the names removed; live runs' are left alone."""
    removed = []
    for ns in leftover_namespaces():
        pid = int(_NAME.match(ns).group(1))  # type: ignore[union-attr]
        if pid != os.getpid() and not _pid_alive(pid):
            delete_namespace(ns)
            removed.append(ns)
    return removed
