"""Calibration: the noise multiplier, sampling rate or number of steps that spends a privacy budget.

For a target epsilon at a delta (or a target delta at an epsilon), each front door finds the
DP-SGD parameter at which the accountant's *certified upper bound* meets the target:

* ``noise_multiplier``: the smallest sigma with upper <= target (the upper falls as sigma grows);
* ``sampling_rate``: the largest q with upper <= target;
* ``steps``: the largest whole number of steps with upper <= target.

Method. The residual is log(upper / target), close to linear in log sigma (log q, log T). The
search starts from the saddle-point accountant's estimate calibrated the same way (constant
time), itself started from the central-limit (GDP) mu of Bu et al. (2020); it grows a bracket
from there and shrinks it by the Illinois secant (``_solver.bracket_search``: values only, since
a slope costs about as much as another certified value; one loop, so the accountant is compiled
once). The value returned
is the bracket end at which the upper bound was *evaluated* on the target's safe side, aimed at
``(1 - margin)`` times the target so that the front door's own plan (which may differ a little
from the calibration's) also stays below it; on the host the answer is then checked by the
front door itself. The root is differentiated by the implicit-function theorem
(``_solver.implicit_root``): d sigma / d target, d sigma / d q, ... (the PLD accountant composes
whole steps, so with it d / d steps raises; the saddle-point and RDP accountants take real
counts).

Plans. The PLD accountant needs an accuracy plan that serves every value the search visits. With
concrete inputs it is made here, for the bracket the guess implies, and remade when the answer
falls outside what it serves. Under ``jit``/``vmap``/``grad`` pass ``plan=`` (from
``calibrate.make_plan``), as for ``jaxacct.epsilon``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxacct import cgf as _cgf
from jaxacct import gdp as _gdp
from jaxacct import rdp as _rdp
from jaxacct import results
from jaxacct import spa as _spa
from jaxacct._inputs import check_choice, check_delta, check_epsilon, check_range, check_whole
from jaxacct._numerics import fast_jit, float64, is_traced, scoped_gradients
from jaxacct._solver import bracket_search, implicit_root
from jaxacct.api import RELATIONS, _dpsgd_model, dpsgd_delta, dpsgd_epsilon
from jaxacct.composition import Composition
from jaxacct.group import GroupSteps, check_fixed_batch, check_group_size, group_sampling
from jaxacct.pld import accountant as _pld
from jaxacct.pld import make_plan as _pld_plan
from jaxacct.pld.plan import stack_plans as _pld_stack
from jaxacct.pld.spectrum import integer_count

UNKNOWNS = ("noise_multiplier", "sampling_rate", "steps")
TARGETS = ("epsilon", "delta")
ACCOUNTANTS = ("pld", "spa", "rdp")  # the accountants that certify an upper bound
# The range searched for each unknown (a bracket is grown from the guess within it).
DOMAIN = {"noise_multiplier": (1e-3, 1e6), "sampling_rate": (1e-12, 1.0),
          "steps": (1.0, 1e7)}
# The PLD upper at the answer is aimed this far below the target (relative to max(1, epsilon)
# for an epsilon target, to delta for a delta one): two plans' uppers differ by less. The
# constant-time accountants compute the same function at the front door: only round-off.
_PLD_MARGIN = {"epsilon": 2e-4, "delta": 1e-3}
_EXACT_MARGIN = 1e-9
_TOL = 1e-9        # relative width of the final bracket of sigma or q
_FTOL = 0.05       # ... or the safe end's upper within this fraction of the margin below the aim
_SEARCH = 60       # evaluations budget of the secant search
_SPREAD = 1.15     # the PLD plan serves the start's value within this factor either side
_STEP = 0.01       # the certified search's first step from its start, in log x (then doubling)
_SHARED_PLAN_FAILED = results.WINDOW_TOO_SMALL | results.BELOW_FLOOR


# ----------------------------------------------------------------------------------------------
# One certified upper bound per setting (the accountants' pure single-setting functions)


def _single(accountant, target):
  """fn(composition, x, plan) -> Bounds of one setting: the upper bound of ``target`` (epsilon
  at delta = x, or delta at epsilon = x) by ``accountant``, traceable and differentiable."""
  if accountant == "pld":
    return _pld._epsilon_single if target == "epsilon" else _pld._delta_single
  if accountant == "spa":
    fn = _spa._epsilon_direction if target == "epsilon" else _spa._delta_direction
    return lambda comp, x, plan: _cgf._worst_direction(comp, fn, x, "clt")
  fn = _rdp._epsilon_single if target == "epsilon" else _rdp._delta_single
  return lambda comp, x, plan: fn(comp, x)


def _composition(sigma, q, steps, relation, full_batch):
  """DP-SGD's composition from (possibly traced) parameters, with the front door's model (a
  ``group.GroupSteps`` relation: against groups)."""
  if isinstance(relation, GroupSteps):
    return relation.composition(sigma, q, steps)
  return Composition.of((_dpsgd_model(sigma, q, relation, full_batch), steps))


# ----------------------------------------------------------------------------------------------
# The traced core: one setting


def _guess(unknown, target, other, sigma, q, steps, relation, target_kind):
  """A starting value from the central-limit mu (Bu et al. 2020): mu = q sqrt(T (e^{1/s^2} - 1))
  with s = sigma (add/remove) or sigma / 2 (replace-one); for a delta target, mu from delta's
  curve at epsilon. Only a start: the bracket search does not depend on its accuracy."""
  if target_kind == "epsilon":
    mu = _gdp._mu_impl(target, other)
  else:
    mu = _gdp._mu_impl(other, target)
  mu = jnp.where(jnp.isfinite(mu) & (mu > 0.0), mu, 1.0)
  scale = (relation.scale if isinstance(relation, GroupSteps)
           else 2.0 if relation == "replace_one" else 1.0)
  lo, hi = DOMAIN[unknown]
  if unknown == "noise_multiplier":
    guess = scale / jnp.sqrt(jnp.log1p(mu * mu / (q * q * steps)))
  elif unknown == "sampling_rate":
    guess = mu / jnp.sqrt(steps * jnp.expm1((scale / sigma) ** 2))
  else:
    guess = jnp.round(mu * mu / (q * q * jnp.expm1((scale / sigma) ** 2)))
  return jnp.clip(jnp.where(jnp.isfinite(guess), guess, 1.0), lo, hi)


def _core(unknown, accountant, target_kind, relation, full_batch, field, step, margin, target,
          other, sigma, q, steps, start, plan):
  """The calibrated value of one setting (implicit gradients) and (whether the search found a
  sign change, the bounds at the value, the status at the other end of the final bracket). The
  search reads ``field`` of the accountant's bounds ("upper"; "estimate" for a starting value)
  and grows its bracket from ``start`` by steps of ``step`` in log x, doubling."""
  single = _single(accountant, target_kind)
  aim = jnp.log(target) + jnp.log1p(-margin)
  whole_steps = accountant == "pld" and unknown != "steps"
  if whole_steps:  # d / d steps raises here (the PLD accountant composes whole steps)
    steps = integer_count(steps)
  known = {"noise_multiplier": sigma, "sampling_rate": q, "steps": steps}

  def bounds_at(value):
    args = dict(known, **{unknown: value})
    if whole_steps:  # (the implicit gradient differentiates the residual in every value it
      # closes over, with explicit zeros: the count enters it as a constant)
      args["steps"] = jax.lax.stop_gradient(args["steps"])
    comp = _composition(args["noise_multiplier"], args["sampling_rate"], args["steps"],
                        relation, full_batch)
    return single(comp, other, plan)

  # Decreasing residuals: the upper falls with sigma and rises with q and T. The safe end (where
  # the upper was seen below the aim) is then b for sigma, a for q and T.
  sign = 1.0 if unknown == "noise_multiplier" else -1.0

  def evaluate(x):
    bounds = bounds_at(x)
    value = getattr(bounds, field)
    value = jnp.where(jnp.isnan(value), jnp.inf, value)  # no bound is never below the target
    return sign * (jnp.log(value) - aim), bounds

  lo, hi = DOMAIN[unknown]
  start = jax.lax.stop_gradient(start)

  def solve(_, __):
    a, b, at_a, at_b, found = bracket_search(
        evaluate, start, step=step, lower=lo, upper=hi, iters=_SEARCH, tol=_TOL,
        whole=unknown == "steps", ftol=_FTOL * margin, safe_end="b" if sign > 0 else "a")
    value, at, far = (b, at_b, at_a) if sign > 0 else (a, at_a, at_b)
    # (as floats: custom_root gives its aux float tangents)
    floats = dataclasses.replace(at, status=at.status.astype(jnp.float64))
    return value, (found.astype(jnp.float64), floats, far.status.astype(jnp.float64))

  if unknown == "steps" or field != "upper":  # a whole number, or a start: no gradient
    value, aux = solve(None, None)
  else:
    value, aux = implicit_root(lambda x: evaluate(x)[0], solve, start, has_aux=True)
  found, at, far_status = aux
  return value, (found > 0.0, dataclasses.replace(at, status=at.status.astype(jnp.int32)),
                 far_status.astype(jnp.int32))


def _start(unknown, target_kind, relation, full_batch, target, other, sigma, q, steps):
  """Where the certified search starts: the saddle-point accountant's estimate calibrated the
  same way (constant time; usually within 1e-3), from the central-limit guess; that guess
  itself where the saddle point finds nothing."""
  clt = _guess(unknown, target, other, sigma, q, steps, relation, target_kind)
  value, (found, _, _) = _core(unknown, "spa", target_kind, relation, full_batch, "estimate",
                               0.25, 0.0, target, other, sigma, q, steps, clt, None)
  lo, hi = DOMAIN[unknown]
  good = found & jnp.isfinite(value) & (value >= lo) & (value <= hi)
  return jax.lax.stop_gradient(jnp.where(good, value, clt))


def _runner(unknown, accountant, target_kind, relation, full_batch, with_start):
  """The compiled search over a flat batch (leaves [settings]): one program per plan and
  options. ``with_start``: the start is computed inside (``_start``) rather than given."""

  def one(margin, target, other, sigma, q, steps, start, plan):
    if with_start:
      start = _start(unknown, target_kind, relation, full_batch, target, other, sigma, q, steps)
    return _core(unknown, accountant, target_kind, relation, full_batch, "upper", _STEP, margin,
                 target, other, sigma, q, steps, start, plan)

  def run(margin, target, other, sigma, q, steps, start, plan):
    # (a plan's leaves: one per setting, or one for all)
    plans = jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, margin.shape), plan)
    args = (margin, target, other, sigma, q, steps, start, plans)
    chunk = None if (accountant == "pld" and jax.default_backend() == "cpu") else 64
    return jax.lax.map(lambda a: one(*a), args, batch_size=chunk)

  return fast_jit(scoped_gradients(run))


def _starter(unknown, target_kind, relation, full_batch):
  """``_start`` compiled over a flat batch."""

  def run(target, other, sigma, q, steps):
    one = lambda *a: _start(unknown, target_kind, relation, full_batch, *a)
    return jax.vmap(one)(target, other, sigma, q, steps)

  return fast_jit(run)


_RUNNERS = {}


def _compiled(kind, *key):
  """The compiled search ("search") or start ("start") for these static options."""
  if (kind, key) not in _RUNNERS:
    _RUNNERS[kind, key] = (_runner if kind == "search" else _starter)(*key)
  return _RUNNERS[kind, key]


# ----------------------------------------------------------------------------------------------
# Front doors: checks, plans, the host's verification


def _check(unknown, target, accountant, relation, target_value, other, known):
  check_choice("unknown", unknown, UNKNOWNS)
  check_choice("target", target, TARGETS)
  check_choice("accountant (a calibration needs a certified upper bound)", accountant,
               ACCOUNTANTS)
  if not isinstance(relation, GroupSteps):
    check_choice("relation", relation, RELATIONS)
  if target == "epsilon":
    check_range("epsilon", target_value, 0.0, np.inf)
    check_delta(other)
    floor = _PLD_MARGIN["epsilon"]  # (the upper is aimed this far below the target)
    if (accountant == "pld" and not is_traced(target_value)
        and np.any(np.asarray(target_value) <= floor)):
      raise ValueError(f"epsilon must be > {floor:g} for the PLD accountant's calibration (its "
                       f"certified upper is aimed {floor:g} below the target); got "
                       f"{target_value!r}")
  else:
    check_delta(target_value)
    check_epsilon(other)
  names = {"noise_multiplier": (0.0, np.inf, True), "sampling_rate": (0.0, 1.0, False),
           "steps": (1.0, np.inf, False)}
  for name, value in known.items():
    low, high, low_open = names[name]
    check_range(name, value, low, high, low_open=low_open, high_open=name != "sampling_rate")
    if name == "steps":
      check_whole("steps", value)


def _margin(accountant, target, target_value):
  """How far below the target the upper is aimed (relative)."""
  if accountant != "pld":
    return jnp.full(jnp.shape(target_value), _EXACT_MARGIN)
  if target == "delta":
    return jnp.full(jnp.shape(target_value), _PLD_MARGIN["delta"])
  return _PLD_MARGIN["epsilon"] * jnp.maximum(1.0, target_value) / target_value


def _settings(unknown, known, target_value, other, margin):
  """(margin, target, other, sigma, q, steps) broadcast and flattened (the unknown's slot: 1)."""
  full = [margin, target_value, other] + [known.get(name, 1.0) for name in UNKNOWNS]
  arrays = jnp.broadcast_arrays(*[jnp.asarray(a, jnp.float64) for a in full])
  return arrays[0].shape, tuple(jnp.ravel(a) for a in arrays)


def _starts(unknown, target, relation, full_batch, flat):
  """``_start`` of every setting of a flat batch (host values)."""
  return np.asarray(_compiled("start", unknown, target, relation, full_batch)(*flat[1:]))


def _plan_for(unknown, target, relation, full_batch, flat, centre, spread, size_cache,
              per_setting=False):
  """A PLD plan serving the search around ``centre`` (each setting's guess or answer) by a
  factor ``spread`` either side, down to the smallest delta the search reads: one grid for the
  whole batch, or (``per_setting``) each setting planned apart and the plans stacked (leaves
  [settings]; a batch of diverse targets then costs its largest setting, not the union)."""
  rows = np.stack([np.asarray(a) for a in flat[1:]] + [np.asarray(centre)], axis=-1)
  if per_setting and len(rows) > 1:
    unique, index = np.unique(rows, axis=0, return_inverse=True)
    plans = [_setting_plan(unknown, target, relation, full_batch, row, spread, size_cache)
             for row in unique]
    return _pld_stack([plans[i] for i in np.ravel(index)])
  return _setting_plan(unknown, target, relation, full_batch, rows, spread, size_cache)


def _setting_plan(unknown, target, relation, full_batch, rows, spread, size_cache):
  """One plan serving ``rows`` ([target, other, sigma, q, steps, centre] each)."""
  target_value, other, sigma, q, steps, centre = np.reshape(rows, (-1, 6)).T
  lo, hi = DOMAIN[unknown]
  ends = np.clip(np.concatenate([centre / spread, centre * spread]), lo, hi)
  known = {"noise_multiplier": np.tile(sigma, 2), "sampling_rate": np.tile(q, 2),
           "steps": np.tile(steps, 2)}
  known[unknown] = np.round(ends) if unknown == "steps" else ends
  comp = _composition(known["noise_multiplier"], known["sampling_rate"], known["steps"],
                      relation, full_batch)
  smallest = other if target == "epsilon" else 0.1 * target_value
  return _pld_plan(comp, np.tile(smallest, 2), size_cache=size_cache)


def _front_door_upper(unknown, target, accountant, relation, flat, value):
  """The certified upper at ``value`` as ``jaxacct.dpsgd_epsilon``/``dpsgd_delta`` give it."""
  _, target_value, other, sigma, q, steps = flat
  known = {"noise_multiplier": sigma, "sampling_rate": q, "steps": steps, unknown: value}
  if isinstance(relation, GroupSteps):
    return np.asarray(relation.upper(target, known["noise_multiplier"], known["sampling_rate"],
                                     known["steps"], other, accountant))
  fn = dpsgd_epsilon if target == "epsilon" else dpsgd_delta
  return np.asarray(fn(known["noise_multiplier"], known["sampling_rate"], known["steps"], other,
                       relation=relation, accountant=accountant).upper)


def _unreachable(unknown, target, accountant, relation, flat, value, index):
  """The ValueError for a setting whose target no value of the unknown meets."""
  _, target_value, other, sigma, q, steps = (np.asarray(a)[index] for a in flat)
  lo, hi = DOMAIN[unknown]
  at = float(np.asarray(value)[index])
  one = tuple(np.asarray([v]) for v in (0.0, target_value, other, sigma, q, steps))
  try:
    upper = float(_front_door_upper(unknown, target, accountant, relation, one,
                                    np.asarray([at]))[0])
  except ValueError:
    upper = float("nan")
  what = f"{target} {target_value:g}"
  setting = (f"({'delta' if target == 'epsilon' else 'epsilon'} {other:g}"
             + "".join(f", {n} {v:g}" for n, v in zip(UNKNOWNS, (sigma, q, steps)) if n != unknown)
             + ")")
  above = not upper <= target_value  # (nan or inf: no finite bound there)
  if unknown == "steps" and not above:
    why = f"every number of steps up to {hi:g} fits (certified upper {upper:.6g} at {at:g})"
  elif unknown == "steps":
    why = f"no number of steps >= 1 fits: one step already gives a certified upper of {upper:.6g}"
  elif unknown == "sampling_rate" and not above:
    why = (f"it would need a sampling rate above 1: the full batch already gives a certified "
           f"upper {target} of {upper:.6g}")
  elif above:
    why = (f"the {accountant} accountant's certified upper {target} stays above the target over "
           f"[{lo:g}, {hi:g}] (at {at:.6g}: {upper:.6g}; inf means it gives no finite bound "
           "there)")
  else:
    why = (f"even {unknown} {at:.6g} keeps the certified upper {target} at {upper:.6g}: the "
           "target does not constrain it")
  return ValueError(f"the target {what} cannot be met by {unknown} {setting}: {why}")


def _budget(target, epsilon, delta):
  """(the target's value, the other quantity): (epsilon, delta) or (delta, epsilon)."""
  return (epsilon, delta) if target == "epsilon" else (delta, epsilon)


@float64
def _calibrate(unknown, target, accountant, relation, plan, size_cache, epsilon, delta, known):
  target_value, other = _budget(target, epsilon, delta)
  _check(unknown, target, accountant, relation, target_value, other, known)
  q = known.get("sampling_rate")
  full_batch = (q is not None and not is_traced(q) and bool(np.all(np.asarray(q) == 1.0))
                and not isinstance(relation, GroupSteps))
  margin = _margin(accountant, target, jnp.asarray(target_value, jnp.float64))
  shape, flat = _settings(unknown, known, target_value, other, margin)
  run = _compiled("search", unknown, accountant, target, relation, full_batch, is_traced(flat))
  if is_traced(flat):
    if accountant == "pld" and plan is None:
      raise ValueError("under jit/vmap/grad the inputs are traced and cannot be used to plan the "
                       "grid: pass plan=jaxacct.calibrate.make_plan(...) for the targets to serve")
    value, (found, _, _) = run(*flat, flat[1], plan)  # (the start is computed inside)
    return jnp.reshape(jnp.where(found, value, jnp.nan), shape)
  own_plan = accountant == "pld" and plan is None
  start = _starts(unknown, target, relation, full_batch, flat)
  centre, spread, replan = start, _SPREAD, own_plan
  for _ in range(6):
    if replan:
      plan = _plan_for(unknown, target, relation, full_batch, flat, centre, spread, size_cache,
                       per_setting=True)
    value, (found, bounds, far_status) = run(*flat, start, plan)
    missed = np.flatnonzero(~np.asarray(found))
    if missed.size:
      raise _unreachable(unknown, target, accountant, relation, flat, value, missed[0])
    failed = (np.asarray(bounds.status) | np.asarray(far_status)) & _SHARED_PLAN_FAILED
    replan = own_plan and bool(np.any(failed))
    upper = _front_door_upper(unknown, target, accountant, relation, flat, value)
    over = ~(upper <= np.asarray(flat[1]))  # (nan: no bound, over)
    if not (replan or np.any(over)):
      break
    # A plan that failed the search (its answer at the edge of what the plan served: the start
    # was far off) is remade around that answer, twice as wide in log x each time.
    centre, spread = value, (spread * spread if replan else _SPREAD)
    # Where the front door's own plan reads a higher upper, aim lower by twice the excess.
    excess = np.where(over, np.nan_to_num(upper / np.asarray(flat[1]) - 1.0, nan=1e-3,
                                          posinf=1e-3), 0.0)
    flat = (flat[0] + 2.0 * excess + np.where(over, _EXACT_MARGIN, 0.0),) + flat[1:]
  else:
    raise RuntimeError(f"calibrating {unknown}: the certified upper at the answer stayed above "
                       "the target after 6 attempts; please report this setting")
  value = np.asarray(value)
  if unknown == "steps":
    value = _last_whole_step(target, accountant, relation, flat, value)
  return jnp.reshape(jnp.asarray(value), shape)


def _last_whole_step(target, accountant, relation, flat, steps):
  """The largest T with the front door's upper <= target, starting from ``steps`` (the search's
  answer on its own plan): a step or two either way at most."""
  limit = np.asarray(flat[1])
  for _ in range(8):
    here = _front_door_upper("steps", target, accountant, relation, flat, steps) <= limit
    above = _front_door_upper("steps", target, accountant, relation, flat, steps + 1) <= limit
    if np.all(here & ~above):
      return steps
    steps = np.where(~here, steps - 1, np.where(above, steps + 1, steps))
  raise RuntimeError("the front door's upper bound is not monotone in the number of steps near "
                     f"{steps}: please report this setting")


_TARGET_DOC = """
  Args:
    epsilon, delta: the budget. With ``target="epsilon"`` (default) the certified upper epsilon
      at ``delta`` is kept <= ``epsilon``; with ``target="delta"`` the certified upper delta at
      ``epsilon`` is kept <= ``delta``.
    accountant: "pld" (default, certified FFT accountant), "spa" or "rdp" (constant time).
    relation: "add_remove" (default) or "replace_one", as in ``jaxacct.dpsgd_epsilon``.
    plan: the PLD accountant's plan (``calibrate.make_plan``); needed under jit/vmap/grad.
    size_cache: a ``jaxacct.SizeCache`` shared with other calls (reuses compiled programs).
  Array arguments broadcast into a batch (one compiled program). Raises ``ValueError`` on invalid
  input and on a target that no value reaches (the message says what is reachable); under
  tracing such a setting gives nan.
"""


def noise_multiplier(epsilon, delta, sampling_rate, steps, *, target="epsilon", accountant="pld",
                     relation="add_remove", plan=None, size_cache=None) -> jax.Array:
  """The smallest noise multiplier whose certified upper bound meets the budget, for DP-SGD with
  Poisson rate ``sampling_rate`` over ``steps`` steps (float64 array; differentiable in the
  target, the rate and, with real-count accountants, the steps).
  """
  known = {"sampling_rate": sampling_rate, "steps": steps}
  return _calibrate("noise_multiplier", target, accountant, relation, plan, size_cache, epsilon,
                    delta, known)


def sampling_rate(epsilon, delta, noise_multiplier, steps, *, target="epsilon",
                  accountant="pld", relation="add_remove", plan=None,
                  size_cache=None) -> jax.Array:
  """The largest Poisson sampling rate whose certified upper bound meets the budget, for DP-SGD
  with ``noise_multiplier`` over ``steps`` steps (float64 array; differentiable)."""
  known = {"noise_multiplier": noise_multiplier, "steps": steps}
  return _calibrate("sampling_rate", target, accountant, relation, plan, size_cache, epsilon,
                    delta, known)


def steps(epsilon, delta, noise_multiplier, sampling_rate, *, target="epsilon",
          accountant="pld", relation="add_remove", plan=None, size_cache=None) -> jax.Array:
  """The largest whole number of DP-SGD steps whose certified upper bound meets the budget
  (float64 array of whole numbers; T + 1 steps would exceed it)."""
  known = {"noise_multiplier": noise_multiplier, "sampling_rate": sampling_rate}
  return _calibrate("steps", target, accountant, relation, plan, size_cache, epsilon,
                    delta, known)


for _fn in (noise_multiplier, sampling_rate, steps):
  _fn.__doc__ += _TARGET_DOC


def group_noise_multiplier(epsilon, delta, steps, group_size, *, sampling_rate=None,
                           batch_size=None, dataset_size=None, target="epsilon",
                           accountant="pld", size_cache=None) -> jax.Array:
  """The smallest noise multiplier whose certified upper bound meets the budget against groups
  of ``group_size`` examples (add or remove up to k: ``jaxacct.group_epsilon``), for DP-SGD with
  Poisson rate ``sampling_rate``, or a fixed batch of ``batch_size`` from a dataset of at least
  ``dataset_size``, over ``steps`` steps. ``group_size`` is one whole number (a static shape);
  the other arguments broadcast into a batch. With the PLD accountant the inputs must be
  concrete (it plans its own grids); under jit/vmap/grad use ``accountant="spa"`` or ``"rdp"``
  (implicit gradients in the target and, for Poisson sampling, the rate)."""
  check_group_size(group_size)
  if np.ndim(group_size):
    raise ValueError(f"group_size must be one whole number here; got {group_size!r}")
  sampling = group_sampling(sampling_rate, batch_size, dataset_size)
  if sampling == "fixed":
    check_fixed_batch(batch_size, dataset_size)
    if np.ndim(batch_size) or np.ndim(dataset_size):
      raise ValueError("batch_size and dataset_size must be single whole numbers here")
    spec = GroupSteps(int(group_size), int(batch_size), int(dataset_size))
    sampling_rate = batch_size / dataset_size
  else:
    spec = GroupSteps(int(group_size))
  known = {"sampling_rate": sampling_rate, "steps": steps}
  return _calibrate("noise_multiplier", target, accountant, spec, None, size_cache, epsilon,
                    delta, known)


@float64
def make_plan(unknown, epsilon, delta, *, noise_multiplier=None, sampling_rate=None,
              steps=None, target="epsilon", relation="add_remove", spread=1.5,
              size_cache=None):
  """A PLD plan for calibrating ``unknown`` (one of ``UNKNOWNS``) to the given targets (arrays:
  a sweep) under jit/vmap/grad: it serves the answers within a factor ``spread`` of the
  central-limit guess (a wider ``spread`` for settings far from the central limit, e.g. small
  sampling rates with few steps; an answer outside gets status bits WINDOW_TOO_SMALL)."""
  known = {name: value for name, value in (("noise_multiplier", noise_multiplier),
                                           ("sampling_rate", sampling_rate), ("steps", steps))
           if name != unknown}
  missing = [name for name, value in known.items() if value is None]
  if missing:
    raise ValueError(f"calibrating {unknown} needs {' and '.join(missing)}")
  target_value, other = _budget(target, epsilon, delta)
  _check(unknown, target, "pld", relation, target_value, other, known)
  check_range("spread", spread, 1.0, np.inf)
  q = known.get("sampling_rate")
  full_batch = q is not None and bool(np.all(np.asarray(q) == 1.0))
  margin = _margin("pld", target, jnp.asarray(target_value, jnp.float64))
  _, flat = _settings(unknown, known, target_value, other, margin)
  centre = _starts(unknown, target, relation, full_batch, flat)
  return _plan_for(unknown, target, relation, full_batch, flat, centre, spread, size_cache)


def get_noise_multiplier(*, target_epsilon, target_delta, sample_rate, epochs=None, steps=None,
                         accountant="pld", epsilon_tolerance=0.01, **kwargs) -> float:
  """Opacus-compatible: the noise multiplier for ``target_epsilon`` at ``target_delta``, as a
  float. Give ``steps`` or ``epochs`` (steps = int(epochs / sample_rate), as Opacus counts them).
  The certified upper epsilon at the answer is <= ``target_epsilon`` and within
  ``epsilon_tolerance`` of it (here much closer: see ``noise_multiplier``). ``accountant``:
  "pld" (default), "spa" or "rdp"; other keywords go to ``noise_multiplier`` (``relation``).
  """
  if (steps is None) == (epochs is None):
    raise ValueError("get_noise_multiplier takes either steps or epochs (exactly one)")
  if steps is None:
    check_range("epochs", epochs, 0.0, np.inf)
    steps = int(epochs / sample_rate)
  check_range("epsilon_tolerance", epsilon_tolerance, 0.0, np.inf)
  return float(noise_multiplier(target_epsilon, target_delta, sample_rate, steps,
                                accountant=accountant, **kwargs))
