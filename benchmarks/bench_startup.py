"""First answers: the command line and a one-question process, each in a fresh process.

What a new user meets first (issue 32): every command runs in a new Python process, so process
start, imports, tracing and compilation are all counted. Each jaxacct command runs twice: with
an empty compilation cache (a fresh ``HOME``, so ``~/.cache/jaxacct`` is empty) and then warm
(the same ``HOME``: the programs the first run compiled are read back). Beside them, Opacus's
``get_noise_multiplier`` (PRV and RDP) in a fresh process, import of torch included, on the
same setting as ``jaxacct calibrate``'s defaults (epsilon 2, delta 1e-5, q 0.01, 1,000 steps).

The first calibration in a process is also timed inside it (after the import: what a training
script's call costs), with the cache empty and then warm.

``--settings N`` times instead the first calibration of N random settings (epsilon 0.3...8,
q 1e-3...0.1, T 100...10^5, delta 1e-9...1e-4; seeded), each in a fresh process with no cache,
from the host's start (``calibrate._host_pld_start``) and from the RDP start alone, alternated:
the seconds and the number of XLA compilations of each (a PLD program per plan size its reads
straddle).

Run:  pip install -e ".[bench]"; python benchmarks/bench_startup.py [--repeat N] [--settings N]
(prints the machine, the ml_dtypes version, its load average before each row, and the median of
N runs per row).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

BIN = os.path.dirname(sys.executable)
JAXACCT = [os.path.join(BIN, "jaxacct")]
COMMANDS = [
    # (what every process pays first: jax's import, and ml_dtypes's within it: 0.7.0's took 0.7 s)
    ("python -c 'import ml_dtypes'", [sys.executable, "-c", "import ml_dtypes"], False),
    ("python -c 'import jax'", [sys.executable, "-c", "import jax"], False),
    ("jaxacct --help", JAXACCT + ["--help"], False),
    ("jaxacct --version", JAXACCT + ["--version"], False),
    ("jaxacct epsilon --json", JAXACCT + ["epsilon", "--json"], True),
    ("jaxacct calibrate --json", JAXACCT + ["calibrate", "--json"], True),
]
# The first calibration in a process, timed inside it (after jaxacct's import): the library call
# a training script makes, with the disk cache empty and then warm.
IN_PROCESS = ("import time, jaxacct; start = time.perf_counter(); "
              "jaxacct.calibrate.noise_multiplier(2.0, 1e-5, 0.01, 1000); "
              "print(time.perf_counter() - start)")
OPACUS = ("from opacus.accountants.utils import get_noise_multiplier; "
          "print(get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01, "
          "steps=1000, accountant={!r}))")


# One setting's first calibration in a fresh process: its seconds and the XLA compilations that
# took over 0.3 s (argv: epsilon, delta, q, T, and "rdp" to start from the RDP start alone).
FIRST_CALIBRATION = """
import sys, time, jax, jaxacct
from jaxacct import calibrate
if sys.argv[5:] == ["rdp"]:
  calibrate._host_pld_start = lambda opts, flat, start, low, high: None
compiles = []
jax.monitoring.register_event_duration_secs_listener(lambda event, seconds, **_: (
    compiles.append(seconds) if event.endswith("backend_compile_duration") and seconds > 0.3
    else None))
eps, delta, q, steps = (float(v) for v in sys.argv[1:5])
start = time.perf_counter()
sigma = float(calibrate.noise_multiplier(eps, delta, q, int(steps)))
print(sigma, len(compiles), time.perf_counter() - start)
"""


def random_settings(count, seed=1):
  """[(epsilon, delta, q, T)] drawn log-uniformly over the ranges in the module docstring."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  draw = lambda lo, hi: float(np.exp(rng.uniform(np.log(lo), np.log(hi))))
  return [(draw(0.3, 8.0), draw(1e-9, 1e-4), draw(1e-3, 0.1), int(draw(100, 1e5)))
          for _ in range(count)]


def first_calibrations(count, base):
  """Each random setting's first calibration from either start (fresh processes, no cache)."""
  env = dict(base, JAXACCT_NO_CACHE="1")
  totals = {"host": [0.0, 0], "rdp": [0.0, 0]}
  print(f"{'epsilon':>8s} {'delta':>8s} {'q':>8s} {'T':>7s}   host start: s, compiles, sigma"
        "   | RDP start alone: s, compiles, sigma")
  for eps, delta, q, steps in random_settings(count):
    cells = []
    for start in ("host", "rdp"):
      argv = [sys.executable, "-c", FIRST_CALIBRATION, repr(eps), repr(delta), repr(q),
              str(steps)] + (["rdp"] if start == "rdp" else [])
      done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
      if done.returncode:
        cells.append(f"refused ({done.stderr.strip().splitlines()[-1][:60]})")
        continue
      sigma, compiles, elapsed = done.stdout.split()[-3:]
      totals[start][0] += float(elapsed)
      totals[start][1] += int(compiles) > 1
      cells.append(f"{float(elapsed):6.2f} {compiles:>2s} {float(sigma):.8g}")
    print(f"{eps:8.3g} {delta:8.2g} {q:8.3g} {steps:7d}   " + "   | ".join(cells), flush=True)
  for start, (elapsed, several) in totals.items():
    print(f"{start} start: {elapsed:.1f} s in all; {several} of {count} settings compiled "
          "more than one program")


def seconds(argv, env):
  """Wall seconds of one run of ``argv`` (which must succeed)."""
  start = time.perf_counter()
  done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
  elapsed = time.perf_counter() - start
  if done.returncode:
    raise SystemExit(f"{' '.join(argv)} failed: {done.stderr[-2000:]}")
  return elapsed


def inner_seconds(code, env):
  """The seconds that ``code`` (run in a fresh process) prints as its last line."""
  done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        check=False)
  if done.returncode:
    raise SystemExit(f"{code} failed: {done.stderr[-2000:]}")
  return float(done.stdout.split()[-1])


def row(name, times):
  load = os.getloadavg()[0]
  print(f"{name:42s} {statistics.median(times):8.2f} s   (runs: "
        f"{', '.join(f'{t:.2f}' for t in times)}; load {load:.2f})", flush=True)


def empty_and_warm(name, timed_run, base, repeat):
  """Rows of ``timed_run(env)`` with an empty cache (a fresh ``HOME``) and then warm (the same
  ``HOME`` again), ``repeat`` pairs."""
  empty, warm = [], []
  for _ in range(repeat):
    with tempfile.TemporaryDirectory() as home:
      env = dict(base, HOME=home)
      empty.append(timed_run(env))
      warm.append(timed_run(env))
  row(f"{name} (empty cache)", empty)
  row(f"{name} (warm cache)", warm)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeat", type=int, default=3)
  parser.add_argument("--settings", type=int, default=0)
  args = parser.parse_args()
  print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, ml_dtypes {importlib.metadata.version('ml_dtypes')}, "
        f"load {os.getloadavg()}")
  base = {k: v for k, v in os.environ.items() if k not in ("JAXACCT_NO_CACHE",
                                                          "JAX_COMPILATION_CACHE_DIR")}
  if args.settings:
    first_calibrations(args.settings, base)
    return
  for name, argv, cached in COMMANDS:
    if not cached:
      row(name, [seconds(argv, base) for _ in range(args.repeat)])
      continue
    empty_and_warm(name, lambda env, argv=argv: seconds(argv, env), base, args.repeat)
  empty_and_warm("first calibration in a process", lambda env: inner_seconds(IN_PROCESS, env),
                 base, args.repeat)
  for accountant in ("prv", "rdp"):
    try:
      times = [seconds([sys.executable, "-c", OPACUS.format(accountant)], base)
               for _ in range(args.repeat)]
    except SystemExit as err:
      print(f"Opacus {accountant}: not run ({str(err)[:200]})")
      continue
    row(f"Opacus get_noise_multiplier ({accountant})", times)


if __name__ == "__main__":
  main()
