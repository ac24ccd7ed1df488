"""``rankwatch report --html``: one self-contained HTML file for a run summary and/or incident verdicts.

The file is meant to be attached to a ticket or mailed, then opened anywhere, offline: CSS is inline,
charts are SVG drawn here, and there is no JavaScript at all. A Content-Security-Policy forbids every
fetch and script, so even a mistake in escaping cannot make the page load or run anything. Every value
shown comes from rank records, stacks and logs (attacker-influenced text such as exception messages),
so all of it passes through ``esc``: control, bidi and format characters replaced and the length bounded
(``core.text.clean``), then ``html.escape``. The file is owner-only (stacks reveal code paths) and
written to a temp file and renamed, so a reader never sees half a report.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rankwatch.hooks.files import atomic_write

from ..core.phases import COMPUTE_PHASES, DISPLAY_ORDER, INPUT_PHASES, SYNC_PHASES
from ..core.ranks import fmt_ranks
from ..core.schema import CONFIDENCES, SUMMARY_SCHEMA, VERDICT_SCHEMA, headline_of
from ..core.text import BLOCK, PROSE, clean
from ..errors import UserError
from .text import int_ranks, next_step

# Canonical phases keep one colour in every report, so readers learn them; input warm, compute cool,
# the two kinds of waiting for peers muted but told apart (purple: a collective the script called, pink:
# DDP's gradient all-reduce), time outside any phase pale grey. No two phases share a colour.
PHASE_COLOURS = {
    "dataloader": "#f28e2b",
    "forward": "#4e79a7",
    "backward": "#76b7b2",
    "optimizer": "#59a14f",
    "collective": "#b07aa1",
    "grad_sync": "#ff9da7",
    "idle": "#d9d9d9",
}
EXTRA_COLOURS = ("#edc948", "#9c755f", "#8cd17d", "#86bcb6", "#f1ce63", "#a0cbe8", "#e6a157", "#6f9bd1")
# the order phases are listed and stacked in charts (not core.snapshot.STEP_PHASE_ORDER, the rule order)
DISPLAY_PHASE_ORDER = DISPLAY_ORDER
STRAGGLER = "#d62728"
RANK_COLOURS = ("#4e79a7", "#59a14f", "#76b7b2", "#edc948", "#b07aa1", "#9c755f", "#f28e2b", "#86bcb6",
                "#8cd17d", "#a0cbe8", "#ff9da7", "#bab0ac")
# at most this many ranks get their own legend entry and colour in the timeline; beyond it they are
# one grey crowd and only stragglers stand out
LEGEND_RANKS = len(RANK_COLOURS)
GROUPS_MAX_BYTES = 512 * 1024  # stacks/groups.txt is small; a huge one is cut rather than bloat the page

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d1d1f;background:#f6f6f4}
main{max-width:1040px;margin:0 auto;padding:24px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px}h3{font-size:15px;margin:20px 0 6px}
section.doc{background:#fff;border:1px solid #ddd;border-radius:8px;padding:18px 22px;margin:18px 0}
.headline{font-size:19px;font-weight:650;margin:4px 0}
.bad{color:#b3141b}.ok{color:#1b7a2f}.slow{color:#8a5a00}
.context{font-size:15px;font-weight:500;color:#444;margin:4px 0}.meta{color:#666;font-size:13px}
.why{background:#fbf7e8;border-left:4px solid #e0c34b;padding:8px 12px;margin:10px 0}
.badge{display:inline-block;border-radius:10px;padding:1px 9px;font-size:12px;font-weight:600;margin-left:6px}
.conf-high{background:#d9f2de;color:#145c25}.conf-medium{background:#fbeccb;color:#7a5300}
.conf-low{background:#eee;color:#555}
table{border-collapse:collapse;margin:6px 0;font-size:13px}
th,td{border-bottom:1px solid #e5e5e5;padding:3px 10px;text-align:right;vertical-align:top}
th{background:#f1f1ef;font-weight:600}td.l,th.l{text-align:left}
tr.hl td{background:#fde8e8;font-weight:600}
pre{background:#f3f3f1;border:1px solid #e0e0e0;padding:10px;overflow:auto;font-size:12px;max-height:520px}
code{font-size:12px}svg{max-width:100%;height:auto;display:block}
svg text{font-family:system-ui,sans-serif;font-size:11px;fill:#333}
.legend span{display:inline-block;margin-right:14px;font-size:12px}
.sw{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:4px;vertical-align:-1px}
nav a{margin-right:12px}ul{margin:6px 0;padding-left:22px}
"""


def esc(value: object, limit: int = PROSE) -> str:
    """Cleaned (no control, bidi or format characters; bounded: ``core.text``), then HTML-escaped."""
    return html.escape(clean(value, limit), quote=True)


def _num(value: object) -> float | None:
    """A finite number from a JSON field, or None (documents may be partial or hand-edited)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def _fmt(value: object, digits: int = 1) -> str:
    n = _num(value)
    return "–" if n is None else f"{n:.{digits}f}"


def _dict(doc: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def _int_key(key: str) -> tuple[int, str]:
    try:
        return int(key), key
    except ValueError:
        return 1 << 30, key


def phase_colours(phases: Iterable[str]) -> dict[str, str]:
    out = {}
    extra = 0
    for p in phases:
        if p in PHASE_COLOURS:
            out[p] = PHASE_COLOURS[p]
        else:
            out[p] = EXTRA_COLOURS[extra % len(EXTRA_COLOURS)]
            extra += 1
    return out


def ordered_phases(names: Iterable[str]) -> list[str]:
    """Canonical phases in step order, then declared phases by name."""
    names = set(names)
    return [p for p in DISPLAY_PHASE_ORDER if p in names] + sorted(names - set(DISPLAY_PHASE_ORDER))


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """Round axis ticks (1, 2, 5 × 10^k) from 0 to at least ``top``."""
    if top <= 0:
        return [0.0, 1.0]
    raw = top / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    n = math.ceil(top / step - 1e-9)
    return [i * step for i in range(n + 1)]


def _tick_label(v: float) -> str:
    return f"{v:g}" if abs(v) < 1e5 else f"{v:.0e}"


def _legend(items: Sequence[tuple[str, str]]) -> str:
    return '<div class="legend">' + "".join(
        f'<span><i class="sw" style="background:{c}"></i>{esc(label)}</span>' for label, c in items
    ) + "</div>"


# -- summary --------------------------------------------------------------------------------------------
def phase_bars_svg(ranks: Mapping[str, Any], stragglers: set[int], colours: Mapping[str, str]) -> str:
    """Stacked horizontal bars: each rank's mean ms per step in each phase (they add up to its mean step),
    straggler ranks highlighted."""
    keys = sorted(ranks, key=_int_key)
    if not keys:
        return '<p class="meta">no per-rank data</p>'
    phases = list(colours)
    totals = {k: sum(_num(ranks[k].get("phases", {}).get(p)) or 0.0 for p in phases) for k in keys}
    ticks = nice_ticks(max(totals.values(), default=0.0))
    top = ticks[-1] or 1.0
    row = 22 if len(keys) <= 32 else 12 if len(keys) <= 128 else 6
    left, right, head, foot = 96, 20, 8, 30  # room for "rank 1234 ◀"
    width = 860
    plot_w = width - left - right
    height = head + row * len(keys) + foot
    parts = [f'<svg viewBox="0 0 {width} {height}" width="{width}" '
             f'height="{height}" role="img" aria-label="mean milliseconds per step in each phase, per rank">']
    for t in ticks:
        x = left + plot_w * t / top
        parts.append(f'<line x1="{x:.1f}" y1="{head}" x2="{x:.1f}" y2="{head + row * len(keys)}" stroke="#e3e3e3"/>')
        parts.append(f'<text x="{x:.1f}" y="{head + row * len(keys) + 14}" text-anchor="middle">'
                     f"{_tick_label(t)}</text>")
    parts.append(f'<text x="{left + plot_w / 2:.0f}" y="{height - 3}" text-anchor="middle">'
                 "mean ms per step, by phase</text>")
    for i, k in enumerate(keys):
        y = head + i * row
        is_straggler = _int_key(k)[0] in stragglers
        if is_straggler:
            parts.append(f'<rect x="0" y="{y}" width="{width}" height="{row}" fill="#fde8e8"/>')
        if row >= 10:
            weight = ' font-weight="700" style="fill:#b3141b"' if is_straggler else ""
            label = f"rank {k}" + (" ◀" if is_straggler else "")
            parts.append(
                f'<text x="{left - 6}" y="{y + row / 2 + 4:.1f}" text-anchor="end"{weight}>{esc(label)}</text>'
            )
        x = float(left)
        for p in phases:
            ms = _num(ranks[k].get("phases", {}).get(p)) or 0.0
            if ms <= 0:
                continue
            w = plot_w * ms / top
            stroke = f' stroke="{STRAGGLER}" stroke-width="1.5"' if is_straggler else ""
            parts.append(
                f'<rect x="{x:.2f}" y="{y + 2}" width="{w:.2f}" height="{max(row - 4, 2)}" fill="{colours[p]}"{stroke}>'
                f"<title>rank {esc(k)} · {esc(p)}: {ms:.1f} ms</title></rect>"
            )
            x += w
    parts.append("</svg>")
    return "".join(parts)


# the values of a timeline point [step, step ms, own work ms, wait ms], by name
TIMELINE_SERIES = {"step": 1, "own": 2, "wait": 3}


def timeline_svg(timeline: Mapping[str, Any], stragglers: set[int], series_name: str = "step",
                 y_label: str = "step time (ms)") -> str:
    """One value per step and rank over the run (``series_name``: the step time, the rank's own work, or
    its wait for peers): one polyline per rank, stragglers drawn last in red."""
    col = TIMELINE_SERIES[series_name]
    series: dict[str, list[tuple[float, float]]] = {}
    for key in sorted(timeline, key=_int_key):
        pts = []
        for item in timeline[key] if isinstance(timeline[key], list) else []:
            if isinstance(item, list | tuple) and len(item) > col and len(item) <= 8:
                s, ms = _num(item[0]), _num(item[col])
                if s is not None and ms is not None:
                    pts.append((s, ms))
        # step 0 carries start-up costs (imports, warm-up, compile) that would flatten every later step
        later = [pt for pt in pts if pt[0] > 0]
        if pts:
            series[key] = later or pts
    all_pts = [pt for pts in series.values() for pt in pts]
    if not all_pts:
        return '<p class="meta">no per-step timeline in this summary</p>'
    s_lo = min(p[0] for p in all_pts)
    s_hi = max(p[0] for p in all_pts)
    ticks_y = nice_ticks(max(p[1] for p in all_pts))
    y_top = ticks_y[-1] or 1.0
    x_span = (s_hi - s_lo) or 1.0
    x_step = nice_ticks(x_span, 6)[1]
    ticks_x = [t * x_step for t in range(math.ceil(s_lo / x_step), math.floor(s_hi / x_step) + 1)] or [s_lo]
    left, right, head, foot, width, height = 62, 20, 10, 34, 860, 300
    pw, ph = width - left - right, height - head - foot

    def xy(s: float, ms: float) -> str:
        return f"{left + pw * (s - s_lo) / x_span:.1f},{head + ph * (1 - ms / y_top):.1f}"

    parts = [f'<svg viewBox="0 0 {width} {height}" width="{width}" '
             f'height="{height}" role="img" aria-label="{esc(y_label)} per rank">']
    for t in ticks_y:
        y = head + ph * (1 - t / y_top)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" stroke="#e3e3e3"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_tick_label(t)}</text>')
    for t in ticks_x:
        x = left + pw * (t - s_lo) / x_span
        parts.append(f'<text x="{x:.1f}" y="{head + ph + 16}" text-anchor="middle">{_tick_label(t)}</text>')
    parts.append(f'<text x="{left + pw / 2:.0f}" y="{height - 3}" text-anchor="middle">step</text>')
    parts.append(f'<text x="12" y="{head + ph / 2:.0f}" transform="rotate(-90 12 {head + ph / 2:.0f})" '
                 f'text-anchor="middle">{esc(y_label)}</text>')
    keys = list(series)
    index = {k: i for i, k in enumerate(keys)}
    many = len(keys) > LEGEND_RANKS
    order = sorted(keys, key=lambda k: _int_key(k)[0] in stragglers)  # stragglers on top
    for k in order:
        pts = series[k]
        is_straggler = _int_key(k)[0] in stragglers
        colour = STRAGGLER if is_straggler else "#9aa5b1" if many else RANK_COLOURS[index[k] % len(RANK_COLOURS)]
        width_px, opacity = (2.4, 1.0) if is_straggler else (1.2, 0.55 if many else 0.85)
        points = " ".join(xy(s, ms) for s, ms in pts) if len(pts) > 1 else (xy(*pts[0]) + " " + xy(*pts[0]))
        parts.append(
            f'<polyline class="rank" data-series="{series_name}" data-rank="{esc(k)}" points="{points}" '
            f'fill="none" stroke="{colour}" '
            f'stroke-width="{width_px}" stroke-opacity="{opacity}" stroke-linejoin="round">'
            f"<title>rank {esc(k)}</title></polyline>"
        )
    parts.append("</svg>")
    if many:
        items = [(f"rank {k} (straggler)", STRAGGLER) for k in keys if _int_key(k)[0] in stragglers]
        items.append((f"other ranks ({len(keys) - len(items)})", "#9aa5b1"))
    else:
        items = [(f"rank {k}" + (" (straggler)" if _int_key(k)[0] in stragglers else ""),
                  STRAGGLER if _int_key(k)[0] in stragglers else RANK_COLOURS[i % len(RANK_COLOURS)])
                 for i, k in enumerate(keys)]
    return "".join(parts) + _legend(items)


def _family(phase: str | None) -> str:
    if phase in INPUT_PHASES:
        return "input"
    if phase in SYNC_PHASES:
        return "waiting for peers"
    if phase in COMPUTE_PHASES:
        return "compute"
    return "declared" if phase else ""


def summary_section(doc: Mapping[str, Any], anchor: str, incident_anchors: Mapping[str, str]) -> str:
    who = int_ranks(doc.get("straggler_ranks") or [])
    stragglers = set(who)
    ranks = _dict(doc, "ranks")
    phases_doc = _dict(doc, "phases")
    names = ordered_phases(
        set(phases_doc) | {p for r in ranks.values() if isinstance(r, dict) for p in (r.get("phases") or {})}
    )
    colours = phase_colours(names)
    out = [
        f'<section class="doc summary" id="{esc(anchor)}">',
        f"<h2>Run summary · job {esc(doc.get('job_id'))}</h2>",
        *_summary_headlines(doc, who, incident_anchors),
        "<h3>Time per step by rank and phase</h3>",
        phase_bars_svg({k: v for k, v in ranks.items() if isinstance(v, dict)}, stragglers, colours),
        _legend([(p, colours[p]) for p in names]),
        *_phase_table(doc, colours),
        *_rank_table(ranks, names, stragglers),
        *_timeline_part(doc.get("timeline"), stragglers),
        *_incident_list(doc, incident_anchors),
        "</section>",
    ]
    return "\n".join(out)


def _summary_headlines(doc: Mapping[str, Any], who: list[int], incident_anchors: Mapping[str, str]) -> list[str]:
    """The run's incidents first, then the straggler diagnosis, its step counts and why."""
    label = str(doc.get("diagnosis") or "NO DIAGNOSIS")
    phase = doc.get("phase")
    st = _dict(doc, "step_time_ms")
    verdicts = [v for v in doc.get("incident_verdicts") or [] if isinstance(v, dict)]
    # a run with an incident is that incident first; the straggler diagnosis describes the steps before it
    # a straggler is a slowdown, an incident a stopped job: the steps before an incident are told in a
    # calmer style than its headline ("before the incident: COMMUNICATION-BOUND" is context, not alarm)
    slow = bool(who) or "STRAGGLER" in label
    tone = "before" if verdicts or doc.get("incidents") else "slow" if slow else "ok"
    headline = esc(label)
    if who:
        headline += f" — {esc(fmt_ranks(who))}"
    if phase:
        headline += f" in <code>{esc(phase)}</code>"
    total = doc.get("steps_total")
    out = []
    for v in verdicts[:8]:
        v_ranks = int_ranks(v.get("initiating_ranks") or [])
        v_who = fmt_ranks(v_ranks) if v_ranks else "no single rank"
        v_head = f"{esc(headline_of(str(v.get('kind'))))} — initiating {esc(v_who)}"
        if v.get("phase"):
            v_head += f" in phase <code>{esc(v.get('phase'))}</code>"
        link = incident_anchors.get(str(v.get("incident_id")))
        out.append(f'<p class="headline bad">{v_head}'
                   + (f' · <a href="#{esc(link)}">incident</a>' if link else "") + "</p>")
    out += [
        f'<p class="{"context" if tone == "before" else "headline " + tone}">'
        + ("before the incident: " if verdicts else "") + f"{headline}</p>",
        '<p class="meta">' + (f"{esc(total)} steps · " if total is not None else "")
        + f'the last {esc(doc.get("steps"))} common steps compared · {len(_dict(doc, "ranks"))} ranks · mean step '
        f'{_fmt(st.get("mean", st.get("median")))} ms · worst {_fmt(st.get("worst"))} ms '
        f'(rank {esc(st.get("worst_rank"))})</p>',
    ]
    if doc.get("why"):
        out.append(f'<div class="why"><b>why:</b> {esc(doc["why"])}</div>')
    cause = doc.get("cause")
    if isinstance(cause, dict) and isinstance(cause.get("cause"), str):
        # why the straggler (or, on a job held in communication, the rank whose path is slow) is slow, measured
        # from outside it (core.straggler_cause): the same line as the text summary's, then what to do next
        out.append(f'<div class="why cause"><b>cause:</b> <code>{esc(cause["cause"])}</code> — '
                   f'{esc(cause.get("text", ""))}</div>')
        if cause.get("next"):
            out.append(f'<div class="why"><b>next:</b> {esc(cause["next"])}</div>')
    return out


def _phase_table(doc: Mapping[str, Any], colours: Mapping[str, str]) -> list[str]:
    """Per phase, the ranks' mean/median/worst/skew (the diagnosed phase highlighted), then the step."""
    phases_doc = _dict(doc, "phases")
    st = _dict(doc, "step_time_ms")
    phase = doc.get("phase")
    out = ["<h3>Phases</h3>",
           '<table><tr><th class="l">phase</th><th class="l">kind</th><th>mean ms</th><th>median ms</th>'
           "<th>worst ms</th><th>worst rank</th><th>skew ms</th></tr>"]
    for p in sorted(phases_doc, key=lambda q: -(_num(_dict(phases_doc, q).get("mean_ms")) or 0.0)):
        s = phases_doc[p] if isinstance(phases_doc[p], dict) else {}
        cls = ' class="hl"' if p == phase else ""
        out.append(
            f'<tr{cls}><td class="l"><i class="sw" style="background:{colours.get(p, "#ccc")}"></i>{esc(p)}</td>'
            f'<td class="l">{esc(_family(p))}</td><td>{_fmt(s.get("mean_ms"))}</td><td>{_fmt(s.get("median_ms"))}</td>'
            f'<td>{_fmt(s.get("worst_ms"))}</td>'
            f'<td>{esc(s.get("worst_rank", "–"))}</td><td>{_fmt(s.get("skew_ms"))}</td></tr>'
        )
    out.append(f'<tr><td class="l"><b>step</b></td><td></td><td>{_fmt(st.get("mean"))}</td>'
               f'<td>{_fmt(st.get("median"))}</td>'
               f'<td>{_fmt(st.get("worst"))}</td><td>{esc(st.get("worst_rank", "–"))}</td><td></td></tr></table>')
    return out


def _rank_table(ranks: Mapping[str, Any], names: Sequence[str], stragglers: set[int]) -> list[str]:
    """Per rank, its mean time per phase (stragglers highlighted), folded away."""
    out = ["<details><summary>Per-rank means per step (ms)</summary><table><tr><th>rank</th><th>steps</th>"
           "<th>step</th>" + "".join(f"<th>{esc(p)}</th>" for p in names) + "</tr>"]
    for k in sorted(ranks, key=_int_key):
        r = ranks[k] if isinstance(ranks[k], dict) else {}
        cls = ' class="hl"' if _int_key(k)[0] in stragglers else ""
        cells = "".join(f"<td>{_fmt((r.get('phases') or {}).get(p))}</td>" for p in names)
        out.append(f"<tr{cls}><td>{esc(k)}</td><td>{esc(r.get('steps', '–'))}</td>"
                   f"<td>{_fmt(r.get('step_time_ms'))}</td>{cells}</tr>")
    out.append("</table></details>")
    return out


def _timeline_part(timeline: Any, stragglers: set[int]) -> list[str]:
    """The per-step charts: own work and waiting by rank (or step time, for an older summary)."""
    out = []
    if not isinstance(timeline, dict):
        out.append('<h3>Step time per rank</h3><p class="meta">no per-step timeline in this summary</p>')
    elif any(isinstance(v, list) and v and isinstance(v[0], list) and len(v[0]) >= 4 for v in timeline.values()):
        # in synchronous training every rank's step lasts as long: what tells ranks apart is how much of
        # it was their own work and how much waiting for the others
        out.append("<h3>Own work per step, by rank</h3>")
        out.append('<p class="meta">everything but waiting for peers (collective, grad_sync): '
                   "a straggler's line is the high one</p>")
        out.append(timeline_svg(timeline, stragglers, "own", "own work (ms)"))
        out.append("<h3>Waiting for peers per step, by rank</h3>")
        out.append('<p class="meta">collective and grad_sync: the ranks that wait for a straggler are high here</p>')
        out.append(timeline_svg(timeline, stragglers, "wait", "waiting (ms)"))
    else:  # a summary from before own/wait were recorded
        out.append("<h3>Step time per rank</h3>")
        out.append(timeline_svg(timeline, stragglers))
    if any(isinstance(v, list) and v and isinstance(v[0], list) and v[0][:1] == [0]
           for v in (timeline or {}).values()):
        out.append('<p class="meta">step 0 (start-up) is left out of the timeline.</p>')
    return out


def _incident_list(doc: Mapping[str, Any], incident_anchors: Mapping[str, str]) -> list[str]:
    incidents = [str(i) for i in doc.get("incidents") or []]
    if not incidents:
        return ["<h3>Incidents</h3>", '<p class="meta">none</p>']
    return ["<h3>Incidents</h3>", "<ul>" + "".join(
        f'<li><a href="#{esc(incident_anchors[i])}">{esc(i)}</a></li>' if i in incident_anchors
        else f"<li>{esc(i)}</li>" for i in incidents) + "</ul>"]


# -- verdict --------------------------------------------------------------------------------------------
def bundle_dir(doc: Mapping[str, Any], base_dir: str) -> str | None:
    """This incident's bundle, when the report was made from the bundle or from its run dir."""
    incident = str(doc.get("incident_id") or "")
    if os.path.isfile(os.path.join(base_dir, "verdict.json")):
        return os.path.abspath(base_dir)
    # the id comes from a file: only a plain name may become a path component
    if incident and incident == os.path.basename(incident) and incident not in (".", ".."):
        candidate = os.path.join(base_dir, "incidents", incident)
        if os.path.isfile(os.path.join(candidate, "verdict.json")):
            return os.path.abspath(candidate)
    return None


def _bundle_text(bundle: str | None, *parts: str) -> str | None:
    """A text file of the bundle, cleaned and bounded (its frames came from the training processes)."""
    if bundle is None:
        return None
    try:
        with open(os.path.join(bundle, *parts), "rb") as f:
            raw = f.read(GROUPS_MAX_BYTES + 1)
    except OSError:
        return None
    text = clean(raw[:GROUPS_MAX_BYTES].decode("utf-8", "replace"), BLOCK, multiline=True)
    return text + ("\n… (cut)\n" if len(raw) > GROUPS_MAX_BYTES else "")


def verdict_section(doc: Mapping[str, Any], anchor: str, base_dir: str) -> str:
    kind = str(doc.get("kind"))
    initiators = int_ranks(doc.get("initiating_ranks") or [])
    who = fmt_ranks(initiators) if initiators else "no single rank"
    phase = doc.get("phase")
    conf = str(doc.get("confidence"))
    headline = f"{esc(headline_of(kind))} — initiating {esc(who)}"
    if phase:
        headline += f" in phase <code>{esc(phase)}</code>"
    conf_cls = f"conf-{conf}" if conf in CONFIDENCES else "conf-low"
    out = [
        f'<section class="doc verdict" id="{esc(anchor)}">',
        f"<h2>Incident {esc(doc.get('incident_id'))}</h2>",
        f'<p class="headline bad">{headline}<span class="badge {conf_cls}">confidence {esc(conf)}</span></p>',
        f'<p class="meta">job {esc(doc.get("job_id"))} · detected {_fmt(doc.get("detected_after_s"))} s after onset'
        + (f" · stall timeout {_fmt(doc.get('stall_timeout_s'))} s" if _num(doc.get("stall_timeout_s")) else "")
        + "</p>",
        f'<div class="why"><b>why:</b> {esc(doc.get("reason", ""))}</div>',
    ]
    trigger = doc.get("trigger")
    if isinstance(trigger, dict) and trigger.get("reason"):
        out.append(f'<p class="meta">trigger: {esc(trigger.get("kind"))} — {esc(trigger.get("reason"))}</p>')
    evidence = doc.get("evidence") or []
    if evidence:
        out.append("<h3>Evidence</h3><ul>" + "".join(f"<li>{esc(e)}</li>" for e in evidence) + "</ul>")
    bundle = bundle_dir(doc, base_dir)
    out.append(f"<p><b>next:</b> {esc(next_step(doc, bundle))}</p>")
    if bundle:
        out.append(f'<p class="meta">bundle: <code>{esc(bundle)}</code> · <code>rankwatch report '
                   f"{esc(bundle)}</code></p>")

    table = _dict(doc, "ranks")
    fr_numbered = isinstance(doc.get("flight_recorder"), dict)
    if table:
        out.append("<h3>Ranks</h3>")
        out.append('<table><tr><th>rank</th><th class="l">node</th><th>pid</th><th class="l">state</th>'
                   '<th>step</th><th class="l">phase</th><th>in phase s</th><th class="l">collective</th>'
                   '<th>GPU %</th><th class="l">top of stack</th></tr>')
        for key in sorted(table, key=_int_key):
            r = table[key] if isinstance(table[key], dict) else {}
            coll = r.get("collective")
            coll_txt = "–"
            if isinstance(coll, dict):  # one numbering: the flight recorder's, where the evidence quotes it
                coll_txt = f"{coll.get('op') or '?'}" + ("" if fr_numbered else f" #{coll.get('seq')}")
            stack = [str(f) for f in r.get("stack_top") or []]
            rank_no = _int_key(key)[0]
            whole = _bundle_text(bundle, "stacks", f"rank-{rank_no}.txt") if rank_no < 1 << 30 else None
            if whole is not None:  # every thread, every frame, with full paths: the bundle's stack file
                first = stack[0] if stack else "stack"
                stack_html = (f"<details><summary><code>{esc(first)}</code></summary><pre>"
                              f"{html.escape(whole, quote=True)}</pre></details>")
            elif len(stack) > 1:
                stack_html = (f"<details><summary><code>{esc(stack[0])}</code></summary><code>"
                              + "<br>".join(esc(f) for f in stack[1:]) + "</code></details>")
            else:
                stack_html = f"<code>{esc(stack[0])}</code>" if stack else "–"
            cls = ' class="hl"' if _int_key(key)[0] in initiators else ""
            gpu = _num(r.get("gpu_util"))
            out.append(
                f"<tr{cls}><td>{esc(key)}{' ◀' if cls else ''}</td><td class=\"l\">{esc(r.get('node', '–'))}</td>"
                f"<td>{esc(r.get('pid', '–'))}</td><td class=\"l\">{esc(r.get('state', '–'))}</td>"
                f"<td>{esc(r.get('step', '–'))}</td><td class=\"l\">{esc(r.get('phase', '–'))}</td>"
                f"<td>{_fmt(r.get('in_phase_s'))}</td><td class=\"l\">{esc(coll_txt)}</td>"
                f"<td>{'–' if gpu is None else f'{gpu:.0f}'}</td><td class=\"l\">{stack_html}</td></tr>"
            )
        out.append("</table>")
    groups = _bundle_text(bundle, "stacks", "groups.txt")
    if groups is not None:
        out.append(f"<h3>Stack groups</h3><pre>{html.escape(groups, quote=True)}</pre>")
    out.append("</section>")
    return "\n".join(out)


# -- page -------------------------------------------------------------------------------------------------
def render_html(docs: Sequence[Mapping[str, Any]], base_dir: str) -> str:
    """The whole page as a string (pure apart from reading the bundles' groups.txt)."""
    anchors = []
    incident_anchors: dict[str, str] = {}
    for i, doc in enumerate(docs):
        if doc.get("schema") == VERDICT_SCHEMA:
            anchor = f"incident-{i}"
            incident_anchors.setdefault(str(doc.get("incident_id")), anchor)
        else:
            anchor = f"summary-{i}"
        anchors.append(anchor)
    jobs = sorted({str(d.get("job_id")) for d in docs if d.get("job_id") is not None})
    title = "rankwatch report" + (f" — {', '.join(jobs)}" if jobs else "")
    sections = []
    nav = []
    for doc, anchor in zip(docs, anchors, strict=True):
        if doc.get("schema") == VERDICT_SCHEMA:
            sections.append(verdict_section(doc, anchor, base_dir))
            nav.append((anchor, f"incident {doc.get('incident_id')}"))
        elif doc.get("schema") == SUMMARY_SCHEMA:
            sections.append(summary_section(doc, anchor, incident_anchors))
            nav.append((anchor, "run summary"))
    nav_html = ("<nav>" + "".join(f'<a href="#{esc(a)}">{esc(t)}</a>' for a, t in nav) + "</nav>") if len(nav) > 1 \
        else ""
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head>\n<body><main>\n"
        f"<h1>{esc(title)}</h1>{nav_html}\n" + "\n".join(sections) +
        '\n<p class="meta">generated by rankwatch · self-contained: no scripts, no network</p>\n</main></body></html>\n'
    )


def write_html(path: str, docs: list[dict[str, Any]], base_dir: str) -> None:
    """Render ``docs`` (summary and/or verdict documents) into one self-contained, owner-only HTML file."""
    page = render_html(docs, base_dir).encode("utf-8")
    try:
        atomic_write(os.path.abspath(path), page)
    except OSError as exc:
        raise UserError(f"cannot write HTML report to {path}: {exc.strerror or exc}") from exc
