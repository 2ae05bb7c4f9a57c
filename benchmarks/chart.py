"""Horizontal grouped bar charts as SVG, with no plotting library: the benchmark writes its chart
wherever it runs (the GPU machine is offline and has no matplotlib), and the charts in docs/ are
drawn by the same code from the tables there.

    python benchmarks/chart.py results/bench_cuda.json -o results/bench_cuda.svg
    python benchmarks/chart.py docs/perf-h200.json -o docs/perf-h200.svg

The JSON is bench.py's output ({"card", "torch", "date", "rows": [{"case", "shape", "layout",
"direction", "ms": {impl: ms}}]}) or the same with "title" and "rows": [{"label", "ms": {...}}].
"""

import argparse
import html
import json
import math
from typing import Dict, List, Optional, Sequence

# Matplotlib's default cycle: fusednorm first, in blue, in every chart.
COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]


def bar_chart_svg(title: str, labels: Sequence[str], series: Dict[str, List[Optional[float]]],
                  unit: str = "ms", log: bool = True) -> str:
    """One group of bars per label, one bar per series (missing values: no bar), on a log axis by
    default (the rows span three decades). Returns the SVG document."""
    names = list(series)
    values = [v for vs in series.values() for v in vs if v is not None and v > 0]
    if not values:
        raise ValueError("nothing to draw")
    lo, hi = min(values), max(values)
    if log:
        lo, hi = 10 ** math.floor(math.log10(lo)), 10 ** math.ceil(math.log10(hi))
    else:
        lo = 0.0
    bar_h, gap, label_w, plot_w, top = 9, 8, 330, 520, 48
    group_h = bar_h * len(names) + gap
    height = top + group_h * len(labels) + 40
    width = label_w + plot_w + 150

    def x_of(v: float) -> float:
        f = (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) if log else v / hi
        return label_w + f * plot_w

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="13">{html.escape(title)}</text>']
    ticks = []
    if log:
        e = round(math.log10(lo))
        while 10 ** e <= hi * 1.0001:
            ticks.append(10 ** e)
            e += 1
    else:
        ticks = [hi * k / 5 for k in range(6)]
    axis_y = top + group_h * len(labels)
    for t in ticks:
        x = x_of(t)
        out.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{axis_y}" stroke="#ddd"/>')
        out.append(f'<text x="{x:.1f}" y="{axis_y + 14}" text-anchor="middle">{t:g}</text>')
    out.append(f'<text x="{label_w + plot_w / 2}" y="{axis_y + 30}" text-anchor="middle">'
               f'{html.escape(unit)}{" (log scale)" if log else ""}, shorter is faster</text>')
    for i, label in enumerate(labels):
        y0 = top + i * group_h
        out.append(f'<text x="{label_w - 6}" y="{y0 + group_h / 2 + 2:.1f}" text-anchor="end">'
                   f'{html.escape(label)}</text>')
        for j, name in enumerate(names):
            v = series[name][i]
            if v is None or v <= 0:
                continue
            y = y0 + j * bar_h
            out.append(f'<rect x="{label_w}" y="{y}" width="{max(x_of(v) - label_w, 1):.1f}" '
                       f'height="{bar_h - 1}" fill="{COLOURS[j % len(COLOURS)]}"/>')
    for j, name in enumerate(names):
        y = top + 14 * j
        out.append(f'<rect x="{label_w + plot_w + 16}" y="{y}" width="10" height="10" '
                   f'fill="{COLOURS[j % len(COLOURS)]}"/>')
        out.append(f'<text x="{label_w + plot_w + 30}" y="{y + 9}">{html.escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def chart_from_results(results: dict, impls: Optional[Sequence[str]] = None) -> str:
    """The chart of bench.py's JSON (or a docs table in the same form)."""
    rows = results["rows"]
    labels = [r.get("label") or f"{r['case']} {r['shape']}{' CL' if r.get('layout') == 'channels_last' else ''} "
              f"{r['direction'][:3]}" for r in rows]
    if impls is None:
        impls = [i for i in ("fusednorm", "plain norm", "eager", "compile", "liger", "Triton peer")
                 if any(i in r["ms"] for r in rows)]
        impls += [i for r in rows for i in r["ms"] if i not in impls]
        impls = list(dict.fromkeys(impls))
    series = {i: [r["ms"].get(i) for r in rows] for i in impls}
    title = results.get("title") or (f"fusednorm on {results.get('card', '?')}, torch {results.get('torch', '?')}, "
                                     f"{results.get('date', '')}")
    return bar_chart_svg(title, labels, series)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="bench.py's JSON, or a table in the same form")
    parser.add_argument("-o", "--out", required=True, help="the SVG to write")
    args = parser.parse_args()
    with open(args.results) as f:
        svg = chart_from_results(json.load(f))
    with open(args.out, "w") as f:
        f.write(svg)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
