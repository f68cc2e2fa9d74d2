"""The one result type: certified (lower, estimate, upper) with a status word."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

# Status bits (combine with |). 0 means every certificate condition held.
OK = 0
WINDOW_TOO_SMALL = 1   # composed distribution wider than the FFT window: bounds widened
BELOW_FLOOR = 2        # requested delta below what the grid resolves: upper = +inf
LOWER_VACUOUS = 4      # no useful lower bound (reported as nan)
APPROXIMATION = 8      # an approximation without certified bounds (lower and upper are nan)
UNRELIABLE = 16        # an approximation outside the regime where it is known to be accurate
OUT_OF_RANGE = 32      # the answer lies beyond the range the method searches: upper is +inf
UPPER_VACUOUS = 64     # the method's error bound is too large for a finite bound (epsilon: +inf)

STATUS_TEXT = {
    WINDOW_TOO_SMALL: "composed loss wider than the grid window; bounds widened",
    BELOW_FLOOR: "delta below the grid's numerical floor; upper is +inf",
    LOWER_VACUOUS: "lower bound vacuous (nan)",
    APPROXIMATION: "central-limit approximation: no certified bound (it can under-report epsilon)",
    UNRELIABLE: "approximation outside its reliable regime (the tilted loss is far from "
                "Gaussian): the estimate may be off by more than 1e-3 relative",
    OUT_OF_RANGE: "answer beyond the searched range of the method; upper is +inf",
    UPPER_VACUOUS: "upper bound vacuous (the method's error bound is not below delta): "
                   "epsilon's upper is +inf, delta's upper is 1",
}


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
    """JSON-ready dict for a single (unbatched) result; absent bounds become ``None``."""
    out = {}
    for key in ("lower", "estimate", "upper"):
      value = float(np.asarray(getattr(self, key)))
      out[key] = value if math.isfinite(value) else None
    status = int(np.asarray(self.status))
    out["status"] = status
    out["notes"] = [text for bit, text in STATUS_TEXT.items() if status & bit]
    out.update(extra)
    return out


def worst_of(a: Bounds, b: Bounds) -> Bounds:
  """Field-wise maximum: the guarantee for the worse of two dominating pairs. Status bits are
  combined, except LOWER_VACUOUS, which describes the combined lower bound (nan only when
  neither pair has one)."""
  lower = jnp.fmax(a.lower, b.lower)
  status = jnp.bitwise_or(a.status, b.status) & ~LOWER_VACUOUS
  status = status | jnp.where(jnp.isnan(lower), LOWER_VACUOUS, OK).astype(status.dtype)
  return Bounds(lower, jnp.maximum(a.estimate, b.estimate), jnp.maximum(a.upper, b.upper),
                status)
