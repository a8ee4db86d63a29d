"""The comparison's outputs: a table (stdout, results.md), results.jsonl and three Pareto plots (four with
Pasta's speedup).

Each plot puts one point per entry at (cost, avg@k) — cost being mean live KV, aggregate throughput
or total decode time — labels it, and draws the Pareto frontier: the entries no other entry beats on
both accuracy and that cost. Lower is better for live KV and decode time, higher for throughput. With
``eval.compare.speedup_of`` the table has a speedup column and ``pareto_speedup.png`` plots quality
(avg@k) against the geometric-mean theoretical speedup (higher is better).
"""

from __future__ import annotations

import json
from pathlib import Path

from sliderl.cluster.eval.comparison import EntryResult

# (metric, column header, format); mean ± std over seeds when there is more than one
COLUMNS = (
    ("avg_at_k", "avg@k", "{:.3f}"),
    ("pass_at_k", "pass@k", "{:.3f}"),
    ("mean_live_kv", "mean live KV", "{:.1f}"),
    ("peak_live_kv", "peak live KV", "{:.0f}"),
    ("kv_token_steps", "KV x steps", "{:.0f}"),  # per completion: live KV summed over its generation
    ("generated_tokens", "tokens", "{:.0f}"),
    ("tokens_per_second", "tok/s", "{:.1f}"),
    ("decode_seconds", "decode s", "{:.2f}"),
    ("speedup", "speedup", "{:.3f}"),  # only with eval.compare.speedup_of
)
OPTIONAL = ("speedup",)  # columns and plots left out when no entry has the metric
# filename, x metric, x axis label, whether a lower x is better
PLOTS = (
    ("pareto_live_kv.png", "mean_live_kv", "mean live KV tokens", True),
    ("pareto_kv_steps.png", "kv_token_steps", "KV x steps per completion (live KV summed over the generation)", True),
    ("pareto_throughput.png", "tokens_per_second", "aggregate throughput (tokens/s)", False),
    ("pareto_decode_time.png", "decode_seconds", "total decode time (s)", True),
    ("pareto_speedup.png", "speedup", "geometric-mean theoretical speedup", False),
)
ACCURACY = "avg_at_k"


def present(results: list[EntryResult], metric: str) -> bool:
    """Whether ``metric`` has a value in every run (an optional metric is left out otherwise)."""
    return metric not in OPTIONAL or all(getattr(run, metric) is not None for r in results for run in r.runs)


def cell(result: EntryResult, metric: str, fmt: str) -> str:
    text = fmt.format(result.mean(metric))
    return text if len(result.runs) == 1 else f"{text} ± {fmt.format(result.std(metric))}"


def table_rows(results: list[EntryResult]) -> list[list[str]]:
    """Header row, then one row per entry."""
    columns = [c for c in COLUMNS if present(results, c[0])]
    header = ["entry", "kv", "budget", *(name for _, name, _ in columns)]
    rows = [[r.label, r.kv, "" if r.budget is None else f"{r.budget} ({r.fraction:g} x {r.budget_of})",
             *(cell(r, metric, fmt) for metric, _, fmt in columns)] for r in results]
    return [header, *rows]


def markdown_table(results: list[EntryResult]) -> str:
    header, *rows = table_rows(results)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def text_table(results: list[EntryResult]) -> str:
    rows = table_rows(results)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows) + "\n"


def result_record(result: EntryResult) -> dict:
    """One line of results.jsonl: the entry, each metric's mean and std over seeds, every seed's run."""
    record = {"label": result.label, "checkpoint": result.checkpoint, "kv": result.kv, "budget_of": result.budget_of,
              "fraction": result.fraction, "budget": result.budget, "seeds": list(result.seeds),
              "num_problems": result.runs[0].num_problems, "k": result.runs[0].k}
    for metric, _, _ in COLUMNS:
        if present([result], metric):
            record[metric] = result.mean(metric)
            record[f"{metric}_std"] = result.std(metric)
    record["runs"] = [{"seed": s, **r.summary()} for s, r in zip(result.seeds, result.runs)]
    return record


def pareto_front(points: list[tuple[float, float]], lower_x_is_better: bool) -> list[int]:
    """Indices of the (x, accuracy) points no other point dominates (at least as good on both, better on
    one), ordered by x."""
    sign = 1 if lower_x_is_better else -1

    def beats(a, b):  # a dominates b
        return sign * a[0] <= sign * b[0] and a[1] >= b[1] and (sign * a[0] < sign * b[0] or a[1] > b[1])

    front = [i for i, p in enumerate(points) if not any(beats(q, p) for q in points)]
    return sorted(front, key=lambda i: points[i][0])


def label_offsets(x: list[float], y: list[float]) -> list[int]:
    """Vertical label offsets (points) so that labels of points close on the plot (same accuracy, x within 15%
    of the x range: baselines that all score 0) step up in turn instead of printing over each other."""
    span = (max(x) - min(x)) or 1.0
    offsets = [4] * len(x)
    placed: list[int] = []
    for i in sorted(range(len(x)), key=lambda i: x[i]):
        near = [j for j in placed if abs(y[j] - y[i]) < 0.03 and abs(x[j] - x[i]) < 0.15 * span]
        taken = {offsets[j] for j in near}
        offsets[i] = next(dy for dy in range(4, 4 + 11 * (len(near) + 1), 11) if dy not in taken)
        placed.append(i)
    return offsets


def write_plots(results: list[EntryResult], out_dir: Path) -> list[Path]:
    """The Pareto plots (Agg backend: no display needed); returns their paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    written = []
    y = [r.mean(ACCURACY) for r in results]
    y_err = [r.std(ACCURACY) for r in results]
    for filename, metric, xlabel, lower_better in PLOTS:
        if not present(results, metric):
            continue
        x = [r.mean(metric) for r in results]
        fig = Figure(figsize=(6.5, 4.5), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.errorbar(x, y, xerr=[r.std(metric) for r in results], yerr=y_err, fmt="o", capsize=3)
        for (xi, yi, r), dy in zip(zip(x, y, results), label_offsets(x, y)):
            ax.annotate(r.label, (xi, yi), textcoords="offset points", xytext=(4, dy), fontsize=8)
        front = pareto_front(list(zip(x, y)), lower_better)
        ax.plot([x[i] for i in front], [y[i] for i in front], "--o", color="tab:red", markerfacecolor="none",
                 markersize=11, label="Pareto frontier")  # circled, so a one-point frontier shows
        ax.margins(x=0.15, y=0.1)  # room for the labels of the outermost points
        ax.set(xlabel=xlabel, ylabel="avg@k accuracy", title=f"accuracy against {xlabel}")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / filename)
        written.append(out_dir / filename)
    return written


def write_tables(results: list[EntryResult], out_dir: Path) -> list[Path]:
    """results.md and results.jsonl in ``out_dir`` (each replaced whole, never left half-written); their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = {"results.md": markdown_table(results),
             "results.jsonl": "".join(json.dumps(result_record(r)) + "\n" for r in results)}
    for name, text in texts.items():
        staging = out_dir / f".{name}.tmp"
        staging.write_text(text)
        staging.replace(out_dir / name)
    return [out_dir / name for name in texts]


def write_report(results: list[EntryResult], out_dir: Path) -> list[Path]:
    """results.md, results.jsonl and the plots in ``out_dir``; returns every path written."""
    return [*write_tables(results, out_dir), *write_plots(results, out_dir)]


__all__ = ["markdown_table", "pareto_front", "result_record", "text_table", "write_report", "write_tables"]
