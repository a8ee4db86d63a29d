"""Per-seed ratios of TIP-SFT and TIP to Dense in the GPU-scale arm, each seed against its own Dense (seed 0 ran at
4ae9f64, seeds 1 and 2 at 1bbeb04: wall times compare within a seed, not across). Writes ratios.md beside it.
    python docs/results/tip/h200-3-seeds/ratios.py"""
import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEEDS = (0, 1, 2)
KEYS = ("avg_at_k", "mean_live_kv", "peak_live_kv", "kv_token_steps", "generated_tokens", "tokens_per_second",
        "decode_seconds")

rows = {}
for s in SEEDS:
    for line in (HERE / f"s{s}" / "eval" / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows.setdefault(r["label"], {})[s] = r

lines = ["| entry | quantity | / Dense per seed (0, 1, 2) | mean ± sample SD |", "|---|---|---|---|"]
for label in ("TIP-SFT", "TIP"):
    for key in KEYS:
        if key == "avg_at_k":  # a difference in points, not a ratio
            d = [rows[label][s][key] - rows["Dense"][s][key] for s in SEEDS]
            lines.append(f"| {label} | avg@k - Dense's | {', '.join(f'{x:+.3f}' for x in d)} | "
                         f"{statistics.mean(d):+.3f} ± {statistics.stdev(d):.3f} |")
            continue
        r = [rows[label][s][key] / rows["Dense"][s][key] for s in SEEDS]
        lines.append(f"| {label} | {key} | {', '.join(f'{x:.3f}' for x in r)} | "
                     f"{statistics.mean(r):.3f} ± {statistics.stdev(r):.3f} |")
(HERE / "ratios.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
