"""A batch of compositions that share their models: each model evaluated once, or once per element.

Workload (the shape of per-example accounting with bucketed gradient norms): 20 models, Poisson-
subsampled Gaussians (q = 0.01, noise multiplier sigma / s for 20 sensitivities s in [0.05, 1],
i.e. 20 buckets of clipped gradient norm), and a batch of compositions (1,000 by default), each
with its own counts of every model (random, 0 to 100 each: ~1,000 steps per example), delta =
1e-5. Everything runs in ONE process on one plan:

1. shared: ``jaxacct.epsilon`` on the batch as it comes (models unbatched, counts batched): each
   model is discretised and transformed once, each element combines the shared spectra with its
   counts;
2. per element (the previous behaviour): the same settings with the models' parameters
   broadcast to the batch, so every element discretises and transforms all 20 models again.

Each runs twice (cold: compilation included; warm); the script checks the two agree (same plan:
within round-off) and prints the time per element and the ratio.

Run:  python benchmarks/bench_shared.py [--batch N]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

MODELS = 20
SIGMA, Q, DELTA = 1.0, 0.01, 1e-5


def timed(fn):
  start = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - start


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", type=int, default=1000)
  args = parser.parse_args()
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import jax
  import jaxacct

  print(f"machine: {platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}, "
        f"{jax.devices()}, load {os.getloadavg()}")
  rng = np.random.default_rng(0)
  sensitivities = np.linspace(0.05, 1.0, MODELS)
  counts = rng.integers(0, 101, size=(args.batch, MODELS)).astype(float)
  models = [jaxacct.PoissonSampled(jaxacct.Gaussian(SIGMA, s), Q) for s in sensitivities]
  shared = jaxacct.Composition.of(*[(m, counts[:, j]) for j, m in enumerate(models)])
  wide = lambda value: np.full(args.batch, value)
  per_element = jaxacct.Composition.of(*[
      (jaxacct.PoissonSampled(jaxacct.Gaussian(wide(SIGMA), wide(s)), wide(Q)), counts[:, j])
      for j, s in enumerate(sensitivities)])
  plan, plan_time = timed(lambda: jaxacct.make_plan(shared, DELTA))
  print(f"plan for the batch (each model evaluated once): {plan_time:.2f} s, "
        f"fft {plan.fft_size}, per step {plan.per_step_size}")

  results = {}
  for name, comp in (("shared", shared), ("per element", per_element)):
    run = lambda: jaxacct.epsilon(comp, DELTA, plan=plan).upper.block_until_ready()
    _, cold = timed(run)
    out, warm = timed(run)
    results[name] = (np.asarray(out), warm)
    print(f"{name:12s}: first call (compile included) {cold:.2f} s; warm {warm:.2f} s for "
          f"{args.batch} = {1e3 * warm / args.batch:.2f} ms per element")
  (a, ta), (b, tb) = results["shared"], results["per element"]
  print(f"max |shared - per element| upper epsilon: {np.max(np.abs(a - b)):.2e} "
        f"(epsilon {a.min():.3f} .. {a.max():.3f})")
  print(f"ratio per element / shared: {tb / ta:.1f}x")


if __name__ == "__main__":
  main()
