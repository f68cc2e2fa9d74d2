"""Discretisation of one step's privacy loss on the grid h*Z (connect-the-dots), and the
Chernoff machinery on grids (exact log-MGF of a discrete step, window edges).

Connect-the-dots (a certified variant of the PRV accountant's discretisation, Gopi, Lee and
Wutschitz 2021, Sec. 5): each step's loss L, restricted to a cell [a, b] of the grid, is split
between a and b so that E[e^{-D}] = E[e^{-L}] in the cell. The discrete pair dominates the true
one (g(y) = (1 - e^{eps-y})_+ is convex in e^{-y}), so delta computed from the composition of the
discrete steps is an upper bound for any number of steps, with a bias of only ~T h^2/8.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxacct._numerics import F64_EPS, LOSS_BIG, array_namespace

# Chernoff tilts used to place the composed window and bound the mass outside it.
TILTS = np.geomspace(1e-2, 1e3, 48)
# Assumed worst relative error of a computed CDF/SF value, in ulps (special functions + mixing).
_CDF_ULPS = 64.0
# Largest span of loss values a grid may cover (keeps e^{+-span} finite in float64).
MAX_SPAN = 600.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Step:
  pmf: jax.Array        # [M] dominating discrete masses at (start + i) h
  start: jax.Array      # int64 grid index of pmf[0]
  log_finite: jax.Array  # log P(D finite)
  tail: jax.Array       # P(L outside the grid), lost by the lower bound's coupling
  moved: jax.Array      # P(round-off guard moved mass up a cell)
  bias: jax.Array       # E[D] - E[L*], the split's upward bias (removed from the estimate)


def _cell_masses(cdf, sf):
  """Mass of each grid cell (t_i, t_{i+1}], accurate in both tails and smooth in parameters.

  Blends the SF and CDF differences with weight w = CDF(t_i): in the right tail (w ~ 1) the SF
  difference is the accurate one, in the left tail the CDF difference. A hard switch between the
  two would move with the parameters and make the pmf jump by the round-off between them (which
  the split amplifies to ~1e-10 relative), i.e. kinks in delta and noise in finite differences.
  Returns the masses and the magnitude of the differenced values (for round-off bounds).
  """
  xp = array_namespace(cdf, sf)
  w = xp.clip(cdf[..., :-1], 0.0, 1.0)
  mass = w * (sf[..., :-1] - sf[..., 1:]) + (1.0 - w) * (cdf[..., 1:] - cdf[..., :-1])
  scale = w * sf[..., :-1] + (1.0 - w) * cdf[..., 1:]
  return xp.maximum(mass, 0.0), scale


def split(cdf_sf, t, h, guard_ulps):
  """Connect-the-dots split of the cells (t_i, t_{i+1}] of grids t [..., M] (the accountant's
  step, or a batch of the planner's coarse grids).

  Each cell's P-mass goes to its ends so that E[e^{-D}] = E[e^{-L}], the lower end's share reduced
  by a round-off guard of ``guard_ulps`` ulps of the differenced CDF values (mass only moves up);
  the mass below the grid joins point 0. Returns the pmf on the M points and, per cell, the P-mass,
  the mass sent to the lower end and the guard.
  """
  p_cdf, p_sf, q_cdf, q_sf = cdf_sf
  xp = array_namespace(p_cdf, t, h)
  p_cell, p_scale = _cell_masses(p_cdf, p_sf)
  q_cell, q_scale = _cell_masses(q_cdf, q_sf)
  exp_b = xp.exp(xp.minimum(t[..., 1:], MAX_SPAN))
  denom = xp.expm1(h)
  # Mass sent to the lower end a: E_P[(e^{-L} - e^{-b}) / (e^{-a} - e^{-b})] over the cell.
  to_lower = (exp_b * q_cell - p_cell) / denom
  guard = guard_ulps * F64_EPS * (exp_b * q_scale + p_scale) / denom
  to_lower = xp.clip(to_lower - guard, 0.0, p_cell)
  # Lower ends receive to_lower, upper ends the rest of the cell.
  zero = xp.zeros(p_cell.shape[:-1] + (1,))
  pmf = (xp.concatenate([to_lower, zero], axis=-1)
         + xp.concatenate([p_cdf[..., :1], p_cell - to_lower], axis=-1))
  return pmf, p_cell, to_lower, guard


def discretise(model, add, plan) -> Step:
  """Dominating connect-the-dots masses of one step on M grid points."""
  h = jax.lax.stop_gradient(plan.grid_step)
  size = plan.per_step_size
  lo, hi = model.loss_range(jax.lax.stop_gradient(plan.log_tail), add)
  lo = jax.lax.stop_gradient(jnp.clip(lo, -LOSS_BIG / 2, LOSS_BIG / 2))
  start = jnp.floor(lo / h).astype(jnp.int64) - 1  # t_0 < lo: P(L <= t_0) is truly tail mass
  t = (start + jnp.arange(size)).astype(jnp.float64) * h
  # The grid ends at the range's top (not wherever the static size reaches), so the planning
  # pass and this one agree on the support; the mass above goes to +inf like any truncated tail.
  top = jax.lax.stop_gradient(jnp.ceil(jnp.clip(hi, -LOSS_BIG / 2, LOSS_BIG / 2) / h) * h)
  cdf_sf = model.cdf_sf(jnp.minimum(t, top), add)
  p_cdf, p_sf = cdf_sf[:2]
  pmf, p_cell, to_lower_safe, guard = split(cdf_sf, t, h, _CDF_ULPS)
  denom = jnp.expm1(h)
  p_inf = model.inf_mass(add)
  # Finite mass above the grid is sent to +inf (pessimistic).
  log_finite = jnp.log1p(-jnp.minimum(p_sf[-1], 1.0))
  tail = p_cdf[0] + jnp.maximum(p_sf[-1] - p_inf, 0.0)
  moved = jnp.sum(jnp.minimum(2.0 * guard, p_cell))
  # Bias of the split against the cell's exponential mean l* = -log(Q/P) (Jensen: l* <= E[L|cell],
  # within ~h^2/24): with u = b - l*, E[D | cell] - l* = u - h expm1(u)/expm1(h) >= 0, where
  # expm1(u) = to_lower expm1(h) / p_cell: times the cell's mass, p_cell u - h to_lower.
  has_mass = p_cell > 1e-120  # (below, p^2 underflows in the derivative of x/p; no bias there)
  u = jnp.log1p(to_lower_safe * denom / jnp.where(has_mass, p_cell, 1.0))
  bias = jnp.sum(jnp.where(has_mass, p_cell * u - h * to_lower_safe, 0.0))
  return Step(pmf, start, log_finite, jax.lax.stop_gradient(tail), jax.lax.stop_gradient(moved),
               bias)


_CGF_BLOCK = 32  # grid points per block in grid_cgf


def grid_cgf(pmf, start, h):
  """log sum_i pmf_i e^{lambda (start + i) h} at lambda = +-TILTS: [..., 2, K] for pmfs [..., M]
  (a batch on the host; one step in JAX, with scalar start and h).

  Blocks of _CGF_BLOCK points: sum_r p_{J,r} e^{lambda h (r - c)} is a matrix product with a
  small table (c the block centre), then a log-sum-exp over blocks. A tilt whose table would
  leave float64 range is given cgf = +inf, which only makes its Chernoff bound vacuous.
  """
  xp = array_namespace(pmf, start, h)
  batch, size = pmf.shape[:-1], pmf.shape[-1]
  blocks = -(-size // _CGF_BLOCK)
  pmf = xp.concatenate([xp.maximum(pmf, 0.0), xp.zeros(batch + (blocks * _CGF_BLOCK - size,))],
                       axis=-1)
  centre = 0.5 * (_CGF_BLOCK - 1)
  tilts = np.concatenate([TILTS, -TILTS])
  h = h[..., None, None]
  exponent = tilts[:, None] * h * (np.arange(_CGF_BLOCK) - centre)                 # [..., 2K, b]
  in_range = TILTS * h[..., 0] * centre <= 600.0
  table = xp.exp(xp.clip(exponent, -700.0, 700.0))
  sums = pmf.reshape(batch + (blocks, _CGF_BLOCK)) @ xp.swapaxes(table, -1, -2)  # [..., B, 2K]
  block_centres = (start[..., None, None] + np.arange(blocks)[:, None] * _CGF_BLOCK + centre) * h
  log_terms = xp.log(sums) + tilts * block_centres
  peak = xp.max(log_terms, axis=-2, keepdims=True)
  peak = xp.where(xp.isfinite(peak), peak, 0.0)
  cgf = peak[..., 0, :] + xp.log(xp.sum(xp.exp(log_terms - peak), axis=-2))
  cgf = cgf.reshape(batch + (2, len(TILTS)))
  return xp.where(in_range[..., None, :], cgf, xp.inf)


def step_cgf(step: Step, h):
  """log E[e^{lambda D}; D finite] at +-TILTS (exact, for the discrete step)."""
  return jax.lax.stop_gradient(grid_cgf(step.pmf, step.start, h))


def window_edges(cgf, log_level):
  """Chernoff: the composed sum lies in [bottom, top] but for exp(log_level) mass on each side,
  from its log-MGF ``cgf`` at +-TILTS."""
  xp = array_namespace(cgf, log_level)
  return (xp.max(-(cgf[..., 1, :] - log_level) / TILTS, axis=-1),
          xp.min((cgf[..., 0, :] - log_level) / TILTS, axis=-1))

