"""The Renyi-DP accountant against independent references.

* Per-order RDP of Poisson-subsampled Gaussian DP-SGD against dp-accounting's ``RdpAccountant``
  (0.6.0) on its default orders, at the *integer* orders only for q < 1 (its exact finite sum).
  Its fractional orders are skipped: ``_compute_log_a_frac`` takes log|binom(alpha, i)| from
  ``gammaln`` and adds every term, also those where the generalised binomial coefficient is
  negative, so it overestimates, e.g. by 10% at q = 1e-3, sigma = 0.5, alpha = 1.5 (40-digit
  mpmath: 3.51700594e-5; dp-accounting: 3.86492e-5; the same series with signs agrees with
  mpmath). Fractional orders are checked against mpmath quadrature instead (40-digit
  ``_mpmath_sgm_rdp`` here; K(t) from tests/spa_reference.py).
* epsilon between the PLD truth (tests/data/references.json) and dp-accounting's RDP epsilon.
* Closed forms: Gaussian (RDP = alpha T / (2 sigma^2)), Laplace (Mironov 2017, Prop. 6), binary
  randomized response; the continuous-order optimum of the Gaussian conversion by scipy.
* jit / vmap / grad, and bad input.
"""

import math

import jax
import jax.numpy as jnp
import mpmath
import numpy as np
import pytest
from scipy import optimize

import dp_accounting
import jaxacct
from jaxacct import rdp
from jaxacct.results import LOWER_VACUOUS
from reference_cases import REFERENCES

DEFAULT_ORDERS = np.array(dp_accounting.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS, float)
INTEGER = DEFAULT_ORDERS == np.round(DEFAULT_ORDERS)


def dpsgd(sigma, rate, steps):
  return jaxacct.Composition.of((jaxacct.PoissonSampled(jaxacct.Gaussian(sigma), rate), steps))


def dpa_accountant(sigma, rate, steps, orders=None):
  event = dp_accounting.GaussianDpEvent(sigma)
  if rate < 1.0:
    event = dp_accounting.PoissonSampledDpEvent(rate, event)
  acc = dp_accounting.rdp.RdpAccountant(orders)
  acc.compose(event, int(steps))
  return acc


# ---------------------------------------------------------------------------------------------
# Per-order RDP

DPSGD_SETTINGS = [  # q, sigma, T: small and large q, sigma 0.5..10, q = 1 (plain Gaussian)
    (1e-3, 0.5, 1), (1e-3, 2.0, 100), (1e-3, 10.0, 10_000), (0.01, 1.0, 1000), (0.01, 5.0, 300),
    (0.05, 0.7, 50), (0.2, 3.0, 10), (0.5, 0.5, 3), (1.0, 0.5, 50), (1.0, 10.0, 1000),
]


def test_per_order_rdp_matches_dp_accounting():
  q, sigma, steps = (np.array(col, float)[:, None] for col in zip(*DPSGD_SETTINGS))
  ours = np.asarray(rdp.rdp(dpsgd(sigma, q, steps), DEFAULT_ORDERS[None, :]))
  assert ours.shape == (len(DPSGD_SETTINGS), DEFAULT_ORDERS.size) and ours.dtype == np.float64
  for row, (rate, s, t) in zip(ours, DPSGD_SETTINGS):
    # q = 1 is dp-accounting's closed form at every order; q < 1 its exact integer-order sum.
    keep = np.ones_like(INTEGER) if rate == 1.0 else INTEGER
    ref = dpa_accountant(s, rate, t, DEFAULT_ORDERS[keep]).rdp
    assert np.all(np.isfinite(ref)) and ref.size >= 66
    np.testing.assert_allclose(row[keep], ref, rtol=1e-9, err_msg=str((rate, s, t)))
    if rate == 1.0:  # through the subsampling quadrature at rate 1
      np.testing.assert_allclose(row, DEFAULT_ORDERS * t / (2 * s * s), rtol=1e-9)


def test_gaussian_model_is_the_closed_form():
  orders = np.array([1.01, 1.5, 2.0, 7.25, 64.0, 1e4])
  comp = jaxacct.Composition.of((jaxacct.Gaussian(3.0), 20), (jaxacct.Gaussian(1.5, 0.5), 7))
  expected = orders * (20 / 9.0 + 7 * (0.5 / 1.5) ** 2) / 2
  np.testing.assert_allclose(np.asarray(rdp.rdp(comp, orders)), expected, rtol=1e-13)


def _mpmath_sgm_rdp(q, sigma, alpha):
  """D_alpha(q N(1, s^2) + (1-q) N(0, s^2) || N(0, s^2)) by 40-digit quadrature, as
  log(1 + E[(1+u)^alpha - 1 - alpha u]) with u = q (e^{(2x-1)/(2 s^2)} - 1), E[u] = 0."""
  with mpmath.workdps(40):
    q, s, a = mpmath.mpf(q), mpmath.mpf(sigma), mpmath.mpf(alpha)

    def f(x):
      u = q * mpmath.expm1((2 * x - 1) / (2 * s * s))
      return mpmath.npdf(x, 0, s) * ((1 + u) ** a - 1 - a * u)

    pts = sorted({-mpmath.inf, -40 * s, 0, 40 * s, a, a + 40 * s, mpmath.inf})
    return float(mpmath.log1p(mpmath.quad(f, pts)) / (a - 1))


# K(t) = log E_P[e^{tL}] of one subsampled Gaussian step (Alghamdi, Asoodeh, Calmon, Gomez,
# Kosut, Sankar and Wei 2022, arXiv 2208.09595, Sec. 3.1), so RDP(1 + t) = K(t)/t: (q, sigma, t)
# -> K from tests/spa_reference.py (30-digit mpmath quadrature), to every printed digit.
MPMATH_K = [((0.01, 2.0, 0.5), 1.06345046792585e-5), ((0.01, 2.0, 10.5), 1.76694211237307e-3),
            ((0.01, 2.0, 27.3), 1.19767565341101e-2), ((0.1, 1.0, 0.5), 5.86729609834262e-3),
            ((0.1, 1.0, 2.5), 0.106811227007633), ((256 / 60000, 1.1, 6.9), 6.69472288712234e-4)]


def test_fractional_orders_match_high_precision_references():
  cases = [((q, s, 1.0 + t), k / t) for (q, s, t), k in MPMATH_K]
  points = [(1e-3, 0.5, 1.5), (1e-3, 10.0, 2.5), (0.01, 1.0, 1.05), (0.2, 3.0, 20.5)]
  cases += [((q, s, a), _mpmath_sgm_rdp(q, s, a)) for q, s, a in points]
  for (q, s, a), ref in cases:
    got = float(rdp.rdp(dpsgd(s, q, 1), a))
    assert got == pytest.approx(ref, rel=1e-9), (q, s, a)


def test_laplace_matches_mironov_closed_form():
  # Mironov 2017, Prop. 6: Laplace with scale b and sensitivity 1 has
  # RDP(a) = log(a/(2a-1) e^{(a-1)/b} + (a-1)/(2a-1) e^{-a/b}) / (a-1)
  # (evaluated in 30 digits: near a = 1 the log of a sum near 1 loses digits in float64).
  orders = np.array([1.001, 1.1, 1.5, 2.0, 3.7, 10.0, 100.0, 1000.0])
  for scale, count in [(0.3, 1), (1.0, 5), (10.0, 200)]:
    with mpmath.workdps(30):
      e0 = 1 / mpmath.mpf(scale)
      expected = [float(count * mpmath.log(a / (2 * a - 1) * mpmath.exp((a - 1) * e0)
                                           + (a - 1) / (2 * a - 1) * mpmath.exp(-a * e0)) / (a - 1))
                  for a in map(mpmath.mpf, orders)]
    got = np.asarray(rdp.rdp([(jaxacct.Laplace(scale), count)], orders))
    np.testing.assert_allclose(got, expected, rtol=1e-11)


def test_randomized_response_matches_closed_form():
  # Binary randomized response P = (p, 1-p), Q = (1-p, p), p = e^eps / (1 + e^eps):
  # RDP(a) = log(p^a (1-p)^(1-a) + (1-p)^a p^(1-a)) / (a-1)   (30 digits, as above).
  orders = np.array([1.001, 1.5, 2.0, 5.5, 50.0, 5000.0])
  for eps, count in [(0.01, 1000), (1.0, 3), (5.0, 1)]:
    with mpmath.workdps(30):
      p = mpmath.exp(eps) / (1 + mpmath.exp(eps))
      rr = lambda a: mpmath.log(p ** a * (1 - p) ** (1 - a) + (1 - p) ** a * p ** (1 - a))
      expected = [float(count * rr(a) / (a - 1)) for a in map(mpmath.mpf, orders)]
    got = np.asarray(rdp.rdp([(jaxacct.PureDP(eps), count)], orders))
    np.testing.assert_allclose(got, expected, rtol=1e-11)
    assert np.all(got <= count * eps * (1 + 1e-12))  # never above the pure-DP bound


def _mpmath_subsampled_laplace(q, b, alpha, add):
  """D_alpha of the Poisson-subsampled Laplace pair (remove: P = mix, Q = B0; add: swapped),
  B1 = Lap(1, b), B0 = Lap(0, b), mix = q B1 + (1-q) B0; 30-digit quadrature over the pieces."""
  with mpmath.workdps(30):
    q, b, a = mpmath.mpf(q), mpmath.mpf(b), mpmath.mpf(alpha)
    lap = lambda x, m: mpmath.exp(-abs(x - m) / b) / (2 * b)
    mix = lambda x: q * lap(x, 1) + (1 - q) * lap(x, 0)
    p, r = (lambda x: lap(x, 0), mix) if add else (mix, lambda x: lap(x, 0))
    f = lambda x: p(x) ** a * r(x) ** (1 - a)
    return float(mpmath.log(mpmath.quad(f, [-mpmath.inf, 0, 1, mpmath.inf])) / (a - 1))


def test_subsampled_laplace_takes_the_worse_direction():
  # A non-symmetric composition: each order reports the larger of the two directions.
  q, b = 0.3, 0.7
  orders = np.array([1.5, 6.0, 30.0])
  got = np.asarray(rdp.rdp(jaxacct.PoissonSampled(jaxacct.Laplace(b), q), orders))
  for a, g in zip(orders, got):
    remove = _mpmath_subsampled_laplace(q, b, a, add=False)
    add = _mpmath_subsampled_laplace(q, b, a, add=True)
    assert g == pytest.approx(max(remove, add), rel=1e-9), (a, remove, add)


# ---------------------------------------------------------------------------------------------
# epsilon and delta

ROWS = [r for r in REFERENCES if r["relation"] == "add_remove" and len(r["entries"]) == 1]


def test_epsilon_between_pld_truth_and_dp_accounting():
  sigma, rate, steps = (np.array(c) for c in zip(*[r["entries"][0] for r in ROWS]))
  deltas = np.array([r["delta"] for r in ROWS])
  assert deltas.min() < 1e-9 and deltas.max() > 1e-4 and len(ROWS) > 50
  out = rdp.epsilon(dpsgd(sigma, rate, steps), deltas)
  ours = np.asarray(out.upper)
  assert np.all(np.isfinite(ours))  # (odd rows check only e >= reference below: +inf would pass)
  np.testing.assert_array_equal(np.asarray(out.estimate), ours)
  assert np.all(np.isnan(np.asarray(out.lower)))
  assert np.all(np.asarray(out.status) == LOWER_VACUOUS)
  for i, (row, e) in enumerate(zip(ROWS, ours)):
    # An upper bound: at least the true epsilon (dp-accounting's PLD, extrapolated to h -> 0;
    # its residual error is ~1e-6). Continuous orders: at most dp-accounting's RDP epsilon
    # (checked on every other row, for time).
    assert e >= row["reference"] - 1e-5, row
    if i % 2 == 0:
      dpa = dpa_accountant(*row["entries"][0]).get_epsilon(row["delta"])
      assert e <= dpa * (1 + 1e-10) + 1e-12, (row, e, dpa)


@pytest.mark.parametrize("sigma, rate, steps, delta", [
    (1.0, 0.01, 1000, 1e-5), (2.0, 0.01, 3000, 1e-5), (1.1, 256 / 60000, 14063, 1e-5)])
def test_epsilon_matches_the_improved_conversion_at_a_continuous_order(sigma, rate, steps, delta):
  # The improved conversion (Alghamdi et al. 2022, eq. (43); Canonne, Kamath and Steinke 2020,
  # arXiv 2004.00010, Prop. 12, as in dp-accounting) minimised over a continuous order:
  # tests/spa_reference.py improved_rdp_epsilon (30-digit mpmath, the worse direction per order).
  expected = {1.0: 2.101322, 2.0: 1.225823, 1.1: 2.596642}[sigma]
  got = float(rdp.epsilon(dpsgd(sigma, rate, steps), delta).upper)
  assert got == pytest.approx(expected, abs=1e-6)


def test_epsilon_is_the_minimum_over_a_dense_order_grid():
  # The optimiser finds the continuous minimum of the conversion (our own per-order RDP, which
  # the tests above check): never above the best grid order, and within the grid's resolution.
  orders = np.geomspace(1.001, 1e4, 1024)
  for sigma, rate, steps, delta in [(0.6, 0.2, 30, 1e-8), (8.0, 1e-3, 10_000, 1e-10),
                                    (1.0, 1.0, 1, 1e-3)]:
    comp = dpsgd(sigma, rate, steps)
    curve = np.asarray(rdp.rdp(comp, orders))
    grid = curve + np.log1p(-1 / orders) - (math.log(delta) + np.log(orders)) / (orders - 1)
    got = float(rdp.epsilon(comp, delta).upper)
    assert grid.min() - 1e-4 * grid.min() <= got <= grid.min() + 1e-12


def _gaussian_continuous(rho, delta=None, eps=None):
  """Gaussian RDP(a) = rho a: the conversion's minimum over a in [1.001, 1e4] by scipy."""
  if delta is not None:
    f = lambda a: rho * a + math.log1p(-1 / a) - (math.log(delta) + math.log(a)) / (a - 1)
  else:
    f = lambda a: (a - 1) * (rho * a - eps + math.log1p(-1 / a)) - math.log(a)
  # Both objectives are unimodal in a: bracket the minimum on a log grid, then Brent.
  grid = np.geomspace(1.001, 1e4, 2001)
  i = int(np.argmin([f(a) for a in grid]))
  lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]
  res = optimize.minimize_scalar(f, bounds=(lo, hi), method="bounded",
                                 options=dict(xatol=1e-12 * hi))
  return min(res.fun, f(lo), f(hi))


@pytest.mark.parametrize("sigma, steps", [(0.8, 1), (3.0, 100), (20.0, 5000), (100.0, 10)])
def test_gaussian_epsilon_and_delta_match_scipy_optimum(sigma, steps):
  comp = [(jaxacct.Gaussian(sigma), steps)]
  rho = steps / (2 * sigma * sigma)
  for delta in [1e-10, 1e-6, 1e-3]:
    expected = max(0.0, _gaussian_continuous(rho, delta=delta))
    assert float(rdp.epsilon(comp, delta).upper) == pytest.approx(expected, rel=1e-9, abs=1e-12)
  for eps in [0.1, 1.0, 4.0]:
    expected = min(1.0, math.exp(_gaussian_continuous(rho, eps=eps)))
    assert float(rdp.delta(comp, eps).upper) == pytest.approx(expected, rel=1e-9, abs=1e-300)


def test_delta_matches_dp_accounting_and_inverts_epsilon():
  rows = ROWS[::4]
  sigma, rate, steps = (np.array(c) for c in zip(*[r["entries"][0] for r in rows]))
  comp = dpsgd(sigma, rate, steps)
  deltas = np.array([r["delta"] for r in rows])
  eps = np.asarray(rdp.epsilon(comp, deltas).upper)
  out = rdp.delta(comp, eps)
  np.testing.assert_allclose(np.asarray(out.upper), deltas, rtol=1e-8)
  for row, e, d in zip(rows, eps, np.asarray(out.upper)):
    assert d <= dpa_accountant(*row["entries"][0]).get_delta(e) * (1 + 1e-10)


def test_host_dpsgd_rdp_matches_dp_accounting_at_its_integer_orders():
  """The calibration's host start (numpy, nothing compiled) is dp-accounting's integer-order RDP
  and conversion, and no tighter than the RDP accountant's continuous orders; its delta
  inverts its epsilon."""
  rng = np.random.default_rng(7)
  sigma = np.exp(rng.uniform(np.log(0.5), np.log(20.0), 24))
  rate = np.where(np.arange(24) % 6 == 0, 1.0, np.exp(rng.uniform(np.log(1e-4), 0.0, 24)))
  steps = np.round(np.exp(rng.uniform(0.0, np.log(1e5), 24)))
  delta = np.exp(rng.uniform(np.log(1e-10), np.log(1e-3), 24))
  orders = [float(a) for a in rdp.HOST_ORDERS]
  host = rdp.host_dpsgd_epsilon(sigma, rate, steps, delta)
  ref = [dpa_accountant(s, q, t, orders).get_epsilon(d)
         for s, q, t, d in zip(sigma, rate, steps, delta)]
  np.testing.assert_allclose(host, ref, rtol=1e-11)
  np.testing.assert_allclose(rdp.host_dpsgd_rdp(sigma[:4], rate[:4])[:, [0, 5]],
                             [dpa_accountant(s, q, 1, [2.0, 7.0]).rdp
                              for s, q in zip(sigma[:4], rate[:4])], rtol=1e-9)
  continuous = np.asarray(rdp.epsilon(dpsgd(sigma, rate, steps), delta).upper)
  assert np.all(host >= continuous * (1 - 1e-9))
  np.testing.assert_allclose(rdp.host_dpsgd_delta(sigma, rate, steps, host), delta, rtol=1e-9)
  for orders in ([2.5], [1, 2], [0]):  # (its binomial sums hold at integer orders >= 2 only)
    with pytest.raises(ValueError, match="integer orders"):
      rdp.host_dpsgd_rdp(1.0, 0.01, orders)


# ---------------------------------------------------------------------------------------------
# Transformations

SIGMAS = np.array([0.7, 0.9, 1.3, 2.0, 4.5])


def test_jit_and_vmap_equal_the_public_calls():
  with jax.enable_x64(True):
    f = jax.jit(jax.vmap(lambda s: rdp.epsilon(dpsgd(s, 0.02, 500), 1e-6).upper))
    batched = np.asarray(f(jnp.asarray(SIGMAS)))
  loop = np.array([float(rdp.epsilon(dpsgd(s, 0.02, 500), 1e-6).upper) for s in SIGMAS])
  np.testing.assert_allclose(batched, loop, rtol=1e-12)
  assert np.all(np.diff(loop) < 0)  # more noise, less epsilon
  # The public batch (padded chunks) equals the loop too.
  np.testing.assert_allclose(np.asarray(rdp.epsilon(dpsgd(SIGMAS, 0.02, 500), 1e-6).upper), loop,
                             rtol=1e-12)


def test_eager_equals_compiled():
  # Op by op (no compilation at all) against the compiled public calls; a Gaussian composition
  # keeps the op-by-op run short (the order search loop runs in Python).
  comp = [(jaxacct.Gaussian(2.0), 30), (jaxacct.Gaussian(5.0), 100)]
  with jax.disable_jit():
    eager = [float(rdp.epsilon(comp, 1e-6).upper), float(rdp.rdp(comp, 7.5))]
  compiled = [float(rdp.epsilon(comp, 1e-6).upper), float(rdp.rdp(comp, 7.5))]
  np.testing.assert_allclose(eager, compiled, rtol=1e-13)


@jax.jit
def _eps_grad(sigma, rate, steps, delta):
  f = lambda s, q, t: rdp.epsilon(dpsgd(s, q, t), delta).upper
  return jax.grad(f, argnums=(0, 1, 2))(sigma, rate, steps)


@pytest.mark.parametrize("sigma, rate, steps, delta", [(0.9, 0.01, 800, 1e-5),
                                                       (2.5, 0.05, 123.4, 1e-8)])
def test_grad_matches_central_differences(sigma, rate, steps, delta):
  # d epsilon / d (sigma, q, T), T real-valued (the CGF is linear in the counts).
  with jax.enable_x64(True):
    grads = _eps_grad(*map(jnp.float64, (sigma, rate, steps, delta)))
  point = [sigma, rate, steps]
  for i, g in enumerate(grads):
    def f(x):
      args = list(point)
      args[i] = x
      return float(rdp.epsilon(dpsgd(*args), delta).upper)
    h = 1e-5 * point[i]
    fd = (f(point[i] + h) - f(point[i] - h)) / (2 * h)
    assert abs(float(g) - fd) <= 1e-4 * abs(fd), (i, float(g), fd)


@jax.jit
def _schedule_value_and_grad(sigmas):
  """epsilon and its gradient in the two phases' sigmas of a schedule whose two phases are of
  one kind (traced once and vmapped over, ``composition.counted_sum``), a Laplace between."""
  def upper(s):
    phase = lambda sigma: jaxacct.PoissonSampled(jaxacct.Gaussian(sigma), 0.01)
    comp = jaxacct.Composition.of((phase(s[0]), 700.0), (jaxacct.Laplace(2.0), 3.0),
                                  (phase(s[1]), 800.0))
    return rdp.epsilon(comp, 1e-6).upper
  return jax.value_and_grad(upper)(sigmas)


def test_each_phase_of_one_kind_gets_its_own_gradient():
  with jax.enable_x64(True):
    sigmas = jnp.array([0.9, 1.4])
    _, grads = _schedule_value_and_grad(sigmas)
    for i in range(2):
      h = jnp.zeros(2).at[i].set(1e-5 * sigmas[i])
      fd = (_schedule_value_and_grad(sigmas + h)[0]
            - _schedule_value_and_grad(sigmas - h)[0]) / (2 * h[i])
      assert float(grads[i]) < 0.0
      assert abs(float(grads[i]) - float(fd)) <= 1e-4 * abs(float(fd)), (i, grads, fd)


def test_real_counts_scale_the_curve():
  orders = np.array([1.5, 3.0, 40.0])
  one = np.asarray(rdp.rdp(dpsgd(1.2, 0.03, 1), orders))
  np.testing.assert_allclose(np.asarray(rdp.rdp(dpsgd(1.2, 0.03, 2.5), orders)), 2.5 * one,
                             rtol=1e-13)


def test_float64_without_the_global_flag(x64_off):
  r = rdp.epsilon(dpsgd(1.3, 0.02, 500), 1e-6)
  assert r.upper.dtype == jnp.float64 and r.status.dtype == jnp.int32
  assert not jax.config.jax_enable_x64


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 2.0, float("nan")])
def test_bad_delta(delta):
  with pytest.raises(ValueError, match=r"\bdelta\b"):
    rdp.epsilon(dpsgd(1.0, 0.01, 10), delta)


@pytest.mark.parametrize("orders", [1.0, 0.5, [2.0, 1.0], 2e4, float("inf")])
def test_bad_orders(orders):
  with pytest.raises(ValueError, match=r"\borders\b"):
    rdp.rdp(dpsgd(1.0, 0.01, 10), orders)


@pytest.mark.parametrize("eps", [-0.1, float("nan"), float("inf")])
def test_bad_epsilon(eps):
  with pytest.raises(ValueError, match=r"\bepsilon\b"):
    rdp.delta(dpsgd(1.0, 0.01, 10), eps)


def test_infinite_cgf_and_bad_models_are_refused():
  with pytest.raises(ValueError, match=r"delta > 0"):
    rdp.epsilon([(jaxacct.EpsilonDelta(1.0, 1e-6), 3)], 1e-5)
  with pytest.raises(ValueError, match=r"delta > 0"):
    rdp.rdp(jaxacct.PoissonSampled(jaxacct.EpsilonDelta(1.0, 1e-6), 0.1), 2.0)
  with pytest.raises(ValueError, match=r"\bsigma\b"):
    rdp.rdp(dpsgd(-1.0, 0.01, 10), 2.0)
  with pytest.raises(ValueError, match=r"\brate\b"):
    rdp.delta(dpsgd(1.0, 1.5, 10), 1.0)
  with pytest.raises(ValueError, match=r"\bcounts\b"):
    rdp.epsilon(dpsgd(1.0, 0.01, -3), 1e-5)
  with pytest.raises(ValueError, match=r"\bcounts\b"):
    rdp.rdp(dpsgd(1.0, 0.01, float("inf")), 2.0)
