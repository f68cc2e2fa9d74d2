"""The mixture-of-Gaussians model: a model whose fields carry a vector per setting (event shape),
against scipy's normal distribution and dp-accounting's ``MixtureOfGaussiansDpEvent``; and a
batch of compositions that share their models (each model evaluated once)."""

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import integrate, optimize, stats

import jaxacct
from jaxacct import results
from jaxacct.mixture import MixtureOfGaussians

ROWS = json.loads((pathlib.Path(__file__).parent / "data" / "mixture_references.json").read_text())


def _batched():
  """The five stored settings as one batched composition (event axis: the three atoms)."""
  column = lambda key: np.array([row[key] for row in ROWS], float)
  model = MixtureOfGaussians(column("sigma"), column("sensitivities"), column("probabilities"))
  return jaxacct.Composition.of((model, column("steps"))), column("delta")


def _scipy_loss_cdfs(sigma, c, p, loss, add):
  """P(L <= l), Q(L <= l) by scipy: u* = f^{-1}(l) by brentq, f(u) = log sum p e^{mu u - mu^2/2}."""
  mu = np.asarray(c) / sigma
  f = lambda u: np.log(np.sum(np.asarray(p) * np.exp(mu * u - 0.5 * mu * mu)))
  target = -loss if add else loss
  p0 = np.sum(np.asarray(p)[mu == 0.0])
  if math.exp(target) <= p0:
    u = -np.inf
  else:
    u = optimize.brentq(lambda v: f(v) - target, -200.0, 200.0, xtol=1e-14, rtol=1e-15)
  mix_cdf = np.sum(np.asarray(p) * stats.norm.cdf(u - mu))
  normal_cdf = stats.norm.cdf(u)
  if add:  # L <= l <=> U >= u*
    return 1.0 - normal_cdf, 1.0 - mix_cdf
  return mix_cdf, normal_cdf


@pytest.mark.parametrize("row", range(len(ROWS)))
def test_loss_cdfs_match_scipy_on_the_host_and_in_jax(row):
  r = ROWS[row]
  model = MixtureOfGaussians(r["sigma"], r["sensitivities"], r["probabilities"])
  host = jax.tree_util.tree_map(lambda a: np.asarray(a, float), model)
  losses = np.linspace(-8.0, 8.0, 41)
  with jax.enable_x64(True):
    for add in (False, True):
      on_host = host.cdf_sf(losses, add)
      in_jax = model.cdf_sf(jnp.asarray(losses), add)
      for i, loss in enumerate(losses):
        p_cdf, q_cdf = _scipy_loss_cdfs(r["sigma"], r["sensitivities"], r["probabilities"], loss,
                                        add)
        for got in (on_host, in_jax):
          assert float(got[0][i]) == pytest.approx(p_cdf, abs=1e-13, rel=1e-10)
          assert float(got[2][i]) == pytest.approx(q_cdf, abs=1e-13, rel=1e-10)
          assert float(got[0][i] + got[1][i]) == pytest.approx(1.0, abs=1e-15)


def test_cumulant_generating_function_matches_quadrature():
  """K(t) = log E_P[e^{tL}] from the model's nodes against scipy quadrature of the mixture."""
  from jaxacct import cgf
  r = ROWS[0]
  model = MixtureOfGaussians(r["sigma"], r["sensitivities"], r["probabilities"])
  mu = np.asarray(r["sensitivities"]) / r["sigma"]
  p = np.asarray(r["probabilities"])
  # f(u) = log sum_i p_i e^{mu_i u - mu_i^2 / 2} (u a scalar, or an array: along its last axis)
  f = lambda u: np.logaddexp.reduce(np.log(p) + mu * np.asarray(u)[..., None] - 0.5 * mu * mu,
                                    axis=-1)
  with jax.enable_x64(True):
    for t in (0.5, 2.0, 8.0):
      for add in (False, True):
        # remove: E_P e^{t f} = int phi e^{(1+t) f}; add: E_{N(0,1)} e^{-t f}; in log space
        power = -t if add else 1.0 + t
        log_g = lambda u: stats.norm.logpdf(u) + power * f(u)
        grid = np.linspace(-80.0, 80.0, 16001)
        top = grid[np.argmax(log_g(grid))]  # (the integrand's peak, where quad's panels split)
        value, _ = integrate.quad(lambda u: math.exp(log_g(u) - log_g(top)), top - 40, top + 40,
                                  points=[top], limit=400, epsabs=0.0, epsrel=1e-13)
        got = float(cgf.step_cumulants(model, t, add)[0])
        assert got == pytest.approx(math.log(value) + log_g(top), rel=1e-9), (t, add)


def test_implicit_gradient_of_the_inverse_loss():
  """d/dsigma of a loss CDF (through f^{-1}, differentiated implicitly) against central
  differences."""
  with jax.enable_x64(True):
    cdf = lambda s: MixtureOfGaussians(s, jnp.array([0.0, 1.0, 2.0]),
                                       jnp.array([0.81, 0.18, 0.01])).cdf_sf(jnp.array([0.7]))[0][0]
    # (one compiled program for the gradient and the two differences: op by op this took 25 s)
    values, grads = jax.jit(jax.vmap(jax.value_and_grad(cdf)))(1.3 + jnp.array([0.0, 1e-6, -1e-6]))
    g = float(grads[0])
    fd = (float(values[1]) - float(values[2])) / 2e-6
  assert g == pytest.approx(fd, rel=1e-7)


def test_pld_batched_over_five_settings_against_dp_accounting():
  """One call, five settings (each a vector of three atoms): the certified bracket is
  consistent with dp-accounting's pessimistic (upper) and optimistic (lower) PLDs, and the
  estimate within 1e-3 of the pessimistic value."""
  comp, delta = _batched()
  out = jaxacct.epsilon(comp, delta)
  assert out.upper.shape == (5,)
  for i, row in enumerate(ROWS):
    lower, estimate, upper = (float(v[i]) for v in (out.lower, out.estimate, out.upper))
    assert int(out.status[i]) == 0
    assert lower <= row["dpa_pessimistic"] and upper >= row["dpa_optimistic"]
    assert lower <= estimate <= upper and upper - lower <= 0.03
    assert abs(estimate - row["dpa_pessimistic"]) <= 1e-3 * max(1.0, row["dpa_pessimistic"])


def test_spa_batched_over_five_settings_against_dp_accounting():
  """The saddle point on the same batch: its finite certified bounds hold against dp-accounting's
  bracket, and where it is not flagged UNRELIABLE its estimate is within 2e-3 relative."""
  comp, delta = _batched()
  out = jaxacct.epsilon(comp, delta, accountant="spa")
  assert out.upper.shape == (5,)
  finite = 0
  for i, row in enumerate(ROWS):
    upper, lower = float(out.upper[i]), float(out.lower[i])
    if math.isfinite(upper):
      finite += 1
      assert upper >= row["dpa_optimistic"]
    assert not lower > row["dpa_pessimistic"]
    if not int(out.status[i]) & results.UNRELIABLE:
      assert float(out.estimate[i]) == pytest.approx(row["dpa_pessimistic"], rel=2e-3)
  assert finite >= 4


def test_bad_mixtures_are_refused_at_construction():
  with pytest.raises(ValueError, match="probabilities"):
    MixtureOfGaussians(1.0, [0.0, 1.0], [0.5, 0.6])
  with pytest.raises(ValueError, match="sensitivities"):
    MixtureOfGaussians(1.0, [0.0, -1.0], [0.5, 0.5])
  with pytest.raises(ValueError, match="sensitivities"):
    MixtureOfGaussians(1.0, [0.0, 0.0], [0.5, 0.5])  # no positive sensitivity: no mechanism
  with pytest.raises(ValueError, match="last axis"):
    MixtureOfGaussians(1.0, [0.0, 1.0, 2.0], [0.5, 0.5])
  with pytest.raises(ValueError, match="sigma"):
    MixtureOfGaussians(0.0, [0.0, 1.0], [0.5, 0.5])
  # A model rebuilt by JAX from scalar leaves (no construction checks) still cannot pass a
  # scalar where a vector per setting is needed.
  treedef = jax.tree_util.tree_structure(MixtureOfGaussians(1.0, [0.0, 1.0], [0.5, 0.5]))
  rebuilt = jax.tree_util.tree_unflatten(treedef, [np.float64(1.0)] * 3)
  with pytest.raises(ValueError, match="vector"):
    jaxacct.epsilon([(rebuilt, 1)], 1e-5)


def test_compositions_sharing_models_evaluate_them_once():
  """A batch whose models are shared (only counts batched) takes the shared path: each model
  is discretised once; its answers equal the per-element path's on the same plan."""
  from jaxacct.pld import accountant, spectrum
  rng = np.random.default_rng(1)
  sens = np.linspace(0.2, 1.0, 4)
  counts = rng.integers(0, 60, size=(6, 4)).astype(float)
  counts[2] = 0.0  # a setting of no steps
  models = [jaxacct.PoissonSampled(jaxacct.Gaussian(1.0, s), 0.02) for s in sens]
  shared = jaxacct.Composition.of(*[(m, counts[:, j]) for j, m in enumerate(models)])
  wide = lambda v: np.full(6, v)
  per_element = jaxacct.Composition.of(*[
      (jaxacct.PoissonSampled(jaxacct.Gaussian(wide(1.0), wide(s)), wide(0.02)), counts[:, j])
      for j, s in enumerate(sens)])
  plan = jaxacct.make_plan(shared, 1e-6)
  calls, routes = [], []
  original, shared_route = spectrum.entry_terms, accountant._shared
  spectrum.entry_terms = lambda mech, *a: calls.append(np.shape(mech.rate)) or original(mech, *a)
  accountant._shared = lambda *a: routes.append(1) or shared_route(*a)
  try:
    a = jaxacct.epsilon(shared, 1e-6, plan=plan)
    traced_shared = list(calls)
    b = jaxacct.epsilon(per_element, 1e-6, plan=plan)
  finally:
    spectrum.entry_terms, accountant._shared = original, shared_route
  # The shared route, its four models of one kind traced once, vmapped over the four (and over
  # both directions); the per-element route does not take it.
  assert routes == [1] and traced_shared == [()]
  np.testing.assert_allclose(np.asarray(a.upper), np.asarray(b.upper), rtol=1e-12)
  np.testing.assert_allclose(np.asarray(a.estimate), np.asarray(b.estimate), rtol=1e-12)
  assert float(a.upper[2]) == 0.0
  # Planned by jaxacct too (one plan for the batch, each model evaluated once on the host).
  c = jaxacct.epsilon(shared, 1e-6)
  for i in range(6):
    assert float(c.lower[i]) <= float(a.upper[i]) and float(a.lower[i]) <= float(c.upper[i])
