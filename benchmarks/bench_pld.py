"""Wall-clock benchmark: jaxacct vs prv-accountant vs dp-accounting on one DP-SGD workload.

Workload: DP-SGD with Poisson sampling, sampling rate q = 0.01, noise multiplier sigma = 1.0,
T = 10,000 steps, delta = 1e-5. Everything runs in ONE process, one method after another:

1. jaxacct ``dpsgd_epsilon``: import time, cold time (first call, incl. JAX compilation), warm
   time (median of repeated calls, each including host-side planning), certified bracket.
2. prv-accountant ``PRVAccountant`` (eps_error=0.01, bracket 0.02): construction + compute.
3. dp-accounting PLD (value_discretization_interval=1e-4): build + self_compose + query
   (pessimistic upper bound only).
4. jaxacct batch: 256 noise multipliers in one call as the front door plans it (each setting
   its own grid, the static sizes shared: ``plan.batch_plan``), in one call on one grid for all
   (``plan=dpsgd_plan(sigmas, ...)``), and as a Python loop of single calls on that grid (all
   warm).
5. Batches of small plans (24 sigmas at T = 100 to 10^4, a calibration check's workload): the
   front door (a host loop of the single-setting program on CPU) against one mapped program.

Run:  python benchmarks/bench_pld.py          (full, ~4 minutes on 2 CPU cores, mostly the batch)
      python benchmarks/bench_pld.py --quick  (skips prv-accountant)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

SIGMA, Q, STEPS, DELTA = 1.0, 0.01, 10_000, 1e-5
N_BATCH = 256
LOOP_BUDGET_S = 60.0  # extrapolate the single-call loop from 32 calls if 256 would exceed this


def timed(fn):
  """(result, seconds) of one call."""
  start = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - start


def bench_jaxacct(repeats=21):
  start = time.perf_counter()
  import jax
  import jaxacct
  t_import = time.perf_counter() - start

  def call():
    b = jaxacct.dpsgd_epsilon(SIGMA, Q, STEPS, DELTA)
    return jax.block_until_ready(b)

  b, t_cold = timed(call)
  warm = [timed(call)[1] for _ in range(repeats)]
  vals = tuple(float(x) for x in (b.lower, b.estimate, b.upper))
  return dict(vals=vals, status=int(b.status), t_import=t_import, t_cold=t_cold,
              t_warm=statistics.median(warm), t_warm_all=warm)


def bench_prv(repeats=2):
  from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

  def call():
    acc = PRVAccountant(
        prvs=[PoissonSubsampledGaussianMechanism(noise_multiplier=SIGMA, sampling_probability=Q)],
        eps_error=0.01, delta_error=DELTA / 1000, max_self_compositions=[STEPS])
    return acc.compute_epsilon(delta=DELTA, num_self_compositions=[STEPS])

  runs = [timed(call) for _ in range(repeats)]
  return dict(vals=tuple(float(x) for x in runs[0][0]), t_cold=runs[0][1],
              t_warm=statistics.median(t for _, t in runs[1:] or runs))


def bench_dpa(repeats=2):
  from dp_accounting.pld import privacy_loss_distribution as pld

  def call():
    p = pld.from_gaussian_mechanism(standard_deviation=SIGMA, sampling_prob=Q,
                                    value_discretization_interval=1e-4)
    return p.self_compose(STEPS).get_epsilon_for_delta(DELTA)

  runs = [timed(call) for _ in range(repeats)]
  return dict(vals=(float("nan"), float("nan"), float(runs[0][0])), t_cold=runs[0][1],
              t_warm=statistics.median(t for _, t in runs[1:] or runs))


def bench_batch():
  import jax
  import jaxacct
  sigmas = np.linspace(0.8, 2.0, N_BATCH)

  def batch():
    return jax.block_until_ready(jaxacct.dpsgd_epsilon(sigmas, Q, STEPS, DELTA))

  plan = jaxacct.dpsgd_plan(sigmas, Q, STEPS, DELTA)

  def single(s):
    return jax.block_until_ready(jaxacct.dpsgd_epsilon(s, Q, STEPS, DELTA, plan=plan))

  def one_grid():
    return jax.block_until_ready(jaxacct.dpsgd_epsilon(sigmas, Q, STEPS, DELTA, plan=plan))

  batch(), one_grid(), single(sigmas[0])  # compile every path
  out, t_batch = timed(batch)
  _, t_one_grid = timed(one_grid)
  start, n_loop = time.perf_counter(), 0
  for s in sigmas:
    single(s)
    n_loop += 1
    if n_loop == 32 and (time.perf_counter() - start) * N_BATCH / 32 > LOOP_BUDGET_S:
      break
  t_loop = (time.perf_counter() - start) * N_BATCH / n_loop
  own = jaxacct.pld.plan.batch_plan(jaxacct.dpsgd_composition(sigmas, Q, STEPS), DELTA)
  return dict(t_batch=t_batch, t_one_grid=t_one_grid, t_loop=t_loop, n_loop=n_loop,
              points=jaxacct.pld.plan.plan_points(own),
              one_grid_points=jaxacct.pld.plan.plan_points(plan),
              max_width=float(np.max(np.asarray(out.upper) - np.asarray(out.lower))),
              bad_status=int(np.count_nonzero(np.asarray(out.status))))


SMALL_BATCHES = [(100, 0.5, 0.8), (1000, 0.74, 1.41), (1000, 1.0, 3.0), (10_000, 1.0, 3.0)]


def bench_small_batch(steps, low, high, n=24):
  """A batch of small plans (n sigmas in [low, high] at T = ``steps``; plans of ~10^5 points, a
  calibration check's workload): the front door (on CPU a host loop of the single-setting
  program for plans this small) against the same plan run as one mapped program (``lax.map``
  over the settings, the front door's path for larger plans), both warm."""
  import jax
  import jaxacct
  from jaxacct import _batch
  from jaxacct.pld import accountant
  sigmas = np.linspace(low, high, n)
  comp = jaxacct.dpsgd_composition(sigmas, Q, steps)
  with jax.enable_x64(True):
    flat = _batch.flatten((comp, np.full(n, DELTA)))[0]
    plan = jaxacct.pld.plan.batch_plan(*flat)
  mapped = accountant._RUNNERS["epsilon"][1]

  def front_door():
    return jax.block_until_ready(jaxacct.dpsgd_epsilon(sigmas, Q, steps, DELTA))

  def one_program():
    with jax.enable_x64(True):
      return jax.block_until_ready(mapped(*flat, plan, 1))

  out, mapped_out = front_door(), one_program()  # compile both
  t_loop = min(timed(front_door)[1] for _ in range(3))
  t_map = min(timed(one_program)[1] for _ in range(3))
  gap = max(float(np.max(np.abs(np.asarray(getattr(out, f)) / np.asarray(getattr(mapped_out, f))
                                - 1.0))) for f in ("lower", "estimate", "upper"))
  return dict(n=n, steps=steps, low=low, high=high, sizes=plan.sizes, t_loop=t_loop,
              t_map=t_map, gap=gap)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="skip prv-accountant")
  args = parser.parse_args(argv)
  # Benchmark this checkout's jaxacct (the script's parent directory), installed or not.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

  load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
  jx = bench_jaxacct()  # first: its cold time must include JAX's first compilation
  import jax
  print(f"machine: processor={platform.processor()!r} cpu_count={os.cpu_count()} "
        f"jax={jax.__version__} devices={jax.devices()}\n"
        f"load average (1/5/15 min) before the jaxacct runs: {load}")
  print(f"workload: DP-SGD Poisson q={Q} sigma={SIGMA} T={STEPS} delta={DELTA}\n")
  print(f"jaxacct import {jx['t_import']:.2f} s, first call {jx['t_cold']:.2f} s, "
        f"import + first call {jx['t_import'] + jx['t_cold']:.2f} s; status {jx['status']}; "
        f"warm calls (s): {', '.join(f'{t:.3f}' for t in jx['t_warm_all'])}")

  rows = [("jaxacct", jx)]
  if not args.quick:
    rows.append(("prv-accountant", bench_prv()))
  rows.append(("dp-accounting (pld)", bench_dpa()))

  print(f"\n{'method':<20} {'eps lower':>10} {'estimate':>10} {'upper':>10} {'width':>8} "
        f"{'cold s':>8} {'warm s':>8} {'warm / jaxacct':>15}")
  for name, r in rows:
    lo, est, up = r["vals"]
    print(f"{name:<20} {lo:>10.5f} {est:>10.5f} {up:>10.5f} {up - lo:>8.5f} "
          f"{r['t_cold']:>8.3f} {r['t_warm']:>8.3f} {r['t_warm'] / jx['t_warm']:>14.1f}x")
  print("(cold s: first call in process; for jaxacct excluding the import. prv-accountant and "
        "dp-accounting: cold = 1st of 2 runs, warm = 2nd;\n dp-accounting gives only a "
        "pessimistic upper bound, shown in the 'upper' column)")

  b = bench_batch()
  note = "" if b["n_loop"] == N_BATCH else f" (extrapolated from {b['n_loop']} calls)"
  print(f"\nbatch of {N_BATCH} sigmas in linspace(0.8, 2.0), warm:")
  print(f"  one call, each setting its own grid ({b['points']:,} points a setting): "
        f"{b['t_batch']:.2f} s total, {1e3 * b['t_batch'] / N_BATCH:.1f} ms per setting")
  print(f"  one call on one grid for all ({b['one_grid_points']:,} points): "
        f"{b['t_one_grid']:.2f} s total, {1e3 * b['t_one_grid'] / N_BATCH:.1f} ms per setting")
  print(f"  loop of singles on that grid: {b['t_loop']:.2f} s total{note}, "
        f"{1e3 * b['t_loop'] / N_BATCH:.1f} ms per setting")
  print(f"  loop / call: {b['t_loop'] / b['t_batch']:.2f}x (one grid: "
        f"{b['t_loop'] / b['t_one_grid']:.2f}x); max bracket width in the call "
        f"{b['max_width']:.5f}; nonzero status: {b['bad_status']}")

  print(f"\nbatches of small plans, q = {Q}, warm: the front door (a host loop of the "
        "single-setting program) against one mapped program on the same plan, ms per setting")
  for steps, low, high in SMALL_BATCHES:
    s = bench_small_batch(steps, low, high)
    print(f"  {s['n']} sigmas {s['low']:g}...{s['high']:g}, T = {s['steps']:>6}, sizes "
          f"{s['sizes']}: loop {1e3 * s['t_loop'] / s['n']:6.2f}, mapped "
          f"{1e3 * s['t_map'] / s['n']:6.2f} ({s['t_map'] / s['t_loop']:.2f}x); bounds differ "
          f"by {s['gap']:.1e} (relative)")


if __name__ == "__main__":
  main()
