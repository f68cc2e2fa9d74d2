"""Extreme settings (tiny q, large sigma, T = 1e6, delta 1e-10 and 1e-12) against dp-accounting.

dp-accounting's pessimistic PLD certifies an upper bound of the truth, its optimistic one a lower
bound; our bracket must be consistent with both, and every one of these settings must be
certified (status 0, finite bounds). (A delta below the numerical floor, where the upper is +inf
with the BELOW_FLOOR status, is tested in test_inputs.py.)
"""

import logging
import math

import numpy as np
import pytest

import jaxacct
from jaxacct import results
from dp_accounting.pld import privacy_loss_distribution as dpa_pld

logging.getLogger().setLevel(logging.ERROR)

CASES = [  # sigma, q, T, delta, dp-accounting grid step
    (1.0, 1e-5, 100_000, 1e-10, 1e-6),
    (10.0, 1e-4, 1_000, 1e-6, 1e-7),
    (50.0, 0.5, 10_000, 1e-8, 1e-5),
    (1.0, 1e-3, 1_000_000, 1e-5, 2e-5),
    (0.6, 0.02, 2_000, 1e-10, 1e-4),
    (2.0, 0.01, 5_000, 1e-12, 1e-4),
]


def _dpa(sigma, rate, steps, delta, step, pessimistic):
  mech = dpa_pld.from_gaussian_mechanism(standard_deviation=sigma, sampling_prob=rate,
                                         value_discretization_interval=step,
                                         pessimistic_estimate=pessimistic,
                                         use_connect_dots=pessimistic)
  return mech.self_compose(steps).get_epsilon_for_delta(delta)


@pytest.mark.slow
@pytest.mark.parametrize("sigma, rate, steps, delta, step", CASES)
def test_extreme_settings(sigma, rate, steps, delta, step):
  r = jaxacct.dpsgd_epsilon(sigma, rate, steps, delta)
  upper_ref = _dpa(sigma, rate, steps, delta, step, True)
  lower_ref = _dpa(sigma, rate, steps, delta, step, False)
  lower, estimate, upper = float(r.lower), float(r.estimate), float(r.upper)
  # Every one of these settings lies above the numerical floor: certified, finite bounds.
  assert int(r.status) == 0
  assert math.isfinite(lower) and math.isfinite(upper)
  assert lower <= upper_ref
  assert lower <= estimate <= upper
  assert upper >= lower_ref
  assert abs(estimate - upper_ref) <= 1e-3 * max(1.0, upper_ref)


@pytest.mark.parametrize("accountant", ["pld", "spa", "edgeworth", "rdp", "gdp"])
@pytest.mark.parametrize("composition,eps", [
    (jaxacct.Composition.of((jaxacct.Gaussian(1.0), 1)), 40.0),
    (jaxacct.Composition.of((jaxacct.Gaussian(1.0), 1)), 2000.0),
    # The saddle point lies beyond the tilt grid (an upper bound from t = t_max).
    (jaxacct.Composition.of((jaxacct.PoissonSampled(jaxacct.Gaussian(9.43), 0.000586), 556)), 24.9),
])
def test_upper_delta_never_underflows_to_zero(accountant, composition, eps):
  """The true delta is positive however large eps is; an upper bound below float64's range is
  reported as the smallest normal number with the UPPER_FLOORED status, never 0 (nor nan). The
  one exception is GDP on subsampled steps: a central-limit estimate that certifies nothing
  (upper nan, status APPROXIMATION)."""
  r = jaxacct.delta(composition, eps, accountant=accountant)
  upper, status = float(r.upper), int(r.status)
  tiny = np.finfo(np.float64).tiny
  if accountant == "gdp" and isinstance(composition.mechanisms[0], jaxacct.PoissonSampled):
    assert math.isnan(upper) and status & results.APPROXIMATION, (upper, status)
    return
  assert math.isfinite(upper) and tiny <= upper <= 1.0, (upper, status)
  if upper == tiny:
    assert status & results.UPPER_FLOORED, (upper, status)


@pytest.mark.parametrize("accountant", ["pld", "spa", "edgeworth", "rdp", "gdp"])
def test_upper_delta_at_huge_eps_is_no_larger_than_at_a_smaller_eps(accountant):
  """The true delta is non-increasing in eps, so upper(40) bounds delta(2000) too: at eps = 2000
  (e^eps overflows float64) the upper must still be a number, and no larger."""
  comp = jaxacct.Composition.of((jaxacct.Gaussian(1.0), 1))
  at_40 = float(jaxacct.delta(comp, 40.0, accountant=accountant).upper)
  at_2000 = float(jaxacct.delta(comp, 2000.0, accountant=accountant).upper)
  assert math.isfinite(at_2000) and at_2000 <= at_40, (at_2000, at_40)
