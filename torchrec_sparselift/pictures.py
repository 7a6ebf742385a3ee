"""Pictures of plans, calibration fits and measured steps, as PNG files.

::

    plans_png([("SparseLift", sl.prediction()), ("TorchRec", tr.prediction())], "compare.png",
              capacity=planner.memory_caps(module))          # sparselift compare --png
    plan_png(ep.prediction, segments, "plan.png")             # sparselift explain --png
    fit_png(fit_points(records), "fit.png")                   # sparselift calibrate steps --png
    fit_png(kernel_fit_points(report), "kernels.png")          # sparselift calibrate kernels --png
    timeline_png({"overlap": measured_steps(result, "overlap")}, "steps.png")
                                            # python -m torchrec_sparselift.pictures timeline

Each drawing function writes one PNG and returns what it drew, read back from the figure's own
artists (bar heights and bottoms, points, segments), so a test can check the picture shows its
inputs. matplotlib is optional: it is imported inside the drawing functions, which raise an
``ImportError`` naming ``pip install matplotlib`` when it is missing. The rest of the module (the
measured timeline's segments, :func:`measured_timeline`) needs nothing beyond the package, and
the module imports without torchrec (``calibrate kernels`` draws with it).

* :func:`plans_png`: per rank, each plan's step stacked by the terms ``sparselift explain``
  prints (compute, exposed communication, overlapped communication), the plans side by side
  (first plan left); below, each plan's per-rank device memory (and host memory where a plan
  uses any) against the per-rank capacity.
* :func:`plan_png`: one plan's per-rank bars, its memory against capacity, its modelled step
  timeline (and, given a measured attribution, measured vs predicted per sparse-path node kind).
* :func:`fit_png`: a calibration's predicted against measured time per point (a step per probe
  plan, or a kernel per record), the ``y = x`` line, each group's MAPE and the fit's in the title.
* :func:`timeline_png`: measured steps (the overlap benchmark's ``timeline_per_rank``), per rank
  the main thread's compute and waits and each collective kind in flight, hidden communication
  (in flight while the rank computes) in one colour and exposed (the rank waits for it) in
  another.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import attrs
import numpy as np

from torchrec_sparselift.cost.pipelines import PHASE_NAMES, Placed

__all__ = [
    "TERMS",
    "RankBars",
    "PlansPicture",
    "PlanPicture",
    "FitPoint",
    "FitPicture",
    "fit_points",
    "kernel_fit_points",
    "fit_png",
    "TimelineSegment",
    "MeasuredStep",
    "measured_timeline",
    "measured_steps",
    "TimelinePicture",
    "timeline_png",
    "plans_png",
    "plan_png",
    "png_size",
    "require_matplotlib",
    "main",
]

GIB = float(2 ** 30)
DPI = 110

#: The per-rank terms of a step, as ``sparselift explain`` prints them: (label, RankPrediction field).
TERMS: Tuple[Tuple[str, str], ...] = (
    ("compute", "compute_s"),
    ("exposed comm", "exposed_comm_s"),
    ("overlapped comm", "overlapped_comm_s"),
)

_TERM_COLORS = {"compute": "#4C72B0", "exposed comm": "#C44E52", "overlapped comm": "#F2B880"}
_PHASE_COLORS = {
    "input_dist": "#DD8452", "uvm_fetch": "#937860", "lookup": "#4C72B0", "output_dist": "#C44E52",
    "dense_fwd": "#55A868", "dense_bwd": "#2E7D32", "grad_dist": "#E377C2",
    "dense_fwd_indep": "#8FD19E", "dense_fwd_rest": "#55A868", "dense_bwd_rest": "#2E7D32",
    "dense_bwd_indep": "#66BB6A", "backward_update": "#8172B3", "allreduce": "#8C8C8C",
}
#: the hatch of every plan after the first (the first is solid), in order
_PLAN_HATCHES = ("", "///", "...", "xx")
#: the line style of each plan's step time, in order
_STEP_STYLES = ("-", "--", ":", "-.")
_MEMORY_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#8172B3")


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend; ``ImportError`` with the install command."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("the PNG needs matplotlib: pip install matplotlib "
                          "(or pip install 'torchrec_sparselift[plot]')") from e
    return plt


def require_matplotlib() -> None:
    """``ImportError`` naming ``pip install matplotlib`` unless matplotlib imports (a command
    checks this before its work, not after)."""
    _pyplot()


def _save(fig: Any, path: str) -> Tuple[int, int]:
    """Write ``fig`` to ``path`` at :data:`DPI`; its size in pixels."""
    size = fig.get_size_inches()
    fig.savefig(path, dpi=DPI)
    _pyplot().close(fig)
    return int(round(size[0] * DPI)), int(round(size[1] * DPI))


def png_size(path: str) -> Tuple[int, int]:
    """(width, height) in pixels of the PNG at ``path`` (its IHDR chunk); ``ValueError`` when
    the file is not a PNG."""
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        raise ValueError(f"{path} is not a PNG file")
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 2 else f"{nbytes / 2 ** 20:.1f} MiB"


def _wrap(title: str, width: int = 90) -> str:
    """Break a long title at the last comma before ``width`` characters."""
    if len(title) <= width:
        return title
    cut = title.rfind(",", 0, width)
    return title[: cut + 1] + "\n" + title[cut + 1:].strip() if cut > 0 else title


# ------------------------------------------------------------------------------------------
# per-rank bars: plans side by side, memory against capacity
# ------------------------------------------------------------------------------------------


@attrs.frozen
class RankBars:
    """One plan's bars as drawn: per stacked part (a term, or ``device``/``host`` memory) the
    bottom and height of each rank's bar, in the axis unit (ms, or GiB), read from the figure."""

    plan: str
    ranks: Tuple[int, ...]
    x: Tuple[float, ...]
    heights: Mapping[str, Tuple[float, ...]]
    bottoms: Mapping[str, Tuple[float, ...]]


@attrs.frozen
class PlansPicture:
    """What :func:`plans_png` drew: per plan the step bars (ms) and the memory bars
    (``memory_unit``: GiB, or MiB when every rank holds less than half a GiB), the step lines
    (ms), the per-rank capacity segments (``device``/``host``, in ``memory_unit``; empty without
    ``capacity``), the PNG's path and size in pixels."""

    path: str
    time: Tuple[RankBars, ...]
    memory: Tuple[RankBars, ...]
    step_ms: Mapping[str, float]
    capacity: Mapping[str, Tuple[float, ...]]
    memory_unit: str
    size_px: Tuple[int, int]


def _read_bars(container: Any) -> Tuple[Tuple[float, ...], Tuple[float, ...], Tuple[float, ...]]:
    """(centres, bottoms, heights) of a BarContainer's rectangles."""
    xs = tuple(float(r.get_x() + r.get_width() / 2) for r in container)
    return xs, tuple(float(r.get_y()) for r in container), tuple(float(r.get_height()) for r in container)


def _offsets(n: int, width: float = 0.8) -> Tuple[List[float], float]:
    """Centres (relative to a rank) and width of ``n`` bars side by side in one rank's slot."""
    w = width / n
    return [-width / 2 + w * (i + 0.5) for i in range(n)], w


def _check_plans(plans: Sequence[Tuple[str, Any]]) -> None:
    if not plans:
        raise ValueError("no plan to draw: give at least one (name, Prediction)")
    names = [n for n, _ in plans]
    if len(set(names)) != len(names):
        raise ValueError(f"plan names must differ, got {names}")
    if len(plans) > len(_PLAN_HATCHES):
        raise ValueError(f"at most {len(_PLAN_HATCHES)} plans side by side, got {len(plans)}")
    for name, p in plans:
        if not getattr(p, "per_rank", ()):
            raise ValueError(f"plan {name!r} has no per-rank prediction to draw")


def _time_bars(ax: Any, plans: Sequence[Tuple[str, Any]]) -> Tuple[List[RankBars], Dict[str, float]]:
    """Per rank, each plan's stacked terms side by side, and each plan's step time as a line."""
    offs, w = _offsets(len(plans))
    drawn, steps = [], {}
    top = 0.0
    for i, (name, p) in enumerate(plans):
        per = sorted(p.per_rank, key=lambda r: r.rank)
        ranks = [r.rank for r in per]
        x = np.array(ranks, dtype=float) + offs[i]
        bottom = np.zeros(len(per))
        heights, bottoms = {}, {}
        for term, field in TERMS:
            h = np.array([getattr(r, field) for r in per]) * 1e3
            bc = ax.bar(x, h, w * 0.92, bottom=bottom, color=_TERM_COLORS[term], hatch=_PLAN_HATCHES[i],
                        edgecolor="white" if i else "none", linewidth=0.0,
                        alpha=0.75 if term == "overlapped comm" else 1.0)
            _, b, hh = _read_bars(bc)
            heights[term], bottoms[term] = hh, b
            bottom = bottom + h
        drawn.append(RankBars(name, tuple(ranks), tuple(float(v) for v in x), heights, bottoms))
        step = p.step_time_s * 1e3
        line = ax.axhline(step, color="black", ls=_STEP_STYLES[i], lw=1.2)
        steps[name] = float(line.get_ydata()[0])
        top = max(top, step, float(bottom.max()))
    ax.set_ylim(0, 1.12 * top if top > 0 else 1.0)
    ax.set_ylabel("ms per step")
    return drawn, steps


def _term_legend(plans: Sequence[Tuple[str, Any]]) -> Tuple[List[Any], List[str]]:
    """Legend entries of the terms some rank of some plan has."""
    plt = _pyplot()
    handles, labels = [], []
    for term, field in TERMS:
        if any(getattr(r, field) > 0 for _n, p in plans for r in p.per_rank):
            handles.append(plt.Rectangle((0, 0), 1, 1, color=_TERM_COLORS[term]))
            labels.append(term + (" (hidden behind compute)" if term == "overlapped comm" else ""))
    return handles, labels


def _plan_legend(ax: Any, plans: Sequence[Tuple[str, Any]], steps: Mapping[str, float]) -> None:
    """The terms, which bar is which plan, and each plan's step line."""
    plt = _pyplot()
    handles, labels = _term_legend(plans)
    for i, (name, _p) in enumerate(plans):
        if len(plans) > 1:
            where = ("left" if i == 0 else "right") if len(plans) == 2 else f"bar {i + 1}"
            handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="#BBBBBB", hatch=_PLAN_HATCHES[i],
                                         edgecolor="white" if i else "#BBBBBB"))
            labels.append(f"{name}: {where} bars")
        handles.append(plt.Line2D([0], [0], color="black", ls=_STEP_STYLES[i], lw=1.2))
        labels.append(f"{name} step {steps[name]:.3f} ms")
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
              title="each rank's embedding work (the step line\nadds the dense part and fixed per-step work)",
              title_fontsize=8, alignment="left")


def _rank_ticks(ax: Any, ranks: Sequence[int]) -> None:
    ranks = sorted(set(ranks))
    if len(ranks) <= 32:
        ax.set_xticks(ranks)
    ax.set_xlim(min(ranks) - 0.6, max(ranks) + 0.6)
    ax.set_xlabel("rank")


def _memory_unit(plans: Sequence[Tuple[str, Any]]) -> Tuple[str, float]:
    """GiB, or MiB when no rank of any plan holds half a GiB."""
    peak = max(max(r.hbm_bytes, r.ddr_bytes) for _n, p in plans for r in p.per_rank)
    return ("GiB", GIB) if peak >= GIB / 2 else ("MiB", float(2 ** 20))


def _memory_bars(ax: Any, plans: Sequence[Tuple[str, Any]], field: str, caps: Optional[np.ndarray],
                 what: str, unit: Tuple[str, float]) -> Tuple[List[RankBars], Tuple[float, ...]]:
    """Per rank, each plan's ``field`` bytes side by side (in ``unit``), with the per-rank capacity."""
    plt = _pyplot()
    uname, scale = unit
    offs, w = _offsets(len(plans))
    drawn = []
    top = 0.0
    handles, labels = [], []
    for i, (name, p) in enumerate(plans):
        per = sorted(p.per_rank, key=lambda r: r.rank)
        ranks = [r.rank for r in per]
        x = np.array(ranks, dtype=float) + offs[i]
        h = np.array([getattr(r, field) for r in per], dtype=float) / scale
        color = _MEMORY_COLORS[i % len(_MEMORY_COLORS)]
        bc = ax.bar(x, h, w * 0.92, color=color, hatch=_PLAN_HATCHES[i], edgecolor="white" if i else "none",
                    linewidth=0.0)
        _, b, hh = _read_bars(bc)
        drawn.append(RankBars(name, tuple(ranks), tuple(float(v) for v in x), {what: hh}, {what: b}))
        top = max(top, float(h.max()) if len(h) else 0.0)
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor=color, hatch=_PLAN_HATCHES[i],
                                     edgecolor="white" if i else color))
        labels.append(f"{name}: peak {float(h.max()):.2f} {uname}")
    drawn_caps: Tuple[float, ...] = ()
    ranks = sorted({r for d in drawn for r in d.ranks})
    if caps is not None:
        caps = np.asarray(caps, dtype=float)
        if len(caps) < len(ranks):
            raise ValueError(f"{what} capacity lists {len(caps)} ranks, the plans {len(ranks)}")
        cap = caps[: len(ranks)] / scale
        peak_share = top / float(cap.min()) if cap.min() > 0 else math.inf
        segs = ax.hlines(cap, np.array(ranks) - 0.45, np.array(ranks) + 0.45, colors="black", lw=1.6)
        drawn_caps = tuple(float(s[0][1]) for s in segs.get_segments())
        same = np.allclose(cap, cap[0])
        cap_txt = _size(cap[0] * scale) if same else f"{_size(cap.min() * scale)}-{_size(cap.max() * scale)}"
        cap_txt += " per rank"
        who = "the plan" if len(plans) == 1 else "the plans"
        if peak_share >= 0.25:  # capacity within reach: show it on the axis
            ax.set_ylim(0, 1.3 * max(top, float(cap.max())))
            cap_label = f"capacity {who} may fill: {cap_txt} (peak use {peak_share:.0%})"
        else:  # far above the bars: keep the bars readable, say where the capacity is
            ax.set_ylim(0, 1.45 * top if top > 0 else 1.0)
            cap_label = f"capacity {who} may fill: {cap_txt}, above the axis (peak use {peak_share:.1%})"
        handles.append(plt.Line2D([0], [0], color="black", lw=1.6))
        labels.append(cap_label)
    else:
        ax.set_ylim(0, 1.45 * top if top > 0 else 1.0)
    ax.set_ylabel(f"{what} memory, {uname}")
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
              title=f"{what} memory per rank", title_fontsize=8, alignment="left")
    return drawn, drawn_caps


def plans_png(plans: Sequence[Tuple[str, Any]], path: str, capacity: Optional[Tuple[Any, Any]] = None,
              title: str = "") -> PlansPicture:
    """Draw ``plans`` (``(name, Prediction)`` pairs, at most four, each with ``per_rank``) side by
    side per rank: the step stacked by :data:`TERMS` with each plan's step time as a line; below,
    each plan's device memory per rank and (when a plan uses host memory) its host memory, each
    against ``capacity`` (``(device bytes per rank, host bytes per rank)``, e.g.
    ``SparseLiftPlanner.memory_caps(module)``; None: no capacity). The first plan is solid and
    left, the others hatched to its right. Writes ``path``; returns what was drawn."""
    _check_plans(plans)
    plt = _pyplot()
    uses_host = any(r.ddr_bytes > 0 for _n, p in plans for r in p.per_rank)
    n_ranks = max(len(p.per_rank) for _n, p in plans)
    rows = 3 if uses_host else 2
    width = max(11.0, min(24.0, 7.5 + 0.55 * n_ranks * len(plans)))
    fig, axes = plt.subplots(rows, 1, figsize=(width, 3.6 * rows + 0.6), sharex=True,
                             gridspec_kw={"height_ratios": [3] + [2] * (rows - 1)})
    time_bars, steps = _time_bars(axes[0], plans)
    _plan_legend(axes[0], plans, steps)
    fig.suptitle(_wrap(title or "per-rank step, " + " vs ".join(n for n, _ in plans), 110), fontsize=10)
    caps = capacity if capacity is not None else (None, None)
    unit = _memory_unit(plans)
    mem, cap_drawn = _memory_bars(axes[1], plans, "hbm_bytes", caps[0], "device", unit)
    cap_out = {"device": cap_drawn}
    if uses_host:
        host, host_caps = _memory_bars(axes[2], plans, "ddr_bytes", caps[1], "host", unit)
        mem = [attrs.evolve(d, heights={**d.heights, **h.heights}, bottoms={**d.bottoms, **h.bottoms})
               for d, h in zip(mem, host)]
        cap_out["host"] = host_caps
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    _rank_ticks(axes[-1], [r for d in time_bars for r in d.ranks])
    fig.tight_layout()
    size = _save(fig, path)
    return PlansPicture(path, tuple(time_bars), tuple(mem), steps,
                        {k: v for k, v in cap_out.items() if v}, unit[0], size)


# ------------------------------------------------------------------------------------------
# one plan: bars and the modelled step timeline (sparselift explain --png)
# ------------------------------------------------------------------------------------------


@attrs.frozen
class PlanPicture:
    """What :func:`plan_png` drew: the per-rank bars (ms), the timeline's segments as
    ``(lane, phase, start ms, duration ms, critical)``, the comparison rows as
    ``(kind, measured ms, predicted ms or None)``, per memory panel (``device``, ``host``) each
    rank's bar and capacity in ``memory_unit`` (empty without ``capacity``), the PNG's path and
    size in pixels."""

    path: str
    bars: RankBars
    step_ms: float
    segments: Tuple[Tuple[str, str, float, float, bool], ...]
    comparison: Tuple[Tuple[str, float, Optional[float]], ...]
    memory: Mapping[str, Tuple[float, ...]]
    capacity: Mapping[str, Tuple[float, ...]]
    memory_unit: str
    size_px: Tuple[int, int]


def plan_png(prediction: Any, segments: Sequence[Placed], path: str, title: str = "",
             comparison: Optional[Sequence[Any]] = None,
             capacity: Optional[Tuple[Any, Any]] = None) -> PlanPicture:
    """Write a PNG of one plan: per-rank bars stacked by :data:`TERMS` (the step time and lower
    bound as lines); with ``capacity`` (``(device bytes per rank, host bytes per rank)``), each
    rank's device memory (and host memory where the plan uses any) against it; the modelled
    timeline of one step (``segments``, from :func:`torchrec_sparselift.explain.step_timeline`:
    critical segments outlined, hidden ones faded). ``comparison`` (rows of
    :func:`torchrec_sparselift.calibration.attribution.compare`: ``kind``, ``measured_ms``,
    ``predicted_ms``) adds a panel of measured vs predicted ms per sparse-path node kind.
    Returns what was drawn."""
    _check_plans([("plan", prediction)])
    plt = _pyplot()
    per = list(prediction.per_rank)
    rows3 = [r for r in (comparison or ()) if r.kind != "step"]
    mem_rows = []
    if capacity is not None:
        mem_rows.append(("hbm_bytes", capacity[0], "device"))
        if any(r.ddr_bytes > 0 for r in per):
            mem_rows.append(("ddr_bytes", capacity[1], "host"))
    ratios = [3] + [2] * len(mem_rows) + [2] + ([3] if rows3 else [])
    fig, axes = plt.subplots(len(ratios), 1, figsize=(max(11.0, min(24.0, 0.25 * len(per) + 9.5)),
                                                      1.0 + 1.5 * sum(ratios)),
                             gridspec_kw={"height_ratios": ratios})
    ax1 = axes[0]
    ax2 = axes[1 + len(mem_rows)]
    memory: Dict[str, Tuple[float, ...]] = {}
    memory_caps: Dict[str, Tuple[float, ...]] = {}
    unit = _memory_unit([("plan", prediction)])
    for ax, (field, caps, what) in zip(axes[1:], mem_rows):
        drawn_mem, drawn_caps = _memory_bars(ax, [("plan", prediction)], field, caps, what, unit)
        memory[what], memory_caps[what] = drawn_mem[0].heights[what], drawn_caps
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        _rank_ticks(ax, [r.rank for r in per])
    bars, steps = _time_bars(ax1, [("plan", prediction)])
    if prediction.lower_bound_s > 0:
        ax1.axhline(prediction.lower_bound_s * 1e3, color="black", ls=":", lw=1)
    plt_handles, labels = _term_legend([("plan", prediction)])
    plt_handles.append(plt.Line2D([0], [0], color="black", lw=1.2))
    labels.append(f"step {prediction.step_time_s * 1e3:.3f} ms")
    if prediction.lower_bound_s > 0:
        plt_handles.append(plt.Line2D([0], [0], color="black", ls=":", lw=1))
        labels.append(f"lower bound {prediction.lower_bound_s * 1e3:.3f} ms")
    ax1.legend(plt_handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
               title="each rank's embedding work (the step line\nadds the dense part and fixed per-step work)",
               title_fontsize=8, alignment="left")
    ax1.set_title(_wrap(title or "per-rank breakdown", 100), fontsize=10)
    ax1.grid(axis="y", alpha=0.3)
    ax1.set_axisbelow(True)
    _rank_ticks(ax1, [r.rank for r in per])

    lanes: List[str] = []
    for s in segments:
        if s.lane not in lanes:
            lanes.append(s.lane)
    drawn_segments = []
    for s in segments:
        y = lanes.index(s.lane)
        bc = ax2.barh(y, s.duration_s * 1e3, left=s.start_s * 1e3, height=0.6,
                      color=_PHASE_COLORS.get(s.phase, "#777777"), alpha=1.0 if s.critical else 0.45,
                      edgecolor="black" if s.critical else "none", lw=0.8)
        r = bc[0]
        drawn_segments.append((s.lane, s.phase, float(r.get_x()), float(r.get_width()), bool(s.critical)))
    total = max((s.end_s for s in segments if s.critical), default=0.0) or max((s.end_s for s in segments),
                                                                              default=0.0)
    for s in segments:
        if s.duration_s > 0.0105 * len(s.phase) * max(total, 1e-15):  # the label fits in the bar
            ax2.text((s.start_s + s.duration_s / 2) * 1e3, lanes.index(s.lane), s.phase,
                     ha="center", va="center", fontsize=7)
    ax2.set_yticks(range(len(lanes)))
    ax2.set_yticklabels(lanes)
    ax2.invert_yaxis()
    ax2.set_xlabel("ms from step start (outlined: critical path; faded: hidden by overlap)")
    ax2.set_title("one steady-state step, modelled", fontsize=10)
    present = [p for p in PHASE_NAMES if any(s.phase == p for s in segments)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=_PHASE_COLORS.get(p, "#777777")) for p in present]
    ax2.legend(handles, present, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
               title="phases", title_fontsize=8, alignment="left", ncol=2 if len(present) > 6 else 1)
    drawn_rows: List[Tuple[str, float, Optional[float]]] = []
    if rows3:
        ax3 = axes[-1]
        y = np.arange(len(rows3))
        meas = ax3.barh(y - 0.2, [r.measured_ms for r in rows3], height=0.4, color="#C44E52",
                        label="measured (profiler, slowest rank)")
        predicted = any(r.predicted_ms is not None for r in rows3)
        pred = None
        if predicted:
            pred = ax3.barh(y + 0.2, [r.predicted_ms or 0.0 for r in rows3], height=0.4, color="#4C72B0",
                            label="predicted (cost model)")
        for i, r in enumerate(rows3):
            drawn_rows.append((r.kind, float(meas[i].get_width()),
                               float(pred[i].get_width()) if pred is not None and r.predicted_ms is not None
                               else None))
        ax3.set_yticks(y)
        ax3.set_yticklabels([r.kind for r in rows3], fontsize=8)
        ax3.invert_yaxis()
        ax3.axvline(0, color="black", lw=0.6)
        ax3.set_xlabel("ms per step")
        ax3.set_title("measured vs predicted per sparse-path node kind", fontsize=10)
        ax3.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    size = _save(fig, path)
    return PlanPicture(path, bars[0], steps["plan"], tuple(drawn_segments), tuple(drawn_rows), memory,
                       memory_caps, unit[0], size)


# ------------------------------------------------------------------------------------------
# calibration fit: predicted vs measured per probe plan
# ------------------------------------------------------------------------------------------


@attrs.frozen
class FitPoint:
    """One probe plan of a calibration: its measured step and the fitted profile's prediction
    (``before_s``: the base profile's, None when not known)."""

    label: str
    group: str
    measured_s: float
    predicted_s: float
    before_s: Optional[float] = None

    def __attrs_post_init__(self) -> None:
        for name in ("measured_s", "predicted_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"probe plan {self.label!r}: {name} must be a positive time, got {v!r}")


def fit_points(records: Sequence[Any]) -> Tuple[FitPoint, ...]:
    """The probe records of a step calibration (:class:`~torchrec_sparselift.calibration.records.ProbeRecord`:
    ``workload``, ``plan``, ``measured_s``, ``predicted_before_s``, ``predicted_after_s``) as points."""
    return tuple(FitPoint(f"{r.workload}/{r.plan}", r.workload, float(r.measured_s), float(r.predicted_after_s),
                          float(r.predicted_before_s)) for r in records)


def kernel_fit_points(report: Any) -> Tuple[FitPoint, ...]:
    """A kernel calibration's records under its fitted profile
    (:class:`~torchrec_sparselift.calibration.kernel_fit.CalibrationReport`'s ``points``: family,
    label, predicted and measured seconds) as points, one group per family."""
    return tuple(FitPoint(f"{family}: {label}", family, measured, predicted)
                 for family, label, predicted, measured in report.points)


def _mape(pred: Sequence[float], meas: Sequence[float]) -> float:
    return sum(abs(p - m) / m for p, m in zip(pred, meas)) / len(meas)


@attrs.frozen
class FitPicture:
    """What :func:`fit_png` drew: the fitted points as (measured ms, predicted ms), the base
    profile's where given, the MAPE in the title (a fraction) and each group's in the legend,
    the title, path and size."""

    path: str
    points_ms: Tuple[Tuple[float, float], ...]
    before_ms: Tuple[Tuple[float, float], ...]
    mape: float
    group_mape: Mapping[str, float]
    title: str
    size_px: Tuple[int, int]


def fit_png(points: Sequence[FitPoint], path: str, title: str = "", what: str = "probe plans",
            quantity: str = "step") -> FitPicture:
    """Predicted against measured time per point (``what``: probe plans, each a ``quantity`` of
    step; one colour per group, with its MAPE), the ``y = x`` line with a +-10% band, the base
    profile's predictions as hollow grey markers (when the points carry them), the three worst
    points named; the fit's MAPE in the title. Log axes when the times span more than a factor
    of 8. Writes ``path``; returns what was drawn."""
    if not points:
        raise ValueError(f"no {what} to draw: the calibration fit has no records")
    plt = _pyplot()
    meas = np.array([p.measured_s for p in points]) * 1e3
    pred = np.array([p.predicted_s for p in points]) * 1e3
    before = [p for p in points if p.before_s is not None and p.before_s > 0]
    mape = _mape(pred, meas)
    fig, ax = plt.subplots(figsize=(7.5, 6.8))
    everything = list(meas) + list(pred) + [p.before_s * 1e3 for p in before]
    lo, hi = min(everything), max(everything)
    log = hi / lo > 8
    pad = (hi / lo) ** 0.06 if log else 0.06 * (hi - lo or hi)
    lo, hi = (lo / pad, hi * pad) if log else (max(0.0, lo - pad), hi + pad)
    line = np.array([lo, hi])
    ax.plot(line, line, color="black", lw=1, label="predicted = measured")
    ax.fill_between(line, line * 0.9, line * 1.1, color="#CCCCCC", alpha=0.4, lw=0, label="within 10%")
    before_drawn: Tuple[Tuple[float, float], ...] = ()
    if before:
        bm = np.array([p.measured_s for p in before]) * 1e3
        bp = np.array([p.before_s for p in before]) * 1e3
        sc = ax.scatter(bm, bp, s=36, facecolors="none", edgecolors="#888888", lw=1.0,
                        label=f"base profile (MAPE {_mape(bp, bm):.1%})")
        before_drawn = tuple((float(a), float(b)) for a, b in sc.get_offsets())
    groups = list(dict.fromkeys(p.group for p in points))
    cmap = plt.get_cmap("tab10")
    drawn: Dict[int, Tuple[float, float]] = {}
    group_mape: Dict[str, float] = {}
    size = 42 if len(points) <= 60 else 18
    for gi, g in enumerate(groups):
        idx = [i for i, p in enumerate(points) if p.group == g]
        group_mape[g] = _mape(pred[idx], meas[idx])
        sc = ax.scatter(meas[idx], pred[idx], s=size, color=cmap(gi % 10), edgecolors="black", lw=0.5, zorder=3,
                        label=f"{g}: {len(idx)}, MAPE {group_mape[g]:.1%}")
        for i, (a, b) in zip(idx, sc.get_offsets()):
            drawn[i] = (float(a), float(b))
    worst = sorted(range(len(points)), key=lambda i: -abs(pred[i] - meas[i]) / meas[i])[:3]
    for i in worst:
        ape = (pred[i] - meas[i]) / meas[i]
        ax.annotate(f"{points[i].label} {ape:+.0%}", (meas[i], pred[i]), textcoords="offset points",
                    xytext=(6, -10 if pred[i] < meas[i] else 6), fontsize=7, color="#333333",
                    bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.85},
                    arrowprops={"arrowstyle": "-", "color": "#777777", "lw": 0.6}, zorder=4)
    if log:  # plain numbers at 1, 2, 5 x 10^k: ms a reader can read off
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
            axis.set_minor_formatter(NullFormatter())
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal", adjustable="box")
    ax.set_xlabel(f"measured {quantity}, ms")
    ax.set_ylabel(f"predicted {quantity}, ms")
    full = (title + ": " if title else "calibration fit: ") + f"MAPE {mape:.1%} over {len(points)} {what}"
    ax.set_title(_wrap(full, 70), fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left", framealpha=0.9)
    fig.tight_layout()
    size_px = _save(fig, path)
    return FitPicture(path, tuple(drawn[i] for i in range(len(points))), before_drawn, mape, group_mape, full,
                      size_px)


# ------------------------------------------------------------------------------------------
# measured timeline: hidden and exposed communication (the overlap benchmark's timeline)
# ------------------------------------------------------------------------------------------

#: main-thread regions of a measured step, in the priority a moment is labelled by
_REGIONS = (("bottom MLP fwd", "dense_fwd_start", "dense_fwd_end"),
            ("bottom MLP bwd", "dense_bwd_start", "dense_bwd_end"),
            ("optimizer", "opt_start", "opt_end"),
            ("backward", "backward_start", "backward_end"))
_MAIN_COLORS = {"forward": "#4C72B0", "backward": "#8172B3", "bottom MLP fwd": "#64B5CD",
                "bottom MLP bwd": "#2E7D32", "optimizer": "#937860", "after backward": "#B0A3D4",
                "waiting": "#E6E6E6"}
_STATE_COLORS = {"hidden": "#55A868", "exposed": "#C44E52"}
_COMM_ORDER = ("input_dist", "output_dist", "grad_dist", "allreduce", "other")


@attrs.frozen
class TimelineSegment:
    """A stretch of a measured step on one lane (ms from the step's start). Lane ``main`` is the
    rank's main thread (``what``: a compute region or ``waiting``); a collective kind's lane holds
    its collectives in flight (``what``: ``hidden`` while the rank computes, ``exposed`` while it
    waits for that kind)."""

    lane: str
    what: str
    start_ms: float
    end_ms: float

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


@attrs.frozen
class MeasuredStep:
    """One rank's measured step as segments, with per collective kind the ms hidden and exposed
    (their sum: the ms during which some collective of the kind is in flight, within the step)."""

    step_ms: float
    segments: Tuple[TimelineSegment, ...]
    comm_ms: Mapping[str, Tuple[float, float]]  # kind -> (hidden, exposed)

    @property
    def hidden_ms(self) -> float:
        return sum(h for h, _e in self.comm_ms.values())

    @property
    def exposed_ms(self) -> float:
        return sum(e for _h, e in self.comm_ms.values())


def _union(intervals: Sequence[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[List[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _split(a: float, b: float, cover: Sequence[Tuple[float, float]]) -> Tuple[List[Tuple[float, float]],
                                                                              List[Tuple[float, float]]]:
    """[a, b] as (parts outside ``cover``, parts inside it); ``cover`` sorted and disjoint."""
    inside, outside, t = [], [], a
    for c, d in cover:
        if d <= t or c >= b:
            continue
        if c > t:
            outside.append((t, c))
        inside.append((max(t, c), min(b, d)))
        t = min(b, d)
    if t < b:
        outside.append((t, b))
    return outside, inside


def measured_timeline(events: Sequence[Sequence[Any]]) -> MeasuredStep:
    """One rank's step as segments, from its events: ``(ms, what, kind)`` as the overlap
    benchmark stores them (``timeline_per_rank``), or ``(ms, what, kind, id)`` with the
    collective's id (:class:`~torchrec_sparselift.runtime.overlap.CommTimeline`'s events, times
    in ms from the step's start). The step runs from ``step_start`` to ``step_end`` (else the
    first to the last event).

    A collective is in flight from its ``issue`` to its ``done`` (paired by id; without ids, in
    order per kind: gloo runs one process group's collectives in order); one done before any
    issue in the step was issued in the step before (in flight from the start), one issued but
    not done is in flight to the end. A kind is in flight while any of its collectives is (two
    at once count once: the ids' and the lengths' all-to-alls of one input_dist). The rank waits from each ``wait_start`` to its
    ``wait_end``, and for the all-reduce from ``graph_done`` to ``backward_end`` (where DDP waits
    for it), as :func:`~torchrec_sparselift.runtime.overlap.step_attribution` counts it. A
    collective's time in flight is *exposed* while the rank waits for its kind and *hidden* the
    rest. The main thread is ``waiting`` during any wait, else computing: in the bottom MLP's
    forward or backward, the optimizer, the backward, and the rest ``forward`` before the
    backward, ``after backward`` after it."""
    evs = sorted(((float(e[0]), str(e[1]), str(e[2]) if len(e) > 2 else "", e[3] if len(e) > 3 else None)
                  for e in events), key=lambda e: e[0])
    if not evs:
        raise ValueError("an empty step: no events to draw")
    t0 = next((t for t, w, _k, _c in evs if w == "step_start"), evs[0][0])
    t1 = next((t for t, w, _k, _c in reversed(evs) if w == "step_end"), evs[-1][0])
    if t1 <= t0:
        raise ValueError(f"the step ends ({t1} ms) before it starts ({t0} ms)")
    flights: Dict[str, List[Tuple[float, float]]] = {}
    open_by_id: Dict[Any, Tuple[str, float]] = {}
    open_fifo: Dict[str, List[float]] = {}
    waits: Dict[str, List[Tuple[float, float]]] = {}
    wait_by_id: Dict[Any, float] = {}
    wait_fifo: Dict[str, List[float]] = {}
    marks: Dict[str, float] = {}
    for t, what, kind, cid in evs:
        t = min(max(t, t0), t1)
        if what == "issue":
            if cid is not None:
                open_by_id[cid] = (kind, t)
            else:
                open_fifo.setdefault(kind, []).append(t)
        elif what == "done":
            if cid is not None:
                start = open_by_id.pop(cid, (kind, t0))[1]
            else:
                q = open_fifo.get(kind, [])
                start = q.pop(0) if q else t0
            flights.setdefault(kind, []).append((start, t))
        elif what == "wait_start":
            if cid is not None:
                wait_by_id[cid] = t
            else:
                wait_fifo.setdefault(kind, []).append(t)
        elif what == "wait_end":
            if cid is not None:
                start = wait_by_id.pop(cid, None)
            else:
                q = wait_fifo.get(kind, [])
                start = q.pop(0) if q else None
            if start is not None:
                waits.setdefault(kind, []).append((start, t))
        else:
            marks.setdefault(what, t)
    for kind, t in open_by_id.values():
        flights.setdefault(kind, []).append((t, t1))
    for kind, q in open_fifo.items():
        flights.setdefault(kind, []).extend((t, t1) for t in q)
    if "graph_done" in marks and "backward_end" in marks:
        waits.setdefault("allreduce", []).append((marks["graph_done"], marks["backward_end"]))
    segments: List[TimelineSegment] = []
    comm: Dict[str, Tuple[float, float]] = {}
    kinds = sorted(flights, key=lambda k: (_COMM_ORDER.index(k) if k in _COMM_ORDER else len(_COMM_ORDER), k))
    for kind in kinds:
        cover = _union(waits.get(kind, []))
        hidden = exposed = 0.0
        for a, b in _union(flights[kind]):  # one kind's collectives in flight at once count once
            out, inside = _split(a, b, cover)
            for c, d in out:
                segments.append(TimelineSegment(kind, "hidden", c - t0, d - t0))
                hidden += d - c
            for c, d in inside:
                segments.append(TimelineSegment(kind, "exposed", c - t0, d - t0))
                exposed += d - c
        comm[kind] = (hidden, exposed)
    waiting = _union([w for ws in waits.values() for w in ws])
    regions = [(name, marks[a], marks[b]) for name, a, b in _REGIONS if a in marks and b in marks]
    cuts = sorted({t0, t1, *(x for w in waiting for x in w), *(x for _n, a, b in regions for x in (a, b))})
    main: List[TimelineSegment] = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if b <= a or a < t0 or b > t1:
            continue
        mid = (a + b) / 2
        if any(c <= mid < d for c, d in waiting):
            what = "waiting"
        else:
            rest = "after backward" if "backward_end" in marks and mid >= marks["backward_end"] else "forward"
            what = next((n for n, c, d in regions if c <= mid < d), rest)
        if main and main[-1].what == what and abs(main[-1].end_ms - (a - t0)) < 1e-12:
            main[-1] = attrs.evolve(main[-1], end_ms=b - t0)
        else:
            main.append(TimelineSegment("main", what, a - t0, b - t0))
    return MeasuredStep(t1 - t0, tuple(main + segments), comm)


def measured_steps(report: Mapping[str, Any], kind: str) -> Tuple[MeasuredStep, ...]:
    """Every rank's measured step of pipeline ``kind`` from an overlap benchmark report (one
    regime's result, with ``timeline_per_rank[rank][kind]``). ``ValueError`` naming the kinds
    the report holds when ``kind`` is not one of them."""
    per_rank = report.get("timeline_per_rank")
    if not per_rank:
        raise ValueError("the report has no timeline_per_rank: write one with benchmarks/overlap.py --worker --out FILE")
    missing = [r for r, t in enumerate(per_rank) if kind not in (t or {})]
    if missing:
        have = sorted({k for t in per_rank for k in (t or {})})
        raise ValueError(f"no timeline of pipeline {kind!r} on rank(s) {missing}: the report holds {have}")
    return tuple(measured_timeline(t[kind]) for t in per_rank)


@attrs.frozen
class TimelinePicture:
    """What :func:`timeline_png` drew: per panel (pipeline) and rank, the segments as
    ``(lane, what, start ms, duration ms)`` read from the figure; path and size in pixels."""

    path: str
    panels: Tuple[str, ...]
    segments: Tuple[Tuple[Tuple[Tuple[str, str, float, float], ...], ...], ...]  # [panel][rank]
    size_px: Tuple[int, int]


def timeline_png(steps: Mapping[str, Sequence[MeasuredStep]], path: str, title: str = "") -> TimelinePicture:
    """Measured steps, one panel per pipeline (``steps``: pipeline name -> each rank's
    :class:`MeasuredStep`, e.g. :func:`measured_steps`), sharing the time axis: per rank the main
    thread (compute regions, waits in light grey) and one lane per collective kind, hidden
    communication green and exposed red; each panel's title gives the step and the hidden and
    exposed ms (mean of ranks). Writes ``path``; returns what was drawn."""
    if not steps or not all(steps.values()):
        raise ValueError("no measured step to draw: give each pipeline's steps, one per rank")
    plt = _pyplot()
    names = list(steps)
    lanes_per = []
    for name in names:
        kinds = []
        for s in steps[name]:
            for seg in s.segments:
                if seg.lane != "main" and seg.lane not in kinds:
                    kinds.append(seg.lane)
        kinds.sort(key=lambda k: (_COMM_ORDER.index(k) if k in _COMM_ORDER else len(_COMM_ORDER), k))
        lanes_per.append([(r, lane) for r in range(len(steps[name])) for lane in ["main"] + kinds])
    heights = [max(2.0, 0.32 * len(lanes) + 1.2) for lanes in lanes_per]
    fig, axes = plt.subplots(len(names), 1, figsize=(11.0, sum(heights) + 1.0), sharex=True,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    drawn_all = []
    longest = max(s.step_ms for name in names for s in steps[name])
    for ax, name, lanes in zip(axes[:, 0], names, lanes_per):
        drawn_ranks = []
        for r, s in enumerate(steps[name]):
            drawn = []
            for seg in s.segments:
                y = lanes.index((r, seg.lane))
                color = _MAIN_COLORS[seg.what] if seg.lane == "main" else _STATE_COLORS[seg.what]
                bc = ax.barh(y, seg.duration_ms, left=seg.start_ms, height=0.72 if seg.lane == "main" else 0.56,
                             color=color, edgecolor="#999999" if seg.what == "waiting" else "none", lw=0.5)
                rect = bc[0]
                drawn.append((seg.lane, seg.what, float(rect.get_x()), float(rect.get_width())))
            ax.axvline(s.step_ms, ymin=0, ymax=1, color="black", lw=0.6, ls=":")
            drawn_ranks.append(tuple(drawn))
        drawn_all.append(tuple(drawn_ranks))
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels([f"rank {r}  " + ("main thread" if lane == "main" else lane) for r, lane in lanes],
                           fontsize=8)
        for i in range(1, len(steps[name])):  # a rule between ranks
            ax.axhline(lanes.index((i, "main")) - 0.5, color="#555555", lw=0.8)
        ax.set_ylim(len(lanes) - 0.5, -0.5)
        n = len(steps[name])
        step = sum(s.step_ms for s in steps[name]) / n
        hid = sum(s.hidden_ms for s in steps[name]) / n
        exp = sum(s.exposed_ms for s in steps[name]) / n
        ax.set_title(f"{name}: step {step:.1f} ms; communication hidden {hid:.1f} ms, exposed {exp:.1f} ms "
                     "(mean of ranks)", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    axes[-1, 0].set_xlim(0, longest * 1.01)
    axes[-1, 0].set_xlabel("ms from the step's start (dotted: the step's end)")
    order = ["forward", "bottom MLP fwd", "backward", "bottom MLP bwd", "after backward", "optimizer", "waiting"]
    present = {seg.what for name in names for s in steps[name] for seg in s.segments}
    handles = [plt.Rectangle((0, 0), 1, 1, color=_STATE_COLORS[k]) for k in ("hidden", "exposed")]
    labels = ["communication hidden (rank computes)", "communication exposed (rank waits)"]
    for k in order:
        if k in present:
            handles.append(plt.Rectangle((0, 0), 1, 1, facecolor=_MAIN_COLORS[k],
                                         edgecolor="#999999" if k == "waiting" else _MAIN_COLORS[k]))
            labels.append(("main thread " + k) if k == "waiting" else k)
    fig.legend(handles, labels, loc="lower center", ncol=max(2, (len(handles) + 1) // 2), fontsize=8, frameon=False)
    if title:
        fig.suptitle(_wrap(title, 110), fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    size = _save(fig, path)
    return TimelinePicture(path, tuple(names), tuple(drawn_all), size)


# ------------------------------------------------------------------------------------------
# command: draw the overlap benchmark's measured timeline
# ------------------------------------------------------------------------------------------


def _regime(report: Mapping[str, Any], regime: Optional[str]) -> Tuple[str, Mapping[str, Any]]:
    """The one regime's result in an overlap report: the worker's own JSON, or the driver's with
    ``regimes``."""
    if "timeline_per_rank" in report:
        return str(report.get("link", "")), report
    regimes = report.get("regimes")
    if not isinstance(regimes, Mapping) or not regimes:
        raise ValueError("not an overlap benchmark report: neither timeline_per_rank nor regimes in it")
    if regime is None:
        if len(regimes) > 1:
            raise ValueError(f"the report holds regimes {sorted(regimes)}: choose one with --regime")
        regime = next(iter(regimes))
    if regime not in regimes:
        raise ValueError(f"no regime {regime!r} in the report: it holds {sorted(regimes)}")
    return regime, regimes[regime]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m torchrec_sparselift.pictures timeline REPORT.json --png OUT.png``: draw the
    overlap benchmark's measured steps (exit 0; 2 on bad input, with the reason)."""
    p = argparse.ArgumentParser(prog="python -m torchrec_sparselift.pictures",
                                description="Draw a measured timeline of hidden and exposed communication.")
    sub = p.add_subparsers(dest="what", metavar="timeline")
    t = sub.add_parser("timeline", help="the overlap benchmark's measured steps, per rank",
                       description="Draw the measured steps an overlap benchmark report holds "
                       "(timeline_per_rank: one steady step per pipeline and rank).")
    t.add_argument("report", help="JSON written by benchmarks/overlap.py (--worker --out, or the driver's --out)")
    t.add_argument("--png", required=True, metavar="FILE", help="where to write the picture")
    t.add_argument("--kinds", default="sparse_dist,overlap", metavar="K1,K2",
                   help="pipelines to draw, one panel each (default sparse_dist,overlap)")
    t.add_argument("--regime", default=None, help="which regime of a driver's report (e.g. 1gbit)")
    t.add_argument("--title", default=None, help="the picture's title (default: the ranks, the link and the file)")
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.what != "timeline":
        p.print_help()
        return 2
    try:
        with open(args.report) as f:
            report = json.load(f)
        regime, result = _regime(report, args.regime)
        kinds = [k for k in args.kinds.split(",") if k]
        if not kinds:
            raise ValueError("--kinds names no pipeline")
        steps = {k: measured_steps(result, k) for k in kinds}
        world = len(next(iter(steps.values())))
        where = f", link {regime}" if regime and regime != "?" else ""
        timeline_png(steps, args.png, title=args.title or f"measured steady step, {world} ranks{where} ({args.report})")
    except (OSError, ValueError) as e:
        print(f"python -m torchrec_sparselift.pictures timeline: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"python -m torchrec_sparselift.pictures timeline: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
