"""GPU check: jaxacct on an accelerator against stored CPU values, in one short run (< 5 min).

* accountants: the certified PLD, saddle-point, Edgeworth and RDP epsilons of DP-SGD settings,
  and a calibrated noise multiplier, computed on the accelerator (JAX's default device there),
  against the CPU's stored values: 1e-10 relative;
* training: 10 jitted steps of a small MLP with the RDP filter (Poisson) on the accelerator, the
  model's own matmuls at float32 precision, against the CPU run: parameters 1e-5 relative, the
  ledger's integers identical; the trainer built with a target (its budget check on the CPU
  backend) and ``privacy_report`` asked on the accelerator (``device=``) against the CPU's;
* throughput: the per-example PLD report (bucket counts of 4,096 examples) on the accelerator
  and on the CPU backend, in examples per second, and the warm private step (MLP 784-128-10 and
  a 8/16-channel convnet, expected batch 256 of 60,000, microbatches of 128).

One table; ``--json PATH`` also writes the figures. ``--store`` (on CPU) rewrites the stored
values, ``benchmarks/data/gpu_check_cpu.json``.
Run on a CUDA machine with jax, flax, optax and orbax:  pip install --no-deps -e . ;
python benchmarks/gpu_check.py --json gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxacct  # noqa: E402
from jaxacct import individual, training  # noqa: E402
from bench_training import conv_init, conv_loss, dataset, mlp_init, mlp_loss  # noqa: E402

STORED = os.path.join(ROOT, "benchmarks", "data", "gpu_check_cpu.json")
SETTINGS = [(1.0, 0.01, 1000, 1e-5), (0.8, 0.004, 10_000, 1e-7), (2.0, 0.1, 300, 1e-10)]
ACCOUNTANTS = ("pld", "spa", "edgeworth", "rdp")
TRAIN_N, TRAIN_STEPS = 256, 10
REPORT_N = 4096


def accountant_values():
  """{name: [lower, estimate, upper]} of every accountant and setting, and the calibration."""
  out = {}
  for sigma, q, steps, delta in SETTINGS:
    for name in ACCOUNTANTS:
      b = jaxacct.dpsgd_epsilon(sigma, q, steps, delta, accountant=name)
      out[f"{name} sigma={sigma} q={q} T={steps} delta={delta:g}"] = [
          float(b.lower), float(b.estimate), float(b.upper)]
  out["calibrated sigma (eps 2, delta 1e-5, q 0.01, T 1000)"] = [float(
      jaxacct.calibrate.noise_multiplier(2.0, 1e-5, sampling_rate=0.01, steps=1000))]
  return out


def small_mlp(key):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (20, 32)) * 0.3, "b1": jnp.zeros(32),
          "w2": jax.random.normal(k2, (32, 4)) * 0.3, "b2": jnp.zeros(4)}


def small_loss(p, ex):
  h = jnp.tanh(ex["x"] @ p["w1"] + p["b1"])
  return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"], ex["y"])


def training_run(device=None):
  """(parameters, the ledger's integer and boolean arrays, the report's worst-case and largest
  individual epsilon) after TRAIN_STEPS steps; the report on
  ``device`` (default the CPU backend)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(TRAIN_N, 20)).astype(np.float32)
  data = {"x": x, "y": (np.abs(x[:, :4]).argmax(1)).astype(np.int32)}
  config = training.DPConfig(num_examples=TRAIN_N, batch_size=32, noise_multiplier=1.2,
                             clip_norm=1.0, steps=50, accountant="rdp_filter",
                             microbatch_size=32, target_epsilon=12.0)
  trainer = training.private_trainer(config, small_loss, optax.adam(0.01))
  with jax.default_matmul_precision("float32"):
    state = trainer.init(small_mlp(jax.random.key(0)), jax.random.key(1), data)
    step = jax.jit(trainer.step)
    for _ in range(TRAIN_STEPS):
      state, _ = step(state, data)
  report = training.privacy_report(state, device=device)
  params = {k: np.asarray(v, np.float64).ravel().tolist() for k, v in state.params.items()}
  ledger = [np.asarray(v).tolist() for v in jax.tree_util.tree_leaves(state.ledger)
            if not np.issubdtype(np.asarray(v).dtype, np.floating)]  # (integers and flags)
  return params, ledger, [float(report.epsilon.upper), report.individual[1.0]]


def per_example_report(devices):
  """(examples per second warm, epsilon upper summary) of the per-example report on
  ``devices``."""
  grid = individual.noise_grid(1.0)
  rng = np.random.default_rng(3)
  weights = 0.7 ** np.arange(grid.size)
  counts = rng.multinomial(rng.integers(100, 1000, REPORT_N), weights / weights.sum())
  run = lambda: individual.per_example_privacy(counts, 1000, grid, 0.01, 1e-5, devices=devices)
  run()  # compile
  start = time.perf_counter()
  report = run()
  seconds = time.perf_counter() - start
  upper = np.asarray(report.pld.upper)
  return REPORT_N / seconds, [float(np.max(upper)), float(np.mean(upper))]


def step_time(loss, init):
  """Warm seconds per private step (Poisson, expected batch 256 of 60,000), median of 20."""
  config = training.DPConfig(num_examples=60_000, batch_size=256, noise_multiplier=1.0,
                             clip_norm=1.0, steps=10_000, microbatch_size=128,
                             capacity=400, overflow_probability=1e-12, delta=1e-5)
  trainer = training.private_trainer(config, loss, optax.sgd(0.1))
  data = dataset(60_000)
  state = trainer.init(init(jax.random.key(0)), jax.random.key(1), data)
  step = jax.jit(trainer.step, donate_argnums=0)
  state, _ = step(state, data)
  jax.block_until_ready(state)
  times = []
  for _ in range(20):
    start = time.perf_counter()
    state, _ = step(state, data)
    jax.block_until_ready(state)
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def relative(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  same = (a == b) | (np.isnan(a) & np.isnan(b))
  with np.errstate(invalid="ignore"):  # (inf - inf where both are inf: counted as same)
    error = np.abs(a - b) / np.maximum(np.abs(b), 1e-300)
  return float(np.max(np.where(same, 0.0, np.where(np.isnan(error), np.inf, error)),
                      initial=0.0))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--store", action="store_true", help="rewrite the stored CPU values")
  parser.add_argument("--json", help="also write the figures here")
  args = parser.parse_args()
  device = jax.devices()[0]
  start = time.perf_counter()
  values = accountant_values()
  params, ledger, report = training_run(device)
  if args.store:
    with open(STORED, "w") as f:
      json.dump(dict(accountants=values, params=params, ledger=ledger, report=report,
                     machine=platform.processor() or platform.machine(), jax=jax.__version__),
                f, indent=1)
    print(f"stored {STORED}")
    return
  with open(STORED) as f:
    stored = json.load(f)
  rows = []
  for name, got in values.items():
    rows.append((f"{name}", relative(got, stored["accountants"][name]), 1e-10))
  rows.append(("training: parameters after 10 steps",
               max(relative(params[k], stored["params"][k]) for k in params), 1e-5))
  rows.append(("training: integer ledger identical (0 = yes)",
               float(ledger != stored["ledger"]), 0.0))
  rows.append(("training: privacy_report on the device", relative(report, stored["report"]),
               1e-10))
  accelerator_rate, summary = per_example_report(jax.local_devices())
  cpu_rate, cpu_summary = per_example_report(jax.local_devices(backend="cpu"))
  rows.append(("per-example report: device vs CPU", relative(summary, cpu_summary), 1e-10))
  mlp, conv = step_time(mlp_loss, mlp_init), step_time(conv_loss, conv_init)
  print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}; stored CPU "
        f"values: {stored['machine']}, jax {stored['jax']}")
  width = max(len(r[0]) for r in rows)
  failed = 0
  for name, error, tolerance in rows:
    ok = error <= tolerance
    failed += not ok
    print(f"{name:<{width}}  {error:9.2e}  (<= {tolerance:g})  {'ok' if ok else 'FAILED'}")
  print(f"per-example report: {accelerator_rate:,.0f} examples/s on the device, "
        f"{cpu_rate:,.0f} on the CPU backend")
  print(f"private step, warm: MLP {1e3 * mlp:.2f} ms, convnet {1e3 * conv:.2f} ms")
  print(f"{len(rows) - failed} of {len(rows)} checks passed in "
        f"{time.perf_counter() - start:.0f} s")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(device=device.device_kind, rows=rows, report_rate=accelerator_rate,
                     cpu_report_rate=cpu_rate, mlp_step=mlp, conv_step=conv), f, indent=1)
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
