"""Wall-clock benchmark: group-level epsilon, jaxacct vs dp-accounting, one process.

Workload: DP-SGD with Poisson sampling q = 0.01, sigma = 1.0, T = 1000 steps, delta = 1e-6,
against groups of k = 4 examples (Ganesh 2024: MixtureOfGaussians with Binomial(4, q) weights).

1. jaxacct ``group_epsilon``: cold (first call, compilation included) and warm (median of
   repeated calls, each including the host-side plan) times, and the certified bracket.
2. dp-accounting: ``MixtureOfGaussiansDpEvent`` composed T times by ``PLDAccountant``
   (discretisation 1e-4, pessimistic: its upper bound), the same epsilon query.
3. A sweep k = 1..16 in one call (one batch, 17 padded atoms), cold and warm.

Run:  python benchmarks/bench_group.py   (about 2 minutes on 2 CPU cores, mostly dp-accounting)
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time

import numpy as np

SIGMA, Q, STEPS, DELTA, K = 1.0, 0.01, 1000, 1e-6, 4


def timed(fn):
  start = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - start


def bench_jaxacct(repeats=5):
  import jax
  import jaxacct

  def call():
    return jax.block_until_ready(jaxacct.group_epsilon(SIGMA, STEPS, DELTA, K, sampling_rate=Q))

  b, cold = timed(call)
  warm = statistics.median(timed(call)[1] for _ in range(repeats))
  return (float(b.lower), float(b.estimate), float(b.upper)), cold, warm


def bench_jaxacct_tight(repeats=5):
  """The same query with a ten times tighter certified bracket (eps_error 1e-3)."""
  import jax
  import jaxacct

  def call():
    return jax.block_until_ready(jaxacct.group_epsilon(SIGMA, STEPS, DELTA, K, sampling_rate=Q,
                                                       eps_error=1e-3))

  b, cold = timed(call)
  warm = statistics.median(timed(call)[1] for _ in range(repeats))
  return (float(b.lower), float(b.estimate), float(b.upper)), cold, warm


def bench_dp_accounting():
  from dp_accounting import dp_event, pld
  from scipy import stats
  probs = stats.binom.pmf(np.arange(K + 1), K, Q)
  event = dp_event.SelfComposedDpEvent(
      dp_event.MixtureOfGaussiansDpEvent(SIGMA, list(range(K + 1)), list(probs)), STEPS)

  def call():
    accountant = pld.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(event)
    return accountant.get_epsilon(DELTA)

  return timed(call)


def bench_sweep():
  import jax
  import jaxacct
  ks = np.arange(1, 17)
  call = lambda: jax.block_until_ready(jaxacct.group_epsilon(SIGMA, STEPS, DELTA, ks,
                                                             sampling_rate=Q))
  out, cold = timed(call)
  warm = statistics.median(timed(call)[1] for _ in range(3))
  return np.asarray(out.upper), cold, warm


def main():
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout
  print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{platform.python_version()}")
  print(f"workload: k = {K}, sigma = {SIGMA}, q = {Q}, T = {STEPS}, delta = {DELTA}")
  (lower, estimate, upper), cold, warm = bench_jaxacct()
  print(f"jaxacct group_epsilon   cold {cold:7.2f} s  warm {warm:7.3f} s   "
        f"bracket [{lower:.6f}, {upper:.6f}] estimate {estimate:.6f}")
  (lo2, est2, up2), cold2, warm2 = bench_jaxacct_tight()
  print(f"jaxacct eps_error=1e-3    cold {cold2:7.2f} s  warm {warm2:7.3f} s   "
        f"bracket [{lo2:.6f}, {up2:.6f}] estimate {est2:.6f}")
  dpa, t_dpa = bench_dp_accounting()
  print(f"dp-accounting MoG PLD         {t_dpa:7.2f} s              epsilon {dpa:.6f} "
        f"(pessimistic, 1e-4)")
  inside = lower <= dpa + 1e-9 and upper >= dpa - 2e-3
  print(f"ratio (dp-accounting / jaxacct warm): {t_dpa / warm:.0f}x; cold: {t_dpa / cold:.1f}x; "
        f"dp-accounting's value {'inside' if inside else 'OUTSIDE'} jaxacct's bracket "
        f"(width {upper - lower:.2e}, |estimate - dp-accounting| {abs(estimate - dpa):.1e})")
  print(f"  with eps_error=1e-3: {t_dpa / warm2:.0f}x warm, bracket width {up2 - lo2:.2e}, "
        f"dp-accounting's value {'inside' if lo2 <= dpa + 1e-9 <= up2 + 2e-3 else 'OUTSIDE'}")
  uppers, cold, warm = bench_sweep()
  print(f"sweep k = 1..16, one call: cold {cold:.2f} s, warm {warm:.3f} s "
        f"({warm / 16 * 1e3:.0f} ms per k); upper at k = 1, 4, 16: "
        f"{uppers[0]:.4f}, {uppers[3]:.4f}, {uppers[15]:.4f}")


if __name__ == "__main__":
  main()
