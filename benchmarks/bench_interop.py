"""The drop-ins beside what they replace: jax_privacy's calibration and dp-accounting's accountant.

Workloads, each in ONE process, one after another:

1. jax_privacy 2.0's own calibration case (its calibrate_test: batch 1024 of 50,000 examples,
   10^4 updates, delta 1e-5, target epsilon 2.27535, which its RDP config meets at sigma 4):
   ``calibrate_noise_multiplier`` (tol 1e-4), ``calibrate_num_updates`` (sigma 4) and
   ``calibrate_batch_size`` (sigma 4) with its ``PldAccountantConfig`` (value discretisation
   1e-4) and with ``JaxacctAccountantConfig`` (the certified PLD, eps_error 0.01). For each answer
   the script prints jaxacct's certified upper epsilon there: above the target is a calibration
   that overshoots the budget.
2. dp-accounting code, ``compose(PoissonSampledDpEvent(0.01, GaussianDpEvent(1.0)), 10_000)``
   then ``get_epsilon(1e-5)``: its ``PLDAccountant`` (1e-4) against ``JaxacctAccountant`` (cold:
   the first in the process; warm: a fresh accountant, the programs compiled).

Run:  pip install -e ".[bench]"; python benchmarks/bench_interop.py
"""

from __future__ import annotations

import os
import platform
import sys
import time


def timed(fn):
  start = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - start


def calibrations(accounting, config, certified):
  """jax_privacy's three calibrations of its test case with ``config``: rows of (what, answer,
  seconds, certified epsilon at the answer)."""
  training = accounting.DpsgdTrainingAccountant(config)
  case = dict(accountant=training, target_epsilon=2.27535, num_samples=50_000,
              target_delta=1e-5)
  rows = []
  sigma, seconds = timed(lambda: accounting.calibrate_noise_multiplier(
      batch_sizes=1024, num_updates=10_000, tol=1e-4, **case))
  rows.append(("noise multiplier", sigma, seconds, certified(sigma, 1024, 10_000)))
  updates, seconds = timed(lambda: accounting.calibrate_num_updates(
      noise_multipliers=4.0, batch_sizes=1024, **case))
  rows.append(("num updates", updates, seconds, certified(4.0, 1024, updates)))
  batch, seconds = timed(lambda: accounting.calibrate_batch_size(
      noise_multipliers=4.0, num_updates=10_000, **case))
  rows.append(("batch size", batch, seconds, certified(4.0, batch, 10_000)))
  return rows


def main():
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import jax
  from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent
  from dp_accounting.pld import PLDAccountant
  from jax_privacy import accounting

  import jaxacct
  from jaxacct.interop import JaxacctAccountant, JaxacctAccountantConfig

  print(f"machine: {platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}, "
        f"load {os.getloadavg()}")
  certified = lambda sigma, batch, steps: float(
      jaxacct.dpsgd_epsilon(sigma, batch / 50_000, steps, 1e-5).upper)
  print("\n1. jax_privacy calibration (target epsilon 2.27535)")
  print(f"{'calibrates':18s} {'config':24s} {'answer':>14s} {'seconds':>9s} {'certified eps':>14s}")
  for name, config in (("PldAccountantConfig", accounting.PldAccountantConfig()),
                       ("JaxacctAccountantConfig", JaxacctAccountantConfig())):
    for what, answer, seconds, eps in calibrations(accounting, config, certified):
      print(f"{what:18s} {name:24s} {answer:14.8g} {seconds:9.2f} {eps:14.6f}")

  print("\n2. dp-accounting code: DP-SGD q=0.01 sigma=1 T=10^4, get_epsilon(1e-5)")
  event = PoissonSampledDpEvent(0.01, GaussianDpEvent(1.0))
  theirs, their_time = timed(lambda: PLDAccountant().compose(event, 10_000).get_epsilon(1e-5))
  cold, cold_time = timed(lambda: JaxacctAccountant().compose(event, 10_000).get_epsilon(1e-5))
  warm, warm_time = timed(lambda: JaxacctAccountant().compose(event, 10_000).get_epsilon(1e-5))
  print(f"dp-accounting PLDAccountant (1e-4):  {theirs:.6f}  {their_time:7.3f} s")
  print(f"JaxacctAccountant cold (certified):  {cold:.6f}  {cold_time:7.3f} s")
  print(f"JaxacctAccountant warm (certified):  {warm:.6f}  {warm_time:7.3f} s  "
        f"({their_time / warm_time:.0f}x dp-accounting)")


if __name__ == "__main__":
  main()
