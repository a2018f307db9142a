"""Inline SVG charts for the dashboard: no JavaScript, no external assets.

Each builder is a pure function of its data and returns ``Markup`` (safe to place in
a template as is). Every piece of text that came from outside (class names, regions,
instance types, job names) goes through ``escape`` here, because ``Markup`` tells the
template not to escape again: forgetting it would let a job name inject markup.
Hover text uses SVG ``<title>`` elements, which browsers show as native tooltips.
Colours are presentation attributes, not ``style=``, so the page's CSP can forbid
inline styles.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from markupsafe import Markup, escape

from orchestrator.domain.failures import FailureClass
from orchestrator.domain.protocol import ORDER

#: One colour per restart-protocol step, in protocol order.
STEP_COLOURS: dict[str, str] = dict(
    zip(
        (str(s) for s in ORDER),
        ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1"),
        strict=True,
    )
)
#: Time inside an incident that no protocol step covers (waiting between steps).
GAP_COLOUR = "#c9c9c9"

_CLASS_PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#393b79", "#ad494a", "#637939", "#8c6d31", "#843c39", "#7b4173",
    "#5254a3", "#6b6ecf", "#9c9ede", "#cedb9c",
)  # fmt: skip
# Not strict: the taxonomy may grow past the palette; a new class must still get a colour.
CLASS_COLOURS: dict[str, str] = {
    str(c): _CLASS_PALETTE[i % len(_CLASS_PALETTE)] for i, c in enumerate(FailureClass)
}
_SERIES_PALETTE = (*_CLASS_PALETTE[:8], "#aaaaaa")


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 172_800:
        return f"{seconds / 3600:.2f} h"
    return f"{seconds / 86_400:.1f} d"


def class_colour(name: str) -> str:
    return CLASS_COLOURS.get(name, CLASS_COLOURS["unknown"])


def _n(x: float) -> str:
    """A coordinate: short, and never an exponent form SVG would not parse."""
    return f"{x:.2f}".rstrip("0").rstrip(".")


def _rect(x: float, y: float, w: float, h: float, fill: str, title: str, cls: str = "") -> str:
    c = f' class="{cls}"' if cls else ""
    return (
        f'<rect x="{_n(x)}" y="{_n(y)}" width="{_n(max(w, 0.0))}" height="{_n(h)}" '
        f'fill="{fill}"{c}><title>{escape(title)}</title></rect>'
    )


def _text(x: float, y: float, s: str, anchor: str = "start", cls: str = "") -> str:
    c = f' class="{cls}"' if cls else ""
    return f'<text x="{_n(x)}" y="{_n(y)}" text-anchor="{anchor}"{c}>{escape(s)}</text>'


def _clipped_label(x: float, y: float, s: str, max_chars: int) -> str:
    """A right-aligned label cut to ``max_chars`` (the whole of it in the tooltip)."""
    shown = s if len(s) <= max_chars else s[: max_chars - 1] + "\u2026"
    return (
        f'<text x="{_n(x)}" y="{_n(y)}" text-anchor="end" class="label">'
        f"<title>{escape(s)}</title>{escape(shown)}</text>"
    )


def _svg(width: float, height: float, body: list[str], label: str, chart_id: str) -> Markup:
    return Markup(
        f'<svg xmlns="http://www.w3.org/2000/svg" id="{chart_id}" class="chart" '
        f'viewBox="0 0 {_n(width)} {_n(height)}" width="{_n(width)}" height="{_n(height)}" '
        f'role="img" aria-label="{escape(label)}">' + "".join(body) + "</svg>"
    )


def _legend(items: Sequence[tuple[str, str]], x: float, y: float, width: float) -> list[str]:
    """Swatches left to right, wrapping at ``width``; returns the SVG parts."""
    out, cx, cy = [], x, y
    for label, colour in items:
        w = 16 + 7 * len(label)
        if cx + w > x + width and cx > x:
            cx, cy = x, cy + 16
        out.append(_rect(cx, cy - 9, 10, 10, colour, label))
        out.append(_text(cx + 14, cy, label, cls="legend"))
        cx += w + 10
    return out


def _legend_height(items: Sequence[tuple[str, str]], width: float) -> float:
    rows, cx = 1, 0.0
    for label, _ in items:
        w = 16 + 7 * len(label)
        if cx + w > width and cx > 0:
            rows, cx = rows + 1, 0.0
        cx += w + 10
    return rows * 16


@dataclass(frozen=True)
class MttrRow:
    label: str
    mttr_seconds: float
    step_seconds: Mapping[str, float]
    ongoing: bool = False


def mttr_chart(rows: Sequence[MttrRow], width: int = 760) -> Markup:
    """One stacked horizontal bar per incident: the seconds of each protocol step in
    order, then (grey) any part of the MTTR no step covers. Bars share one scale so
    incidents compare at a glance."""
    label_w, bar_h, gap, top = 190.0, 18.0, 8.0, 6.0
    plot_w = width - label_w - 100  # room for "27.8 min so far" after the longest bar
    longest = max((max(r.mttr_seconds, sum(r.step_seconds.values())) for r in rows), default=0)
    scale = plot_w / longest if longest > 0 else 0.0
    body: list[str] = []
    y = top
    for r in rows:
        body.append(_clipped_label(label_w - 8, y + bar_h - 5, r.label, 27))
        x = label_w
        for step in STEP_COLOURS:
            s = r.step_seconds.get(step)
            if s is None:
                continue
            w = s * scale
            body.append(
                _rect(x, y, w, bar_h, STEP_COLOURS[step], f"{step}: {format_duration(s)}", "seg")
            )
            x += w
        uncovered = r.mttr_seconds - sum(r.step_seconds.values())
        if uncovered > 0.05:
            body.append(
                _rect(
                    x,
                    y,
                    uncovered * scale,
                    bar_h,
                    GAP_COLOUR,
                    f"between steps: {format_duration(uncovered)}",
                    "seg",
                )
            )
            x += uncovered * scale
        total = format_duration(r.mttr_seconds) + (" so far" if r.ongoing else "")
        body.append(_text(x + 6, y + bar_h - 5, total, cls="value"))
        y += bar_h + gap
    legend = [*STEP_COLOURS.items(), ("between steps", GAP_COLOUR)]
    y += 10
    body += _legend(legend, label_w, y, plot_w + 60)
    height = y + _legend_height(legend, plot_w + 60) + 4
    return _svg(width, height, body, "MTTR by restart-protocol step", "mttr-chart")


def split_bar(parts: Sequence[tuple[str, float, str]], width: int = 760) -> Markup:
    """The job's wall time as one bar: (label, seconds, colour) parts."""
    total = sum(s for _, s, _ in parts)
    h, body, x = 22.0, [], 0.0
    for label, seconds, colour in parts:
        if seconds <= 0 or total <= 0:
            continue
        w = width * seconds / total
        share = seconds / total
        body.append(
            _rect(x, 0, w, h, colour, f"{label}: {format_duration(seconds)} ({share:.1%})", "seg")
        )
        x += w
    legend = [(label, colour) for label, _, colour in parts]
    body += _legend(legend, 0, h + 16, width)
    return _svg(width, h + 12 + _legend_height(legend, width), body, "wall time", "split-bar")


@dataclass(frozen=True)
class Span:
    start: datetime
    end: datetime
    label: str
    colour: str
    title: str


def timeline(
    attempts: Sequence[Span],
    incidents: Sequence[Span],
    start: datetime,
    end: datetime,
    width: int = 760,
) -> Markup:
    """Attempts on one lane, incidents (detection to validated relaunch) on another,
    over the job's wall time."""
    left, lane_h, top = 80.0, 22.0, 4.0
    plot_w = width - left - 10
    span = max((end - start).total_seconds(), 1e-9)

    def x(d: datetime) -> float:
        return left + plot_w * min(max((d - start).total_seconds() / span, 0.0), 1.0)

    body = [
        _text(left - 8, top + lane_h - 7, "attempts", "end", "label"),
        _text(left - 8, top + 2 * lane_h + 4 - 7, "incidents", "end", "label"),
        _rect(left, top, plot_w, lane_h, "#f4f4f4", "no attempt up (idle)"),
        _rect(left, top + lane_h + 4, plot_w, lane_h, "#f4f4f4", "no incident"),
    ]
    for a in attempts:
        x0, x1 = x(a.start), x(a.end)
        body.append(_rect(x0, top, x1 - x0, lane_h, a.colour, a.title, "attempt"))
        if x1 - x0 > 7 * len(a.label) + 6:
            body.append(_text(x0 + 4, top + lane_h - 7, a.label, cls="onbar"))
    for i in incidents:
        x0, x1 = x(i.start), x(i.end)
        w = max(x1 - x0, 2.0)  # a short incident is still visible
        body.append(_rect(x0, top + lane_h + 4, w, lane_h, i.colour, i.title, "incident"))
    axis_y = top + 2 * lane_h + 20
    for k in range(5):
        t = start + timedelta(seconds=span * k / 4)
        anchor = "start" if k == 0 else "end" if k == 4 else "middle"
        body.append(_text(left + plot_w * k / 4, axis_y, t.strftime("%m-%d %H:%M"), anchor, "axis"))
    return _svg(width, axis_y + 6, body, "job timeline", "timeline")


def stacked_columns(
    buckets: Sequence[datetime],
    series: Mapping[str, Sequence[int]],
    colours: Mapping[str, str],
    bucket_label: str,
    chart_id: str,
    label: str,
    width: int = 860,
) -> Markup:
    """Counts per time bucket, stacked by series (a class, or a region/instance type)."""
    left, top, plot_h = 36.0, 8.0, 180.0
    plot_w = width - left - 10
    n = max(len(buckets), 1)
    totals = [sum(v[i] for v in series.values()) for i in range(len(buckets))]
    # Whole-number gridlines: counts are integers, "0.5 incidents" reads as a bug.
    tick = max(1, -(-max(totals, default=0) // 4))
    peak = 4 * tick
    slot = plot_w / n
    bar_w = max(slot * 0.8, 1.0)
    body: list[str] = []
    for k in range(5):
        y = top + plot_h - plot_h * k / 4
        body.append(
            f'<line x1="{_n(left)}" y1="{_n(y)}" x2="{_n(left + plot_w)}" y2="{_n(y)}" '
            'class="grid"/>'
        )
        body.append(_text(left - 4, y + 4, str(k * tick), "end", "axis"))
    for i, b in enumerate(buckets):
        y = top + plot_h
        x = left + i * slot + (slot - bar_w) / 2
        for name, counts in series.items():
            c = counts[i]
            if not c:
                continue
            h = plot_h * c / peak
            y -= h
            title = f"{b.strftime('%Y-%m-%d')} ({bucket_label}): {name}: {c}"
            body.append(_rect(x, y, bar_w, h, colours[name], title, "seg"))
    step = max(1, n // 8)
    for i in range(0, len(buckets), step):
        body.append(
            _text(
                left + i * slot + slot / 2,
                top + plot_h + 16,
                buckets[i].strftime("%m-%d"),
                "middle",
                "axis",
            )
        )
    legend = [(name, colours[name]) for name in series]
    body += _legend(legend, left, top + plot_h + 38, plot_w)
    height = top + plot_h + 30 + _legend_height(legend, plot_w) + 4
    return _svg(width, height, body, label, chart_id)


def series_colours(names: Sequence[str]) -> dict[str, str]:
    """Colours for at most 9 series (the caller folds the rest into one)."""
    return {n: _SERIES_PALETTE[i % len(_SERIES_PALETTE)] for i, n in enumerate(names)}


@dataclass(frozen=True)
class Band:
    """A mark on a time axis: an incident (start to end) or a checkpoint (end None)."""

    start: datetime
    end: datetime | None
    kind: str
    label: str


#: Incident bands and checkpoint lines on the run's time-series charts.
INCIDENT_FILL = "#f6c9c9"
CHECKPOINT_STROKE = "#59a14f"


def line_chart(
    series: Mapping[str, Sequence[tuple[datetime, float]]],
    start: datetime,
    end: datetime,
    marks: Sequence[Band],
    chart_id: str,
    label: str,
    unit: str = "",
    width: int = 860,
) -> Markup:
    """One polyline per series (a rank, or the mean of many) over ``start..end``, with
    each point a small circle (its value in the tooltip), incidents as red bands and
    checkpoints as green lines on the same axis. Empty series: an empty plot that says
    so, never a blank space."""
    left, top, plot_h = 56.0, 8.0, 150.0
    plot_w = width - left - 10
    span = max((end - start).total_seconds(), 1e-9)
    values = [v for pts in series.values() for _, v in pts]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    floor = 0.0 if lo >= 0 else None  # rates, losses, norms: never an axis below zero
    if hi - lo < 1e-12:
        lo, hi = lo - max(abs(lo) * 0.5, 0.5), hi + max(abs(hi) * 0.5, 0.5)
    pad = (hi - lo) * 0.05
    lo, hi = lo - pad, hi + pad
    if floor is not None:
        lo = max(lo, floor)

    def x(d: datetime) -> float:
        return left + plot_w * min(max((d - start).total_seconds() / span, 0.0), 1.0)

    def y(v: float) -> float:
        return top + plot_h - plot_h * (v - lo) / (hi - lo)

    body: list[str] = []
    for m in marks:
        if m.kind == "incident":
            x0 = x(m.start)
            x1 = x(m.end) if m.end else left + plot_w
            body.append(_rect(x0, top, max(x1 - x0, 2.0), plot_h, INCIDENT_FILL, m.label, "mark"))
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        gy = y(v)
        body.append(
            f'<line x1="{_n(left)}" y1="{_n(gy)}" x2="{_n(left + plot_w)}" y2="{_n(gy)}" '
            'class="grid"/>'
        )
        body.append(_text(left - 4, gy + 4, f"{v:.3g}", "end", "axis"))
    for m in marks:
        if m.kind == "checkpoint":
            cx = x(m.start)
            body.append(
                f'<line x1="{_n(cx)}" y1="{_n(top)}" x2="{_n(cx)}" y2="{_n(top + plot_h)}" '
                f'stroke="{CHECKPOINT_STROKE}" class="mark"><title>{escape(m.label)}</title></line>'
            )
    colours = series_colours(list(series))
    for name, pts in series.items():
        if not pts:
            continue
        coords = " ".join(f"{_n(x(t))},{_n(y(v))}" for t, v in pts)
        body.append(
            f'<polyline points="{coords}" fill="none" stroke="{colours[name]}" '
            f'stroke-width="1.5" class="line"><title>{escape(name)}</title></polyline>'
        )
        for t, v in pts:
            body.append(
                f'<circle cx="{_n(x(t))}" cy="{_n(y(v))}" r="2" fill="{colours[name]}" '
                f'class="point"><title>{escape(name)} {t.strftime("%H:%M:%S")}: '
                f"{v:.4g}{escape(unit)}</title></circle>"
            )
    if not values:
        body.append(_text(left + plot_w / 2, top + plot_h / 2, "no samples yet", "middle", "axis"))
    for k in range(5):
        t = start + timedelta(seconds=span * k / 4)
        anchor = "start" if k == 0 else "end" if k == 4 else "middle"
        body.append(
            _text(left + plot_w * k / 4, top + plot_h + 16, t.strftime("%H:%M:%S"), anchor, "axis")
        )
    legend = [(n, colours[n]) for n in series] + [
        ("incident", INCIDENT_FILL),
        ("checkpoint", CHECKPOINT_STROKE),
    ]
    body += _legend(legend, left, top + plot_h + 38, plot_w)
    height = top + plot_h + 30 + _legend_height(legend, plot_w) + 4
    return _svg(width, height, body, label, chart_id)
