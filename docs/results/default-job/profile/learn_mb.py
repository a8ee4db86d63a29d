import sys, time, dataclasses, torch
from collections import defaultdict
torch.set_num_threads(1)
from sliderl.cluster.storage.trace_log import TraceLog
from sliderl.core.trace import traces_from_table
from sliderl.cluster.config.base import load_config
from sliderl.cluster.config.train import TrainConfig
from sliderl.trainer.learner import Learner
R = "/work/fresh4/runs/train-20261204-160416"
cfg = load_config(TrainConfig, R + "/config.yaml", [])
traces = traces_from_table(TraceLog(R).read())
groups = defaultdict(list)
for t in traces: groups[t.group_id].append(t)
groups = list(groups.values())[:8 * 12]
model = "/tmp/tmp.cuyoy1AAso/.cache/sliderl/warmstart/sft-04bf97d45315"
for mb in [int(x) for x in sys.argv[1:]]:
    la = dataclasses.replace(cfg.learner, micro_batch_tokens=mb)
    la = {f.name: getattr(la, f.name) for f in dataclasses.fields(type(cfg.learner).__mro__[1])}
    from sliderl.trainer.learner_args import LearnerArgs
    L = Learner(model, LearnerArgs(**la))
    ts = []
    for s in range(12):
        t = time.perf_counter(); L.step(groups[s * 8:(s + 1) * 8]); ts.append(time.perf_counter() - t)
    print(mb, "mean s/step (steps 3-12)", round(sum(ts[2:]) / 10, 3), [round(x, 2) for x in ts[:3]], flush=True)
