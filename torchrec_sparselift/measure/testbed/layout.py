"""What the testbed emulates (:class:`HostLayout`: hosts, ranks per host, the links' rate and
shape) and the units its command line reads (``1gbit``, ``64kb``)."""

from __future__ import annotations

import math
import re
from typing import List, Optional

import attrs

__all__ = ["HostLayout", "HostLayoutError", "parse_rate", "parse_size", "format_rate"]

_LOOPBACK_PACKET = 64 * 1024  # the loopback's MTU: the largest packet a shaped loopback sends
_PACKET = 16 * 1024  # the default largest packet on the links between hosts (their GSO size)
_BURST_PACKETS = 4  # the default bucket, in largest packets (docs/testbed.md: the burst's effect)


def _default_burst(t: "HostLayout") -> int:
    """Four of the layout's largest packets (a 64 KiB bucket for 16 KiB packets); an invalid
    ``packet_bytes`` (reported by :meth:`HostLayout.problems`) counts as the default."""
    valid = isinstance(t.packet_bytes, int) and not isinstance(t.packet_bytes, bool)
    return _BURST_PACKETS * (t.largest_packet if valid else _PACKET)


class HostLayoutError(ValueError):
    """A :class:`HostLayout` that cannot be built; the message lists every problem and its fix."""


@attrs.frozen
class HostLayout:
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
            raise HostLayoutError("invalid testbed layout:\n  - " + "\n  - ".join(problems))

    def problems(self) -> List[str]:
        """Every reason this layout cannot be built, each with its fix (empty: it can)."""
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



# ---------------------------------------------------------------- units


_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12, "bps": 1.0}
_SIZE_UNITS = {"b": 1, "kb": 1024, "k": 1024, "mb": 1024**2, "m": 1024**2, "gb": 1024**3, "g": 1024**3}


def parse_rate(text: str) -> float:
    """Bits per second from ``1gbit``, ``300mbit``, ``100kbit``, ``1e9`` (tc's decimal units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _RATE_UNITS and m.group(2) != "":
        raise HostLayoutError(
            f"rate {text!r}: write a number with a unit, e.g. 1gbit, 300mbit, 100kbit, or bits "
            "per second as a plain number (1e9)"
        )
    return float(m.group(1)) * _RATE_UNITS.get(m.group(2), 1.0)


def parse_size(text: str) -> int:
    """Bytes from ``512kb``, ``1mb``, ``65536`` (binary units, as tc's ``burst``)."""
    m = re.fullmatch(r"\s*([0-9]+)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _SIZE_UNITS and m.group(2) != "":
        raise HostLayoutError(f"size {text!r}: write bytes with a unit, e.g. 512kb, 1mb, or 65536")
    return int(m.group(1)) * _SIZE_UNITS.get(m.group(2), 1)


def format_rate(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.4g} {unit}"
    return f"{bps:.4g} bit/s"
