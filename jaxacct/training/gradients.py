"""Private gradients: per-example gradients, clipping, the summed clipped gradient and its noise.

The loss is a function of a parameter pytree and *one* example (a pytree of arrays without a
batch axis), ``loss(params, example) -> scalar``; ``per_example_gradients`` vmaps its gradient
over a batch. A Flax NNX model becomes such a pair with ``nnx_loss``.

Every example's gradient g_i is clipped to norm C (g_i min(1, C / ||g_i||)), weighted by w_i
(1 for a member of the step's batch, 0 for padding or an example its filter refused, a scale in
(0, 1] otherwise) and summed. Entries of weight 0 contribute exactly zero, even when their
gradient is not finite; an example whose gradient norm is not finite (NaN or inf) contributes
zero too (it cannot be clipped). ``add_noise`` adds N(0, (sigma C)^2) to every
coordinate. Batches are processed in microbatches so memory stays that of one microbatch.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax


def per_example_gradients(loss, params, examples):
  """(losses [B], gradients with a leading batch axis [B, ...]) of ``loss`` at each example."""
  return jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0))(params, examples)


def global_norms(gradients):
  """Each example's gradient norm over all leaves ([B])."""
  leaves = jax.tree_util.tree_leaves(gradients)
  squares = [jnp.sum(jnp.reshape(g, (g.shape[0], -1)).astype(
      jnp.promote_types(g.dtype, jnp.float32)) ** 2, axis=1) for g in leaves]
  return jnp.sqrt(sum(squares))


# Clip factors are shaved by this much: the factor's division and the product's rounding then
# keep a clipped gradient's norm <= C (float32 and wider parameters).
_CLIP_SHAVE = 1e-6


def clip_factors(norms, clip_norm):
  """min(1, C / ||g||) per example (1 for a zero gradient, 0 for a norm that is not finite);
  ``clip_norm`` a scalar or one bound per example."""
  finite = jnp.isfinite(norms)
  safe = jnp.where(finite & (norms > 0), norms, 1.0)
  scaled = clip_norm / safe * (1.0 - _CLIP_SHAVE)
  return jnp.where(finite, jnp.where(norms > clip_norm, scaled, 1.0), 0.0)


def clipped_sum(gradients, norms, weights, clip_norm):
  """sum_i w_i min(1, C/||g_i||) g_i (``clip_norm`` a scalar or one bound per example);
  entries of weight 0 contribute exactly zero."""
  factors = jnp.where(weights > 0, weights * clip_factors(norms, clip_norm), 0.0)

  def leaf_sum(g):  # (the mask through the factors: XLA then computes g once, not twice)
    kept = jnp.where(jnp.reshape(factors > 0, (-1,) + (1,) * (g.ndim - 1)), g, 0)
    return jnp.tensordot(factors.astype(g.dtype), kept, axes=1)
  return jax.tree_util.tree_map(leaf_sum, gradients)


def add_noise(tree, key, std):
  """``tree`` plus independent N(0, std^2) noise on every coordinate (a key per leaf, split in
  the order of ``tree_leaves``)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  keys = jax.random.split(key, len(leaves))
  noisy = [x + std * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  return jax.tree_util.tree_unflatten(treedef, noisy)


def microbatch_gradients(loss, params, data, indices):
  """Per-example losses, gradients and norms of the examples ``data[indices]``."""
  examples = jax.tree_util.tree_map(lambda x: x[indices], data)
  losses, gradients = per_example_gradients(loss, params, examples)
  return losses, gradients, global_norms(gradients)


def zeros_like_params(params):
  return jax.tree_util.tree_map(jnp.zeros_like, params)


class Examples(NamedTuple):
  """Per-example values of a step's buffer ([buffer]): losses, gradient norms (in the dtype they
  were computed in) and the weights their gradients entered the sum with (0 for padding, refused
  examples and chunks not run)."""

  losses: jax.Array
  norms: jax.Array
  weights: jax.Array


def private_sum(loss, params, data, indices, weights, clip_norm, microbatch_size,
                chunks=None, weigh=None, carry=None):
  """The clipped, weighted gradient sum of ``data[indices]`` over microbatches.

  ``indices``, ``weights`` (and ``clip_norm`` when it is one bound per entry) are padded to a
  multiple of ``microbatch_size``; ``chunks`` (may
  be traced: a while loop then runs only the chunks holding sampled examples) defaults to all.
  ``weigh(carry, indices, weights, norms) -> (carry, weights)`` lets a per-example accountant
  see each microbatch's norms before its gradients are summed (``carry`` its state).
  Returns (summed gradient, carry, ``Examples``).
  """
  m = microbatch_size
  total = indices.shape[0] // m
  chunks = total if chunks is None else chunks
  blank = jnp.zeros((total, m), jnp.float32)
  # (norms kept in their own dtype: an accountant may charge them after the sum)
  norm_type = jax.eval_shape(lambda: microbatch_gradients(loss, params, data, indices[:m])[2])
  blank_norms = jnp.zeros((total, m), norm_type.dtype)

  def body(k, state):
    summed, inner, seen = state
    at = jax.lax.dynamic_slice(indices, (k * m,), (m,))
    w = jax.lax.dynamic_slice(weights, (k * m,), (m,))
    bound = (jax.lax.dynamic_slice(clip_norm, (k * m,), (m,)) if jnp.ndim(clip_norm)
             else clip_norm)
    losses, gradients, norms = microbatch_gradients(loss, params, data, at)
    if weigh is not None:
      inner, w = weigh(inner, at, w, norms)
    part = clipped_sum(gradients, norms, w, bound)
    summed = jax.tree_util.tree_map(jnp.add, summed, part)
    values = (jnp.where(w > 0, losses, 0.0), norms, w)
    seen = Examples(*(old.at[k].set(new.astype(old.dtype)) for old, new in zip(seen, values)))
    return summed, inner, seen

  start = (zeros_like_params(params), carry, Examples(blank, blank_norms, blank))
  summed, carry, seen = jax.lax.fori_loop(0, chunks, body, start)
  return summed, carry, Examples(*(x.reshape(-1) for x in seen))


def all_norms(loss, params, data, num_examples, microbatch_size):
  """Every example's gradient norm ([N]), in microbatches (for accounting that needs all)."""
  def one_chunk(at):
    return microbatch_gradients(loss, params, data, at)[2]
  padded = pad_to(jnp.arange(num_examples, dtype=jnp.int32), microbatch_size, 0)
  norms = jax.lax.map(one_chunk, padded.reshape(-1, microbatch_size))
  return norms.reshape(-1)[:num_examples]


def pad_to(array, multiple, value):
  """``array`` padded with ``value`` to a length that is a multiple of ``multiple``."""
  extra = (-array.shape[0]) % multiple
  return jnp.concatenate([array, jnp.full((extra,), value, array.dtype)]) if extra else array


class AggregateState(NamedTuple):
  key: jax.Array


def private_aggregate(clip_norm, noise_multiplier,
                      key) -> optax.GradientTransformationExtraArgs:
  """An Optax transformation for per-example gradients you compute yourself.

  ``update(per_example_updates, state, params=None, *, weights=None)`` takes updates with a
  leading batch axis and returns their clipped sum plus N(0, (sigma C)^2) noise (``weights`` in
  [0, 1], clamped: 0 drops a padding row or a refused example; the noise key advances every
  call). Chain it before your optimiser, dividing by the expected batch size, e.g.
  ``optax.chain(private_aggregate(C, sigma, key), optax.scale(1 / expected_batch),
  optax.adam(1e-3))``, and pass ``weights=`` to the chain's ``update``: it is an
  ``optax.GradientTransformationExtraArgs``, so ``optax.chain`` hands it on. The privacy of the
  run is that of the sampler that drew the batches: account it with ``DPConfig.composition``.
  """
  if not clip_norm > 0:
    raise ValueError(f"clip_norm must be > 0; got {clip_norm!r}")
  if not noise_multiplier > 0:
    raise ValueError(f"noise_multiplier must be > 0; got {noise_multiplier!r}")

  def init(params):
    del params
    return AggregateState(jnp.asarray(key))

  def update(updates, state, params=None, *, weights=None, **extra_args):
    del params, extra_args  # (the chain's other extra arguments are not ours)
    norms = global_norms(updates)
    weights = (jnp.ones_like(norms) if weights is None
               else jnp.clip(jnp.asarray(weights, norms.dtype), 0.0, 1.0))
    step_key, next_key = jax.random.split(state.key)
    summed = clipped_sum(updates, norms, weights, clip_norm)
    return add_noise(summed, step_key, noise_multiplier * clip_norm), AggregateState(next_key)

  return optax.GradientTransformationExtraArgs(init, update)


def nnx_loss(model, loss_fn: Callable):
  """A Flax NNX model as ``(params, loss)``: ``params`` its ``nnx.Param`` state, ``loss(params,
  example) = loss_fn(model with params, example)``. Other variables are held fixed; write the
  trained parameters back with ``nnx.update(model, params)``."""
  from flax import nnx
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p, example):
    return loss_fn(nnx.merge(graphdef, p, rest), example)
  return params, loss


__all__ = ["AggregateState", "Examples", "add_noise", "all_norms", "clip_factors", "clipped_sum",
           "global_norms", "nnx_loss", "per_example_gradients", "private_aggregate",
           "private_sum"]
