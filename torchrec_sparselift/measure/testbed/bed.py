"""The emulated hosts of one run: :func:`emulated_hosts` builds them (namespaces, veth links,
tbf shapers) and yields a :class:`Testbed` that runs commands and torchrun in them and measures
their links."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import attrs

from torchrec_sparselift.measure.testbed.layout import HostLayout, format_rate
from torchrec_sparselift.measure.testbed.namespaces import (
    ETC_NETNS,
    PREFIX,
    TestbedError,
    cleanup_stale,
    delete_namespace,
    kill_namespace_processes,
    leftover_namespaces,
    require_available,
    run_command,
)

__all__ = ["HOST_IFACE", "Testbed", "HostResult", "LinkMeasurement", "emulated_hosts"]

HOST_IFACE = "tb0"
"""The name of each host's link to the switch, inside its namespace (the same in every host)."""

_LOOP_GATEWAY = "198.19.255.2"
_LOOP_MAC = "02:00:c6:13:ff:02"
_SHARED_TABLE = "100"

@attrs.frozen
class HostResult:
    """How one host's command ended: its exit code (``None`` when it was killed: at the timeout,
    or still running ``grace_s`` after another host failed) and its output (stdout and stderr
    together; empty when not captured). For :meth:`Testbed.torchrun`, ``job_returncode`` is the
    exit code of the job's own failed process (torchrun exits 1 whatever its worker's code was;
    its failure report's root cause, negative for a signal: ``-9`` is SIGKILL), ``None`` when
    the host reported no failed worker; ``ended_s`` is when the host's torchrun ended, in seconds
    after the start (``None`` when it was killed)."""

    host: int
    returncode: Optional[int]
    output: str
    killed: bool = False
    job_returncode: Optional[int] = None
    ended_s: Optional[float] = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0


_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


class _Tee:
    """Read one torchrun's output line by line: keep it (``capture``) or pass it on to this
    process's stdout and stderr, and find the exit code of its failed worker in torchrun's
    failure report (the root cause's, else the first listed)."""

    def __init__(self, proc: subprocess.Popen, capture: bool) -> None:
        self.lines: List[str] = []
        self.codes: List[int] = []
        self.root: Optional[int] = None
        self._capture = capture
        self._after_root = False
        self.muted = False  # set at teardown: the job's noise about being killed is not passed on
        streams = [(proc.stdout, sys.stdout)] + ([] if proc.stderr is None else [(proc.stderr, sys.stderr)])
        self._threads = [threading.Thread(target=self._read, args=(src, dst), daemon=True) for src, dst in streams]
        for t in self._threads:
            t.start()

    def _read(self, src: IO[str], dst: IO[str]) -> None:
        for line in src:
            if self._capture:
                self.lines.append(line)
            elif not self.muted:
                with contextlib.suppress(OSError, ValueError):
                    dst.write(line)
                    dst.flush()
            if "Root Cause" in line:
                self._after_root = True
            m = _EXITCODE.match(line)
            if m:
                self.codes.append(int(m.group(1)))
                if self._after_root and self.root is None:
                    self.root = int(m.group(1))

    def finish(self, timeout_s: float = 10.0) -> Tuple[str, Optional[int]]:
        for t in self._threads:
            t.join(timeout_s)
        code = self.root if self.root is not None else (self.codes[0] if self.codes else None)
        return "".join(self.lines), code


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

    def __init__(self, layout: HostLayout, name: str) -> None:
        self.layout = layout
        self.name = name
        self.host_namespaces = [f"{name}-h{i}" for i in range(layout.hosts)]
        self.switch_namespace: Optional[str] = f"{name}-sw" if layout.hosts > 1 else None
        self._created: List[str] = []
        self._procs: List[subprocess.Popen] = []
        self._tees: List[_Tee] = []
        self._closed = False
        self._lock = threading.Lock()

    # -- addresses

    def address(self, host: int) -> str:
        """The address other hosts reach ``host`` at (its ranks bind gloo to it)."""
        self._check_host(host)
        return "127.0.0.1" if self.layout.hosts == 1 else f"198.18.{host}.2"

    def interface(self, host: int) -> str:
        """The interface gloo binds to in ``host`` (``GLOO_SOCKET_IFNAME``)."""
        self._check_host(host)
        return "lo" if self.layout.hosts == 1 else HOST_IFACE

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
            "SPARSELIFT_TESTBED_HOSTS": str(self.layout.hosts),
        }

    def _check_host(self, host: int) -> None:
        if not (isinstance(host, int) and 0 <= host < self.layout.hosts):
            raise ValueError(f"host={host!r}: this testbed has hosts 0..{self.layout.hosts - 1}")

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
        t = self.layout
        tees = []
        start = time.monotonic()
        for host in range(t.hosts):
            argv = [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", str(t.hosts), "--node_rank", str(host),
                "--nproc_per_node", str(t.ranks_per_host),
                "--master_addr", self.master_addr, "--master_port", str(master_port),
                *torchrun_args, *script_argv,
            ]  # fmt: skip
            err = subprocess.STDOUT if capture else subprocess.PIPE
            proc = self.popen(host, argv, env, stdout=subprocess.PIPE, stderr=err, text=True, errors="replace",
                              bufsize=1)
            tees.append((proc, _Tee(proc, capture)))
            with self._lock:
                self._tees.append(tees[-1][1])
        codes, ended = self._wait_all([p for p, _ in tees], timeout_s, grace_s, start)
        results = []
        for host, ((_proc, tee), code, end) in enumerate(zip(tees, codes, ended)):
            text, job = tee.finish()
            results.append(HostResult(host, code, text, killed=code is None, job_returncode=job, ended_s=end))
        return results

    def _wait_all(self, procs: List[subprocess.Popen], timeout_s: float, grace_s: float,
                  start: float) -> Tuple[List[Optional[int]], List[Optional[float]]]:
        deadline = time.monotonic() + timeout_s
        killed: List[bool] = [False] * len(procs)
        ended: List[Optional[float]] = [None] * len(procs)
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            for host, p in enumerate(procs):
                if ended[host] is None and p.poll() is not None:
                    ended[host] = now - start
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, now + grace_s)
            if now >= deadline:
                for host, p in enumerate(procs):
                    if p.poll() is None:
                        killed[host] = True
                        # torchrun starts its workers in sessions of their own: end the host's all
                        kill_namespace_processes(self.host_namespaces[host])
                        self._kill(p)
                break
            time.sleep(0.1)
        now = time.monotonic()
        ended = [None if k else (e if e is not None else now - start) for e, k in zip(ended, killed)]
        return [None if k else p.wait() for p, k in zip(procs, killed)], ended

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
            dst = (src + 1) % self.layout.hosts
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
            rate = self.layout.rate_bps
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
        run_command(["ip", "netns", "add", ns])
        run_command(["ip", "-n", ns, "link", "set", "lo", "up"])
        if self.layout.hosts > 1:
            # `ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts: the hosts' addresses
            # get names (gloo's and c10d's reverse lookups resolve without asking DNS)
            os.makedirs(os.path.join(ETC_NETNS, ns), exist_ok=True)
            try:
                with open("/etc/hosts") as f:
                    base = f.read()
            except OSError:
                base = "127.0.0.1 localhost\n"
            names = "".join(
                f"{prefix}{self.address(h)} {self.name}-host{h} host{h}\n"
                for h in range(self.layout.hosts)
                for prefix in ("", "::ffff:")  # as an IPv6 socket sees an IPv4 peer
            )
            with open(os.path.join(ETC_NETNS, ns, "hosts"), "w") as f:
                f.write(base.rstrip("\n") + "\n# emulated hosts of torchrec_sparselift.measure.testbed\n" + names)

    def _tbf(self, ns: str, dev: str) -> None:
        t = self.layout
        run_command([
            "tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
            "rate", f"{int(t.rate_bps)}bit", "burst", str(t.burst_bytes),
            "latency", f"{max(1, int(round(t.queue_latency_s * 1e6)))}us",
        ])  # fmt: skip

    def _packets(self, ns: str, dev: str) -> None:
        """Cap the packets ``dev`` sends at ``packet_bytes`` (its GSO size), so a small bucket
        passes them whole."""
        if self.layout.rate_bps is not None:
            run_command(["ip", "-n", ns, "link", "set", "dev", dev, "gso_max_size", str(self.layout.packet_bytes)])

    def _sysctl(self, ns: str, **values: str) -> None:
        for key, value in values.items():
            path = "/proc/sys/net/ipv4/" + key.replace("__", "/")
            run_command(["ip", "netns", "exec", ns, "sh", "-c", f"echo {value} > {path}"])

    def build(self) -> None:
        t = self.layout
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
            run_command(["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", HOST_IFACE, "netns", ns])
            run_command(["ip", "-n", sw, "addr", "add", f"198.18.{i}.1/24", "dev", port])
            run_command(["ip", "-n", ns, "addr", "add", f"198.18.{i}.2/24", "dev", HOST_IFACE])
            run_command(["ip", "-n", sw, "link", "set", port, "up"])
            run_command(["ip", "-n", ns, "link", "set", HOST_IFACE, "up"])
            self._packets(sw, port)
            self._packets(ns, HOST_IFACE)
            run_command(["ip", "-n", ns, "route", "add", "198.18.0.0/15", "via", f"198.18.{i}.1", "dev", HOST_IFACE])
            if t.rate_bps is not None and not t.shared:
                self._tbf(ns, HOST_IFACE)
                self._tbf(sw, port)
        if t.shared:
            # every packet between hosts leaves through `la` (shaped) and comes back in at `lb`,
            # then goes out to its host: one queue for all pairs and both directions
            run_command(["ip", "-n", sw, "link", "add", "la", "type", "veth", "peer", "name", "lb"])
            run_command(["ip", "-n", sw, "link", "set", "lb", "address", _LOOP_MAC])
            for dev in ("la", "lb"):
                self._packets(sw, dev)
                self._sysctl(sw, **{f"conf__{dev}__rp_filter": "0"})
                run_command(["ip", "-n", sw, "link", "set", dev, "up"])
            run_command(["ip", "-n", sw, "neigh", "replace", _LOOP_GATEWAY, "lladdr", _LOOP_MAC, "dev", "la", "nud", "permanent"])
            run_command(["ip", "-n", sw, "route", "add", "198.18.0.0/15", "via", _LOOP_GATEWAY, "dev", "la",
                 "onlink", "table", _SHARED_TABLE])  # fmt: skip
            for i in range(t.hosts):
                run_command(["ip", "-n", sw, "rule", "add", "iif", f"p{i}", "lookup", _SHARED_TABLE, "pref", "100"])
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
        others = [self.address(h) for h in range(1, self.layout.hosts)]
        self.run(0, [sys.executable, "-I", "-c", probe, str(timeout_s), *others], timeout_s=timeout_s + 5, check=True)

    def teardown(self) -> None:
        """Kill every process started in the hosts and delete every namespace created (their
        links go with them). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs, self._procs = self._procs, []
            for tee in self._tees:
                tee.muted = True
        for proc in procs:
            self._kill(proc)
        for ns in reversed(self._created):
            delete_namespace(ns)
        left = [ns for ns in self._created if ns in leftover_namespaces()]
        if left:
            raise TestbedError(f"could not delete namespaces {left}; remove them with `ip netns del NAME`")


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def emulated_hosts(layout: HostLayout) -> Iterator[Testbed]:
    """Build the emulated hosts of ``layout``, yield a :class:`Testbed`, and tear everything
    down on the way out, on an exception and on SIGTERM/SIGHUP (turned into ``SystemExit``
    while the block runs) or Ctrl-C. Removes the leftovers of dead runs first.

    SIGINT raises ``KeyboardInterrupt`` while the block runs even where this process was started
    with SIGINT ignored (a non-interactive shell's ``command &`` starts it so, and Python then
    never installs its Ctrl-C handler): an interrupt always tears the hosts down instead of
    leaving the job to run on to its timeout."""
    require_available()
    cleanup_stale()
    bed = Testbed(layout, f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}")
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if main_thread:
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _raise_exit)
        signal.signal(signal.SIGINT, signal.default_int_handler)
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
