"""The report of ``benchmarks/long_rl.py``: learning curves, the arms' table, the verdict per GPU-second, accuracy vs W.

``write_report`` reads what a run left in its folder — ``run.json`` (stage seconds, the arms' exit codes and
GPU-busy seconds, every greedy evaluation) and per arm ``arms/<arm>/curve.jsonl`` (one row per RL step: its
metrics and ``wall_s`` since the arms started) and ``final.json`` — and writes ``curves.png``, ``summary.md``
and ``summary.json``. ``GpuBusy`` measures, while the arms run, how long each arm's processes kept the GPU busy.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from benchmarks.accuracy_vs_w import table as window_table
from benchmarks.pmon import ProcessSampler, busy_seconds

LAST = 3  # steps averaged for the rollout accuracy at the start and the end of a curve


class GpuBusy:
    """Seconds each arm's processes kept the GPU busy (``benchmarks/pmon.py``): a process belongs to the arm named
    by its ``env_var``. Nothing is counted where nvidia-smi is missing or shows no process of ours (e.g. in a
    container whose process ids it does not see)."""

    def __init__(self, env_var: str):
        self.prefix = f"{env_var}=".encode()
        self.sampler = ProcessSampler(label=self._arm)

    def _arm(self, pid: int) -> str | None:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            env = []
        return next((e[len(self.prefix):].decode() for e in env if e.startswith(self.prefix)), None)

    def stop(self) -> dict[str, float]:
        samples = self.sampler.stop()
        return busy_seconds(samples, self.sampler.labels.get)


# ------------------------------------------------------------------------------------------ reading


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def arm_record(folder: Path, evals: dict, arm, window: int, share: float, busy: float | None) -> dict:
    """One arm's numbers: its curve, greedy start and end, GPU-seconds, learner and rollout costs."""
    rows = read_jsonl(folder / "curve.jsonl")
    final = json.loads((folder / "final.json").read_text()) if (folder / "final.json").is_file() else None
    stepped = [r for r in rows if r.get("learner/stepped")]
    wall = final["wall_s"] if final else (rows[-1]["wall_s"] if rows else 0.0)
    policy = arm.policy(window)
    start = next((e for label, e in evals.items() if label.startswith("start-") and e["kv"] == policy), None)
    end = evals.get(f"end-{arm.name}")
    gaps = [b["wall_s"] - a["wall_s"] for a, b in zip(rows, rows[1:])]
    tokens = sum(r["rollout_tokens_per_s"] * g for r, g in zip(rows[1:], gaps))  # received between reports
    total = lambda key: sum(r.get(key, 0.0) for r in stepped)  # noqa: E731
    return {
        "arm": arm.name, "label": arm.label, "kv": policy, "window_mode": arm.window_mode,
        "steps": rows[-1]["step"] if rows else 0, "trained_steps": len(stepped), "wall_s": wall,
        "gpu_s": wall * share, "gpu_busy_s": busy, "final": final is not None,
        "curve": [(r["wall_s"], r["accuracy"]) for r in rows],
        "rollout_accuracy_first": _mean([r["accuracy"] for r in rows[:LAST]]),
        "rollout_accuracy_last": _mean([r["accuracy"] for r in rows[-LAST:]]),
        "start_accuracy": start["accuracy"] if start else None, "end_accuracy": end["accuracy"] if end else None,
        "eval_problems": (end or start or {}).get("problems"),
        "learner_step_s": statistics.median([r["learner_step_seconds"] for r in stepped]) if stepped else None,
        "learner_peak_gib": max((r["learner/peak_memory_gib"] for r in stepped if "learner/peak_memory_gib" in r),
                                default=None),
        "rollout_tok_s": tokens / sum(gaps) if gaps and sum(gaps) > 0 else None,
        "fed_per_trace": total("learner/num_tokens") / total("learner/num_traces") if stepped else None,
        "loss_per_trace": total("learner/num_loss_tokens") / total("learner/num_traces") if stepped else None,
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


# ------------------------------------------------------------------------------------------ writing


def fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def arms_table(records: list[dict]) -> str:
    lines = ["| arm | policy | loss on | steps (trained) | greedy start → end | rollout acc first → last 3 steps "
             "| GPU-s (wall × share) | GPU busy-s (pmon) | learner step s (median) | learner peak GiB "
             "| rollout tok/s | tokens fed / loss tokens per trace |", "|" + "---|" * 12]
    for r in records:
        lines.append(
            f"| {r['arm']} | {r['kv']} | {r['window_mode']} | {r['steps']} ({r['trained_steps']}) "
            f"| {fmt(r['start_accuracy'], '.3f')} → {fmt(r['end_accuracy'], '.3f')} "
            f"| {fmt(r['rollout_accuracy_first'], '.3f')} → {fmt(r['rollout_accuracy_last'], '.3f')} "
            f"| {r['gpu_s']:.0f} | {fmt(r['gpu_busy_s'], '.0f')} | {fmt(r['learner_step_s'], '.2f')} "
            f"| {fmt(r['learner_peak_gib'], '.2f')} | {fmt(r['rollout_tok_s'], '.0f')} "
            f"| {fmt(r['fed_per_trace'], '.0f')} / {fmt(r['loss_per_trace'], '.0f')} |")
    return "\n".join(lines) + "\n"


def verdict(records: list[dict]) -> str:
    """Which arm gained the most greedy accuracy (end − start) per GPU-second, and whether that gain — and its lead
    over the runner-up's — is beyond the evaluations' noise (two standard errors of the difference)."""
    scored = [r for r in records if r["end_accuracy"] is not None and r["start_accuracy"] is not None and r["gpu_s"] > 0]
    if not scored:
        return "no arm has both a start and a final greedy evaluation: no verdict\n"
    se = lambda r, p: math.sqrt(max(p * (1 - p), 1e-12) / (r["eval_problems"] or 1))  # noqa: E731
    noise = lambda r: 2 * math.hypot(se(r, r["start_accuracy"]), se(r, r["end_accuracy"]))  # noqa: E731
    gain = lambda r: r["end_accuracy"] - r["start_accuracy"]  # noqa: E731
    ranked = sorted(scored, key=lambda r: (gain(r) / r["gpu_s"], -r["gpu_s"]), reverse=True)
    lines = [f"- {r['arm']}: greedy {r['start_accuracy']:.3f} → {r['end_accuracy']:.3f} ({100 * gain(r):+.1f} pt, "
             f"noise ±{100 * noise(r):.1f}) in {r['gpu_s']:.0f} GPU-s: {100 * gain(r) / r['gpu_s']:+.3f} pt per GPU-s"
             for r in ranked]
    best = ranked[0]
    if gain(best) <= noise(best):
        head = ("**No arm's greedy accuracy rose beyond the evaluations' noise** (two standard errors of its start-to-end "
                "difference): no verdict on which trains best per GPU-second")
    else:
        head = f"**Trains best per GPU-second: {best['arm']}** ({best['label']})"
        if len(ranked) > 1:
            runner = ranked[1]
            lead, both = gain(best) - gain(runner), math.hypot(noise(best), noise(runner))
            head += (f", {100 * lead:.1f} pt more gain than {runner['arm']} " +
                     ("(beyond the noise)" if lead > both else f"(within the noise, ±{100 * both:.1f} pt: not resolved)"))
    return head + "\n\n" + "\n".join(lines) + "\n"


def write_curves(records: list[dict], path: Path) -> None:
    """Rollout accuracy per step against wall seconds, one line per arm; greedy start (hollow) and end (filled)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, r in enumerate(records):
        color = f"C{i}"
        if r["curve"]:
            xs, ys = zip(*r["curve"])
            ax.plot(xs, ys, ".-", color=color, alpha=0.85, markersize=4, label=f"{r['arm']}: {r['label']}")
        if r["start_accuracy"] is not None:
            ax.plot([0], [r["start_accuracy"]], "o", mfc="none", color=color, markersize=9)
        if r["end_accuracy"] is not None:
            ax.plot([r["wall_s"]], [r["end_accuracy"]], "o", color=color, markersize=9)
    ax.set(xlabel="wall seconds since the arms started (arms that ran together share one GPU)", ylabel="accuracy",
           title="rollout accuracy per RL step (lines); greedy eval at start (o) and end (●)", ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def write_report(out: Path, arms, window: int) -> str:
    """``curves.png``, ``summary.md`` and ``summary.json`` in ``out`` from the run's files; returns the summary."""
    run = json.loads((out / "run.json").read_text())
    evals = run["evals"]
    arms = [a for a in arms if a.name in run["arms"]]  # the arms this run (or the runs merged into it) ran
    ran = {a.name: run["arms"][a.name] for a in arms}
    # each arm is charged wall x its share of the GPU: 1 / the number of arms that ran beside it (older runs: all)
    records = [arm_record(out / "arms" / a.name, evals, a, window, ran[a.name].get("share", 1 / len(arms)),
                          ran[a.name].get("gpu_busy_s")) for a in arms]
    write_curves(records, out / "curves.png")
    windows = [e for label, e in evals.items() if label.startswith("w-")]
    seconds = ", ".join(f"{k} {v:.0f} s" for k, v in run["seconds"].items())
    together = sorted({round(1 / r.get("share", 1 / len(arms))) for r in ran.values()})
    text = (f"# RL where T >> W: {len(arms)} arms on one GPU ({' or '.join(map(str, together))} at a time), "
            f"{run['arm_seconds']:.0f} s each ({seconds})\n\n"
            + arms_table(records) + "\n" + verdict(records)
            + "\nGreedy accuracy of the ps-trunc arm's final weights per window (accuracy vs W):\n\n"
            + (window_table(windows) if windows else "(not run)\n"))
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(json.dumps({"arms": records, "accuracy_vs_w": windows, "run": run}, indent=1)
                                      + "\n")
    return text
