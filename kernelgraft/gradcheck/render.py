"""A ModelAudit as Markdown and as one self-contained HTML page (tables and inline SVG plots, no
scripts, no external files). Both are built from the same table cells, so their numbers agree."""

from __future__ import annotations

import html as _html
import math

RULE = "error <= 1.1 x max(eager, compile) + 4 float32 eps, errors relative to the reference"

SITE_HEAD = [
    "module",
    "pattern",
    "what",
    "shapes",
    "dtypes",
    "kernelgraft",
    "eager",
    "compile",
    "bound",
    "status",
]
PARAM_HEAD = ["parameter", "shape", "dtype", "kernelgraft", "eager", "compile", "bound", "status"]


def num(x) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    if math.isnan(x):
        return "nan"
    return f"{x:.3e}"


def status(r) -> str:
    if r.note:
        return f"FAIL: {r.note}"
    return "ok" if r.ok else f"FAIL: {r.ratio:.2f}x bound"


def site_cells(a) -> list[list[str]]:
    return [
        [r.where, r.pattern, r.what, r.shapes, r.dtypes, num(r.kernelgraft), num(r.eager), num(r.compile),
         num(r.bound), status(r)]
        for r in a.sites
    ]  # fmt: skip


def param_cells(a) -> list[list[str]]:
    return [
        [r.where, r.shapes, r.dtypes, num(r.kernelgraft), num(r.eager), num(r.compile), num(r.bound), status(r)]
        for r in a.params
    ]


def summary(a) -> list[str]:
    n_sites = len({r.site for r in a.sites})
    verdict = "ok" if a.ok else f"FAILED ({len(a.failures())} of {len(a.rows)} quantities)"
    w = a.worst()
    lines = [
        f"model {a.model}, {a.dtype} on {a.device}, kernelgraft backend {a.backend}; reference {a.reference}; "
        f"{a.date}, {a.versions}",
        f"verdict: {verdict}. {n_sites} site(s), {len(a.params) - 1} parameter gradient(s) and the loss checked"
        f"{f', the model on {a.batches} batches' if a.batches > 1 else ''}.",
        f"rule: {RULE}.",
    ]
    if w is not None:
        lines.append(f"worst: {w.where} {w.what} at {w.ratio:.2f}x its bound ({status(w)}).")
    if a.lints:
        lines.append(f"lints: {len(a.lints)} (below).")
    return lines


def markdown(a) -> str:
    out = [f"# kernelgraft audit: {a.model}", ""] + [f"- {s}" for s in summary(a)]
    out += ["", "## Sites (output and input gradients vs float64 truth)", ""]
    out += _md_table(SITE_HEAD, site_cells(a))
    out += [
        "",
        f"## Parameters (gradient of the whole model vs the {a.reference} reference; the loss first)",
        "",
    ]
    out += _md_table(PARAM_HEAD, param_cells(a))
    if a.lints:
        out += ["", "## Lints", ""] + [f"- **{x.name}**: {x.message}" for x in a.lints]
    if a.fallbacks:
        out += ["", "## Sites left stock (fell back)", ""] + [f"- {f}" for f in a.fallbacks]
    return "\n".join(out) + "\n"


def _md_table(head, rows) -> list[str]:
    esc = lambda c: str(c).replace("|", "\\|")
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(esc(c) for c in r) + " |" for r in rows),
    ]


# ---- HTML ------------------------------------------------------------------------------------------

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:12.5px}
th,td{border:1px solid #ccc;padding:3px 7px;text-align:left}th{background:#f3f3f3}
td.num{text-align:right;font-family:ui-monospace,monospace}
tr.fail td{background:#fde2e2}.ok{color:#17752e;font-weight:600}.bad{color:#b3261e;font-weight:600}
figure{margin:1em 0}figcaption{font-size:12px;color:#555}
"""


def html(a) -> str:
    e = _html.escape
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>kernelgraft audit: {e(a.model)}</title><style>{CSS}</style></head><body>",
        f"<h1>kernelgraft audit: {e(a.model)}</h1>",
        f"<p class='{'ok' if a.ok else 'bad'}' id='verdict'>{'ok' if a.ok else 'FAILED'}</p><ul>",
        *(f"<li>{e(s)}</li>" for s in summary(a)),
        "</ul>",
        "<h2>Sites (output and input gradients vs float64 truth)</h2>",
        _svg_sites(a),
        _html_table("sites", SITE_HEAD, site_cells(a), [r.ok for r in a.sites]),
        f"<h2>Parameters (gradient of the whole model vs the {e(a.reference)} reference; the loss first)</h2>",
        _svg_params(a),
        _html_table("params", PARAM_HEAD, param_cells(a), [r.ok for r in a.params]),
    ]
    if a.lints:
        parts += ["<h2>Lints</h2><ul id='lints'>"]
        parts += [f"<li><b>{e(x.name)}</b>: {e(x.message)}</li>" for x in a.lints]
        parts += ["</ul>"]
    if a.fallbacks:
        parts += (
            ["<h2>Sites left stock (fell back)</h2><ul>"]
            + [f"<li>{e(f)}</li>" for f in a.fallbacks]
            + ["</ul>"]
        )
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _html_table(tid, head, rows, oks) -> str:
    e = _html.escape
    numeric = {"kernelgraft", "eager", "compile", "bound"}
    out = [
        f"<table id='{tid}'><thead><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr></thead><tbody>"
    ]
    for r, ok in zip(rows, oks):
        cells = "".join(
            f"<td{' class=num' if h in numeric else ''}>{e(str(c))}</td>" for h, c in zip(head, r)
        )
        out.append(f"<tr{'' if ok else ' class=fail'}>{cells}</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def _log_range(vals):
    v = [x for x in vals if x is not None and 0 < x < math.inf]
    if not v:
        return -8.0, 0.0
    lo, hi = math.floor(math.log10(min(v))), math.ceil(math.log10(max(v)))
    return float(lo), float(max(hi, lo + 1))


def _svg_sites(a) -> str:
    """Per compared quantity: eager's error (hollow), compile's (grey) and kernelgraft's (filled) on
    a log axis, with the rule's bound as a tick."""
    rows = a.sites
    if not rows:
        return "<p>No sites.</p>"
    lo, hi = _log_range([x for r in rows for x in (r.kernelgraft, r.eager, r.compile, r.bound)])
    W, left, right, rh = 900, 330, 20, 16
    H = 30 + rh * len(rows) + 20
    X = lambda v: left + (W - left - right) * (min(max(math.log10(max(v, 10**lo)), lo), hi) - lo) / (hi - lo)
    s = [f"<figure><svg xmlns='http://www.w3.org/2000/svg' width='{W}' height='{H}' font-size='10'>"]
    for k in range(int(lo), int(hi) + 1):
        x = X(10.0**k)
        s.append(f"<line x1='{x:.1f}' y1='20' x2='{x:.1f}' y2='{H - 20}' stroke='#ddd'/>")
        s.append(f"<text x='{x:.1f}' y='14' text-anchor='middle'>1e{k}</text>")
    for i, r in enumerate(rows):
        y = 30 + rh * i
        s.append(
            f"<text x='{left - 6}' y='{y + 3}' text-anchor='end'>{_html.escape(r.where[-34:] + ' ' + r.what)}</text>"
        )
        b = X(r.bound)
        s.append(f"<line x1='{b:.1f}' y1='{y - 6}' x2='{b:.1f}' y2='{y + 6}' stroke='#b3261e'/>")
        if r.compile is not None:
            s.append(f"<circle cx='{X(r.compile):.1f}' cy='{y}' r='3.5' fill='#999'/>")
        s.append(f"<circle cx='{X(r.eager):.1f}' cy='{y}' r='4.5' fill='none' stroke='#333'/>")
        color = "#1f5fbf" if r.ok else "#b3261e"
        kx = X(r.kernelgraft) if math.isfinite(r.kernelgraft) else W - right
        s.append(f"<circle cx='{kx:.1f}' cy='{y}' r='3' fill='{color}'/>")
    s.append("</svg><figcaption>Relative error vs float64 truth (log scale): kernelgraft (filled; red if it fails), "
             "eager (hollow), torch.compile (grey); the red tick is the rule's bound.</figcaption></figure>")  # fmt: skip
    return "\n".join(s)


def _svg_params(a) -> str:
    """Per parameter: eager's gradient error (x) against kernelgraft's (y), log-log, with the bound."""
    rows = a.params
    if not rows:
        return "<p>No parameters.</p>"
    lo, hi = _log_range([x for r in rows for x in (r.kernelgraft, r.eager)])
    S, m = 360, 50
    P = lambda v: m + (S - 2 * m) * (min(max(math.log10(max(v, 10**lo)), lo), hi) - lo) / (hi - lo)
    s = [f"<figure><svg xmlns='http://www.w3.org/2000/svg' width='{S}' height='{S}' font-size='10'>"]
    s.append(f"<rect x='{m}' y='{m}' width='{S - 2 * m}' height='{S - 2 * m}' fill='none' stroke='#aaa'/>")
    for k in range(int(lo), int(hi) + 1):
        p = P(10.0**k)
        s.append(f"<text x='{p:.1f}' y='{S - m + 14}' text-anchor='middle'>1e{k}</text>")
        s.append(f"<text x='{m - 4}' y='{S - p + 3:.1f}' text-anchor='end'>1e{k}</text>")
    x0, x1 = P(10**lo), P(10**hi)
    s.append(f"<line x1='{x0:.1f}' y1='{S - x0:.1f}' x2='{x1:.1f}' y2='{S - x1:.1f}' stroke='#b3261e' stroke-dasharray='4 3'/>")  # fmt: skip
    for r in rows:
        y = P(r.kernelgraft) if math.isfinite(r.kernelgraft) else m
        color = "#1f5fbf" if r.ok else "#b3261e"
        s.append(f"<circle cx='{P(r.eager):.1f}' cy='{S - y:.1f}' r='3' fill='{color}'><title>{_html.escape(r.where)}</title></circle>")  # fmt: skip
    s.append(f"<text x='{S / 2}' y='{S - 12}' text-anchor='middle'>stock model's gradient error</text>")
    s.append(
        f"<text x='12' y='{S / 2}' transform='rotate(-90 12 {S / 2})' text-anchor='middle'>kernelgraft's</text>"
    )
    s.append("</svg><figcaption>One dot per parameter (and the loss): on or below the dashed line y = x, the "
             "optimized model is as accurate as the stock one.</figcaption></figure>")  # fmt: skip
    return "\n".join(s)
