"""The Edgeworth accountant (Wang, Gao, Zhang, Shen and Su 2022, "Analytical Composition of
Differential Privacy via the Edgeworth Accountant", arXiv 2206.04236): delta(eps) and eps(delta)
in constant time in the number of steps, from the first five cumulants of the composed privacy
loss.

With L the composed loss, delta(eps) = P(L > eps) - e^eps Q(L > eps) (``models`` conventions).
Both tails are sums of independent steps, so each is approximated by an Edgeworth series in the
standardised sum, from the summed cumulants of L under P and under Q (``cgf.law_moments`` per
step, times its count: real counts are allowed, heterogeneous lists add up):

* estimate: the approximate Edgeworth accountant (AEA, Def. 4.1) of order 2 by default
  ("order1"/"order3" selectable); eps(delta) is the largest root of AEA(eps) = delta (scan +
  safeguarded Newton, implicit gradients).
* certified bounds (the paper's EEAI, Def. 4.2): only the first-order series has an explicit
  error bound, sup_x |F(x) - E_1(x)| <= Delta, the smallest of Berry-Esseen (Shevtsova's
  constants, plus the first-order term's own size) and the bounds of Derumigny, Girard &
  Guyonvarch (2024, Sankhya A 86), i.n.i.d. always and i.i.d. for a single repeated step
  (epsD = 0.1, as in the paper's Lemma 4.3).
  Then delta+(eps) = P~ + Delta_P - e^eps (Q~ - Delta_Q)_+ and delta-(eps) = P~ - Delta_P -
  e^eps (Q~ + Delta_Q). As the true delta is non-increasing, any eps with delta+(eps) <= target is
  an upper bound on eps(target) and any eps with delta-(eps) > target a lower bound: the first
  (last) crossing on the scan is refined and the returned point is one where the sign was
  evaluated. Where Delta is not below delta the bound is vacuous (upper +inf, lower nan) and the
  status says so; this is common: Delta shrinks only like 1/sqrt(steps).
* regime guard (status UNRELIABLE), per order: the series' terms beyond the estimate's order
  predict its epsilon error; the estimate is flagged where that exceeds 2e-4 x max(1, eps),
  where a tail's first correction exceeds half its Gaussian term at eps, where a composed law
  is strongly skewed, or where the AEA crosses delta more than once (``_unreliable``).

Both adjacency directions are computed for an asymmetric composition and the worse is reported.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.scipy.special import erf, erfc, log_ndtr

from jaxacct import results
from jaxacct._inputs import check_choice, check_delta, check_epsilon
from jaxacct._numerics import as_leaf, float64
from jaxacct._solver import root_in_bracket
from jaxacct.cgf import checked, law_moments, query
from jaxacct.composition import counted_sum, total_count
from jaxacct.results import Bounds

METHODS = ("order2", "order1", "order3")
"""The Edgeworth estimates (``method=``; the first is the default): the series to order 1, 2
or 3."""
_ORDER = {"order1": 1, "order2": 2, "order3": 3}
_SCAN = 512          # eps grid points over [0, mean + _SCAN_SDS sd] of the loss under P
_SCAN_SDS = 40.0
_EPS_CAP = 500.0
_ITERS = 32
# The absolute central moments come from the same quadrature as the cumulants, whose kink at the
# mean costs accuracy: E|d| is inflated by this relative slack (measured error <= 7e-6) and
# capped by sqrt(k2) (Jensen); E|d|^3 and E d^4 by 1e-6. The CDF bound gets an absolute slack for
# the quadrature error of the cumulants (relative <= 1e-9, which moves the series by far less).
_ABS1_SLACK = 1e-4
_ABS34_SLACK = 1e-6
_CDF_SLACK = 1e-9
# Regime guard for the estimate (see ``_unreliable``). On the 600 settings of
# benchmarks/flag_sweep.py no unflagged estimate was off by more than 1.85e-4 x max(1, eps)
# (README, "Accuracy").
_RELIABLE = 2e-4
_SERIES_SETTLED = 0.5
_RHO3_RELIABLE = 0.25

# Constants of Derumigny, Girard & Guyonvarch (2024): |Psi(t)| <= _C_PSI / (2 pi |t|), chi_1,
# and the free parameter eps_D of their skewed no-continuity bounds (0.1, as in the paper).
_C_PSI = 1.0253
_CHI1 = 0.09916191
_EPS_D = 0.1
# Berry-Esseen constants for identical (Shevtsova 2011) and non-identical (Shevtsova 2010) summands.
_BE_IID, _BE_INID = 0.4748, 0.5600
_PHI0 = 1.0 / math.sqrt(2.0 * math.pi)


# ---------------------------------------------------------------- the composed laws


def _laws_of(composition, add):
  """Summed moments of the composed loss under P and under Q (tilts 0 and -1 of the CGF): the
  cumulants k1..k5 and what the error bounds read (n, K3, Ktilde3, K4, lambda3 as Derumigny et
  al. define them: averages over steps standardised by the average variance)."""
  def step(mech):  # what each sum adds per step: [8, 2] (P, Q)
    m = law_moments(mech, jnp.array([0.0, -1.0]), add)  # shape (8, 2): P, Q
    abs1 = jnp.minimum(m[5] * (1.0 + _ABS1_SLACK), jnp.sqrt(m[1]))
    return jnp.concatenate([m[:5], (abs1 * m[1])[None], m[6:8] * (1.0 + _ABS34_SLACK)])

  sums = counted_sum(step, composition)  # (one traced step per kind of entry)
  n = total_count(composition)
  k, abs1_k2, abs3, cen4 = sums[:5], sums[5], sums[6], sums[7]
  b = jnp.sqrt(k[1])
  k3 = abs3 * jnp.sqrt(n) / b ** 3
  both = dict(k=k, n=n + jnp.zeros(2), K3=k3, Kt3=k3 + abs1_k2 * jnp.sqrt(n) / b ** 3,
              K4=cen4 * n / b ** 4, lam3=k[2] * jnp.sqrt(n) / b ** 3)
  pick = lambda i: {name: value[..., i] for name, value in both.items()}
  return pick(0), pick(1)


# ---------------------------------------------------------------- the series


def _hermite(z, top):
  """Probabilists' Hermite polynomials He_0..He_top at z (He_{n+1} = z He_n - n He_{n-1})."""
  he = [jnp.ones_like(z), z]
  for n in range(1, top):
    he.append(z * he[n] - n * he[n - 1])
  return he


def _correction(z, k, order):
  """c(z) with P(S > z) ~ Phi(-z) + phi(z) c(z): the Edgeworth series of the given order in the
  standardised cumulants rho_r = k_r / k2^{r/2}."""
  r3, r4, r5 = k[2] / k[1] ** 1.5, k[3] / k[1] ** 2, k[4] / k[1] ** 2.5
  he = _hermite(z, 8)
  c = r3 / 6.0 * he[2]
  if order >= 2:
    c = c + r4 / 24.0 * he[3] + r3 ** 2 / 72.0 * he[5]
  if order >= 3:
    c = c + r5 / 120.0 * he[4] + r3 * r4 / 144.0 * he[6] + r3 ** 3 / 1296.0 * he[8]
  return c


def _scaled_tail(x, k, order, log_scale):
  """e^{log_scale} x the order-``order`` Edgeworth approximation of P(L > x) for a law with summed
  cumulants ``k``, clipped to [0, 1] (the truth lies there); computed in log space."""
  z = (x - k[0]) / jnp.sqrt(k[1])
  gauss = jnp.exp(log_scale + log_ndtr(-z))
  corr = jnp.exp(log_scale - 0.5 * z * z) * _PHI0 * _correction(z, k, order)
  return jnp.clip(gauss + corr, 0.0, jnp.exp(log_scale))


# ---------------------------------------------------------------- error bound of the first order


def _upper_gamma(x):
  """Gamma(3/2, x) = sqrt(x) e^{-x} + sqrt(pi)/2 erfc(sqrt(x)) (closed form)."""
  r = jnp.sqrt(x)
  return r * jnp.exp(-x) + 0.5 * math.sqrt(math.pi) * erfc(r)


def _lower_gamma(x):
  """gamma(3/2, x) = sqrt(pi)/2 erf(sqrt(x)) - sqrt(x) e^{-x} (closed form)."""
  r = jnp.sqrt(x)
  return 0.5 * math.sqrt(math.pi) * erf(r) - r * jnp.exp(-x)


def _derumigny_inid(n, K3, Kt3, K4, lam3):
  """Derumigny et al.'s bound on sup |F - E_1| for independent, non-identical steps (skewed,
  no-continuity case); +inf where it does not apply (n < K4 / (1 - 4 chi_1)^2)."""
  e = _EPS_D
  g = lambda a: math.exp(math.lgamma(a))
  p1 = (144 + 48 * e + 4 * e * e + 96 * math.sqrt(2 * e) + 32 * e
        + 16 * math.sqrt(2) * e ** 1.5) / 576
  e1 = math.exp(e * e * (1 / 6 + 2 * p1 / (1 - 3 * e) ** 2))
  d = (1 - 3 * e) ** 2 * math.pi
  cc = 1 / 24 + p1 / (2 * (1 - 3 * e) ** 2)
  lam = jnp.abs(lam3)
  r = K4 / n
  dlt = (1 - 4 * _CHI1 - jnp.sqrt(r)) / 2
  valid = dlt > 0
  dlt = jnp.where(valid, dlt, 1.0)
  curly3 = 0.5 * dlt ** -1.5 * jnp.abs(
      _lower_gamma(4 * dlt * n / Kt3 ** 2)
      - _lower_gamma(2 * dlt * jnp.minimum(e * jnp.sqrt(n / K4), 2 * n / Kt3 ** 2)))
  rbar = (_C_PSI / (48 * d) * r ** 1.5 * 8 * g(4) + _C_PSI / (24 ** 2 * 2 * d) * r ** 2 * 16 * g(5)
          + _C_PSI / (12 * d) * r ** 1.25 * 2 ** 2.5 * g(3.5)
          + _C_PSI / (72 * d) * r ** 1.5 * 8 * g(4)
          + _C_PSI / (144 * d) * r ** 1.75 * 2 ** 3.5 * g(4.5)
          + _C_PSI * e1 / (2 * math.pi) * r ** 2 * cc ** 2 * 16 * g(5)
          + _C_PSI * e1 / (6 * math.pi) * lam * K4 * n ** -1.5 * cc * 16 * g(5))
  top = 2 * jnp.sqrt(n) / Kt3
  a_lo = jnp.minimum(math.sqrt(2 * e) * (n / K4) ** 0.25, top)
  r1 = ((14.1961 + 67.0415) * Kt3 ** 4 / (16 * math.pi ** 4 * n ** 2)
        + 4.3394 * lam * Kt3 ** 3 / (8 * math.pi ** 3 * n ** 2) + rbar
        + lam * (_upper_gamma(a_lo) - _upper_gamma(top)) / jnp.sqrt(n)
        + _C_PSI * K3 * curly3 / (6 * math.pi * jnp.sqrt(n)))
  bound = (0.1995 * Kt3 / jnp.sqrt(n)
           + (0.031 * Kt3 ** 2 + 0.327 * K4 * (1 / 12 + 1 / (4 * (1 - 3 * e) ** 2))) / n
           + (0.054 * lam * Kt3 + 0.037 * e1 * lam3 ** 2) / n + r1)
  return jnp.where(valid, bound, jnp.inf)


def _derumigny_iid(n, K3, Kt3, K4, lam3):
  """Derumigny et al.'s bound on sup |F - E_1| for n identical steps (skewed, no-continuity)."""
  e = _EPS_D
  g = lambda a: math.exp(math.lgamma(a))
  lam = jnp.abs(lam3)
  e3 = math.exp(e * e / 6 + e * e / (2 * (1 - 3 * e)) ** 2)
  p2 = (48 * e * jnp.sqrt(K4 / n) + 4 * e * e * K4 / n
        + 96 * math.sqrt(2 * e) * lam / (K4 * n) ** 0.25 + 32 * e * lam3 ** 2 / jnp.sqrt(K4 * n)
        + 16 * math.sqrt(2) * K4 ** 0.25 * lam * e ** 1.5 / n ** 0.75)
  s = (1 - 3 * e) ** 2
  e2 = jnp.exp(e * e * (1 / 6 + 1 / (2 * s) + 2 * p2 / (576 * s)))
  d2 = 2 * s * math.pi
  zz = K4 / 12 + 1 / (4 * s) + p2 / (576 * s)
  rbar = (_C_PSI / d2 * lam / (6 * n ** 1.5) * math.sqrt(2) * g(1.5)
          + _C_PSI / d2 * K4 / (24 * n ** 2) * 8 * g(4)
          + _C_PSI / d2 * lam3 ** 2 / (36 * n ** 2) * 8 * g(4)
          + _C_PSI / d2 * K4 * lam / (72 * n ** 2.5) * 2 ** 3.5 * g(4.5)
          + _C_PSI / d2 * K4 ** 2 / (576 * n ** 3) * 16 * g(5)
          + _C_PSI / math.pi * e2 / (8 * n ** 2) * zz * 16 * g(5)
          + _C_PSI / math.pi * e2 * lam / (12 * n ** 1.5) * zz * 2 ** 3.5 * g(4.5))
  top = 2 * jnp.sqrt(n) / Kt3
  a_lo = jnp.minimum(math.sqrt(2 * e) * (n / K4) ** 0.25, top)
  r1 = ((14.1961 + 67.0415) * Kt3 ** 4 / (16 * math.pi ** 4 * n ** 2)
        + 4.3394 * lam * Kt3 ** 3 / (8 * math.pi ** 3 * n ** 2) + rbar
        + 1.306 * (e2 - e3) * lam3 ** 2 / (36 * n)
        + lam * (_upper_gamma(a_lo) - _upper_gamma(top)) / jnp.sqrt(n)
        + _C_PSI * 2 ** 2.5 * K3 / (3 * math.pi * jnp.sqrt(n))
        * (_upper_gamma(a_lo ** 2 / 8) - _upper_gamma(n / (2 * Kt3 ** 2))))
  return (0.1995 * Kt3 / jnp.sqrt(n)
          + (0.031 * Kt3 ** 2 + 0.327 * K4 * (1 / 12 + 1 / (4 * s))) / n
          + (0.054 * lam * Kt3 + 0.037 * e3 * lam3 ** 2) / n + r1)


def cdf_error(law, iid):
  """A certified bound on sup_x |P(L <= x) - E_1(x)| for the composed law (``_law``): the
  smallest valid one of Berry-Esseen (plus sup |E_1 - Phi|) and Derumigny et al."""
  n, K3, Kt3, K4, lam3 = law["n"], law["K3"], law["Kt3"], law["K4"], law["lam3"]
  berry_esseen = ((_BE_IID if iid else _BE_INID) * K3 + jnp.abs(lam3) * _PHI0 / 6) / jnp.sqrt(n)
  bound = jnp.minimum(berry_esseen, _derumigny_inid(n, K3, Kt3, K4, lam3))
  if iid:
    bound = jnp.minimum(bound, _derumigny_iid(n, K3, Kt3, K4, lam3))
  return bound + _CDF_SLACK


# ---------------------------------------------------------------- delta curves


def _laws(composition, add):
  """(law under P, law under Q, their CDF error bounds) of the composed loss, direction ``add``."""
  iid = len(composition.mechanisms) == 1
  under_p, under_q = _laws_of(composition, add)
  return under_p, under_q, cdf_error(under_p, iid), cdf_error(under_q, iid)


def _aea(eps, laws, order):
  """The approximate Edgeworth accountant's delta(eps) of ``order`` (one direction), >= 0."""
  kp, kq = laws[0]["k"], laws[1]["k"]
  return jnp.maximum(_scaled_tail(eps, kp, order, 0.0) - _scaled_tail(eps, kq, order, eps), 0.0)


def _interval(eps, laws):
  """(delta+, delta-)(eps) from the first-order tails P~, Q~ and their error bounds Delta:
  delta+ = P~ + Delta_P - e^eps (Q~ - Delta_Q)_+ in [0, 1] and
  delta- = P~ - Delta_P - e^eps min(Q~ + Delta_Q, 1)."""
  tail_p = _scaled_tail(eps, laws[0]["k"], 1, 0.0)
  tail_q = _scaled_tail(eps, laws[1]["k"], 1, 0.0)
  scale = jnp.exp(eps)  # (+inf beyond eps ~ 709: a zero tail times it is 0, not nan)
  times = lambda tail: jnp.where(tail > 0.0, scale * tail, 0.0)
  upper = jnp.clip(tail_p + laws[2] - times(jnp.maximum(tail_q - laws[3], 0.0)), 0.0, 1.0)
  return upper, tail_p - laws[2] - times(jnp.minimum(tail_q + laws[3], 1.0))


def _curves(eps, laws, order):
  """(estimate, certified upper, certified lower) of delta at eps, before the monotone
  envelopes: the AEA of ``order``, delta+ and delta- of the first-order interval."""
  return jnp.stack([_aea(eps, laws, order), *_interval(eps, laws)])


def _grid(laws):
  k = laws[0]["k"]
  top = jnp.clip(k[0] + _SCAN_SDS * jnp.sqrt(k[1]), 1e-3, _EPS_CAP)
  return top * jnp.linspace(0.0, 1.0, _SCAN)


def predicted_error(eps, laws, order):
  """The epsilon error of the order-``order`` estimate at eps, predicted by the series' terms
  beyond it: the largest change of delta from one order to the next among those it leaves out
  (order 1: to order 2 and from 2 to 3, since a small next term alone can hide a large one
  after it, deep in the tail at few steps), divided by the slope of the estimate's delta curve.
  Order 3, the last implemented (its next term needs a sixth cumulant), is charged with its own
  last term, the change from order 2 (a bound rather than an estimate: where the series
  settles, each term is smaller than the one before)."""
  values = [_aea(eps, laws, k) for k in (1, 2, 3)]
  change = jnp.abs(values[2] - values[1])
  if order == 1:
    change = jnp.maximum(change, jnp.abs(values[1] - values[0]))
  slope = jnp.abs(jax.grad(_aea)(eps, laws, order))
  return jnp.where(slope > 0.0, change / jnp.where(slope > 0.0, slope, 1.0), jnp.inf)


def _first_correction(x, k):
  """The first Edgeworth correction of P(L > x) relative to its Gaussian term (law with summed
  cumulants ``k``): |phi(z) rho_3 He_2(z) / 6| / Phi(-z), ~ |rho_3| z^3 / 6 deep in the tail."""
  z = (x - k[0]) / jnp.sqrt(k[1])
  log_ratio = -0.5 * z * z + math.log(_PHI0) - log_ndtr(-z)
  return jnp.exp(log_ratio) * jnp.abs(k[2] / k[1] ** 1.5 / 6.0 * (z * z - 1.0))


def _unreliable(eps, laws, order):
  """The estimate's regime guard (status UNRELIABLE): the predicted epsilon error
  (``predicted_error``) is above _RELIABLE x max(1, eps); or a tail's series has not started
  to converge at eps, its first correction above _SERIES_SETTLED of its Gaussian term (deep in
  the tail at few steps); or a composed law is strongly skewed (|rho_3| > _RHO3_RELIABLE: few
  steps of a far-from-Gaussian loss). Where one of the last two holds, the series' terms need
  not predict its error."""
  eps = jax.lax.stop_gradient(eps)
  laws = jax.lax.stop_gradient(laws)
  rho3 = lambda k: jnp.abs(k[2]) / k[1] ** 1.5
  skewed = jnp.maximum(rho3(laws[0]["k"]), rho3(laws[1]["k"])) > _RHO3_RELIABLE
  settled = jnp.maximum(_first_correction(eps, laws[0]["k"]),
                        _first_correction(eps, laws[1]["k"])) <= _SERIES_SETTLED
  error = predicted_error(eps, laws, order)
  return skewed | ~(settled & (error <= _RELIABLE * jnp.maximum(1.0, eps)))


def _log_residual(value, target):
  return jnp.log(jnp.maximum(value, 1e-300)) - jnp.log(target)


# ---------------------------------------------------------------- queries per direction


def _delta_direction(composition, eps, method, add):
  laws = _laws(composition, add)
  grid = _grid(laws)
  at_eps = _curves(eps, laws, _ORDER[method])
  on_grid = jax.vmap(lambda e: _curves(e, laws, 1))(grid)
  # The true delta is non-increasing: any delta+ at a smaller eps and any delta- at a larger
  # eps also bound it.
  upper = jnp.minimum(at_eps[1], jnp.min(jnp.where(grid <= eps, on_grid[:, 1], 1.0)))
  lower = jnp.maximum(at_eps[2], jnp.max(jnp.where(grid >= eps, on_grid[:, 2], -1.0)))
  lower = jnp.where(lower > 0.0, lower, jnp.nan)
  status = jnp.where(jnp.isnan(lower), results.LOWER_VACUOUS, results.OK)
  status = status | jnp.where(upper >= 1.0, results.UPPER_VACUOUS, results.OK)
  status = status | jnp.where(_unreliable(eps, laws, _ORDER[method]), results.UNRELIABLE,
                              results.OK)
  return Bounds(lower, at_eps[0], upper, status.astype(jnp.int32))


def _epsilon_direction(composition, delta, method, add):
  laws = _laws(composition, add)
  order = _ORDER[method]
  grid = _grid(laws)
  last = _SCAN - 1
  values = jax.lax.stop_gradient(jax.vmap(lambda e: _curves(e, laws, order))(grid)).T
  curve = (lambda e: _aea(e, laws, order), lambda e: _interval(e, laws)[0],
           lambda e: _interval(e, laws)[1])
  residual = lambda field: (lambda e: _log_residual(curve[field](e), delta))
  index = jnp.arange(_SCAN)

  # Estimate: the largest root of AEA(eps) = delta.
  above = values[0] > delta
  i = jnp.max(jnp.where(above, index, -1))
  cell = jnp.clip(i, 0, last - 1)
  estimate, _ = root_in_bracket(residual(0), grid[cell], grid[cell + 1], _ITERS)
  estimate = jnp.where(i < 0, 0.0, jnp.where(i == last, jnp.inf, estimate))
  crossings = jnp.sum(above[1:] != above[:-1])

  # Upper: the first eps with delta+ <= delta (refined to a point where that was evaluated).
  below = values[1] <= delta
  j = jax.lax.argmax(below, 0, jnp.int32)
  cell = jnp.clip(j - 1, 0, last - 1)
  upper, _ = root_in_bracket(residual(1), grid[cell], grid[cell + 1], _ITERS, which=1)
  upper = jnp.where(j == 0, 0.0, upper)
  upper = jnp.where(jnp.any(below), upper, jnp.inf)

  # Lower: the last eps with delta- > delta (likewise on its safe side).
  over = values[2] > delta
  k = jnp.max(jnp.where(over, index, -1))
  cell = jnp.clip(k, 0, last - 1)
  lower, _ = root_in_bracket(residual(2), grid[cell], grid[cell + 1], _ITERS, which=-1)
  lower = jnp.where(k == last, grid[last], lower)
  lower = jnp.where((k < 0) | (lower <= 0.0), jnp.nan, lower)  # 0 says nothing: vacuous

  status = jnp.where(jnp.isnan(lower), results.LOWER_VACUOUS, results.OK)
  status = status | jnp.where(jnp.isinf(upper), results.UPPER_VACUOUS, results.OK)
  unreliable = (_unreliable(jnp.where(jnp.isfinite(estimate), estimate, 0.0), laws, order)
                | (crossings > 1) | ~jnp.isfinite(estimate))
  status = status | jnp.where(unreliable, results.UNRELIABLE, results.OK)
  status = status | jnp.where(i == last, results.OUT_OF_RANGE, results.OK)
  return Bounds(lower, estimate, upper, status.astype(jnp.int32))


# ---------------------------------------------------------------- public


@float64
def epsilon(composition, delta, *, method="order2") -> Bounds:
  """epsilon(delta) by the Edgeworth accountant, worse adjacency direction.

  Args:
    composition: a ``Composition``, a model, or a list of (model, count) entries; counts may be
      real numbers (d epsilon / d T exists). Leaves may be arrays: the result is batched over
      their broadcast shape. Models with mass at infinite loss are refused.
    delta: target delta in (0, 1), broadcast with the composition.
    method: the estimate, one of ``METHODS`` ("order2", "order1", "order3").
  Returns:
    ``Bounds`` (lower, estimate, upper, status), float64, batched like the inputs.
  """
  check_choice("method", method, METHODS)
  composition = checked(composition)
  delta = as_leaf(delta)
  check_delta(delta)
  return query(_epsilon_direction, method, composition, delta)


@float64
def delta(composition, epsilon, *, method="order2") -> Bounds:
  """delta(epsilon) by the Edgeworth accountant, worse adjacency direction; arguments as in
  ``epsilon`` (``epsilon`` >= 0)."""
  check_choice("method", method, METHODS)
  composition = checked(composition)
  epsilon = as_leaf(epsilon)
  check_epsilon(epsilon)
  return query(_delta_direction, method, composition, epsilon)
