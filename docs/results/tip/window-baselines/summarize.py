"""Mean ± sample SD over seeds of every entry in this folder's evaluation rows (python summarize.py > summary.md)."""
import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rows(pattern: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for path in sorted(HERE.glob(pattern)):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out.setdefault(row["label"], []).append(row["runs"][0] | {"kv": row["kv"]})
    return out


def ms(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


print("| variant | entry | kv | avg@4 (mean ± sample SD, 3 seeds) | per seed | mean live KV | peak live KV |")
print("|---|---|---|---|---|---|---|")
for variant in ("last", "prologue"):
    for group in (f"{variant}/s*/eval-results.jsonl", f"dense-under-eviction/{variant}-s*/results.jsonl"):
        for label, runs in rows(group).items():
            acc = [r["avg_at_k"] for r in runs]
            print(f"| {variant} | {label} | {runs[0]['kv']} | {ms(acc)} | {', '.join(f'{a:.3f}' for a in acc)} | "
                  f"{statistics.mean(r['mean_live_kv'] for r in runs):.1f} | {max(r['peak_live_kv'] for r in runs)} |")
