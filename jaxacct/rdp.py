"""Renyi DP: a composition's RDP curve and its conversion to (epsilon, delta).

The Renyi divergence of order alpha of a step's pair (P, Q) is RDP(alpha) = K(alpha-1)/(alpha-1),
K(t) = log E_P[e^{tL}] the cumulant generating function of its privacy loss (``jaxacct.cgf``); it
adds up over a composition (real counts allowed). Under add/remove adjacency each order takes the
worse of the two directions, as an RDP guarantee must.

The conversion is the one dp-accounting and TF-Privacy use (Balle et al. 2020, Prop. 12; Canonne,
Kamath and Steinke 2020): for every order alpha = 1 + t,

    epsilon(delta) <= RDP(alpha) + log((alpha - 1)/alpha) - (log delta + log alpha)/(alpha - 1),
    log delta(epsilon) <= (alpha - 1)(RDP(alpha) - epsilon + log(1 - 1/alpha)) - log alpha,

minimised here over a *continuous* order instead of a fixed list. With c(t) = t log t -
(1+t) log(1+t), convex like K, the epsilon bound is N(t)/t with N = K + c - log delta convex and
N(0) > 0, the log-delta bound is K + c - epsilon t, convex: both are unimodal in t, and each
minimiser is the single root of an increasing function:

    epsilon:  t K'(t) - K(t) + log(1 + t) + log delta,     slope t K''(t) + 1/(1 + t),
    delta:    K'(t) - epsilon - log(1 + 1/t),               slope K''(t) + 1/(t (1 + t)).

Newton in log t, safeguarded by bisection of the sign bracket, finds the root over the whole
searched range (a fixed number of steps: static shapes), and ``implicit_root`` differentiates it.
The bound is stationary there, so its gradient is that of the objective at the optimal order
(envelope theorem); the implicit derivative of the order also makes second derivatives right.
Orders are searched in [1 + ``MIN_TILT``, ``MAX_ORDER``] = [1.001, 10000], where the models' CGF
quadratures are accurate (about 1e-8 relative at alpha = 1e4, 1e-12 at DP-SGD's optimal orders);
when the optimum lies outside, the bound at the nearer end is returned (valid, not the infimum).

``upper`` = ``estimate`` is that bound; RDP gives no lower bound (``lower`` is nan, status
``LOWER_VACUOUS``). Every function is float64, and jit/vmap/grad-able (inputs are checked only
when concrete), except the ``host_dpsgd_*`` functions at the end: DP-SGD on the host (numpy) at
integer orders, a calibration's starting value with nothing compiled.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxacct import cgf, models
from jaxacct._batch import answer, blockwise, vectorised
from jaxacct._inputs import check_delta, check_epsilon, check_range
from jaxacct._numerics import (array_namespace, as_leaf, exp_upper, float64, floored_status,
                               host_logsumexp, safe_where)
from jaxacct._solver import implicit_root, newton_in_bracket
from jaxacct.composition import Composition, counted_sum, total_count
from jaxacct.results import LOWER_VACUOUS, UPPER_FLOORED, Bounds, zero_if

MAX_ORDER = 1.0e4   # largest Renyi order accepted by ``rdp`` and searched by the conversions
"""The largest Renyi order accepted by ``rdp`` and searched by the conversions."""
MIN_TILT = 1.0e-3   # smallest alpha - 1 searched by the conversions
"""The smallest alpha - 1 searched by the conversions."""
_START = np.log(8.0)  # first iterate of the order search, in log(alpha - 1)
# Iterations of the order search: interior optima converge in <= 23 over a random sweep of
# DP-SGD settings, optima at an end of the range in <= 34 (bisection).
_NEWTON_ITERS = 40
_END_MARGIN = 1e-7  # in log(alpha - 1): closer to an end of the range counts as the end
# Per step, K below this is recomputed by the compensated sum (``_small_log_mgf``); above it the
# log-sum-exp of ``jaxacct.cgf`` is already accurate to a few ulps relative.
_SMALL_K = 1.0


# ----------------------------------------------------------------------------------------------
# The cumulant generating function, with full relative precision when it is small


def _expm1_minus_x(x):
  """(e^{-a} (e^x - 1 - x), a), a = max(x, 0): the scaled factor lies in [0, 1) for x > 0.

  A Taylor series below |x| = 0.5, where expm1(x) - x would cancel.
  """
  def series(x):
    acc = jnp.ones_like(x)
    for k in range(16, 2, -1):
      acc = 1.0 + acc * x / k
    return 0.5 * x * x * acc

  def direct(x):
    # e^{-x} (e^x - 1 - x) = -expm1(-x) - x e^{-x} for x > 0 (never overflows)
    return safe_where(x > 0.0, lambda y: -jnp.expm1(-y) - y * jnp.exp(-y),
                      lambda y: jnp.expm1(y) - y, x)

  small = jnp.abs(x) < 0.5
  scaled = safe_where(small, series, direct, x)
  return scaled, jnp.where(small, 0.0, jnp.maximum(x, 0.0))


def _small_log_mgf(log_weights, losses, t):
  """K(t) = log1p(E_P[g(L)]) with g(l) = (e^{tl} - 1 - tl) + t (e^{-l} - 1 + l) >= 0.

  E_P[1] = E_P[e^{-L}] = 1 when neither P nor Q has an atom at infinite loss (``check_cgf`` and
  the worse-direction rule make K infinite otherwise), so E_P[e^{tL}] - 1 = E_P[g(L)] exactly.
  Every term is non-negative and O(L^2): a K of 1e-8 (DP-SGD with q = 1e-3, sigma = 10) keeps
  full relative precision, where log E_P[e^{tL}] of the quadrature loses ~1e-14 / K (each weight
  is the exp of a log weight, rounded). Only used when K < ``_SMALL_K``, so nothing overflows.
  """
  s1, a1 = _expm1_minus_x(t * losses)
  s2, a2 = _expm1_minus_x(-losses)
  grow = lambda a: jnp.exp(jnp.minimum(log_weights + a, 700.0))
  return jnp.log1p(jnp.sum(grow(a1) * s1 + t * grow(a2) * s2))


def _step_cgf(mech, t, add):
  """(K, K', K'') of one step of ``mech`` at tilt t, direction ``add``."""
  c = cgf.step_cumulants(mech, t, add)
  if isinstance(mech, models.Gaussian):  # closed form, exact already
    return c[:3]
  small = _small_log_mgf(*mech.loss_nodes(t, add), t)
  k = jnp.where(c[0] < _SMALL_K, small, c[0])  # c[0] is +inf for an atom at L = +inf
  return jnp.stack([k, c[1], c[2]])


def _composition_cgf(composition: Composition, t, precise=False):
  """(K, K', K'') at tilt t of the direction with the larger K (per tilt).

  Both directions run as one vmapped program (the models take a traced ``add``): half the
  compiled code. ``precise`` adds the small-K refinement of ``_step_cgf``, which only ``rdp``
  needs: the conversions use K through K - log delta or exp(K), where an absolute error of
  1e-16 in K is harmless, and they compile much faster without it.
  """
  def direction(add):
    def step(mech):
      return _step_cgf(mech, t, add) if precise else cgf.step_cumulants(mech, t, add)[:3]
    return counted_sum(step, composition)  # (one traced step per kind of entry)

  if composition.symmetric:
    return direction(False)
  both = jax.vmap(direction)(jnp.array([False, True]))
  return jnp.where(both[1, 0] > both[0, 0], both[1], both[0])


# ----------------------------------------------------------------------------------------------
# Optimal order


def _optimal_tilt(composition, condition):
  """The root in [MIN_TILT, MAX_ORDER - 1] of the increasing ``condition(t, (K, K', K''))``,
  which returns (value, d value / d t); the nearest end of the range when there is none inside.

  Solved in s = log t over the whole range by one loop (the CGF is compiled once). Implicit
  gradients inside the range; none at an end (there the tilt is a constant).
  """
  lo, hi = np.log(MIN_TILT), np.log(MAX_ORDER - 1.0)

  def value_and_slope(s):
    t = jnp.exp(s)
    value, slope = condition(t, _composition_cgf(composition, t))
    return value, slope * t

  def solve(_, __):
    def decreasing(s):  # newton_in_bracket wants a decreasing function
      value, slope = value_and_slope(s)
      return -value, -slope
    return newton_in_bracket(decreasing, jnp.asarray(lo), jnp.asarray(hi), jnp.asarray(_START),
                             _NEWTON_ITERS)[0]

  residual = lambda s: value_and_slope(s)[0]
  s = implicit_root(residual, solve, jnp.asarray(_START))
  inside = (s > lo + _END_MARGIN) & (s < hi - _END_MARGIN)
  return jnp.exp(jnp.where(inside, s, jax.lax.stop_gradient(s)))


def _epsilon_condition(log_delta):
  def condition(t, c):
    k, k1, k2 = c[0], c[1], c[2]
    return t * k1 - k + jnp.log1p(t) + log_delta, t * k2 + 1.0 / (1.0 + t)
  return condition


def _delta_condition(epsilon):
  def condition(t, c):
    k1, k2 = c[1], c[2]
    return k1 - epsilon - jnp.log1p(1.0 / t), k2 + 1.0 / (t * (1.0 + t))
  return condition


def _epsilon_at(k, t, log_delta):
  """The conversion's epsilon at order 1 + t (``k`` = K(t) of the composition; host or traced)."""
  xp = array_namespace(k, t, log_delta)
  return (k - log_delta - xp.log1p(t)) / t - xp.log1p(1.0 / t)


def _log_delta_at(k, t, epsilon):
  """The conversion's log delta at order 1 + t (host or traced)."""
  xp = array_namespace(k, t, epsilon)
  return k - epsilon * t - t * xp.log1p(1.0 / t) - xp.log1p(t)


def _bounds(composition, value, status=0):
  """Upper = estimate = ``value`` (+inf where it is nan); no lower bound. A composition of no
  steps is exactly 0."""
  upper = jnp.where(jnp.isnan(value), jnp.inf, value)
  status = jnp.full(jnp.shape(upper), LOWER_VACUOUS, jnp.int32) | status
  return zero_if(total_count(composition) == 0,
                 Bounds(jnp.full_like(upper, jnp.nan), upper, upper, status))


def _rdp_single(composition, order):
  t = order - 1.0
  return _composition_cgf(composition, t, precise=True)[0] / t


def epsilon_at_log_delta(composition, log_delta):
  """The conversion's epsilon at delta = e^{log_delta}, one setting, traced (any log_delta, even
  below float64's range: the group-privacy lemma's search reads it there)."""
  t = _optimal_tilt(composition, _epsilon_condition(log_delta))
  eps = _epsilon_at(_composition_cgf(composition, t)[0], t, log_delta)
  return jnp.maximum(eps, 0.0)  # (a negative value means delta(0) <= delta already)


def _epsilon_single(composition, delta):
  return _bounds(composition, epsilon_at_log_delta(composition, jnp.log(delta)))


def _delta_single(composition, epsilon):
  t = _optimal_tilt(composition, _delta_condition(epsilon))
  log_delta = jnp.minimum(_log_delta_at(_composition_cgf(composition, t)[0], t, epsilon), 0.0)
  return _bounds(composition, exp_upper(log_delta), floored_status(log_delta, UPPER_FLOORED))


# ----------------------------------------------------------------------------------------------
# Front door: input checks, batching, compilation


_rdp_run = vectorised(_rdp_single, 256)
_epsilon_run = blockwise(_epsilon_single, 16)
_delta_run = blockwise(_delta_single, 16)


@float64
def rdp(composition, orders) -> jax.Array:
  """Renyi DP of a composition at ``orders`` alpha in (1, ``MAX_ORDER``] (worse direction).

  Args:
    composition: a ``Composition``, a model, or a list of (model, count) entries (leaves may be
      arrays; real counts allowed). Models with an infinite CGF ((epsilon, delta)-DP with
      delta > 0) are refused.
    orders: Renyi orders, broadcast with the composition's leaves.
  Returns:
    float64 array of RDP(alpha) = K(alpha - 1)/(alpha - 1), shaped like the broadcast inputs.
  Inputs are checked when concrete (ValueError naming the parameter), not under tracing.
  """
  composition = cgf.checked(composition)
  orders = as_leaf(orders)
  check_range("orders", orders, 1.0, MAX_ORDER, high_open=False)
  return _rdp_run(composition, orders)


@float64
def epsilon(composition, delta) -> Bounds:
  """epsilon(delta) by the RDP conversion, minimised over continuous orders in [1.001, 10^4].

  ``upper`` = ``estimate`` is a valid guarantee whenever the CGF is exact (the models' quadratures
  are accurate to ~1e-9 relative or better); ``lower`` is nan (status ``LOWER_VACUOUS``): RDP gives
  no lower bound. ``delta`` in (0, 1) broadcasts with the composition's leaves.
  """
  composition = cgf.checked(composition)
  delta = as_leaf(delta)
  check_delta(delta)
  return answer(_epsilon_run, composition, delta)


@float64
def delta(composition, epsilon) -> Bounds:
  """delta(epsilon) by the matching RDP conversion, minimised over orders in [1.001, 10^4].

  Conventions as in ``epsilon``; ``epsilon`` >= 0 broadcasts with the composition's leaves.
  """
  composition = cgf.checked(composition)
  epsilon = as_leaf(epsilon)
  check_epsilon(epsilon)
  return answer(_delta_run, composition, epsilon)


# ----------------------------------------------------------------------------------------------
# DP-SGD on the host at integer orders: a calibration's starting value, nothing compiled


# Integer orders 2...32, then ~12% apart up to 1024 (a step's binomial sum has order + 1 terms).
HOST_ORDERS = np.unique(np.concatenate([np.arange(2, 33),
                                        np.round(np.geomspace(32, 1024, 31))])).astype(int)
"""The integer Renyi orders ``host_dpsgd_epsilon`` and ``host_dpsgd_delta`` minimise over."""


def host_dpsgd_rdp(noise_multiplier, sampling_rate, orders=HOST_ORDERS) -> np.ndarray:
  """RDP of one add/remove DP-SGD step (the Poisson-subsampled Gaussian, sensitivity 1) at the
  integer ``orders``, on the host (numpy, nothing compiled): [settings, orders]. At an integer
  order a the divergence is exact, log(sum_k C(a, k) (1-q)^(a-k) q^k e^{(k^2-k)/(2 s^2)})/(a-1)
  (Mironov, Talwar and Zhang 2019; the other direction is no larger), summed in log space;
  its absolute round-off (~1e-16 per step) makes it a starting value, not a certified bound
  where a step's divergence is that small (``rdp`` is the accountant). (libm's lgamma and
  numpy's sums, not scipy's: a first calibration then imports no scipy, ~0.2 s.)"""
  if np.any(np.asarray(orders) != np.round(orders)) or np.any(np.asarray(orders) < 2):
    raise ValueError(f"host_dpsgd_rdp takes integer orders >= 2, got {orders!r}")
  sigma = np.atleast_1d(np.asarray(noise_multiplier, np.float64))[:, None, None]
  q = np.atleast_1d(np.asarray(sampling_rate, np.float64))[:, None, None]
  largest = int(np.max(orders))
  whole = np.asarray(orders, np.int64)[None, :, None]
  a = whole.astype(np.float64)
  k = np.arange(largest + 1, dtype=np.float64)[None, None, :]
  inside = k <= a
  log_factorial = np.array([math.lgamma(n + 1.0) for n in range(largest + 1)])
  with np.errstate(divide="ignore", invalid="ignore"):  # (q = 1: only k = a weighs)
    log_binomial = (log_factorial[whole] - log_factorial[None, None, :]
                    - log_factorial[np.maximum(whole - np.arange(largest + 1), 0)])
    terms = (log_binomial + np.where(k < a, (a - k) * np.log1p(-q), 0.0)
             + np.where(k > 0.0, k * np.log(q), 0.0) + (k * k - k) / (2.0 * sigma * sigma))
  log_moment = host_logsumexp(np.where(inside, terms, -np.inf), axis=-1)
  return np.maximum(log_moment, 0.0) / (a[..., 0] - 1.0)


def _host_cgf(noise_multiplier, sampling_rate, steps):
  """(K(a - 1) of ``steps`` DP-SGD steps at each of ``HOST_ORDERS`` [settings, orders], a - 1)."""
  t = HOST_ORDERS.astype(np.float64) - 1.0
  steps = np.atleast_1d(np.asarray(steps, np.float64))[:, None]
  return steps * t * host_dpsgd_rdp(noise_multiplier, sampling_rate), t


def host_dpsgd_epsilon(noise_multiplier, sampling_rate, steps, delta) -> np.ndarray:
  """epsilon(delta) of ``steps`` add/remove DP-SGD steps by ``epsilon``'s conversion at the
  integer ``HOST_ORDERS`` (not its continuous orders: a little larger), on the host, arrays
  elementwise: a calibration's starting value (``host_dpsgd_rdp``)."""
  k, t = _host_cgf(noise_multiplier, sampling_rate, steps)
  log_delta = np.log(np.atleast_1d(np.asarray(delta, np.float64)))[:, None]
  return np.maximum(np.min(_epsilon_at(k, t, log_delta), axis=-1), 0.0)


def host_dpsgd_delta(noise_multiplier, sampling_rate, steps, epsilon) -> np.ndarray:
  """delta(epsilon) of ``steps`` add/remove DP-SGD steps by ``delta``'s conversion at the
  integer ``HOST_ORDERS``, on the host, arrays elementwise (as ``host_dpsgd_epsilon``)."""
  k, t = _host_cgf(noise_multiplier, sampling_rate, steps)
  epsilon = np.atleast_1d(np.asarray(epsilon, np.float64))[:, None]
  return np.exp(np.minimum(np.min(_log_delta_at(k, t, epsilon), axis=-1), 0.0))
