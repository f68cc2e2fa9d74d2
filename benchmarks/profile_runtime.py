"""Where a warm answer spends its time: the certified PLD program, and 100 calibration targets.

Issue 32's warm targets that are still missed (the PLD at 20x dp-accounting and 100x
prv-accountant; 100 calibration targets within 5 s) are set by the run time of compiled
programs, not by compiling them (``program_kernels.py`` measures that). This script says where
that run time goes, warm, in one process:

1. The front door's single-setting PLD program (``pld.accountant.single_program``: compose, then
   query) for DP-SGD at q = 0.01, sigma = 1, delta = 1e-5 and T = 10^3, 10^4, 10^5, against the
   same computation as two programs (compose; query the composed PLD): milliseconds each and
   whether both give the same upper. Then, under JAX's profiler, the T = 10^4 program's XLA
   kernels: their summed busy time against the wall time (above 1: kernels ran side by side
   on several cores) and the costliest kernels.
2. ``calibrate.noise_multiplier`` for 100 epsilon targets (1...4, delta 1e-5, q 0.01,
   T = 1,000): the time of each stage its progress reports (start and plans, the certified
   search, the front door's check) and how many certified values each setting's search read.

3. The allocator (``--allocator`` runs this part alone): the single-setting program at
   T = 10^3, 10^4, 10^5, warm, in fresh processes with glibc's default malloc and with
   ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``: milliseconds and page faults a call. XLA:CPU
   allocates a program's temporaries anew at every call; glibc maps an allocation over 32 MiB
   fresh from the kernel each time, so each call faults in every page of it (4 KiB at a time,
   or 2 MiB with transparent huge pages, which that tunable asks for).

Run (``pip install -e ".[bench]"``; the profiler needs nothing more)::

    python benchmarks/profile_runtime.py [--allocator]
    XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false python benchmarks/profile_runtime.py
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

from jaxacct import calibrate, dpsgd_composition  # noqa: E402
from jaxacct.pld import make_plan  # noqa: E402
from jaxacct.pld.accountant import single_program  # noqa: E402
from jaxacct.pld.distribution import compose  # noqa: E402
from jaxacct.pld.query import epsilon_from_pld  # noqa: E402

Q, SIGMA, DELTA = 0.01, 1.0, 1e-5
REPEATS = 20


def warm_ms(fn, *args, repeats=REPEATS):
  """The median wall time of ``fn(*args)`` in milliseconds, after two calls."""
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


_compose = jax.jit(compose)
_query = jax.jit(lambda pld, delta: epsilon_from_pld(pld, delta))


def two_programs(composition, delta, plan):
  """The single program's computation as two compiled programs: compose, then query."""
  return _query(_compose(composition, plan), delta)


def program_rows():
  """(T, FFT size, fused ms, two programs ms, same upper) for each number of steps."""
  rows = []
  for steps in (1_000, 10_000, 100_000):
    comp = dpsgd_composition(SIGMA, Q, steps)
    plan = make_plan(comp, DELTA)
    fused = single_program("epsilon")
    same = float(fused(comp, DELTA, plan).upper) == float(two_programs(comp, DELTA, plan).upper)
    rows.append((steps, plan.fft_size, warm_ms(fused, comp, DELTA, plan),
                 warm_ms(two_programs, comp, DELTA, plan), same))
  return rows


def kernel_profile(steps=10_000, calls=5, top=12):
  """(wall ms, summed kernel ms, [(kernel ms, name)]) of one warm call, from a profiler trace."""
  comp = dpsgd_composition(SIGMA, Q, steps)
  plan = make_plan(comp, DELTA)
  fused = single_program("epsilon")
  warm_ms(fused, comp, DELTA, plan, repeats=2)
  with tempfile.TemporaryDirectory() as folder:
    start = time.perf_counter()
    with jax.profiler.trace(folder, create_perfetto_trace=True):
      for _ in range(calls):
        jax.block_until_ready(fused(comp, DELTA, plan))
      wall = (time.perf_counter() - start) / calls
    path = glob.glob(os.path.join(folder, "**", "*perfetto_trace.json.gz"), recursive=True)[0]
    with gzip.open(path) as file:
      events = json.load(file)
  events = events["traceEvents"] if isinstance(events, dict) else events
  busy = collections.Counter()
  for event in events:  # (XLA's kernels; not the executor's, the runtime's or Python's spans)
    name = event.get("name", "")
    if event.get("ph") == "X" and not name.startswith(("Thunk", "$", "PjitFunction", "Common")):
      busy[name] += event.get("dur", 0.0) / 1e3 / calls
  return 1e3 * wall, sum(busy.values()), [(ms, name) for name, ms in busy.most_common(top)]


def calibration_stages(targets=np.linspace(1.0, 4.0, 100), steps=1_000, repeats=3):
  """([(stage, seconds)] of the last warm call, its total, the reads per setting (a count of
  settings for each number of reads))."""
  stamps, reads = [], []
  search = calibrate._search  # (read-only: the reads each search made)

  def counted(*args, **kwargs):
    found = search(*args, **kwargs)
    reads.append(np.asarray(found.reads, int))
    return found

  calibrate._search = counted
  try:
    for _ in range(repeats):
      stamps.clear()
      reads.clear()
      start = time.perf_counter()
      calibrate.noise_multiplier(targets, DELTA, Q, steps,
                                 progress=lambda line: stamps.append((time.perf_counter(), line)))
      end = time.perf_counter()
  finally:
    calibrate._search = search
  ends = [t for t, _ in stamps[1:]] + [end]
  stages = [(line, t_end - t) for (t, line), t_end in zip(stamps, ends)]
  return stages, end - start, np.bincount(np.concatenate(reads))


_WARM_CALLS = """
import json, resource, statistics, sys, time
import jax
jax.config.update("jax_enable_x64", True)
from jaxacct import dpsgd_composition
from jaxacct.pld import make_plan
from jaxacct.pld.accountant import single_program
steps, calls = int(sys.argv[1]), int(sys.argv[2])
comp = dpsgd_composition({sigma}, {q}, steps)
plan, run = make_plan(comp, {delta}), single_program("epsilon")
for _ in range(3):
  upper = float(run(comp, {delta}, plan).upper)
faults, times = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, []
for _ in range(calls):
  start = time.perf_counter()
  jax.block_until_ready(run(comp, {delta}, plan))
  times.append(time.perf_counter() - start)
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / calls
print(json.dumps([1e3 * statistics.median(times), faults, upper]))
""".format(sigma=SIGMA, q=Q, delta=DELTA)

TUNABLE = "glibc.malloc.hugetlb=1"


def allocator_rows(rounds=2):
  """(T, [(ms, faults a call, upper)] with glibc's defaults, the same with ``TUNABLE``), each
  the best median of ``rounds`` fresh processes, alternated."""
  rows = []
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
  for steps in (1_000, 10_000, 100_000):
    runs = {"": [], TUNABLE: []}
    for _ in range(rounds):
      for tunable, found in runs.items():
        env = dict(os.environ, GLIBC_TUNABLES=tunable, PYTHONPATH=path)
        out = subprocess.run([sys.executable, "-c", _WARM_CALLS, str(steps),
                              str(REPEATS if steps < 100_000 else 5)], env=env, check=True,
                             capture_output=True, text=True).stdout
        found.append(json.loads(out.splitlines()[-1]))
    rows.append((steps, [min(found) for found in runs.values()]))
  return rows


def print_allocator():
  print(f"\n3. the allocator: the single-setting program warm, fresh processes "
        f"(GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r} in this one)")
  print(f"{'T':>8s} {'default ms':>11s} {'faults':>8s} {TUNABLE + ' ms':>29s} {'faults':>8s}"
        f"  same upper")
  for steps, ((ms, faults, upper), (ms_t, faults_t, upper_t)) in allocator_rows():
    print(f"{steps:8,d} {ms:11.2f} {faults:8.0f} {ms_t:29.2f} {faults_t:8.0f}  {upper == upper_t}")


def main():
  if "--allocator" in sys.argv[1:]:
    print_allocator()
    return
  print(f"machine: {platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}, "
        f"load {os.getloadavg()[0]:.2f}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print(f"\n1. the single-setting PLD program, q {Q}, sigma {SIGMA}, delta {DELTA} (warm, median "
        f"of {REPEATS})")
  print(f"{'T':>8s} {'FFT':>9s} {'one program ms':>15s} {'two programs ms':>16s}  same upper")
  for steps, fft, fused, split, same in program_rows():
    print(f"{steps:8,d} {fft:9,d} {fused:15.2f} {split:16.2f}  {same}")
  wall, busy, kernels = kernel_profile()
  print(f"\nT = 10,000, one program under the profiler: wall {wall:.2f} ms, kernels busy "
        f"{busy:.2f} ms (x{busy / wall:.2f} of the wall)")
  for ms, name in kernels:
    print(f"  {ms:7.2f} ms  {name}")
  stages, total, reads = calibration_stages()
  print(f"\n2. 100 targets (epsilon 1...4) in one calibration call, warm: {total:.2f} s")
  for line, seconds in stages:
    print(f"  {seconds:6.2f} s  {line}")
  print("  settings by certified values read: "
        + ", ".join(f"{n} reads: {c}" for n, c in enumerate(reads) if c)
        + f" ({int(np.dot(np.arange(reads.size), reads))} in all)")
  print_allocator()


if __name__ == "__main__":
  main()
