"""Batches of settings: the broadcast of every leaf's batch shape, with each model field's event
shape kept whole.

A leaf's *event* dimensions are the trailing ones a model declares for a field that holds a
vector per setting (a mixture's weights over its components: ``event_field``); every other
dimension is a batch dimension. A batch is flattened to one leading axis of settings (each leaf
[settings, *event]), run in blocks, and reshaped back to the batch shape.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxacct._numerics import array_namespace, fast_jit, is_traced, scoped_gradients
from jaxacct.results import Bounds


def event_field(**kwargs):
  """A model field that holds one vector per setting (its last axis is an event axis)."""
  return dataclasses.field(metadata={"event_ndim": 1}, **kwargs)


def _is_model(node):
  from jaxacct.models import PrivacyLoss  # (models import this module's helpers)
  return isinstance(node, PrivacyLoss)


def event_ndims(tree) -> list:
  """The number of event dimensions of each leaf of ``tree`` (in ``tree_leaves`` order): a model
  field's declared ``event_ndim``, 0 for everything else."""
  out = []
  for node in jax.tree_util.tree_leaves(tree, is_leaf=_is_model):
    if not _is_model(node):
      out.append(0)
      continue
    for field in dataclasses.fields(node):
      value = getattr(node, field.name)
      if _is_model(value):
        out.extend(event_ndims(value))
      else:
        out.extend([field.metadata.get("event_ndim", 0)] * len(jax.tree_util.tree_leaves(value)))
  return out


def _named_leaves(tree):
  """(name, leaf) pairs: the leaf's path in ``tree`` as a readable name."""
  pairs = jax.tree_util.tree_flatten_with_path(tree)[0]
  names = []
  for path, _ in pairs:
    text = jax.tree_util.keystr(path)
    for quote in ("['", "']"):
      text = text.replace(quote, "." if quote == "['" else "")
    names.append(text.lstrip("."))
  return list(zip(names, (leaf for _, leaf in pairs)))


def batch_shape(tree) -> tuple:
  """The broadcast of the batch shapes of ``tree``'s leaves; a ValueError naming the leaves whose
  shapes do not broadcast."""
  named = _named_leaves(tree)
  shapes = []
  for (name, leaf), ndim in zip(named, event_ndims(tree)):
    shape = np.shape(leaf)
    if len(shape) < ndim:
      raise ValueError(f"{name} must have {ndim} event dimension(s) (a vector per setting); "
                       f"got shape {shape}")
    shapes.append(shape[:len(shape) - ndim])
  try:
    return tuple(np.broadcast_shapes(*shapes))
  except ValueError:
    batched = [f"{name} {shape}" for (name, _), shape in zip(named, shapes) if shape]
    raise ValueError("batch shapes do not broadcast: " + ", ".join(batched)) from None


def flatten(tree):
  """(flat tree, batch shape): every leaf as float64, broadcast to the batch shape (its event
  dimensions kept) and reshaped to one leading axis of settings (of size 1 for a scalar batch).
  Host values stay numpy arrays (no small programs compiled for the reshaping)."""
  shape = batch_shape(tree)
  xp = array_namespace(tree)
  size = int(np.prod(shape))
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  flat = []
  for leaf, ndim in zip(leaves, event_ndims(tree)):
    leaf = xp.asarray(leaf, xp.float64)
    event = leaf.shape[leaf.ndim - ndim:] if ndim else ()
    flat.append(xp.broadcast_to(leaf, shape + event).reshape((size,) + event))
  return jax.tree_util.tree_unflatten(treedef, flat), shape


def take(flat, index):
  """The setting at ``index`` of a flat batch (leading axis dropped, event axes kept)."""
  return jax.tree_util.tree_map(lambda a: a[index], flat)


def select(flat, indices):
  """The settings at ``indices`` (an integer array) of a flat batch, still a flat batch."""
  return jax.tree_util.tree_map(lambda a: a[np.asarray(indices)], flat)


def reshaped(out, shape):
  """Every leaf of a flat result reshaped to the batch shape: numpy results on the host, then
  placed as arrays (nothing compiled: a one-question process compiles its accountant alone),
  device results in one dispatch."""
  if is_traced(out):
    return jax.tree_util.tree_map(lambda a: a.reshape(shape + a.shape[1:]), out)
  if all(isinstance(a, np.ndarray) for a in jax.tree_util.tree_leaves(out)):
    return jax.device_put(jax.tree_util.tree_map(lambda a: a.reshape(shape + a.shape[1:]), out))
  return _reshape_all(out, shape)


@functools.partial(jax.jit, static_argnums=1)
def _reshape_all(out, shape):
  return jax.tree_util.tree_map(lambda a: a.reshape(shape + a.shape[1:]), out)


def blockwise(single, chunk):
  """``single(composition, x)`` (one setting) as a function of a flat batch, compiled once per
  block shape: full blocks of ``chunk`` settings and a remainder padded to the next power of two
  (so a few programs serve every batch size, memory stays bounded and padding at most doubles a
  small batch's work). One setting is one compiled call; under a caller's transformation (traced
  inputs) a batch is a ``lax.map`` in the caller's program. Outputs keep the leading axis."""
  one = fast_jit(scoped_gradients(lambda *args: jax.tree_util.tree_map(
      lambda a: jnp.reshape(a, (1,) + jnp.shape(a)), single(*args))))
  block = fast_jit(scoped_gradients(jax.vmap(single)))

  def run(flat):
    size = jax.tree_util.tree_leaves(flat)[0].shape[0]
    if size == 1:  # (the leading axis is added in the compiled call; the result to the host)
      return jax.device_get(one(*take(flat, 0)))
    if is_traced(flat):
      return jax.lax.map(lambda el: single(*el), flat, batch_size=min(size, chunk))
    parts = []
    for start in range(0, size, chunk):
      n = min(chunk, size - start)
      pad = (1 << (n - 1).bit_length()) - n

      def padded(a):
        part = a[start:start + n]
        return jnp.concatenate([part, jnp.repeat(part[-1:], pad, axis=0)])

      part = jax.tree_util.tree_map(padded, flat)
      parts.append(jax.tree_util.tree_map(lambda a: a[:n], block(*part)))
    return jax.tree_util.tree_map(lambda *p: jnp.concatenate(p), *parts)

  return run


def vectorised(single, chunk):
  """``single(composition, x)`` over the broadcast batch shape of its inputs (``blockwise``)."""
  run = blockwise(single, chunk)

  def call(composition, x):
    flat, shape = flatten((composition, x))
    return reshaped(run(flat), shape)

  return call


def _no_steps(flat_composition):
  """Per setting of a flat batch (host values): True where every count is 0."""
  counts = np.stack([np.asarray(c) for c in flat_composition.counts])
  return np.all(counts == 0.0, axis=0)


def answer(run, composition, x):
  """The accountants' shared front-door pass: ``run`` (a function of a flat batch returning flat
  ``Bounds``) over the broadcast batch of (composition, x). Settings of no steps lose no privacy:
  they are answered at once, epsilon = delta = 0 (every bound exact), and never run."""
  flat, shape = flatten((composition, x))
  if is_traced(flat):
    return reshaped(run(flat), shape)
  empty = _no_steps(flat[0])
  busy = np.flatnonzero(~empty)
  if busy.size == empty.size:
    return reshaped(run(flat), shape)
  fields = {name: np.zeros(empty.size, np.int32 if name == "status" else np.float64)
            for name in ("lower", "estimate", "upper", "status")}
  if busy.size:
    result = run(select(flat, busy))
    for name in fields:
      fields[name][busy] = np.asarray(getattr(result, name))
  return Bounds(**{name: jax.device_put(value.reshape(shape)) for name, value in fields.items()})
