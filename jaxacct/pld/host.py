"""The PLD accountant's epsilon of one setting computed on the host with numpy: nothing compiled.

Each step is discretised as the accountant discretises it (``discretise.split`` of the model's
``cdf_sf`` on the plan's grid, connect-the-dots: a dominating pair), the steps are composed by
numpy's FFT on the plan's ``fft_size`` points, and epsilon(delta) is read off the composed masses
(the grid's losses above epsilon, in both directions where the loss is not symmetric). None of
the accountant's certificates is computed (no allowance for the window's tails, aliasing or
round-off), so this is an estimate of its upper bound, not a bound (usually within ~1e-5
relative of it; ~1e-2 at q ~1e-4 and a few steps, where the certificates weigh more): a
calibration starts its certified search there. Its reads are compiled programs, one per plan
size, and a search whose reads straddle two plan sizes compiles two: from a start this close
to the answer (against ~1-4 % for the central-limit and RDP start) they rarely do.
"""

from __future__ import annotations

import math

import numpy as np

from jaxacct.pld.discretise import grid_cgf, split, window_edges

HOST_POINTS = 2**20
"""The largest FFT ``epsilon`` computes (a few tenths of a second a direction at this size; 3-50
ms at a calibration's usual 10^4-10^5 points); a larger plan is refused (ValueError)."""


def _step(mech, add, plan):
  """(masses on the grid from index ``start``, start, mass above the grid) of one step."""
  h = float(plan.grid_step)
  lo, hi = (float(np.asarray(v)) for v in mech.loss_range(float(plan.log_tail), add))
  start = math.floor(lo / h) - 1
  t = np.arange(start, math.ceil(hi / h) + 1, dtype=np.float64) * h
  if t.size > plan.fft_size:
    raise ValueError(f"a step's grid of {t.size} points passes the plan's FFT")
  cdf_sf = tuple(np.asarray(v, np.float64) for v in mech.cdf_sf(t, add))
  pmf = split(cdf_sf, t, np.float64(h), 0.0)[0]
  return np.maximum(pmf, 0.0), start, float(np.clip(cdf_sf[1][-1], 0.0, 1.0))


def composed(composition, plan, add):
  """(losses ascending [n], their composed masses, the mass at +inf) of one direction: the
  circular FFT's indices laid over the window the accountant places (``spectrum``: the
  Chernoff window of the composed steps' log-MGF, centred in the FFT where it fits, else
  keeping its top)."""
  n, h = plan.fft_size, float(plan.grid_step)
  spectrum = np.ones(n // 2 + 1, np.complex128)
  first, log_finite, cgf = 0, 0.0, 0.0
  for mech, count in zip(composition.mechanisms, composition.counts):
    count = int(round(float(np.asarray(count))))
    if count == 0:
      continue
    pmf, start, above = _step(mech, add, plan)
    spectrum *= np.fft.rfft(pmf, n) ** count
    first += count * start
    with np.errstate(divide="ignore"):  # (an empty block's log: -inf, as in the planner)
      cgf = cgf + count * grid_cgf(pmf[None], np.array([start], np.float64), np.array([h]))[0]
    log_finite += count * math.log1p(-min(above, 1.0 - 1e-16))
  masses = np.maximum(np.fft.irfft(spectrum, n), 0.0)
  if not np.all(np.isfinite(masses)):
    raise ValueError("the host's composed masses are not finite")
  bottom, top = (float(v) for v in window_edges(cgf, float(plan.log_window_tail)))
  needed = math.ceil((top - bottom) / h) + 1
  low = (math.floor(bottom / h) - (n - needed) // 2 if needed <= n
         else math.ceil(top / h) - n + 1)              # (the window's first grid index)
  # (index i of the FFT holds grid index first + i modulo n: the window's j-th, low + j, sits at
  # i = j + low - first modulo n, a rotation)
  losses = (low + np.arange(n, dtype=np.float64)) * h
  return losses, np.roll(masses, first - low), -math.expm1(log_finite)


def _epsilon_at(losses, masses, at_inf, delta):
  """The smallest epsilon >= 0 with sum over losses l > epsilon of m (1 - e^{epsilon - l}) plus
  the mass at +inf <= delta (exactly, between grid losses)."""
  shifted = np.exp(np.clip(-losses, -700.0, 700.0))
  above = np.cumsum(masses[::-1])[::-1] + at_inf            # mass at losses >= l_k
  tilted = np.cumsum((masses * shifted)[::-1])[::-1]         # ... times e^{-l}
  # delta(eps) on [l_{k-1}, l_k) is above[k] - e^{eps} tilted[k] (at_inf counted in above)
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    at_grid = np.append(above[1:], at_inf) - np.exp(np.clip(losses, -700.0, 700.0)) * np.append(
        tilted[1:], 0.0)  # delta(l_k): the masses strictly above l_k
    k = int(np.argmax(at_grid <= delta)) if np.any(at_grid <= delta) else losses.size
    if k == losses.size or at_inf > delta:
      return math.inf
    if tilted[k] > 0.0:
      ratio = (above[k] - delta) / tilted[k]
      epsilon = math.log(ratio) if ratio > 0.0 else -math.inf  # (-inf: delta(eps) <= delta)
    else:  # (no finite mass from l_k on: delta(eps) = above[k] on the segment)
      epsilon = -math.inf if above[k] <= delta else losses[k]
  return max(float(np.clip(epsilon, losses[k - 1] if k else -math.inf, losses[k])), 0.0)


def epsilon(composition, delta, plan, directions=None) -> tuple[float, bool]:
  """(epsilon(delta), the direction that gives it: ``add``) of a single-setting composition from
  the accountant's discretisation on ``plan``, on the host: an estimate of ``pld.epsilon``'s
  upper (see the module docstring), the larger over both directions unless the composition is
  symmetric or ``directions`` names the one(s) to compute (a search near one answer keeps the
  one that gave it: half the work). Raises ValueError where the plan passes ``HOST_POINTS``."""
  if plan.fft_size > HOST_POINTS:
    raise ValueError(f"a {plan.fft_size}-point FFT is past the host's {HOST_POINTS}")
  if directions is None:
    directions = (False,) if composition.symmetric else (False, True)
  return max((_epsilon_at(*composed(composition, plan, add), float(delta)), add)
             for add in directions)
