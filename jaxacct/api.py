"""The front door: epsilon / delta of a composition, and the DP-SGD shortcut.

Every function here checks concrete inputs (raising ``ValueError`` that names the parameter and
its range), plans the grid on the host when no plan is given, and runs a compiled float64
accountant. Under ``jit``/``vmap``/``grad`` the inputs are tracers: they cannot be checked or used
for planning, so pass ``plan=`` (from ``make_plan`` / ``dpsgd_plan`` for the worst case).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxacct import cgf as _cgf
from jaxacct import edgeworth as _edgeworth
from jaxacct import gdp as _gdp
from jaxacct import pld as _pld
from jaxacct import rdp as _rdp
from jaxacct import spa as _spa
from jaxacct._numerics import check_range as _check_range
from jaxacct._numerics import (as_leaf, fast_jit, flatten_batch, float64, is_traced,
                               scoped_gradients, unbatched, vectorised)
from jaxacct.composition import Composition, as_composition
from jaxacct.models import Gaussian, PoissonSampled, SampledGaussianReplaceOne
from jaxacct.results import BELOW_FLOOR, WINDOW_TOO_SMALL, Bounds

RELATIONS = ("add_remove", "replace_one")
# accountant -> (module with epsilon/delta functions, its methods; the first is the default).
# "pld" is the certified FFT accountant (pld.py); "spa" and "edgeworth" read the cumulant
# generating function (run here); "rdp" and "gdp" are their modules' own checked, batched functions.
ACCOUNTANTS = {"pld": (None, ("pld",)), "spa": (_spa, _spa.METHODS),
               "edgeworth": (_edgeworth, _edgeworth.METHODS),
               "rdp": (_rdp, ("optimal_order",)), "gdp": (_gdp, ("mu",))}
# Peak memory of one batch element is ~ 16 arrays of N float64 values; chunks stay under this.
_CHUNK_BYTES = 1 << 28


def _as_float64(tree):
  """Every leaf as a float64 array (inputs may come from a float32 program)."""
  return jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), tree)


def _chunk(plan: _pld.Plan, batch_size):
  """Settings per vectorised chunk. On CPU one at a time: vectorising FFTs gains nothing there,
  and a single setting keeps its runtime branch (the spectrum band, see pld._high_band), which
  vmap would turn into computing both branches. Elsewhere as many as fit the memory budget."""
  if batch_size is not None:
    return int(batch_size)
  if jax.default_backend() == "cpu":
    return 1
  return int(max(1, min(64, _CHUNK_BYTES // (16 * 8 * plan.fft_size))))


def _mapped(single):
  """Applies ``single(composition, x, plan)`` to a flat batch in chunks of ``chunk`` (vmapped)."""

  def run(composition, x, plan, chunk):
    # (batch_size=1 would still vmap, over a batch of one; a plain map is a loop.)
    return jax.lax.map(lambda args: single(*args, plan), (composition, x),
                       batch_size=chunk if chunk > 1 else None)

  return fast_jit(scoped_gradients(run, nondiff_argnums=(3,)), static_argnums=(3,))


def _epsilon_single(composition, delta, plan):
  return _pld.epsilon_from_pld(_pld.compose(composition, plan), delta)


def _delta_single(composition, epsilon, plan):
  return _pld.delta_from_pld(_pld.compose(composition, plan), epsilon)


_epsilon_one = fast_jit(scoped_gradients(_epsilon_single))
_delta_one = fast_jit(scoped_gradients(_delta_single))
_epsilon_many = _mapped(_epsilon_single)
_delta_many = _mapped(_delta_single)
_compose = fast_jit(scoped_gradients(_pld.compose))


def _run(one, many, composition, x, plan, batch_size):
  (flat_comp, flat_x), shape = flatten_batch((composition, x))
  if shape == ():
    return one(*unbatched((flat_comp, flat_x)), plan)
  out = many(flat_comp, flat_x, plan, _chunk(plan, batch_size))
  return jax.tree_util.tree_map(lambda a: a.reshape(shape), out)


# Certificates that can fail on a sweep's shared plan (made for its extremes: the finest grid,
# the widest window and the smallest delta of all its settings) and hold on a setting's own.
_SHARED_PLAN_FAILED = WINDOW_TOO_SMALL | BELOW_FLOOR


def _run_planned(one, many, composition, x, plan, replan, batch_size):
  """``_run`` on a plan jaxacct made itself (``replan(composition, x)`` plans one setting; None
  when the caller gave the plan). When the composed loss outgrew the window (WINDOW_TOO_SMALL,
  bounds widened) it retries with a twice larger window (twice). In a batch, a setting whose
  certificate failed on the shared plan is rerun on a plan of its own (the tighter upper kept)."""
  result = _run(one, many, composition, x, plan, batch_size)
  if replan is None or is_traced(result):
    return result
  for _ in range(2):
    if not np.any(np.asarray(result.status) & WINDOW_TOO_SMALL):
      break
    wider = _pld.widen(plan)
    if wider is None:  # (as wide as float64 serves: the widened bounds stand)
      break
    plan = wider
    result = _run(one, many, composition, x, plan, batch_size)
  failed = np.flatnonzero(np.asarray(result.status) & _SHARED_PLAN_FAILED)
  if np.ndim(result.status) == 0 or failed.size == 0:
    return result
  (flat_comp, flat_x), shape = flatten_batch((composition, x))
  names = ("lower", "estimate", "upper", "status")
  fields = {name: np.array(getattr(result, name)).reshape(-1) for name in names}
  for i in failed:
    comp_i, x_i = unbatched(jax.tree_util.tree_map(lambda a: a[i:i + 1], (flat_comp, flat_x)))
    own = _run_planned(one, many, comp_i, x_i, replan(comp_i, x_i), replan, batch_size)
    if float(own.upper) <= fields["upper"][i]:
      for name in names:
        fields[name][i] = np.asarray(getattr(own, name))
  return Bounds(**{name: jnp.asarray(value.reshape(shape)) for name, value in fields.items()})


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


def _plan_for(composition, delta, eps_error, delta_error, plan):
  if plan is not None:
    return plan
  if is_traced((composition, delta)):
    raise ValueError("under jit/vmap/grad the inputs are traced and cannot be used to plan the "
                     "grid: pass plan=jaxacct.make_plan(...) (or dpsgd_plan) for the worst case")
  return _pld.make_plan(composition, delta, eps_error=eps_error, delta_error=delta_error)


@float64
def make_plan(composition, delta, eps_error=0.01, delta_error=1e-3) -> _pld.Plan:
  """Accuracy plan serving ``composition`` (or a batched sweep of it) down to ``delta``.

  The certified bracket upper - lower is about 2 * ``eps_error``; ``delta_error`` is the lower
  bound's delta slack as a fraction of delta. The plan's grid sizes are static: one compiled
  accountant serves every setting the plan covers.
  """
  return _pld.make_plan(as_composition(composition), delta, eps_error, delta_error)


@float64
def compose(composition, *, delta=1e-10, eps_error=0.01, delta_error=1e-3,
            plan=None) -> _pld.PrivacyLossDistribution:
  """Composed privacy-loss distribution, reusable for many queries and ``append``.

  ``delta`` is the smallest delta the PLD will be asked about (it sizes the grid).
  """
  composition = as_composition(composition)
  composition.check()
  _check_range("delta", delta, 0.0, 1.0)
  plan = _plan_for(composition, delta, eps_error, delta_error, plan)
  return _compose(_as_float64(composition), plan)


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
  replan = None if plan is not None else (
      lambda comp, d: _pld.make_plan(comp, d, eps_error=eps_error, delta_error=delta_error))
  plan = _plan_for(composition, delta, eps_error, delta_error, plan)
  return _run_planned(_epsilon_one, _epsilon_many, composition, delta, plan, replan, batch_size)


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
  _check_range("smallest_delta", smallest_delta, 0.0, 1.0)
  replan = None if plan is not None else (
      lambda comp, _: _pld.make_plan(comp, smallest_delta, eps_error=eps_error,
                                     delta_error=delta_error))
  plan = _plan_for(composition, smallest_delta, eps_error, delta_error, plan)
  return _run_planned(_delta_one, _delta_many, composition, epsilon, plan, replan, batch_size)


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
               eps_error=0.01, delta_error=1e-3) -> _pld.Plan:
  """Plan for DP-SGD queries under jit/vmap/grad: give the worst case of the sweep (smallest
  noise, largest rate and step count, smallest delta), or arrays of the settings to serve."""
  comp = dpsgd_composition(noise_multiplier, sampling_rate, steps, relation)
  return _pld.make_plan(comp, delta, eps_error, delta_error)


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
