import time, sys
T0=time.time()
def mark(name): print(f"[phase {time.time()-T0:6.2f}] {name}", flush=True)
import sliderl.cluster.run.driver as d
def wrap(obj, attr, label):
    f=getattr(obj, attr)
    def g(*a, **k):
        mark(label+" start"); r=f(*a, **k); mark(label+" end"); return r
    setattr(obj, attr, g)
wrap(d, "prepare", "prepare"); wrap(d, "connect", "connect"); wrap(d, "initial_model", "initial_model")
wrap(d, "reserve", "reserve"); wrap(d, "make_learner", "make_learner")
wrap(d.WorkerPool, "start", "pool.start"); wrap(d.Session, "_evaluate", "evaluate")
import sliderl.cluster.observe.monitor as m
wrap(m.Monitor, "__init__", "Monitor"); wrap(m.Monitor, "finish", "monitor.finish")
wrap(d.Session, "_step", "step")
from sliderl.cluster.cli import main
mark("imports done")
sys.exit(main(["train", *sys.argv[1:]]))
