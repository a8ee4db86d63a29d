import sys, time, dataclasses, torch
torch.set_num_threads(2)
from sliderl.cluster.config.base import load_config
from sliderl.cluster.config.train import TrainConfig
from sliderl.cluster.run.plan import warm_start_examples, prompt_format_of
from sliderl.trainer.sft import run_sft
over = sys.argv[1:]
cfg = load_config(TrainConfig, None, ["run_dir=/tmp/prof/run", *over])
mp = cfg.model.resolve()
pf = prompt_format_of(cfg, mp)
t0=time.perf_counter()
tr, ho = warm_start_examples(cfg, mp, pf)
print("examples", len(tr), len(ho), time.perf_counter()-t0)
sft = dataclasses.replace(cfg.warmstart.sft, summary_tool=cfg.engine.summary_tool)
r = run_sft(mp, "/tmp/prof/out", tr, ho, cfg.engine.kv, cfg.warmstart.learner, sft)
print(r.line(), r.checks[-5:])
