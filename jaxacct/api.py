"""The front door: epsilon / delta of a composition, and the DP-SGD shortcut.

Every function here checks concrete inputs (raising ``ValueError`` that names the parameter and
its range), plans the grid on the host when no plan is given, and runs a compiled float64
accountant. Under ``jit``/``vmap``/``grad`` the inputs are tracers: they cannot be checked or used
for planning, so pass ``plan=`` (from ``make_plan`` / ``dpsgd_plan`` for the worst case).
"""

from __future__ import annotations

import numpy as np

from jaxacct import cgf as _cgf
from jaxacct import edgeworth as _edgeworth
from jaxacct import gdp as _gdp
from jaxacct import pld as _pld
from jaxacct import rdp as _rdp
from jaxacct import spa as _spa
from jaxacct._batch import vectorised
from jaxacct._inputs import check_range as _check_range
from jaxacct._inputs import check_whole
from jaxacct._numerics import as_leaf, float64, is_traced
from jaxacct.composition import Composition, as_composition
from jaxacct.models import Gaussian, PoissonSampled, SampledGaussianReplaceOne
from jaxacct.results import Bounds

RELATIONS = ("add_remove", "replace_one")
# accountant -> (module with epsilon/delta functions, its methods; the first is the default).
# "pld" is the certified FFT accountant (pld.py); "spa" and "edgeworth" read the cumulant
# generating function (run here); "rdp" and "gdp" are their modules' own checked, batched functions.
ACCOUNTANTS = {"pld": (None, ("pld",)), "spa": (_spa, _spa.METHODS),
               "edgeworth": (_edgeworth, _edgeworth.METHODS),
               "rdp": (_rdp, ("optimal_order",)), "gdp": (_gdp, ("mu",))}
# Settings per vmapped block of a CGF accountant's batch.
_CGF_CHUNK = 64
_CGF_RUNNERS = {}


def _run_cgf(accountant, quantity, composition, x, method):
  """epsilon or delta by a CGF-based accountant, batched over the broadcast input shape."""
  module, methods = ACCOUNTANTS[accountant]
  method = methods[0] if method is None else method
  if method not in methods:
    raise ValueError(f"method for accountant {accountant!r} must be one of {methods}; "
                     f"got {method!r}")
  if accountant not in ("spa", "edgeworth"):
    return getattr(module, quantity)(composition, x)
  _cgf.check_cgf(composition)
  key = (accountant, quantity, method)
  if key not in _CGF_RUNNERS:
    fn = getattr(module, quantity)
    _CGF_RUNNERS[key] = vectorised(lambda comp, value: fn(comp, value, method), _CGF_CHUNK)
  return _CGF_RUNNERS[key](composition, x)


def _check_accountant(accountant):
  if accountant not in ACCOUNTANTS:
    raise ValueError(f"accountant must be one of {tuple(ACCOUNTANTS)}; got {accountant!r}")


def make_plan(composition, delta, eps_error=0.01, delta_error=1e-3,
              size_cache=None) -> _pld.Plan:
  """Accuracy plan serving ``composition`` (or a batched sweep of it) down to ``delta``: see
  ``jaxacct.pld.make_plan``."""
  return _pld.make_plan(composition, delta, eps_error=eps_error, delta_error=delta_error,
                        size_cache=size_cache)


def compose(composition, *, delta=1e-10, eps_error=0.01, delta_error=1e-3, plan=None,
            size_cache=None) -> _pld.PrivacyLossDistribution:
  """Composed privacy-loss distribution, reusable for many queries and ``append``: see
  ``jaxacct.pld.compose``."""
  return _pld.compose(composition, delta=delta, eps_error=eps_error, delta_error=delta_error,
                      plan=plan, size_cache=size_cache)


@float64
def epsilon(composition, delta, *, accountant="pld", method=None, eps_error=0.01,
            delta_error=1e-3, plan=None, batch_size=None) -> Bounds:
  """epsilon(delta) of a composition (worst adjacency direction), certified by default.

  Args:
    composition: a ``Composition``, a model, or a list of (model, count) entries. Leaves may be
      arrays: the result is then batched over their broadcast shape.
    delta: target delta in (0, 1) (scalar or array, broadcast with the composition).
    accountant: "pld" (certified FFT accountant, the default); "spa" (saddle point: constant
      time in the step count; certified bounds from its Berry-Esseen error, nan where vacuous);
      "edgeworth" (Edgeworth series: constant time; certified bounds from the first-order
      series' error bound, often vacuous below ~1e5 steps);
      "rdp" (Renyi DP at the best continuous order: an upper bound only); "gdp" (Gaussian DP:
      exact for Gaussian steps, a central-limit estimate without bounds for subsampled ones).
    method: the accountant's estimate; for "spa" one of "clt" (default), "msd0", "msd1"; for
      "edgeworth" the series order "order2" (default), "order1", "order3".
    eps_error: target half-width of the certified bracket (upper - lower ~ 2 eps_error).
    delta_error: the lower bound's delta slack, as a fraction of delta.
    plan: a ``Plan`` (required under jit/vmap/grad); planned for the worst case if omitted.
    batch_size: elements per vectorised chunk of a batch (memory bound); automatic if omitted.
  Returns:
    ``Bounds`` (lower, estimate, upper, status), float64, batched like the inputs.
  """
  _check_accountant(accountant)
  composition, delta = as_composition(composition), as_leaf(delta)
  composition.check(integer_counts=accountant == "pld")
  _check_range("delta", delta, 0.0, 1.0)
  if accountant != "pld":
    return _run_cgf(accountant, "epsilon", composition, delta, method)
  return _pld.epsilon(composition, delta, eps_error=eps_error, delta_error=delta_error,
                      plan=plan, batch_size=batch_size)


@float64
def delta(composition, epsilon, *, accountant="pld", method=None, smallest_delta=1e-10,
          eps_error=0.01, delta_error=1e-3, plan=None, batch_size=None) -> Bounds:
  """delta(epsilon) of a composition (worst adjacency direction), certified by default.

  ``smallest_delta`` sizes the PLD grid: answers below it are valid but their relative accuracy
  degrades. Other arguments as in ``epsilon``.
  """
  _check_accountant(accountant)
  composition, epsilon = as_composition(composition), as_leaf(epsilon)
  composition.check(integer_counts=accountant == "pld")
  _check_range("epsilon", epsilon, 0.0, np.inf, low_open=False)
  if accountant != "pld":
    return _run_cgf(accountant, "delta", composition, epsilon, method)
  return _pld.delta(composition, epsilon, smallest_delta=smallest_delta, eps_error=eps_error,
                    delta_error=delta_error, plan=plan, batch_size=batch_size)


def dpsgd_composition(noise_multiplier, sampling_rate, steps,
                      relation="add_remove") -> Composition:
  """DP-SGD with Poisson sampling: ``steps`` Gaussian steps of noise ``noise_multiplier`` (in
  units of the clip norm) on a batch that holds each example with probability ``sampling_rate``.

  ``relation`` is "add_remove" (both directions, the worse reported) or "replace_one"
  (dp-accounting's definition). A concrete rate of 1 is full-batch DP-GD (the Gaussian mechanism).
  """
  if relation not in RELATIONS:
    raise ValueError(f"relation must be one of {RELATIONS}; got {relation!r}")
  _check_range("noise_multiplier", noise_multiplier, 0.0, np.inf)
  _check_range("sampling_rate", sampling_rate, 0.0, 1.0, high_open=False)
  _check_range("steps", steps, 0.0, np.inf, low_open=False)
  check_whole("steps", steps)
  full_batch = (not is_traced(sampling_rate)) and bool(np.all(np.asarray(sampling_rate) == 1.0))
  if relation == "replace_one":
    model = (Gaussian(noise_multiplier, 2.0) if full_batch
             else SampledGaussianReplaceOne(noise_multiplier, sampling_rate))
  else:
    model = (Gaussian(noise_multiplier) if full_batch
             else PoissonSampled(Gaussian(noise_multiplier), sampling_rate))
  return Composition.of((model, steps))


@float64
def dpsgd_plan(noise_multiplier, sampling_rate, steps, delta, *, relation="add_remove",
               eps_error=0.01, delta_error=1e-3, size_cache=None) -> _pld.Plan:
  """Plan for DP-SGD queries under jit/vmap/grad: give the worst case of the sweep (smallest
  noise, largest rate and step count, smallest delta), or arrays of the settings to serve."""
  comp = dpsgd_composition(noise_multiplier, sampling_rate, steps, relation)
  return _pld.make_plan(comp, delta, eps_error=eps_error, delta_error=delta_error,
                        size_cache=size_cache)


@float64
def dpsgd_epsilon(noise_multiplier, sampling_rate, steps, delta, *, relation="add_remove",
                  accountant="pld", method=None, eps_error=0.01, delta_error=1e-3, plan=None,
                  batch_size=None) -> Bounds:
  """Certified epsilon of DP-SGD (Poisson sampling), e.g.
  ``dpsgd_epsilon(1.0, 0.01, 10_000, 1e-5).upper``. Array arguments broadcast into a batch.

  Args are as in ``dpsgd_composition`` and ``epsilon``.
  """
  comp = dpsgd_composition(noise_multiplier, sampling_rate, steps, relation)
  return epsilon(comp, delta, accountant=accountant, method=method, eps_error=eps_error,
                 delta_error=delta_error, plan=plan, batch_size=batch_size)


@float64
def dpsgd_delta(noise_multiplier, sampling_rate, steps, epsilon, *, relation="add_remove",
                accountant="pld", method=None, smallest_delta=1e-10, eps_error=0.01,
                delta_error=1e-3, plan=None, batch_size=None) -> Bounds:
  """Certified delta(epsilon) of DP-SGD; arguments as in ``dpsgd_epsilon``."""
  comp = dpsgd_composition(noise_multiplier, sampling_rate, steps, relation)
  return delta(comp, epsilon, accountant=accountant, method=method,
               smallest_delta=smallest_delta, eps_error=eps_error, delta_error=delta_error,
               plan=plan, batch_size=batch_size)
