"""Individual privacy filters: each example keeps its own budget inside the training step.

``gdp_filter`` is Algorithm 1 of Koskela, Tobaben and Honkela (ICLR 2023): at step j example i
contributes mu_j^i = min(||g_i||, C) / (sigma C) (its own sensitivity over the noise) and joins the
step only while its running sum of mu^2, *including this step*, stays <= B^2 (the strict HALT of
their filter, ``> B^2``). By their Theorem 1 (fully adaptive GDP composition) the whole run is
B-GDP for every example under add/remove, so (eps, delta_B(eps))-DP for all eps.

``rdp_filter`` is the individual Renyi filter of Feldman and Zrnic (NeurIPS 2021) for Gaussian and
Poisson-subsampled Gaussian steps, at a fixed vector of orders: an example joins while its RDP sum
stays within the budget at every order.

Both are Optax-style: a function of the hyper-parameters returns pure ``init``/``update``
functions over a small pytree state (``FilterState``) of static shape, updated inside a compiled
step (no host callbacks). A step's examples come as a fixed-shape batch (``norms``, ``indices``,
``valid``): padded entries (``valid`` False) are ignored, so Poisson batches work under ``jit``.
An example enters a step at most once. Concrete input that lists an example twice in one step
raises; under ``jit``, where nothing can raise, an index's copies after its first (in this update,
or in an earlier update of the same step) are inactive and charged nothing, so a step never
releases more of an example than its ledger was charged for. An index outside [0, N) is inactive.

What a ledger records. Charges are rounded up and summed as double words (``_directed``): the
recorded spending is never below the exact one, in float32 or float64. An example whose norm
exceeds C is charged as C (clipping), never less; a NaN, infinite or negative norm under ``jit``
is charged as C too (a concrete one raises ``ValueError``). The admission test is
``recorded + charge <= B^2 (1 + rtol)`` (``rtol`` = 1e-9 by default absorbs the rounding of a
budget computed as sqrt(T)/sigma, so T clipped steps fit): every example's exact spending is then
<= B^2 (1 + rtol), i.e. the run is B sqrt(1 + rtol)-GDP, which ``guarantee`` reports.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxacct import gdp, rdp
from jaxacct._inputs import check_range
from jaxacct._numerics import is_traced
from jaxacct.api import _dpsgd_model
from jaxacct.composition import Composition
from jaxacct.individual import _directed, _grid
from jaxacct.individual._directed import host_round, host_round_all

DEFAULT_RTOL = 1e-9
"""The relative tolerance by which a filter's ledgers round every charge up (``rtol=``)."""
# What a filter's figures certify, said where they appear.
CERTIFIES = ("A filter's guarantee holds under full adaptivity: every example is held to it "
             "whatever the training does. An individual epsilon is what the example has spent so "
             "far by the filter's ledger (its odometer), not a guarantee of its own.")
"""What a filter's figures certify (``jaxacct.individual.FILTER_CERTIFIES``), said beside them
in reports."""
# Renyi orders of ``rdp_filter`` by default: a compact set that holds DP-SGD's optimal orders.
DEFAULT_ORDERS = (1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0, 24.0,
                  32.0, 40.0, 48.0, 64.0, 128.0, 256.0)
"""The Renyi orders of ``rdp_filter`` by default: a compact set that holds DP-SGD's optimal
orders."""
_ODOMETER_POINTS = 2048  # mu grid of the GDP odometer's table


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FilterState:
  """The per-example ledger of an individual filter (a pytree of arrays, static shapes).

  ``spent`` + ``spent_low`` is each example's recorded spending as a double word, in units of
  ``unit``: for ``gdp_filter`` ([N]) sum_j (min(||g_ij||, C) / C)^2, the number of clipped steps
  it is worth (exact for clipped steps), with ``unit`` = 1/sigma^2 (rounded up) the mu^2 of one;
  for ``rdp_filter`` the RDP at each order ([N, orders], ``unit`` = 1). Read it with
  ``spent_mu`` / the filter's ``odometer``. ``halted`` marks examples refused at least once (with
  ``may_return=False`` they never return). ``active`` marks the examples admitted to the
  latest step (a Poisson batch keeps only its active members). ``steps`` counts the steps taken.
  """

  spent: jax.Array
  spent_low: jax.Array
  halted: jax.Array
  active: jax.Array
  steps: jax.Array
  unit: jax.Array


class IndividualFilter(NamedTuple):
  """``init()`` -> state; ``update(state, norms, indices, valid)`` -> (state, active);
  ``odometer(state, delta)`` -> each example's epsilon so far (an upper bound, [N]);
  ``guarantee(delta)`` -> the epsilon every example is held to (host float); ``spec``: what
  gives the ledger's numbers their meaning (JSON values: the kind, dtype, orders, noise grid,
  rounding tolerance), so a checkpoint can refuse a ledger read under another."""

  init: Callable
  update: Callable
  odometer: Callable
  guarantee: Callable
  spec: dict


def _dtype(dtype):
  return jnp.dtype(dtype) if dtype is not None else jnp.zeros(()).dtype  # float32 unless x64


def _positive(name, value, high=math.inf):
  check_range(name, value, 0.0, high, high_open=math.isinf(high))


def _check_rate(sampling_rate):
  check_range("sampling_rate", sampling_rate, 0.0, 1.0, high_open=False)


def _check_rtol(rtol):
  check_range("rtol", rtol, 0.0, 1e-2, low_open=False)


def _check_count(num_examples):
  if not (isinstance(num_examples, (int, np.integer)) and num_examples > 0):
    raise ValueError(f"num_examples must be a positive integer; got {num_examples!r}")


def _checked_batch(norms, indices, valid, num_examples):
  """The batch as arrays; when concrete, ValueError naming the argument for bad input."""
  norms, indices, valid = jnp.asarray(norms), jnp.asarray(indices), jnp.asarray(valid)
  if not (norms.ndim == 1 and norms.shape == indices.shape == valid.shape):
    raise ValueError("norms, indices and valid must be 1-D arrays of one shape; got shapes "
                     f"{norms.shape}, {indices.shape} and {valid.shape}")
  if not jnp.issubdtype(indices.dtype, jnp.integer):
    raise ValueError(f"indices must be integers; got dtype {indices.dtype}")
  if jnp.iinfo(indices.dtype).max < num_examples:  # (widened: N itself marks "no example")
    indices = indices.astype(jnp.int32)
  if not jnp.issubdtype(norms.dtype, jnp.floating):
    norms = norms.astype(jnp.zeros(()).dtype)
  if valid.dtype != bool:
    raise ValueError(f"valid must be a boolean mask; got dtype {valid.dtype}")
  if not is_traced((norms, indices, valid)):
    n, i, v = np.asarray(norms), np.asarray(indices), np.asarray(valid)
    if np.any(v & ~(n >= 0)):
      raise ValueError("norms must be >= 0 and not NaN (the per-example gradient norms); got "
                       f"{n[v & ~(n >= 0)][:4]!r}")
    if np.any(v & ((i < 0) | (i >= num_examples))):
      raise ValueError(f"indices must lie in [0, {num_examples}); got "
                       f"{i[v & ((i < 0) | (i >= num_examples))][:4]!r}")
    if len(np.unique(i[v])) != int(np.sum(v)):
      raise ValueError("indices of valid entries must be distinct (an example is in a step at "
                       "most once)")
  return norms, indices, valid


def listed(indices, valid, num_examples):
  """The valid entries whose index is an example, in [0, N) (under ``jit`` others are skipped)."""
  return valid & (indices >= 0) & (indices < num_examples)


_SCRATCH_PER_ENTRY = 64  # an [N] scratch array where N <= this x the batch size B


def first_copies(indices, valid, num_examples):
  """``listed`` entries that are the first valid one of their index: under ``jit`` a repeated
  index cannot be refused, so its later copies are dropped. A batch of B entries that is large
  against N (DP-GD lists every example) finds each index's first position by one scatter-min
  into an [N] scratch array, O(B + N); a smaller one by a stable sort of the batch, O(B log B)
  and no [N] array (XLA's CPU sort of 60,000 entries took ~9 ms a step)."""
  valid = listed(indices, valid, num_examples)
  size = indices.shape[0]
  if size < 2:
    return valid
  key = jnp.where(valid, indices, num_examples)
  position = jnp.arange(size, dtype=jnp.int32)
  if num_examples <= _SCRATCH_PER_ENTRY * size:
    first = jnp.full(num_examples + 1, size, jnp.int32).at[key].min(position)
    return valid & (first[key] == position)
  order = jnp.argsort(key, stable=True)
  ranked = key[order]
  leads = jnp.concatenate([jnp.ones(1, bool), ranked[1:] != ranked[:-1]])
  return valid & jnp.zeros_like(valid).at[order].set(leads)


def _new_in_step(state, indices, valid, new_step):
  """``valid`` less the examples already admitted in this step (by an earlier update with
  ``new_step=False``): a second copy of an example in one step is never admitted. Concrete
  input raises instead."""
  if new_step:
    return valid
  again = valid & state.active[jnp.where(valid, indices, 0)]
  if not is_traced((state.active, indices, valid)) and bool(jnp.any(again)):
    raise ValueError("an example is in a step at most once; already admitted in this step: "
                     f"{np.asarray(indices)[np.asarray(again)][:4]!r}")
  return valid & ~again


def _ledger_norms(norms, dtype):
  """Norms in the ledger's dtype, rounded up where the conversion rounded down."""
  if norms.dtype == dtype:
    return norms
  converted = norms.astype(dtype)
  return jnp.where(converted < norms, _directed.up(converted), converted)


def _scatter(array, indices, changed, values, num_examples):
  """``array`` with ``values`` written at ``indices`` where ``changed`` (others dropped)."""
  return array.at[jnp.where(changed, indices, num_examples)].set(values, mode="drop")


def _step_count(state, new_step):
  return state.steps + 1 if new_step else state.steps


def _empty_state(num_examples, orders_shape, dtype, unit):
  """A fresh state; every leaf its own buffer (a training step may donate the state)."""
  zeros = lambda: jnp.zeros((num_examples,) + orders_shape, dtype)
  flags = lambda: jnp.zeros(num_examples, bool)
  return FilterState(zeros(), zeros(), flags(), flags(), jnp.zeros((), jnp.int32),
                     jnp.asarray(unit))


# ----------------------------------------------------------------------------------------------
# GDP filter


def _budget_squares(budget, num_examples):
  """B^2 as Fractions (exact), one per example or one for all."""
  values = np.ravel(np.asarray(budget, np.float64))
  if values.size not in (1, num_examples):
    raise ValueError(f"budget must be a scalar or one value per example ({num_examples}); got "
                     f"{values.size} values")
  return [Fraction(float(b)) ** 2 for b in values]


def _per_example(values, dtype, direction):
  """Host Fractions rounded to ``dtype`` (a scalar when all examples share one)."""
  rounded = host_round_all(values, dtype, direction)
  return rounded[0] if rounded.size == 1 else rounded


@functools.lru_cache(maxsize=64)
def _gdp_odometer_table(top_mu, delta, dtype):
  """(mu grid, eps at the grid rounded up), both in ``dtype``, eps computed in float64 at the
  grid's own values: eps(mu) of mu-GDP at ``delta`` is convex in mu (and 0 at mu = 0), so the
  chord between grid points bounds it from above (checked in the tests)."""
  grid = np.geomspace(top_mu * 1e-6, top_mu, _ODOMETER_POINTS - 1).astype(dtype)
  grid = np.concatenate([[0.0], np.unique(grid)]).astype(dtype)
  with jax.ensure_compile_time_eval():  # (a host table, also when called under a trace)
    eps = np.asarray(gdp.epsilon_of_mu(grid[1:].astype(np.float64), delta), np.float64)
  eps = np.concatenate([[0.0], host_round_all(eps, dtype, 1)]).astype(dtype)
  return grid, eps


def _chord_upper(x, grid, values):
  """The chord interpolant of a convex increasing table at x, with a margin of 8 units of
  rounding; +inf above the table."""
  grid, values = jnp.asarray(grid), jnp.asarray(values)
  k = jnp.clip(jnp.searchsorted(grid, x, side="left"), 1, grid.shape[0] - 1)
  x0, x1, y0, y1 = grid[k - 1], grid[k], values[k - 1], values[k]
  frac = jnp.clip((x - x0) / (x1 - x0), 0.0, 1.0)
  y = y0 + (y1 - y0) * frac
  y = _directed.up(y + 8.0 * jnp.finfo(y.dtype).eps * y1)
  return jnp.where(x <= grid[-1], jnp.minimum(y, y1), jnp.inf)


def gdp_filter(budget, clip_norm, noise_multiplier, num_examples, may_return=True,
               fill_up=False, *, rtol=DEFAULT_RTOL, dtype=None) -> IndividualFilter:
  """Individual GDP filter for DP-GD (Alg. 1 of Koskela et al.): every example B-GDP.

  Args:
    budget: the mu-GDP budget B > 0 (one for all, or one per example); from a target
      (eps, delta) take ``jaxacct.gdp.mu_of_eps_delta(eps, delta)``.
    clip_norm: C > 0.
    noise_multiplier: sigma > 0 (the noise's std is sigma C).
    num_examples: N, the dataset size (indices are 0..N-1).
    may_return: True (Alg. 1): an example refused at one step (charged nothing) joins a later
      step that fits its remaining budget. False: the authors' code's monotone active set, an
      example once refused never returns.
    fill_up: Remark 3 / Feldman-Zrnic Alg. 3: a step that does not fit is taken with the
      example's gradient scaled by s in [0, 1) so that it spends its budget exactly;
      ``active`` is then each example's gradient scale (1, s or 0), else a boolean mask.
    rtol: relative tolerance of the admission test (module docstring).
    dtype: the ledger's float dtype (default: float32, or float64 when x64 is enabled).

  The filter is for steps whose sum holds exactly the active listed examples (DP-GD, or a
  deterministic batch): an example not listed at a step is not charged. For Poisson-subsampled
  steps use ``rdp_filter(..., sampling_rate=q)``.
  """
  _positive("budget", budget)
  _positive("clip_norm", clip_norm)
  _positive("noise_multiplier", noise_multiplier, 1e15)
  _check_count(num_examples)
  _check_rtol(rtol)
  dtype = _dtype(dtype)
  sigma_sq = Fraction(float(noise_multiplier)) ** 2
  squares = _budget_squares(budget, num_examples)  # B^2; in clipped steps B^2 sigma^2:
  threshold = _per_example([b * sigma_sq * (1 + Fraction(rtol)) for b in squares], dtype, -1)
  fill_to = _per_example([b * sigma_sq for b in squares], dtype, -1)
  mu_max = math.sqrt(float(max(squares) * (1 + Fraction(rtol)))) * (1 + 4e-16)  # B sqrt(1+rtol)
  top_mu = mu_max * (1 + 1e-6)  # the odometer's table reaches past it
  unit = host_round(1 / sigma_sq, dtype, 1)
  clip = host_round(float(clip_norm), dtype, -1)

  def init():
    return _empty_state(num_examples, (), dtype, unit)

  def update(state, norms, indices, valid, new_step=True):
    norms, indices, valid = _checked_batch(norms, indices, valid, num_examples)
    valid = _new_in_step(state, indices, first_copies(indices, valid, num_examples), new_step)
    at = jnp.where(valid, indices, 0)
    charge = _directed.clipped_square(_ledger_norms(norms, dtype), clip)
    hi, lo = state.spent[at], state.spent_low[at]
    new_hi, new_lo = _directed.add(hi, lo, charge)
    limit = threshold if np.ndim(threshold) == 0 else jnp.asarray(threshold)[at]
    allowed = valid if may_return else valid & ~state.halted[at]
    active = allowed & (_directed.total(new_hi, new_lo) <= limit)
    if fill_up:
      target = fill_to if np.ndim(fill_to) == 0 else jnp.asarray(fill_to)[at]
      scale = _fill_scale(_directed.total(hi, lo), target, charge)
      partial = allowed & ~active & (scale > 0)
      new_hi = jnp.where(partial, target, new_hi)
      new_lo = jnp.where(partial, 0.0, new_lo)
      charged = active | partial
      out = jnp.where(active, 1.0, jnp.where(partial, scale, 0.0)).astype(dtype)
    else:
      charged, out = active, active
    # Refused a full step (a topped-up example's budget is spent too).
    halted = _scatter(state.halted, indices, allowed & ~active, True, num_examples)
    was_active = jnp.zeros_like(state.active) if new_step else state.active
    state = FilterState(_scatter(state.spent, indices, charged, new_hi, num_examples),
                        _scatter(state.spent_low, indices, charged, new_lo, num_examples),
                        halted, _scatter(was_active, indices, charged, True, num_examples),
                        _step_count(state, new_step), state.unit)
    return state, out

  def odometer(state, delta):
    grid, eps = _gdp_odometer_table(top_mu, float(delta), np.dtype(state.spent.dtype))
    return _chord_upper(spent_mu(state), grid, eps)

  def guarantee(delta):
    return float(gdp.epsilon_of_mu(mu_max, delta))

  spec = dict(accountant="gdp_filter", dtype=dtype.name, rtol=float(rtol), unit=float(unit),
              fill_up=bool(fill_up))
  return IndividualFilter(init, update, odometer, guarantee, spec)


# ----------------------------------------------------------------------------------------------
# RDP filter


def _checked_orders(orders):
  orders = np.asarray(orders, np.float64)
  if orders.ndim != 1 or orders.size < 1 or not np.all((orders > 1) & (orders <= rdp.MAX_ORDER)):
    raise ValueError(f"orders must be a 1-D array of Renyi orders in (1, {rdp.MAX_ORDER:g}]; got "
                     f"{orders!r}")
  return orders


def _step_rdp(noise_multipliers, sampling_rate, orders):
  """RDP at ``orders`` of one step at each noise multiplier ([grid, orders], float64): the
  Gaussian's alpha / (2 sigma^2), or the Poisson-subsampled Gaussian's (jaxacct.rdp)."""
  sigmas = np.asarray(noise_multipliers, np.float64)[:, None]
  if sampling_rate == 1.0:
    return orders / (2.0 * sigmas ** 2)
  with jax.ensure_compile_time_eval():  # (concrete also where a caller is being traced)
    return np.asarray(_subsampled_rdp(sigmas, sampling_rate, orders), np.float64)


@jax.jit
def _subsampled_rdp(sigmas, sampling_rate, orders):
  """jaxacct.rdp of one Poisson-subsampled Gaussian step at each noise and order, as one
  compiled program (op by op, a 200 x 156 table took ~8 s of a first per-example report)."""
  step = _dpsgd_model(sigmas, sampling_rate, "add_remove", False)
  return rdp.rdp(Composition.of((step, 1)), orders)


# Relative allowance for the quadrature error of a tabulated subsampled-Gaussian RDP (jaxacct.rdp
# is accurate to ~1e-12 relative at DP-SGD's orders and ~1e-8 at order 10^4).
_RDP_TABLE_SLACK = 1e-6


def _rounded_step_rdp(noise_multipliers, sampling_rate, orders, dtype):
  """``_step_rdp`` raised by its quadrature slack and rounded up to ``dtype``: a ledger's charge
  of one step at each noise multiplier ([grid, orders])."""
  table = _step_rdp(noise_multipliers, sampling_rate, orders) * (1.0 + _RDP_TABLE_SLACK)
  return host_round_all(table, dtype, 1)


def _rdp_odometer(recorded, orders, delta):
  """Each example's epsilon from an upper bound on its RDP ([..., orders]): min over the orders
  of it plus the conversion's term, rounded up, and >= 0."""
  term = host_round_all(_conversion(orders, delta), np.dtype(recorded.dtype), 1)
  value = recorded + term
  value = _directed.up(value + 4.0 * jnp.finfo(value.dtype).eps * jnp.abs(value))
  return jnp.maximum(jnp.min(value, axis=-1), 0.0)


def rdp_budget(noise_multiplier, sampling_rate, steps, orders=DEFAULT_ORDERS):
  """The RDP at ``orders`` of ``steps`` worst-case DP-SGD steps: the budget under which every
  example of an ``rdp_filter`` gets the worst-case run's (epsilon, delta), and examples with
  small gradients run longer. (Raised by 2e-6 relative, so that ``steps`` clipped steps fit a
  ledger whose charges are rounded up, in float32 too.)"""
  _positive("noise_multiplier", noise_multiplier)
  _positive("steps", steps)
  _check_rate(sampling_rate)
  orders = _checked_orders(orders)
  step = _step_rdp([float(noise_multiplier)], float(sampling_rate), orders)[0]
  return float(steps) * step * (1.0 + 2.0 * _RDP_TABLE_SLACK)


def rdp_epsilon(rdp_values, orders, delta):
  """epsilon(delta) from RDP values [..., orders]: min over the orders of the conversion of
  dp-accounting and TF-Privacy (Balle et al. 2020, Prop. 12), in float64 on the host."""
  orders = _checked_orders(orders)
  values = np.asarray(rdp_values, np.float64)
  return np.maximum(np.min(values + _conversion(orders, delta), axis=-1), 0.0)


def _conversion(orders, delta):
  """What the conversion adds to the RDP at each order: log(1 - 1/alpha) - (log delta +
  log alpha) / (alpha - 1)."""
  return np.log1p(-1.0 / orders) - (math.log(delta) + np.log(orders)) / (orders - 1.0)


def rdp_filter(budget, clip_norm, noise_multiplier, num_examples, may_return=True, *,
               sampling_rate=1.0, orders=DEFAULT_ORDERS, sigma_grid=None, rtol=DEFAULT_RTOL,
               dtype=None) -> IndividualFilter:
  """Individual Renyi filter (Feldman and Zrnic 2021) for Gaussian or Poisson-subsampled Gaussian
  steps: an example joins a step while its RDP, including this step, stays within ``budget`` at
  every order; each example is then (alpha, budget(alpha))-RDP for every order.

  Args:
    budget: the RDP budget at each order ([orders] or a scalar), e.g. ``rdp_budget(sigma, q, T)``.
    clip_norm: as in ``gdp_filter``.
    noise_multiplier: as in ``gdp_filter``.
    num_examples: as in ``gdp_filter``.
    may_return: as in ``gdp_filter``.
    rtol: as in ``gdp_filter``.
    dtype: as in ``gdp_filter``.
    sampling_rate: q of Poisson sampling (1: every listed example is in the step).
    orders: the Renyi orders of the ledger.
    sigma_grid: with q < 1, the increasing noise grid (from at most ``noise_multiplier``) onto
      which each step's noise ratio sigma C / min(||g||, C) is rounded down to read its RDP from a
      table (default: 200 geometric points up to 100 sigma).

  A step's RDP is exact for q = 1 (alpha mu^2 / 2). With q < 1 an example's step costs privacy
  whether or not it is sampled, so its charge must not depend on the sampling: list a set of
  examples chosen independently of the step's batch (their norms at the step's parameters,
  typically all N); every example not listed is charged the step's worst case (a clipped
  gradient). Then keep the batch's members that ``state.active`` admits. A step's examples must
  come in one update (``new_step=False`` is refused with q < 1).
  """
  _positive("clip_norm", clip_norm)
  _positive("noise_multiplier", noise_multiplier)
  _check_count(num_examples)
  _check_rate(sampling_rate)
  _check_rtol(rtol)
  orders = _checked_orders(orders)
  budget_values = np.broadcast_to(np.asarray(budget, np.float64), orders.shape)
  _positive("budget", budget_values)
  dtype = _dtype(dtype)
  limit = host_round_all([Fraction(float(b)) * (1 + Fraction(rtol)) for b in budget_values],
                         dtype, -1)
  clip = host_round(float(clip_norm), dtype, -1)
  sigma = float(noise_multiplier)
  subsampled = sampling_rate < 1.0
  if subsampled:
    grid = _grid.checked_grid(_grid.noise_grid(sigma) if sigma_grid is None else sigma_grid,
                              sigma)
    table = _rounded_step_rdp(grid, float(sampling_rate), orders, dtype)
    thresholds = _grid.ratio_thresholds(grid, sigma, dtype)
    worst = _rounded_step_rdp([sigma], float(sampling_rate), orders, dtype)[0]
  else:
    per_clipped_step = host_round_all([Fraction(float(a)) / (2 * Fraction(sigma) ** 2)
                                       for a in orders], dtype, 1)

  def charges(norms):
    """Each listed example's RDP at the orders for this step ([batch, orders], rounded up)."""
    norms = _ledger_norms(norms, dtype)
    if subsampled:
      ratio = _directed.clipped_ratio(norms, clip)
      return jnp.asarray(table)[_grid.bucket(ratio, thresholds)]
    return _directed.times(_directed.clipped_square(norms, clip)[:, None],
                           jnp.asarray(per_clipped_step))

  def init():
    return _empty_state(num_examples, orders.shape, dtype, np.asarray(1.0, dtype))

  def update(state, norms, indices, valid, new_step=True):
    norms, indices, valid = _checked_batch(norms, indices, valid, num_examples)
    first = first_copies(indices, valid, num_examples)
    charge = charges(norms)
    if subsampled:
      if not new_step:
        raise ValueError("with sampling_rate < 1 a step's examples come in one update "
                         "(new_step=False is not accepted)")
      listed = _listed_charges(state.spent.shape, worst, charge, indices, valid, num_examples)
      new_hi, new_lo = _directed.add(state.spent, state.spent_low, listed)
      fits = jnp.all(_directed.total(new_hi, new_lo) <= jnp.asarray(limit), axis=-1)
      allowed = jnp.ones_like(fits) if may_return else ~state.halted
      active_all = allowed & fits
      keep = active_all[:, None]
      state = FilterState(jnp.where(keep, new_hi, state.spent),
                          jnp.where(keep, new_lo, state.spent_low),
                          state.halted | (allowed & ~fits), active_all, state.steps + 1,
                          state.unit)
      return state, first & active_all[jnp.where(first, indices, 0)]
    valid = _new_in_step(state, indices, first, new_step)
    at = jnp.where(valid, indices, 0)
    hi, lo = state.spent[at], state.spent_low[at]
    new_hi, new_lo = _directed.add(hi, lo, charge)
    fits = jnp.all(_directed.total(new_hi, new_lo) <= jnp.asarray(limit), axis=-1)
    allowed = valid if may_return else valid & ~state.halted[at]
    active = allowed & fits
    was_active = jnp.zeros_like(state.active) if new_step else state.active
    state = FilterState(_scatter(state.spent, indices, active, new_hi, num_examples),
                        _scatter(state.spent_low, indices, active, new_lo, num_examples),
                        _scatter(state.halted, indices, allowed & ~fits, True, num_examples),
                        _scatter(was_active, indices, active, True, num_examples),
                        _step_count(state, new_step), state.unit)
    return state, active

  def odometer(state, delta):
    """min over orders of the recorded RDP plus the conversion's term, rounded up."""
    recorded = _directed.total(state.spent, state.spent_low)
    nothing = jnp.all(recorded == 0, axis=-1)  # (no step taken: epsilon 0, not the conversion's)
    return jnp.where(nothing, 0.0, _rdp_odometer(recorded, orders, delta))

  def guarantee(delta):
    return float(rdp_epsilon(budget_values * (1.0 + rtol) * (1 + 4e-16), orders, delta))

  spec = dict(accountant="rdp_filter", dtype=dtype.name, rtol=float(rtol),
              orders=orders.tolist(), sampling_rate=float(sampling_rate),
              sigma_grid=grid.tolist() if subsampled else None)
  return IndividualFilter(init, update, odometer, guarantee, spec)


def _listed_charges(shape, worst, charge, indices, valid, num_examples):
  """A subsampled step's charge of every example ([N, orders]): a listed one its own (the
  largest of its copies', should it be listed twice), the others the worst case."""
  rows = jnp.where(listed(indices, valid, num_examples), indices, num_examples)
  largest = jnp.zeros(shape, charge.dtype).at[rows].max(charge, mode="drop")
  charged = jnp.zeros(shape[0], bool).at[rows].set(True, mode="drop")
  return jnp.where(charged[:, None], largest, jnp.asarray(worst))


def _fill_scale(recorded, target, charge):
  """s in [0, 1] with s^2 * charge <= target - recorded (all rounded down): the gradient scale
  that spends the rest of the budget (charge >= the exact charge, so the exact spending stays <=
  target)."""
  rest, error = _directed.two_sum(target, -recorded)
  rest = jnp.where(error < 0, jnp.nextafter(rest, jnp.zeros_like(rest)), rest)
  ratio = jnp.maximum(rest, 0.0) / charge
  ratio = jnp.nextafter(ratio, jnp.zeros_like(ratio))
  scale = jnp.nextafter(jnp.sqrt(jnp.maximum(ratio, 0.0)), jnp.zeros_like(ratio))
  return jnp.clip(scale, 0.0, 1.0)


def spent_mu(state: FilterState):
  """Each example's GDP mu so far, sqrt(recorded sum mu^2), rounded up ([N])."""
  recorded = _directed.up(_directed.total(state.spent, state.spent_low) * state.unit)
  return jnp.where(recorded > 0, _directed.up(jnp.sqrt(recorded)), 0.0)


__all__ = ["CERTIFIES", "DEFAULT_ORDERS", "DEFAULT_RTOL", "FilterState", "IndividualFilter",
           "first_copies", "gdp_filter", "listed", "rdp_budget", "rdp_epsilon", "rdp_filter",
           "spent_mu"]
