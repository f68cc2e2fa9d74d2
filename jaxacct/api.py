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

from jaxacct import pld as _pld
from jaxacct._numerics import fast_jit, float64, is_traced, scoped_gradients
from jaxacct.composition import Composition, as_composition
from jaxacct.models import Gaussian, PoissonSampled, SampledGaussianReplaceOne
from jaxacct.results import WINDOW_TOO_SMALL, Bounds

RELATIONS = ("add_remove", "replace_one")
# Peak memory of one batch element is ~ 16 arrays of N float64 values; chunks stay under this.
_CHUNK_BYTES = 1 << 28


def _as_float64(tree):
  """Every leaf as a float64 array (inputs may come from a float32 program)."""
  return jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), tree)


def _check_range(name, value, low, high, low_open=True, high_open=True):
  if is_traced(value):
    return
  vals = np.asarray(value, dtype=np.float64)
  ok = np.isfinite(vals) & ((vals > low) if low_open else (vals >= low))
  ok &= (vals < high) if high_open else (vals <= high)
  if not np.all(ok):
    left, right = "(" if low_open else "[", ")" if high_open else "]"
    raise ValueError(f"{name} must be finite and in {left}{low}, {high}{right}; got {value!r}")


def _batch_shape(tree):
  return np.broadcast_shapes(*[np.shape(x) for x in jax.tree_util.tree_leaves(tree)])


def _flatten_batch(tree, shape):
  """Broadcasts every leaf to ``shape`` and flattens it to one batch axis."""
  size = int(np.prod(shape))
  return jax.tree_util.tree_map(
      lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.float64), shape).reshape(size), tree)


def _chunk(plan: _pld.Plan, batch_size):
  if batch_size is not None:
    return int(batch_size)
  return int(max(1, min(64, _CHUNK_BYTES // (16 * 8 * plan.fft_size))))


def _mapped(single):
  """Applies ``single(composition, x, plan)`` to a flat batch in chunks of ``chunk`` (vmapped)."""

  def run(composition, x, plan, chunk):
    return jax.lax.map(lambda args: single(*args, plan), (composition, x), batch_size=chunk)

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
  composition, x = _as_float64((composition, x))
  shape = _batch_shape((composition, x))
  if shape == ():
    return one(composition, x, plan)
  flat_comp, flat_x = _flatten_batch((composition, x), shape)
  out = many(flat_comp, flat_x, plan, _chunk(plan, batch_size))
  return jax.tree_util.tree_map(lambda a: a.reshape(shape), out)


def _run_planned(one, many, composition, x, plan, planned_here, batch_size):
  """``_run``; when jaxacct planned the grid itself and the composed loss outgrew its window
  (status WINDOW_TOO_SMALL, bounds widened), it retries with a twice larger window (twice)."""
  result = _run(one, many, composition, x, plan, batch_size)
  for _ in range(2 if planned_here and not is_traced(result) else 0):
    if not np.any(np.asarray(result.status) & WINDOW_TOO_SMALL):
      break
    plan = _pld.widen(plan)
    result = _run(one, many, composition, x, plan, batch_size)
  return result


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
def epsilon(composition, delta, *, eps_error=0.01, delta_error=1e-3, plan=None,
            batch_size=None) -> Bounds:
  """Certified epsilon(delta) of a composition (worst adjacency direction).

  Args:
    composition: a ``Composition``, a model, or a list of (model, count) entries. Leaves may be
      arrays: the result is then batched over their broadcast shape.
    delta: target delta in (0, 1) (scalar or array, broadcast with the composition).
    eps_error: target half-width of the certified bracket (upper - lower ~ 2 eps_error).
    delta_error: the lower bound's delta slack, as a fraction of delta.
    plan: a ``Plan`` (required under jit/vmap/grad); planned for the worst case if omitted.
    batch_size: elements per vectorised chunk of a batch (memory bound); automatic if omitted.
  Returns:
    ``Bounds`` (lower, estimate, upper, status), float64, batched like the inputs.
  """
  composition = as_composition(composition)
  composition.check()
  _check_range("delta", delta, 0.0, 1.0)
  planned_here = plan is None
  plan = _plan_for(composition, delta, eps_error, delta_error, plan)
  return _run_planned(_epsilon_one, _epsilon_many, composition, delta, plan, planned_here,
                      batch_size)


@float64
def delta(composition, epsilon, *, smallest_delta=1e-10, eps_error=0.01, delta_error=1e-3,
          plan=None, batch_size=None) -> Bounds:
  """Certified delta(epsilon) of a composition (worst adjacency direction).

  ``smallest_delta`` sizes the grid: answers below it are valid but their relative accuracy
  degrades. Other arguments as in ``epsilon``.
  """
  composition = as_composition(composition)
  composition.check()
  _check_range("epsilon", epsilon, 0.0, np.inf, low_open=False)
  _check_range("smallest_delta", smallest_delta, 0.0, 1.0)
  planned_here = plan is None
  plan = _plan_for(composition, smallest_delta, eps_error, delta_error, plan)
  return _run_planned(_delta_one, _delta_many, composition, epsilon, plan, planned_here,
                      batch_size)


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
                  eps_error=0.01, delta_error=1e-3, plan=None, batch_size=None) -> Bounds:
  """Certified epsilon of DP-SGD (Poisson sampling), e.g.
  ``dpsgd_epsilon(1.0, 0.01, 10_000, 1e-5).upper``. Array arguments broadcast into a batch.

  Args are as in ``dpsgd_composition`` and ``epsilon``.
  """
  comp = dpsgd_composition(noise_multiplier, sampling_rate, steps, relation)
  return epsilon(comp, delta, eps_error=eps_error, delta_error=delta_error, plan=plan,
                 batch_size=batch_size)


@float64
def dpsgd_delta(noise_multiplier, sampling_rate, steps, epsilon, *, relation="add_remove",
                smallest_delta=1e-10, eps_error=0.01, delta_error=1e-3, plan=None,
                batch_size=None) -> Bounds:
  """Certified delta(epsilon) of DP-SGD; arguments as in ``dpsgd_epsilon``."""
  comp = dpsgd_composition(noise_multiplier, sampling_rate, steps, relation)
  return delta(comp, epsilon, smallest_delta=smallest_delta, eps_error=eps_error,
               delta_error=delta_error, plan=plan, batch_size=batch_size)
