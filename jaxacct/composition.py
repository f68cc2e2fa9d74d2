"""Compositions: a static list of (privacy-loss model, count) entries with array counts."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxacct._numerics import as_leaf
from jaxacct.models import PrivacyLoss, with_array_fields


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
      mechs.append(with_array_fields(mech))
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
      try:
        vals = np.asarray(count, dtype=np.float64)
      except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        continue
      whole = np.all(vals == np.round(vals)) or not integer_counts
      if not (np.all(np.isfinite(vals)) and np.all(vals >= 0) and whole):
        kind = "integers" if integer_counts else "numbers"
        raise ValueError(f"counts (steps) must be finite non-negative {kind}; got {count!r}")


def as_composition(entry) -> Composition:
  """Accepts a Composition, a single model, or a list of (model, count) entries."""
  if isinstance(entry, Composition):
    return entry
  if isinstance(entry, PrivacyLoss):
    return Composition.of(entry)
  return Composition.of(*entry)
