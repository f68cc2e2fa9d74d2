"""The PLD accountant's front door: check, plan, run; the planner's answer when a certificate
fails on a plan (a wider window, a plan of a setting's own).

Data flows one way: ``epsilon``/``delta`` check their inputs, answer settings of no steps at once
(epsilon = delta = 0), plan the rest on the host (``plan.batch_plan``: a batch's settings each
sized apart where that is cheaper than one grid for all), run the compiled accountant
(``distribution.compose`` + ``query``; a large setting on CPU from the PLD kept as its band,
``distribution.compose_band``) on each block of settings, and, where jaxacct made the
plan, rerun what a certificate could not serve on the plan ``plan.widen`` or a setting's own
plan gives. Under ``jit``/``vmap``/``grad`` the inputs are traced: there is no planning, the
caller's ``plan`` serves every setting.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np

from jaxacct import _batch
from jaxacct._inputs import check_delta, check_epsilon, check_range
from jaxacct._numerics import as_leaf, fast_jit, float64, is_traced, scoped_gradients
from jaxacct.composition import Composition, checked
from jaxacct.pld import plan as _plan
from jaxacct.pld import spectrum
from jaxacct.pld.distribution import PrivacyLossDistribution, compose as _compose_pure
from jaxacct.pld.distribution import compose_band
from jaxacct.pld.query import delta_from_pld, epsilon_from_pld
from jaxacct.results import BELOW_FLOOR, WINDOW_TOO_SMALL, Bounds

# Peak memory of one batch element is ~ 16 arrays of N float64 values; chunks stay under this.
_CHUNK_BYTES = 1 << 28
# Certificates that can fail on a sweep's shared plan (made for its extremes: the finest grid,
# the widest window and the smallest delta of all its settings) and hold on a setting's own.
_SHARED_PLAN_FAILED = WINDOW_TOO_SMALL | BELOW_FLOOR
_FIELDS = ("lower", "estimate", "upper", "status")


def _chunk(plan: _plan.Plan, batch_size):
  """Settings per vectorised chunk. On CPU one at a time: vectorising FFTs gains nothing there,
  and a single setting keeps its runtime branch (the spectrum band, see spectrum._high_band),
  which vmap would turn into computing both branches. Elsewhere as many as fit the memory
  budget."""
  if batch_size is not None:
    return int(batch_size)
  if jax.default_backend() == "cpu":
    return 1
  return int(max(1, min(64, _CHUNK_BYTES // (16 * 8 * plan.fft_size))))


def _epsilon_single(composition, delta, plan):
  return epsilon_from_pld(_compose_pure(composition, plan), delta)


def _delta_single(composition, epsilon, plan):
  return delta_from_pld(_compose_pure(composition, plan), epsilon)


def _mapped(single):
  """``single(composition, x, plan)`` over a flat batch in chunks of ``chunk`` (vmapped); a
  plan whose leaves are [settings] (``plan.batch_plan``: each setting its own grid) is mapped
  with the batch, one with scalar leaves serves every setting."""

  def run(composition, x, plan, chunk):
    # (batch_size=1 would still vmap, over a batch of one; a plain map is a loop.)
    chunk = chunk if chunk > 1 else None
    if jnp.ndim(plan.grid_step) == 0:
      return jax.lax.map(lambda args: single(*args, plan), (composition, x), batch_size=chunk)
    return jax.lax.map(lambda args: single(*args), (composition, x, plan), batch_size=chunk)

  return fast_jit(scoped_gradients(run, nondiff_argnums=(3,)), static_argnums=(3,))


# glibc maps an allocation over 32 MiB fresh from the kernel (its mmap threshold grows no
# further), and XLA:CPU allocates a program's temporaries as one block anew at every call: past
# this size every page of that block faults in again on each call (``_in_two_programs``).
_FRESH_MAPPING_BYTES = 32 << 20


def _temporaries(composition, plan):
  """Estimated bytes of temporaries of the single-setting program and of its query alone, fitted
  to XLA's ``memory_analysis`` of 15 settings (``benchmarks/profile_runtime.py --programs``
  prints both for ten), within ~21 %: per direction, 38 a grid point and 100 a step-grid point
  and entry; the query 16 (directions + 1) a grid point."""
  directions = spectrum.directions(composition).shape[0]
  entries = len(composition.mechanisms)
  single = directions * (38 * plan.fft_size + 100 * entries * plan.per_step_size)
  return single, 16 * (directions + 1) * plan.fft_size


def _in_two_programs(composition, plan) -> bool:
  """Whether one setting is composed and queried as two programs, not one: on CPU where the
  query's temporaries alone do not pass ``_FRESH_MAPPING_BYTES``. Where the single program's
  pass it, two programs fault in less on each call (0.71-0.98x the time); below, compiled with
  the elemental emitters (``compile_cache.quick_options``), they run as fast as one (12-05, T
  100 to 3,000: 5.3 / 6.1 / 12.2 ms against 5.4 / 6.8 / 12.6 ms, the bounds bit for bit the
  same), and a first answer compiles the two side by side (``_exported.prepare``)."""
  _, query = _temporaries(composition, plan)
  return jax.default_backend() == "cpu" and query <= _FRESH_MAPPING_BYTES


# (the programs of one setting's full PLD serve first answers: they compile ~1 s sooner with
# XLA's elemental emitters, ``quick``; the band's serves warm answers. Within ``answering_once``
# their twins compiled at the back end's lowest level serve plans up to ``_ONE_ANSWER_MAX_FFT``)
_compose = fast_jit(scoped_gradients(_compose_pure), exported="pld.compose", quick=True)
_compose_once = fast_jit(scoped_gradients(_compose_pure), exported="pld.compose",
                         quick="one_answer")

# Grid points up to which a process that answers one question (``answering_once``) compiles a
# setting's full PLD at XLA's lowest back-end level (``compile_cache.LEVEL_OPTION``): it
# compiles ~0.8 s sooner and runs slower by ~50 ms at the command line's default setting
# (327,680 points) and ~0.3 s at 3.1 M points, where a calibration's few reads would spend it.
_ONE_ANSWER_MAX_FFT = 1_310_720


# The band's sums' round-off allowance is kept under this share of the lower bound's delta slack
# eta = delta_error x delta (the plan's window tail level is 1e-2 eta): below delta ~1e-8 at
# T = 10^4 it would loosen the bounds (by ~1e-5 relative at delta 1e-10), so those run in full.
_BAND_ROUND_OFF_SHARE = 0.1


# Set within ``answering_once``: a setting is never first answered from its band.
_ONE_ANSWER = contextvars.ContextVar("jaxacct_one_answer", default=False)


@contextlib.contextmanager
def answering_once():
  """Within this context the front door answers a single setting from its full PLD (one
  program, or two), never first from the PLD's band: for a process that answers one question
  (the command line), where compiling is most of its time. The band's program runs ~1.5-2x
  faster warm but compiles ~0.3-0.4 s slower at T = 10^4 (12-05, quick-compile flags: trace,
  lowering and compilation 2.97-3.15 s against 2.68 s for the two programs). The bounds are
  the full PLD's: the band's carry its sums' round-off allowance as well (upper 6.1877237472
  against 6.1877237481 at the command line's default setting). Plans up to
  ``_ONE_ANSWER_MAX_FFT`` points compile at XLA's lowest back-end level (the same bounds to
  round-off: 4e-12 relative at the median of the 67 stored references, 3.1e-8 at most)."""
  token = _ONE_ANSWER.set(True)
  try:
    yield
  finally:
    _ONE_ANSWER.reset(token)


def _as_band(composition, plan) -> bool:
  """Whether one setting is first answered from its PLD kept as its band (``_band_single``): on
  CPU, where the plan drops the spectrum above a band, the single program's temporaries pass
  ``_FRESH_MAPPING_BYTES`` (large grids, where the inverse transform and the query's O(N) sums
  cost most: 0.39-0.70x the time of the better of the one program and the two, 12-03, T 10^4 to
  10^5; the same bounds to ~1e-9 relative at delta 1e-5) and the band's sums' round-off is a
  small share of the delta the plan serves (``spectrum.band_round_off``)."""
  if _ONE_ANSWER.get():
    return False
  single, _ = _temporaries(composition, plan)
  slack = 100.0 * float(np.min(np.exp(np.asarray(plan.log_window_tail, np.float64))))
  return (jax.default_backend() == "cpu" and plan.band < plan.fft_size // 2 + 1
          and single > _FRESH_MAPPING_BYTES
          and spectrum.band_round_off(plan) <= _BAND_ROUND_OFF_SHARE * slack)


def _band_single(quantity):
  """``quantity``'s bounds of one setting from its PLD kept as its band
  (``distribution.compose_band``: no inverse transform, each delta in O(band)), and whether
  they are as tight as the full PLD's (the spectrum above the band negligible in every
  direction; where it is not they stay certified, loosely)."""
  query = _QUERIES[quantity]

  def single(composition, x, plan):
    pld = compose_band(composition, plan)
    return query(pld, x), jnp.all(spectrum.high_band_negligible(pld.high_log, plan))

  return single


def _compiled_for_one_answer(plan) -> bool:
  """Whether a setting's full PLD programs are the twins compiled at XLA's lowest back-end
  level: within ``answering_once``, for plans up to ``_ONE_ANSWER_MAX_FFT`` points."""
  return _ONE_ANSWER.get() and plan.fft_size <= _ONE_ANSWER_MAX_FFT


class _OneSetting:
  """The front door's accountant of one setting. From its band first where ``_as_band``; else,
  or where the band's answer is loose, ``single`` as one compiled program, or compose and query
  as two (``_in_two_programs``); each exported for later processes. Under a caller's
  jit/vmap/grad always ``single`` (the caller compiles it; the two halves' gradient rules would
  hand each other the PLD's integer fields). ``start`` dispatches and ``finish`` reads, so a
  loop over settings queues its first programs before it waits on any."""

  def __init__(self, quantity, single):
    full = lambda fn, name, quick: fast_jit(scoped_gradients(fn), exported=name, quick=quick)
    # (compose, query, the one program): for any process, and for one that answers once (one
    # export of each serves both: they differ in XLA's options alone)
    self.tiers = {once: (_compose_once if once else _compose,
                         full(_QUERIES[quantity], f"pld.{quantity}.query", quick),
                         full(single, f"pld.{quantity}", quick))
                  for once, quick in ((False, True), (True, "one_answer"))}
    self.banded = fast_jit(scoped_gradients(_band_single(quantity)),
                           exported=f"pld.{quantity}.band")

  def start(self, composition, x, plan):
    """(bounds, whether they stand: None where nothing is left to check), dispatched."""
    if not is_traced((composition, x, plan)) and _as_band(composition, plan):
      return self.banded(composition, x, plan)
    return self._full(composition, x, plan), None

  def finish(self, started, composition, x, plan):
    """The bounds of ``start``, rerun in full where the band's were loose."""
    bounds, tight = started
    return bounds if tight is None or bool(tight) else self._full(composition, x, plan)

  def _full(self, composition, x, plan):
    compose, query, fused = self.tiers[_compiled_for_one_answer(plan)]
    if not is_traced((composition, x, plan)) and _in_two_programs(composition, plan):
      # (each program made on a thread of its own, the query's from the PLD's shapes read off
      # the composition's export: a first answer compiles the two side by side)
      shapes = compose.output_specs(composition, plan)
      if shapes is not None:
        compose.prepare(composition, plan)
        query.prepare(shapes, x)
      return query(compose(composition, plan), x)
    return fused(composition, x, plan)

  def __call__(self, composition, x, plan):
    return self.finish(self.start(composition, x, plan), composition, x, plan)


_QUERIES = {"epsilon": epsilon_from_pld, "delta": delta_from_pld}
_RUNNERS = {"epsilon": (_OneSetting("epsilon", _epsilon_single), _mapped(_epsilon_single)),
            "delta": (_OneSetting("delta", _delta_single), _mapped(_delta_single))}


def single_program(quantity):
  """The accountant of one setting that the front door runs: fn(composition, x, plan) -> Bounds
  of ``quantity`` ("epsilon" at delta = x, or "delta" at epsilon = x), a function that runs a
  compiled program on the PLD's band, or one program, or two (``_OneSetting``). A caller that
  reads single settings on its own plans (calibration's search) shares its compilations."""
  return _RUNNERS[quantity][0]


def _shared_many(mechanisms, counts, x, plan, chunk, quantity):
  """A batch of compositions of the same models (counts [settings, entries]): each model is
  discretised and transformed once, then each setting combines the shared spectra with its
  counts (a count-weighted sum of logs), materialises and is queried."""
  flags = spectrum.directions(Composition(mechanisms, counts[0]))
  terms = spectrum.entry_terms_by_direction(mechanisms, flags, plan, plan.fft_size // 2 + 1)

  def single(args):
    row, value = args
    fields = spectrum.fields_from_terms(terms, row, plan)
    return _QUERIES[quantity](PrivacyLossDistribution(plan=plan, **fields), value)

  return jax.lax.map(single, (counts, x), batch_size=chunk if chunk > 1 else None)


_shared = fast_jit(scoped_gradients(_shared_many, nondiff_argnums=(4, 5)), static_argnums=(4, 5))


def _shares_models(composition):
  """True when no model parameter is batched: the batch comes from the counts (or the query)."""
  leaves = jax.tree_util.tree_leaves(composition.mechanisms)
  return all(np.ndim(leaf) == n for leaf, n in zip(leaves, _batch.event_ndims(
      composition.mechanisms)))


def _run(quantity, flat, plan, batch_size, models=None):
  """The compiled accountant on a flat batch (leaves [settings, ...]): flat Bounds. With
  ``models`` (the compositions' shared, unbatched models) each model is evaluated once."""
  one, many = _RUNNERS[quantity]
  size = jax.tree_util.tree_leaves(flat)[0].shape[0]
  if size == 1:  # (reshaped on the host: nothing compiled beside the accountant)
    out = jax.device_get(one(*_batch.take(flat, 0), plan))
    return jax.tree_util.tree_map(lambda a: np.reshape(a, (1,)), out)
  if models is not None:
    counts = jnp.stack([jnp.asarray(c) for c in flat[0].counts], axis=1)
    return _shared(models, counts, jnp.asarray(flat[1]), plan, _chunk(plan, batch_size),
                   quantity)
  chunk = _chunk(plan, batch_size)
  if chunk == 1 and not is_traced((flat, plan)) and (
      plan.fft_size <= _LOOP_MAX_FFT or _as_band(flat[0], plan)
      or _in_two_programs(flat[0], plan)):
    return _looped(one, flat, plan)
  return many(*flat, plan, chunk)


# One setting at a time, plans up to this FFT size run as a host loop of the single-setting
# program (``_looped``), larger ones as one mapped program (12-02, by hand, 12 settings a batch,
# T 100 to 10^4: the loop 1.10-1.66x faster up to 327,680 points, one tie; 0.86-1.13x beyond,
# where each call's fresh buffers of tens of MB cost more than the slices save; see also
# ``benchmarks/bench_pld.py``'s batches of small plans). Larger plans loop too where each
# setting runs from its band (``_as_band``) or as two programs (``_in_two_programs``): no fresh
# buffers over 32 MiB. 12-03, 12 sigmas 0.9...1.2 at q 0.01, alternated: from the band 0.50 s,
# as two programs 0.66 s, mapped 0.92 s at T = 10^4; 1.07 / 1.59 / 1.62 s at T = 2 x 10^4;
# 5.57 / 9.13 / 9.13 s at T = 10^5.
_LOOP_MAX_FFT = 327_680


def _looped(one, flat, plan):
  """``one`` (the single-setting program) on each setting of a flat batch in turn, from the
  host, on its row of a per-setting plan (or the plan). Not a ``lax.map``: there each setting's
  parameters and plan leaves are sliced inside the loop, and XLA:CPU fuses those slices into
  the step's elementwise kernels, which then run slower. Calls are dispatched before any result
  is read (they queue)."""
  rows = np.ndim(plan.grid_step) == 1
  size = jax.tree_util.tree_leaves(flat)[0].shape[0]
  args = [(*_batch.take(flat, i), _batch.take(plan, i) if rows else plan) for i in range(size)]
  started = [one.start(*a) for a in args]
  out = [one.finish(s, *a) for s, a in zip(started, args)]
  return jax.tree_util.tree_map(lambda *a: np.stack(a), *jax.device_get(out))


def _planned(quantity, flat, planner, size_cache, batch_size, models=None):
  """``_run`` on a plan made for ``flat`` by ``planner``; what a certificate could not serve is
  rerun: on a wider window (twice at most) after WINDOW_TOO_SMALL, and, in a batch, a setting
  whose certificate failed on the batch's plan on a plan of its own (the tighter upper kept).
  With shared ``models`` the planner also evaluates each model once."""
  composition, x = flat
  plan = planner(composition if models is None else Composition(models, composition.counts), x,
                 models is None)
  result = _run(quantity, flat, plan, batch_size, models)
  for _ in range(2):
    if not np.any(np.asarray(result.status) & WINDOW_TOO_SMALL):
      break
    wider = _plan.widen(plan, size_cache)
    if wider is None:  # (as wide as float64 serves: the widened bounds stand)
      break
    plan = wider
    result = _run(quantity, flat, plan, batch_size, models)
  failed = np.flatnonzero(np.asarray(result.status) & _SHARED_PLAN_FAILED)
  if np.size(result.status) == 1 or failed.size == 0:
    return result
  fields = {name: np.array(getattr(result, name)) for name in _FIELDS}
  for i in failed:
    own = _planned(quantity, _batch.select(flat, [i]), planner, size_cache, batch_size)
    if float(own.upper[0]) <= fields["upper"][i]:
      for name in _FIELDS:
        fields[name][i] = np.asarray(getattr(own, name))[0]
  return Bounds(**fields)


def _answer(quantity, composition, x, plan, planner, size_cache, batch_size):
  """The front door's one pass (``_batch.answer``: settings of no steps answered at once), on
  the caller's plan or, planned here, with the planner's reruns. A batch of compositions that
  share their models (only counts or the query batched) evaluates each model once."""
  if plan is None and is_traced((composition, x)):
    raise ValueError("under jit/vmap/grad the inputs are traced and cannot be used to plan the "
                     "grid: pass plan=jaxacct.make_plan(...) (or dpsgd_plan) for the worst case")
  models = None  # (one setting has nothing to share: it is planned and run on its own)
  if (not is_traced(composition) and _shares_models(composition)
      and np.prod(_batch.batch_shape((composition, x))) > 1):
    models = jax.tree_util.tree_map(lambda a: jax.device_put(np.asarray(a, np.float64)),
                                    composition.mechanisms)  # (converted on the host)
  if plan is not None:
    run = lambda flat: _run(quantity, flat, plan, batch_size, models)
  else:
    run = lambda flat: _planned(quantity, flat, planner, size_cache, batch_size, models)
  return _batch.answer(run, composition, x)


def _planner(eps_error, delta_error, size_cache, smallest_delta=None):
  """Plans a flat batch (for delta queries: down to ``smallest_delta``): each setting sized
  apart where that is cheaper (``plan.batch_plan``; not where the settings share their models,
  which are then discretised once on one grid), else one grid for the batch's worst case."""
  def plan(composition, x, per_setting):
    make = _plan.batch_plan if per_setting else _plan.make_plan
    return make(composition, x if smallest_delta is None else smallest_delta, eps_error,
                delta_error, size_cache)
  return plan


def _check_accuracy(eps_error, delta_error):
  check_range("eps_error", eps_error, 0.0, 1.0, high_open=False)
  check_range("delta_error", delta_error, 0.0, 1.0)


@float64
def make_plan(composition, delta, *, eps_error=0.01, delta_error=1e-3,
              size_cache=None) -> _plan.Plan:
  """Accuracy plan serving ``composition`` (or a batched sweep of it) down to ``delta``.

  The certified bracket upper - lower is about 2 * ``eps_error``; ``delta_error`` is the lower
  bound's delta slack as a fraction of delta. The plan's grid sizes are static: one compiled
  accountant serves every setting the plan covers. A plan depends only on these inputs unless a
  ``size_cache`` (``jaxacct.pld.SizeCache``) is given, which lets nearby plans reuse compiled
  sizes.
  """
  composition = checked(composition, integer_counts=True)
  delta = as_leaf(delta)
  check_delta(delta)
  _check_accuracy(eps_error, delta_error)
  return _plan.make_plan(composition, delta, eps_error, delta_error, size_cache)


@float64
def compose(composition, *, delta=1e-10, eps_error=0.01, delta_error=1e-3, plan=None,
            size_cache=None) -> PrivacyLossDistribution:
  """Composed privacy-loss distribution of one setting, reusable for many queries and
  ``append``.

  ``delta`` is the smallest delta the PLD will be asked about (it sizes the grid).
  """
  composition = checked(composition, integer_counts=True)
  check_delta(delta)
  _check_accuracy(eps_error, delta_error)
  if _batch.batch_shape(composition) != ():
    raise ValueError("compose takes one setting (scalar parameters and counts); for a batch of "
                     "settings use epsilon or delta")
  if plan is None:
    if is_traced(composition):
      raise ValueError("under jit/vmap/grad pass plan=jaxacct.make_plan(...)")
    plan = _plan.make_plan(composition, delta, eps_error, delta_error, size_cache)
  return _compose(jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), composition),
                  plan)


@float64
def epsilon(composition, delta, *, eps_error=0.01, delta_error=1e-3, plan=None,
            batch_size=None, size_cache=None) -> Bounds:
  """Certified epsilon(delta) of a composition by the PLD accountant (worse adjacency direction).

  Args:
    composition: a ``Composition``, a model, or a list of (model, count) entries; counts are
      whole numbers. Leaves may be arrays: the result is batched over their broadcast shape.
    delta: target delta in (0, 1), broadcast with the composition.
    eps_error: target half-width of the certified bracket (upper - lower ~ 2 eps_error).
    delta_error: the lower bound's delta slack, as a fraction of delta.
    plan: a ``Plan`` (required under jit/vmap/grad); planned for the worst case if omitted.
    batch_size: settings per vectorised chunk of a batch (memory bound); automatic if omitted.
    size_cache: a ``SizeCache`` shared by calls that should reuse compiled programs.
  Returns:
    ``Bounds`` (lower, estimate, upper, status), float64, batched like the inputs.
  """
  composition = checked(composition, integer_counts=True)
  delta = as_leaf(delta)
  check_delta(delta)
  _check_accuracy(eps_error, delta_error)
  planner = _planner(eps_error, delta_error, size_cache)
  return _answer("epsilon", composition, delta, plan, planner, size_cache, batch_size)


@float64
def delta(composition, epsilon, *, smallest_delta=1e-10, eps_error=0.01, delta_error=1e-3,
          plan=None, batch_size=None, size_cache=None) -> Bounds:
  """Certified delta(epsilon) of a composition by the PLD accountant (worse direction).

  ``smallest_delta`` sizes the grid: answers below it are valid but their relative accuracy
  degrades. Other arguments as in ``epsilon``.
  """
  composition = checked(composition, integer_counts=True)
  epsilon = as_leaf(epsilon)
  check_epsilon(epsilon)
  check_delta(smallest_delta, "smallest_delta")
  _check_accuracy(eps_error, delta_error)
  planner = _planner(eps_error, delta_error, size_cache, smallest_delta)
  return _answer("delta", composition, epsilon, plan, planner, size_cache, batch_size)
