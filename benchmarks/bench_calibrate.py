"""Calibration: the noise multiplier for a privacy budget, jaxacct beside the libraries users pick.

Workload (issue 15, `../shared/notes/anchors.md` section 3): DP-SGD with Poisson sampling, the
sigma that gives epsilon = 2 at delta = 1e-5 with q = 0.01 and T = 1,000 steps. Everything runs in
ONE process, one after another:

* jaxacct ``calibrate.noise_multiplier`` with the PLD (default), saddle-point and RDP accountants:
  cold (the first call: tracing and compiling included; ``import jaxacct`` timed apart) and warm
  (median of repeated calls); then 100 targets in ONE call (epsilon 1...4, then 0.5...10);
* Opacus ``get_noise_multiplier`` with its PRV and RDP accountants (default tolerance 0.01);
* prv-accountant ``find_noise_multiplier`` (eps_error 0.1, its default; skipped by ``--quick``);
* dp-accounting ``calibrate_dp_mechanism`` with its PLD (value discretisation 1e-4) and RDP
  accountants.

For every answer the script prints jaxacct's certified PLD upper epsilon at that sigma: a value
above the target is a calibration that overshoots the budget. Ratios are peer time / jaxacct warm
PLD time.

``--edges`` instead times the calibrations of issue 29 item 9 at the edges of the plans (each in
a fresh process, cold, with a time limit): each must answer, or refuse with the reason, within
about a minute on 2 cores. It prints wall and CPU seconds (the CPU time is what a free 2-core
machine would take at most, the wall time what this one took under its load) and the answer or
the refusal.

Run:  pip install -e ".[bench]"; python benchmarks/bench_calibrate.py [--quick | --edges]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

EPSILON, DELTA, Q, STEPS = 2.0, 1e-5, 0.01, 1000
N_TARGETS = 100
WARM_REPEATS = 5


def timed(fn):
  start = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - start


def warm_median(fn, repeats=WARM_REPEATS):
  return statistics.median(timed(fn)[1] for _ in range(repeats))


def jaxacct_rows(calibrate):
  """(name, sigma, cold s, warm s) for each jaxacct accountant."""
  rows = []
  for accountant in ("pld", "spa", "rdp"):
    call = lambda: float(calibrate.noise_multiplier(EPSILON, DELTA, Q, STEPS,
                                                    accountant=accountant))
    sigma, cold = timed(call)
    rows.append((f"jaxacct {accountant}", sigma, cold, warm_median(call)))
  return rows


def peer_rows(quick):
  """(name, sigma, seconds) for each peer library's calibration of the same target."""
  import dp_accounting
  from dp_accounting import mechanism_calibration as calibration
  from dp_accounting.pld import pld_privacy_accountant
  from dp_accounting.rdp import rdp_privacy_accountant
  from opacus.accountants.utils import get_noise_multiplier

  rows = []
  for accountant in ("prv", "rdp"):
    sigma, seconds = timed(lambda: get_noise_multiplier(
        target_epsilon=EPSILON, target_delta=DELTA, sample_rate=Q, steps=STEPS,
        accountant=accountant))
    rows.append((f"opacus get_noise_multiplier ({accountant})", sigma, seconds))

  def event(sigma):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(sigma)), STEPS)

  makers = {"pld": lambda: pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4),
            "rdp": rdp_privacy_accountant.RdpAccountant}
  for name, make in makers.items():
    sigma, seconds = timed(lambda: calibration.calibrate_dp_mechanism(
        make, event, EPSILON, DELTA, calibration.LowerEndpointAndGuess(0.1, 1.0)))
    rows.append((f"dp-accounting calibrate_dp_mechanism ({name})", sigma, seconds))

  if not quick:
    from prv_accountant.dpsgd import find_noise_multiplier
    sigma, seconds = timed(lambda: find_noise_multiplier(Q, STEPS, EPSILON, DELTA))
    rows.append(("prv-accountant find_noise_multiplier", sigma, seconds))
  return rows


# Issue 29 item 9: calls that ran for minutes (or gave nothing in 120-500 s) before the plans'
# sizes were bounded, then those an independent review found beyond a minute or wrongly refused
# after (A: a size cache that breached the plan cap; C: steps above ~2e4; D: a bogus saddle-point
# start): (label, Python expression).
EDGES = [
    ("far start", "calibrate.noise_multiplier(0.020036, 5.739e-11, 1.2603e-4, 1804)"),
    ("eps 50, q 1e-6, T 1", "calibrate.noise_multiplier(50.0, 1e-12, 1e-6, 1)"),
    ("eps 0.01, delta 0.1, q 1e-6, T 1e7", "calibrate.noise_multiplier(0.01, 0.1, 1e-6, 10**7)"),
    ("eps 2, q 1e-6, T 1e7", "calibrate.noise_multiplier(2.0, 1e-5, 1e-6, 10**7)"),
    ("eps 3.08, q 3.41e-5, T 4.4e6",
     "calibrate.noise_multiplier(3.08, 0.0229, 3.41e-5, 4_387_004)"),
    ("group k = 1..50", "jaxacct.group_epsilon(2.0, 500, 1e-6, np.arange(1, 51), "
                        "sampling_rate=0.01).upper"),
    ("A: sigma, eps 1, delta 1e-12, q 1e-4", "calibrate.noise_multiplier(1.0, 1e-12, 1e-4, 10**4)"),
    ("C: steps, eps 2, sigma 1, q 1e-3", "calibrate.steps(2.0, 1e-5, 1.0, 0.001)"),
    ("C: steps, eps 1, delta 1e-12, q 1e-4", "calibrate.steps(1.0, 1e-12, 0.9, 1e-4)"),
    ("D: rate, eps 1, delta 1e-12, sigma 0.78",
     "calibrate.sampling_rate(1.0, 1e-12, 0.78, 10**4)"),
]
_EDGE_SCRIPT = """
import resource, time
start = time.perf_counter()  # (import included)
import numpy as np
import jaxacct
from jaxacct import calibrate
try:
  out = "answer " + np.array2string(np.asarray({call}), precision=7, threshold=8)
except (ValueError, RuntimeError) as err:
  out = "refused: " + type(err).__name__ + ": " + str(err)[:240] + "..."
usage = resource.getrusage(resource.RUSAGE_SELF)
print(f"{{time.perf_counter() - start:.1f}} {{usage.ru_utime + usage.ru_stime:.1f}} {{out}}")
"""


def edges(limit, only=None):
  """Each call of ``EDGES`` (those whose label starts with one of ``only``) in a fresh process:
  the 1-minute load before it, wall and CPU seconds, the answer or the refusal."""
  import subprocess
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAXACCT_NO_CACHE="1", PYTHONPATH=root)
  print(f"{root}: each call in a fresh process (cold), limit {limit} s, {os.cpu_count()} cores")
  for label, call in EDGES:
    if only and not any(label.startswith(prefix) for prefix in only):
      continue
    load = os.getloadavg()[0]
    try:
      run = subprocess.run([sys.executable, "-c", _EDGE_SCRIPT.format(call=call)], env=env,
                           capture_output=True, text=True, timeout=limit, check=False)
      line = (run.stdout.strip().splitlines() or [run.stderr.strip()[-200:]])[-1]
      wall, cpu, out = line.split(" ", 2) if run.returncode == 0 else ("-", "-", line)
    except subprocess.TimeoutExpired:
      wall, cpu, out = f">{limit:g}", "-", "no answer within the limit"
    print(f"{label:40s} load {load:4.1f}  wall {wall:>6s} s  cpu {cpu:>6s} s  {out}", flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="skip prv-accountant (~2 minutes)")
  parser.add_argument("--edges", action="store_true",
                      help="time issue 29's edge calibrations instead (about 10 minutes)")
  parser.add_argument("--limit", type=float, default=600.0, help="--edges: seconds per call")
  parser.add_argument("--only", nargs="*", default=None,
                      help="--edges: the calls whose labels start with these")
  args = parser.parse_args()
  if args.edges:
    edges(args.limit, args.only)
    return
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  _, import_time = timed(lambda: __import__("jaxacct.calibrate"))
  import jax
  import jaxacct
  from jaxacct import calibrate

  print(f"machine: {platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}, "
        f"{jax.devices()}, load {os.getloadavg()}")
  print(f"workload: sigma for epsilon = {EPSILON} at delta = {DELTA}, q = {Q}, T = {STEPS}")
  print(f"import jaxacct: {import_time:.2f} s")
  upper = lambda sigma: float(jaxacct.dpsgd_epsilon(sigma, Q, STEPS, DELTA).upper)

  ours = jaxacct_rows(calibrate)
  base = ours[0][3]
  print(f"\n{'method':46s} {'sigma':>10s} {'cold s':>8s} {'warm s':>8s} {'PLD upper eps':>14s}")
  for name, sigma, cold, warm in ours:
    print(f"{name:46s} {sigma:10.6f} {cold:8.2f} {warm:8.3f} {upper(sigma):14.6f}")

  for low, high in ((1.0, 4.0), (0.5, 10.0)):
    targets = np.linspace(low, high, N_TARGETS)
    batch = lambda: np.asarray(calibrate.noise_multiplier(targets, DELTA, Q, STEPS))
    sigmas, cold = timed(batch)
    warm = warm_median(batch, repeats=1)
    print(f"{N_TARGETS} targets (epsilon {low:g}...{high:g}) in one PLD call: cold {cold:.2f} s, "
          f"warm {warm:.2f} s ({1e3 * warm / N_TARGETS:.0f} ms per target); sigma "
          f"{sigmas.min():.4f}...{sigmas.max():.4f}")

  print(f"\n{'peer (one call)':46s} {'sigma':>10s} {'s':>8s} {'ratio':>8s} {'PLD upper eps':>14s}")
  for name, sigma, seconds in peer_rows(args.quick):
    print(f"{name:46s} {sigma:10.6f} {seconds:8.2f} {seconds / base:7.1f}x {upper(sigma):14.6f}")
  print("ratio: peer time / jaxacct warm PLD time; PLD upper eps > 2 means the budget is exceeded")


if __name__ == "__main__":
  main()
