"""Wall-clock benchmark of the constant-time (CGF-based) accountants against the PLD accountants.

Workload: DP-SGD with Poisson sampling, q = 0.01, sigma = 1.0, delta = 1e-5, T = 10^3 ... 10^6.
Everything runs in ONE process:

1. jaxacct's saddle point (``accountant="spa"``) and Edgeworth (``accountant="edgeworth"``)
   accountants: cold (first call, incl. compilation) and warm time per epsilon result (lower,
   estimate and upper together) for each T — flat in T.
2. The same, amortised over one vectorised call on 1,000 noise multipliers.
3. jaxacct's certified PLD accountant and prv-accountant (eps_error 0.01) at T = 10^3 and 10^4,
   for the ratio. The papers' research code (saddle point: ~6 s per epsilon; Edgeworth: ~40 s)
   was timed once on the same kind of machine (2-core Xeon CPU); it is not re-run here.

Run:  python benchmarks/bench_cgf.py [--quick]   (--quick skips prv-accountant)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

SIGMA, Q, DELTA = 1.0, 0.01, 1e-5
STEPS = (1_000, 10_000, 100_000, 1_000_000)
N_BATCH = 1000
ACCOUNTANTS = ("spa", "edgeworth")


def timed(fn, repeats=1):
  times, out = [], None
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - start)
  return out, times


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="skip prv-accountant")
  args = parser.parse_args()
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
  import jax
  import jaxacct

  print(f"machine: {platform.machine()} {platform.system()}, cpus={os.cpu_count()}, "
        f"jax {jax.__version__}, load {os.getloadavg()}")

  def run(accountant, steps, sigma=SIGMA):
    out = jaxacct.dpsgd_epsilon(sigma, Q, steps, DELTA, accountant=accountant)
    return jax.block_until_ready(out)

  warm_at = {}
  for accountant in ACCOUNTANTS:
    print(f"\n{accountant}, one setting (epsilon: lower / estimate / upper)")
    for i, steps in enumerate(STEPS):
      result, cold = timed(lambda: run(accountant, steps))
      _, warm = timed(lambda: run(accountant, steps), repeats=7)
      warm_at[accountant, steps] = statistics.median(warm)
      first = f"cold {cold[0]:.2f} s (first T: includes compilation), " if i == 0 else ""
      print(f"  T={steps:>9,d}: [{float(result.lower):.5f}, {float(result.estimate):.5f}, "
            f"{float(result.upper):.5f}] status {int(result.status)}; {first}"
            f"warm median {1e3 * warm_at[accountant, steps]:.1f} ms")

    sigmas = np.linspace(0.8, 3.0, N_BATCH)
    batch = lambda: jax.block_until_ready(
        jaxacct.dpsgd_epsilon(sigmas, Q, 10_000, DELTA, accountant=accountant))
    _, cold = timed(batch)
    _, warm = timed(batch, repeats=2)
    print(f"  batch of {N_BATCH} sigmas (T=10,000): cold {cold[0]:.1f} s, warm "
          f"{min(warm):.2f} s = {1e3 * min(warm) / N_BATCH:.2f} ms per setting")

  print("\ncertified PLD accountants (same workload)")
  for steps in STEPS[:2]:
    pld = lambda: jax.block_until_ready(jaxacct.dpsgd_epsilon(SIGMA, Q, steps, DELTA))
    pld()
    _, warm_pld = timed(pld, repeats=3)
    ratios = ", ".join(f"{statistics.median(warm_pld) / warm_at[a, steps]:.0f}x the {a} time"
                       for a in ACCOUNTANTS)
    line = f"  T={steps:>6,d}: jaxacct pld warm {statistics.median(warm_pld):.3f} s ({ratios})"
    if not args.quick:
      from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

      def prv():
        acc = PRVAccountant(
            prvs=[PoissonSubsampledGaussianMechanism(noise_multiplier=SIGMA,
                                                     sampling_probability=Q)],
            eps_error=0.01, delta_error=DELTA / 1000, max_self_compositions=[steps])
        return acc.compute_epsilon(delta=DELTA, num_self_compositions=[steps])
      _, t_prv = timed(prv)
      ratios = ", ".join(f"{t_prv[0] / warm_at[a, steps]:.0f}x the {a} time" for a in ACCOUNTANTS)
      line += f"; prv-accountant {t_prv[0]:.2f} s ({ratios})"
    print(line)
  print("\nresearch-code timings (measured once, not re-run): saddle-point code ~6 s per epsilon, "
        "Edgeworth code ~40 s per epsilon")


if __name__ == "__main__":
  main()
