"""The front door: epsilon / delta of a composition by any accountant, and the DP-SGD shortcut.

``epsilon`` and ``delta`` check which accountant and options were asked for and hand the query to
that accountant's own public function (``jaxacct.pld.epsilon``, ``jaxacct.spa.epsilon``, ...),
which checks its inputs with the one validator, runs in float64 and returns ``Bounds``: the
answer is the same whichever door is used. Options an accountant does not use are refused.
Under ``jit``/``vmap``/``grad`` the inputs are tracers: they cannot be checked or used for
planning, so the PLD accountant needs ``plan=`` (from ``make_plan`` / ``dpsgd_plan``).
"""

from __future__ import annotations

import numpy as np

from jaxacct import edgeworth as _edgeworth
from jaxacct import gdp as _gdp
from jaxacct import pld as _pld
from jaxacct import rdp as _rdp
from jaxacct import spa as _spa
from jaxacct._inputs import check_broadcast, check_choice, check_range, check_unused, check_whole
from jaxacct._numerics import as_leaf, float64, is_traced
from jaxacct.composition import Composition
from jaxacct.models import Gaussian, PoissonSampled, SampledGaussianReplaceOne
from jaxacct.results import Bounds

RELATIONS = ("add_remove", "replace_one")
"""The neighbouring relations (``relation=``): ``"add_remove"`` (the default: each direction
composed on its own, the worse reported) and ``"replace_one"`` (dp-accounting's replace-one pair
of the subsampled Gaussian)."""
# accountant -> (module with public epsilon/delta, its methods; the first is the default). Only
# "spa" and "edgeworth" take a ``method``; the others have one method, named here for tables.
ACCOUNTANTS = {"pld": (_pld, ("pld",)), "spa": (_spa, _spa.METHODS),
               "edgeworth": (_edgeworth, _edgeworth.METHODS),
               "rdp": (_rdp, ("optimal_order",)), "gdp": (_gdp, ("mu",))}
"""The accountants (``accountant=``), each with its module and its methods (``method=``; the
first is the default): ``"pld"`` (certified, the default), ``"spa"`` (saddle point),
``"edgeworth"``, ``"rdp"`` and ``"gdp"``."""
_PLD_DEFAULTS = dict(eps_error=0.01, delta_error=1e-3)


def _options(accountant, method, **pld_options):
  """The keyword arguments for ``accountant``'s own function; options it does not use refused."""
  check_choice("accountant", accountant, ACCOUNTANTS)
  _, methods = ACCOUNTANTS[accountant]
  if method is not None:
    check_choice(f"method (of the {accountant!r} accountant)", method, methods)
  if accountant != "pld":
    check_unused(accountant, **pld_options)
    return {"method": methods[0] if method is None else method} if len(methods) > 1 else {}
  given = {k: v for k, v in pld_options.items() if v is not None}
  return {**_PLD_DEFAULTS, **given}


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


def epsilon(composition, delta, *, accountant="pld", method=None, eps_error=None,
            delta_error=None, plan=None, batch_size=None) -> Bounds:
  """epsilon(delta) of a composition (worse adjacency direction), certified by default.

  Args:
    composition: a ``Composition``, a model, or a list of (model, count) entries. Leaves may be
      arrays: the result is then batched over their broadcast shape.
    delta: target delta in (0, 1) (scalar or array, broadcast with the composition).
    accountant: "pld" (certified FFT accountant, the default; whole-number counts); "spa" (saddle
      point: constant time in the step count; certified bounds from its Berry-Esseen error, nan
      where vacuous); "edgeworth" (Edgeworth series: constant time; certified bounds from the
      first-order series' error bound, often vacuous below ~1e5 steps); "rdp" (Renyi DP at the
      best continuous order: an upper bound only); "gdp" (Gaussian DP: exact for Gaussian steps,
      a central-limit estimate without bounds for subsampled ones). The constant-time
      accountants take real counts.
    method: the accountant's estimate; for "spa" one of "clt" (default), "msd0", "msd1"; for
      "edgeworth" the series order "order2" (default), "order1", "order3".
    eps_error: the PLD accountant's target half-width of its certified bracket (default 0.01;
      this and the three below as in ``jaxacct.pld.epsilon``, refused by the other accountants).
    delta_error: the PLD accountant's lower-bound slack in delta, as a fraction of delta.
    plan: the PLD accountant's accuracy plan (``make_plan``), needed under jit/vmap/grad.
    batch_size: the PLD accountant's settings per vectorised chunk of a batch (memory bound).
  Returns:
    ``Bounds`` (lower, estimate, upper, status), float64, batched like the inputs.
  """
  options = _options(accountant, method, eps_error=eps_error, delta_error=delta_error,
                     plan=plan, batch_size=batch_size)
  return ACCOUNTANTS[accountant][0].epsilon(composition, delta, **options)


def delta(composition, epsilon, *, accountant="pld", method=None, smallest_delta=None,
          eps_error=None, delta_error=None, plan=None, batch_size=None) -> Bounds:
  """delta(epsilon) of a composition (worse adjacency direction), certified by default.

  ``smallest_delta`` (PLD only, default 1e-10) sizes the grid: answers below it are valid but
  their relative accuracy degrades. Other arguments as in ``epsilon``.
  """
  options = _options(accountant, method, smallest_delta=smallest_delta, eps_error=eps_error,
                     delta_error=delta_error, plan=plan, batch_size=batch_size)
  return ACCOUNTANTS[accountant][0].delta(composition, epsilon, **options)


def _check_dpsgd(noise_multiplier, sampling_rate, steps, relation):
  check_choice("relation", relation, RELATIONS)
  check_range("noise_multiplier", noise_multiplier, 0.0, np.inf)
  check_range("sampling_rate", sampling_rate, 0.0, 1.0, high_open=False)
  check_range("steps", steps, 0.0, np.inf, low_open=False)
  check_whole("steps", steps)


def dpsgd_composition(noise_multiplier, sampling_rate, steps,
                      relation="add_remove") -> Composition:
  """DP-SGD with Poisson sampling: ``steps`` (a whole number) Gaussian steps of noise
  ``noise_multiplier`` (in units of the clip norm) on a batch that holds each example with
  probability ``sampling_rate``.

  ``relation`` is "add_remove" (both directions, the worse reported) or "replace_one"
  (dp-accounting's definition). A concrete rate of 1 is full-batch DP-GD (the Gaussian mechanism).
  """
  noise_multiplier, sampling_rate, steps = map(as_leaf, (noise_multiplier, sampling_rate, steps))
  _check_dpsgd(noise_multiplier, sampling_rate, steps, relation)
  check_broadcast(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, steps=steps)
  full_batch = (not is_traced(sampling_rate)) and bool(np.all(np.asarray(sampling_rate) == 1.0))
  return Composition.of((_dpsgd_model(noise_multiplier, sampling_rate, relation, full_batch),
                         steps))


def _dpsgd_model(noise_multiplier, sampling_rate, relation, full_batch):
  """One DP-SGD step's model (parameters may be traced); ``full_batch`` (static) gives the
  Gaussian mechanism itself (twice the sensitivity for replace-one)."""
  if relation == "replace_one":
    return (Gaussian(noise_multiplier, 2.0) if full_batch
            else SampledGaussianReplaceOne(noise_multiplier, sampling_rate))
  return (Gaussian(noise_multiplier) if full_batch
          else PoissonSampled(Gaussian(noise_multiplier), sampling_rate))


@float64
def dpsgd_plan(noise_multiplier, sampling_rate, steps, delta, *, relation="add_remove",
               eps_error=0.01, delta_error=1e-3, size_cache=None) -> _pld.Plan:
  """Plan for DP-SGD queries under jit/vmap/grad: give the worst case of the sweep (smallest
  noise, largest rate and step count, smallest delta), or arrays of the settings to serve."""
  comp = dpsgd_composition(noise_multiplier, sampling_rate, steps, relation)
  return _pld.make_plan(comp, delta, eps_error=eps_error, delta_error=delta_error,
                        size_cache=size_cache)


def dpsgd_epsilon(noise_multiplier, sampling_rate, steps, delta, *, relation="add_remove",
                  accountant="pld", method=None, eps_error=None, delta_error=None, plan=None,
                  batch_size=None) -> Bounds:
  """Certified epsilon of DP-SGD (Poisson sampling), e.g.
  ``dpsgd_epsilon(1.0, 0.01, 10_000, 1e-5).upper``. Array arguments broadcast into a batch.

  Args are as in ``dpsgd_composition`` and ``epsilon``.
  """
  comp = dpsgd_composition(noise_multiplier, sampling_rate, steps, relation)
  check_broadcast(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, steps=steps,
                  delta=delta)
  return epsilon(comp, delta, accountant=accountant, method=method, eps_error=eps_error,
                 delta_error=delta_error, plan=plan, batch_size=batch_size)


def dpsgd_delta(noise_multiplier, sampling_rate, steps, epsilon, *, relation="add_remove",
                accountant="pld", method=None, smallest_delta=None, eps_error=None,
                delta_error=None, plan=None, batch_size=None) -> Bounds:
  """Certified delta(epsilon) of DP-SGD; arguments as in ``dpsgd_epsilon``."""
  comp = dpsgd_composition(noise_multiplier, sampling_rate, steps, relation)
  check_broadcast(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, steps=steps,
                  epsilon=epsilon)
  return delta(comp, epsilon, accountant=accountant, method=method,
               smallest_delta=smallest_delta, eps_error=eps_error, delta_error=delta_error,
               plan=plan, batch_size=batch_size)
