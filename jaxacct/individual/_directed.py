"""Directed rounding for privacy ledgers kept on the device, in float32 or float64.

A ledger must never record less privacy loss than was spent. Each charge is rounded up
(``nextafter`` wherever an operation may have rounded down) and sums are kept as a double word
(hi, lo) with an exact error term (TwoSum), so the recorded total hi + lo is an upper bound of the
exact sum that stays within a few ulps of it over millions of steps; a plain float32 sum rounded
up at every step would drift by up to one ulp per step (~0.1% after 10^4 steps), and sums of
equal charges (a clipped example's steps) stay exact.

XLA on CPU flushes subnormal numbers to zero, which would silently drop an error term. Charges are
therefore floored at ``FLOOR`` = 2^-100 (far below any budget), so every value and every exact
error term of a sum of them is a normal number in float32 and float64.
"""

from __future__ import annotations

from fractions import Fraction

import jax.numpy as jnp
import numpy as np

FLOOR = 2.0 ** -100


def up(x):
  """The next float above x."""
  return jnp.nextafter(x, jnp.full_like(x, jnp.inf))


def two_sum(a, b):
  """(s, e) with s = fl(a + b) and a + b = s + e exactly (Knuth's TwoSum)."""
  s = a + b
  b_virtual = s - a
  e = (a - (s - b_virtual)) + (b - b_virtual)
  return s, e


def add(hi, lo, x):
  """The double word (hi, lo) plus x >= 0, never below the exact sum hi + lo + x."""
  s, e = two_sum(hi, x)
  t, f = two_sum(lo, e)
  t = jnp.where(f > 0, up(t), t)  # lo + e, rounded up
  new_hi = s + t
  return new_hi, t - (new_hi - s)  # |t| << |s|: exact (Fast2Sum)


def total(hi, lo):
  """hi + lo rounded up (the recorded value of a double word)."""
  s, e = two_sum(hi, lo)
  return jnp.where(e > 0, up(s), s)


def times(x, c):
  """x * c rounded up (x, c >= 0), exact when x == 1, at least FLOOR."""
  product = x * c
  return jnp.where(x == 1, c, jnp.maximum(up(product), FLOOR))


def clipped_ratio(norms, clip_norm):
  """min(norm, C) / C rounded up, in [2^-50, 1]; exactly 1 for a clipped example.

  A NaN, infinite or negative norm counts as clipped (1): bad input never lowers a charge.
  ``clip_norm`` is the clip norm rounded *down* to the ledger's dtype, so the ratio only grows.
  """
  ok = (norms >= 0) & (norms < clip_norm)  # False for NaN
  ratio = jnp.where(ok, norms, clip_norm) / clip_norm
  ratio = jnp.where(ratio >= 1, 1.0, up(ratio)).astype(norms.dtype)
  return jnp.maximum(ratio, np.asarray(2.0 ** -50, norms.dtype))


def clipped_square(norms, clip_norm):
  """(min(norm, C) / C)^2 rounded up, in [FLOOR, 1]; exactly 1 for a clipped example."""
  ratio = clipped_ratio(norms, clip_norm)
  return jnp.where(ratio >= 1, 1.0, up(ratio * ratio)).astype(norms.dtype)


def host_round(value, dtype, direction):
  """A host number (float or Fraction) rounded to ``dtype`` up (+1) or down (-1): the nearest
  representable value on that side, so ledgers compare against exact host quantities."""
  exact = Fraction(value)
  x = np.asarray(float(exact), dtype)
  target = np.asarray(np.inf if direction > 0 else -np.inf, dtype)
  while (Fraction(float(x)) < exact) if direction > 0 else (Fraction(float(x)) > exact):
    x = np.nextafter(x, target)
  return x


def host_round_all(values, dtype, direction):
  """``host_round`` of every entry of a host array (or list), as an array of ``dtype``."""
  values = np.asarray(values, object)
  return np.array([host_round(v, dtype, direction) for v in values.ravel()],
                  dtype).reshape(values.shape)
