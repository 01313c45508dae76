"""Files people look at: summary.json/md, pareto.png (speedup vs accuracy), report.html (token sources)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

COLOURS = {"accepted": "#c8e6c9", "override": "#ffe082", "corrected": "#ef9a9a", "bonus": "#90caf9",
           "target": "#eeeeee"}
MEANING = {"accepted": "accepted by SD", "override": "kept by the PAD/baseline override",
           "corrected": "corrected by the target", "bonus": "bonus token from the target",
           "target": "plain decoding"}


def fmt(x: Any, spec: str, suffix: str = "") -> str:
    """A table cell: ``x`` formatted, or "-" when there is no value."""
    return "-" if x is None else format(x, spec) + suffix


def paired_cell(p: dict[str, Any] | None) -> str:
    """'-0.020 (p 0.25)': accuracy difference and exact McNemar p-value, or '-'."""
    return "-" if not p else f"{p['diff']:+.3f} (p {p['p_mcnemar']:.2g})"


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    lines = ["| method | accuracy | 95% CI | vs ar (McNemar) | vs sd (McNemar) | eta | tau | target fwd/token | "
             "ms/token | speedup | speedup IQR |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, s in summary.items():
        lo, hi = s["ci95"]
        iqr = "-" if not s["speedup_iqr"] else f"{s['speedup_iqr'][0]:.2f}-{s['speedup_iqr'][1]:.2f}"
        paired = s.get("paired", {})
        lines.append(f"| {label} | {s['accuracy']:.3f} | [{lo:.3f}, {hi:.3f}] | {paired_cell(paired.get('ar'))} | "
                     f"{paired_cell(paired.get('sd'))} | {fmt(s['eta'], '.3f')} | "
                     f"{fmt(s['tau'], '.2f')} | {fmt(s['target_forwards_per_token'], '.3f')} | "
                     f"{fmt(s['ms_per_token'], '.1f')} | {fmt(s['speedup'], '.2f', 'x')} | {iqr} |")
    batched = {s["batch_size"] for s in summary.values() if "batch_size" in s}
    if batched:  # throughput columns; speedups need one decode at a time
        lines[0] += " tokens/s |"
        lines[1] += "---|"
        for i, s in enumerate(summary.values(), start=2):
            lines[i] += f" {fmt(s.get('tokens_per_s'), '.1f')} |"
        lines.append(f"\nDecoded {max(batched)} rows at a time (--batch-size): ms/token and tokens/s are throughput; "
                     "speedups are per problem at batch 1 only (rerun with --batch-size 1).")
    return "\n".join(lines)


def write_reports(out: Path, rows: list[dict[str, Any]], summary: dict[str, Any], problems: list[Any],
                  config: dict) -> None:
    (out / "summary.json").write_text(json.dumps({"config": config, "methods": summary}, indent=1))
    (out / "summary.md").write_text(format_table(summary) + "\n")
    pareto_plot(summary, out / "pareto.png")
    (out / "report.html").write_text(report_html(rows, summary, problems, config))


def pareto_plot(summary: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for label, s in summary.items():
        if s["speedup"] is None:
            continue
        lo, hi = s["ci95"]
        ax.errorbar(s["speedup"], s["accuracy"], yerr=[[s["accuracy"] - lo], [hi - s["accuracy"]]], fmt="o",
                    capsize=3)
        ax.annotate(label, (s["speedup"], s["accuracy"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("speedup over ar (wall time)")
    ax.set_ylabel("accuracy (95% CI)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _tokens_html(trace: list[list[str]]) -> str:
    spans = []
    for text, source in trace:
        spans.append(f'<span class="tok {source}" title="{source}">{html.escape(text)}</span>')
    return "".join(spans)


def report_html(rows: list[dict[str, Any]], summary: dict[str, Any], problems: list[Any], config: dict) -> str:
    legend = " ".join(f'<span class="tok {k}">{html.escape(v)}</span>' for k, v in MEANING.items())
    css = "".join(f".{k}{{background:{c}}}" for k, c in COLOURS.items())
    table_rows = []
    for line in format_table(summary).splitlines()[2:2 + len(summary)]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        table_rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    header = [c.strip() for c in format_table(summary).splitlines()[0].strip("|").split("|")]
    by_problem: dict[str, list[dict]] = {}
    for r in rows:
        by_problem.setdefault(r["problem_id"], []).append(r)
    sections = []
    for p in problems:
        if p.id not in by_problem:
            continue
        question = p.messages[-1]["content"] if p.messages else p.prompt
        items = []
        for r in by_problem[p.id]:
            mark = "&#10003;" if r["score"] >= 1 else "&#10007;"
            items.append(f'<div class="row"><div class="meta">{html.escape(r["method"])} {mark} '
                         f'({r["stats"]["new_tokens"]} tokens, {r["stats"]["wall_s"]:.2f} s)</div>'
                         f'<div class="text">{_tokens_html(r["trace"])}</div></div>')
        sections.append(f'<section><h3>{html.escape(p.id)} (answer: {html.escape(str(p.answer))})</h3>'
                        f'<pre class="q">{html.escape(question)}</pre>{"".join(items)}</section>')
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>pivotspec report</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:auto}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 6px}} .tok{{white-space:pre-wrap;border-radius:2px}} {css}
.text{{font-family:monospace;line-height:1.6}} .meta{{font-weight:bold;margin-top:8px}} .q{{white-space:pre-wrap}}
</style></head><body>
<h1>pivotspec evaluation</h1>
<p>{html.escape(json.dumps(config))}</p>
<table><tr>{"".join(f"<th>{html.escape(h)}</th>" for h in header)}</tr>{"".join(table_rows)}</table>
<p><img src="pareto.png" alt="speedup vs accuracy"></p>
<p>Token colours: {legend}</p>
{"".join(sections)}
</body></html>
"""
