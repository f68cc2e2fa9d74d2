"""The saddle-point accountant (Alghamdi, Asoodeh, Calmon, Gomez, Kosut, Sankar and Wei 2022,
"The Saddle-Point Accountant for Differential Privacy", arXiv 2208.09595): delta(eps) and
eps(delta) in constant time in the number of steps, from the composition's cumulant generating
function K (``cgf``).

For a target eps, the saddle point t0 > 0 solves K'(t) = eps + 1/t + 1/(1+t). At t0:

* SP-CLT (the default estimate, Sec. 3.3.2): the tilted loss is replaced by a Gaussian with its
  mean and variance, delta ~ e^{K - eps t} E[(1 - e^{-Z})_+ e^{-t Z}], Z ~ N(K'(t) - eps, K''(t))
  (closed form). Exact for Gaussian mechanisms at every tilt.
* SP-MSD of order 0 and 1 (Sec. 3.3.1): the method of steepest descent, selectable as alternative
  estimates.
* Certified bounds (Theorem 5, Sec. 4.1):
  |delta - SP-CLT| <= 2C e^{K - eps t} t^t (1+t)^{-(1+t)} rho(t) / K''(t)^{3/2}
  (Berry-Esseen on the tilted sum, C = 0.56 for non-identical summands, Shevtsova 2010), widened
  by a small relative slack for the quadrature of K. A lower bound that is not positive is
  vacuous (nan).

eps(delta) follows the saddle curve: eps(t) = K'(t) - 1/t - 1/(1+t) is increasing in t, so each
quantity is a root in log t: a coarse scan finds its grid cell, safeguarded Newton refines it
(``root_in_bracket``: gradients are implicit). A certified end is a point moved a little to its
safe side whose sign is then checked on the same nodes (else no bound). Both adjacency
directions are computed for an asymmetric composition and the worse is reported.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import log_ndtr

from jaxacct import results
from jaxacct._inputs import check_choice, check_delta, check_epsilon
from jaxacct._numerics import as_leaf, exp_upper, float64, floored_status
from jaxacct._solver import root_in_bracket
from jaxacct.cgf import checked, cumulants, query, tilt_nodes
from jaxacct.composition import Composition
from jaxacct.results import Bounds

METHODS = ("clt", "msd0", "msd1")
_TWO_C = 1.12  # twice the Berry-Esseen constant for non-identical summands (Shevtsova 2010: 0.56)
# Tilts are searched on this log-spaced grid over [1e-8, 1e3] (the CGF quadrature covers these
# tilts), then refined by Newton inside the grid cell that holds the root.
_LOG_T_GRID = np.linspace(math.log(1e-8), math.log(1e3), 33)
# Newton starts at the coarse values' linear interpolation and stops once its step in log t is
# below _NEWTON_TOL (so its error is ~1e-12: convergence is quadratic); on a vmapped batch of 64
# DP-SGD settings every root converged within 9 steps, most within 4-5. An unconverged bound
# falls back to its bracket's safe end.
_NEWTON_STEPS = 24
_NEWTON_TOL = 1e-6
# The search runs on a quarter-size rule over the bracket; one Newton step then polishes the root
# with the full rule's value and the search's last slope (see ``root_in_bracket``; a second step
# changed no sweep result by > 1e-7).
_NEWTON_PANELS = 32
# The scan reads K from a coarse rule (_SCAN_PANELS x 16 nodes): it only has to find the grid
# cell of the root (on 400 random settings, q 1e-5..1, sigma 0.3..20, T 1..1e7, delta
# 1e-12..1e-2, it picked the full rule's cell every time; 8 panels missed by one twice). The
# refinement spans that cell and its two neighbours (a coarse sign error next to a grid point
# moves the root by at most one cell) on one node set for the whole bracket, so each Newton step
# is a cheap reweighting.
_SCAN_PANELS = 16
# Grid points up to this tilt share one scan node set (their quadrature intervals nearly
# coincide: the bulk of P and Q plus at most mu); each larger tilt gets its own. On 600 random
# settings (ranges as above) every scan residual kept its sign, both directions, all fields.
_SHARED_SCAN_TILT = 1.0
# Relative slack added to the error bound for the quadrature error of K (per unit of count).
_QUADRATURE_SLACK = 1e-12


def _terms(cum, t, eps):
  """log SP-CLT, log SP-MSD0, log SP-MSD1, log error bound and a reliability flag at tilt t,
  from the composition's cumulants ``cum`` at t."""
  k, k1, k2, k3, k4, rho = cum
  mu = k1 - eps
  s = jnp.sqrt(k2)
  a = t * s - mu / s
  b = a + s
  la = -t * mu + 0.5 * (t * s) ** 2 + log_ndtr(-a)
  lb = -(1.0 + t) * mu + 0.5 * ((1.0 + t) * s) ** 2 + log_ndtr(-b)
  tilt = k - eps * t
  log_clt = tilt + la + jnp.log1p(-jnp.exp(jnp.minimum(lb - la, 0.0)))
  phi0 = tilt - jnp.log(t) - jnp.log1p(t)
  phi2 = k2 + t ** -2 + (1.0 + t) ** -2
  phi3 = k3 - 2.0 * t ** -3 - 2.0 * (1.0 + t) ** -3
  phi4 = k4 + 6.0 * t ** -4 + 6.0 * (1.0 + t) ** -4
  log_msd0 = phi0 - 0.5 * jnp.log(2.0 * math.pi * phi2)
  corr = 1.0 + phi4 / (8.0 * phi2 ** 2) - 5.0 * phi3 ** 2 / (24.0 * phi2 ** 3)
  log_msd1 = jnp.where(corr > 0.0, log_msd0 + jnp.log(jnp.where(corr > 0.0, corr, 1.0)), jnp.nan)
  log_err = (math.log(_TWO_C) + tilt + t * jnp.log(t) - (1.0 + t) * jnp.log1p(t) + jnp.log(rho)
             - 1.5 * jnp.log(k2))
  # Regime guard: a large term of the first steepest-descent correction (the two can cancel in
  # corr) means the tilted sum is far from Gaussian. On the 59 stored DP-SGD references every
  # setting with both terms <= 0.05 had a relative error <= 3e-4; every error above 1e-3 (up to
  # 2x, at small q and sigma) had a term above 0.05.
  correction = jnp.maximum(jnp.abs(phi4 / (8.0 * phi2 ** 2)),
                           jnp.abs(5.0 * phi3 ** 2 / (24.0 * phi2 ** 3)))
  unreliable = correction > 0.05
  return dict(clt=log_clt, msd0=log_msd0, msd1=log_msd1, err=log_err, unreliable=unreliable)


def _count(composition):
  return sum(jnp.asarray(c, jnp.float64) for c in composition.counts)


def _log_bounds(terms, method, count):
  """(log lower, log estimate, log upper) of delta from the terms at one tilt, and the log of
  the error bound they use (quadrature slack included)."""
  slack = jnp.expm1(_QUADRATURE_SLACK * (1.0 + count))
  log_err = jnp.logaddexp(terms["err"], terms["clt"] + jnp.log(slack))
  upper = jnp.minimum(jnp.logaddexp(terms["clt"], log_err), 0.0)
  gap = log_err - terms["clt"]
  safe_gap = jnp.where(gap < 0.0, gap, -1.0)  # finite gradients where the bound is vacuous
  lower = jnp.where(gap < 0.0, terms["clt"] + jnp.log1p(-jnp.exp(safe_gap)), jnp.nan)
  return lower, terms[method], upper, log_err


def _scan(residual_at, composition, add):
  """``residual_at(x, nodes)`` at every point of _LOG_T_GRID, K read from the coarse scan rule:
  one node set for the tilts up to _SHARED_SCAN_TILT, one per larger tilt."""
  small = _LOG_T_GRID <= math.log(_SHARED_SCAN_TILT)
  shared = tilt_nodes(composition, math.exp(_LOG_T_GRID[0]), _SHARED_SCAN_TILT, add,
                      panels=_SCAN_PANELS)
  low = jax.vmap(lambda x: residual_at(x, shared))(jnp.asarray(_LOG_T_GRID[small]))
  own = lambda x: tilt_nodes(composition, jnp.exp(x), jnp.exp(x), add, panels=_SCAN_PANELS)
  high = jax.vmap(lambda x: residual_at(x, own(x)))(jnp.asarray(_LOG_T_GRID[~small]))
  return jax.lax.stop_gradient(jnp.concatenate([low, high]))


def _phi_prime(composition, log_t, eps, add, nodes=None):
  t = jnp.exp(log_t)
  _, k1, k2, *_ = cumulants(composition, t, add, nodes)
  return k1 - eps - 1.0 / t - 1.0 / (1.0 + t), k2 + t ** -2 + (1.0 + t) ** -2


def _decreasing_root(make_residual, grid_values, which, composition, add):
  """Root in x = log t of a decreasing residual, given its (coarse) values on _LOG_T_GRID: the
  grid cell where it changes sign, then safeguarded Newton on that cell and its neighbours
  (implicit gradients), started at the coarse values' linear interpolation: the search reads
  ``make_residual(nodes)`` from a quarter-size node set for the bracket, the polish step reads
  the full rule's value.

  ``which`` picks the result: 0 the Newton point, +1 the bracket end where residual <= 0, -1 the
  end where residual >= 0 (the safe ends for upper and lower bounds; the Newton point once it
  converged). Also returns the slope the search last read (on the quarter-size rule), whether
  the sign change lies inside the grid at all (``below``: none at or after the first point;
  ``beyond``: none before the last point), and the full rule's node set for the bracket. Without
  a sign change the bracket is the nearer grid end (one step).
  """
  grid = jnp.asarray(_LOG_T_GRID)
  n = grid.shape[0]
  # The cell of a coarse sign change: for a lower bound (which < 0) the last point at or above
  # the target (the largest valid eps), otherwise the first point below it (the smallest upper
  # eps); the same cell where the residual is monotone, a real sign change where it is not.
  nonneg = grid_values >= 0.0
  last_nonneg = n - 1 - jax.lax.argmax(nonneg[::-1], 0, jnp.int32)
  first_neg = jax.lax.argmax(~nonneg, 0, jnp.int32)
  lower_side = which < 0
  below = jnp.where(lower_side, ~jnp.any(nonneg), ~nonneg[0])
  beyond = jnp.where(lower_side, nonneg[-1], jnp.all(nonneg))
  i = jnp.clip(jnp.where(lower_side, last_nonneg, first_neg - 1), 0, n - 2)
  i = jnp.where(below, 0, jnp.where(beyond, n - 2, i))  # the bracket is then that grid end
  lo, hi = grid[jnp.maximum(i - 1, 0)], grid[jnp.minimum(i + 2, n - 1)]
  lo = jnp.where(beyond, grid[-1], lo)
  hi = jnp.where(below, grid[0], hi)
  v0, v1 = grid_values[i], grid_values[i + 1]
  fraction = jnp.where(jnp.isfinite(v1), jnp.clip(v0 / jnp.where(v0 > v1, v0 - v1, 1.0), 0.0, 1.0),
                       0.0)
  start = jnp.clip(grid[i] + fraction * (grid[i + 1] - grid[i]), lo, hi)
  nodes = tilt_nodes(composition, jnp.exp(lo), jnp.exp(hi), add)
  coarse = tilt_nodes(composition, jnp.exp(lo), jnp.exp(hi), add, panels=_NEWTON_PANELS)
  x, slope = root_in_bracket(make_residual(nodes), lo, hi, _NEWTON_STEPS, which, _NEWTON_TOL,
                            jax.lax.stop_gradient(start), coarse=make_residual(coarse))
  return x, slope, below, beyond, nodes


def saddle_point(composition: Composition, eps, add=False):
  """log t0, the root of K'(t) = eps + 1/t + 1/(1+t) (implicit gradients), and whether it lies
  inside the searched range."""
  residual = lambda nodes: (lambda x: -_phi_prime(composition, x, eps, add, nodes)[0])
  values = _scan(lambda x, nodes: residual(nodes)(x), composition, add)
  log_t, _, _, beyond, _ = _decreasing_root(residual, values, 0, composition, add)
  return log_t, ~beyond


def _delta_direction(composition, eps, method, add):
  log_t, inside = saddle_point(composition, eps, add)
  t = jnp.exp(log_t)
  terms = _terms(cumulants(composition, t, add), t, eps)
  lower, estimate, upper, _ = _log_bounds(terms, method, _count(composition))
  status = jnp.where(jnp.isnan(lower), results.LOWER_VACUOUS, results.OK)
  status = status | jnp.where(terms["unreliable"], results.UNRELIABLE, results.OK)
  # Beyond the searched tilts the bound is still valid (it holds at any tilt).
  status = status | jnp.where(inside, results.OK, results.OUT_OF_RANGE)
  status = status | jnp.where(upper >= 0.0, results.UPPER_VACUOUS, results.OK)
  status = status | floored_status(upper, results.UPPER_FLOORED)
  return Bounds(jnp.exp(lower), jnp.exp(estimate), exp_upper(upper), status.astype(jnp.int32))


def _curve_point(composition, log_t, method, add, nodes=None):
  """(log lower, log estimate, log upper) of delta at the point eps(t) of the saddle curve,
  eps(t) = K'(t) - 1/t - 1/(1+t) (t is the saddle point of eps(t) by construction)."""
  t = jnp.exp(log_t)
  cum = cumulants(composition, t, add, nodes)
  eps = cum[1] - 1.0 / t - 1.0 / (1.0 + t)
  terms = _terms(cum, t, eps)
  lower, estimate, upper, log_err = _log_bounds(terms, method, _count(composition))
  # A vacuous lower bound (nan) counts as delta = 0 there, i.e. below any target.
  values = jnp.stack([jnp.where(jnp.isnan(lower), -jnp.inf, lower), estimate, upper])
  return values, eps, dict(terms, log_err=log_err)


def _residuals(values, terms, log_delta):
  """Decreasing residuals in t whose roots are the lower, estimated and upper eps. The estimate
  and the upper bound: log delta minus the target. The lower bound, delta_clt - err >= target,
  as log delta_clt - log(target + err): the same sign at every t, but smooth where the lower
  bound is vacuous (err >= delta_clt, where log(delta_clt - err) is -inf), so Newton runs on it
  as on the estimate's residual."""
  r = values - log_delta
  lower = terms["clt"] - jnp.logaddexp(log_delta, terms["log_err"])
  return jnp.stack([lower, r[1], r[2]])


def _epsilon_direction(composition, delta, method, add):
  log_delta = jnp.log(delta)
  curve = lambda x, nodes=None: _curve_point(composition, x, method, add, nodes)

  def residuals(x, nodes):
    values, _, terms = curve(x, nodes)
    return _residuals(values, terms, log_delta)

  grid_values = _scan(residuals, composition, add)

  def one(field, which):  # lower (field 0), estimate (1), upper (2) and its safe bracket end
    residual = lambda nodes: (lambda x: residuals(x, nodes)[field])
    log_t, slope, below, beyond, nodes = _decreasing_root(residual, grid_values[:, field],
                                                          which, composition, add)
    # The returned point must be on its safe side (delta_upper <= target for the upper eps,
    # delta_lower >= target for the lower), whatever the shape of the curve: else no bound.
    on_safe_side = lambda gap: jnp.where(which > 0, gap <= 0.0, jnp.where(which < 0, gap >= 0.0,
                                                                         True))
    # The curve carries rounding noise (up to ~1e-10 in log delta at large T, from cancelling
    # terms), so a bound's point first moves further to its safe side (delta falls as t grows)
    # by what changes its residual by 1e-8 (the slope the search last read, on the coarse rule:
    # only its size matters): the bound loosens by ~1e-8 relative.
    nudge = which * jnp.clip(1e-8 / jnp.abs(slope), 1e-12, 1e-3)
    log_t = log_t + jax.lax.stop_gradient(nudge)
    values, eps, terms = curve(log_t, nodes)  # the nodes the root was found on
    safe = below | on_safe_side(values[field] - log_delta)
    # Only eps >= 0 matters: where the curve is already below the target at eps = 0, eps = 0.
    return jnp.where(below | (eps < 0.0), 0.0, eps), beyond | ~safe, terms["unreliable"]

  eps, beyond, unreliable = jax.vmap(one)(jnp.arange(3), jnp.array([-1, 0, 1]))
  lower = jnp.where(beyond[0], jnp.nan, eps[0])
  upper = jnp.where(beyond[2], jnp.inf, eps[2])
  status = jnp.where(jnp.isnan(lower), results.LOWER_VACUOUS, results.OK)
  status = status | jnp.where(unreliable[1], results.UNRELIABLE, results.OK)
  status = status | jnp.where(beyond[2], results.OUT_OF_RANGE, results.OK)
  return Bounds(lower, eps[1], upper, status.astype(jnp.int32))


@float64
def epsilon(composition, delta, *, method="clt") -> Bounds:
  """epsilon(delta) by the saddle-point accountant, worse adjacency direction.

  Args:
    composition: a ``Composition``, a model, or a list of (model, count) entries; counts may be
      real numbers (d epsilon / d T exists). Leaves may be arrays: the result is batched over
      their broadcast shape. Models with mass at infinite loss are refused.
    delta: target delta in (0, 1), broadcast with the composition.
    method: the estimate, one of ``METHODS`` ("clt", "msd0", "msd1").
  Returns:
    ``Bounds`` (lower, estimate, upper, status), float64, batched like the inputs.
  """
  check_choice("method", method, METHODS)
  composition = checked(composition)
  delta = as_leaf(delta)
  check_delta(delta)
  return query(_epsilon_direction, method, composition, delta)


@float64
def delta(composition, epsilon, *, method="clt") -> Bounds:
  """delta(epsilon) by the saddle-point accountant, worse adjacency direction; arguments as in
  ``epsilon`` (``epsilon`` >= 0)."""
  check_choice("method", method, METHODS)
  composition = checked(composition)
  epsilon = as_leaf(epsilon)
  check_epsilon(epsilon)
  return query(_delta_direction, method, composition, epsilon)
