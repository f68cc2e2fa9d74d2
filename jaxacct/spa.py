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
  by a small relative slack for the quadrature of K. A lower bound that is not positive (delta:
  one that underflows to 0; eps: 0 or none) is vacuous (nan).
* Regime guard (status UNRELIABLE), per estimate: the terms of the steepest-descent series
  (Daniels 1954) that the estimate leaves out, from K'' ... K^(6) at t0, predict its epsilon
  error; the estimate is flagged where that exceeds 2e-4 x max(1, eps), where the series' first
  correction exceeds half its leading term, or where t0 lies beyond the searched tilts
  (``_unreliable``). A delta(eps) query is flagged by the same rule at its eps.

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
from jaxacct.composition import Composition, total_count
from jaxacct.results import Bounds

METHODS = ("clt", "msd0", "msd1")
"""The saddle-point estimates (``method=``; the first is the default): the SP-CLT and the
method-of-steepest-descent corrections of orders 0 and 1 (Alghamdi et al.)."""
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
# The regime guard (``_unreliable``): an estimate is flagged UNRELIABLE where its predicted
# epsilon error exceeds _RELIABLE x max(1, eps), or where its series' first correction exceeds
# _SERIES_SETTLED of the leading term. On the 600 settings of benchmarks/flag_sweep.py the
# prediction was within 8 % of SP-CLT's and SP-MSD0's actual errors on 90 % of the unflagged
# settings (median 3 %); no unflagged estimate was off by more than 2.05e-4 x max(1, eps)
# (README, "Accuracy").
_RELIABLE = 2e-4
_SERIES_SETTLED = 0.5


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
  return dict(clt=log_clt, msd0=log_msd0, msd1=log_msd1, err=log_err)


def _higher_cumulants(composition, t, nodes, add):
  """(K^(5), K^(6)) of the composition at tilt t, the derivatives of K'''' in t (read by the
  regime guard only; ``nodes``, when given, must cover t)."""
  k4 = lambda x: cumulants(composition, x, add, nodes)[4]
  k5 = lambda x: jax.jvp(k4, (x,), (jnp.ones_like(x),))[1]
  return jax.jvp(k5, (t,), (jnp.ones_like(t),))


def _series(phi2, phi3, phi4, phi5, phi6):
  """The first two corrections of the steepest-descent series, delta ~ SP-MSD0 (1 + a1 + a2),
  in the standardised derivatives l_k = phi^(k) / phi''^(k/2) (Daniels 1954, eq. (2.6)): a1,
  a2, and a2 with its five terms counted in absolute value (a bound on its size where they
  cancel by accident)."""
  l3, l4, l5, l6 = (p / phi2 ** (0.5 * k) for p, k in ((phi3, 3), (phi4, 4), (phi5, 5), (phi6, 6)))
  a1 = l4 / 8.0 - 5.0 * l3 ** 2 / 24.0
  terms = (385.0 * l3 ** 4 / 1152.0, -35.0 * l3 ** 2 * l4 / 64.0, 35.0 * l4 ** 2 / 384.0,
           7.0 * l3 * l5 / 48.0, -l6 / 48.0)
  return a1, sum(terms), sum(jnp.abs(x) for x in terms)


def predicted_error(cum, higher, t, method):
  """The epsilon error of one estimate at the saddle point t, predicted by the terms of the
  steepest-descent series that it leaves out, and the series' first corrections (a1, g1).

  With phi = K - eps t - log t - log(1+t), delta ~ SP-MSD0 (1 + a1 + a2) (``_series``). SP-MSD0
  leaves out a1 + a2. SP-CLT is exact for the quadratic K with the same K, K', K'' at t, whose
  series has the same SP-MSD0 and its own (g1, g2) (K's cumulants above the second set to
  zero), so it is off by (1 + a1 + a2) / (1 + g1 + g2) - 1 (zero for Gaussian steps). SP-MSD1
  leaves out a2, whose terms are counted in absolute value: few steps of a small-q loss can
  make them cancel (on the flag sweep a2 itself understated SP-MSD1's error by up to 450x, as
  at sigma 0.51, q 5e-4, T 969: 1.5e-2); their sum of sizes never did. A relative delta error
  r moves epsilon by r / s, with s = -d log SP-MSD0 / d eps = t + phi''' / (2 phi''^2) along
  the saddle curve (dt / d eps = 1 / phi'').
  """
  k2, k3 = cum[2], cum[3]
  u, v = 1.0 / t, 1.0 / (1.0 + t)  # the derivatives of -log t - log(1+t), orders 2..6:
  log_part = (u ** 2 + v ** 2, -2.0 * (u ** 3 + v ** 3), 6.0 * (u ** 4 + v ** 4),
              -24.0 * (u ** 5 + v ** 5), 120.0 * (u ** 6 + v ** 6))
  phi2 = k2 + log_part[0]
  a1, a2, a2_size = _series(phi2, *(k + g for k, g in zip((k3, cum[4], *higher), log_part[1:])))
  g1, g2, _ = _series(phi2, *log_part[1:])
  left_out = dict(clt=(1.0 + a1 + a2) / (1.0 + g1 + g2) - 1.0, msd0=a1 + a2,
                  msd1=a2_size / (1.0 + a1))[method]
  slope = t + (k3 + log_part[1]) / (2.0 * phi2 ** 2)
  error = jnp.where(slope > 0.0, jnp.abs(left_out) / jnp.where(slope > 0.0, slope, 1.0), jnp.inf)
  return error, a1, g1


def _unreliable(cum, higher, t, eps, method):
  """The regime guard (status UNRELIABLE): the predicted epsilon error (``predicted_error``)
  exceeds _RELIABLE x max(1, eps), or the series it comes from has not started to converge (a
  first correction above _SERIES_SETTLED of the leading term, where its next terms need not
  predict the error)."""
  error, a1, g1 = predicted_error(jax.lax.stop_gradient(cum), jax.lax.stop_gradient(higher),
                                  jax.lax.stop_gradient(t), method)
  settled = (jnp.abs(a1) <= _SERIES_SETTLED) & (jnp.abs(g1) <= _SERIES_SETTLED)
  return ~(settled & (error <= _RELIABLE * jnp.maximum(1.0, eps)))


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
  nodes = tilt_nodes(composition, t, t, add)
  cum = cumulants(composition, t, add, nodes)
  terms = _terms(cum, t, eps)
  lower, estimate, upper, _ = _log_bounds(terms, method, total_count(composition))
  higher = _higher_cumulants(*jax.lax.stop_gradient((composition, t, nodes)), add)
  unreliable = ~inside | _unreliable(cum, higher, t, eps, method)  # (beyond: not a saddle point)
  lower = jnp.exp(lower)
  lower = jnp.where(lower > 0.0, lower, jnp.nan)  # one that underflows to 0 is no bound either
  status = jnp.where(jnp.isnan(lower), results.LOWER_VACUOUS, results.OK)
  status = status | jnp.where(unreliable, results.UNRELIABLE, results.OK)
  # Beyond the searched tilts the bound is still valid (it holds at any tilt).
  status = status | jnp.where(inside, results.OK, results.OUT_OF_RANGE)
  status = status | jnp.where(upper >= 0.0, results.UPPER_VACUOUS, results.OK)
  status = status | floored_status(upper, results.UPPER_FLOORED)
  return Bounds(lower, jnp.exp(estimate), exp_upper(upper), status.astype(jnp.int32))


def _curve_point(composition, log_t, method, add, nodes=None):
  """(log lower, log estimate, log upper) of delta at the point eps(t) of the saddle curve,
  eps(t) = K'(t) - 1/t - 1/(1+t) (t is the saddle point of eps(t) by construction)."""
  t = jnp.exp(log_t)
  cum = cumulants(composition, t, add, nodes)
  eps = cum[1] - 1.0 / t - 1.0 / (1.0 + t)
  terms = _terms(cum, t, eps)
  lower, estimate, upper, log_err = _log_bounds(terms, method, total_count(composition))
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


def _estimate_unreliable(composition, log_t, nodes, method, add):
  """The regime guard of the estimate at its saddle point log t (``nodes``: the three fields'
  stacked node sets; the estimate's is the second)."""
  t = jnp.exp(log_t)
  nodes = jax.tree_util.tree_map(lambda a: a[1], nodes)
  cum = cumulants(composition, t, add, nodes)
  eps = cum[1] - 1.0 / t - 1.0 / (1.0 + t)
  higher = _higher_cumulants(*jax.lax.stop_gradient((composition, t, nodes)), add)
  return _unreliable(cum, higher, t, eps, method)


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
    return jnp.where(below | (eps < 0.0), 0.0, eps), beyond | ~safe, log_t, nodes

  # (int32 field indices: under jit(grad) with x64 off, XLA lowers the index reads' transposed
  # scatters after the float64 scope has closed, with int32 bounds that int64 indices fail.)
  fields = jnp.arange(3, dtype=jnp.int32)
  eps, beyond, log_t, nodes = jax.vmap(one)(fields, jnp.array([-1, 0, 1]))
  # A lower bound of 0 (the target is above the lower curve everywhere, or is met only at
  # eps <= 0) says nothing: vacuous, nan.
  lower = jnp.where(beyond[0] | (eps[0] <= 0.0), jnp.nan, eps[0])
  upper = jnp.where(beyond[2], jnp.inf, eps[2])
  status = jnp.where(jnp.isnan(lower), results.LOWER_VACUOUS, results.OK)
  # An estimate whose saddle point lies beyond the searched tilts is the curve's end, not a root.
  unreliable = beyond[1] | _estimate_unreliable(composition, log_t[1], nodes, method, add)
  status = status | jnp.where(unreliable, results.UNRELIABLE, results.OK)
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
