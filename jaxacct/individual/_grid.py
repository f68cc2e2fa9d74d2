"""The noise grid: each example's per-step noise ratio sigma~ = sigma C / min(||g||, C), rounded
*down* onto a fixed grid of noise multipliers, so that a few models (one per grid point) serve
every example (Koskela et al. 2023, App. D.2). Rounding the noise down only raises the privacy
loss (data processing), so every figure computed from the grid bounds the exact one from above.
"""

from __future__ import annotations

import math
from fractions import Fraction

import jax.numpy as jnp
import numpy as np

from jaxacct.individual import _directed

DEFAULT_MAX_RATIO = 100.0  # the grid runs from sigma to 100 sigma ...
DEFAULT_POINTS = 200       # ... in 200 geometric steps of 2.3%


def noise_grid(noise_multiplier, max_ratio=DEFAULT_MAX_RATIO, points=DEFAULT_POINTS):
  """A geometric grid of noise multipliers from ``noise_multiplier`` to ``max_ratio`` times it."""
  if not (math.isfinite(max_ratio) and max_ratio > 1.0):
    raise ValueError(f"max_ratio must be finite and > 1; got {max_ratio!r}")
  if not (isinstance(points, (int, np.integer)) and points >= 2):
    raise ValueError(f"points must be an integer >= 2; got {points!r}")
  return float(noise_multiplier) * np.geomspace(1.0, max_ratio, points)


def checked_grid(sigma_grid, noise_multiplier):
  """The grid as float64, ValueError unless it is increasing, positive and starts at or below
  the noise multiplier (clipped steps have sigma~ = sigma: the grid must cover them)."""
  grid = np.asarray(sigma_grid, np.float64)
  if grid.ndim != 1 or grid.size < 1 or not np.all(np.isfinite(grid)) or np.any(grid <= 0):
    raise ValueError(f"sigma_grid must be a 1-D array of finite values > 0; got {sigma_grid!r}")
  if np.any(np.diff(grid) <= 0):
    raise ValueError("sigma_grid must be strictly increasing")
  if grid[0] > float(noise_multiplier):
    raise ValueError(f"sigma_grid does not cover the noise ratios: it starts at {grid[0]:g}, above "
                     f"the noise multiplier {float(noise_multiplier):g} (a clipped step's ratio)")
  return grid


def ratio_thresholds(grid, noise_multiplier, dtype):
  """t_b = sigma / sigma_b rounded down in ``dtype``, increasing (b from the top of the grid):
  a step of clipped-norm ratio r = min(||g||, C)/C has sigma~ = sigma / r >= sigma_b when
  r <= t_b."""
  sigma = Fraction(float(noise_multiplier))
  return _directed.host_round_all([sigma / Fraction(float(s)) for s in grid[::-1]], dtype, -1)


def bucket(ratio_up, thresholds):
  """The grid index b of the largest sigma_b <= sigma / ratio (``ratio_up`` >= the exact clipped
  ratio, ``thresholds`` from ``ratio_thresholds``): the noise rounded down, never up."""
  points = thresholds.shape[0]
  first = jnp.searchsorted(jnp.asarray(thresholds), ratio_up, side="left")  # first t >= ratio
  return jnp.clip(points - 1 - first, 0, points - 1)
