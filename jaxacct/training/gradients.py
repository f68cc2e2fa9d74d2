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

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax


def per_example_gradients(loss, params, examples):
  """(losses [B], gradients with a leading batch axis [B, ...]) of ``loss`` at each example."""
  return jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0))(params, examples)


# Norms: each leaf's squares summed in blocks of _BLOCK (in whatever order XLA picks), the
# blocks' sums and then the leaves' sums added pairwise (an explicit tree), all in float32 or
# wider. A sum of nonnegative terms whose additions nest at most d deep has relative error at
# most gamma_d = d u / (1 - d u) (u the unit round-off: Higham, Accuracy and Stability of
# Numerical Algorithms, Sec. 4.2), here d <= _BLOCK + log2(P / _BLOCK) + log2(leaves) + 1 (the
# squares' rounding): below _DEPTH for up to 2^48 parameters in up to 2^20 leaves.
_BLOCK = 64
_DEPTH = _BLOCK + 48 + 20 + 1


def _pairwise_sum(x):
  """The sum over the last axis of ``x`` by an explicit tree of pairwise additions (depth
  ceil(log2 n))."""
  while x.shape[-1] > 1:
    if x.shape[-1] % 2:
      x = jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (1,), x.dtype)], axis=-1)
    x = x[..., 0::2] + x[..., 1::2]
  return x[..., 0]


def _squares_by_example(g):
  """sum_j g_ij^2 of one leaf ([B, ...] -> [B]) in float32 or wider, blocked then pairwise."""
  flat = jnp.reshape(g, (g.shape[0], -1)).astype(jnp.promote_types(g.dtype, jnp.float32))
  if flat.shape[1] == 0:  # (an empty leaf)
    return jnp.zeros(flat.shape[0], flat.dtype)
  extra = (-flat.shape[1]) % _BLOCK if flat.shape[1] > _BLOCK else 0
  flat = jnp.pad(flat, ((0, 0), (0, extra)))
  blocks = jnp.sum(jnp.reshape(flat ** 2, (flat.shape[0], -1, min(_BLOCK, flat.shape[1]))), -1)
  return _pairwise_sum(blocks)


def global_norms(gradients):
  """Each example's gradient norm over all leaves ([B]), in float32 or wider whatever the
  parameters' dtype, with relative error below ``norm_error()`` (see ``clip_factors``)."""
  squares = [_squares_by_example(g) for g in jax.tree_util.tree_leaves(gradients)]
  dtype = jnp.result_type(*squares)
  return jnp.sqrt(_pairwise_sum(jnp.stack([s.astype(dtype) for s in squares], axis=-1)))


def norm_error(dtype=jnp.float32) -> float:
  """gamma of the norm's sum of squares in ``dtype``: the computed squared norm is within a
  factor (1 +- gamma) of the exact one of the gradient as computed."""
  u = float(jnp.finfo(dtype).eps) / 2
  return _DEPTH * u / (1 - _DEPTH * u)


def clip_margin(dtype=jnp.float32) -> float:
  """The relative shave of every clip factor: a clipped gradient's exact norm stays <= C.

  With n the exact norm, n^ the computed one (n^ >= n sqrt(1 - gamma) (1 - u): the sum's error
  and the square root's rounding), the factor f = fl(fl(C (1 - s)) / n^) <= C (1 - s)(1 + u)^2 /
  n^, and each coordinate's product rounding (1 + u): ||fl(f g)|| <= C (1 - s) (1 + u)^3 /
  (sqrt(1 - gamma) (1 - u)), which is <= C for s >= 1 - sqrt(1 - gamma) (1 - u) / (1 + u)^3;
  the margin is twice that (checked in exact arithmetic in the tests)."""
  u = float(jnp.finfo(dtype).eps) / 2
  return 2.0 * (1.0 - math.sqrt(1.0 - norm_error(dtype)) * (1 - u) / (1 + u) ** 3)


def clip_factors(norms, clip_norm):
  """min(1, C (1 - s) / ||g||) per example, s = ``clip_margin`` (1 for a zero gradient, 0 for a
  norm that is not finite); ``clip_norm`` a scalar or one bound per example. Every gradient at
  or within the margin of C is scaled, so a norm computed a little low cannot slip through."""
  finite = jnp.isfinite(norms)
  bound = clip_norm * (1.0 - clip_margin(norms.dtype))
  safe = jnp.where(finite & (norms > 0), norms, 1.0)
  return jnp.where(finite, jnp.where(norms > bound, bound / safe, 1.0), 0.0)


def clipped_sum(gradients, norms, weights, clip_norm):
  """sum_i w_i min(1, C/||g_i||) g_i in float32 or wider (``clip_norm`` a scalar or one bound
  per example); entries of weight 0 contribute exactly zero. The sum over examples is a
  contraction at ``precision=HIGHEST`` (no bf16 passes or TF32 on accelerators)."""
  factors = jnp.where(weights > 0, weights * clip_factors(norms, clip_norm), 0.0)

  def leaf_sum(g):  # (the mask through the factors: XLA then computes g once, not twice)
    wide = jnp.promote_types(g.dtype, jnp.float32)
    kept = jnp.where(jnp.reshape(factors > 0, (-1,) + (1,) * (g.ndim - 1)), g, 0).astype(wide)
    return jnp.tensordot(factors.astype(wide), kept, axes=1,
                         precision=jax.lax.Precision.HIGHEST)
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


def sum_buffers(params):
  """Zeros shaped like ``params`` in float32 or wider: where a clipped sum accumulates."""
  return jax.tree_util.tree_map(
      lambda p: jnp.zeros(jnp.shape(p), jnp.promote_types(p.dtype, jnp.float32)), params)


class Examples(NamedTuple):
  """Per-example values of a step's buffer ([buffer]): losses, gradient norms (in the dtype they
  were computed in) and the weights their gradients entered the sum with (0 for padding, refused
  examples and chunks not run)."""

  losses: jax.Array
  norms: jax.Array
  weights: jax.Array


def private_sum(loss, params, data, indices, weights, clip_norm, microbatch_size,
                chunks=None, weigh=None, carry=None):
  """The clipped, weighted gradient sum of ``data[indices]`` over microbatches, in float32 or
  wider.

  ``indices``, ``weights`` (and ``clip_norm`` when it is one bound per entry) are padded to a
  multiple of ``microbatch_size``; ``chunks`` (may be traced: a while loop then runs only the
  chunks holding sampled examples) defaults to all. When one microbatch holds the buffer there
  is no loop (XLA compiles some gradients, convolutions on CPU among them, far slower inside
  one); a traced ``chunks`` of 0 then zeroes the weights.
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
    if total == 1:
      w = jnp.where(k < chunks, w, 0.0)
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

  start = (sum_buffers(params), carry, Examples(blank, blank_norms, blank))
  if total == 1:
    summed, carry, seen = body(0, start)
  else:
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
  """The state of ``private_aggregate``: the random key its next noise is drawn from."""

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
    noisy = add_noise(summed, step_key, noise_multiplier * clip_norm)
    like_input = jax.tree_util.tree_map(lambda x, u: x.astype(u.dtype), noisy, updates)
    return like_input, AggregateState(next_key)

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


__all__ = ["AggregateState", "Examples", "add_noise", "all_norms", "clip_factors", "clip_margin",
           "clipped_sum", "global_norms", "nnx_loss", "norm_error", "per_example_gradients",
           "private_aggregate", "private_sum", "sum_buffers"]
