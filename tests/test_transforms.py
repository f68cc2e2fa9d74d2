"""jit / vmap / grad of the PLD accountant, float64 scoping, reuse of a composed PLD."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxacct
from jaxacct.pld import distribution, query

SIGMAS = np.linspace(0.8, 3.0, 100)
PLAN_ARGS = dict(noise_multiplier=SIGMAS, sampling_rate=0.02, steps=300, delta=1e-6)


@pytest.fixture(scope="module")
def plan():
  return jaxacct.dpsgd_plan(**PLAN_ARGS)


def _fields(r):
  return np.array([np.asarray(r.lower), np.asarray(r.estimate), np.asarray(r.upper)])


def test_jit_equals_eager(plan):
  comp = jaxacct.dpsgd_composition(1.3, 0.02, 300)
  with jax.enable_x64(True):
    eager = query.epsilon_from_pld(distribution.compose(comp, plan), 1e-6)
    jitted = jax.jit(lambda c, d: query.epsilon_from_pld(distribution.compose(c, plan), d))(
        comp, 1e-6)
  # The estimate agrees to round-off; the bounds' safe-side nudge is proportional to a residual
  # at round-off level, so it moves with XLA's fusion order (1e-9 relative, always outward).
  np.testing.assert_allclose(np.asarray(eager.estimate), np.asarray(jitted.estimate), rtol=1e-11)
  np.testing.assert_allclose(_fields(eager), _fields(jitted), rtol=1e-8)


def test_vmap_over_100_sigmas_equals_loop(plan):
  batched = jaxacct.dpsgd_epsilon(SIGMAS, 0.02, 300, 1e-6, plan=plan)
  assert batched.estimate.shape == (100,)
  for i in range(0, 100, 9):
    one = jaxacct.dpsgd_epsilon(SIGMAS[i], 0.02, 300, 1e-6, plan=plan)
    # Equal up to FFT round-off (~1e-20 per grid point, ~1e-9 relative in epsilon at this delta);
    # the bounds' safe-side nudge is proportional to a round-off residual (1e-8 relative).
    np.testing.assert_allclose(np.asarray(one.estimate), np.asarray(batched.estimate)[i], rtol=1e-8)
    np.testing.assert_allclose(_fields(one), _fields(batched)[:, i], rtol=1e-7)
  # More noise, less epsilon: the batch is ordered.
  assert np.all(np.diff(np.asarray(batched.upper)) < 0)


def test_user_vmap_and_jit(plan):
  f = jax.jit(jax.vmap(lambda s: jaxacct.dpsgd_epsilon(s, 0.02, 300, 1e-6, plan=plan).estimate))
  out = f(jnp.asarray(SIGMAS[:7]))
  ref = jaxacct.dpsgd_epsilon(SIGMAS[:7], 0.02, 300, 1e-6, plan=plan).estimate
  # A differently fused program: equal within the certified round-off (fft_error ~ 2e-13 on delta).
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6)


def _estimate(plan, sigma, rate, steps=300, delta=1e-6):
  return jaxacct.dpsgd_epsilon(sigma, rate, steps, delta, plan=plan).estimate


@jax.jit
def _estimate_grad(plan, sigma, rate):
  return jax.grad(lambda s, q: _estimate(plan, s, q), argnums=(0, 1))(sigma, rate)


@pytest.mark.parametrize("sigma, rate", [(0.93, 0.0137), (1.3711, 0.02), (2.71, 0.0155)])
def test_grad_matches_central_differences(plan, sigma, rate):
  # Central differences with step 1e-5 relative. The estimate has a round-off noise floor of
  # ~1e-9 that, at isolated points, moves one such difference by ~2e-4 relative; the median of the
  # differences at steps 3e-6, 1e-5 and 3e-5 cannot be moved by one such point.
  with jax.enable_x64(True):  # (compiled once for the three settings; op by op this took 18 s)
    d_sigma, d_rate = _estimate_grad(plan, sigma, rate)
  for x, g, f in [(sigma, d_sigma, lambda s: _estimate(plan, s, rate)),
                  (rate, d_rate, lambda q: _estimate(plan, sigma, q))]:
    fds = [(float(f(x + r * x)) - float(f(x - r * x))) / (2 * r * x) for r in (3e-6, 1e-5, 3e-5)]
    fd = float(np.median(fds))
    assert abs(float(g) - fd) <= 1e-4 * abs(fd), (x, float(g), fds)


def test_grad_of_gaussian_matches_closed_form():
  # eps(delta) for mu-GDP: d eps / d mu = phi(mu/2 - eps/mu) / (e^eps Phi(-eps/mu - mu/2)).
  from scipy import stats
  from conftest import gaussian_epsilon
  sigma, steps, delta = 10.0, 1000, 1e-5
  comp = lambda s: jaxacct.Composition.of((jaxacct.Gaussian(s), steps))
  plan = jaxacct.make_plan(comp(sigma * 0.9), delta)
  # (compiled: the un-jitted grad, op by op, took 26 s; it is tested on DP-SGD steps above)
  g = jax.jit(jax.grad(lambda s: jaxacct.epsilon(comp(s), delta, plan=plan).estimate))(sigma)
  mu = math.sqrt(steps) / sigma
  eps = gaussian_epsilon(delta, mu)
  deps_dmu = (stats.norm.pdf(mu / 2 - eps / mu)
              / (math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)))
  assert abs(float(g) - (-(mu / sigma) * deps_dmu)) < 1e-3 * abs(deps_dmu * mu / sigma)


def test_grad_wrt_delta_is_implicit():
  comp = jaxacct.dpsgd_composition(1.0, 0.01, 1000)
  plan = jaxacct.make_plan(comp, 1e-7)
  f = lambda d: jaxacct.epsilon(comp, d, plan=plan).estimate
  g = jax.jit(jax.grad(f))(1e-6)  # (compiled: op by op this took 10 s more)
  fd = (float(f(1e-6 * (1 + 1e-5))) - float(f(1e-6 * (1 - 1e-5)))) / 2e-11
  assert abs(float(g) - fd) < 1e-4 * abs(fd)


def test_float64_is_scoped(plan):
  assert not jax.config.jax_enable_x64
  r = jaxacct.dpsgd_epsilon(1.2, 0.02, 300, 1e-6)
  assert r.estimate.dtype == jnp.float64
  assert not jax.config.jax_enable_x64  # the process-wide flag is untouched


def test_inside_a_float32_jit(plan):
  @jax.jit
  def train_step(w, sigma):
    loss = jnp.sum(w * w)  # a float32 computation of the user's
    eps = jaxacct.dpsgd_epsilon(sigma, 0.02, 300, 1e-6, plan=plan)
    return loss, eps.upper

  loss, eps = train_step(jnp.ones(3, jnp.float32), jnp.float32(1.3))
  assert loss.dtype == jnp.float32
  assert eps.dtype == jnp.float64
  ref = jaxacct.dpsgd_epsilon(1.3, 0.02, 300, 1e-6, plan=plan).upper
  # sigma arrives as float32: compare at that sigma.
  ref32 = jaxacct.dpsgd_epsilon(float(np.float32(1.3)), 0.02, 300, 1e-6, plan=plan).upper
  assert float(eps) == pytest.approx(float(ref32), rel=1e-6)
  assert float(eps) == pytest.approx(float(ref), rel=1e-6)


@pytest.mark.parametrize("accountant", ["spa", "edgeworth", "rdp", "gdp"])
def test_constant_time_accountants_differentiate_inside_a_float32_jit(accountant):
  """d epsilon / d sigma under ``jit(value_and_grad)`` with x64 off (a training program's
  setting) against central differences of the same program: the saddle point's upper once
  failed to compile there (a scatter's int32 bounds against its int64 indices)."""
  # (Edgeworth's upper is inf here and GDP's nan: a central-limit figure certifies nothing.)
  field = "upper" if accountant in ("spa", "rdp") else "estimate"
  f = lambda s: getattr(jaxacct.dpsgd_epsilon(s, 0.02, 300.0, 1e-6, accountant=accountant), field)
  both = jax.jit(jax.value_and_grad(f))
  value, slope = both(1.3)
  ends = np.float32([1.3 + 1e-3, 1.3 - 1e-3])  # (what the program sees, x64 off)
  fd = (float(both(ends[0])[0]) - float(both(ends[1])[0])) / (float(ends[0]) - float(ends[1]))
  assert np.isfinite(float(value)) and float(slope) < 0.0
  assert float(slope) == pytest.approx(fd, rel=1e-4)


def test_composed_pld_reuse_and_append():
  """A PLD appended to entry by entry is the one composed at once. The entries of one kind are
  discretised together (composition.map_entries): interleaved kinds must keep each entry
  with its count."""
  sampled = lambda sigma: jaxacct.PoissonSampled(jaxacct.Gaussian(sigma), 0.01)
  comp = jaxacct.Composition.of((sampled(1.1), 700), (jaxacct.Gaussian(8.0), 3),
                                (sampled(1.3), 800))
  plan = jaxacct.make_plan(comp, 1e-8)
  half = jaxacct.compose(jaxacct.Composition.of((sampled(1.1), 700)), plan=plan)
  whole = half.append(jaxacct.Composition.of((jaxacct.Gaussian(8.0), 3))).append(
      jaxacct.Composition.of((sampled(1.3), 800)))
  direct = jaxacct.compose(comp, plan=plan)
  deltas = np.array([1e-5, 1e-6, 1e-7])
  a, b = whole.epsilon(deltas), direct.epsilon(deltas)
  assert a.estimate.shape == (3,)
  np.testing.assert_allclose(_fields(a), _fields(b), rtol=1e-9)
  # delta(epsilon) and epsilon(delta) are inverse to each other.
  back = direct.delta(b.estimate)
  np.testing.assert_allclose(np.asarray(back.estimate), deltas, rtol=1e-7)


def test_a_sweep_reruns_a_setting_its_shared_plan_cannot_serve():
  """A sweep's shared plan (finest grid, widest window, smallest delta of its settings) can fail
  a certificate for one setting (here: delta 1.9e-10 below the round-off floor of a window sized
  for eps = 65); planned by jaxacct, that setting is rerun on its own plan and gets its bounds."""
  from jaxacct import results
  with jax.enable_x64(True):
    e0, rate, steps = [0.4065, 2.4493], [0.009754, 0.2319], [767.0, 149.0]
    delta = jnp.array([1.893e-10, 5.013e-7])
    comp = jaxacct.Composition.of((jaxacct.PoissonSampled(jaxacct.PureDP(jnp.array(e0)),
                                                          jnp.array(rate)), jnp.array(steps)))
    shared = jaxacct.epsilon(comp, delta, plan=jaxacct.make_plan(comp, delta))
    assert int(shared.status[0]) & results.BELOW_FLOOR and math.isinf(float(shared.upper[0]))
    swept = jaxacct.epsilon(comp, delta)
    for i in range(2):
      alone = jaxacct.epsilon(jaxacct.Composition.of((jaxacct.PoissonSampled(
          jaxacct.PureDP(e0[i]), rate[i]), steps[i])), float(delta[i]))
      assert int(swept.status[i]) == int(alone.status) == 0
      if i == 0:  # rerun alone: the same numbers
        np.testing.assert_allclose(_fields(swept)[:, i], _fields(alone), rtol=1e-9)
      else:  # served by the shared plan: both brackets hold the truth
        assert float(swept.lower[i]) <= float(alone.upper)
        assert float(alone.lower) <= float(swept.upper[i])


def test_differentiating_a_step_count_raises_not_zero(plan):
  """The PLD accountant composes whole steps: d eps / d T does not exist there, and a silent 0
  would mislead a calibration. A traced count that is not differentiated is fine."""
  f = lambda s, t: jaxacct.dpsgd_epsilon(s, 0.02, t, 1e-6, plan=plan).estimate
  with pytest.raises(ValueError, match="whole steps"):  # (refused as it is traced)
    jax.jit(jax.grad(f, argnums=1))(1.3, 300.0)
  g_traced_count = jax.jit(jax.grad(f, argnums=0))(1.3, 300.0)
  with jax.enable_x64(True):  # (a concrete count: the program of the central-difference test)
    g = _estimate_grad(plan, 1.3, 0.02)[0]
  # (the traced count's gradient is float32 here, x64 off: equal to its rounding)
  assert float(g_traced_count) == pytest.approx(float(g), rel=1e-6) and float(g) < 0.0
  # The CGF accountants take real counts: there d eps / d T exists (and is positive).
  comp = lambda t: jaxacct.Composition.of((jaxacct.PoissonSampled(jaxacct.Gaussian(1.3), 0.02), t))
  with jax.enable_x64(True):  # (compiled, in a float64 scope: op by op this took 20 s)
    d_steps = jax.jit(jax.grad(
        lambda t: jaxacct.epsilon(comp(t), 1e-6, accountant="spa").estimate))(300.0)
  assert float(d_steps) > 0.0


def test_zero_steps_inside_a_compiled_program(plan):
  """Under jit (no planning, the caller's plan) a setting of no steps still gives 0."""
  out = jax.jit(lambda t: jaxacct.dpsgd_epsilon(1.3, 0.02, t, 1e-6, plan=plan))(0.0)
  assert float(out.lower) == float(out.estimate) == float(out.upper) == 0.0
  d = jax.jit(lambda t: jaxacct.dpsgd_delta(1.3, 0.02, t, 0.5, plan=plan))(0.0)
  assert float(d.upper) <= 1e-12 and float(d.lower) == 0.0
