"""The PLD accountant against closed forms: composed Gaussians (the mu-GDP curve of Dong, Roth and
Su 2022, JRSS-B, Cor. 2.13, with mu = sqrt(sum mu_i^2) under composition, Cor. 3.3), pure DP (the
exact k-fold composition, Kairouz, Oh and Viswanath 2015) and approximate DP; conftest computes
each curve. At the default plan every bracket is certified (status 0) and narrow: epsilon within
~2 eps_error (0.022), delta within 5e-3."""

import dataclasses
import math

import jax
import numpy as np
import pytest

import jaxacct
from jaxacct.models import RandomizedResponse
from conftest import epsilon_of, gaussian_delta, gaussian_epsilon, laplace_delta, pure_dp_delta

GAUSSIAN_CASES = [  # sigma, T, delta
    (100.0, 10_000, 1e-5), (1.0, 1, 1e-5), (10.0, 1000, 1e-5), (2.0, 100, 1e-6),
    (5.0, 1, 1e-10), (30.0, 3000, 1e-8), (3.0, 7, 1e-3), (50.0, 100_000, 1e-7),
]


@pytest.mark.parametrize("sigma, steps, delta", GAUSSIAN_CASES)
def test_composed_gaussian_epsilon(sigma, steps, delta):
  exact = gaussian_epsilon(delta, math.sqrt(steps) / sigma)
  r = jaxacct.epsilon([(jaxacct.Gaussian(sigma), steps)], delta)
  assert int(r.status) == 0
  assert float(r.lower) <= exact <= float(r.upper)
  assert abs(float(r.estimate) - exact) <= 1e-4
  assert float(r.upper) - float(r.lower) <= 0.022  # the default plan: ~2 eps_error = 0.02


def test_gaussian_values_at_mu_one():
  # sigma = 100, T = 1e4: mu = 1, eps(1e-5) = 4.3771780957, eps(1e-3) = 3.13867055 (the closed
  # form, Dong, Roth and Su 2022, Cor. 2.13, by conftest's gaussian_epsilon).
  for delta, expected in [(1e-5, 4.3771780957), (1e-3, 3.13867055)]:
    assert gaussian_epsilon(delta, 1.0) == pytest.approx(expected, abs=5e-9)
    r = jaxacct.epsilon([(jaxacct.Gaussian(100.0), 10_000)], delta)
    assert int(r.status) == 0
    assert abs(float(r.estimate) - expected) < 1e-4
    assert float(r.lower) <= expected <= float(r.upper)
    assert float(r.upper) - float(r.lower) <= 0.022


@pytest.mark.parametrize("eps", [0.0, 0.5, 1.0, 2.0, 3.0])
def test_composed_gaussian_delta(eps):
  exact = gaussian_delta(eps, 1.0)
  r = jaxacct.delta([(jaxacct.Gaussian(1.0), 1)], eps)
  assert int(r.status) == 0
  assert float(r.lower) <= exact <= float(r.upper)
  assert float(r.upper) - float(r.lower) <= 5e-3
  assert abs(float(r.estimate) - exact) <= 1e-4 * exact


def test_heterogeneous_gaussian():
  # sigma=10 x50 then sigma=5 x50: mu = sqrt(50/100 + 50/25) (Dong, Roth and Su 2022, Cor. 3.3),
  # delta(4) = 1.645567e-2 (Cor. 2.13, conftest's gaussian_delta).
  comp = [(jaxacct.Gaussian(10.0), 50), (jaxacct.Gaussian(5.0), 50)]
  mu = math.sqrt(0.5 + 2.0)
  assert abs(gaussian_delta(4.0, mu) - 1.645567e-2) < 1e-8
  r = jaxacct.delta(comp, 4.0)
  assert int(r.status) == 0
  assert float(r.lower) <= gaussian_delta(4.0, mu) <= float(r.upper)
  assert float(r.upper) - float(r.lower) <= 5e-3
  e = jaxacct.epsilon(comp, 1e-6)
  exact = gaussian_epsilon(1e-6, mu)
  assert int(e.status) == 0
  assert float(e.lower) <= exact <= float(e.upper)
  assert float(e.upper) - float(e.lower) <= 0.022
  assert abs(float(e.estimate) - exact) < 1e-4


def test_gaussian_sensitivity_scales_like_sigma():
  a = jaxacct.epsilon([(jaxacct.Gaussian(4.0, sensitivity=2.0), 30)], 1e-6)
  b = jaxacct.epsilon([(jaxacct.Gaussian(2.0), 30)], 1e-6)
  assert abs(float(a.estimate) - float(b.estimate)) < 1e-9


@pytest.mark.parametrize("eps0, k, eps", [(0.1, 100, 0.5), (0.1, 100, 1.0), (0.1, 100, 2.0),
                                          (1.0, 10, 3.0), (0.5, 400, 6.0)])
def test_pure_dp_delta_exact(eps0, k, eps):
  exact = pure_dp_delta(eps, eps0, k)
  r = jaxacct.delta([(jaxacct.PureDP(eps0), k)], eps)
  assert int(r.status) == 0
  assert float(r.lower) <= exact <= float(r.upper)
  assert float(r.upper) - float(r.lower) <= 5e-3
  assert abs(float(r.estimate) - exact) <= 2e-3 * exact  # atoms: the estimate converges slower


def test_pure_dp_values_of_the_exact_composition():
  # 100-fold 0.1-DP: the exact curve (Kairouz, Oh and Viswanath 2015; binary randomized response
  # attains it), delta = E[(1 - e^{eps - Y})_+], Y = 0.1 (2 J - 100), J ~ Bin(100, e^0.1 /
  # (1 + e^0.1)): conftest's pure_dp_delta.
  for eps, expected in [(0.5, 2.392542e-01), (1.0, 1.256884e-01), (2.0, 2.014018e-02)]:
    assert abs(pure_dp_delta(eps, 0.1, 100) - expected) < 1e-6
    r = jaxacct.delta([(jaxacct.PureDP(0.1), 100)], eps)
    assert int(r.status) == 0
    assert float(r.lower) <= expected <= float(r.upper)
    assert float(r.upper) - float(r.lower) <= 5e-3


def test_approximate_dp_delta_at_zero():
  # (0, 1e-7)-DP composed 1e4 times: delta(0) = 1 - (1 - 1e-7)^1e4 = 9.995002160e-4.
  r = jaxacct.delta([(jaxacct.EpsilonDelta(0.0, 1e-7), 10_000)], 0.0)
  exact = -math.expm1(10_000 * math.log1p(-1e-7))
  assert abs(exact - 9.995002160e-04) < 1e-12
  assert float(r.lower) <= exact <= float(r.upper)
  assert float(r.lower) > 0.99 * exact
  # Spreading each grid mass over its cell costs O(h) next to an atom at eps: still 1e-4 relative.
  assert abs(float(r.estimate) - exact) < 1e-4 * exact


def test_approximate_dp_infinite_mass():
  # (1, 1e-6)-DP x 100: delta(eps) >= 1 - (1 - 1e-6)^100 for every eps; epsilon(delta) = inf below.
  comp = [(jaxacct.EpsilonDelta(1.0, 1e-6), 100)]
  floor = -math.expm1(100 * math.log1p(-1e-6))
  # (eps above the largest finite loss)
  assert float(jaxacct.delta(comp, 101.0).estimate) == pytest.approx(floor, rel=1e-9)
  r = jaxacct.epsilon(comp, 0.5 * floor)
  assert math.isinf(float(r.estimate)) and math.isinf(float(r.upper))


@pytest.mark.parametrize("base, atom", [
    (jaxacct.EpsilonDelta(1.0, 1e-3), 1e-3), (jaxacct.PureDP(0.5), 0.0),
    (jaxacct.Gaussian(1.0), 0.0), (jaxacct.Laplace(2.0), 0.0)])
@pytest.mark.parametrize("rate", [1.0, 0.3])
def test_subsampled_infinite_mass_in_both_directions(base, atom, rate):
  # P(L = +inf): remove q * delta; add delta at q = 1 (the base's -inf atom under Q), else 0.
  model = jaxacct.PoissonSampled(base, rate)
  with jax.enable_x64(True):
    assert float(model.inf_mass(add=False)) == pytest.approx(rate * atom, abs=1e-300)
    assert float(model.inf_mass(add=True)) == pytest.approx(atom if rate == 1.0 else 0.0,
                                                            abs=1e-300)
    # The same atom as the base's CDF at the bottom of every loss grid, under Q.
    assert float(base.cdf_sf(jax.numpy.asarray(-1e4))[2]) == pytest.approx(atom, abs=1e-300)


def test_too_small_window_widens_honestly(monkeypatch):
  # A window far too small for the composed loss: the bounds stay valid and the status says so.
  import dataclasses
  from jaxacct import results
  from jaxacct.pld import accountant
  comp = jaxacct.Composition.of((jaxacct.Gaussian(10.0), 1000))
  exact = gaussian_epsilon(1e-5, math.sqrt(1000) / 10.0)
  plan = jaxacct.make_plan(comp, 1e-5)
  small = dataclasses.replace(plan, fft_size=plan.fft_size // 4,
                              low_frequencies=min(plan.low_frequencies, plan.fft_size // 8))
  r = jaxacct.epsilon(comp, 1e-5, plan=small)
  assert int(r.status) & results.WINDOW_TOO_SMALL
  # The widened upper stays finite (26.45 against the exact 17.86); the widened lower collapses
  # to the trivial bound 0.
  assert math.isfinite(float(r.upper))
  assert float(r.lower) == 0.0 <= exact <= float(r.upper)
  # Planned by jaxacct itself, the same shortfall is retried with a larger window.
  monkeypatch.setattr(accountant._plan, "make_plan", lambda *a, **k: small)
  retried = jaxacct.epsilon(comp, 1e-5)
  assert int(retried.status) == 0
  assert float(retried.lower) <= exact <= float(retried.upper)
  assert float(retried.upper) - float(retried.lower) <= 0.022


HOST_MODELS = [
    jaxacct.Gaussian(0.7), jaxacct.Gaussian(2.0, 1.5), jaxacct.Laplace(1.3),
    jaxacct.EpsilonDelta(1.0, 1e-3), jaxacct.PureDP(0.5),
    jaxacct.PoissonSampled(jaxacct.Gaussian(1.0), 0.01),
    jaxacct.PoissonSampled(jaxacct.Gaussian(0.6), 1.0),
    jaxacct.PoissonSampled(jaxacct.Laplace(2.0), 0.3),
    jaxacct.PoissonSampled(jaxacct.EpsilonDelta(1.0, 1e-4), 0.2),
    jaxacct.SampledGaussianReplaceOne(1.0, 0.05), jaxacct.SampledGaussianReplaceOne(0.8, 1.0),
    RandomizedResponse(0.3, 5.0), RandomizedResponse(0.6, 2.0)]


@pytest.mark.parametrize("model", HOST_MODELS, ids=lambda m: type(m).__name__)
def test_models_evaluate_alike_on_the_host_and_in_jax(model):
  # The planner evaluates cdf_sf and loss_range with numpy (nothing compiled); the accountant in
  # JAX. Both must be the same function.
  loss = np.linspace(-40.0, 40.0, 4001)
  host = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), model)
  with jax.enable_x64(True), np.errstate(all="ignore"):
    in_jax = jax.tree_util.tree_map(lambda a: jax.numpy.asarray(a, np.float64), model)
    for add in (False, True):
      on_host = host.cdf_sf(loss, add)
      assert all(isinstance(v, np.ndarray) for v in on_host)
      for h, j in zip(on_host, in_jax.cdf_sf(jax.numpy.asarray(loss), add)):
        j = np.asarray(j)
        normal = np.abs(j) > 1e-300  # (JAX flushes subnormals to zero)
        # (Far normal tails: erfc(x) ~ e^{-x^2} carries the rounding of x^2 ~ 1e3 in JAX.)
        np.testing.assert_allclose(h[normal], j[normal], rtol=1e-11)
        assert np.all(h[~normal] < 1e-300)
      np.testing.assert_allclose(np.asarray(host.loss_range(np.float64(-30.0), add), float),
                                 np.asarray(in_jax.loss_range(np.float64(-30.0), add), float),
                                 rtol=1e-13)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _JaxOnlyGaussian(jaxacct.PrivacyLoss):
  """A user's model written with jax.numpy alone, one loss value at a time (vmapped over the
  grid): the planner runs it eagerly, one setting at a time."""

  sigma: jax.Array

  def cdf_sf(self, loss, add=False):
    mu = 1.0 / self.sigma
    norm = jax.scipy.stats.norm
    one = lambda l: (norm.cdf((l - 0.5 * mu**2) / mu), norm.sf((l - 0.5 * mu**2) / mu),
                     norm.cdf((l + 0.5 * mu**2) / mu), norm.sf((l + 0.5 * mu**2) / mu))
    return jax.vmap(one)(loss)

  def loss_range(self, log_tail, add=False):
    mu = 1.0 / self.sigma
    z = jax.numpy.sqrt(-2.0 * log_tail)
    return -0.5 * mu**2 - z * mu, 0.5 * mu**2 + z * mu


def test_a_model_written_with_jax_numpy_only_is_planned_and_accounted():
  sigma, steps, delta = 4.0, 300, 1e-6
  exact = gaussian_epsilon(delta, math.sqrt(steps) / sigma)
  r = jaxacct.epsilon([(_JaxOnlyGaussian(sigma), steps)], delta)
  assert int(r.status) == 0
  assert float(r.lower) <= exact <= float(r.upper)
  assert abs(float(r.estimate) - exact) <= 1e-4
  swept = jaxacct.epsilon([(_JaxOnlyGaussian(np.array([4.0, 8.0])), steps)], delta)
  exact = gaussian_epsilon(delta, math.sqrt(steps) / 8.0)
  assert float(swept.lower[1]) <= exact <= float(swept.upper[1])


def test_an_entry_with_count_zero_changes_nothing():
  # Also on a coarse grid (eps_error 1), where some tilts' MGF is +inf (0 x inf must not be NaN).
  exact = gaussian_epsilon(1e-5, 2.0)
  for eps_error in (0.01, 1.0):
    r = jaxacct.epsilon([(jaxacct.Gaussian(0.5), 1), (jaxacct.Gaussian(0.5), 0)], 1e-5,
                        eps_error=eps_error)
    assert int(r.status) == 0
    assert float(r.lower) <= exact <= float(r.upper)


# The certified upper at the default plan is tight (its own bias, not only the bracket): within
# 2e-4 max(1, eps) of the truth for continuous losses at any number of steps, few included, and
# within 1e-3 for losses with atoms (Laplace, pure DP), where a grid's error is first order.
FEW_GAUSSIAN = [(sigma, steps, delta) for sigma in (0.5, 1.0, 5.0, 20.0) for steps in (1, 10)
                for delta in (1e-3, 1e-10)]


@pytest.mark.parametrize("sigma, steps, delta", FEW_GAUSSIAN)
def test_upper_is_tight_for_few_gaussian_steps(sigma, steps, delta):
  exact = gaussian_epsilon(delta, math.sqrt(steps) / sigma)
  r = jaxacct.epsilon([(jaxacct.Gaussian(sigma), steps)], delta)
  assert int(r.status) == 0
  assert exact <= float(r.upper) <= exact + 2e-4 * max(1.0, exact)


ATOMS = ([("pure", e0, k, d) for e0 in (0.1, 1.0, 2.0) for k in (1, 10) for d in (1e-5, 1e-10)]
         + [("laplace", b, k, d) for b in (1.0, 10.0) for k in (1, 2) for d in (1e-5, 1e-10)])


@pytest.mark.parametrize("kind, parameter, steps, delta", ATOMS)
def test_upper_is_tight_for_few_steps_with_atoms(kind, parameter, steps, delta):
  if kind == "pure":
    model, curve = jaxacct.PureDP(parameter), lambda e: pure_dp_delta(e, parameter, steps)
    high = parameter * steps
  else:
    model, curve = jaxacct.Laplace(parameter), lambda e: laplace_delta(e, 1.0 / parameter, steps)
    high = steps / parameter
  exact = epsilon_of(curve, delta, high)
  r = jaxacct.epsilon([(model, steps)], delta)
  assert int(r.status) == 0
  assert float(r.lower) <= exact <= float(r.upper) <= exact + 1e-3 * max(1.0, exact)


@pytest.mark.parametrize("entries, delta, exact", [
    ([(jaxacct.Gaussian(2.0), 50)], 1e-6, lambda: gaussian_epsilon(1e-6, math.sqrt(50) / 2.0)),
    ([(jaxacct.Gaussian(0.8), 3)], 1e-10, lambda: gaussian_epsilon(1e-10, math.sqrt(3) / 0.8)),
    ([(jaxacct.PureDP(0.5), 30)], 1e-5,
     lambda: epsilon_of(lambda e: pure_dp_delta(e, 0.5, 30), 1e-5, 15.0)),
    ([(jaxacct.Laplace(1.0), 2)], 1e-4,
     lambda: epsilon_of(lambda e: laplace_delta(e, 1.0, 2), 1e-4, 2.0)),
])
def test_the_host_estimate_lies_at_the_closed_form_from_above(entries, delta, exact):
  """``pld.host.epsilon`` (numpy, nothing compiled: a calibration's start) composes the
  accountant's dominating discretisation: at or above the exact epsilon, within the plan's
  eps_error (0.01) of it."""
  from jaxacct.pld import host, make_plan
  comp = jaxacct.Composition.of(*entries)
  eps, _ = host.epsilon(comp, delta, make_plan(comp, delta))
  truth = exact()
  assert truth * (1 - 1e-9) <= eps <= truth + 0.01, (eps, truth)
