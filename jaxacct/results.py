"""The one result type: certified (lower, estimate, upper) with a status word."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

# Status bits (combine with |). 0 means every certificate condition held.
OK = 0
"""Status 0: every certificate condition held."""
WINDOW_TOO_SMALL = 1   # composed distribution wider than the FFT window: bounds widened
"""Status bit 1: the composed privacy loss outgrew the grid's window; the bounds were widened
(still certified)."""
BELOW_FLOOR = 2        # requested delta below what the grid resolves: upper = +inf
"""Status bit 2: the requested delta lies below the grid's numerical floor; ``upper`` is
+inf."""
LOWER_VACUOUS = 4      # no useful lower bound (reported as nan)
"""Status bit 4: no lower bound; ``lower`` is nan."""
APPROXIMATION = 8      # an approximation without certified bounds (lower and upper are nan)
"""Status bit 8: an approximation with no certified bounds (GDP's central limit; it can
under-report epsilon); ``lower`` and ``upper`` are nan."""
UNRELIABLE = 16        # an approximation outside the regime where it is known to be accurate
                       # (without it: within 2.5e-4 x max(1, eps), benchmarks/flag_sweep.py)
"""Status bit 16: an approximation (saddle point, Edgeworth) outside the regime where it is
known to be accurate. An estimate without it is within 2.5e-4 x max(1, eps) of the truth."""
OUT_OF_RANGE = 32      # the answer lies beyond the range the method searches: upper is +inf
"""Status bit 32: the answer lies beyond the range a constant-time accountant searches; an
epsilon's ``upper`` is +inf."""
UPPER_VACUOUS = 64     # the method's error bound is too large for a finite bound (epsilon: +inf)
"""Status bit 64: the method's error bound is not below delta, so there is no finite upper
bound: epsilon's ``upper`` is +inf, delta's is 1."""
UPPER_FLOORED = 128    # delta's upper bound lies below float64's range: reported as its floor
"""Status bit 128: delta's upper bound lies below float64's range; the smallest normal number
is reported, a floor rather than an estimate."""

STATUS_TEXT = {
    WINDOW_TOO_SMALL: "composed loss wider than the grid window; bounds widened",
    BELOW_FLOOR: "delta below the grid's numerical floor; upper is +inf",
    LOWER_VACUOUS: "lower bound vacuous (nan)",
    APPROXIMATION: "central-limit approximation: no certified bound (it can under-report epsilon)",
    UNRELIABLE: "approximation outside its reliable regime (the terms its series leaves out "
                "predict an epsilon error above 2e-4 x max(1, eps), or the series has not "
                "settled): the estimate may be off by more than 2.5e-4 x max(1, eps)",
    OUT_OF_RANGE: "answer beyond the range the method searches: an epsilon's upper is +inf; a "
                  "delta's bounds are those at the end of the range (valid, not tight)",
    UPPER_VACUOUS: "upper bound vacuous (the method's error bound is not below delta): "
                   "epsilon's upper is +inf, delta's upper is 1",
    UPPER_FLOORED: "delta's upper bound is below float64's range: the smallest normal number "
                   "(2.2e-308) is reported, a floor rather than an estimate",
}
"""One line of text for each status bit: the ``notes`` of ``Bounds.to_dict`` (and of the
command line's ``--json``)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Bounds:
  """A privacy parameter with certified bounds: ``lower <= truth <= upper``.

  ``estimate`` is the accountant's point value. A lower bound the method cannot give is ``nan``;
  an upper bound is ``+inf`` where a certificate failed and ``nan`` where the method is an
  approximation that certifies nothing (GDP's central limit); ``status`` says why (bits in
  ``jaxacct.results``). Every field is
  a float64 array, batched like the inputs. Report ``upper`` as the privacy guarantee.
  """

  lower: jax.Array
  estimate: jax.Array
  upper: jax.Array
  status: jax.Array

  def to_dict(self, **extra):
    """JSON-ready dict for a single (unbatched) result. A bound the method does not give (nan)
    is ``None``; an infinite bound is the string ``"inf"`` (``float("inf")`` reads it back), so
    "no guarantee" (``"upper": "inf"``) and "no lower bound" (``"lower": null``) differ."""
    out = {key: json_number(getattr(self, key)) for key in ("lower", "estimate", "upper")}
    status = int(np.asarray(self.status))
    out["status"] = status
    out["notes"] = [text for bit, text in STATUS_TEXT.items() if status & bit]
    out.update(extra)
    return out


def json_number(value):
  """A scalar as a JSON value: a finite float as itself, nan (no bound) as None, an infinite one
  as the string "inf" or "-inf" (``float`` reads it back)."""
  value = float(np.asarray(value))
  return (value if math.isfinite(value) else None if math.isnan(value)
          else "inf" if value > 0 else "-inf")


def worst_of(a: Bounds, b: Bounds) -> Bounds:
  """Field-wise maximum: the guarantee for the worse of two dominating pairs. Status bits are
  combined, except LOWER_VACUOUS and UPPER_FLOORED, which describe the combined bounds (nan only
  when neither pair has a lower bound; floored only when the upper kept is a floor)."""
  lower = jnp.fmax(a.lower, b.lower)
  upper = jnp.maximum(a.upper, b.upper)
  status = jnp.bitwise_or(a.status, b.status) & ~(LOWER_VACUOUS | UPPER_FLOORED)
  status = status | jnp.where(jnp.isnan(lower), LOWER_VACUOUS, OK).astype(status.dtype)
  floored = (upper == a.upper) & (a.status & UPPER_FLOORED > 0)
  floored = floored | ((upper == b.upper) & (b.status & UPPER_FLOORED > 0))
  status = status | jnp.where(floored, UPPER_FLOORED, OK).astype(status.dtype)
  return Bounds(lower, jnp.maximum(a.estimate, b.estimate), upper, status)


def worst_over(stacked: Bounds) -> Bounds:
  """``worst_of`` over the leading axis of ``stacked`` (one Bounds per adjacency direction)."""
  row = lambda i: jax.tree_util.tree_map(lambda x: x[i], stacked)
  out = row(0)
  for i in range(1, stacked.upper.shape[0]):
    out = worst_of(out, row(i))
  return out


def zero_if(none, bounds: Bounds) -> Bounds:
  """``bounds``, or exactly 0 with status OK where ``none`` (a composition of no steps)."""
  return Bounds(*(jnp.where(none, 0.0, v) for v in (bounds.lower, bounds.estimate, bounds.upper)),
                jnp.where(none, OK, bounds.status).astype(jnp.int32))
