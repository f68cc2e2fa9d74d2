"""Scaling of the private training step: on 1, 2, 4 and 8 forced host devices, and beside
jax_privacy 2.0's clipped-gradient step on one device.

* Mesh: 10 steps of an MLP 784-128-10 (Poisson, expected batch 256 of N = 4,096, microbatches of
  64) on a mesh of 1, 2, 4 and 8 forced CPU host devices in this process: the parameters'
  difference from the one-device run (each leaf's ||a - b|| / ||a||, the largest), and the warm
  step time. On a 2-core
  machine no speed-up is expected, only no blow-up beyond the cost of the collective.
* Peers, one device, the same batch of 64 rows, float32, SGD: jaxacct's private step (sampler
  "full" over the 64 rows: per-example gradients in one microbatch, clipping, noise, optimiser,
  ledger), jax_privacy's (``clipped_grad``, the same Gaussian noise and optimiser) and the
  non-private step (the mean loss's gradient), on an MLP 64-128-10 and a convnet (3x3
  convolutions of 16 and 32 channels with 2x2 average pooling on 28 x 28, then dense to 10).

Warm times: the runners timed in turns, 10 steps each per round, the median of 7 rounds'
medians. Run:  pip install -e ".[bench]"; python benchmarks/bench_scaling.py [--quick]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jaxacct import training  # noqa: E402
from jaxacct.training import gradients  # noqa: E402
from bench_training import conv_loss, interleaved, mlp_init, mlp_loss  # noqa: E402

SIGMA, CLIP, LR = 1.0, 1.0, 0.1
PEER_ROWS = 64


def mesh_section(quick):
  n = 4096
  rng = np.random.default_rng(0)
  data = {"x": rng.normal(size=(n, 28, 28)).astype(np.float32),
          "y": rng.integers(0, 10, n).astype(np.int32)}
  config = training.DPConfig(num_examples=n, batch_size=256, noise_multiplier=SIGMA,
                             clip_norm=CLIP, steps=10_000, microbatch_size=64, capacity=400,
                             overflow_probability=1e-12)
  params = mlp_init(jax.random.PRNGKey(0))
  rows, runs, finals, colds = [], [], {}, []
  for count in (1, 2, 4, 8):
    mesh = None if count == 1 else jax.make_mesh(
        (count,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:count])
    trainer = training.private_trainer(config, mlp_loss, optax.sgd(LR), mesh=mesh)
    placed = trainer.place(data)
    state = trainer.init(params, jax.random.key(1), placed)
    step = jax.jit(trainer.step)
    start = time.perf_counter()
    state, _ = step(state, placed)
    jax.block_until_ready(state)
    colds.append(time.perf_counter() - start)  # (compile and the first step)
    for _ in range(9):
      state, _ = step(state, placed)
    finals[count] = state.params
    box = [state]

    def run(box=box, step=step, placed=placed):
      box[0], _ = step(box[0], placed)
      return box[0].params
    runs.append(run)
  times = interleaved(runs, 3 if quick else 7, per_round=10)
  for count, cold, (_, warm) in zip((1, 2, 4, 8), colds, times):
    diff = max(float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(a))
               for a, b in zip(jax.tree_util.tree_leaves(finals[1]),
                               jax.tree_util.tree_leaves(finals[count])))
    rows.append((count, diff, cold, warm))
  print("\nPrivate step on a mesh of forced host devices (MLP 784-128-10, Poisson 256 of 4,096)")
  print(f"{'devices':>8} {'params vs 1 device':>19} {'cold s':>8} {'warm ms':>8} {'vs 1':>6}"
        "   (params: each leaf's ||a - b|| / ||a||, the largest)")
  for count, diff, cold, warm in rows:
    print(f"{count:>8} {diff:>19.1e} {cold:>8.2f} {1e3 * warm:>8.2f} "
          f"{warm / rows[0][3]:>6.2f}")


def small_mlp_init(key):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (64, 128)) * 0.1, "b1": jnp.zeros(128),
          "w2": jax.random.normal(k2, (128, 10)) * 0.1, "b2": jnp.zeros(10)}


def small_mlp_loss(p, ex):
  h = jax.nn.relu(ex["x"] @ p["w1"] + p["b1"])
  return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"], ex["y"])


def convnet_init(key):
  k1, k2, k3 = jax.random.split(key, 3)
  return {"c1": jax.random.normal(k1, (3, 3, 1, 16)) * 0.3,
          "c2": jax.random.normal(k2, (3, 3, 16, 32)) * 0.1,
          "w": jax.random.normal(k3, (7 * 7 * 32, 10)) * 0.02, "b": jnp.zeros(10)}


def jaxacct_runner(loss, params, data):
  config = training.DPConfig(num_examples=PEER_ROWS, noise_multiplier=SIGMA, clip_norm=CLIP,
                             steps=10**9, sampler="full", microbatch_size=PEER_ROWS)
  trainer = training.private_trainer(config, loss, optax.sgd(LR))
  step = jax.jit(trainer.step, donate_argnums=0)
  box = [trainer.init(params, jax.random.key(1), data)]

  def run():
    box[0], _ = step(box[0], data)
    return box[0].params
  return run


def jax_privacy_runner(loss, params, data):
  from jax_privacy import clipped_grad
  optimizer = optax.sgd(LR)
  grad = clipped_grad(loss, l2_clip_norm=CLIP, keep_batch_dim=False)

  @jax.jit
  def step(params, opt_state, key):
    key, noise_key = jax.random.split(key)
    noisy = gradients.add_noise(grad(params, data), noise_key, SIGMA * CLIP)  # (same noise)
    noisy = jax.tree_util.tree_map(lambda g: g / PEER_ROWS, noisy)
    updates, opt_state = optimizer.update(noisy, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, key
  box = [params, optimizer.init(params), jax.random.key(1)]

  def run():
    box[:] = step(*box)
    return box[0]
  return run


def non_private_runner(loss, params, data):
  optimizer = optax.sgd(LR)

  @jax.jit
  def step(params, opt_state):
    mean = lambda p: jnp.mean(jax.vmap(loss, in_axes=(None, 0))(p, data))
    updates, opt_state = optimizer.update(jax.grad(mean)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  box = [params, optimizer.init(params)]

  def run():
    box[:] = step(*box)
    return box[0]
  return run


def peer_section(quick):
  rng = np.random.default_rng(0)
  device = jax.devices()[0]
  print(f"\nOne device, {PEER_ROWS} rows, float32: jaxacct's private step beside jax_privacy "
        f"2.0's and the non-private step (warm ms; ratios to jax_privacy / non-private)")
  print(f"{'model':<18} {'jaxacct':>8} {'jax_privacy':>12} {'non-private':>12} "
        f"{'vs jax_privacy':>15} {'vs non-private':>15}")
  models = [("MLP 64-128-10", small_mlp_init, small_mlp_loss, (64,)),
            ("convnet 16/32", convnet_init, conv_loss, (28, 28))]
  for name, init, loss, shape in models:
    data = jax.device_put({"x": rng.normal(size=(PEER_ROWS,) + shape).astype(np.float32),
                           "y": rng.integers(0, 10, PEER_ROWS).astype(np.int32)}, device)
    params = jax.device_put(init(jax.random.PRNGKey(0)), device)
    runs = [make(loss, params, data) for make in (jaxacct_runner, jax_privacy_runner,
                                                  non_private_runner)]
    (_, ours), (_, peer), (_, plain) = interleaved(runs, 3 if quick else 7, per_round=10)
    print(f"{name:<18} {1e3 * ours:>8.2f} {1e3 * peer:>12.2f} {1e3 * plain:>12.2f} "
          f"{ours / peer:>15.2f} {ours / plain:>15.2f}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="fewer rounds")
  args = parser.parse_args()
  print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"jax {jax.__version__}, {jax.device_count()} forced host devices")
  peer_section(args.quick)
  mesh_section(args.quick)


if __name__ == "__main__":
  main()
