"""The price of a two-level all-to-all across hosts against the flat one (pure; no torch).

A job of ``H`` hosts x ``L`` ranks per host (``W = H L`` ranks, rank ``r = h L + l``) runs an
all-to-all in which rank ``r`` sends ``S[r][q]`` bytes to rank ``q``. Three ways to run it:

* ``flat``: one ``all_to_all_single`` over all ``W`` ranks. Every rank sends ``L - 1`` messages within
  its host and ``(H - 1) L`` across hosts.
* ``rail`` (two-level, every rank crosses): an all-to-all within each host regroups the blocks by the
  destination's local index (rank ``(h, l)`` hands rank ``(h, l')`` every block bound for a rank of
  local index ``l'`` on any host), then an all-to-all among the ranks of one local index, one per
  host, carries each host's blocks for that index across in one message per host pair and index.
  A rank sends ``H - 1`` messages across hosts, each ``L`` blocks.
* ``leader`` (two-level, one rank per host crosses): each host's ranks gather their send buffers on
  the host's first rank, the ``H`` leaders run an all-to-all (one message per host pair, ``L^2``
  blocks), and each leader scatters what arrived to its ranks.

Both two-level schemes carry the same bytes across hosts as the flat one; they send fewer, larger
messages across hosts and add an intra-host stage (more calls, more intra-host bytes, the copies that
regroup the blocks). On one host (``H = 1``) or with one rank per host (``L = 1``) they are the flat
all-to-all (nothing to regroup), priced as such. docs/cost_model.md, "A two-level all-to-all across
hosts", has the equations; ``benchmarks/two_level.py`` measures them on the testbed.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import attrs

__all__ = ["SCHEMES", "TWO_LEVEL_SCHEMES", "A2APrices", "A2AShape", "A2APrice", "price", "flat_price",
           "two_level_price", "break_even_message_s", "prices_from_profile", "plan_note"]

#: Every scheme :func:`price` knows.
SCHEMES = ("flat", "rail", "leader")
#: The two-level schemes.
TWO_LEVEL_SCHEMES = ("rail", "leader")


def _finite_positive(inst: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{type(inst).__name__}.{attribute.name} must be a positive finite number "
                         f"(bytes/s or seconds), got {value!r}")


def _finite_non_negative(inst: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{type(inst).__name__}.{attribute.name} must be a finite number >= 0, got {value!r}")


def _count(inst: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{type(inst).__name__}.{attribute.name} must be an int >= 1, got {value!r}")


@attrs.frozen
class A2APrices:
    """What the link costs (``HardwareProfile`` fields, :func:`prices_from_profile`).

    ``intra_bw`` / ``inter_bw``: a rank's all-to-all rate within a host / across hosts with every
    rank of the host sending at once (bytes/s; ``intra_host_bw`` / ``inter_host_bw``). ``call_s``:
    the fixed cost of one collective call (``collective_latency_s``). ``intra_message_s`` /
    ``inter_message_s``: what each message a rank sends within a host / across hosts costs beyond
    its bytes (the send/receive handshake, the network's round trip, the NIC's message rate).
    ``copy_byte_s``: seconds per byte of a local regrouping copy (read and write). ``host_link_shared``:
    a host's ranks share one inter-host link (``HardwareProfile.host_link_shared``), so one rank alone
    on it gets the host's ``L inter_bw``; else each rank has its own (a leader alone gets ``inter_bw``).
    """

    intra_bw: float = attrs.field(validator=_finite_positive)
    inter_bw: float = attrs.field(validator=_finite_positive)
    call_s: float = attrs.field(validator=_finite_non_negative)
    intra_message_s: float = attrs.field(validator=_finite_non_negative)
    inter_message_s: float = attrs.field(validator=_finite_non_negative)
    copy_byte_s: float = attrs.field(validator=_finite_non_negative)
    host_link_shared: bool = attrs.field(default=False)

    @host_link_shared.validator
    def _check_shared(self, attribute: Any, value: Any) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"A2APrices.host_link_shared must be True or False, got {value!r}")


PairBytes = Union[float, Tuple[Tuple[float, ...], ...]]


def _pair_bytes(value: Any) -> PairBytes:
    if isinstance(value, (list, tuple)):
        return tuple(tuple(row) if isinstance(row, (list, tuple)) else row for row in value)
    return value


@attrs.frozen
class A2AShape:
    """The all-to-all: ``hosts`` x ``ranks_per_host`` ranks; ``pair_bytes``: the bytes each rank sends
    to each other rank (one number), or the ``W x W`` matrix ``S[sender][receiver]`` (its diagonal,
    what a rank keeps, crosses no link)."""

    hosts: int = attrs.field(validator=_count)
    ranks_per_host: int = attrs.field(validator=_count)
    pair_bytes: PairBytes = attrs.field(converter=_pair_bytes)

    @pair_bytes.validator
    def _check_bytes(self, attribute: Any, value: Any) -> None:
        w = self.world_size
        if isinstance(value, tuple):
            if len(value) != w or any(not isinstance(row, tuple) or len(row) != w for row in value):
                raise ValueError(f"A2AShape.pair_bytes must be one number or a {w} x {w} matrix "
                                 f"(hosts {self.hosts} x ranks_per_host {self.ranks_per_host} ranks)")
            cells = [x for row in value for x in row]
        else:
            cells = [value]
        for x in cells:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
                raise ValueError(f"A2AShape.pair_bytes must hold finite byte counts >= 0, got {x!r}")

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def uniform(self) -> bool:
        """Whether every rank sends every rank the same bytes (one number): priced in closed form."""
        return not isinstance(self.pair_bytes, tuple)

    def matrix(self) -> List[List[float]]:
        """``S[sender][receiver]`` (a uniform size expanded; the diagonal what a rank keeps)."""
        if isinstance(self.pair_bytes, tuple):
            return [list(map(float, row)) for row in self.pair_bytes]
        w = self.world_size
        return [[float(self.pair_bytes)] * w for _ in range(w)]


@attrs.frozen
class A2APrice:
    """One scheme's price: ``seconds`` and its parts (each the slowest rank's), the ``calls`` it
    makes, the messages a rank sends across hosts (``inter_messages``, the most of any rank) and per
    host pair and direction (``inter_messages_per_host_pair``), the bytes a rank moves within its host
    (``intra_bytes``) and on its share of the inter-host link (``inter_bytes``), and the regrouping
    copies' bytes (``copy_bytes``)."""

    scheme: str
    seconds: float
    calls: int
    inter_messages: int
    inter_messages_per_host_pair: int
    intra_bytes: float
    inter_bytes: float
    copy_bytes: float
    parts: Dict[str, float] = attrs.field(factory=dict, converter=dict)


def _host(r: int, L: int) -> int:
    return r // L


def _link(sent: Sequence[float], recv: Sequence[float], L: int, shared: bool) -> float:
    """The most bytes a rank's share of the inter-host link carries (max of sent and received); with
    a shared link each rank's share is its host's mean."""
    per_rank = [max(s, r) for s, r in zip(sent, recv)]
    if not shared:
        return max(per_rank, default=0.0)
    hosts = len(per_rank) // L
    return max((max(sum(sent[h * L:(h + 1) * L]), sum(recv[h * L:(h + 1) * L])) / L for h in range(hosts)),
               default=0.0)


def flat_price(shape: A2AShape, p: A2APrices) -> A2APrice:
    """One ``all_to_all_single`` over every rank:
    ``call_s + (L-1) intra_message_s + (H-1) L inter_message_s + max(B_intra / intra_bw, B_inter / inter_bw)``."""
    H, L = shape.hosts, shape.ranks_per_host
    W = H * L
    if shape.uniform:  # every rank sends (L-1) s within its host and (H-1) L s across
        s = float(shape.pair_bytes)
        intra, inter = (L - 1) * s, (H - 1) * L * s
    else:
        S = shape.matrix()
        si, ri, se, re = ([0.0] * W for _ in range(4))
        for a in range(W):
            for b in range(W):
                if a == b:
                    continue
                if _host(a, L) == _host(b, L):
                    si[a] += S[a][b]
                    ri[b] += S[a][b]
                else:
                    se[a] += S[a][b]
                    re[b] += S[a][b]
        intra = max((max(x, y) for x, y in zip(si, ri)), default=0.0)
        inter = _link(se, re, L, p.host_link_shared)
    messages = (L - 1) * p.intra_message_s + (H - 1) * L * p.inter_message_s
    wire = max(intra / p.intra_bw, inter / p.inter_bw)
    parts = dict(calls=p.call_s, messages=messages, bytes=wire, copies=0.0)
    return A2APrice("flat", sum(parts.values()), 1, (H - 1) * L, L * L if H > 1 else 0, intra, inter, 0.0, parts)


def _rail_loads(shape: A2AShape, p: A2APrices) -> Tuple[float, float, float]:
    """(intra, inter, copies) bytes of the slowest rank under ``rail``."""
    H, L = shape.hosts, shape.ranks_per_host
    W = H * L
    if shape.uniform:  # stage 1: H (L-1) s each way; stage 2: (H-1) L s; copies: the send buffer and the held one
        s = float(shape.pair_bytes)
        return H * (L - 1) * s, (H - 1) * L * s, 2 * W * s
    S = shape.matrix()
    # stage 1, within host h: rank (h, l) -> rank (h, l') every block bound for local index l'
    s1, r1, hold = [0.0] * W, [0.0] * W, [0.0] * W  # hold: what a rank has after stage 1
    for a in range(W):
        h, l = divmod(a, L)
        for b in range(W):
            lb = b % L
            if lb != l:
                s1[a] += S[a][b]
                r1[h * L + lb] += S[a][b]
            hold[h * L + lb] += S[a][b]
    # stage 2, among the ranks of local index l: host h -> host h' one message of L blocks
    s2, r2 = [0.0] * W, [0.0] * W
    for a in range(W):
        ha = _host(a, L)
        for b in range(W):
            hb = _host(b, L)
            if ha != hb:
                via = ha * L + b % L  # the rank of a's host holding the block after stage 1
                s2[via] += S[a][b]
                r2[b] += S[a][b]
    intra = max((max(x, y) for x, y in zip(s1, r1)), default=0.0)
    inter = _link(s2, r2, L, p.host_link_shared)
    copies = max(sum(S[a]) + hold[a] for a in range(W))  # regroup before stage 1 and before stage 2
    return intra, inter, copies


def _rail(shape: A2AShape, p: A2APrices) -> A2APrice:
    H, L = shape.hosts, shape.ranks_per_host
    intra, inter, copies = _rail_loads(shape, p)
    parts = dict(calls=2 * p.call_s, messages=(L - 1) * p.intra_message_s + (H - 1) * p.inter_message_s,
                 bytes=intra / p.intra_bw + inter / p.inter_bw, copies=copies * p.copy_byte_s)
    return A2APrice("rail", sum(parts.values()), 2, H - 1, L, intra, inter, copies, parts)


def _leader_loads(shape: A2AShape) -> Tuple[float, float, float, float]:
    """(gather, scatter, inter, copies) bytes of the busiest leader under ``leader``."""
    H, L = shape.hosts, shape.ranks_per_host
    W = H * L
    if shape.uniform:  # every rank's buffer is W s; a leader sends (H-1) L^2 s across
        s = float(shape.pair_bytes)
        return (L - 1) * W * s, (L - 1) * W * s, (H - 1) * L * L * s, 2 * L * W * s
    S = shape.matrix()
    row = [sum(S[a]) for a in range(W)]
    col = [sum(S[a][b] for a in range(W)) for b in range(W)]
    gather = max(sum(row[h * L + 1:(h + 1) * L]) for h in range(H))  # the leader receives its ranks' buffers
    scatter = max(sum(col[h * L + 1:(h + 1) * L]) for h in range(H))  # and sends them what arrived
    sent, recv = [0.0] * H, [0.0] * H
    for a in range(W):
        for b in range(W):
            ha, hb = _host(a, L), _host(b, L)
            if ha != hb:
                sent[ha] += S[a][b]
                recv[hb] += S[a][b]
    inter = max((max(x, y) for x, y in zip(sent, recv)), default=0.0)  # one rank per host on the link
    copies = max(sum(row[h * L:(h + 1) * L]) + sum(col[h * L:(h + 1) * L]) for h in range(H))
    return gather, scatter, inter, copies


def _leader(shape: A2AShape, p: A2APrices) -> A2APrice:
    H, L = shape.hosts, shape.ranks_per_host
    gather, scatter, inter, copies = _leader_loads(shape)
    inter_bw = p.inter_bw * (L if p.host_link_shared else 1)
    parts = dict(calls=3 * p.call_s, messages=2 * (L - 1) * p.intra_message_s + (H - 1) * p.inter_message_s,
                 bytes=(gather + scatter) / p.intra_bw + inter / inter_bw, copies=copies * p.copy_byte_s)
    return A2APrice("leader", sum(parts.values()), 3, H - 1, 1, max(gather, scatter), inter, copies, parts)


def two_level_price(shape: A2AShape, p: A2APrices, scheme: str = "rail") -> A2APrice:
    """The two-level all-to-all ``scheme`` (``rail`` or ``leader``); on one host or with one rank per
    host it is the flat all-to-all (:func:`flat_price`, named ``scheme``)."""
    if scheme not in TWO_LEVEL_SCHEMES:
        raise ValueError(f"two_level_price: scheme {scheme!r} is not one of {', '.join(TWO_LEVEL_SCHEMES)}")
    if shape.hosts == 1 or shape.ranks_per_host == 1:
        return attrs.evolve(flat_price(shape, p), scheme=scheme)
    return _rail(shape, p) if scheme == "rail" else _leader(shape, p)


def price(shape: A2AShape, p: A2APrices, scheme: str) -> A2APrice:
    """:func:`flat_price` for ``flat``, else :func:`two_level_price`."""
    if scheme == "flat":
        return flat_price(shape, p)
    if scheme not in SCHEMES:
        raise ValueError(f"price: scheme {scheme!r} is not one of {', '.join(SCHEMES)}")
    return two_level_price(shape, p, scheme)


def break_even_message_s(shape: A2AShape, p: A2APrices, scheme: str = "rail") -> Optional[float]:
    """The ``inter_message_s`` above which ``scheme`` is priced faster than the flat all-to-all
    (every other price as in ``p``); 0.0 where it wins already at none, None where it never wins
    (it sends no fewer messages across hosts)."""
    zero = attrs.evolve(p, inter_message_s=0.0)
    flat, two = flat_price(shape, zero), two_level_price(shape, zero, scheme)
    fewer = flat.inter_messages - two.inter_messages
    if fewer <= 0:
        return 0.0 if two.seconds < flat.seconds else None
    return max(0.0, (two.seconds - flat.seconds) / fewer)


def prices_from_profile(profile: Any, *, intra_message_s: float, inter_message_s: float) -> A2APrices:
    """:class:`A2APrices` from a ``HardwareProfile``: its ``intra_host_bw``, ``inter_host_bw``,
    ``collective_latency_s`` (per call), ``host_link_shared`` and a copy at ``hbm_bw`` (read and
    write: ``2 / hbm_bw`` per byte). The profile has no per-message price: give it."""
    return A2APrices(intra_bw=float(profile.intra_host_bw), inter_bw=float(profile.inter_host_bw),
                     call_s=float(profile.collective_latency_s), intra_message_s=intra_message_s,
                     inter_message_s=inter_message_s, copy_byte_s=2.0 / float(profile.hbm_bw),
                     host_link_shared=bool(profile.host_link_shared))


def plan_note(hosts: int, ranks_per_host: int, rank_inter_bytes: float, profile: Any) -> Optional[str]:
    """One line for a multi-host plan's rewrite notes: the ``rail`` two-level price of its output
    all-to-all against the flat one (``rank_inter_bytes``: the busiest rank's cross-host bytes, spread
    evenly over its ``(H-1) L`` cross-host peers), with no per-message cost (the profile prices calls,
    not messages), and the per-message cost above which it would win. None on one host, with one
    rank per host, or without cross-host bytes."""
    if hosts < 2 or ranks_per_host < 2 or not rank_inter_bytes > 0:
        return None
    pair = float(rank_inter_bytes) / ((hosts - 1) * ranks_per_host)
    shape = A2AShape(hosts, ranks_per_host, pair)
    p = prices_from_profile(profile, intra_message_s=0.0, inter_message_s=0.0)
    flat, rail = flat_price(shape, p), two_level_price(shape, p, "rail")
    be = break_even_message_s(shape, p, "rail")
    wins = "never" if be is None else f"above {be * 1e6:.1f} us per cross-host message"
    return (f"two-level all-to-all: not run (the runtime runs every all-to-all flat); for the output all-to-all "
            f"({pair:.0f} B per rank pair across {hosts} hosts x {ranks_per_host} ranks) it is priced "
            f"{rail.seconds * 1e3:.3f} ms against {flat.seconds * 1e3:.3f} ms flat with no per-message cost, "
            f"and would win {wins} (docs/two_level.md)")
