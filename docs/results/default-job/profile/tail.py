import time, sys
T0=time.time()
def mark(name): print(f"[phase {time.time()-T0:6.2f}] {name}", flush=True)
import ray
import sliderl.cluster.run.driver as d
def wrap(obj, attr, label):
    f=getattr(obj, attr)
    def g(*a, **k):
        mark(label+" start"); r=f(*a, **k); mark(label+" end"); return r
    setattr(obj, attr, g)
wrap(ray, "shutdown", "ray.shutdown"); wrap(d, "release", "release"); wrap(d.Session, "_evaluate", "evaluate"); wrap(d, "_sessions", "sessions")
import sliderl.cluster.observe.monitor as m
wrap(m.Monitor, "finish", "monitor.finish")
from sliderl.cluster.cli import main
rc = main(["train", *sys.argv[1:]]); mark("main returned"); sys.exit(rc)
