"""The one validator: every public function checks its inputs with these, the same way.

Concrete values are checked (a ``ValueError`` that names the parameter and the allowed range);
traced values (inside a caller's ``jit``/``vmap``/``grad``) cannot be, and pass through.
"""

from __future__ import annotations

import math

import numpy as np

from jaxacct._numerics import is_traced

# The smallest delta accepted: XLA flushes subnormal float64 inputs to zero on CPU.
SMALLEST_DELTA = float(np.finfo(np.float64).tiny)


def _concrete(value):
  """``value`` as a float64 numpy array, or None when it is traced (not checkable)."""
  if is_traced(value):
    return None
  try:
    return np.asarray(value, dtype=np.float64)
  except (TypeError, ValueError):
    return np.asarray(np.nan)


def check_range(name, value, low, high, low_open=True, high_open=True):
  """Raises ValueError naming ``name`` unless every concrete entry of ``value`` is finite and
  lies in the interval."""
  vals = _concrete(value)
  if vals is None:
    return
  with np.errstate(invalid="ignore"):
    ok = np.isfinite(vals) & ((vals > low) if low_open else (vals >= low))
    ok &= (vals < high) if high_open else (vals <= high)
  if not np.all(ok):
    left, right = "(" if low_open else "[", ")" if high_open else "]"
    bad = np.size(vals) - int(np.sum(ok))
    shown = value if np.size(vals) <= 8 else f"an array with {bad} entries outside"
    raise ValueError(f"{name} must be finite and in {left}{low:g}, {high:g}{right}; got {shown!r}")


def check_whole(name, value):
  """Raises ValueError naming ``name`` unless every concrete entry is a whole number."""
  vals = _concrete(value)
  if vals is not None and not np.all(vals == np.round(vals)):
    raise ValueError(f"{name} must be whole numbers (integers); got {value!r}")


def check_choice(name, value, choices):
  """Raises ValueError naming ``name`` unless ``value`` is one of ``choices``."""
  if value not in choices:
    raise ValueError(f"{name} must be one of {tuple(choices)}; got {value!r}")


def check_delta(value, name="delta"):
  """delta in [the smallest normal float64, 1)."""
  check_range(name, value, SMALLEST_DELTA, 1.0, low_open=False)


def check_epsilon(value, name="epsilon"):
  """epsilon in [0, inf)."""
  check_range(name, value, 0.0, math.inf, low_open=False)


def check_unused(accountant, **options):
  """Raises ValueError for options an accountant does not use (given, i.e. not None)."""
  given = [name for name, value in options.items() if value is not None]
  if given:
    raise ValueError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply to the "
                     f"{accountant!r} accountant (only to 'pld')")


def check_broadcast(**named):
  """Raises ValueError naming the parameters whose shapes do not broadcast together."""
  shapes = {name: np.shape(value) for name, value in named.items()}
  try:
    np.broadcast_shapes(*shapes.values())
  except ValueError:
    listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items() if shape)
    raise ValueError(f"shapes do not broadcast: {listed}") from None
