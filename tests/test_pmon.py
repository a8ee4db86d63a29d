"""benchmarks/pmon.py: nvidia-smi pmon's lines, busy seconds per group of processes, and colocate.py's per-role
utilisation (the one-GPU recipe's engine and learner told apart by their process ids)."""

import subprocess
import sys
import textwrap
import time

import pytest

from benchmarks.colocate import role_util
from benchmarks.pmon import ProcessSampler, busy_seconds, parse_pmon

# pmon -s u as a driver prints it (header, units line, one line per process and second; "-" when idle; the
# command last), pids 11 (an engine) and 22 (a learner) on GPU 0, 33 on GPU 1
PLAIN = textwrap.dedent("""\
    # gpu         pid   type     sm    mem    enc    dec    jpg    ofa    command
    # Idx           #    C/G      %      %      %      %      %      %    name
        0         11     C     60     20      -      -      -      -    ray::RolloutWorker
        0         22     C      -      -      -      -      -      -    ray::Learner
        1         33     C      7      1      -      -      -      -
        0         11     C     40     10      -      -      -      -    ray::RolloutWorker
        0         22     C     30      5      -      -      -      -    ray::Learner
    """).splitlines()


def test_pmon_lines_by_hand():
    # catches: columns read by position instead of the header's names (sm taken from the mem column: 20 + 10),
    # an idle "-" sample counted, a line without its command dropped (pid 33), the time not from arrival
    samples = parse_pmon(PLAIN, arrival=[float(i) for i in range(len(PLAIN))])
    assert samples == [(2.0, 11, 60.0), (4.0, 33, 7.0), (5.0, 11, 40.0), (6.0, 22, 30.0)]


def test_busy_seconds_and_role_util_by_hand():
    # catches: sm % not divided by 100, samples outside the timed window counted (the warm-up's compile), a
    # process of another role (or of no role) counted, the window taken from the first report instead of
    # the warm-up's last step's (as colocate's step_numbers time them: a timed step runs from the report before
    # it). Samples: engine 11 at 60% and 50% (t=1, 7: the warm-up), 40% and 80% (t=12, 18); learner 22 at 30% (t=15);
    # 99 no role. Reports at t = 5, 10, 30, warm-up 2: the timed step runs from the 2nd report, 10..30 = 20 s;
    # engine busy 0.4 + 0.8 = 1.2 s = 6% of the GPU, learner 0.3 s = 1.5%
    samples = [(1.0, 11, 60.0), (7.0, 11, 50.0), (12.0, 11, 40.0), (15.0, 22, 30.0), (18.0, 11, 80.0),
               (19.0, 99, 100.0)]
    assert busy_seconds(samples, {11: "a"}.get) == {"a": pytest.approx(2.3)}
    got = role_util(samples, {"rollout": [11], "learner": [22]}, [5.0, 10.0, 30.0], warmup=2)
    assert got["rollout"] == {"busy_s": pytest.approx(1.2), "util_pct": pytest.approx(6.0)}
    assert got["learner"] == {"busy_s": pytest.approx(0.3), "util_pct": pytest.approx(1.5)}
    assert role_util(samples, {"rollout": [11]}, [5.0, 10.0], warmup=2) == {}  # no timed step


@pytest.mark.gpu
def test_a_busy_child_is_seen_busy_and_an_idle_one_is_not():
    # catches: pmon's samples not reaching us on the GPU machine (a command its driver refuses, process ids of
    # another namespace, lines read by the wrong columns): a child running matmuls for 6 s must show several
    # busy seconds; one holding a CUDA context while sleeping must show (nearly) none
    loop = ("import torch, time; x = torch.randn(8192, 8192, device='cuda'); t = time.time()\n"
            "while time.time() - t < 6: x = (x @ x).clamp_(-1, 1)\ntorch.cuda.synchronize()")
    idle = "import torch, time; torch.zeros(1, device='cuda'); time.sleep(6)"
    sampler = ProcessSampler()
    busy, rest = (subprocess.Popen([sys.executable, "-c", code]) for code in (loop, idle))
    busy.wait(timeout=120)
    rest.wait(timeout=120)
    time.sleep(2)
    got = busy_seconds(sampler.stop(), {busy.pid: "busy", rest.pid: "idle"}.get)
    assert got.get("busy", 0.0) > 2.0 and got.get("idle", 0.0) < 0.5, got
