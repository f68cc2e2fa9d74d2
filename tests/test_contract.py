"""The front-door contract: every public function that returns ``Bounds`` checks its inputs with
the one validator, runs in float64 in a float32 process, names its arguments ``epsilon`` /
``delta``, and agrees with ``jaxacct.epsilon`` / ``jaxacct.delta``. The public names are
enumerated, so a new accountant function cannot skip the contract. Also the honest edges: no
steps, options an accountant does not use, shapes that do not broadcast, status bits that agree
with the values they describe."""

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxacct
from jaxacct import results

SGD = lambda sigma=1.0, q=0.01, steps=1000: jaxacct.dpsgd_composition(sigma, q, steps)
MODULES = {"jaxacct": jaxacct, "pld": jaxacct.pld, "spa": jaxacct.spa,
           "edgeworth": jaxacct.edgeworth, "rdp": jaxacct.rdp, "gdp": jaxacct.gdp}


def _composed():
  return jaxacct.compose(SGD(), delta=1e-8)


# Each public function returning Bounds: (how to call it with a query value x, the quantity it
# answers, the accountant whose front-door answer it must equal).
QUERIES = {
    "jaxacct.epsilon": (lambda x: jaxacct.epsilon(SGD(), x), "epsilon", "pld"),
    "jaxacct.delta": (lambda x: jaxacct.delta(SGD(), x), "delta", "pld"),
    "jaxacct.dpsgd_epsilon": (lambda x: jaxacct.dpsgd_epsilon(1.0, 0.01, 1000, x), "epsilon",
                              "pld"),
    "jaxacct.dpsgd_delta": (lambda x: jaxacct.dpsgd_delta(1.0, 0.01, 1000, x), "delta", "pld"),
    "pld.epsilon": (lambda x: jaxacct.pld.epsilon(SGD(), x), "epsilon", "pld"),
    "pld.delta": (lambda x: jaxacct.pld.delta(SGD(), x), "delta", "pld"),
    "spa.epsilon": (lambda x: jaxacct.spa.epsilon(SGD(), x), "epsilon", "spa"),
    "spa.delta": (lambda x: jaxacct.spa.delta(SGD(), x), "delta", "spa"),
    "edgeworth.epsilon": (lambda x: jaxacct.edgeworth.epsilon(SGD(), x), "epsilon", "edgeworth"),
    "edgeworth.delta": (lambda x: jaxacct.edgeworth.delta(SGD(), x), "delta", "edgeworth"),
    "rdp.epsilon": (lambda x: jaxacct.rdp.epsilon(SGD(), x), "epsilon", "rdp"),
    "rdp.delta": (lambda x: jaxacct.rdp.delta(SGD(), x), "delta", "rdp"),
    "gdp.epsilon": (lambda x: jaxacct.gdp.epsilon(SGD(q=1.0), x), "epsilon", "gdp"),
    "gdp.delta": (lambda x: jaxacct.gdp.delta(SGD(q=1.0), x), "delta", "gdp"),
    # (group level: its own model, the mixture, so no equality with the DP-SGD front door)
    "jaxacct.group_epsilon": (lambda x: jaxacct.group_epsilon(1.0, 100, x, 2, sampling_rate=0.01),
                              "epsilon", None),
    "jaxacct.group_delta": (lambda x: jaxacct.group_delta(1.0, 100, x, 2, sampling_rate=0.01),
                            "delta", None),
    "PrivacyLossDistribution.epsilon": (lambda x: _composed().epsilon(x), "epsilon", None),
    "PrivacyLossDistribution.delta": (lambda x: _composed().delta(x), "delta", None),
}


def _returns_bounds(fn):
  try:
    annotation = inspect.signature(fn).return_annotation
  except (TypeError, ValueError):
    return False
  return annotation in (results.Bounds, "Bounds")


def _public(module):
  """A module's public names: its ``__all__``, else what it defines itself."""
  if hasattr(module, "__all__"):
    return list(module.__all__)
  return [name for name in dir(module) if not name.startswith("_")
          and getattr(getattr(module, name), "__module__", None) == module.__name__]


def test_every_public_bounds_function_is_in_the_contract_table():
  found = {f"{label}.{name}" for label, module in MODULES.items() for name in _public(module)
           if _returns_bounds(getattr(module, name))}
  found |= {f"PrivacyLossDistribution.{name}" for name in dir(jaxacct.PrivacyLossDistribution)
            if not name.startswith("_") and _returns_bounds(getattr(jaxacct.PrivacyLossDistribution,
                                                                    name))}
  assert found == set(QUERIES)


@pytest.mark.parametrize("name", sorted(QUERIES))
def test_argument_names(name):
  module, _, function = name.rpartition(".")
  owner = (jaxacct.PrivacyLossDistribution if module == "PrivacyLossDistribution"
           else MODULES[module])
  params = inspect.signature(getattr(owner, function)).parameters
  quantity = QUERIES[name][1]
  given = "delta" if quantity == "epsilon" else "epsilon"
  assert given in params and "delta_" not in params and "eps" not in params


def _front_door(quantity, accountant, x):
  comp = SGD(q=1.0) if accountant == "gdp" else SGD()
  return getattr(jaxacct, quantity)(comp, x, accountant=accountant)


@pytest.mark.parametrize("name", sorted(QUERIES))
def test_float64_in_a_float32_process_and_equal_to_the_front_door(name, x64_off):
  call, quantity, accountant = QUERIES[name]
  x = np.float32(1e-5) if quantity == "epsilon" else np.float32(2.0)
  out = call(x)
  assert isinstance(out, jaxacct.Bounds)
  for field in (out.lower, out.estimate, out.upper):
    assert field.dtype == jnp.float64
  assert out.status.dtype == jnp.int32
  assert not jax.config.jax_enable_x64
  assert not math.isnan(float(out.estimate))
  if accountant in ("pld", "spa", "rdp", None):  # certified and finite at this setting
    assert math.isfinite(float(out.upper))
  if accountant is not None:
    ref = _front_door(quantity, accountant, x)
    for field in ("lower", "estimate", "upper", "status"):
      np.testing.assert_array_equal(np.asarray(getattr(out, field)),
                                    np.asarray(getattr(ref, field)))


@pytest.mark.parametrize("name", sorted(QUERIES))
def test_bad_query_value_names_the_parameter(name):
  call, quantity, _ = QUERIES[name]
  bad, param = (0.0, "delta") if quantity == "epsilon" else (-1.0, "epsilon")
  with pytest.raises(ValueError, match=rf"(?<!\w){param}(?!\w)"):
    call(bad)


@pytest.mark.parametrize("accountant", list(jaxacct.ACCOUNTANTS))
def test_no_steps_is_answered_at_once(accountant, monkeypatch):
  """Steps = 0 gives epsilon = delta = 0 exactly, with no planning and no compiled program
  (the planner and the compiled runners are replaced by functions that fail)."""
  from jaxacct import _batch
  monkeypatch.setattr(jaxacct.pld.accountant._plan, "make_plan",
                      lambda *a, **k: pytest.fail("planned a composition of no steps"))
  calls = []
  original = _batch.answer

  def answer(run, composition, x):
    return original(lambda flat: calls.append(1) or run(flat), composition, x)

  monkeypatch.setattr(_batch, "answer", answer)
  for module in (jaxacct.gdp, jaxacct.rdp, jaxacct.cgf, jaxacct.pld.accountant):
    if hasattr(module, "answer"):
      monkeypatch.setattr(module, "answer", answer)
  q = 1.0 if accountant == "gdp" else 0.01
  e = jaxacct.dpsgd_epsilon(1.0, q, 0, 1e-5, accountant=accountant)
  d = jaxacct.dpsgd_delta(1.0, q, 0, 0.5, accountant=accountant)
  for r in (e, d):
    assert (float(r.lower), float(r.estimate), float(r.upper), int(r.status)) == (0, 0, 0, 0)
  assert not calls


@pytest.mark.parametrize("accountant", list(jaxacct.ACCOUNTANTS))
def test_no_steps_in_a_batch(accountant):
  """In a batch, the settings of no steps are exact and the others computed."""
  q = 1.0 if accountant == "gdp" else 0.01
  mixed = jaxacct.dpsgd_epsilon(1.0, q, np.array([0, 100]), 1e-5, accountant=accountant)
  assert float(mixed.estimate[0]) == float(mixed.upper[0]) == 0.0
  assert float(mixed.estimate[1]) > 0.0


@pytest.mark.parametrize("accountant", ["spa", "edgeworth", "rdp", "gdp"])
def test_pld_options_are_refused_by_other_accountants(accountant):
  for option in ("eps_error", "delta_error", "plan", "batch_size"):
    with pytest.raises(ValueError, match=option):
      jaxacct.dpsgd_epsilon(1.0, 0.01, 100, 1e-5, accountant=accountant, **{option: 0.1})
  with pytest.raises(ValueError, match="smallest_delta"):
    jaxacct.dpsgd_delta(1.0, 0.01, 100, 1.0, accountant=accountant, smallest_delta=1e-9)
  if accountant in ("rdp", "gdp"):  # one method each: naming another is refused
    with pytest.raises(ValueError, match="method"):
      jaxacct.dpsgd_epsilon(1.0, 0.01, 100, 1e-5, accountant=accountant, method="clt")


@pytest.mark.parametrize("accountant", list(jaxacct.ACCOUNTANTS))
def test_dpsgd_steps_are_whole_numbers_for_every_accountant(accountant):
  with pytest.raises(ValueError, match=r"(?<!\w)steps(?!\w)"):
    jaxacct.dpsgd_epsilon(1.0, 0.01, 1.5, 1e-5, accountant=accountant)


def test_real_counts_stay_available_by_an_explicit_composition():
  comp = jaxacct.Composition.of((jaxacct.PoissonSampled(jaxacct.Gaussian(1.0), 0.01), 999.5))
  for accountant in ("spa", "edgeworth", "rdp"):
    assert math.isfinite(float(jaxacct.epsilon(comp, 1e-5, accountant=accountant).estimate))
  with pytest.raises(ValueError, match="counts"):
    jaxacct.epsilon(comp, 1e-5)  # the PLD accountant composes whole steps


def test_shape_mismatch_names_the_parameters():
  with pytest.raises(ValueError, match=r"noise_multiplier \(2,\).*steps \(3,\)"):
    jaxacct.dpsgd_epsilon([1.0, 2.0], 0.01, [10, 20, 30], 1e-5)
  with pytest.raises(ValueError, match=r"sampling_rate \(2,\).*delta \(3,\)"):
    jaxacct.dpsgd_epsilon(1.0, [0.01, 0.02], 10, [1e-5, 1e-6, 1e-7])
  comp = jaxacct.Composition.of((jaxacct.Gaussian(np.array([1.0, 2.0])), np.array([1, 2, 3])))
  with pytest.raises(ValueError, match=r"sigma \(2,\).*counts\[0\] \(3,\)"):
    jaxacct.epsilon(comp, 1e-5, accountant="rdp")


HUGE_EPS = [(jaxacct.Composition.of((jaxacct.Gaussian(1.0), 1)), 750.0),
            (SGD(), 100.0), (SGD(), 800.0)]


@pytest.mark.parametrize("accountant", list(jaxacct.ACCOUNTANTS))
@pytest.mark.parametrize("case", range(len(HUGE_EPS)))
def test_status_bits_agree_with_the_values(accountant, case):
  """Far in the tails every accountant answers, and each bit says what the values show: an
  upper reported as float64's floor carries UPPER_FLOORED (and only then); OUT_OF_RANGE on a
  delta query keeps a finite, valid upper; UPPER_VACUOUS means upper = 1."""
  comp, eps = HUGE_EPS[case]
  if accountant == "gdp":
    comp = jaxacct.Composition.of((jaxacct.Gaussian(1.0), 1))
  r = jaxacct.delta(comp, eps, accountant=accountant)
  upper, status = float(r.upper), int(r.status)
  tiny = float(np.finfo(np.float64).tiny)
  assert not upper < tiny  # never 0 (below any positive truth), never nan
  assert bool(status & results.UPPER_FLOORED) == (upper == tiny)
  if status & results.UPPER_VACUOUS:
    assert upper == 1.0
  if status & results.OUT_OF_RANGE:
    assert math.isfinite(upper)


@pytest.mark.parametrize("accountant", list(jaxacct.ACCOUNTANTS))
def test_no_hang_at_the_float64_floor(accountant):
  comp = jaxacct.Composition.of((jaxacct.Gaussian(2.0), 10))
  tiny = float(np.finfo(np.float64).tiny)
  r = jaxacct.epsilon(comp, tiny, accountant=accountant)
  assert not float(r.upper) < float(jaxacct.gdp.epsilon(comp, 1e-300).lower)
  with pytest.raises(ValueError, match="delta"):
    jaxacct.epsilon(comp, tiny / 4, accountant=accountant)  # subnormal: refused, not flushed
