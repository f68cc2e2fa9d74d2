"""Gaussian differential privacy (mu-GDP): exact conversions, composition and the CLT mu.

A mechanism is mu-GDP when its privacy curve is no worse than that of N(mu, 1) against N(0, 1):
for every eps >= 0 it is (eps, delta_mu(eps))-DP with (Dong, Roth and Su 2022, Cor. 2.13)

    delta_mu(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2).

The curve is exact for composed Gaussian mechanisms (mu = sqrt(sum_i T_i (s_i / sigma_i)^2)), so
for them ``epsilon``/``delta`` below are exact, not bounds. For Poisson-subsampled Gaussian steps
(DP-SGD) the composition is only asymptotically Gaussian: Bu et al.'s (2020) central-limit mu
q sqrt(T (e^{(s/sigma)^2} - 1)) is an *estimate* that can under-report epsilon (Gopi, Lee and
Wutschitz 2021, Sec. 1 and Fig. 1), so those results carry no certified bound and the status bit
``APPROXIMATION``.

Numerics. With a = -eps/mu + mu/2, b = a - mu and the inverse Mills ratio lam(x) = phi(x)/Phi(x),
e^eps phi(b) = phi(a) gives delta = Phi(a) (1 - e^r) with r = -log(1 + (lam(b) - lam(a))/lam(a)),
which never forms e^eps or the difference Phi(a) - e^eps Phi(b) (that cancels for large eps/mu).
lam(b) - lam(a) is computed without cancellation: as mu + kappa(b) - kappa(a), where the excess
kappa = lam + x comes from Laplace's continued fraction (small when a << 0), or, for small mu, as
the integral of -lam' = lam kappa over [b, a] (Gauss-Legendre). log delta is then accurate to
~2e-15 (1 + |log delta|) (measured against 50-digit mpmath): delta keeps nearly full relative
accuracy down to 1e-300, and ``log_delta_of_mu`` goes on where delta underflows. Derivatives are the
closed forms d delta/d mu = phi(a), d delta/d eps = -e^eps Phi(b) (a custom JVP); the inverses
solve for a root with ``implicit_root`` in the variable sqrt(-2 log delta), nearly affine in eps.

Every public function checks concrete inputs (``ValueError`` naming the parameter) and runs in
float64 under a scoped ``enable_x64``; under jit/vmap/grad the inputs are not checked.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import erf, erfc, ndtr

from jaxacct import results
from jaxacct._batch import answer, blockwise
from jaxacct._inputs import check_delta, check_epsilon, check_range
from jaxacct._numerics import (F64_EPS, as_leaf, exp_upper, fast_jit, float64, floored_status,
                               host_log_ndtr, scoped_gradients)
from jaxacct._solver import implicit_root, newton_in_bracket
from jaxacct.composition import Composition, checked, total_count
from jaxacct.models import Gaussian, PoissonSampled
from jaxacct.results import APPROXIMATION, UPPER_FLOORED, Bounds, zero_if

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
# Below -_CF_FROM the inverse Mills ratio comes from the continued fraction (_CF_TERMS terms are
# exact to ~1e-16 there); above it from phi / Phi directly (at most ~3.5 units of cancellation).
_CF_FROM = 3.5
_CF_TERMS = 50
# Below this mu, lam(b) - lam(a) is integrated (6-point Gauss-Legendre) rather than differenced.
_SMALL_MU = 0.25
_GL_X, _GL_W = np.polynomial.legendre.leggauss(6)
# Safeguarded Newton steps of the inversions (the residual is nearly affine: <= 6 are used).
_NEWTON_STEPS = 40
# Claimed worst absolute error of the computed log delta, in units of F64_EPS * (1 + |log delta|)
# (measured worst over mu in [1e-5, 30], eps in [0, 300] against 60-digit mpmath: 9 units).
_LOG_DELTA_ULPS = 64.0


# ----------------------------------------------------------------------------------------------
# The exact curve


def _inverse_mills(x):
  """(lam(x), kappa(x)): lam = phi(x)/Phi(x) and its excess kappa = lam + x (any real x).

  Laplace's continued fraction kappa(x) = 1/(u + 2/(u + 3/(u + ...))), u = -x, for u >= _CF_FROM;
  phi / Phi directly above (where lam <= 4, so kappa = lam - u keeps its absolute accuracy).
  """
  u = -x
  uc = jnp.maximum(u, _CF_FROM)
  tail = jax.lax.fori_loop(0, _CF_TERMS,
                           lambda i, t: (_CF_TERMS - i).astype(uc.dtype) / (uc + t),
                           jnp.zeros_like(uc))
  ud = jnp.minimum(u, _CF_FROM)
  lam_direct = jnp.exp(-0.5 * ud * ud - _LOG_SQRT_2PI) / ndtr(-ud)
  far = u >= _CF_FROM
  kappa = jnp.where(far, tail, lam_direct - ud)
  lam = jnp.where(far, uc + tail, lam_direct)
  return lam, kappa


def _log1p(x):
  """log(1 + x) to ~1 ulp. XLA's float64 log1p on CPU errs by up to 2e-14 relative near
  x = -0.4; below -0.3, log(1 + x) is as accurate (1 + x rounds by < 2^-54 and the log is not
  small)."""
  far = x < -0.3
  return jnp.where(far, jnp.log(1.0 + x), jnp.log1p(jnp.where(far, 0.0, x)))


def _log1mexp(r):
  """log(1 - e^r) for r <= 0, accurate on both sides of -log 2."""
  near = r > -math.log(2.0)
  return jnp.where(near, jnp.log(-jnp.expm1(jnp.where(near, r, -1.0))),
                   _log1p(-jnp.exp(jnp.where(near, -1.0, r))))


def _curve_parts(mu, eps):
  """(log delta, r, log lam(a)) of the mu-GDP curve at eps (mu > 0, eps >= 0).

  delta = Phi(a) (1 - e^r), r = -log(1 + (lam(b) - lam(a))/lam(a)); see the module docstring.
  Every inverse Mills ratio needed is computed in one stacked call (one program, fast compile).
  """
  mu, eps = jnp.broadcast_arrays(mu, eps)
  mid = -eps / mu
  a = mid + 0.5 * mu
  b = mid - 0.5 * mu  # < 0 for every eps >= 0
  small = mu < _SMALL_MU
  # For small mu, lam(b) - lam(a) = int_b^a lam kappa dx (lam' = -lam kappa) by Gauss-Legendre:
  # differencing two O(1) values would lose log10(1/mu) digits. The interval is given by its
  # midpoint and half-width (a - b in floating point is not mu).
  half = 0.5 * jnp.where(small, mu, _SMALL_MU)
  nodes = mid[..., None] + half[..., None] * _GL_X
  lam, kappa = _inverse_mills(jnp.concatenate([jnp.stack([a, b, -a], -1), nodes], -1))
  lam_a, lam_b, lam_minus_a = lam[..., 0], lam[..., 1], lam[..., 2]
  integral = half * jnp.sum(_GL_W * lam[..., 3:] * kappa[..., 3:], axis=-1)
  # Otherwise lam(b) - lam(a) = mu + kappa(b) - kappa(a): no cancellation when a << 0.
  gap = jnp.where(small, integral, mu + kappa[..., 1] - kappa[..., 0])
  r_ratio = -_log1p(gap / lam_a)
  log_cdf_a_neg = -0.5 * a * a - _LOG_SQRT_2PI - jnp.log(lam_a)
  # a >= 0 (and mu >= _SMALL_MU): Phi(a) >= 1/2, r = eps + log Phi(b) - log Phi(a) is not small.
  ap = jnp.maximum(a, 0.0)
  log_cdf_a_pos = _log1p(-jnp.exp(-0.5 * ap * ap - _LOG_SQRT_2PI) / lam_minus_a)
  log_cdf_b = -0.5 * b * b - _LOG_SQRT_2PI - jnp.log(lam_b)
  r_pos = eps + log_cdf_b - log_cdf_a_pos
  neg = a < 0.0
  r = jnp.minimum(jnp.where(neg | small, r_ratio, r_pos), 0.0)
  log_cdf_a = jnp.where(neg, log_cdf_a_neg, log_cdf_a_pos)
  log_lam_a = jnp.where(neg, jnp.log(lam_a), -0.5 * ap * ap - _LOG_SQRT_2PI - log_cdf_a_pos)
  return log_cdf_a + _log1mexp(r), r, log_lam_a


def _slopes(r, log_lam_a):
  """d log delta / d mu = lam(a)/(1 - e^r) and d log delta / d eps = -1/(e^{-r} - 1)."""
  return jnp.exp(log_lam_a - _log1mexp(r)), -1.0 / jnp.expm1(-r)


@jax.custom_jvp
def _log_delta(mu, eps):
  return _curve_parts(mu, eps)[0]


@_log_delta.defjvp
def _log_delta_jvp(primals, tangents):
  mu, eps = primals
  d_mu, d_eps = tangents
  value, r, log_lam_a = _curve_parts(mu, eps)
  s_mu, s_eps = _slopes(r, log_lam_a)
  return value, s_mu * d_mu + s_eps * d_eps


def _log_delta_at_zero(mu):
  """log delta_mu(0) = log(2 Phi(mu/2) - 1) = log erf(mu / (2 sqrt 2))."""
  y = mu / (2.0 * math.sqrt(2.0))
  low = y < 1.0
  return jnp.where(low, jnp.log(erf(jnp.where(low, y, 1.0))),
                   _log1p(-erfc(jnp.where(low, 1.0, y))))


def _z(mu, eps):
  """sqrt(-2 log delta_mu(eps)): ~ eps/mu - mu/2 for large eps, the variable roots are solved in."""
  return jnp.sqrt(-2.0 * _log_delta(mu, eps))


# ----------------------------------------------------------------------------------------------
# Inversions (scalar cores; vectorised by the callers)


def _value_and_slope(fn):
  return lambda x: jax.jvp(fn, (x,), (jnp.ones_like(x),))


def _epsilon_scalar(mu, delta):
  """eps with delta_mu(eps) = delta; 0 when delta >= delta_mu(0) = 2 Phi(mu/2) - 1."""
  log_target = jnp.log(delta)
  log_at_zero = _log_delta_at_zero(mu)
  zero = log_target >= log_at_zero
  log_t = jnp.where(zero, log_at_zero - 1.0, log_target)  # a target the solver can meet
  z_t = jnp.sqrt(-2.0 * log_t)
  # delta_mu(eps) <= Phi(a) <= e^{-a^2/2}/2 for a <= 0: eps_hi has a = -u, delta(eps_hi) <= target.
  u = jnp.sqrt(jnp.maximum(-2.0 * (log_t + math.log(2.0)), 0.0))
  hi = mu * u + 0.5 * mu * mu

  def residual(eps):  # decreasing in eps
    return z_t - _z(mu, eps)

  def solve(fn, guess):
    x, *_ = newton_in_bracket(_value_and_slope(fn), jnp.zeros_like(guess), guess, guess,
                             iters=_NEWTON_STEPS)
    return x

  eps = implicit_root(residual, solve, hi)
  return jnp.where(zero, 0.0, eps)


def _mu_bracket(eps, delta):
  """(lo, hi) around the mu with delta_mu(eps) = delta."""
  z_t = jnp.sqrt(-2.0 * jnp.log(delta))
  # Lower bounds: delta <= Phi(a) <= e^{-a^2/2} forces a >= -z_t, i.e. mu^2/2 + z_t mu >= eps;
  # and delta_mu(eps) = int_0^mu phi(a(m)) dm <= mu phi(0).
  lo = jnp.maximum(2.0 * eps / (z_t + jnp.sqrt(z_t * z_t + 2.0 * eps)),
                   math.sqrt(2.0 * math.pi) * delta)
  # Upper bound: for a >= w >= 0, Phi(a) >= Phi(w) >= (1 + delta)/2 when w^2 = -2 log(1 - delta)
  # (Chernoff), and e^r = lam(a)/lam(b) <= lam(0)/(mu/2) <= 1.6/mu <= (1 - delta)/(1 + delta)
  # for mu >= 1.6 (1 + delta)/(1 - delta); then delta_mu(eps) >= delta. (a = w at mu = w +
  # sqrt(w^2 + 2 eps).)
  w = jnp.sqrt(-2.0 * _log1p(-delta))
  hi = jnp.maximum(w + jnp.sqrt(w * w + 2.0 * eps), 1.6 * (1.0 + delta) / (1.0 - delta))
  return lo, jnp.maximum(hi, lo)


def _mu_scalar(eps, delta):
  """mu with delta_mu(eps) = delta (delta_mu increases with mu, from 0 to 1)."""
  z_t = jnp.sqrt(-2.0 * jnp.log(delta))
  lo, hi = _mu_bracket(eps, delta)

  def residual(mu):  # decreasing in mu
    return _z(mu, eps) - z_t

  def solve(fn, guess):
    x, *_ = newton_in_bracket(_value_and_slope(fn), guess, hi, guess, iters=_NEWTON_STEPS)
    return x

  return implicit_root(residual, solve, lo)


def host_mu(epsilon, delta, iters=60):
  """mu with delta_mu(epsilon) = delta, on the host (numpy, no compilation; arrays
  elementwise): the solver's safeguarded Newton in log mu on [1e-6, 1e4], to ~1e-12 relative
  where delta_mu(epsilon) is resolved in float64. A starting value (the calibration's
  central-limit guess), not a bound and not differentiable: ``mu_of_eps_delta`` is the
  accountant's."""
  epsilon, delta = np.broadcast_arrays(np.asarray(epsilon, np.float64),
                                       np.asarray(delta, np.float64))

  def value_and_slope(log_mu):
    # f = log delta - log delta_mu(epsilon), decreasing in log mu; delta_mu = Phi(a) - e^eps Phi(b)
    # with a = -eps/mu + mu/2, b = a - mu, and d delta_mu / d mu = phi(a).
    mu = np.exp(log_mu)
    a = -epsilon / mu + 0.5 * mu
    log_a, log_b = host_log_ndtr(a), host_log_ndtr(a - mu)
    with np.errstate(divide="ignore", invalid="ignore"):
      log_curve = log_a + np.log1p(-np.exp(np.minimum(epsilon + log_b - log_a, 0.0)))
      log_phi = -0.5 * a * a - 0.5 * math.log(2.0 * math.pi)
      return np.log(delta) - log_curve, -mu * np.exp(log_phi - log_curve)

  lo, hi = np.full(epsilon.shape, math.log(1e-6)), np.full(epsilon.shape, math.log(1e4))
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # (inf/nan: bisected)
    log_mu, *_ = newton_in_bracket(value_and_slope, lo, hi, 0.5 * (lo + hi), iters=iters)
  return np.exp(log_mu)


def _delta_impl(mu, eps):
  return jnp.exp(_log_delta(mu, eps))


def _epsilon_impl(mu, delta):
  return jnp.vectorize(_epsilon_scalar)(mu, delta)


def _mu_impl(eps, delta):
  return jnp.vectorize(_mu_scalar)(eps, delta)


_delta_jit = fast_jit(scoped_gradients(_delta_impl))
_log_delta_jit = fast_jit(scoped_gradients(_log_delta))
_epsilon_jit = fast_jit(scoped_gradients(_epsilon_impl))
_mu_jit = fast_jit(scoped_gradients(_mu_impl))


def _f64(*xs):
  return tuple(jnp.asarray(x, jnp.float64) for x in xs)


def _check_mu(mu):
  check_range("mu", mu, 0.0, math.inf)


@float64
def delta_of_mu(mu, epsilon):
  """delta_mu(epsilon) of mu-GDP, exact (relative error < 2e-15 (1 - log delta); 0 below 1e-308).

  mu > 0 and epsilon >= 0, scalars or broadcastable arrays.
  """
  mu, epsilon = as_leaf(mu), as_leaf(epsilon)
  _check_mu(mu)
  check_epsilon(epsilon)
  return _delta_jit(*_f64(mu, epsilon))


@float64
def log_delta_of_mu(mu, epsilon):
  """log delta_mu(epsilon): the same curve where delta underflows float64 (e.g. mu = 0.2,
  epsilon = 60)."""
  mu, epsilon = as_leaf(mu), as_leaf(epsilon)
  _check_mu(mu)
  check_epsilon(epsilon)
  return _log_delta_jit(*_f64(mu, epsilon))


@float64
def epsilon_of_mu(mu, delta):
  """The exact epsilon(delta) of mu-GDP: the inverse of ``delta_of_mu`` in epsilon.

  0 when delta >= 2 Phi(mu/2) - 1. Gradients in mu and delta are implicit (closed form).
  """
  mu, delta = as_leaf(mu), as_leaf(delta)
  _check_mu(mu)
  check_delta(delta)
  return _epsilon_jit(*_f64(mu, delta))


@float64
def mu_of_eps_delta(epsilon, delta):
  """The mu whose GDP curve passes through (epsilon, delta): the inverse of ``delta_of_mu`` in
  mu. E.g. the GDP budget B that a filter must respect for a target (epsilon, delta).
  """
  epsilon, delta = as_leaf(epsilon), as_leaf(delta)
  check_epsilon(epsilon)
  check_delta(delta)
  return _mu_jit(*_f64(epsilon, delta))


# ----------------------------------------------------------------------------------------------
# Composition


def _safe_sqrt(x):
  """sqrt with a zero (not infinite) derivative at 0."""
  pos = x > 0.0
  return jnp.where(pos, jnp.sqrt(jnp.where(pos, x, 1.0)), 0.0)


def _compose_impl(mus, counts):
  return _safe_sqrt(jnp.sum(counts * mus * mus, axis=-1))


_compose_jit = fast_jit(scoped_gradients(_compose_impl))


@float64
def compose_mu(mus, counts=None):
  """GDP composition: sqrt(sum_i counts_i mu_i^2) over the last axis (counts default to 1).

  Counts may be real (d mu / d T is then available).
  """
  mus = as_leaf(mus)
  check_range("mus", mus, 0.0, math.inf, low_open=False)
  counts = jnp.ones_like(jnp.asarray(mus, jnp.float64)) if counts is None else as_leaf(counts)
  check_range("counts", counts, 0.0, math.inf, low_open=False)
  mus, counts = jnp.broadcast_arrays(*_f64(mus, counts))
  if mus.ndim == 0:
    mus, counts = mus[None], counts[None]
  return _compose_jit(mus, counts)


def _is_subsampled_gaussian(mech):
  return isinstance(mech, PoissonSampled) and isinstance(mech.base, Gaussian)


def _checked(composition) -> Composition:
  """The composition checked (models' parameters, real counts >= 0) and of GDP's models."""
  composition = checked(composition, integer_counts=False)
  for mech in composition.mechanisms:
    if not (isinstance(mech, Gaussian) or _is_subsampled_gaussian(mech)):
      raise ValueError("GDP accounting supports Gaussian and PoissonSampled(Gaussian) entries; "
                       f"got {type(mech).__name__}"
                       + (f"({type(mech.base).__name__})" if isinstance(mech, PoissonSampled)
                          else ""))
  return composition


def _is_approximate(composition: Composition) -> bool:
  """Static: True when any entry's mu is the central-limit estimate."""
  return any(isinstance(m, PoissonSampled) for m in composition.mechanisms)


def _mu_squared(composition: Composition):
  """sum_i T_i mu_i^2: (s/sigma)^2 per Gaussian step, Bu et al.'s q^2 (e^{(s/sigma)^2} - 1) per
  Poisson-subsampled one (the central-limit mu of q sqrt(T (e^{(s/sigma)^2} - 1)), Bu, Dong, Long
  and Su 2020)."""
  total = jnp.zeros(())
  for mech, count in zip(composition.mechanisms, composition.counts):
    if isinstance(mech, PoissonSampled):
      step = mech.rate ** 2 * jnp.expm1((mech.base.sensitivity / mech.base.sigma) ** 2)
    else:
      step = (mech.sensitivity / mech.sigma) ** 2
    total = total + count * step
  return total


def _status(approximate, shape):
  return jnp.full(shape, APPROXIMATION if approximate else results.OK, jnp.int32)


def _mu_of_impl(composition):
  mu = _safe_sqrt(_mu_squared(composition))
  return mu, _status(_is_approximate(composition), mu.shape)


_mu_of_jit = fast_jit(scoped_gradients(_mu_of_impl))


@float64
def mu_of(composition):
  """(mu, status) of a composition of Gaussian and Poisson-subsampled Gaussian entries.

  Exact for Gaussian entries (mu = sqrt(sum T s^2/sigma^2)); when any entry is subsampled, mu
  adds Bu et al.'s central-limit T q^2 (e^{(s/sigma)^2} - 1) for it and ``status`` is
  ``APPROXIMATION``: an estimate that can under-report epsilon, not a guarantee. Other models
  raise ``ValueError``. Counts may be real.
  """
  composition = _checked(composition)
  return _mu_of_jit(jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), composition))


# ----------------------------------------------------------------------------------------------
# Accountant front ends: Bounds


def _rounding(composition, mu, eps, log_delta):
  """(d eps, d log delta): how far rounding can move the computed point of the curve.

  Covers a relative error of mu of (8 + 2K) ulps for K entries (mu is computed from the inputs)
  and an absolute error of the computed log delta of _LOG_DELTA_ULPS ulps times
  (1 + |log delta|). Not differentiated (a rounding allowance).
  """
  mu_safe = jnp.where(mu > 0.0, mu, 1.0)
  _, r, log_lam_a = _curve_parts(mu_safe, eps)
  d_mu = (8.0 + 2.0 * len(composition.mechanisms)) * F64_EPS * mu_safe
  d_log = _LOG_DELTA_ULPS * F64_EPS * (1.0 + jnp.abs(log_delta))
  s_mu, s_eps = _slopes(r, log_lam_a)
  d_log_total = s_mu * d_mu + d_log  # log delta moves by at most this ...
  d_eps = d_log_total / -s_eps + 8.0 * F64_EPS * (1.0 + eps)  # ... so eps by this over |slope|
  return jax.lax.stop_gradient(d_eps), jax.lax.stop_gradient(d_log_total)


def _epsilon_bounds_impl(composition, delta):
  mu = _safe_sqrt(_mu_squared(composition))
  mu, delta = jnp.broadcast_arrays(mu, delta)
  positive = mu > 0.0
  eps = jnp.where(positive, _epsilon_impl(jnp.where(positive, mu, 1.0), delta), 0.0)
  status = _status(_is_approximate(composition), eps.shape)
  if _is_approximate(composition):
    nan = jnp.full_like(eps, jnp.nan)
    return Bounds(nan, eps, nan, status)
  d_eps, _ = _rounding(composition, mu, eps, jnp.log(delta))
  d_eps = jnp.where(positive, d_eps, 0.0)
  return Bounds(jnp.maximum(eps - d_eps, 0.0), eps, eps + d_eps, status)


def _no_steps(composition, bounds):
  return zero_if(total_count(composition) == 0, bounds)


def _delta_bounds_impl(composition, eps):
  mu = _safe_sqrt(_mu_squared(composition))
  mu, eps = jnp.broadcast_arrays(mu, eps)
  positive = mu > 0.0
  mu_safe = jnp.where(positive, mu, 1.0)
  log_delta = _log_delta(mu_safe, eps)
  delta = jnp.where(positive, jnp.exp(log_delta), 0.0)
  status = _status(_is_approximate(composition), delta.shape)
  if _is_approximate(composition):
    nan = jnp.full_like(delta, jnp.nan)
    return Bounds(nan, delta, nan, status)
  _, d_log = _rounding(composition, mu, eps, log_delta)
  upper = jnp.where(positive, jnp.minimum(exp_upper(log_delta + d_log), 1.0), 0.0)
  lower = jnp.where(positive, jnp.exp(log_delta - d_log), 0.0)
  status = status | jnp.where(positive, floored_status(log_delta + d_log, UPPER_FLOORED), 0)
  return Bounds(lower, delta, upper, status)


_epsilon_run = blockwise(lambda comp, d: _no_steps(comp, _epsilon_bounds_impl(comp, d)), 256)
_delta_run = blockwise(lambda comp, e: _no_steps(comp, _delta_bounds_impl(comp, e)), 256)


@float64
def epsilon(composition, delta) -> Bounds:
  """epsilon(delta) of a composition by GDP.

  Exact for Gaussian entries: lower = estimate = upper up to rounding, the bracket widened to
  cover it (status OK). With any Poisson-subsampled entry, the central-limit estimate only:
  lower = upper = nan and status ``APPROXIMATION`` (it can under-report epsilon; use the PLD
  accountant ``jaxacct.epsilon`` for a guarantee). Counts may be real. Batched over the
  broadcast of the inputs.
  """
  composition = _checked(composition)
  delta = as_leaf(delta)
  check_delta(delta)
  return answer(_epsilon_run, composition, delta)


@float64
def delta(composition, epsilon) -> Bounds:
  """delta(epsilon) of a composition by GDP; exact or central-limit as in ``epsilon``."""
  composition = _checked(composition)
  epsilon = as_leaf(epsilon)
  check_epsilon(epsilon)
  return answer(_delta_run, composition, epsilon)


__all__ = ["APPROXIMATION", "compose_mu", "delta", "delta_of_mu", "epsilon", "epsilon_of_mu",
           "log_delta_of_mu", "mu_of", "mu_of_eps_delta"]
