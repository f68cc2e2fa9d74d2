"""Individual filters: the GDP filter against an exact (Fraction) re-implementation of Alg. 1 of
Koskela et al., the paper's numbers, the ledger's rounding, bad input and life inside jit."""

import dataclasses
import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxacct import gdp, individual
from conftest import gaussian_epsilon

DTYPES = [np.float32, np.float64]


def _run(f, norms_by_step, valid_by_step, dtype, new_state=None):
  """Runs the filter over a [T, N] table of norms (every example listed at every step; invalid
  entries padded), returning the states and outputs of every step."""
  n = norms_by_step.shape[1]
  with jax.enable_x64(dtype == np.float64):
    update = jax.jit(f.update)
    state = f.init() if new_state is None else new_state
    states, outs = [], []
    for norms, valid in zip(norms_by_step, valid_by_step):
      state, out = update(state, jnp.asarray(norms, dtype), jnp.arange(n), jnp.asarray(valid))
      states.append(jax.device_get(state))
      outs.append(np.asarray(out))
  return states, outs


def _exact_alg1(norms_by_step, valid_by_step, budget, clip, sigma, may_return, rtol):
  """Alg. 1 in exact arithmetic: (active masks, exact spending, margins of each decision)."""
  n = norms_by_step.shape[1]
  spent = [Fraction(0)] * n
  halted = [False] * n
  limit = Fraction(budget) ** 2 * (1 + Fraction(rtol))
  masks, margins = [], []
  for norms, valid in zip(norms_by_step, valid_by_step):
    mask, margin = [], []
    for i in range(n):
      clipped = min(Fraction(float(norms[i])), Fraction(clip))
      mu_sq = (clipped / (Fraction(sigma) * Fraction(clip))) ** 2
      candidate = spent[i] + mu_sq
      ok = bool(valid[i]) and (may_return or not halted[i]) and candidate <= limit
      if ok:
        spent[i] = candidate
      elif valid[i] and (may_return or not halted[i]):
        halted[i] = True
      mask.append(ok)
      margin.append(abs(float((candidate - limit) / limit)))
    masks.append(mask)
    margins.append(margin)
  return np.array(masks), spent, np.array(margins)


def _recorded(state, i):
  """The ledger's recorded sum mu^2 of example i, exactly (double word times unit)."""
  return ((Fraction(float(state.spent[i])) + Fraction(float(state.spent_low[i])))
          * Fraction(float(state.unit)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(DTYPES),
       may_return=st.booleans(), steps=st.integers(1, 40))
def test_gdp_filter_matches_exact_algorithm_1_and_never_under_records(seed, dtype, may_return,
                                                                       steps):
  rng = np.random.default_rng(seed)
  n = 7
  clip = float(rng.uniform(0.1, 5.0))
  sigma = float(np.exp(rng.uniform(np.log(0.5), np.log(50.0))))
  budget = float(np.sqrt(rng.uniform(0.2, 1.0) * steps) / sigma)
  # Norms: a mix of tiny, moderate, exactly C and above C (clipped), some exactly 0.
  scale = clip * np.exp(rng.uniform(-6.0, 1.0, (steps, n)))
  norms = np.where(rng.random((steps, n)) < 0.1, clip, scale)
  norms = np.where(rng.random((steps, n)) < 0.05, 0.0, norms).astype(dtype)
  valid = rng.random((steps, n)) < 0.85
  f = individual.gdp_filter(budget, clip, sigma, n, may_return=may_return, dtype=dtype)
  states, outs = _run(f, norms, valid, dtype)
  masks, exact_spent, margins = _exact_alg1(norms, valid, budget, clip, sigma, may_return,
                                            individual.filters.DEFAULT_RTOL)
  tolerance = 1e-5 if dtype == np.float32 else 1e-12
  got = np.array(outs)
  differ = got != masks
  # The float ledger may refuse a step the exact one takes, only at a near-tie; never the reverse
  # while the histories agree.
  first = np.argwhere(differ)
  if first.size:
    t, i = first[0]
    assert not got[t, i] and masks[t, i], (t, i)
    assert margins[t, i] <= tolerance, margins[t, i]
  else:
    final = states[-1]
    limit = Fraction(budget) ** 2 * (1 + Fraction(individual.filters.DEFAULT_RTOL))
    ulp = Fraction(float(np.finfo(dtype).eps))
    for i in range(n):
      recorded = _recorded(final, i)
      assert recorded >= exact_spent[i]  # never below the exact spending
      assert recorded <= limit * (1 + 4 * ulp)  # within the budget (the unit's rounding)
      # ... and close: a few ulps per charge, not one ulp of the total per step.
      assert recorded <= exact_spent[i] * (1 + 8 * ulp) + Fraction(2) ** -90 * steps
  if not may_return:  # monotone: once refused (while valid), never active again
    refused = valid & ~got
    for i in range(n):
      hit = np.flatnonzero(refused[:, i])
      if hit.size:
        assert not got[hit[0]:, i].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fill_up_spends_the_budget_exactly(dtype):
  rng = np.random.default_rng(3)
  n, steps, clip, sigma = 16, 60, 1.0, 4.0
  budget = 1.3
  norms = (clip * rng.uniform(0.2, 1.5, (steps, n))).astype(dtype)
  valid = np.ones((steps, n), bool)
  f = individual.gdp_filter(budget, clip, sigma, n, fill_up=True, dtype=dtype)
  states, outs = _run(f, norms, valid, dtype)
  outs = np.array(outs)
  assert outs.min() >= 0.0 and outs.max() <= 1.0
  partial = (outs > 0) & (outs < 1)
  assert partial.any(axis=0).all()  # every example was topped up once in 60 steps
  final = states[-1]
  target = Fraction(budget) ** 2
  for i in range(n):
    recorded = _recorded(final, i)
    ulp = Fraction(float(np.finfo(dtype).eps))
    assert target * (1 - 2 * ulp) <= recorded <= target * (1 + 2 * ulp)
    # The exact spending: the full steps plus the topped-up step (scale^2 mu^2).
    exact = Fraction(0)
    for t in range(steps):
      clipped = min(Fraction(float(norms[t, i])), Fraction(clip))
      mu_sq = (clipped / (Fraction(sigma) * Fraction(clip))) ** 2
      exact += Fraction(float(outs[t, i])) ** 2 * mu_sq
    assert exact <= target
    assert exact >= target * (1 - 64 * ulp)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paper_sigma_100_gdp_runs_495_steps_where_rdp_allows_420(dtype):
  from dp_accounting import dp_event
  from dp_accounting.rdp import rdp_privacy_accountant
  accountant = rdp_privacy_accountant.RdpAccountant(orders=list(range(2, 33)))
  accountant.compose(dp_event.GaussianDpEvent(100.0), 420)
  eps_rdp = accountant.get_epsilon(1e-5)
  assert abs(eps_rdp - 0.815630) < 1e-6  # the digest's value
  budget = float(gdp.mu_of_eps_delta(eps_rdp, 1e-5))
  f = individual.gdp_filter(budget, 1.0, 100.0, 3, dtype=dtype)
  norms = np.full((500, 3), 2.0, dtype)  # clipped: the worst case
  _, outs = _run(f, norms, np.ones((500, 3), bool), dtype)
  taken = np.array(outs).sum(axis=0)
  assert list(taken) == [495, 495, 495]
  assert f.guarantee(1e-5) <= eps_rdp * (1 + 1e-9)  # B sqrt(1 + rtol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mimic_setting_gives_epsilon_2_751021(dtype):
  sigma = 10.614652581338738
  budget = math.sqrt(50) / sigma
  f = individual.gdp_filter(budget, 0.7872438989061009, sigma, 2, dtype=dtype)
  norms = np.array([[5.0, 0.3]] * 60, dtype)
  states, outs = _run(f, norms, np.ones((60, 2), bool), dtype)
  outs = np.array(outs)
  assert outs[:50, 0].all() and not outs[50:, 0].any()  # 50 clipped steps, then filtered
  assert outs[:, 1].all()
  reference = gaussian_epsilon(1e-5, budget)
  assert abs(reference - 2.751021) < 5e-7
  assert 0 <= f.guarantee(1e-5) - reference < 1e-8  # B sqrt(1 + rtol)
  with jax.enable_x64(dtype == np.float64):
    odometer = np.asarray(f.odometer(states[-1], 1e-5))
  assert reference <= odometer[0] <= reference * (1 + 8 * np.finfo(dtype).eps) + 1e-6
  mu_1 = float(individual.spent_mu(states[-1])[1])
  assert gaussian_epsilon(1e-5, mu_1) <= odometer[1]


@pytest.mark.parametrize("delta", [1e-3, 1e-5, 1e-10])
def test_odometer_bounds_the_exact_epsilon_from_above_and_closely(delta):
  rng = np.random.default_rng(1)
  n, sigma, budget = 400, 3.0, 2.0
  f = individual.gdp_filter(budget, 1.0, sigma, n)
  with jax.enable_x64(True):
    f = individual.gdp_filter(budget, 1.0, sigma, n)
    state = f.init()
    spent = np.concatenate([[0.0, 1e-12], rng.uniform(0, budget**2 * sigma**2, n - 2)])
    state = dataclasses.replace(state, spent=jnp.asarray(spent))
    odometer = np.asarray(f.odometer(state, delta))
    mu = np.asarray(individual.spent_mu(state))
  # (The table's interpolation against gdp's exact inversion, itself checked against mpmath.)
  exact = np.asarray(gdp.epsilon_of_mu(np.maximum(mu, 1e-300), delta))
  assert np.all(odometer >= exact)
  assert np.all(odometer <= exact * (1 + 2e-4) + 1e-6)


def test_update_compiles_in_a_float32_program_with_no_host_callback(x64_off):
  f = individual.gdp_filter(0.5, 1.0, 2.0, 100)

  @jax.jit
  def step(state, norms, indices, valid):
    state, active = f.update(state, norms, indices, valid)
    return state, active, f.odometer(state, 1e-5)

  state = f.init()
  args = (jnp.linspace(0.0, 2.0, 10), jnp.arange(10) * 7, jnp.arange(10) < 8)
  text = str(jax.make_jaxpr(step)(state, *args))
  assert "callback" not in text and "f64" not in text
  state, active, eps = step(state, *args)
  assert state.spent.dtype == jnp.float32 and eps.dtype == jnp.float32
  assert active.tolist() == [True] * 8 + [False] * 2
  leaves, tree = jax.tree_util.tree_flatten(state)
  again = jax.device_put(jax.tree_util.tree_unflatten(tree, leaves))
  assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: bool(jnp.all(a == b)),
                                                       state, again))


def test_nan_and_negative_norms_under_jit_are_charged_as_the_clip_norm(x64_off):
  f = individual.gdp_filter(1.0, 1.0, 2.0, 4)
  state, _ = jax.jit(f.update)(f.init(), jnp.array([jnp.nan, -1.0, jnp.inf, 0.5]),
                               jnp.arange(4), jnp.ones(4, bool))
  spent = np.asarray(state.spent)
  assert spent[:3].tolist() == [1.0, 1.0, 1.0]
  assert 0.25 <= spent[3] <= 0.25 * (1 + 4e-7)  # (rounded up)


def test_out_of_range_indices_under_jit_are_skipped(x64_off):
  f = individual.gdp_filter(1.0, 1.0, 2.0, 4)
  state, active = jax.jit(f.update)(f.init(), jnp.ones(3), jnp.array([0, 4, -1]),
                                    jnp.ones(3, bool))
  assert active.tolist() == [True, False, False]
  assert np.asarray(state.spent).tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("call, message", [
    (lambda: individual.gdp_filter(0.0, 1.0, 1.0, 3), "budget"),
    (lambda: individual.gdp_filter(-1.0, 1.0, 1.0, 3), "budget"),
    (lambda: individual.gdp_filter(1.0, 0.0, 1.0, 3), "clip_norm"),
    (lambda: individual.gdp_filter(1.0, 1.0, float("nan"), 3), "noise_multiplier"),
    (lambda: individual.gdp_filter(1.0, 1.0, 1.0, 0), "num_examples"),
    (lambda: individual.gdp_filter([1.0, 2.0], 1.0, 1.0, 3), "budget"),
])
def test_bad_hyper_parameters_are_refused_by_name(call, message):
  with pytest.raises(ValueError, match=message):
    call()


@pytest.mark.parametrize("norms, indices, valid, message", [
    ([1.0, -0.5], [0, 1], [True, True], "norms"),
    ([1.0, float("nan")], [0, 1], [True, True], "norms"),
    ([1.0, 1.0], [0, 3], [True, True], "indices"),
    ([1.0, 1.0], [1, 1], [True, True], "distinct"),
    ([1.0, 1.0, 1.0], [0, 1], [True, True], "shape"),
    ([1.0, 1.0], [0, 1], [True], "shape"),
    ([1.0, 1.0], [0.0, 1.0], [True, True], "integers"),
    ([1.0, 1.0], [0, 1], [1, 1], "boolean"),
])
def test_bad_batches_are_refused_by_name(norms, indices, valid, message):
  f = individual.gdp_filter(1.0, 1.0, 1.0, 3)
  with pytest.raises(ValueError, match=message):
    f.update(f.init(), jnp.asarray(norms), jnp.asarray(indices), jnp.asarray(valid))


def test_invalid_entries_may_hold_anything():
  f = individual.gdp_filter(1.0, 1.0, 1.0, 3)
  state, active = f.update(f.init(), jnp.array([0.5, jnp.nan, -3.0]), jnp.array([2, 2, 99]),
                           jnp.array([True, False, False]))
  assert active.tolist() == [True, False, False]
  spent = np.asarray(state.spent)
  assert spent[:2].tolist() == [0.0, 0.0] and 0.25 <= spent[2] <= 0.25 * (1 + 4e-7)


def test_per_example_budgets_and_microbatched_steps():
  f = individual.gdp_filter(np.array([1.0, 2.0, 3.0]), 1.0, 1.0, 3)
  state = f.init()
  for _ in range(10):  # one step in two microbatches
    state, _ = f.update(state, jnp.ones(2), jnp.array([0, 1]), jnp.ones(2, bool))
    state, _ = f.update(state, jnp.ones(1), jnp.array([2]), jnp.ones(1, bool), new_step=False)
  assert int(state.steps) == 10
  assert np.asarray(state.spent).tolist() == [1.0, 4.0, 9.0]


# ----------------------------------------------------------------------------------------------
# RDP filter


def _dp_accounting_rdp(sigmas, q, orders):
  """dp-accounting's RDP of a heterogeneous sequence of (subsampled) Gaussian steps."""
  from dp_accounting import dp_event
  from dp_accounting.rdp import rdp_privacy_accountant
  accountant = rdp_privacy_accountant.RdpAccountant(orders=list(orders))
  for sigma in sigmas:
    event = dp_event.GaussianDpEvent(sigma)
    accountant.compose(event if q == 1 else dp_event.PoissonSampledDpEvent(q, event))
  return accountant


def _recorded_rdp(state):
  return np.asarray(state.spent, np.float64) + np.asarray(state.spent_low, np.float64)


@pytest.mark.parametrize("q, dtype", [(0.01, np.float64), (0.01, np.float32), (1.0, np.float64),
                                      (1.0, np.float32)])
def test_rdp_ledger_matches_dp_accounting_for_the_same_heterogeneous_sequence(q, dtype):
  rng = np.random.default_rng(5)
  n, steps, sigma, clip = 4, 25, 1.5, 2.0
  # Integer orders: there dp-accounting's subsampled-Gaussian RDP is exact (at fractional
  # orders it is an upper bound, ~3% above the quadrature at 1.25, which jaxacct.rdp matches).
  orders = [2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 128.0]
  norms = (clip * np.exp(rng.uniform(-3.0, 0.5, (steps, n)))).astype(dtype)
  f = individual.rdp_filter(1e6, clip, sigma, n, sampling_rate=q, orders=orders, dtype=dtype)
  states, outs = _run(f, norms, np.ones((steps, n), bool), dtype)
  assert np.array(outs).all()
  recorded = _recorded_rdp(states[-1])
  grid = individual.noise_grid(sigma)
  for i in range(n):
    ratios = np.minimum(norms[:, i].astype(np.float64), clip) / clip
    exact = sigma / ratios
    theirs = _dp_accounting_rdp(exact, q, orders)
    assert np.all(recorded[i] >= theirs._rdp * (1 - 1e-12))  # never below the exact sequence
    if q == 1:  # exact up to rounding
      np.testing.assert_allclose(recorded[i], theirs._rdp, rtol=8 * np.finfo(dtype).eps)
    else:  # the noise rounded down onto the grid: dp-accounting on the same grid values
      rounded = grid[np.searchsorted(grid, exact, side="right") - 1]
      same = _dp_accounting_rdp(rounded, q, orders)
      np.testing.assert_allclose(recorded[i], same._rdp, rtol=3e-6)
    # The odometer: dp-accounting's conversion over the same orders, from above.
    with jax.enable_x64(dtype == np.float64):
      odometer = float(f.odometer(states[-1], 1e-5)[i])
    reference = (same if q < 1 else theirs).get_epsilon(1e-5)
    assert reference <= odometer <= reference * (1 + 1e-5)
    exact_eps = theirs.get_epsilon(1e-5)  # the 2.3% grid costs a few percent of epsilon
    assert exact_eps <= odometer <= exact_eps * 1.1


@pytest.mark.parametrize("q", [0.02, 1.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rdp_budget_of_t_steps_admits_exactly_t_clipped_steps(q, dtype):
  steps = 40
  budget = individual.rdp_budget(3.0, q, steps)
  f = individual.rdp_filter(budget, 1.0, 3.0, 3, sampling_rate=q, dtype=dtype)
  norms = np.tile(np.array([5.0, 0.5, 0.5], dtype), (60, 1))
  valid = np.tile(np.array([True, True, False]), (60, 1))  # example 2 never listed
  states, outs = _run(f, norms, valid, dtype)
  outs, active = np.array(outs), np.array([s.active for s in states])
  assert outs[:steps, 0].all() and not outs[steps:, 0].any()
  assert outs[:, 1].all()
  if q < 1:  # the unlisted example is charged the worst case: it stops with the clipped one
    assert active[:steps, 2].all() and not active[steps:, 2].any()
  else:  # not in the step: charged nothing
    assert not active[:, 2].any() and _recorded_rdp(states[-1])[2].max() == 0
  assert abs(f.guarantee(1e-5) - float(individual.rdp_epsilon(budget, individual.DEFAULT_ORDERS,
                                                              1e-5))) < 1e-8 * f.guarantee(1e-5)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), alpha=st.sampled_from([1.5, 2.0, 8.0, 32.0]))
def test_rdp_filter_at_one_order_halts_like_the_gdp_filter(seed, alpha):
  """For Gaussian steps RDP_alpha = alpha mu^2 / 2: the filters stop on the same event when
  B_rdp = alpha B^2 / 2 (Koskela et al., App. A)."""
  rng = np.random.default_rng(seed)
  n, steps, sigma = 6, 30, 2.0
  budget = float(np.sqrt(rng.uniform(1.0, 20.0)) / sigma)
  norms = np.exp(rng.uniform(-2.0, 0.5, (steps, n)))
  valid = np.ones((steps, n), bool)
  with jax.enable_x64(True):
    gdp_f = individual.gdp_filter(budget, 1.0, sigma, n, dtype=np.float64)
    rdp_f = individual.rdp_filter(alpha * budget**2 / 2, 1.0, sigma, n, orders=[alpha],
                                  dtype=np.float64)
  _, gdp_out = _run(gdp_f, norms, valid, np.float64)
  _, rdp_out = _run(rdp_f, norms, valid, np.float64)
  differ = np.array(gdp_out) != np.array(rdp_out)
  if differ.any():  # only at a near-tie of the two roundings
    t, i = np.argwhere(differ)[0]
    spent = sum(min(norms[s, i], 1.0) ** 2 for s in range(t + 1) if gdp_out[s][i] or s == t)
    assert abs(spent / sigma**2 - budget**2) <= 1e-12 * budget**2


@pytest.mark.parametrize("call, message", [
    (lambda: individual.rdp_filter(1.0, 1.0, 2.0, 3, sampling_rate=0.1, sigma_grid=[2.5, 3.0]),
     "does not cover"),
    (lambda: individual.rdp_filter(1.0, 1.0, 2.0, 3, sampling_rate=0.1, sigma_grid=[2.0, 1.9]),
     "increasing"),
    (lambda: individual.rdp_filter(1.0, 1.0, 2.0, 3, orders=[0.5, 2.0]), "orders"),
    (lambda: individual.rdp_filter(-1.0, 1.0, 2.0, 3), "budget"),
    (lambda: individual.rdp_filter(1.0, 1.0, 2.0, 3, sampling_rate=1.5), "sampling_rate"),
])
def test_bad_rdp_filters_are_refused_by_name(call, message):
  with pytest.raises(ValueError, match=message):
    call()


def test_subsampled_rdp_steps_come_in_one_update():
  f = individual.rdp_filter(1.0, 1.0, 2.0, 3, sampling_rate=0.1)
  with pytest.raises(ValueError, match="one update"):
    f.update(f.init(), jnp.ones(2), jnp.arange(2), jnp.ones(2, bool), new_step=False)


# ----------------------------------------------------------------------------------------------
# Per-example DP-SGD accounting (bucket counts)


def _dp_accounting_heterogeneous(sigmas_and_counts, q):
  from dp_accounting import dp_event
  return dp_event.ComposedDpEvent([
      dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(s)),
                                   int(c)) for s, c in sigmas_and_counts if c > 0])


@pytest.fixture(scope="module")
def dpsgd_report():
  """20 examples with random per-step norms through the in-step counter, and their report."""
  rng = np.random.default_rng(11)
  n, steps, q, sigma, clip = 20, 80, 0.05, 1.2, 1.0
  counter = individual.bucket_counter(sigma, clip, q, n)
  update = jax.jit(counter.update)
  state = counter.init()
  levels = np.exp(rng.uniform(np.log(0.05), np.log(2.0), n))
  for _ in range(steps):
    state = update(state, jnp.asarray(levels * rng.uniform(0.3, 1.3, n), jnp.float32),
                   jnp.arange(n), jnp.ones(n, bool))
  return counter, state, counter.report(state, 1e-5), individual.noise_grid(sigma), q


@functools.lru_cache(maxsize=None)
def _dp_accounting_step_pld(sigma, q, pessimistic):
  """dp-accounting's PLD of one Poisson-subsampled Gaussian step (discretisation 1e-4): the
  pessimistic one by connect-the-dots, as its PLDAccountant makes it; the optimistic one by
  privacy buckets, the only method it offers for that estimate."""
  from dp_accounting.pld import privacy_loss_distribution
  return privacy_loss_distribution.from_gaussian_mechanism(
      sigma, pessimistic_estimate=pessimistic, value_discretization_interval=1e-4,
      sampling_prob=q, use_connect_dots=pessimistic)


def _dp_accounting_pld_epsilon(sigmas_and_counts, q, delta, pessimistic):
  """dp-accounting's PLD epsilon of a heterogeneous sequence, composed as its PLDAccountant
  composes it (the identity, then each entry's step self-composed, in turn); each step's PLD is
  made once per noise level (the accountant remakes it for every entry of every sequence)."""
  from dp_accounting.pld import privacy_loss_distribution
  pld = privacy_loss_distribution.identity(value_discretization_interval=1e-4,
                                                pessimistic_estimate=pessimistic)
  for sigma, count in sigmas_and_counts:
    if count > 0:
      pld = pld.compose(_dp_accounting_step_pld(float(sigma), q, pessimistic).self_compose(
          int(count)))
  return pld.get_epsilon_for_delta(delta)


def test_per_example_pld_bracket_contains_dp_accounting(dpsgd_report):
  from dp_accounting.pld import pld_privacy_accountant
  _, state, report, grid, q = dpsgd_report
  counts = np.asarray(state.counts)
  assert counts.sum() == 80 * 20
  # The shortest sequence through dp-accounting's PLDAccountant itself: the same epsilon.
  short = int(np.argmin(np.sum(counts > 0, axis=1)))
  accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
  accountant.compose(_dp_accounting_heterogeneous(zip(grid, counts[short]), q))
  assert accountant.get_epsilon(1e-5) == _dp_accounting_pld_epsilon(zip(grid, counts[short]), q,
                                                                     1e-5, True)
  # Against dp-accounting's own composition: four examples across the range of epsilons (the
  # smallest and largest upper and two between), each 1-4 s of dp-accounting; the other rows
  # are the same program's answers on other counts (their status and width checked here).
  assert np.all(np.asarray(report.pld.status) == 0)
  assert np.all(np.asarray(report.pld.upper) - np.asarray(report.pld.lower) < 0.05)
  by_upper = np.argsort(np.asarray(report.pld.upper))
  for i in by_upper[np.linspace(0, counts.shape[0] - 1, 4).round().astype(int)]:
    eps = {pessimistic: _dp_accounting_pld_epsilon(zip(grid, counts[i]), q, 1e-5, pessimistic)
           for pessimistic in (True, False)}
    lower, upper = float(report.pld.lower[i]), float(report.pld.upper[i])
    assert lower <= eps[False] <= eps[True] <= upper + 1e-4, (i, lower, eps, upper)


def test_certified_gdp_curve_lies_above_the_pld_upper_curve(dpsgd_report):
  from jaxacct.individual import dpsgd
  from jaxacct.pld import query, spectrum
  from jaxacct.pld.distribution import PrivacyLossDistribution
  _, state, report, grid, q = dpsgd_report
  counts = np.asarray(state.counts)
  eps = np.linspace(0.0, report.gdp_range, 400)

  @jax.jit
  def upper_curve(terms, row, plan):  # the direct query, point by point
    fields = spectrum.fields_from_terms(terms, row, plan)
    return query.delta_from_pld(PrivacyLossDistribution(plan=plan, **fields),
                                jnp.asarray(eps)).upper

  with jax.enable_x64(True):
    plan = dpsgd._plan_for(grid, q, 80, report.tail_delta, 0.01)
    terms, _ = dpsgd._stacked_terms(jnp.asarray(grid), q, plan)
    for i in range(0, counts.shape[0], 4):
      upper = np.asarray(upper_curve(terms, jnp.asarray(counts[i], jnp.float64), plan))
      curve = np.asarray(gdp.delta_of_mu(float(report.gdp_mu[i]), eps))
      assert np.all(curve + report.tail_delta >= upper), i
      assert np.all((curve >= upper) | (upper <= report.tail_delta)), i
  # A curve above the PLD's gives a larger epsilon; its RDP route larger still.
  assert np.all(report.gdp_epsilon >= report.pld.upper)
  assert np.all(report.gdp_rdp_epsilon >= report.gdp_epsilon - 1e-9)


def test_gdp_rdp_route_is_the_conversion_minimised_over_orders(dpsgd_report):
  """The RDP route's epsilon of each fitted mu against the conversion in closed form
  (alpha rho + (log(1/delta) - log alpha) / (alpha - 1) + log(1 - 1/alpha), rho = mu^2 / 2)
  minimised on a fine grid of orders in [1.001, 10^4]; the report's extreme cases too."""
  from jaxacct.individual import dpsgd
  _, _, report, _, _ = dpsgd_report
  alpha = 1.0 + np.geomspace(1e-3, 1e4 - 1.0, 400_001)
  for mu, eps in zip(report.gdp_mu, report.gdp_rdp_epsilon):
    rho = 0.5 * mu * mu
    conversion = (alpha * rho + (math.log(1e5) - np.log(alpha)) / (alpha - 1.0)
                  + np.log1p(-1.0 / alpha))
    assert conversion.min() * (1 - 1e-7) <= eps <= conversion.min() * (1 + 1e-12)
  mus = np.array([np.inf, 0.0, 1e-3, 0.5, 40.0])
  with jax.enable_x64(True):
    out = dpsgd._rdp_route(mus, 1e-5)
  assert out[0] == np.inf and out[1] == 0.0 and np.all(np.isfinite(out[2:]))
  assert np.all(np.diff(out[2:]) > 0)


def _fitted_mus(curves, eps_points, tail_delta):
  from jaxacct.individual import dpsgd
  with jax.enable_x64(True):
    fit = jax.jit(lambda c, e: jax.lax.map(lambda x: dpsgd._gdp_mu(x[1:], x[0], e, tail_delta),
                                           c))
    return np.asarray(fit(jnp.asarray(curves), jnp.asarray(eps_points)))


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_gdp_fit_is_the_largest_of_the_points_own_mus(noise):
  """The fitted mu is the largest over the live intervals of gdp.mu_of_eps_delta(eps_k,
  upper(eps_{k-1})), raised by 1e-9: on GDP-shaped curves (the interval at 0 binds: the fast
  path) and on noisy ones (a later interval binds: the fallback over all points); 0 with no
  live interval, +inf where a live one needs delta 1; a few points (fewer than the fit's
  candidates) too."""
  rng = np.random.default_rng(7)
  tail_delta = 1e-8
  for points in (96, 5):
    eps_points = np.sort(rng.uniform(0.002, rng.uniform(0.5, 8.0), points))
    mus = rng.uniform(0.05, 3.0, 24)
    curves = np.stack([np.asarray(gdp.delta_of_mu(m, np.concatenate([[0.0], eps_points])))
                       for m in mus])
    curves = np.minimum.accumulate(np.clip(
        curves * np.exp(rng.normal(0.0, noise, curves.shape)), 0.0, 1.0), axis=1)
    curves[0] = 0.0  # no live interval
    curves[1, :3] = 1.0  # an interval that needs delta 1
    fitted = _fitted_mus(curves, eps_points, tail_delta)
    assert fitted[0] == 0.0 and fitted[1] == np.inf
    for curve, mu in zip(curves[2:], fitted[2:]):
      lefts = curve[:-1]
      live = lefts > tail_delta
      if np.any(lefts[live] >= 1.0 - 1e-9):
        assert mu == np.inf
        continue
      # (at every point, then the live ones taken: one array shape, one program, per size)
      own = np.asarray(gdp.mu_of_eps_delta(eps_points, np.clip(lefts, 1e-300, 1.0 - 1e-9)))
      np.testing.assert_allclose(mu, own[live].max() * (1 + 1e-9), rtol=1e-11)
      assert np.all(np.asarray(gdp.delta_of_mu(mu, eps_points))[live] >= lefts[live])


@functools.lru_cache(maxsize=None)
def _dp_accounting_step_rdp(sigma, q, orders):
  """dp-accounting's RDP of one Poisson-subsampled Gaussian step at ``orders`` (its
  RdpAccountant's vector after that one event)."""
  from dp_accounting import dp_event
  from dp_accounting.rdp import rdp_privacy_accountant
  accountant = rdp_privacy_accountant.RdpAccountant(orders=list(orders))
  accountant.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)))
  return accountant.rdp


def _dp_accounting_rdp_epsilon(sigmas_and_counts, q, orders, delta):
  """dp-accounting's RDP epsilon of a heterogeneous sequence, composed as its RdpAccountant
  composes it (each entry's count times its step's RDP, added in turn) and converted by its
  compute_epsilon; each step's RDP is computed once per noise level (the accountant recomputes
  it for every entry of every sequence)."""
  from dp_accounting.rdp import rdp_privacy_accountant
  rdp = np.zeros(len(orders))
  for sigma, count in sigmas_and_counts:
    if count > 0:
      rdp += int(count) * _dp_accounting_step_rdp(float(sigma), q, tuple(orders))
  return rdp_privacy_accountant.compute_epsilon(list(orders), rdp, delta)[0]


def test_rdp_figure_matches_dp_accounting_rdp(dpsgd_report):
  from dp_accounting.rdp import rdp_privacy_accountant
  from jaxacct.individual import dpsgd
  _, state, report, grid, q = dpsgd_report
  counts = np.asarray(state.counts)
  # The shortest sequence through dp-accounting's RdpAccountant itself: the same epsilon.
  short = int(np.argmin(np.sum(counts > 0, axis=1)))
  accountant = rdp_privacy_accountant.RdpAccountant(orders=list(dpsgd.RDP_ORDERS))
  accountant.compose(_dp_accounting_heterogeneous(zip(grid, counts[short]), q))
  assert accountant.get_epsilon(1e-5) == _dp_accounting_rdp_epsilon(
      zip(grid, counts[short]), q, dpsgd.RDP_ORDERS, 1e-5)
  for i in range(counts.shape[0]):
    theirs = _dp_accounting_rdp_epsilon(zip(grid, counts[i]), q, dpsgd.RDP_ORDERS, 1e-5)
    # dp-accounting's fractional orders are an upper bound (jaxacct.rdp integrates exactly).
    assert theirs * 0.97 <= report.rdp_epsilon[i] <= theirs * (1 + 1e-6), i


def test_a_report_split_by_band_is_the_one_band_report_to_round_off(dpsgd_report):
  """The fixture's 20 examples fit in one chunk, so its report runs them all at the widest band
  they need; in chunks of 8 each band runs apart, in the examples' order again. The bounds agree
  to the wider band's round-off allowance (outward), the estimates to round-off."""
  from jaxacct.individual import dpsgd
  _, state, merged, grid, q = dpsgd_report
  counts = np.asarray(state.counts)
  split = dpsgd.per_example_privacy(counts, 80, grid, q, 1e-5, chunk=8)
  upper, lower = np.asarray(merged.pld.upper), np.asarray(merged.pld.lower)
  np.testing.assert_allclose(np.asarray(split.pld.upper), upper, rtol=1e-7)
  np.testing.assert_allclose(np.asarray(split.pld.lower), lower, rtol=1e-7)
  np.testing.assert_allclose(np.asarray(split.pld.estimate), np.asarray(merged.pld.estimate),
                             rtol=1e-10)
  assert np.all(np.asarray(split.pld.upper) <= upper * (1 + 1e-11))
  assert np.all(np.asarray(split.pld.lower) >= lower * (1 - 1e-11))
  assert len(np.unique(np.round(upper, 3))) > 10  # (distinct examples: an order mix-up would show)


def test_a_never_listed_example_counts_as_clipped(dpsgd_report):
  counter, state, _, grid, q = dpsgd_report
  from jaxacct.individual import dpsgd
  # (the fixture's 20 examples and 80 steps: the report's programs are the fixture's)
  counts = np.zeros((20, grid.size), np.int64)
  counts[0, 5] = 60  # listed 60 of 80 steps
  report = dpsgd.per_example_privacy(counts, 80, grid, q, 1e-5)
  alone = dpsgd.per_example_privacy(np.array([[80] + [0] * (grid.size - 1)] * 20), 80, grid, q,
                                    1e-5)
  assert float(report.pld.upper[1]) == float(alone.pld.upper[1])
  assert float(report.pld.upper[0]) < float(report.pld.upper[1])


def _band_and_full(sigma, q, steps, delta, band_factor):
  """One DP-SGD composition queried from its band (at the plan's band times ``band_factor``, a
  factor below 1 drops spectrum that is not negligible) and from its materialised pmf."""
  from jaxacct.api import _dpsgd_model
  from jaxacct.composition import Composition
  from jaxacct.pld import plan as _plan
  from jaxacct.pld import query, spectrum
  from jaxacct.pld.distribution import PrivacyLossDistribution
  composition = Composition.of((_dpsgd_model(sigma, q, "add_remove", False), steps))
  plan = _plan.make_plan(composition, delta)
  band = max(plan.low_frequencies, min(int(plan.band * band_factor), plan.fft_size // 2 + 1))
  plan = dataclasses.replace(plan, band=band)
  terms = spectrum.entry_terms_by_direction(composition.mechanisms, np.array([0.0, 1.0]), plan)
  eps = jnp.linspace(0.0, 3.0, 7)

  def queried(fields):
    pld = PrivacyLossDistribution(plan=plan, **fields)
    curve = query.upper_delta_curve(pld, eps)
    if fields["pmf"] is None:  # with the batched curve of the report's chunks beside it
      batch = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), pld)
      curve = jnp.stack([curve, query.band_upper_curves(batch, plan, eps)[1]])
    return (query.epsilon_from_pld(pld, delta), query.delta_from_pld(pld, eps), curve,
            jnp.max(fields["fft_error"]))

  counts = jnp.asarray([float(steps)])
  both = jax.jit(lambda t, c: (queried(spectrum.band_fields_from_terms(t, c, plan)),
                               queried(spectrum.fields_from_terms(t, c, plan)),
                               jnp.all(spectrum.high_band_negligible(
                                   jnp.stack([spectrum._accumulate(jax.tree_util.tree_map(
                                       lambda x: x[d], t), c, plan)[0]["high_log"]
                                       for d in range(2)]), plan))))
  return both(terms, counts)


_BAND_CORNERS = [(2.0, 0.135, 7, 5.6e-9, 1.0), (2.0, 0.135, 1, 5.6e-9, 0.25),
                 (6.0, 1e-3, 20000, 1e-5, 1.0), (0.8, 0.2, 500, 1e-10, 4.0),
                 (1.1, 0.01, 300, 1e-6, 0.25)]


@settings(max_examples=1, deadline=None)  # (one random draw a run; the corners below are fixed)
@given(sigma=st.floats(0.6, 6.0), log_q=st.floats(math.log(1e-3), math.log(0.3)),
       log_steps=st.floats(0.0, math.log(20000)), log_delta=st.floats(math.log(1e-10), -7.0),
       band_factor=st.sampled_from([0.25, 1.0, 4.0]))
def test_band_queries_match_the_materialised_pmf_and_stay_bounds(sigma, log_q, log_steps,
                                                                  log_delta, band_factor):
  _check_band_queries(sigma, math.exp(log_q), max(1, int(math.exp(log_steps))),
                      math.exp(log_delta), band_factor)


@pytest.mark.parametrize("sigma, q, steps, delta, band_factor", _BAND_CORNERS)
def test_band_queries_at_corners(sigma, q, steps, delta, band_factor):
  _check_band_queries(sigma, q, steps, delta, band_factor)


def _check_band_queries(sigma, q, steps, delta, band_factor):
  """The per-example report queries a composed PLD from its spectrum's band (no inverse
  transform): where the rest of the spectrum is negligible it must agree with the pmf's
  queries to within their error terms; where it is not (a band cut too narrow) it must stay a
  bound, only looser."""
  with jax.enable_x64(True):
    band, full, exact = _band_and_full(sigma, q, steps, delta, band_factor)
  (eps_b, delta_b, (curve_b, batched), error_b), (eps_f, delta_f, curve_f, error_f) = band, full
  slack = float(error_b) + float(error_f)
  # The batched curve (boundaries as integer offsets, powers factored) agrees with the
  # point-by-point one within a hundredth of the round-off allowance that both carry.
  assert np.all(np.abs(np.asarray(batched) - np.asarray(curve_b)) <= 0.01 * float(error_b))
  if bool(exact):
    # (The band's error terms differ from the pmf's: at extreme epsilons, e.g. 79 at 1e-10,
    # its upper is looser by a fraction of the bracket.)
    width = float(eps_f.upper) - float(eps_f.lower)
    assert abs(float(eps_b.upper) - float(eps_f.upper)) <= max(1e-4 * max(1.0, float(eps_f.upper)),
                                                              0.5 * width)
    for field in ("lower", "estimate", "upper"):
      np.testing.assert_allclose(getattr(delta_b, field), getattr(delta_f, field), rtol=1e-9,
                                 atol=slack + 1e-300)
    # The band's curve is read at each point (the pmf's at the boundary at or below it).
    assert np.all(np.asarray(curve_b) <= np.asarray(curve_f) + slack)
  assert float(eps_b.upper) >= float(eps_f.estimate)
  assert float(eps_b.lower) <= float(eps_f.estimate)
  assert np.all(np.asarray(delta_b.upper) >= np.asarray(delta_f.estimate) * (1 - 1e-12))
  assert np.all(np.asarray(delta_b.lower) <= np.asarray(delta_f.estimate) * (1 + 1e-12) + 1e-300)
  assert np.all(np.asarray(curve_b) >= np.asarray(delta_b.upper) * (1 - 1e-12))


def test_bucket_counter_odometer_bounds_dp_accountings_rdp(dpsgd_report, x64_off):
  """The counter's per-step odometer (jit, float32): each example's RDP epsilon at the filters'
  orders, against dp-accounting's RDP accountant on the same sequence; 0 before any step."""
  from dp_accounting.rdp import rdp_privacy_accountant
  counter, state, _, grid, q = dpsgd_report
  odometer = np.asarray(jax.jit(counter.odometer, static_argnums=1)(state, 1e-5))
  assert odometer.dtype == np.float32
  assert float(jax.jit(counter.odometer, static_argnums=1)(counter.init(), 1e-5)[0]) == 0.0
  counts = np.asarray(state.counts)
  for i in range(0, counts.shape[0], 4):
    accountant = rdp_privacy_accountant.RdpAccountant(orders=list(individual.DEFAULT_ORDERS))
    accountant.compose(_dp_accounting_heterogeneous(zip(grid, counts[i]), q))
    theirs = accountant.get_epsilon(1e-5)
    # (dp-accounting's fractional orders are upper bounds, a few % high at 1.25.)
    assert theirs * 0.97 <= odometer[i] <= theirs * (1 + 1e-4), i


def test_states_can_be_donated_to_a_compiled_step(x64_off):
  """A training step donates its state (updated in place): no two leaves may share a buffer."""
  n = 64
  norms, indices, valid = jnp.full(n, 0.5, jnp.float32), jnp.arange(n), jnp.ones(n, bool)
  for f in (individual.gdp_filter(2.0, 1.0, 4.0, n), individual.rdp_filter(
      individual.rdp_budget(4.0, 0.1, 50), 1.0, 4.0, n, sampling_rate=0.1),
      individual.bucket_counter(4.0, 1.0, 0.1, n)):
    step = jax.jit(f.update, donate_argnums=0)
    state = f.init()
    for _ in range(3):
      out = step(state, norms, indices, valid)
      state = out[0] if isinstance(out, tuple) else out
    assert int(state.steps) == 3


# ----------------------------------------------------------------------------------------------
# Repeated indices under jit: a step never releases more of an example than it charged for


def _pld_upper_of_steps(noise, q, steps, delta):
  """dp-accounting's pessimistic PLD epsilon of ``steps`` steps at ``noise`` (rate q)."""
  from dp_accounting import dp_event
  from dp_accounting.pld import pld_privacy_accountant
  accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
  step = dp_event.GaussianDpEvent(noise)
  accountant.compose(step if q == 1 else dp_event.PoissonSampledDpEvent(q, step), steps)
  return accountant.get_epsilon(delta)


@pytest.mark.parametrize("num_examples", [5, 40, 10**6], ids=["scratch_5", "scratch_40", "sort"])
def test_first_copies_keeps_each_listed_index_once_at_its_first_position(num_examples, x64_off):
  """``first_copies`` under jit (a scatter-min into [N] scratch where N <= 64 B, else a stable
  sort of the batch) against a loop, on random batches with repeats, out-of-range indices and
  invalid entries."""
  from jaxacct.individual import filters
  first = jax.jit(filters.first_copies, static_argnums=2)
  rng = np.random.default_rng(num_examples)
  for size in (7, 50):
    for _ in range(20):
      indices = rng.integers(-2, min(num_examples, 60) + 2, size).astype(np.int32)
      valid = rng.random(size) < 0.8
      seen, expected = set(), []
      for i, v in zip(indices.tolist(), valid.tolist()):
        expected.append(bool(v and 0 <= i < num_examples and i not in seen))
        seen |= {i} if expected[-1] else set()
      got = first(jnp.asarray(indices), jnp.asarray(valid), num_examples)
      assert np.asarray(got).tolist() == expected, (indices, valid)


@pytest.mark.parametrize("make", [
    lambda: individual.gdp_filter(1.0, 1.0, 2.0, 4),
    lambda: individual.gdp_filter(1.0, 1.0, 2.0, 4, fill_up=True),
    lambda: individual.rdp_filter(individual.rdp_budget(2.0, 1.0, 4), 1.0, 2.0, 4)],
    ids=["gdp", "gdp_fill_up", "rdp_q1"])
def test_repeated_indices_under_jit_enter_once_and_are_charged_once(make, x64_off):
  """The issue's case: indices [0, 0, 0, 1], norms 0.5, sigma 2, C 1 under jit: example 0's
  first copy enters (charged (0.5 / 1)^2 clipped units), its copies do not."""
  f = make()
  update = jax.jit(f.update, static_argnames="new_step")
  state, active = update(f.init(), jnp.full(4, 0.5), jnp.array([0, 0, 0, 1]), jnp.ones(4, bool))
  assert np.asarray(active).astype(float).tolist() == [1.0, 0.0, 0.0, 1.0]
  one_copy = np.asarray(update(f.init(), jnp.full(1, 0.5), jnp.array([0]),
                               jnp.ones(1, bool))[0].spent)[0]
  np.testing.assert_array_equal(np.asarray(state.spent)[0], one_copy)
  # a later update of the same step (another microbatch) lists example 0 again: refused, free
  again, active = update(state, jnp.full(2, 0.5), jnp.array([0, 2]), jnp.ones(2, bool),
                         new_step=False)
  assert np.asarray(active).astype(float).tolist() == [0.0, 1.0]
  np.testing.assert_array_equal(np.asarray(again.spent)[0], one_copy)
  # the next step admits it again, once
  _, active = update(again, jnp.full(2, 0.5), jnp.array([0, 0]), jnp.ones(2, bool))
  assert np.asarray(active).astype(float).tolist() == [1.0, 0.0]
  with pytest.raises(ValueError, match="at most once"):  # concrete input is refused
    f.update(state, jnp.full(1, 0.5), jnp.array([0]), jnp.ones(1, bool), new_step=False)


@functools.lru_cache(maxsize=None)
def _small_gdp_filter():
  """A GDP filter over 6 examples and its jitted update, built once for every random draw."""
  f = individual.gdp_filter(3.0, 1.0, 1.0, 6)
  return f, jax.jit(f.update, static_argnames="new_step")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_filters_never_admit_more_than_they_charge_whatever_the_indices(seed):
  """Random batches with repeated, out-of-range and padded indices, split over microbatches,
  under jit: per step an example is active at most once, and its recorded spending grows by at
  least the charge of the copy admitted (the GDP filter's clipped square, exactly)."""
  rng = np.random.default_rng(seed)
  n, size = 6, 5
  f, update = _small_gdp_filter()
  state = f.init()
  for _ in range(4):
    admitted = np.zeros(n, int)
    for part in range(2):
      indices = rng.integers(-1, n + 1, size)
      norms = rng.uniform(0.0, 2.0, size).astype(np.float32)
      valid = rng.random(size) < 0.8
      before = np.asarray(state.spent, np.float64) + np.asarray(state.spent_low, np.float64)
      state, active = update(state, jnp.asarray(norms), jnp.asarray(indices), jnp.asarray(valid),
                             new_step=part == 0)
      active = np.asarray(active)
      after = np.asarray(state.spent, np.float64) + np.asarray(state.spent_low, np.float64)
      for i in range(n):
        mine = active & (indices == i)
        admitted[i] += mine.sum()
        charged = sum(min(float(g), 1.0) ** 2 for g in norms[mine])
        assert after[i] - before[i] >= charged * (1 - 1e-6)
      assert not np.any(active & ~valid) and not np.any(active & ((indices < 0) | (indices >= n)))
    assert admitted.max() <= 1


@pytest.mark.parametrize("copies", [[0.1, 0.9], [0.9, 0.1]])
def test_subsampled_rdp_filter_charges_the_largest_copy(copies, x64_off):
  """q < 1: the listing bounds each example's norm; an example listed twice is charged the
  larger of its copies' charges (whichever comes first), and only its first copy is active."""
  f = individual.rdp_filter(individual.rdp_budget(2.0, 0.1, 10), 1.0, 2.0, 3, sampling_rate=0.1)
  update = jax.jit(f.update)
  state, active = update(f.init(), jnp.array(copies + [0.2]), jnp.array([0, 0, 1]),
                         jnp.ones(3, bool))
  assert np.asarray(active).tolist() == [True, False, True]
  large, _ = update(f.init(), jnp.array([0.9]), jnp.array([0]), jnp.ones(1, bool))
  np.testing.assert_array_equal(np.asarray(state.spent)[0], np.asarray(large.spent)[0])


def test_narrow_index_dtypes_cannot_reach_another_example(x64_off):
  """uint8 indices with N = 300: the padding sentinel (N) must not wrap onto example 44, and
  examples above 255 stay reachable by wider indices (the batch's indices are widened)."""
  for f in (individual.gdp_filter(10.0, 1.0, 1.0, 300),
            individual.rdp_filter(individual.rdp_budget(1.0, 1.0, 50), 1.0, 1.0, 300)):
    update = jax.jit(f.update)
    state = f.init()
    for _ in range(10):
      state, _ = update(state, jnp.ones(1), jnp.array([44], jnp.int32), jnp.ones(1, bool))
    before = np.asarray(f.odometer(state, 1e-5))[44]
    state, active = update(state, jnp.ones(2), jnp.array([7, 9], jnp.uint8),
                           jnp.array([False, True]))
    assert np.asarray(active).tolist() == [False, True]
    assert np.asarray(f.odometer(state, 1e-5))[44] == before > 1.0


def test_bucket_counter_counts_an_example_once_per_step_under_jit(x64_off):
  """The issue's case with q < 1: three jitted steps listing [0, 0, 0, 1] count example 0 three
  times, not nine; its RDP odometer stays above dp-accounting's PLD of three steps at its noise
  ratio sigma C / 0.5 (the counts can never go negative)."""
  q, sigma = 0.1, 2.0
  counter = individual.bucket_counter(sigma, 1.0, q, 4)
  update = jax.jit(counter.update)
  state = counter.init()
  for _ in range(3):
    state = update(state, jnp.full(4, 0.5), jnp.array([0, 0, 0, 1]), jnp.ones(4, bool))
  assert np.asarray(state.counts).sum(axis=1).tolist() == [3, 3, 0, 0]
  eps = np.asarray(counter.odometer(state, 1e-5))
  honest = _pld_upper_of_steps(sigma / 0.5, q, 3, 1e-5)
  assert honest > 0.17  # (before: example 0's odometer read 0.0)
  assert eps[0] >= honest and eps[0] == eps[1]
  report = counter.report(state, 1e-5)
  assert report.pld.upper[0] >= honest * (1 - 1e-3) and np.all(np.isfinite(report.pld.upper))


def test_bucket_counter_counts_copies_once_at_their_largest_norm(x64_off):
  counter = individual.bucket_counter(2.0, 1.0, 0.1, 3)
  update = jax.jit(counter.update)
  state = update(counter.init(), jnp.array([0.1, 0.6, 0.3]), jnp.array([0, 0, 1]),
                 jnp.ones(3, bool))
  alone = update(counter.init(), jnp.array([0.6]), jnp.array([0]), jnp.ones(1, bool))
  np.testing.assert_array_equal(np.asarray(state.counts)[0], np.asarray(alone.counts)[0])
  assert np.asarray(state.counts).sum() == 2


def test_bucket_odometer_of_an_impossible_ledger_is_infinite(x64_off):
  """A ledger no update can produce (restored from elsewhere, or forged): more counts than steps
  or a negative count gives +inf, never a small epsilon."""
  counter = individual.bucket_counter(2.0, 1.0, 0.1, 3)
  counts = np.zeros((3, individual.noise_grid(2.0).size), np.int32)
  counts[0, 5], counts[1, 0], counts[1, 7] = 5, 3, -2
  state = individual.BucketState(jnp.asarray(counts), jnp.asarray(4, jnp.int32),
                                 jnp.zeros(3, bool))
  eps = np.asarray(jax.jit(counter.odometer, static_argnums=1)(state, 1e-5))
  assert np.isinf(eps[:2]).all() and np.isfinite(eps[2])


def test_bucket_counter_at_q_1_voids_an_example_listed_twice(x64_off):
  """q = 1 (the listed examples are the step's sum): two copies of an example are a
  sensitivity the grid cannot hold, so the example gets no guarantee (+inf), never less."""
  counter = individual.bucket_counter(2.0, 1.0, 1.0, 3)
  state = jax.jit(counter.update)(counter.init(), jnp.full(3, 0.5), jnp.array([0, 0, 1]),
                                  jnp.ones(3, bool))
  assert np.asarray(state.repeated).tolist() == [True, False, False]
  eps = np.asarray(counter.odometer(state, 1e-5))
  assert np.isinf(eps[0]) and np.isfinite(eps[1])
  report = counter.report(state, 1e-5)
  assert np.isinf(report.pld.upper[0]) and np.isinf(report.rdp_epsilon[0])
  assert np.isfinite(report.pld.upper[1])


@pytest.mark.parametrize("counts, steps, message", [
    ([[2, 0], [-1, 1]], 3, ">= 0"), ([[3, 2], [0, 0]], 4, "at most once per step"),
    ([[0.5, 0], [0, 0]], 4, "whole"), ([[1, 0, 0]], 4, "one column per grid noise"),
    (np.zeros((0, 2), int), 4, "examples >= 1")])
def test_per_example_privacy_refuses_impossible_counts(counts, steps, message):
  with pytest.raises(ValueError, match=message):
    individual.per_example_privacy(np.asarray(counts), steps, [2.0, 3.0], 0.1, 1e-5)


@pytest.mark.parametrize("grid, message", [([2.0, -1.0], "finite values > 0"),
                                           ([2.0, np.nan], "finite values > 0"),
                                           ([3.0, 2.0], "strictly increasing")])
def test_per_example_privacy_refuses_bad_grids(grid, message):
  with pytest.raises(ValueError, match=message):
    individual.per_example_privacy(np.ones((1, 2), int), 2, grid, 0.1, 1e-5)
