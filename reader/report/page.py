"""The ``report`` page: :class:`reader.report.collect.ReportData` drawn with matplotlib and written as one
self-contained HTML file (inline CSS, figures as ``data:`` PNGs, no script, nothing fetched).

The only module of ``reader/`` that imports matplotlib (the ``report`` extra), through its object API (a
``Figure`` and the Agg canvas), so a caller's pyplot state is never touched.
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any, Sequence

import numpy as np

from reader.report import figures
from reader.report.collect import ReportData
from reader.report.annotated_rows import html_row
from reader.storage.progress import describe as describe_progress, format_bytes

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1180px; color: #1d1d1f; padding: 0 16px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; }
.state { display: inline-block; padding: 2px 8px; border-radius: 4px; font-weight: 600; }
.finished { background: #e3f4e1; color: #1e6b1e; } .running { background: #fff1cc; color: #7a5200; }
table { border-collapse: collapse; } th { white-space: nowrap; }
td, th { padding: 3px 10px 3px 0; text-align: left; vertical-align: top; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 12px; }
figure { margin: 0; } figcaption { color: #555; font-size: 12px; }
img { max-width: 100%; height: auto; }
pre, .row { font: 12px/1.5 ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; }
pre { background: #f6f6f6; padding: 8px; }
.row { border: 1px solid #ddd; padding: 6px 8px; margin: 4px 0 10px; }
.rowhead { color: #555; font-size: 12px; }
.seg0 { background: #dbeafe; } .seg1 { background: #fde68a; } .seg2 { background: #d1fae5; }
.seg3 { background: #fbcfe8; } .seg4 { background: #e0e7ff; } .seg5 { background: #fed7aa; }
.masked { color: #6b7280; font-style: italic; }
.pad { color: #999; background: repeating-linear-gradient(45deg, #eee, #eee 3px, #fff 3px, #fff 6px); }
.doc { color: #c00; font-weight: 700; padding: 0 1px; }
.note { color: #7a5200; }
"""


def _png(fig) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(width: float = 5.6, height: float = 2.6):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=90, layout="constrained")
    return fig, fig.add_subplot()


def _img(src: str, alt: str, caption: str) -> str:
    return (f'<figure><img src="{src}" alt="{html.escape(alt)}"><figcaption>{html.escape(caption)}</figcaption>'
            "</figure>")


def histogram_png(h: figures.Histogram, xlabel: str, ylabel: str = "count") -> str:
    fig, ax = _figure()
    ax.bar(h.edges[:-1], h.counts, width=np.diff(h.edges), align="edge", color="#4f7cac", edgecolor="white",
           linewidth=0.4)
    if h.log:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _png(fig)


def bars_png(items: Sequence[tuple[str, int]], xlabel: str) -> str:
    """Horizontal bars, one per labelled value (the first on top)."""
    fig, ax = _figure(height=min(6.0, 0.9 + 0.22 * len(items)))
    labels = [lab if len(lab) <= 28 else lab[:27] + "…" for lab, _ in items]
    y = np.arange(len(items))[::-1]
    ax.barh(y, [n for _, n in items], color="#4f7cac")
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel(xlabel)
    return _png(fig)


def shares_png(at: np.ndarray, realised: np.ndarray, target: np.ndarray, names: Sequence[str]) -> str:
    fig, ax = _figure()
    for c, name in enumerate(names):
        line, = ax.plot(at, realised[:, c], label=f"{name} drawn")
        ax.plot(at, target[:, c], linestyle="--", color=line.get_color(), linewidth=1, label=f"{name} weight")
    ax.set_xlabel("steps")
    ax.set_ylabel("share of examples so far")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, ncols=2)
    return _png(fig)


def locality_png(loc: figures.Locality, batch_size: int, names: Sequence[str] | None) -> str:
    fig, ax = _figure()
    comps = np.unique(loc.components)
    for c in comps.tolist():
        sel = loc.components == c
        ax.scatter(loc.steps[sel], loc.sources[sel], s=3, alpha=0.5, linewidths=0,
                   label=names[c] if names is not None else None)
    if names is None:  # where the rows would come from unshuffled
        ax.plot([0, loc.steps.max()], [0, (loc.steps.max() + 1) * batch_size], color="#888", linewidth=0.8,
                label="unshuffled")
    ax.set_xlabel("step")
    ax.set_ylabel("source example" + (" (of its component)" if names is not None else ""))
    ax.legend(fontsize=7, markerscale=3)
    return _png(fig)


def _rows_table(rows: Sequence[tuple[str, Any]]) -> str:
    out = []
    for key, value in rows:
        ident = key.lower().replace(" ", "-")
        shown = f"{value:,}" if isinstance(value, int) else html.escape(str(value))
        out.append(f'<tr><th>{html.escape(key)}</th><td id="{ident}">{shown}</td></tr>')
    return "<table>" + "".join(out) + "</table>"


def _summary(d: ReportData) -> str:
    s = d.summary
    if d.is_mixture:
        head = "<tr><th>component</th><th>path</th><th>state</th><th>documents</th><th>tokens</th><th>chunks</th>"
        head += "".join(f"<th>weight from batch {g['start_batch']:,}</th>" for g in s["segments"])
        head += ("<th>examples per pass</th><th>pass rule</th><th>max_passes</th><th>examples drawn</th>"
                 "<th>passes</th></tr>")
        body = []
        for c in s["components"]:
            passes = "-" if c.get("passes") is None else f"{c['passes']:.3f}"
            limit = "-" if c.get("max_passes") is None else f"{c['max_passes']:g}"
            w = "".join(f'<td class="n">{g["weights"][c["name"]]:.4f}</td>' for g in s["segments"])
            body.append(f"<tr><td>{html.escape(c['name'])}</td><td>{html.escape(c['path'])}</td>"
                        f"<td>{'finished' if c['finished'] else 'BUILDING'}</td><td class='n'>{c['documents']:,}</td>"
                        f"<td class='n'>{c['tokens']:,}</td><td class='n'>{c['chunks']:,}</td>{w}"
                        f"<td class='n'>{c['examples_per_pass']:,}</td><td>{_rule(c)}</td><td class='n'>{limit}</td>"
                        f"<td class='n'>{c.get('examples_drawn', 0):,}</td><td class='n'>{passes}</td></tr>")
        docs = sum(c["documents"] for c in s["components"])
        refused = s.get("steps", {}).get("refused_from")
        note = "" if refused is None else f"<p><b>{html.escape(refused['error'])}</b></p>"
        return (_rows_table([("documents", docs), ("tokens", sum(c["tokens"] for c in s["components"])),
                             ("tokenizer", d.tokenizer), ("seed", s["seed"]), ("block", s["block"])])
                + f"<h2>Components</h2><p>Passes over each component that steps 0 to {d.steps:,} draw: a pass is the "
                  "component's examples per pass, under the pass rule \"spans\" each served once per pass.</p>"
                + note + "<table>" + head + "".join(body) + "</table>")
    tokens, docs = s["tokens"], s["documents"]
    rows = [("documents", docs), ("tokens", tokens), ("chunks", s["chunks"]),
            ("empty chunks", s["empty_chunks"]), ("Parquet bytes", s["bytes"]), ("input shards", s["inputs"]),
            ("bytes per token", f"{s['bytes'] / tokens:.3f} (Parquet)" if tokens else "-")]
    if d.progress is not None:
        inp = d.progress.input_bytes_total
        rows.append(("input bytes", f"{format_bytes(inp)}" + (f", {inp / tokens:.3f} per token" if tokens and
                                                              d.progress.finished else "")))
    rows += [("tokenizer", d.tokenizer), ("doc length", "  ".join(f"{k}={v}" for k, v in
                                                                  s["doc_length_percentiles"].items()))]
    p = s.get("passes")
    if p is not None:
        rows.append(("examples per pass", p["examples_per_pass"]))
        rows.append(("pass rule", _rule(p)))
        if p.get("passes") is not None:
            rows.append(("passes", f"{p['passes']:.3f} in steps 0 to {p['steps'] - 1:,}"))
    rows += [(f"kept field {name}", note) for name, note in d.field_notes.items()]
    return _rows_table(rows)


def _rule(p: dict) -> str:
    """A pass rule as the page says it (:func:`reader.report.summary.passes`)."""
    text = p["pass_rule"] + (f" (the default for format version {p['format_version']})" if p["rule_by_version"] else "")
    if p["repeated_rows"]:
        text += (f"; about {p['repeated_rows'] / p['examples_per_pass']:.0%} of each pass's rows are served twice "
                 "within it (pass_rule 'spans' serves each once)")
    return html.escape(text)


def _state(d: ReportData) -> str:
    if d.is_mixture:
        running = [c["name"] for c in d.summary["components"] if not c["finished"]]
        if not running:
            return '<span class="state finished">finished</span>'
        return f'<span class="state running">BUILD RUNNING: {html.escape(", ".join(running))}</span>' + \
            "<p class='note'>Figures show what those builds have written so far.</p>"
    p = d.progress
    if p is None or p.finished:
        return '<span class="state finished">finished</span>'
    lines = "<br>".join(html.escape(x) for x in describe_progress(p, readable=d.summary["chunks"]))
    return (f'<span class="state running">BUILD {"RUNNING" if p.running else "UNFINISHED"}</span>'
            f"<p class='note'>This page shows what the build has written so far.<br>{lines}</p>")


def _view(d: ReportData) -> str:
    """What the view read keeps, in all and per input (``inspect --view`` also shows its duplicate clusters)."""
    v = d.view
    if v is None:
        return ""
    out = [f"<h2>View</h2><p id='view'>{html.escape(v['view'])}</p><table><tr><th>input</th><th>documents kept</th>"
           "<th>documents</th><th>tokens kept</th><th>tokens</th><th>share of tokens kept</th></tr>"]
    for name, r in [("all", v)] + [(str(r["input"]), r) for r in v["by_input"]]:
        docs, tokens = r["kept_documents"] + r["dropped_documents"], r["kept_tokens"] + r["dropped_tokens"]
        out.append(f"<tr><td>{html.escape(name)}</td><td class='n'>{r['kept_documents']:,}</td><td class='n'>{docs:,}"
                   f"</td><td class='n'>{r['kept_tokens']:,}</td><td class='n'>{tokens:,}</td>"
                   f"<td class='n'>{r['kept_tokens'] / max(1, tokens):.1%}</td></tr>")
    return "".join(out) + "</table>"


def _bad(d: ReportData) -> str:
    if d.is_mixture:
        return ""
    if not d.bad:
        return "<h2>Bad records</h2><p>None.</p>"
    out = ["<h2>Bad records</h2><table><tr><th>reason</th><th>count</th><th>share</th></tr>"]
    out += [f"<tr><td>{html.escape(r)}</td><td class='n'>{n:,}</td><td class='n'>{100 * f:.1f}%</td></tr>"
            for r, n, f in d.bad]
    out.append("</table>")
    for reason, examples in d.dead_letters.items():
        out.append(f"<h3>{html.escape(reason)}</h3>")
        for e in examples:
            out.append(f"<pre>{html.escape(str(e['file']))} {html.escape(str(e['where']))}: "
                       f"{html.escape(str(e['detail']))}\n{html.escape(str(e['line']))}</pre>")
    return "".join(out)


def _batches(d: ReportData) -> str:
    o = d.options
    how = (f"seq_len {o.seq_len}, batch_size {o.batch_size}, {'packed, ' + o.packing if o.packed else 'unpacked'}, "
           f"ideal_readers {o.ideal_readers}" + (f", shuffle_seed {o.shuffle_seed}" if o.shuffle_seed is not None else "")
           + (f", max_segments {o.max_segments}" if o.max_segments is not None else "")
           + (f", view {o.view}" if o.view is not None else ""))
    out = [f"<h2>Batches</h2><p>Read with {html.escape(how)}. Colours: one per document piece; "
           '<span class="doc">|</span> a document start; <span class="doc">…</span> first in a row: the row begins '
           'inside a document that started before it; <span class="masked seg0">grey italics</span>: masked out '
           'of the loss; <span class="pad">···</span> padding.</p>']
    for b in d.batches:
        out.append(f"<h3>Batch {b.batch:,}</h3>")
        if b.note:
            out.append(f"<p class='note'>{html.escape(b.note)}</p>")
        if b.packing is not None and b.packing.rows:
            out.append(f"<p class='packing'>The batch's {html.escape(b.packing.describe())}.</p>")
        for r in b.rows:
            comp = f", component {html.escape(r.component)}" if r.component is not None else ""
            out.append(f"<div class='rowhead'>row {r.row} (example {r.example:,}, epoch {r.epoch}{comp})</div>"
                       f"<div class='row'>{html_row(r.pieces)}</div>")
    return "".join(out)


def render(d: ReportData) -> str:
    """The page as HTML text. Every text in a figure is drawn as it is (never as mathtext: a kept field's
    ``$x^2$`` is those five characters), every value on the page escaped."""
    from matplotlib import rc_context

    with rc_context({"text.parse_math": False, "text.usetex": False}):
        return _render(d)


def _render(d: ReportData) -> str:
    figs = [_img(histogram_png(d.lengths, "tokens per document (log scale)", "documents"), "document lengths",
                 f"Document length: {d.length_note}.")]
    if d.shard_tokens:
        if len(d.shard_tokens) <= 40:
            figs.append(_img(bars_png(d.shard_tokens, "tokens"), "tokens per input shard",
                             "Tokens per input shard (ledger)."))
        else:
            h = figures.linear_histogram([n for _, n in d.shard_tokens])
            figs.append(_img(histogram_png(h, "tokens per input shard", "shards"), "tokens per input shard",
                             f"Tokens per input shard, {len(d.shard_tokens):,} shards (ledger)."))
    if d.chunk_tokens is not None:
        figs.append(_img(histogram_png(d.chunk_tokens, "tokens per chunk", "chunks"), "chunk sizes",
                         "Chunk sizes (ledger)."))
    for name, items in d.field_tokens.items():
        figs.append(_img(bars_png(items, "tokens"), f"tokens per {name}",
                         f"Tokens per value of the kept field {name!r} (sampled chunks)."))
    if d.shares is not None:
        at, realised, target, names = d.shares
        figs.append(_img(shares_png(at, realised, target, names), "mixture proportions",
                         f"Share of each component in the examples of the first N steps (solid) and the weights "
                         f"(dashed), N up to {d.steps:,}."))
    if d.locality is not None:
        figs.append(_img(locality_png(d.locality, d.options.batch_size, d.shares[3] if d.shares else None),
                         "shuffle locality", f"Shuffled read: the source example of rows of steps 0 to "
                                             f"{max(d.steps, 1):,} (sampled rows)."))
    title = f"chunkledger report: {d.path}"
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>{_state(d)}"
            f"<h2>Summary</h2>{_summary(d)}{_view(d)}<h2>Figures</h2><div class='grid'>{''.join(figs)}</div>"
            f"{_bad(d)}{_batches(d)}<h2>This page</h2><p>Regenerate it with:</p><pre id='command'>"
            f"{html.escape(d.command)}</pre><p class='rowhead'>Chunk files read: {d.chunks_read:,}.</p>"
            "</body></html>")
