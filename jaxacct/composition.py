"""Compositions: a static list of (privacy-loss model, count) entries with array counts; and
the entries grouped by kind (``kinds``), so that every accountant traces one kind's code once,
vmapped over its entries (``map_entries``, ``counted_sum``), however many entries share it."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxacct._inputs import check_range, check_whole
from jaxacct._numerics import as_leaf
from jaxacct.models import PrivacyLoss


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Composition:
  """``counts[i]`` adaptive uses of ``mechanisms[i]``, for each i.

  The list structure (which model types, how many entries) is static; parameters and counts are
  arrays, so one compiled accountant serves any values. The PLD accountant needs integer-valued
  counts.
  """

  mechanisms: tuple
  counts: tuple

  @classmethod
  def of(cls, *entries):
    """``Composition.of((model, count), ...)``; a bare model counts once."""
    mechs, counts = [], []
    for entry in entries:
      if isinstance(entry, PrivacyLoss):
        entry = (entry, 1)
      mech, count = entry
      mechs.append(mech)
      counts.append(as_leaf(count))
    return cls(tuple(mechs), tuple(counts))

  @property
  def symmetric(self) -> bool:
    """True when every entry's pair is its own mirror image (one direction suffices)."""
    return all(type(m).symmetric for m in self.mechanisms)

  def append(self, other: "Composition") -> "Composition":
    return Composition(self.mechanisms + other.mechanisms, self.counts + other.counts)

  def check(self, integer_counts=True):
    """Raises ValueError on invalid concrete parameters or counts (no-op under tracing). The
    CGF-based accountants accept real-valued counts (``integer_counts=False``)."""
    if not self.mechanisms:
      raise ValueError("a composition needs at least one (mechanism, count) entry")
    for mech, count in zip(self.mechanisms, self.counts):
      mech.check()
      check_range("counts", count, 0.0, math.inf, low_open=False)
      if integer_counts:
        check_whole("counts", count)


def as_composition(entry) -> Composition:
  """Accepts a Composition, a single model, or a list of (model, count) entries."""
  if isinstance(entry, Composition):
    return entry
  if isinstance(entry, PrivacyLoss):
    return Composition.of(entry)
  return Composition.of(*entry)


def checked(entry, *, integer_counts) -> Composition:
  """``as_composition(entry)``, its models' parameters and counts checked (concrete values)."""
  composition = as_composition(entry)
  composition.check(integer_counts)
  return composition


def total_count(composition: Composition):
  """The number of steps of a composition (a float64 array; real counts allowed)."""
  return sum(jnp.asarray(c, jnp.float64) for c in composition.counts)


def kinds(mechanisms) -> list:
  """The entries' indices grouped by kind (one model class and structure, leaves of the same
  shapes, dtypes and weak types: stacked, they compute as each does alone), in order of first
  appearance."""
  groups = {}
  for index, mech in enumerate(mechanisms):
    leaves, structure = jax.tree_util.tree_flatten(mech)
    try:
      key = (structure, tuple(jax.typeof(x) for x in leaves))
      groups.setdefault(key, []).append(index)
    except TypeError:  # (static fields that cannot be hashed, leaves of no dtype: its own kind)
      groups[("own", index)] = [index]
  return list(groups.values())


def over_kind(fn, indices, mechanisms, *stacked):
  """``fn(mechanism, *extras)`` of the entries ``indices`` of one kind (``kinds``), stacked
  (leading axis: those entries): one trace, vmapped over them (an entry of its own kind is
  traced as it is: no vmap to trace). ``stacked``: extras with that leading axis."""
  if len(indices) == 1:
    first = lambda x: x[0]
    out = fn(mechanisms[indices[0]], *(jax.tree_util.tree_map(first, x) for x in stacked))
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x)[None], out)
  mechanism = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs),
                                     *[mechanisms[i] for i in indices])
  return jax.vmap(fn)(mechanism, *stacked)


def map_entries(fn, mechanisms):
  """``fn(mechanism)`` of each entry, stacked in the entries' order (leading axis: entries).
  Traced once per kind (``over_kind``): a program compiles one copy of a kind's code however
  many entries share it (a schedule of phases, a mixture of sensitivities)."""
  parts, order = [], []
  for indices in kinds(mechanisms):
    parts.append(over_kind(fn, indices, mechanisms))
    order += indices
  out = jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs), *parts)
  if order == sorted(order):
    return out
  back = np.argsort(order)
  return jax.tree_util.tree_map(lambda x: x[back], out)


def counted_sum(fn, composition, per_kind=None):
  """sum_i counts_i fn(mechanism_i) over the entries (real counts; float64), one traced ``fn``
  per kind (``over_kind``). ``per_kind``: for each kind (``kinds``' order) extras stacked over
  its entries, passed as ``fn``'s second argument (None: none)."""
  groups = kinds(composition.mechanisms)
  per_kind = (None,) * len(groups) if per_kind is None else per_kind
  total = 0.0
  for indices, extra in zip(groups, per_kind, strict=True):
    counts = jnp.stack([jnp.asarray(composition.counts[i], jnp.float64) for i in indices])
    values = over_kind(fn, indices, composition.mechanisms,
                       *(() if extra is None else (extra,)))
    total = total + jnp.tensordot(counts, values, axes=(0, 0))  # (counts: one per entry)
  return total
