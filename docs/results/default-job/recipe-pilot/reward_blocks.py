"""Training reward (temperature 1, the runs' own rollouts) averaged over blocks of 12 steps, per run folder."""
import json
import sys
from pathlib import Path

for run in sys.argv[1:]:
    rows = {}
    for line in (Path(run) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "reward" in row:
            rows[row["step"]] = row["reward"]
    rewards = [rows[s] for s in sorted(rows)]
    blocks = [round(sum(rewards[i:i + 12]) / len(rewards[i:i + 12]), 3) for i in range(0, len(rewards), 12)]
    print(f"{run}: {len(rewards)} steps, blocks of 12: {blocks}")
