"""Individual (per-example) accounting: the filters' step cost and the per-example DP-SGD report,
jaxacct beside dp-accounting on the same examples.

Workload (issue 16): 60,000 examples, DP-SGD with Poisson sampling, q = 0.005, sigma = 2,
T = 10,000 steps, delta = 1e-5, clip norm 1. Synthetic norms: each example draws a scale s
log-uniformly in [0.05, 2] and its per-step norms from s * Exp(1); its bucket counts on the noise
grid are drawn exactly as T such norms would fill them (a multinomial over the grid's buckets),
which is what the in-step counter would hold after T steps.

* the filters' update (GDP, RDP at q = 0.005, the bucket counter) on a batch listing all 60,000
  examples, float32 (x64 off, as in a training program), the state donated (updated in place,
  as in a training step): cold (compile) and warm per step;
* the per-example report (certified PLD bounds, certified GDP mu, RDP figure) for all examples,
  in a child process each: one device; four forced host devices (the examples sharded); a
  smaller chunk. Each child prints its wall time, throughput and peak resident memory;
* the report on 64 examples drawn the same way after 300 and 10,000 steps, cold and warm (a
  child process each);
* dp-accounting on a few of the same examples: its heterogeneous PLD (value discretisation 1e-4,
  its default) and its RDP accountant, per example, and the ratio to jaxacct's per-example time.

Run:  pip install -e ".[test]"; python benchmarks/bench_individual.py [--quick]
(--quick: 6,000 examples and one dp-accounting PLD example.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SIGMA, Q, STEPS, DELTA, CLIP = 2.0, 0.005, 10_000, 1e-5, 1.0
_SMALL, _SMALL_STEPS = 64, (300, STEPS)  # the small reports' examples and steps


def synthetic_counts(n, grid, seed=0, steps=STEPS):
  """Bucket counts of n examples after ``steps`` steps of norms s * Exp(1), s log-uniform."""
  rng = np.random.default_rng(seed)
  scale = np.exp(rng.uniform(np.log(0.05), np.log(2.0), n))
  # P(ratio >= grid_g) = P(min(norm, C) <= sigma C / grid_g); ratios are rounded down.
  cut = np.minimum(SIGMA * CLIP / grid, CLIP)
  at_least = np.where(cut[None, :] >= CLIP, 1.0, -np.expm1(-cut[None, :] / scale[:, None]))
  probs = at_least - np.concatenate([at_least[:, 1:], np.zeros((n, 1))], axis=1)
  probs = np.maximum(probs, 0.0)
  return rng.multinomial(steps, probs / probs.sum(axis=1, keepdims=True)), scale


def timed(fn):
  start = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - start


def filter_rows(n):
  """(name, cold s, warm ms per step) of each filter's update on a batch of all n examples."""
  import jax
  import jax.numpy as jnp
  from jaxacct import individual
  rng = np.random.default_rng(1)
  norms = jnp.asarray(rng.exponential(0.5, n), jnp.float32)
  indices, valid = jnp.arange(n), jnp.ones(n, bool)
  filters = {
      "gdp_filter": individual.gdp_filter(3.0, CLIP, SIGMA, n),
      "rdp_filter (q = 0.005, 21 orders)": individual.rdp_filter(
          individual.rdp_budget(SIGMA, Q, STEPS), CLIP, SIGMA, n, sampling_rate=Q),
      "bucket_counter": individual.bucket_counter(SIGMA, CLIP, Q, n),
  }
  rows = []
  for name, f in filters.items():
    update = jax.jit(f.update, donate_argnums=0)  # the state updated in place, as in a step
    state = f.init()
    out, cold = timed(lambda: jax.block_until_ready(update(state, norms, indices, valid)))
    state = out[0] if isinstance(out, tuple) else out
    times = []
    for _ in range(20):
      out, dt = timed(lambda: jax.block_until_ready(update(state, norms, indices, valid)))
      state = out[0] if isinstance(out, tuple) else out
      times.append(dt)
    rows.append((name, cold, 1e3 * statistics.median(times)))
  return rows


_CHILD = r"""
import json, os, resource, sys, time
devices, chunk, n, steps = (int(a) for a in sys.argv[1:5])
if devices > 1:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=" + str(devices)
sys.path.insert(0, ROOT_DIR)
sys.path.insert(0, HERE_DIR)
import numpy as np
import jax
from bench_individual import synthetic_counts, SIGMA, Q, STEPS, DELTA
from jaxacct.individual import dpsgd, noise_grid
grid = noise_grid(SIGMA)
counts, _ = synthetic_counts(n, grid, steps=steps)
start = time.perf_counter()
report = dpsgd.per_example_privacy(counts, steps, grid, Q, DELTA, chunk=chunk)
cold = time.perf_counter() - start
start = time.perf_counter()
report = dpsgd.per_example_privacy(counts, steps, grid, Q, DELTA, chunk=chunk)
warm = time.perf_counter() - start
print(json.dumps(dict(devices=len(jax.devices()), chunk=chunk, n=n, cold=cold, warm=warm,
                      peak_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      upper=np.quantile(report.pld.upper, [0, 0.5, 1]).tolist(),
                      gdp=np.quantile(report.gdp_epsilon, [0, 0.5, 1]).tolist(),
                      rdp=np.quantile(report.rdp_epsilon, [0, 0.5, 1]).tolist(),
                      status=int(np.max(report.pld.status)),
                      first=[report.pld.lower[:20].tolist(), report.pld.upper[:20].tolist(),
                             report.rdp_epsilon[:20].tolist()])))
"""


def report_run(devices, chunk, n, steps=STEPS):
  """The report on n examples after ``steps`` steps in a child process: its JSON line."""
  code = _CHILD.replace("ROOT_DIR", repr(ROOT)).replace(
      "HERE_DIR", repr(os.path.dirname(os.path.abspath(__file__))))
  out = subprocess.run([sys.executable, "-c", code, str(devices), str(chunk), str(n), str(steps)],
                       capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def peer_rows(counts, grid, n_pld):
  """dp-accounting's per-example time (heterogeneous PLD, RDP) and its answers."""
  from dp_accounting import dp_event
  from dp_accounting.pld import pld_privacy_accountant
  from dp_accounting.rdp import rdp_privacy_accountant

  def event(row):
    return dp_event.ComposedDpEvent([
        dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(Q, dp_event.GaussianDpEvent(s)), int(c))
        for s, c in zip(grid, row) if c > 0])

  pld = []
  for row in counts[:n_pld]:
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    eps, dt = timed(lambda: accountant.compose(event(row)).get_epsilon(DELTA))
    pld.append((eps, dt))
  rdp = []
  for row in counts[:20]:
    accountant = rdp_privacy_accountant.RdpAccountant()
    eps, dt = timed(lambda: accountant.compose(event(row)).get_epsilon(DELTA))
    rdp.append((eps, dt))
  return pld, rdp


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args()
  n = 6_000 if args.quick else 60_000
  print(f"# {platform.platform()}, {os.cpu_count()} CPUs, load {os.getloadavg()}")
  from jaxacct import individual
  grid = individual.noise_grid(SIGMA)
  counts, _ = synthetic_counts(n, grid)

  print(f"\nFilter update, a batch listing all {n} examples (float32):")
  for name, cold, warm in filter_rows(n):
    print(f"  {name:36s} cold {cold:6.2f} s   warm {warm:7.2f} ms per step")

  print(f"\nPer-example report, {n} examples, T = {STEPS}, q = {Q}, sigma = {SIGMA}:")
  runs = [(1, 256), (4, 256)] + ([] if args.quick else [(1, 32)])
  ours = {}
  for devices, chunk in runs:
    r = report_run(devices, chunk, n)
    ours[(devices, chunk)] = r
    print(f"  devices {r['devices']} chunk {chunk:4d}: cold {r['cold']:6.1f} s, warm "
          f"{r['warm']:6.1f} s = {n / r['warm']:6.0f} examples/s, peak {r['peak_mb']:6.0f} MB; "
          f"upper eps min/median/max {np.round(r['upper'], 4).tolist()}, GDP "
          f"{np.round(r['gdp'], 4).tolist()}, RDP {np.round(r['rdp'], 4).tolist()}, "
          f"status {r['status']}")

  # Small reports (a short run's few examples, a test's): cold, the time is mostly compiling;
  # where the examples fit in one chunk of the widest band they need, one program serves them.
  for steps in _SMALL_STEPS:
    small = report_run(1, 256, _SMALL, steps)
    print(f"  a small report, {_SMALL} examples after {steps} steps: cold {small['cold']:5.1f} s,"
          f" warm {small['warm']:5.2f} s")

  per_example = ours[(1, 256)]["warm"] / n
  lower, upper, our_rdp = ours[(1, 256)]["first"]
  pld, rdp = peer_rows(counts, grid, 1 if args.quick else 3)
  print("\ndp-accounting on the same examples (one process, one example at a time):")
  for i, (eps, dt) in enumerate(pld):
    print(f"  PLD (1e-4) example {i}: eps {eps:.5f} (jaxacct [{lower[i]:.5f}, {upper[i]:.5f}]) "
          f"in {dt:6.2f} s = {dt / per_example:8.0f}x jaxacct's per-example time (1 device)")
  rdp_time = statistics.median(dt for _, dt in rdp)
  ratio = max(abs(e / ours - 1) for (e, _), ours in zip(rdp, our_rdp))
  print(f"  RDP: median {1e3 * rdp_time:.1f} ms per example = {rdp_time / per_example:.1f}x; "
        f"jaxacct's RDP figure within {ratio:.1e} relative on 20 examples")


if __name__ == "__main__":
  main()
