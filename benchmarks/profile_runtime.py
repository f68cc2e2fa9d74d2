"""Where a warm answer spends its time: the certified PLD program, and 100 calibration targets.

Issue 32's warm targets that are still missed (the PLD at 20x dp-accounting and 100x
prv-accountant; 100 calibration targets within 5 s) are set by the run time of compiled
programs, not by compiling them (``program_kernels.py`` measures that). This script says where
that run time goes, warm, in one process:

1. The front door's single-setting PLD program (``pld.accountant.single_program``: compose, then
   query) on ten settings (DP-SGD at T = 10^3 to 10^5, a symmetric one, one of two entries), as
   one compiled program, as two (compose; query the composed PLD) and as the program on the PLD
   kept as its band (no inverse transform, queries in O(band)): the temporaries of the one
   program and of the query alone (XLA's ``memory_analysis``, beside the estimate the front
   door decides by: the band where the one passes glibc's 32 MiB and the plan drops a band,
   else two programs where the query does not pass it), milliseconds each, and how far the
   uppers differ. Then, under JAX's profiler, the XLA
   kernels of the one program at T = 10^4: their summed busy time against the wall time (above
   1: kernels ran side by side on several cores) and the costliest kernels.
2. ``calibrate.noise_multiplier`` for 100 epsilon targets (1...4, delta 1e-5, q 0.01,
   T = 1,000): the time of each stage its progress reports (start and plans, the certified
   search, the front door's check) and how many certified values each setting's search read.

(``--programs`` runs part 1's table alone, ``--targets`` part 2 alone.)

3. The allocator (``--allocator`` runs this part alone): the front door's single-setting
   accountant (one program, or two at T = 10^4) at T = 10^3, 10^4, 10^5, warm, in fresh
   processes with glibc's default malloc and with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``:
   milliseconds and page faults a call. XLA:CPU allocates a program's temporaries anew at every
   call; glibc maps an allocation over 32 MiB fresh from the kernel each time, so each call
   faults in every page of it (4 KiB at a time, or 2 MiB with transparent huge pages, which
   that tunable asks for).

4. The kernel timeline (``--timeline`` runs this part alone): the front door's single-setting
   program at T = 10^3 (one program) and T = 10^4 (from the PLD's band) in one warm call under
   JAX's profiler: each kernel of at least 0.15 ms with its start, length and thread, in the
   order they ran. What lies on one chain (one kernel waiting for the last) sets the wall time;
   kernels on the second thread at the same time are free.

Run (``pip install -e ".[bench]"``; the profiler needs nothing more)::

    python benchmarks/profile_runtime.py [--programs | --targets | --allocator | --timeline]
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

from jaxacct import calibrate, dpsgd_composition, models  # noqa: E402
from jaxacct._numerics import scoped_gradients  # noqa: E402
from jaxacct.composition import Composition  # noqa: E402
from jaxacct.pld import accountant, make_plan  # noqa: E402
from jaxacct.pld.accountant import _band_single, _epsilon_single, single_program  # noqa: E402
from jaxacct.pld.distribution import compose  # noqa: E402
from jaxacct.pld.query import epsilon_from_pld  # noqa: E402

Q, SIGMA, DELTA = 0.01, 1.0, 1e-5
REPEATS = 20


def interleaved_ms(fns, *args, repeats=REPEATS):
  """The median wall time in milliseconds of each of ``fns`` on ``args``, their calls taken in
  turn (so that a drifting machine slows them alike), after two calls each."""
  times = [[] for _ in fns]
  for round_ in range(repeats + 2):
    for fn, found in zip(fns, times):
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      if round_ >= 2:
        found.append(time.perf_counter() - start)
  return [1e3 * statistics.median(found) for found in times]


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


_single = jax.jit(scoped_gradients(_epsilon_single))  # (one program, whatever the grid)
_banded = jax.jit(scoped_gradients(_band_single("epsilon")))


def band_program(composition, delta, plan):
  """The bounds of the program on the PLD kept as its band (whatever its flag says)."""
  return _banded(composition, delta, plan)[0]

# DP-SGD settings (sigma, q, T) and two others whose single programs' temporaries fall on both
# sides of glibc's 32 MiB (symmetric: one direction; two entries).
SETTINGS = {f"dpsgd {s:g}, {q:g}, {t:g}": dpsgd_composition(s, q, t) for s, q, t in (
    (1, 0.01, 1e3), (1, 0.01, 5e3), (1, 0.01, 1e4), (1, 0.01, 2e4), (1, 0.01, 1e5),
    (1.1, 0.004, 2e4), (2, 0.1, 5e3), (0.7, 0.05, 3e3))}
SETTINGS["gaussian 30 x 1e4"] = Composition.of((models.Gaussian(30.0), 10_000))
SETTINGS["dpsgd 1.2, 0.02, 7e3 + laplace"] = Composition.of(
    (models.PoissonSampled(models.Gaussian(1.2), 0.02), 7_000), (models.Laplace(20.0), 5))


def program_rows():
  """(setting, FFT size, the single program's temporaries in MB: measured and estimated, the
  query's: measured and estimated, one program ms, two programs ms, the band's program ms, the
  front door's choice, the uppers' largest relative difference) for each setting."""
  rows = []
  for name, comp in SETTINGS.items():
    plan = make_plan(comp, DELTA)
    args = (comp, DELTA, plan)
    single = _single.trace(*args).lower().compile().memory_analysis().temp_size_in_bytes
    query = _query.trace(_compose(comp, plan), DELTA).lower().compile().memory_analysis()
    estimated = accountant._temporaries(comp, plan)
    programs = (_single, two_programs, band_program, single_program("epsilon"))
    uppers = [float(fn(*args).upper) for fn in programs]
    repeats = 2 * REPEATS if plan.fft_size < 10**6 else 6
    rows.append((name, plan.fft_size, single / 1e6, estimated[0] / 1e6,
                 query.temp_size_in_bytes / 1e6, estimated[1] / 1e6,
                 *interleaved_ms(programs[:3], *args, repeats=repeats),
                 "band" if accountant._as_band(comp, plan) else
                 "two" if accountant._in_two_programs(comp, plan) else "one",
                 max(uppers) / min(uppers) - 1))
  return rows


def _kernel_events(fn, args, calls):
  """XLA's kernel spans ({name, ts, dur, tid}, microseconds) of ``calls`` warm calls of
  ``fn(*args)`` under JAX's profiler (not the executor's, the runtime's or Python's spans), and
  the mean wall time of a call in milliseconds."""
  with tempfile.TemporaryDirectory() as folder:
    start = time.perf_counter()
    with jax.profiler.trace(folder, create_perfetto_trace=True):
      for _ in range(calls):
        jax.block_until_ready(fn(*args))
      wall = (time.perf_counter() - start) / calls
    path = glob.glob(os.path.join(folder, "**", "*perfetto_trace.json.gz"), recursive=True)[0]
    with gzip.open(path) as file:
      events = json.load(file)
  events = events["traceEvents"] if isinstance(events, dict) else events
  skip = ("Thunk", "$", "PjitFunction", "Common")
  return [e for e in events if e.get("ph") == "X" and not e.get("name", "").startswith(skip)
          ], 1e3 * wall


def kernel_profile(steps=10_000, calls=5, top=12):
  """(wall ms, summed kernel ms, [(kernel ms, name)]) of one warm call, from a profiler trace."""
  comp = dpsgd_composition(SIGMA, Q, steps)
  plan = make_plan(comp, DELTA)
  warm_ms(_single, comp, DELTA, plan, repeats=2)
  events, wall = _kernel_events(_single, (comp, DELTA, plan), calls)
  busy = collections.Counter()
  for event in events:
    busy[event["name"]] += event.get("dur", 0.0) / 1e3 / calls
  return wall, sum(busy.values()), [(ms, name) for name, ms in busy.most_common(top)]


def kernel_timeline(steps, least_ms=0.15):
  """The single-setting program in one warm call (from the PLD's band where the front door
  answers from it, else as one program; the two-program route is not traced here): [(start ms, kernel ms, thread, name)] of its kernels of at least ``least_ms``,
  in the order they ran, and the call's span in ms (first kernel's start to last one's end)."""
  comp = dpsgd_composition(SIGMA, Q, steps)
  plan = make_plan(comp, DELTA)
  fn = _banded if accountant._as_band(comp, plan) else _single
  warm_ms(fn, comp, DELTA, plan, repeats=2)
  events, _ = _kernel_events(fn, (comp, DELTA, plan), 1)
  first = min(e["ts"] for e in events)
  span = max(e["ts"] + e["dur"] for e in events) - first
  threads = {tid: i for i, tid in enumerate(sorted({e["tid"] for e in events}))}
  rows = [((e["ts"] - first) / 1e3, e["dur"] / 1e3, threads[e["tid"]], e["name"])
          for e in sorted(events, key=lambda e: e["ts"]) if e["dur"] >= 1e3 * least_ms]
  return rows, span / 1e3


def print_timeline():
  for steps in (1_000, 10_000):
    rows, span = kernel_timeline(steps)
    print(f"\n4. T = {steps:,}: the single-setting program's kernels of >= 0.15 ms in one warm "
          f"call (its kernels span {span:.2f} ms)")
    print(f"{'start ms':>9s} {'ms':>6s} {'thread':>6s}  kernel")
    for start, ms, thread, name in rows:
      print(f"{start:9.2f} {ms:6.2f} {thread:6d}  {name}")


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


def print_targets():
  stages, total, reads = calibration_stages()
  print(f"\n2. 100 targets (epsilon 1...4) in one calibration call, warm: {total:.2f} s")
  for line, seconds in stages:
    print(f"  {seconds:6.2f} s  {line}")
  print("  settings by certified values read: "
        + ", ".join(f"{n} reads: {c}" for n, c in enumerate(reads) if c)
        + f" ({int(np.dot(np.arange(reads.size), reads))} in all)")


def main():
  if "--allocator" in sys.argv[1:]:
    print_allocator()
    return
  if "--timeline" in sys.argv[1:]:
    print_timeline()
    return
  if "--targets" in sys.argv[1:]:
    print_targets()
    return
  print(f"machine: {platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}, "
        f"load {os.getloadavg()[0]:.2f}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print(f"\n1. the single-setting PLD program, delta {DELTA} (warm, calls in turn, median "
        f"of {2 * REPEATS}); "
        f"temporaries in MB, measured / the front door's estimate")
  print(f"{'setting':>30s} {'FFT':>9s} {'temps one':>14s} {'temps query':>14s} {'one ms':>8s} "
        f"{'two ms':>8s} {'band ms':>8s}  front door  uppers differ by")
  for (name, fft, single, single_est, query, query_est, one, two, band, chosen,
       spread) in program_rows():
    print(f"{name:>30s} {fft:9,d} {single:6.1f} / {single_est:5.1f} {query:6.1f} / "
          f"{query_est:5.1f} {one:8.2f} {two:8.2f} {band:8.2f}  {chosen:>10s}  {spread:.1e}")
  if "--programs" in sys.argv[1:]:
    return
  wall, busy, kernels = kernel_profile()
  print(f"\nT = 10,000, one program under the profiler: wall {wall:.2f} ms, kernels busy "
        f"{busy:.2f} ms (x{busy / wall:.2f} of the wall)")
  for ms, name in kernels:
    print(f"  {ms:7.2f} ms  {name}")
  print_targets()
  print_allocator()


if __name__ == "__main__":
  main()
