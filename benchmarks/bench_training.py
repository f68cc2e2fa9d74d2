"""DP training step: the cost of accounting inside the compiled step, beside a private step
without it and beside a host-side accountant (dp-accounting) called every step.

Workloads (issue 17), float32, synthetic MNIST-shaped data (28 x 28, 10 classes):
* a small MLP (784-128-10) and a small convnet (two 3x3 convolutions of 8 and 16 channels with
  2x2 average pooling, then a dense layer to 10), per-example gradients in microbatches of 128;
* Poisson sampling, expected batch 256 of N = 60,000, sigma = 1, C = 1, SGD:
  - "private step": sampler, per-example clipped sum, noise, optimiser -- no accounting;
  - "+ ledger": jaxacct's step with the worst-case ledger in the jit;
  - "+ dp-accounting per step": the private step, then dp-accounting's RDP accountant asked for
    epsilon after 1,000 steps (as jax_privacy users do on the host), or its PLD accountant;
* DP-GD on a batch of 256 (the whole dataset, N = 256) with an individual accountant inside the
  step (GDP filter, RDP filter, bucket counter) against the same DP-GD step without it.

Each figure: cold (first call: compile + run) and warm (the runners of a section timed in turns,
5 steps each per round, the median of the rounds' medians; the same batches for all). Ratios
print against the private step without accounting.
Run:  pip install -e ".[bench]"; python benchmarks/bench_training.py [--quick]
"""

from __future__ import annotations

import argparse
import math
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

from jaxacct import training  # noqa: E402
from jaxacct.training import gradients  # noqa: E402

SIGMA, CLIP, DELTA, MICRO = 1.0, 1.0, 1e-5, 128
HOST_STEPS = 1000  # the step count at which the host accountant is asked (its cost grows with T)


def mlp_init(key):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (784, 128)) * 0.03, "b1": jnp.zeros(128),
          "w2": jax.random.normal(k2, (128, 10)) * 0.1, "b2": jnp.zeros(10)}


def mlp_loss(p, ex):
  h = jax.nn.relu(ex["x"].reshape(-1) @ p["w1"] + p["b1"])
  return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"], ex["y"])


def conv_init(key):
  k1, k2, k3 = jax.random.split(key, 3)
  return {"c1": jax.random.normal(k1, (3, 3, 1, 8)) * 0.3, "c2": jax.random.normal(
      k2, (3, 3, 8, 16)) * 0.1, "w": jax.random.normal(k3, (7 * 7 * 16, 10)) * 0.02,
      "b": jnp.zeros(10)}


def conv_loss(p, ex):
  x = ex["x"][None, :, :, None]
  for kernel in (p["c1"], p["c2"]):
    x = jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    x = jax.nn.relu(x)
    x = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4
  logits = x.reshape(-1) @ p["w"] + p["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, ex["y"])


def dataset(n, seed=0):
  rng = np.random.default_rng(seed)
  return {"x": jnp.asarray(rng.normal(size=(n, 28, 28)).astype(np.float32)),
          "y": jnp.asarray(rng.integers(0, 10, n).astype(np.int32))}


def plain_private_step(config, loss, optimizer):
  """The same private step with no ledger and no individual accountant: the baseline."""
  sample = config.sampler_fn()
  m = config.microbatch_size

  def step(params, opt_state, key, data):
    key, sample_key, noise_key = jax.random.split(key, 3)
    batch = sample(sample_key)
    indices = gradients.pad_to(batch.indices, m, 0)
    weights = gradients.pad_to(batch.valid.astype(jnp.float32), m, 0.0)
    chunks = (batch.size + m - 1) // m
    summed, _, _ = gradients.private_sum(loss, params, data, indices, weights,
                                         config.clip_norm, m, chunks)
    noisy = gradients.add_noise(summed, noise_key, config.noise_multiplier * config.clip_norm)
    grad = jax.tree_util.tree_map(lambda g: g / config.expected_batch_size, noisy)
    updates, opt_state = optimizer.update(grad, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, key
  return step


def timed_steps(run, repeats):
  """(cold, warm): the first call's time, then the median of ``repeats`` calls."""
  start = time.perf_counter()
  jax.block_until_ready(run())
  cold = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(run())
    times.append(time.perf_counter() - start)
  return cold, statistics.median(times) if times else math.nan


def interleaved(runs, rounds, per_round=5):
  """Each runner's (cold, warm) with the runners timed in turns (round-robin, ``per_round``
  steps each per round), so that the machine's drift hits them alike; warm is the median of
  the per-round medians."""
  colds = [timed_steps(run, 0)[0] for run in runs]
  medians = [[] for _ in runs]
  for _ in range(rounds):
    for run, out in zip(runs, medians):
      out.append(timed_steps(run, per_round)[1])
  return [(cold, statistics.median(m)) for cold, m in zip(colds, medians)]


def baseline_runner(config, loss, init, data):
  optimizer = optax.sgd(0.1)
  step = jax.jit(plain_private_step(config, loss, optimizer), donate_argnums=(0, 1, 2))
  params = init(jax.random.PRNGKey(0))
  box = [params, optimizer.init(params), jax.random.PRNGKey(1)]

  def run():
    box[:] = step(*box, data)
    return box[0]
  return run


def trainer_runner(config, loss, init, data):
  trainer = training.private_trainer(config, loss, optax.sgd(0.1))
  step = jax.jit(trainer.step, donate_argnums=0)
  box = [trainer.init(init(jax.random.PRNGKey(0)), jax.random.PRNGKey(1), data)]

  def run():
    box[0], _ = step(box[0], data)
    return box[0].params
  return run


def host_accountant(kind, q, steps):
  """dp-accounting asked for epsilon after ``steps`` Poisson steps (what a host loop does)."""
  from dp_accounting import dp_event as E
  from dp_accounting import pld, rdp
  accountant = rdp.RdpAccountant() if kind == "rdp" else pld.PLDAccountant()
  accountant.compose(E.PoissonSampledDpEvent(q, E.GaussianDpEvent(SIGMA)), steps)
  return accountant.get_epsilon(DELTA)


def row(name, cold, warm, base=None):
  ratio = "" if base is None else f"{warm / base:8.3f}x ({100 * (warm / base - 1):+.1f}%)"
  print(f"  {name:<32s} cold {cold:7.2f} s   warm {1e3 * warm:8.2f} ms   {ratio}", flush=True)


def poisson_section(name, loss, init, n, batch, rounds, host_steps):
  print(f"\n{name}: Poisson, expected batch {batch} of N = {n}, microbatch {MICRO}")
  data = dataset(n)
  config = training.DPConfig(num_examples=n, noise_multiplier=SIGMA, clip_norm=CLIP,
                             batch_size=batch, steps=10 ** 6, microbatch_size=MICRO)
  runs = [baseline_runner(config, loss, init, data), trainer_runner(config, loss, init, data)]
  (cold, base), (cold_ledger, warm) = interleaved(runs, rounds)
  row("private step (no accounting)", cold, base)
  row("+ ledger in the step (jaxacct)", cold_ledger, warm, base)
  for kind in ("rdp", "pld"):
    cold, host = timed_steps(lambda: host_accountant(kind, batch / n, host_steps), 5)
    row(f"+ dp-accounting {kind.upper()} per step", cold, base + host, base)


def dpgd_section(name, loss, init, n, rounds):
  print(f"\n{name}: DP-GD on a batch of N = {n} (every example every step), "
        f"microbatch {MICRO}")
  data = dataset(n)
  kwargs = dict(num_examples=n, noise_multiplier=SIGMA, clip_norm=CLIP, steps=10 ** 4,
                sampler="full", microbatch_size=MICRO)
  accountants = ("worst_case", "gdp_filter", "rdp_filter", "bucket_counter")
  runs = [baseline_runner(training.DPConfig(**kwargs), loss, init, data)]
  runs += [trainer_runner(training.DPConfig(**kwargs, accountant=a), loss, init, data)
           for a in accountants]
  timed = interleaved(runs, rounds)
  base = timed[0][1]
  row("private step (no accounting)", *timed[0])
  for accountant, (cold, warm) in zip(accountants, timed[1:]):
    row(f"+ {accountant} in the step", cold, warm, base)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args()
  rounds = 4 if args.quick else 20
  print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}")
  for name, loss, init in (("MLP 784-128-10", mlp_loss, mlp_init),
                           ("convnet 8-16 channels", conv_loss, conv_init)):
    poisson_section(name, loss, init, 60_000, 256, rounds, HOST_STEPS)
    dpgd_section(name, loss, init, 256, rounds)


if __name__ == "__main__":
  main()
