"""Compositions: a static list of (privacy-loss model, count) entries with array counts."""

from __future__ import annotations

import dataclasses
import math

import jax

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
