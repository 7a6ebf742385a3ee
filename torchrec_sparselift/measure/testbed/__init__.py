"""Emulated hosts on one machine: network namespaces joined by shaped veth links.

Each emulated *host* is a Linux network namespace; the ranks of one host talk over its own
loopback. Hosts reach each other through a *switch* namespace over veth pairs, and ``tc ... tbf``
caps each direction of those links at the rate asked for. Real TCP, real gloo, real torchrun: only
the link between hosts is slower. Three shapes of network (:class:`HostLayout`):

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

    with emulated_hosts(HostLayout(hosts=2, ranks_per_host=2, rate_bps=1e9)) as bed:
        print(bed.measure_link(0, 1))
        results = bed.torchrun(["train.py", "--steps", "10"])

or from the command line (docs/testbed.md)::

    python -m torchrec_sparselift.measure.testbed --hosts 2 --ranks-per-host 1 --rate 1gbit -- train.py

The modules: :mod:`.layout` (what to emulate, :class:`HostLayout`, and the rate and size units),
:mod:`.namespaces` (whether the machine can, and the leftovers of dead runs), :mod:`.bed` (the
emulated hosts, :func:`emulated_hosts`, :class:`Testbed`), :mod:`.__main__` (the command line, ``main``).
Nothing here imports torch.
"""

from torchrec_sparselift.measure.testbed.bed import HOST_IFACE, HostResult, LinkMeasurement, Testbed, emulated_hosts
from torchrec_sparselift.measure.testbed.layout import (
    HostLayout,
    HostLayoutError,
    format_rate,
    parse_rate,
    parse_size,
)
from torchrec_sparselift.measure.testbed.namespaces import (
    PREFIX,
    TestbedError,
    TestbedUnavailable,
    cleanup_stale,
    leftover_namespaces,
    unavailable_reason,
)

__all__ = [
    "HostLayout",
    "HostLayoutError",
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
    "format_rate",
    "HOST_IFACE",
    "PREFIX",
]
