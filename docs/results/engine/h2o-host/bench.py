"""Host time of adding one decode step's page mass to every sequence (h2o), at the H200 row's shape: 219 sequences
x 260 block-table columns. Baseline: the per-page dict loop HeavyHitters used until a7b351d (copied here, since it
is gone from the code), fed lists as read_back gave them; against HeavyHitters.add on the numpy rows read_back
gives now. Same inputs, one thread, median of 5 rounds of 20 steps.

    python docs/results/engine/h2o-host/bench.py > docs/results/engine/h2o-host/out.txt
"""

import statistics
import time

import numpy as np

from sliderl.rollout.heavy_hitters import HeavyHitters

S, M, ROUNDS, STEPS = 219, 260, 5, 20
rng = np.random.default_rng(0)
pages = np.tile(np.arange(M, dtype=np.int32) + 8000, (S, 1))
pages[:, -3:] = -1  # padding columns
values = rng.random((S, M), dtype=np.float32)
live = {p: 0 for p in range(8000, 8000 + M)}


def old_add(mass: dict, page_row, value_row) -> None:  # the loop of HeavyHitters.add before a7b351d
    for page, value in zip(page_row.tolist(), value_row):
        if page >= 0 and page in live:
            mass[page] = mass.get(page, 0.0) + value


def timed(step) -> float:
    runs = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(STEPS):
            step()
        runs.append((time.perf_counter() - start) / STEPS * 1e3)
    return statistics.median(runs)


dicts = [{} for _ in range(S)]
heavy = [HeavyHitters(256, 128, 10) for _ in range(S)]
old = timed(lambda: [old_add(dicts[i], pages[i], row) for i, row in enumerate(values.tolist())])
new = timed(lambda: [heavy[i].add(pages[i], values[i], 9000) for i in range(S)])
same = all(np.allclose([d.get(p, 0.0) for p in range(8000, 8000 + M - 3)], h.mass[8000:8000 + M - 3])
           for d, h in zip(dicts, heavy))
print(f"{S} sequences x {M} columns, median of {ROUNDS} x {STEPS} steps")
print(f"dict loop (before a7b351d)  {old:.2f} ms per step")
print(f"numpy rows (HeavyHitters)   {new:.2f} ms per step   ({old / new:.1f}x less)")
print(f"same accumulated mass: {same}")
