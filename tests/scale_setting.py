"""The small run the scale-out tests share (tests/scale_runs.py in fresh processes with
forced host devices, tests/test_scale.py for one-device references): no side effects."""

import jax.numpy as jnp
import numpy as np
import optax

from jaxacct import training

N, D = 32, 3
COMBOS = [("poisson", "worst_case"), ("poisson", "rdp_filter"), ("poisson", "bucket_counter"),
          ("fixed", "worst_case"), ("full", "worst_case"), ("full", "gdp_filter"),
          ("full", "rdp_filter"), ("full", "bucket_counter")]


def data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(N, D)).astype(np.float32) * rng.uniform(0.2, 3.0, size=(N, 1))
  return {"x": x.astype(np.float32), "y": (x[:, 0] > 0).astype(np.int32)}


def params(dtype=jnp.float32):
  rng = np.random.default_rng(1)
  return {"w": jnp.asarray(rng.normal(size=(D, 2)), dtype), "b": jnp.zeros(2, dtype)}


def loss(p, example):
  logits = example["x"] @ p["w"] + p["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, example["y"])


def config(sampler, accountant, **changes):
  kw = dict(num_examples=N, noise_multiplier=1.1, clip_norm=0.5, steps=20, microbatch_size=4,
            sampler=sampler, accountant=accountant)
  if sampler != "full":
    kw["batch_size"] = 8
  kw.update(changes)
  return training.DPConfig(**kw)


