"""Reward against wall seconds for the time-matched truncated vs whole-trace arms (2 seeds), from each arm's
metrics.jsonl beside this file: python docs/results/prefix-sliding/long-rl-cpu-time-matched/plot.py"""
import json
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

HERE = Path(__file__).resolve().parent


def rows(arm: str) -> list[dict]:
    return [json.loads(line) for line in (HERE / arm / "metrics.jsonl").read_text().splitlines() if line.strip()]


def smooth(values: list[float], n: int = 10) -> list[float]:
    return [sum(values[max(0, i - n + 1):i + 1]) / len(values[max(0, i - n + 1):i + 1]) for i in range(len(values))]


fig = Figure(figsize=(9, 3.8), dpi=100)
FigureCanvasAgg(fig)
axes = fig.subplots(1, 2, sharey=True)
for ax, seed in zip(axes, (0, 1)):
    for arm, color in ((f"trunc-time-s{seed}", "C1"), (f"whole-s{seed}", "C0")):
        r = [x for x in rows(arm) if "reward" in x and "elapsed_s" in x]
        label = ("truncated (k = 4, loss on the last W)" if arm.startswith("trunc") else "whole trace") + f": {len(r)} steps"
        ax.plot([x["elapsed_s"] for x in r], smooth([x["reward"] for x in r]), color=color, label=label)
    ax.set(title=f"seed {seed}", xlabel="seconds since the first step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
axes[0].set_ylabel("reward (mean of 10 steps)")
fig.suptitle("GRPO on traces ~10 W long, 2-core CPU: the truncated arm given at least the whole arm's wall time", fontsize=9)
fig.tight_layout()
fig.savefig(HERE / "reward_vs_seconds.png")
print(HERE / "reward_vs_seconds.png")
