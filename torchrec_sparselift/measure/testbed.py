"""Emulated hosts on one machine: network namespaces joined by shaped veth links.

Each emulated *host* is a Linux network namespace; the ranks of one host talk over its own
loopback. Hosts reach each other through a *switch* namespace over veth pairs, and ``tc ... tbf``
caps each direction of those links at the rate asked for. Real TCP, real gloo, real torchrun: only
the link between hosts is slower. Three shapes of network (:class:`Topology`):

- ``hosts >= 2`` (the default): every host's link to the switch is capped at ``rate_bps`` in each
  direction (a host's NIC; the switch itself is non-blocking).
- ``hosts >= 2, shared=True``: all traffic between hosts, every pair and both directions, crosses
  one link of ``rate_bps`` inside the switch (a single shared uplink; two one-rank hosts sharing
  a 1 Gbit/s link is the 2-rank network-bound regime).
- ``hosts == 1``: the ranks share the host's loopback, capped at ``rate_bps`` (all ranks' traffic
  through one queue, like the shared link).

Only the rate is shaped. tbf's ``latency`` is the longest a packet may wait in its queue (the queue
size), not an added delay: without netem there is no latency or loss emulation.

Addresses (198.18.0.0/15, the range set aside for network benchmarks) exist only inside the
namespaces created here; nothing outside the machine is ever addressed. Namespace names carry the
creating process's pid, so concurrent runs do not collide, and a run removes everything it made
on exit, on an exception and on SIGINT/SIGTERM/SIGHUP; leftovers of a killed run (its pid dead)
are removed by the next one. Needs root and iproute2 (``ip``, ``tc``).

Use it from Python::

    with emulated_hosts(Topology(hosts=2, ranks_per_host=2, rate_bps=1e9)) as bed:
        print(bed.measure_link(0, 1))
        results = bed.torchrun(["train.py", "--steps", "10"])

or from the command line (docs/testbed.md)::

    python -m torchrec_sparselift.measure.testbed --hosts 2 --ranks-per-host 1 --rate 1gbit -- train.py
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import attrs

__all__ = [
    "Topology",
    "TopologyError",
    "TestbedUnavailable",
    "TestbedError",
    "Testbed",
    "HostResult",
    "LinkMeasurement",
    "emulated_hosts",
    "unavailable_reason",
    "cleanup_stale",
    "leftover_namespaces",
    "parse_rate",
    "parse_size",
    "main",
]

PREFIX = "sltb"
"""Every namespace this module creates is named ``sltb<pid>x<token>-<role>``."""

_NAME = re.compile(rf"^{PREFIX}(\d+)x([0-9a-f]+)-(\S+)")
HOST_IFACE = "tb0"
"""The name of each host's link to the switch, inside its namespace (the same in every host)."""

_LOOP_GATEWAY = "198.19.255.2"
_LOOP_MAC = "02:00:c6:13:ff:02"
_SHARED_TABLE = "100"
_LOOPBACK_PACKET = 64 * 1024  # the loopback's MTU: the largest packet a shaped loopback sends
_PACKET = 16 * 1024  # the default largest packet on the links between hosts (their GSO size)
_BURST_PACKETS = 4  # the default bucket, in largest packets (docs/testbed.md: the burst's effect)
_ETC_NETNS = "/etc/netns"


def _default_burst(t: "Topology") -> int:
    """Four of the topology's largest packets (a 64 KiB bucket for 16 KiB packets); an invalid
    ``packet_bytes`` (reported by :meth:`Topology.problems`) counts as the default."""
    valid = isinstance(t.packet_bytes, int) and not isinstance(t.packet_bytes, bool)
    return _BURST_PACKETS * (t.largest_packet if valid else _PACKET)


class TopologyError(ValueError):
    """A :class:`Topology` that cannot be built; the message lists every problem and its fix."""


class TestbedUnavailable(RuntimeError):
    """This machine cannot emulate hosts (not root, ``ip``/``tc`` missing, no tbf); the message
    says which and what to do."""


class TestbedError(RuntimeError):
    """A command that sets up the emulated network failed; the message holds the command and its
    error output."""


@attrs.frozen
class Topology:
    """What to emulate: ``hosts`` x ``ranks_per_host`` ranks, hosts joined by links of
    ``rate_bps`` bit/s in each direction (``None``: unshaped veth, as fast as the CPU copies).

    ``shared``: all traffic between hosts crosses one link of ``rate_bps`` (both directions and
    every pair share it) instead of each host having its own link. ``packet_bytes``: the largest
    packet the links between hosts carry (their GSO size). ``burst_bytes``: the token bucket's
    depth, how much may leave at the veth's own speed after an idle moment where a real link sends
    nothing faster than its rate; it must hold two of the largest packets, and defaults to four
    (64 KiB between hosts, 256 KiB on a shaped loopback). ``queue_latency_s``:
    the longest a packet waits in the shaper's queue before it is dropped (tbf's ``latency``;
    the queue's size, not an added delay)."""

    hosts: int = 2
    ranks_per_host: int = 1
    rate_bps: Optional[float] = None
    shared: bool = False
    packet_bytes: int = _PACKET
    burst_bytes: int = attrs.field(default=attrs.Factory(lambda t: _default_burst(t), takes_self=True))
    queue_latency_s: float = 0.05

    def __attrs_post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise TopologyError("invalid testbed topology:\n  - " + "\n  - ".join(problems))

    def problems(self) -> List[str]:
        """Every reason this topology cannot be built, each with its fix (empty: it can)."""
        out = []
        if not isinstance(self.hosts, int) or isinstance(self.hosts, bool) or not 1 <= self.hosts <= 250:
            out.append(f"hosts={self.hosts!r}: give an integer from 1 to 250")
        if (
            not isinstance(self.ranks_per_host, int)
            or isinstance(self.ranks_per_host, bool)
            or not 1 <= self.ranks_per_host <= 256
        ):
            out.append(f"ranks_per_host={self.ranks_per_host!r}: give an integer from 1 to 256")
        if self.rate_bps is not None:
            if not isinstance(self.rate_bps, (int, float)) or isinstance(self.rate_bps, bool):
                out.append(f"rate_bps={self.rate_bps!r}: give bits per second as a number, or None")
            elif not (math.isfinite(self.rate_bps) and 1e5 <= self.rate_bps <= 1e12):
                out.append(
                    f"rate_bps={self.rate_bps!r}: give bits per second from 1e5 (100 kbit/s) to "
                    "1e12, or None for an unshaped link"
                )
        if not isinstance(self.shared, bool):
            out.append(f"shared={self.shared!r}: give True or False")
        elif self.shared and self.rate_bps is None:
            out.append("shared=True without rate_bps: a shared link needs a rate; give rate_bps")
        packet_ok = (isinstance(self.packet_bytes, int) and not isinstance(self.packet_bytes, bool)
                     and 1500 <= self.packet_bytes <= 65536)
        if not packet_ok:
            out.append(f"packet_bytes={self.packet_bytes!r}: give an integer from 1500 (one Ethernet frame) to "
                       "65536 (the largest offloaded packet)")
        if not isinstance(self.burst_bytes, int) or isinstance(self.burst_bytes, bool):
            out.append(f"burst_bytes={self.burst_bytes!r}: give an integer number of bytes")
        elif packet_ok and not 2 * self.largest_packet <= self.burst_bytes <= 1 << 30:
            what = ("the shaped loopback's 64 KiB packets" if self.hosts == 1
                    else f"packet_bytes={self.packet_bytes} packets")
            out.append(
                f"burst_bytes={self.burst_bytes}: give at least {2 * self.largest_packet} (the bucket must hold "
                f"two of {what}) and at most 1 GiB"
            )
        if not isinstance(self.queue_latency_s, (int, float)) or isinstance(self.queue_latency_s, bool):
            out.append(f"queue_latency_s={self.queue_latency_s!r}: give seconds as a number")
        elif not (math.isfinite(self.queue_latency_s) and 1e-4 <= self.queue_latency_s <= 10):
            out.append(f"queue_latency_s={self.queue_latency_s!r}: give 1e-4 to 10 seconds")
        return out

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def largest_packet(self) -> int:
        """The largest packet the shaper sees: ``packet_bytes`` on the links between hosts, the
        loopback's MTU (64 KiB) when one host's loopback is shaped."""
        return _LOOPBACK_PACKET if self.hosts == 1 else self.packet_bytes

    def describe(self) -> str:
        """One line for logs: ``2 hosts x 1 rank, 1 Gbit/s per host link per direction``."""
        ranks = f"{self.ranks_per_host} rank{'s' if self.ranks_per_host > 1 else ''}"
        head = f"{self.hosts} host{'s' if self.hosts > 1 else ''} x {ranks}"
        if self.rate_bps is None:
            return f"{head}, unshaped links"
        rate = format_rate(self.rate_bps)
        if self.hosts == 1:
            return f"{head}, loopback shared at {rate}"
        if self.shared:
            return f"{head}, one shared {rate} link between hosts"
        return f"{head}, {rate} per host link per direction"


@attrs.frozen
class HostResult:
    """How one host's command ended: its exit code (``None`` when it was killed: at the timeout,
    or still running ``grace_s`` after another host failed) and its output (stdout and stderr
    together; empty when not captured)."""

    host: int
    returncode: Optional[int]
    output: str
    killed: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0


@attrs.frozen
class LinkMeasurement:
    """A bulk TCP transfer and a small-message ping-pong from host ``src`` to host ``dst``."""

    src: int
    dst: int
    bulk_bytes: int
    bulk_s: float
    message_bytes: int
    round_trips: int
    round_trip_s: float  # median

    @property
    def bandwidth_bps(self) -> float:
        """Achieved goodput of the bulk transfer in bit/s (TCP payload; the shaper also counts
        headers, so a shaped link measures a few percent under its rate)."""
        return 8.0 * self.bulk_bytes / self.bulk_s

    @property
    def latency_s(self) -> float:
        """Per-message one-way latency: half the median round trip."""
        return self.round_trip_s / 2.0

    def __str__(self) -> str:
        return (
            f"host {self.src} -> host {self.dst}: {format_rate(self.bandwidth_bps)} "
            f"({self.bulk_bytes / 1e6:.1f} MB in {self.bulk_s:.3f} s), "
            f"{self.latency_s * 1e6:.0f} us per {self.message_bytes} B message "
            f"(median of {self.round_trips} round trips)"
        )


# ---------------------------------------------------------------- units


_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12, "bps": 1.0}
_SIZE_UNITS = {"b": 1, "kb": 1024, "k": 1024, "mb": 1024**2, "m": 1024**2, "gb": 1024**3, "g": 1024**3}


def parse_rate(text: str) -> float:
    """Bits per second from ``1gbit``, ``300mbit``, ``100kbit``, ``1e9`` (tc's decimal units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _RATE_UNITS and m.group(2) != "":
        raise TopologyError(
            f"rate {text!r}: write a number with a unit, e.g. 1gbit, 300mbit, 100kbit, or bits "
            "per second as a plain number (1e9)"
        )
    return float(m.group(1)) * _RATE_UNITS.get(m.group(2), 1.0)


def parse_size(text: str) -> int:
    """Bytes from ``512kb``, ``1mb``, ``65536`` (binary units, as tc's ``burst``)."""
    m = re.fullmatch(r"\s*([0-9]+)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _SIZE_UNITS and m.group(2) != "":
        raise TopologyError(f"size {text!r}: write bytes with a unit, e.g. 512kb, 1mb, or 65536")
    return int(m.group(1)) * _SIZE_UNITS.get(m.group(2), 1)


def format_rate(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.4g} {unit}"
    return f"{bps:.4g} bit/s"


# ---------------------------------------------------------------- preflight and leftovers


def _sh(argv: Sequence[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
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
        made = _sh(["ip", "netns", "add", probe], check=False)
        if made.returncode != 0:
            return f"`ip netns add` failed ({made.stderr.strip()}); the kernel or container forbids network namespaces"
        tbf = _sh(
            ["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1mbit",
             "burst", "128kb", "latency", "50ms"],
            check=False,
        )  # fmt: skip
        if tbf.returncode != 0:
            return (
                f"the tbf qdisc is unavailable ({tbf.stderr.strip()}); load it with `modprobe sch_tbf` "
                "or use a kernel built with CONFIG_NET_SCH_TBF"
            )
        veth = _sh(["ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"], check=False)
        if veth.returncode != 0:
            return f"veth links are unavailable ({veth.stderr.strip()}); load them with `modprobe veth`"
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot run iproute2: {e}"
    finally:
        _sh(["ip", "netns", "del", probe], check=False)
    return None


def _require_available() -> None:
    reason = unavailable_reason()
    if reason is not None:
        raise TestbedUnavailable(reason)


def _namespaces() -> List[str]:
    proc = _sh(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def leftover_namespaces() -> List[str]:
    """Every namespace of this module's naming that exists now (live runs' included), and every
    name with a leftover /etc/netns/NAME folder."""
    try:
        etc = os.listdir(_ETC_NETNS)
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


def _kill_namespace_processes(ns: str) -> None:
    """SIGTERM, then SIGKILL, every process inside namespace ``ns``."""
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
        pids = [int(p) for p in _sh(["ip", "netns", "pids", ns], check=False).stdout.split() if p.isdigit()]
        pids = [p for p in pids if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.05)


def _delete_namespace(ns: str) -> None:
    _kill_namespace_processes(ns)
    _sh(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(os.path.join(_ETC_NETNS, ns), ignore_errors=True)


def cleanup_stale() -> List[str]:
    """Remove the namespaces (and so their links and processes) left by runs whose process is
    dead, e.g. killed with SIGKILL. Returns the names removed; live runs' are left alone."""
    removed = []
    for ns in leftover_namespaces():
        pid = int(_NAME.match(ns).group(1))  # type: ignore[union-attr]
        if pid != os.getpid() and not _pid_alive(pid):
            _delete_namespace(ns)
            removed.append(ns)
    return removed


# ---------------------------------------------------------------- the testbed


_BULK_SERVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0)); s.listen(2); print(s.getsockname()[1], flush=True)
def exact(c, n):
    b = bytearray()
    while len(b) < n:
        part = c.recv(n - len(b))
        if not part: return bytes(b)
        b += part
    return bytes(b)
c, _ = s.accept(); total = int.from_bytes(exact(c, 8), "big"); got = 0
while got < total:
    part = c.recv(1 << 20)
    if not part: break
    got += len(part)
c.sendall(got.to_bytes(8, "big")); c.close()
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
size = int.from_bytes(exact(c, 8), "big")
while True:
    m = exact(c, size)
    if len(m) < size: break
    c.sendall(m)
"""

_BULK_CLIENT = r"""
import json, socket, statistics, sys, time
addr, port, total, size, trips = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
def exact(c, n):
    b = bytearray()
    while len(b) < n:
        part = c.recv(n - len(b))
        if not part: raise SystemExit("connection closed early")
        b += part
    return bytes(b)
c = socket.create_connection((addr, port)); c.sendall(total.to_bytes(8, "big"))
chunk = memoryview(bytes(1 << 20)); left = total; t0 = time.perf_counter()
while left:
    n = min(left, len(chunk)); c.sendall(chunk[:n]); left -= n
got = int.from_bytes(exact(c, 8), "big"); bulk_s = time.perf_counter() - t0; c.close()
if got != total: raise SystemExit(f"server received {got} of {total} bytes")
c = socket.create_connection((addr, port)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
c.sendall(size.to_bytes(8, "big")); msg = bytes(size); rtts = []
for _ in range(trips + 5):
    t = time.perf_counter(); c.sendall(msg); exact(c, size); rtts.append(time.perf_counter() - t)
c.close()
print(json.dumps({"bulk_s": bulk_s, "round_trip_s": statistics.median(rtts[5:])}))
"""


class Testbed:
    """The emulated hosts of one :func:`emulated_hosts` block: run commands in a host
    (:meth:`run`, :meth:`popen`), launch torchrun on all hosts (:meth:`torchrun`), measure a
    link (:meth:`measure_link`). Valid only inside the ``with`` block."""

    def __init__(self, topology: Topology, name: str) -> None:
        self.topology = topology
        self.name = name
        self.host_namespaces = [f"{name}-h{i}" for i in range(topology.hosts)]
        self.switch_namespace: Optional[str] = f"{name}-sw" if topology.hosts > 1 else None
        self._created: List[str] = []
        self._procs: List[subprocess.Popen] = []
        self._closed = False
        self._lock = threading.Lock()

    # -- addresses

    def address(self, host: int) -> str:
        """The address other hosts reach ``host`` at (its ranks bind gloo to it)."""
        self._check_host(host)
        return "127.0.0.1" if self.topology.hosts == 1 else f"198.18.{host}.2"

    def interface(self, host: int) -> str:
        """The interface gloo binds to in ``host`` (``GLOO_SOCKET_IFNAME``)."""
        self._check_host(host)
        return "lo" if self.topology.hosts == 1 else HOST_IFACE

    @property
    def master_addr(self) -> str:
        return self.address(0)

    def host_env(self, host: int) -> Dict[str, str]:
        """Variables every command in ``host`` gets: gloo (and TensorPipe) bound to the host's
        link, and which emulated host it is."""
        iface = self.interface(host)
        return {
            "GLOO_SOCKET_IFNAME": iface,
            "TP_SOCKET_IFNAME": iface,
            "SPARSELIFT_TESTBED_HOST": str(host),
            "SPARSELIFT_TESTBED_HOSTS": str(self.topology.hosts),
        }

    def _check_host(self, host: int) -> None:
        if not (isinstance(host, int) and 0 <= host < self.topology.hosts):
            raise ValueError(f"host={host!r}: this testbed has hosts 0..{self.topology.hosts - 1}")

    def _argv(self, host: int, argv: Sequence[str]) -> List[str]:
        if self._closed:
            raise TestbedError("the testbed was torn down; run commands inside its `with` block")
        self._check_host(host)
        return ["ip", "netns", "exec", self.host_namespaces[host], *argv]

    def _env(self, host: int, env: Optional[Mapping[str, str]]) -> Dict[str, str]:
        return {**os.environ, **self.host_env(host), **(env or {})}

    # -- running commands

    def popen(
        self, host: int, argv: Sequence[str], env: Optional[Mapping[str, str]] = None, **kwargs
    ) -> subprocess.Popen:
        """Start ``argv`` inside ``host`` (``env`` added to this process's environment and
        :meth:`host_env`). The process is killed when the testbed is torn down."""
        proc = subprocess.Popen(self._argv(host, argv), env=self._env(host, env), start_new_session=True, **kwargs)
        with self._lock:
            self._procs.append(proc)
        return proc

    def run(
        self,
        host: int,
        argv: Sequence[str],
        env: Optional[Mapping[str, str]] = None,
        timeout_s: Optional[float] = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host`` to completion; stdout and stderr are captured as text."""
        proc = self.popen(host, argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            out, err = proc.communicate()
            raise TestbedError(f"`{' '.join(argv)}` in host {host} ran past {timeout_s} s; killed") from None
        done = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
        if check and proc.returncode != 0:
            raise TestbedError(f"`{' '.join(argv)}` in host {host} failed (exit {proc.returncode}): {err.strip()}")
        return done

    def torchrun(
        self,
        script_argv: Sequence[str],
        env: Optional[Mapping[str, str]] = None,
        timeout_s: float = 600.0,
        capture: bool = True,
        master_port: int = 29500,
        grace_s: float = 30.0,
        torchrun_args: Sequence[str] = (),
    ) -> List[HostResult]:
        """Run ``script_argv`` (a script and its arguments, or ``["-m", module, ...]``) under one
        ``torchrun --nnodes H --node_rank i --nproc_per_node R`` per host, rendezvous at host 0's
        address (static rendezvous; ports are per namespace, so ``master_port`` never collides
        with the machine's). Returns each host's exit code and output (``capture=False``: the
        output goes to this process's stdout/stderr). When a host fails, the others get
        ``grace_s`` to finish before they are killed; at ``timeout_s`` all are."""
        t = self.topology
        outputs: List[Optional[IO[str]]] = []
        procs = []
        try:
            for host in range(t.hosts):
                argv = [
                    sys.executable, "-m", "torch.distributed.run",
                    "--nnodes", str(t.hosts), "--node_rank", str(host),
                    "--nproc_per_node", str(t.ranks_per_host),
                    "--master_addr", self.master_addr, "--master_port", str(master_port),
                    *torchrun_args, *script_argv,
                ]  # fmt: skip
                out = tempfile.TemporaryFile(mode="w+") if capture else None
                outputs.append(out)
                sink = {"stdout": out, "stderr": subprocess.STDOUT} if capture else {}
                procs.append(self.popen(host, argv, env, **sink))
            codes = self._wait_all(procs, timeout_s, grace_s)
            results = []
            for host, (code, out) in enumerate(zip(codes, outputs)):
                text = ""
                if out is not None:
                    out.seek(0)
                    text = out.read()
                results.append(HostResult(host, code, text, killed=code is None))
            return results
        finally:
            for out in outputs:
                if out is not None:
                    out.close()

    def _wait_all(self, procs: List[subprocess.Popen], timeout_s: float, grace_s: float) -> List[Optional[int]]:
        deadline = time.monotonic() + timeout_s
        killed: List[bool] = [False] * len(procs)
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, now + grace_s)
            if now >= deadline:
                for host, p in enumerate(procs):
                    if p.poll() is None:
                        killed[host] = True
                        # torchrun starts its workers in sessions of their own: end the host's all
                        _kill_namespace_processes(self.host_namespaces[host])
                        self._kill(p)
                break
            time.sleep(0.1)
        return [None if k else p.wait() for p, k in zip(procs, killed)]

    def measure_link(
        self,
        src: int = 0,
        dst: Optional[int] = None,
        bulk_bytes: Optional[int] = None,
        message_bytes: int = 64,
        round_trips: int = 200,
        timeout_s: float = 120.0,
    ) -> LinkMeasurement:
        """Time a bulk TCP transfer and a ``message_bytes`` ping-pong from host ``src`` to host
        ``dst`` (default: the next host; itself on one host) with Python sockets inside the
        namespaces. ``bulk_bytes`` defaults to about one second at the shaped rate (at least
        8 MiB; 64 MiB unshaped)."""
        if dst is None:
            dst = (src + 1) % self.topology.hosts
        return self.measure_links([(src, dst)], bulk_bytes, message_bytes, round_trips, timeout_s)[0]

    def measure_links(
        self,
        pairs: Sequence[Tuple[int, int]],
        bulk_bytes: Optional[int] = None,
        message_bytes: int = 64,
        round_trips: int = 200,
        timeout_s: float = 120.0,
    ) -> List[LinkMeasurement]:
        """:meth:`measure_link` for several ``(src, dst)`` pairs at once, all transfers running
        concurrently (e.g. both directions of a shared link split its rate)."""
        if bulk_bytes is None:
            rate = self.topology.rate_bps
            bulk_bytes = 64 << 20 if rate is None else int(min(max(rate / 8.0, 8 << 20), 256 << 20))
        servers, clients = [], []
        try:
            for src, dst in pairs:
                self._check_host(src)
                servers.append(self.popen(
                    dst, [sys.executable, "-I", "-c", _BULK_SERVER, self.address(dst)],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                ))  # fmt: skip
            ports = []
            for (src, dst), server in zip(pairs, servers):
                line = server.stdout.readline().strip()  # type: ignore[union-attr]
                if not line.isdigit():
                    err = server.stderr.read()  # type: ignore[union-attr]
                    raise TestbedError(f"the measuring server in host {dst} did not start: {err}")
                ports.append(line)
            for (src, dst), port in zip(pairs, ports):
                argv = [sys.executable, "-I", "-c", _BULK_CLIENT, self.address(dst), port,
                        str(bulk_bytes), str(message_bytes), str(round_trips)]  # fmt: skip
                clients.append(self.popen(src, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            out = []
            deadline = time.monotonic() + timeout_s
            for (src, dst), client in zip(pairs, clients):
                try:
                    stdout, stderr = client.communicate(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise TestbedError(f"measuring host {src} -> host {dst} ran past {timeout_s} s") from None
                if client.returncode != 0:
                    raise TestbedError(f"measuring host {src} -> host {dst} failed: {stderr.strip()}")
                got = json.loads(stdout)
                out.append(LinkMeasurement(
                    src, dst, bulk_bytes, got["bulk_s"], message_bytes, round_trips, got["round_trip_s"]
                ))  # fmt: skip
            return out
        finally:
            for proc in clients + servers:
                self._kill(proc)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        if proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=3)
                return
            except subprocess.TimeoutExpired:
                continue

    # -- building and tearing down

    def _ns(self, ns: str) -> None:
        self._created.append(ns)
        _sh(["ip", "netns", "add", ns])
        _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        if self.topology.hosts > 1:
            # `ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts: the hosts' addresses
            # get names (gloo's and c10d's reverse lookups resolve without asking DNS)
            os.makedirs(os.path.join(_ETC_NETNS, ns), exist_ok=True)
            try:
                with open("/etc/hosts") as f:
                    base = f.read()
            except OSError:
                base = "127.0.0.1 localhost\n"
            names = "".join(
                f"{prefix}{self.address(h)} {self.name}-host{h} host{h}\n"
                for h in range(self.topology.hosts)
                for prefix in ("", "::ffff:")  # as an IPv6 socket sees an IPv4 peer
            )
            with open(os.path.join(_ETC_NETNS, ns, "hosts"), "w") as f:
                f.write(base.rstrip("\n") + "\n# emulated hosts of torchrec_sparselift.measure.testbed\n" + names)

    def _tbf(self, ns: str, dev: str) -> None:
        t = self.topology
        _sh([
            "tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
            "rate", f"{int(t.rate_bps)}bit", "burst", str(t.burst_bytes),
            "latency", f"{max(1, int(round(t.queue_latency_s * 1e6)))}us",
        ])  # fmt: skip

    def _packets(self, ns: str, dev: str) -> None:
        """Cap the packets ``dev`` sends at ``packet_bytes`` (its GSO size), so a small bucket
        passes them whole."""
        if self.topology.rate_bps is not None:
            _sh(["ip", "-n", ns, "link", "set", "dev", dev, "gso_max_size", str(self.topology.packet_bytes)])

    def _sysctl(self, ns: str, **values: str) -> None:
        for key, value in values.items():
            path = "/proc/sys/net/ipv4/" + key.replace("__", "/")
            _sh(["ip", "netns", "exec", ns, "sh", "-c", f"echo {value} > {path}"])

    def build(self) -> None:
        t = self.topology
        for ns in self.host_namespaces:
            self._ns(ns)
        if t.hosts == 1:
            if t.rate_bps is not None:
                self._tbf(self.host_namespaces[0], "lo")
            return
        sw = self.switch_namespace
        assert sw is not None
        self._ns(sw)
        self._sysctl(sw, ip_forward="1", conf__all__rp_filter="0", conf__default__rp_filter="0",
                     conf__all__send_redirects="0", conf__default__send_redirects="0")  # fmt: skip
        for i, ns in enumerate(self.host_namespaces):
            port = f"p{i}"
            _sh(["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", HOST_IFACE, "netns", ns])
            _sh(["ip", "-n", sw, "addr", "add", f"198.18.{i}.1/24", "dev", port])
            _sh(["ip", "-n", ns, "addr", "add", f"198.18.{i}.2/24", "dev", HOST_IFACE])
            _sh(["ip", "-n", sw, "link", "set", port, "up"])
            _sh(["ip", "-n", ns, "link", "set", HOST_IFACE, "up"])
            self._packets(sw, port)
            self._packets(ns, HOST_IFACE)
            _sh(["ip", "-n", ns, "route", "add", "198.18.0.0/15", "via", f"198.18.{i}.1", "dev", HOST_IFACE])
            if t.rate_bps is not None and not t.shared:
                self._tbf(ns, HOST_IFACE)
                self._tbf(sw, port)
        if t.shared:
            # every packet between hosts leaves through `la` (shaped) and comes back in at `lb`,
            # then goes out to its host: one queue for all pairs and both directions
            _sh(["ip", "-n", sw, "link", "add", "la", "type", "veth", "peer", "name", "lb"])
            _sh(["ip", "-n", sw, "link", "set", "lb", "address", _LOOP_MAC])
            for dev in ("la", "lb"):
                self._packets(sw, dev)
                self._sysctl(sw, **{f"conf__{dev}__rp_filter": "0"})
                _sh(["ip", "-n", sw, "link", "set", dev, "up"])
            _sh(["ip", "-n", sw, "neigh", "replace", _LOOP_GATEWAY, "lladdr", _LOOP_MAC, "dev", "la", "nud", "permanent"])
            _sh(["ip", "-n", sw, "route", "add", "198.18.0.0/15", "via", _LOOP_GATEWAY, "dev", "la",
                 "onlink", "table", _SHARED_TABLE])  # fmt: skip
            for i in range(t.hosts):
                _sh(["ip", "-n", sw, "rule", "add", "iif", f"p{i}", "lookup", _SHARED_TABLE, "pref", "100"])
            self._tbf(sw, "la")
        self._wait_reachable()

    def _wait_reachable(self, timeout_s: float = 10.0) -> None:
        """Until host 0 reaches every other host (a fresh veth may take a moment to carry)."""
        probe = (
            "import socket, sys, time\n"
            "deadline = time.monotonic() + float(sys.argv[1])\n"
            "for a in sys.argv[2:]:\n"
            "    while True:\n"
            "        s = socket.socket(); s.settimeout(0.5)\n"
            "        try: s.connect((a, 9)); break\n"
            "        except ConnectionRefusedError: break\n"
            "        except OSError:\n"
            "            if time.monotonic() > deadline: sys.exit(f'{a} unreachable')\n"
            "            time.sleep(0.05)\n"
            "        finally: s.close()\n"
        )
        others = [self.address(h) for h in range(1, self.topology.hosts)]
        self.run(0, [sys.executable, "-I", "-c", probe, str(timeout_s), *others], timeout_s=timeout_s + 5, check=True)

    def teardown(self) -> None:
        """Kill every process started in the hosts and delete every namespace created (their
        links go with them). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs, self._procs = self._procs, []
        for proc in procs:
            self._kill(proc)
        for ns in reversed(self._created):
            _delete_namespace(ns)
        left = [ns for ns in self._created if ns in leftover_namespaces()]
        if left:
            raise TestbedError(f"could not delete namespaces {left}; remove them with `ip netns del NAME`")


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def emulated_hosts(topology: Topology) -> Iterator[Testbed]:
    """Build the emulated hosts of ``topology``, yield a :class:`Testbed`, and tear everything
    down on the way out, on an exception and on SIGTERM/SIGHUP (turned into ``SystemExit``
    while the block runs) or Ctrl-C. Removes the leftovers of dead runs first."""
    _require_available()
    cleanup_stale()
    bed = Testbed(topology, f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}")
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if main_thread:
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _raise_exit)
    atexit.register(bed.teardown)
    try:
        bed.build()
        yield bed
    finally:
        if main_thread:  # a second Ctrl-C or SIGTERM must not cut the cleanup short
            for sig in previous:
                signal.signal(sig, signal.SIG_IGN)
        try:
            bed.teardown()
        finally:
            atexit.unregister(bed.teardown)
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


# ---------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchrec_sparselift.measure.testbed",
        description=(
            "Run a torchrun job on emulated hosts: one network namespace per host, hosts joined "
            "by veth links shaped with tc tbf. Needs root. See docs/testbed.md."
        ),
        epilog="example: --hosts 2 --ranks-per-host 2 --rate 1gbit -- examples/train.py --steps 20",
    )
    p.add_argument("--hosts", type=int, default=2, help="emulated hosts (network namespaces), default 2")
    p.add_argument("--ranks-per-host", type=int, default=1, help="torchrun ranks per host, default 1")
    p.add_argument("--rate", help="link rate per direction, e.g. 1gbit, 300mbit (default: unshaped)")
    p.add_argument("--shared", action="store_true", help="all traffic between hosts shares one link of --rate")
    p.add_argument("--burst", help="token bucket depth (default: four of the largest packets, 64kb between hosts, "
                   "256kb on a shaped loopback; docs/testbed.md)")
    p.add_argument("--packet", default="16kb", help="largest packet on the links between hosts (GSO size), "
                   "default 16kb")
    p.add_argument("--queue-latency-ms", type=float, default=50.0, help="tbf queue limit in ms, default 50")
    p.add_argument("--check", action="store_true", help="measure the link between host 0 and host 1 and print it")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the job is killed, default 3600")
    p.add_argument("--master-port", type=int, default=29500, help="rendezvous port inside the namespaces")
    p.add_argument("--cleanup", action="store_true", help="only remove leftovers of dead runs, then exit")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS... run under torchrun on every host")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    script = list(args.script)
    if script[:1] == ["--"]:
        script = script[1:]
    try:
        if args.cleanup:
            _require_available()
            removed = cleanup_stale()
            print(f"removed {len(removed)} leftover namespace(s)" + (f": {' '.join(removed)}" if removed else ""))
            return 0
        topology = Topology(
            hosts=args.hosts,
            ranks_per_host=args.ranks_per_host,
            rate_bps=None if args.rate is None else parse_rate(args.rate),
            shared=args.shared,
            packet_bytes=parse_size(args.packet),
            **({} if args.burst is None else dict(burst_bytes=parse_size(args.burst))),
            queue_latency_s=args.queue_latency_ms / 1e3,
        )
        if not script and not args.check:
            print("nothing to do: give --check and/or -- SCRIPT ARGS...", file=sys.stderr)
            return 2
        with emulated_hosts(topology) as bed:
            print(f"testbed: {topology.describe()}; master {bed.master_addr}:{args.master_port}", flush=True)
            if args.check:
                print(bed.measure_link(0), flush=True)
                if topology.hosts > 1:
                    print(bed.measure_link(1, 0), flush=True)
                    both = bed.measure_links([(0, 1), (1, 0)])
                    total = sum(m.bulk_bytes for m in both) * 8 / max(m.bulk_s for m in both)
                    print(f"both directions at once: {format_rate(total)} in total", flush=True)
                    for m in both:
                        print(f"  {m}", flush=True)
            if not script:
                return 0
            results = bed.torchrun(script, timeout_s=args.timeout, capture=False, master_port=args.master_port)
        for r in results:
            state = "killed" if r.killed else f"exit {r.returncode}"
            print(f"testbed: host {r.host}: {state}", file=sys.stderr)
        bad = [r for r in results if not r.ok]
        if not bad:
            return 0
        code = bad[0].returncode
        return code if code is not None and 0 < code < 128 else 1
    except (TopologyError, TestbedUnavailable, TestbedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; the emulated hosts were removed", file=sys.stderr)
        return 130
    except SystemExit as e:
        if isinstance(e.code, int) and e.code > 128:
            print(f"stopped by signal {e.code - 128}; the emulated hosts were removed", file=sys.stderr)
        raise


if __name__ == "__main__":
    sys.exit(main())
