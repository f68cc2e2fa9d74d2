"""The mixture-of-Gaussians mechanism: N(0, sigma^2) against sum_i p_i N(c_i, sigma^2).

One step of DP-SGD against a group of k examples is dominated by such a mixture with a random
sensitivity c (Ganesh 2024, "Tight group-level DP guarantees for DP-SGD with sampling via
mixture of Gaussians mechanisms", arXiv 2401.10294, Def. 2.8, Thms 3.1 and 3.3); the
subsampled Gaussian is the two-atom case c in {0, 1}. The sensitivities and probabilities are
*event* fields: each setting holds a vector of them (a batch of settings adds leading axes).

With u = x / sigma and mu_i = c_i / sigma, the remove pair is P = sum_i p_i N(mu_i, 1) against
Q = N(0, 1) and its privacy loss is f(u) = log sum_i p_i exp(mu_i u - mu_i^2 / 2): a log-sum-exp
of affine functions, so convex, and increasing when some mu_i > 0. Its range is (log p_0, inf),
p_0 the mass of the zero sensitivities. The add pair is P = N(0, 1) against the mixture, with
loss -f(u). Loss CDFs need u* = f^{-1}(l), found elementwise by the solver module (implicit
gradients in JAX, the same iteration on the host for the planner).
"""

from __future__ import annotations

import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxacct._batch import event_field
from jaxacct._inputs import check_range
from jaxacct._numerics import F64_EPS, LOSS_BIG, standard_normal_nodes
from jaxacct._solver import bisect, implicit_root, newton_in_bracket
from jaxacct.models import _REACH, PrivacyLoss, _clamp, _model, _normal_cdf_sf

_INVERSE_STEPS = 60  # safeguarded Newton steps of f^{-1} (from the right: ~6-10 are used)


@_model
class MixtureOfGaussians(PrivacyLoss):
  """Mixture-of-Gaussians mechanism: output N(0, sigma^2) without the user (group), and
  sum_i p_i N(c_i, sigma^2) with it (remove pair; the add pair is its mirror).

  ``sensitivities`` c_i >= 0 and ``probabilities`` p_i (summing to 1) hold one vector per
  setting (their last axis); ``sigma`` is a scalar per setting. At least one positive
  sensitivity must have positive probability.
  """

  sigma: jax.Array
  sensitivities: jax.Array = event_field()
  probabilities: jax.Array = event_field()

  symmetric: ClassVar[bool] = False

  def check(self):
    check_range("sigma", self.sigma, 0.0, math.inf)
    check_range("sensitivities", self.sensitivities, 0.0, math.inf, low_open=False)
    check_range("probabilities", self.probabilities, 0.0, 1.0, low_open=False, high_open=False)
    if any(isinstance(v, jax.core.Tracer) for v in (self.sensitivities, self.probabilities)):
      return
    c, p = np.asarray(self.sensitivities, float), np.asarray(self.probabilities, float)
    if c.ndim < 1 or p.ndim < 1 or c.shape[-1] != p.shape[-1]:
      raise ValueError("sensitivities and probabilities must be vectors of one length (their "
                       f"last axis); got shapes {c.shape} and {p.shape}")
    total = np.sum(p, axis=-1)
    if not np.all(np.abs(total - 1.0) <= 1e-9 * p.shape[-1]):
      raise ValueError(f"probabilities must sum to 1 (over their last axis); got sums {total}")
    c, p = np.broadcast_arrays(c, p)
    if not np.all(np.any((c > 0.0) & (p > 0.0), axis=-1)):
      raise ValueError("sensitivities: at least one positive sensitivity must have positive "
                       "probability")

  # -- the loss f(u) and its inverse --------------------------------------------------------

  def _mus(self, xp):
    return xp.asarray(self.sensitivities) / xp.asarray(self.sigma)[..., None]

  def _log_p(self, xp):
    """log p_i, -inf where p_i = 0 (with a finite gradient)."""
    p = xp.asarray(self.probabilities)
    return xp.where(p > 0.0, xp.log(xp.where(p > 0.0, p, 1.0)), -xp.inf)

  def _loss_and_slope(self, u, xp):
    """(f(u), f'(u)) for an array u of standardised outputs (the atoms on a new last axis)."""
    mu, log_p = self._mus(xp), self._log_p(xp)
    terms = log_p + mu * u[..., None] - 0.5 * mu * mu
    top = xp.max(terms, axis=-1, keepdims=True)
    weights = xp.exp(terms - top)
    total = xp.sum(weights, axis=-1)
    return top[..., 0] + xp.log(total), xp.sum(weights * mu, axis=-1) / total

  def _inverse(self, loss, xp):
    """u* with f(u*) = loss (elementwise), and where the loss lies in f's range (else u* is
    -LOSS_BIG: every CDF there is that of u = -inf)."""
    mu, log_p = self._mus(xp), self._log_p(xp)
    p = xp.asarray(self.probabilities)
    p0 = xp.sum(xp.where(mu == 0.0, p, 0.0))
    support = xp.exp(xp.minimum(loss, 700.0)) > p0
    target = xp.where(support, loss, 0.0)  # (a placeholder inside the range off the support)
    # Brackets: f(u) >= log p_m + mu_m u - mu_m^2 / 2 for the largest mu_m with p_m > 0 gives
    # f(hi) >= l; for l < 0, f(u) <= log(p0 + (1 - p0) e^{mu_min u}) (u <= 0, mu_min the smallest
    # positive mu with p > 0) gives f(lo) <= l; for l >= 0, f(0) <= 0 <= l.
    positive = (mu > 0.0) & (p > 0.0)
    top = xp.argmax(xp.where(positive, mu, -1.0))
    mu_top, log_p_top = mu[top], log_p[top]
    mu_min = xp.min(xp.where(positive, mu, xp.inf))
    hi = (target - log_p_top) / mu_top + 0.5 * mu_top
    rise = xp.maximum(xp.exp(xp.minimum(target, 0.0)) - p0, 1e-300) / (1.0 - p0)
    lo = xp.where(target >= 0.0, 0.0, xp.log(xp.minimum(rise, 1.0)) / mu_min)
    lo = xp.minimum(lo, hi)
    # Start: f(u) >= log(p0 + p_i e^{mu_i u - mu_i^2/2}) for each positive atom i, so each such
    # two-term inverse lies right of u*; from the smallest, Newton on the convex f converges
    # monotonically in a few steps (from hi it crawls where f is flat).
    log_excess = target + xp.log1p(-xp.minimum(p0 * xp.exp(-target), 1.0 - F64_EPS))
    two_term = xp.where(positive, (log_excess[..., None] - xp.where(positive, log_p, 0.0))
                        / xp.where(positive, mu, 1.0) + 0.5 * mu, xp.inf)
    start = xp.clip(xp.min(two_term, axis=-1), lo, hi)
    tol = 4.0 * F64_EPS * (1.0 + xp.maximum(xp.abs(lo), xp.abs(hi)))

    # f's round-off: a residual below it is a root (where f is flat, its noise over the slope
    # exceeds tol and the iteration would never settle).
    noise = 8.0 * F64_EPS * (1.0 + xp.abs(target))

    def value_and_slope(u):  # decreasing in u
      value, slope = self._loss_and_slope(u, xp)
      residual = target - value
      return xp.where(xp.abs(residual) <= noise, 0.0, residual), -slope

    if xp is np:
      u = newton_in_bracket(value_and_slope, lo, hi, start, _INVERSE_STEPS, tol)[0]
    else:
      lo, hi, tol, start = (jax.lax.stop_gradient(v) for v in (lo, hi, tol, start))

      def solve(_, guess):  # (no gradient flows through the iterations)
        return newton_in_bracket(value_and_slope, lo, hi, guess, _INVERSE_STEPS, tol)[0]

      u = implicit_root(lambda u: target - self._loss_and_slope(u, jnp)[0], solve, start)
    return xp.where(support, u, -LOSS_BIG), support

  # -- the model interface ------------------------------------------------------------------

  def cdf_sf(self, loss, add=False):
    xp = self._xp(loss, add)
    loss = _clamp(loss)
    # remove: L = f(U), U ~ mixture under P, N(0, 1) under Q; add: L = -f(U), U ~ N(0, 1) under
    # P, mixture under Q, so L <= l <=> U >= f^{-1}(-l) and the roles of CDF and SF swap.
    u, _ = self._inverse(xp.where(add, -loss, loss), xp)
    mu, p = self._mus(xp), xp.asarray(self.probabilities)
    mix_cdf, mix_sf = (xp.sum(p * v, axis=-1) for v in _normal_cdf_sf(u[..., None] - mu))
    normal_cdf, normal_sf = _normal_cdf_sf(u)
    remove = (mix_cdf, mix_sf, normal_cdf, normal_sf)
    added = (normal_sf, normal_cdf, mix_sf, mix_cdf)
    return tuple(xp.where(add, a, r) for r, a in zip(remove, added))

  def loss_range(self, log_tail, add=False):
    xp = self._xp(log_tail, add)
    z = xp.sqrt(-2.0 * log_tail)
    # The mixture's mass above u is <= sum_i p_i min(1, e^{-(u - mu_i)^2 / 2}) (u >= mu_i): above
    # mu_i + z_i with p_i e^{-z_i^2 / 2} = tail / K for each atom of p_i K > tail, at most
    # tail / K from each of those and at most p_i <= tail / K from each rare atom (p_i K <= tail)
    # wherever u lies: <= tail in all. So a rare atom (a large group's top sensitivities: at
    # k = 50, q = 0.01 those above ~14) leaves the range altogether, which keeps the grid short.
    # (Only the grid's placement reads this: the mass above it goes to +inf, pessimistic.)
    log_p = self._log_p(xp)
    atoms = log_p.shape[-1]
    excess = log_p + np.log(atoms) - log_tail  # (-inf for an atom of no mass)
    z_atom = xp.sqrt(2.0 * xp.maximum(excess, 0.0))
    top = xp.max(xp.where(excess > 0.0, self._mus(xp) + z_atom, 0.0))
    low, high = (self._loss_and_slope(xp.asarray(v), xp)[0] for v in (-z, xp.maximum(top, z)))
    return xp.where(add, -high, low), xp.where(add, -low, high)

  def loss_nodes(self, t, add=False, t_high=None, panels=None):
    # Remove: e^{tL} dP = phi(u) e^{(1 + t) f(u)} du peaks in [0, (1 + t) mu_max]; P's bulk is
    # in [0, mu_max], Q's at 0. Add: e^{tL} dP = phi(u) e^{-t f(u)} is log-concave with its mode
    # at the root of u + t f'(u) = 0, in [-t mu_max, 0] for t >= 0, furthest left at t_high.
    t_high = t if t_high is None else t_high
    mu_top = jnp.max(jnp.where(jnp.asarray(self.probabilities) > 0.0, self._mus(jnp), 0.0))
    t_up = jnp.maximum(jax.lax.stop_gradient(t_high), 0.0)
    mode = bisect(lambda u: u + t_up * self._loss_and_slope(u, jnp)[1],
                  -t_up * mu_top - 1.0, jnp.zeros(()), 40)[0]
    left = jnp.where(add, jnp.minimum(mode, 0.0), 0.0) - _REACH
    right = jnp.where(add, mu_top, (1.0 + t_up) * mu_top) + _REACH
    log_w, u = standard_normal_nodes(jax.lax.stop_gradient(left),
                                     jax.lax.stop_gradient(right), panels)
    f = self._loss_and_slope(u, jnp)[0]
    return jnp.where(add, log_w, log_w + f), jnp.where(add, -f, f)
