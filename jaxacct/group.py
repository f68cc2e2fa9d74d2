"""Group-level DP of DP-SGD: the mixture-of-Gaussians dominating pairs of Ganesh (2024).

Adjacent datasets differ by adding or removing up to ``group_size`` = k examples (a user's
examples, a family, a document's chunks). One DP-SGD step against such a group is dominated by a
mixture of Gaussians N(0, sigma^2) against sum_j p_j N(c_j, sigma^2) with a random sensitivity c
in units of the clip norm (Ganesh 2024, arXiv 2401.10294):

* Poisson sampling at rate q: c = j ~ Binomial(k, q), j = 0..k (Thm 3.1);
* a fixed batch of B out of a dataset of at least n examples: c = 2m with
  m ~ Hypergeometric(B draws, n + k balls, k marked), p_m = C(B, m) C(n + k - B, k - m) /
  C(n + k, k) (Thm 3.3: each sampled group member swaps out an example, moving the sum by <= 2).

Both pairs are tight for every-iterate release (the paper's Sec. 3.3), and both adjacency
directions are accounted; the worse is reported. The mixtures are ``MixtureOfGaussians`` models,
read by the "pld" (certified, the default), "spa", "edgeworth" and "rdp" accountants (not "gdp").

Static shapes: the mixture has ``max_group_size + 1`` atoms, those above k padded with
probability 0, so a sweep over k (and over sigma, q, steps, delta) is one batch and one compiled
program (under jit, with ``max_group_size`` and a plan). A concrete PLD sweep over several k,
planned here, is cut into runs of group sizes of similar plan work, each on its own atoms and
plan (padding every k to the largest one's atoms and grid made k = 1..50 take > 500 s while each
k alone took 10-21 s): a sweep costs about the sum of its members.

Weights are computed in log space from products of at most k exact terms (no
cancellation of log-gamma values); an atom whose weight underflows float64 (~5e-324) carries
no mass, which changes delta by less than T K e^epsilon 5e-324.

Baselines, for comparison (what the mixture accounting improves on):

* ``lemma_epsilon``: the group-privacy lemma (Vadhan 2017, Lemma 2.2) applied to the example-level
  RDP curve, as TF Privacy computed group guarantees: (eps, delta')-DP for examples gives
  (k eps, delta' (e^{k eps} - 1)/(e^eps - 1))-DP for groups. Searched in log delta' (never a
  spurious infinity: TF Privacy's search returned inf at k >= 9 for T = 2000, q = 0.01, sigma = 1).
* ``linear_epsilon``: k times the example-level epsilon (the paper's "lower bound" line).

Replace adjacency (a group's k examples swapped for k others) is not offered: see
``docs/group_privacy.md`` for why no dominating pair is claimed and what to use instead.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxacct import api
from jaxacct import pld as _pld
from jaxacct import rdp as _rdp
from jaxacct import results
from jaxacct._batch import flatten, reshaped
from jaxacct._inputs import check_broadcast, check_delta, check_range, check_whole
from jaxacct._numerics import (array_namespace, as_leaf, fast_jit, float64, is_traced,
                               scoped_gradients)
from jaxacct._solver import bisect
from jaxacct.composition import Composition
from jaxacct.mixture import MixtureOfGaussians
from jaxacct.models import Gaussian, PoissonSampled
from jaxacct.results import Bounds

# ----------------------------------------------------------------------------------------------
# Sensitivity distributions (log weights over the padded atoms 0..K-1)


def _log_falling(x, r, size, xp):
  """log x (x - 1) ... (x - r + 1) for whole r in [0, size), r <= x: a running sum of exact logs
  (no log-gamma cancellation), read at r. ``x`` is per setting, ``r`` per setting and atom."""
  i = xp.arange(size - 1, dtype=xp.float64)
  left = x[..., None] - i
  terms = xp.where(left > 0.0, xp.log(xp.where(left > 0.0, left, 1.0)), 0.0)
  zero = xp.zeros(terms.shape[:-1] + (1,))
  table = xp.concatenate([zero, xp.cumsum(terms, axis=-1)], axis=-1)  # [..., size]
  table = xp.broadcast_to(table, r.shape[:-1] + (size,))
  return xp.take_along_axis(table, xp.clip(r, 0, size - 1).astype(xp.int32), axis=-1)


def _log_factorial(r, size, xp):
  """log r! for whole r in [0, size)."""
  table = xp.concatenate([xp.zeros(1), xp.cumsum(xp.log(xp.arange(1, size, dtype=xp.float64)))])
  return table[xp.clip(r, 0, size - 1).astype(xp.int32)]


def _log_choose(x, r, size, xp):
  """log C(x, r) for x per setting and whole 0 <= r < size, r <= x, per setting and atom."""
  return _log_falling(x, r, size, xp) - _log_factorial(r, size, xp)


def binomial_log_weights(sampling_rate, group_size, atoms):
  """log P(j) for j = 0..atoms-1, j ~ Binomial(group_size, sampling_rate); -inf above k (numpy
  for host values, JAX for traced ones; float64)."""
  xp = array_namespace(sampling_rate, group_size)
  q, k = xp.broadcast_arrays(*(xp.asarray(v, xp.float64) for v in (sampling_rate, group_size)))
  j = xp.broadcast_to(xp.arange(atoms, dtype=xp.float64), k.shape + (atoms,))
  inside = j <= k[..., None]
  rest = xp.where(inside, k[..., None] - j, 0.0)  # k - j >= 0
  below_one = (q < 1.0)[..., None]
  log_q = xp.log(q)[..., None]
  log_1mq = xp.log1p(-xp.where(below_one, q[..., None], 0.5))
  # 0 log 0 = 0: j = 0 never reads log q, and k - j = 0 never reads log(1 - q) (-inf at q = 1).
  failures = xp.where(rest > 0, xp.where(below_one, rest * log_1mq, -xp.inf), 0.0)
  terms = xp.where(j > 0, j * log_q, 0.0) + failures
  choose = _log_choose(k, xp.where(inside, j, 0.0), atoms, xp)
  return _invalid_to_nan(xp.where(inside, choose + terms, -xp.inf), k, atoms, xp)


def hypergeometric_log_weights(batch_size, dataset_size, group_size, atoms):
  """log P(m) for m = 0..atoms-1: m marked among B draws without replacement from n + k balls of
  which k are marked, P(m) = C(B, m) C(n + k - B, k - m) / C(n + k, k); -inf outside its support
  (the paper's Hypergeom(B, n + k, k); scipy's ``hypergeom.pmf(m, n + k, k, B)``)."""
  xp = array_namespace(batch_size, dataset_size, group_size)
  b, n, k = xp.broadcast_arrays(*(xp.asarray(v, xp.float64)
                                  for v in (batch_size, dataset_size, group_size)))
  m = xp.broadcast_to(xp.arange(atoms, dtype=xp.float64), k.shape + (atoms,))
  b_, n_, k_ = (v[..., None] for v in (b, n, k))
  inside = (m <= k_) & (m <= b_) & (k_ - m <= n_ + k_ - b_)
  m_in = xp.where(inside, m, 0.0)
  rest = xp.where(inside, k_ - m, 0.0)
  log_p = (_log_choose(b, m_in, atoms, xp) + _log_choose(n + k - b, rest, atoms, xp)
           - _log_choose(n + k, k_, atoms, xp))
  return _invalid_to_nan(xp.where(inside, log_p, -xp.inf), k, atoms, xp)


def valid_group_size(group_size, atoms, xp=jnp):
  """Whether k is a whole number in [1, atoms - 1] (the check a traced k cannot get at the
  door)."""
  k = xp.asarray(group_size, xp.float64)
  return (k >= 1.0) & (k == xp.round(k)) & (k <= atoms - 1)


def _invalid_to_nan(log_p, k, atoms, xp):
  """nan weights where k is not a whole number in [1, atoms - 1]: its mass above the padded
  atoms would otherwise be dropped silently (optimistic), so no number is given instead."""
  return xp.where(valid_group_size(k, atoms, xp)[..., None], log_p, xp.nan)


# ----------------------------------------------------------------------------------------------
# The mixtures and the compositions


def group_sampling(sampling_rate, batch_size, dataset_size):
  """"poisson" (a rate given) or "fixed" (a batch size and a dataset size given)."""
  fixed = batch_size is not None or dataset_size is not None
  if (sampling_rate is not None) == fixed:
    raise ValueError("give sampling_rate (Poisson sampling) or batch_size and dataset_size (a "
                     "fixed batch size), not both and not neither")
  if fixed and (batch_size is None or dataset_size is None):
    raise ValueError("a fixed batch size needs both batch_size (B) and dataset_size (n, a lower "
                     "bound on the size of the smaller dataset)")
  return "fixed" if fixed else "poisson"


# The largest group accepted: the mixture's atoms and its loss range grow with k (at sigma = 1
# and q = 0.01, epsilon is already ~100 at k = 20).
MAX_GROUP_SIZE = 1000


def _max_group_size(group_size, max_group_size):
  """The static number of atoms minus one: ``max_group_size``, or the largest concrete k."""
  if max_group_size is None:
    if is_traced(group_size):
      raise ValueError("under jit/vmap/grad the group size is traced: give max_group_size (a "
                       "Python int, the largest group size of the sweep)")
    k_max = int(np.max(np.asarray(group_size)))
    if k_max > MAX_GROUP_SIZE:
      raise ValueError(f"group_size must be <= {MAX_GROUP_SIZE}; got {group_size!r}")
    return k_max
  check_range("max_group_size", max_group_size, 1.0, MAX_GROUP_SIZE, low_open=False,
              high_open=False)
  check_whole("max_group_size", max_group_size)
  k_max = int(max_group_size)
  if not is_traced(group_size) and np.any(np.asarray(group_size) > k_max):
    raise ValueError(f"group_size must be <= max_group_size = {k_max}; got {group_size!r}")
  return k_max


def check_group_size(group_size):
  """k: whole numbers >= 1 (concrete values; a traced k is checked by ``valid_group_size``)."""
  check_range("group_size", group_size, 1.0, np.inf, low_open=False)
  check_whole("group_size", group_size)


def _check_common(noise_multiplier, group_size):
  check_range("noise_multiplier", noise_multiplier, 0.0, np.inf)
  check_group_size(group_size)


def poisson_mixture(noise_multiplier, sampling_rate, group_size, *,
                    max_group_size=None) -> MixtureOfGaussians:
  """One DP-SGD step with Poisson sampling against a group of ``group_size`` examples (Thm 3.1):
  sensitivities j = 0..K-1 with Binomial(k, q) weights, K = ``max_group_size`` + 1 (default: the
  largest k given). Arrays broadcast into a batch of settings."""
  noise_multiplier, sampling_rate, group_size = map(
      as_leaf, (noise_multiplier, sampling_rate, group_size))
  _check_common(noise_multiplier, group_size)
  check_range("sampling_rate", sampling_rate, 0.0, 1.0, high_open=False)
  check_broadcast(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate,
                  group_size=group_size)
  atoms = _max_group_size(group_size, max_group_size) + 1
  log_p = binomial_log_weights(sampling_rate, group_size, atoms)
  return _mixture(noise_multiplier, np.arange(atoms, dtype=np.float64), log_p)


def check_fixed_batch(batch_size, dataset_size):
  """B and n: whole numbers >= 1 with B <= n (concrete values)."""
  for name, value in (("batch_size", batch_size), ("dataset_size", dataset_size)):
    check_range(name, value, 1.0, np.inf, low_open=False)
    check_whole(name, value)
  if not is_traced((batch_size, dataset_size)) and np.any(
      np.asarray(batch_size) > np.asarray(dataset_size)):
    raise ValueError(f"batch_size must be <= dataset_size; got batch_size {batch_size!r} and "
                     f"dataset_size {dataset_size!r}")


def fixed_batch_mixture(noise_multiplier, batch_size, dataset_size, group_size, *,
                        max_group_size=None) -> MixtureOfGaussians:
  """One DP-SGD step with a fixed batch of ``batch_size`` examples drawn from a dataset of at
  least ``dataset_size`` (n: a lower bound on the smaller dataset's size), against a group of
  ``group_size`` (Thm 3.3): sensitivities 2m with Hypergeometric weights."""
  noise_multiplier, batch_size, dataset_size, group_size = map(
      as_leaf, (noise_multiplier, batch_size, dataset_size, group_size))
  _check_common(noise_multiplier, group_size)
  check_fixed_batch(batch_size, dataset_size)
  check_broadcast(noise_multiplier=noise_multiplier, batch_size=batch_size,
                  dataset_size=dataset_size, group_size=group_size)
  atoms = _max_group_size(group_size, max_group_size) + 1
  log_p = hypergeometric_log_weights(batch_size, dataset_size, group_size, atoms)
  return _mixture(noise_multiplier, 2.0 * np.arange(atoms, dtype=np.float64), log_p)


def _mixture(sigma, sensitivities, log_p):
  """The model, its leaves broadcast to one batch shape (an atom axis last)."""
  xp = array_namespace(sigma, log_p)
  sigma = xp.asarray(sigma, xp.float64)
  shape = tuple(np.broadcast_shapes(np.shape(sigma), log_p.shape[:-1]))
  log_p = xp.broadcast_to(log_p, shape + log_p.shape[-1:])
  return MixtureOfGaussians(xp.broadcast_to(sigma, shape),
                            xp.broadcast_to(xp.asarray(sensitivities), log_p.shape),
                            xp.exp(log_p))


def group_mixture(noise_multiplier, group_size, *, sampling_rate=None, batch_size=None,
                  dataset_size=None, max_group_size=None) -> MixtureOfGaussians:
  """``poisson_mixture`` (``sampling_rate`` given) or ``fixed_batch_mixture`` (``batch_size``
  and ``dataset_size`` given)."""
  if group_sampling(sampling_rate, batch_size, dataset_size) == "poisson":
    return poisson_mixture(noise_multiplier, sampling_rate, group_size,
                           max_group_size=max_group_size)
  return fixed_batch_mixture(noise_multiplier, batch_size, dataset_size, group_size,
                             max_group_size=max_group_size)


def group_composition(noise_multiplier, steps, group_size, *, sampling_rate=None,
                      batch_size=None, dataset_size=None, max_group_size=None) -> Composition:
  """``steps`` DP-SGD steps against a group of ``group_size``: the composition every accountant
  reads (``jaxacct.epsilon(group_composition(...), delta)``)."""
  steps = as_leaf(steps)
  check_range("steps", steps, 0.0, np.inf, low_open=False)
  model = group_mixture(noise_multiplier, group_size, sampling_rate=sampling_rate,
                        batch_size=batch_size, dataset_size=dataset_size,
                        max_group_size=max_group_size)
  return Composition.of((model, steps))


# ----------------------------------------------------------------------------------------------
# Front doors


def group_epsilon(noise_multiplier, steps, delta, group_size, *, sampling_rate=None,
                  batch_size=None, dataset_size=None, max_group_size=None, accountant="pld",
                  method=None, eps_error=None, delta_error=None, plan=None) -> Bounds:
  """Certified epsilon(delta) of DP-SGD against groups of ``group_size`` examples (add or remove
  up to k; the worse direction), e.g.
  ``group_epsilon(1.0, 2000, 1e-6, 4, sampling_rate=0.01).upper``.

  Args:
    noise_multiplier: noise standard deviation / clip norm.
    steps: number of steps (whole numbers for the PLD accountant).
    delta: target delta in (0, 1).
    group_size: k >= 1 (k = 1 is example-level DP).
    sampling_rate: Poisson sampling probability q; or, for a fixed batch, ``batch_size`` and
      ``dataset_size``.
    batch_size: B, the size of a fixed batch (with ``dataset_size``, instead of
      ``sampling_rate``).
    dataset_size: n, a lower bound on the size of the dataset a fixed batch is drawn from.
    max_group_size: the static number of atoms minus one (default: the largest k given); needed
      under jit/vmap/grad, where k is traced.
    accountant: as in ``jaxacct.epsilon``.
    method: as in ``jaxacct.epsilon``.
    eps_error: as in ``jaxacct.epsilon``.
    delta_error: as in ``jaxacct.epsilon``.
    plan: as in ``jaxacct.epsilon`` (a plan from ``group_plan`` under jit/vmap/grad).

  Array arguments broadcast into a batch: a sweep over k is one call and one compiled program.
  """
  comp = group_composition(noise_multiplier, steps, group_size, sampling_rate=sampling_rate,
                           batch_size=batch_size, dataset_size=dataset_size,
                           max_group_size=max_group_size)
  options = dict(accountant=accountant, method=method, eps_error=eps_error,
                 delta_error=delta_error)
  if _sweeps_group_sizes(group_size, max_group_size, accountant, plan, comp, delta):
    sampling = dict(sampling_rate=sampling_rate, batch_size=batch_size, dataset_size=dataset_size)
    return _by_plan_size(group_epsilon, noise_multiplier, steps, delta, group_size, sampling,
                         options, delta)
  out = api.epsilon(comp, delta, plan=plan, **options)
  return _no_guarantee_unless_valid(out, group_size, comp, jnp.inf)


def group_delta(noise_multiplier, steps, epsilon, group_size, *, sampling_rate=None,
                batch_size=None, dataset_size=None, max_group_size=None, accountant="pld",
                method=None, smallest_delta=None, eps_error=None, delta_error=None,
                plan=None) -> Bounds:
  """Certified delta(epsilon) of DP-SGD against groups; arguments as in ``group_epsilon``."""
  comp = group_composition(noise_multiplier, steps, group_size, sampling_rate=sampling_rate,
                           batch_size=batch_size, dataset_size=dataset_size,
                           max_group_size=max_group_size)
  options = dict(accountant=accountant, method=method, smallest_delta=smallest_delta,
                 eps_error=eps_error, delta_error=delta_error)
  if _sweeps_group_sizes(group_size, max_group_size, accountant, plan, comp, epsilon):
    sampling = dict(sampling_rate=sampling_rate, batch_size=batch_size, dataset_size=dataset_size)
    return _by_plan_size(group_delta, noise_multiplier, steps, epsilon, group_size, sampling,
                         options, 1e-10 if smallest_delta is None else smallest_delta)
  out = api.delta(comp, epsilon, plan=plan, **options)
  return _no_guarantee_unless_valid(out, group_size, comp, 1.0)


def _no_guarantee_unless_valid(bounds, group_size, composition, vacuous):
  """``bounds`` where the (possibly traced) group size is valid for the mixture's atoms; else
  no guarantee: upper ``vacuous`` (+inf for epsilon, 1 for delta), status OUT_OF_RANGE."""
  if not is_traced(group_size):
    return bounds  # (checked at the door)
  atoms = composition.mechanisms[0].probabilities.shape[-1]
  valid = jnp.broadcast_to(valid_group_size(group_size, atoms), jnp.shape(bounds.upper))
  return Bounds(jnp.where(valid, bounds.lower, jnp.nan), jnp.where(valid, bounds.estimate, jnp.nan),
                jnp.where(valid, bounds.upper, vacuous),
                jnp.where(valid, bounds.status, bounds.status | results.OUT_OF_RANGE))


def _sweeps_group_sizes(group_size, max_group_size, accountant, plan, composition, x):
  """A concrete PLD query over several group sizes, planned here: answered a bucket at a time."""
  return (accountant == "pld" and plan is None and max_group_size is None
          and not is_traced((composition, x)) and np.unique(np.asarray(group_size)).size > 1)


# A compilation's cost in plan work (``calibrate.plan_points``: ~5 s on 2 busy CPU cores).
_COMPILE_POINTS = 5e7


def _buckets(costs):
  """Runs of consecutive group sizes (ascending k, ``costs`` their plan work, growing with k: the
  atoms and the loss range) that minimise the sweep's work: each run computes all its members on
  its largest member's plan and compiles once (dynamic programming over the split points)."""
  costs = np.asarray(costs, np.float64)
  best = np.zeros(len(costs) + 1)  # best[j]: the work of the first j sizes
  cut = np.zeros(len(costs) + 1, int)
  for j in range(1, len(costs) + 1):
    starts = np.arange(j)
    tops = np.maximum.accumulate(costs[:j][::-1])[::-1]  # the largest of costs[i:j]
    work = best[:j] + _COMPILE_POINTS + (j - starts) * tops
    cut[j] = int(np.argmin(work))
    best[j] = work[cut[j]]
  runs, j = [], len(costs)
  while j > 0:
    runs.append(list(range(cut[j], j)))
    j = cut[j]
  return runs[::-1]


@float64
def _by_plan_size(front, noise_multiplier, steps, x, group_size, sampling, options, smallest):
  """``front`` (``group_epsilon``/``group_delta``) over a sweep of group sizes, one call per
  bucket of sizes of similar plan work, each with its own atoms (its largest k + 1) and plan. A
  sweep padded to its largest k would run every setting on the largest one's atoms and grid:
  k = 1..50 at sigma 2, q 0.01 gave nothing in 500 s, each k alone took 10-21 s. Bucketed, it
  costs about the sum of its members plus one compilation per bucket."""
  from jaxacct.calibrate import plan_points  # (calibrate imports this module)
  given = {name: value for name, value in sampling.items() if value is not None}
  names = ["noise_multiplier", "steps", "x", "group_size"] + list(given)
  arrays = np.broadcast_arrays(*(np.asarray(v, np.float64) for v in
                                 [noise_multiplier, steps, x, group_size] + list(given.values())))
  shape = arrays[0].shape
  flat = dict(zip(names, (a.reshape(-1) for a in arrays)))
  sizes = np.unique(flat["group_size"])
  costs = []
  for k in sizes:  # (host planning passes: milliseconds each)
    rows = flat["group_size"] == k
    comp = group_composition(flat["noise_multiplier"][rows], flat["steps"][rows], k,
                             **{name: flat[name][rows] for name in given})
    eps_error = options.get("eps_error") or 0.01
    delta_error = options.get("delta_error") or 1e-3
    smallest_here = flat["x"][rows] if front is group_epsilon else smallest
    costs.append(plan_points(api.make_plan(comp, smallest_here, eps_error=eps_error,
                                           delta_error=delta_error), int(k) + 1))
  fields = {name: np.zeros(flat["x"].size, np.int32 if name == "status" else np.float64)
            for name in ("lower", "estimate", "upper", "status")}
  for run in _buckets(costs):
    members = sizes[run]
    rows = np.flatnonzero(np.isin(flat["group_size"], members))
    part = front(flat["noise_multiplier"][rows], flat["steps"][rows], flat["x"][rows],
                 flat["group_size"][rows], max_group_size=int(members[-1]), **options,
                 **{name: flat[name][rows] for name in given})
    for name in fields:
      fields[name][rows] = np.asarray(getattr(part, name))
  return Bounds(**{name: jnp.asarray(value.reshape(shape)) for name, value in fields.items()})


def group_plan(noise_multiplier, steps, delta, group_size, *, sampling_rate=None,
               batch_size=None, dataset_size=None, max_group_size=None, eps_error=0.01,
               delta_error=1e-3) -> _pld.Plan:
  """A PLD plan for group queries under jit/vmap/grad: give the settings to serve (arrays), or
  the sweep's worst case (smallest noise, largest k, rate and step count, smallest delta)."""
  comp = group_composition(noise_multiplier, steps, group_size, sampling_rate=sampling_rate,
                           batch_size=batch_size, dataset_size=dataset_size,
                           max_group_size=max_group_size)
  return api.make_plan(comp, delta, eps_error=eps_error, delta_error=delta_error)


@dataclasses.dataclass(frozen=True)
class GroupSteps:
  """DP-SGD against groups of a fixed size, as a static (hashable) description: what the
  calibration functions read in place of a relation (``calibrate.group_noise_multiplier``). The
  rate slot of a fixed batch is B / n (only the starting guess reads it)."""

  group_size: int
  batch_size: int | None = None
  dataset_size: int | None = None

  def sampling(self, sampling_rate):
    """The sampling keywords of the group functions (a fixed batch ignores the rate slot)."""
    if self.batch_size is None:
      return {"sampling_rate": sampling_rate}
    return {"batch_size": self.batch_size, "dataset_size": self.dataset_size}

  def composition(self, noise_multiplier, sampling_rate, steps) -> Composition:
    """The composition at (possibly traced) sigma, q, steps."""
    return group_composition(noise_multiplier, steps, self.group_size,
                             **self.sampling(sampling_rate))

  @property
  def scale(self) -> float:
    """The largest sensitivity (the starting guess treats it as a Gaussian's)."""
    return float(self.group_size * (1 if self.batch_size is None else 2))

  def upper(self, target, noise_multiplier, sampling_rate, steps, other, accountant,
            eps_error=None):
    """The front door's certified upper of ``target`` ("epsilon" at delta = ``other``, or
    "delta" at epsilon = ``other``)."""
    fn = group_epsilon if target == "epsilon" else group_delta
    return fn(noise_multiplier, steps, other, self.group_size, accountant=accountant,
              eps_error=eps_error, **self.sampling(sampling_rate)).upper


# ----------------------------------------------------------------------------------------------
# Baselines: the group-privacy lemma on the example-level RDP curve, and k times epsilon_1


def example_composition(noise_multiplier, steps, *, sampling_rate=None, batch_size=None,
                        dataset_size=None) -> Composition:
  """The example-level (k = 1) composition: the subsampled Gaussian for Poisson sampling, the
  two-atom mixture {0, 2} with weight B / (n + 1) on 2 for a fixed batch."""
  if group_sampling(sampling_rate, batch_size, dataset_size) == "poisson":
    noise_multiplier, sampling_rate, steps = map(as_leaf,
                                                 (noise_multiplier, sampling_rate, steps))
    check_range("sampling_rate", sampling_rate, 0.0, 1.0, high_open=False)
    check_range("noise_multiplier", noise_multiplier, 0.0, np.inf)
    return Composition.of((PoissonSampled(Gaussian(noise_multiplier), sampling_rate), steps))
  return group_composition(noise_multiplier, steps, 1, batch_size=batch_size,
                           dataset_size=dataset_size, max_group_size=1)


# The lemma's search: example-level log delta' = log delta - s, s on a geometric grid (the
# first feasible point), then bisection between it and the grid point before.
_LEMMA_GRID = np.concatenate([[0.0], np.geomspace(1e-4, 1e7, 55)])
_LEMMA_BISECTIONS = 50


def _log_geometric_sum(eps, k):
  """log (e^{k eps} - 1)/(e^eps - 1) = log(1 + e^eps + ... + e^{(k-1) eps}), stable."""
  def log_expm1(x):
    return jnp.where(x > 30.0, x + jnp.log1p(-jnp.exp(-jnp.minimum(x, 700.0))),
                     jnp.log(jnp.expm1(jnp.minimum(x, 30.0))))
  tiny = eps < 1e-12
  safe = jnp.where(tiny, 1.0, eps)
  return jnp.where(tiny, jnp.log(k), log_expm1(k * safe) - log_expm1(safe))


def _lemma_single(composition, delta, group_size):
  """Group epsilon by Lemma 1.1 over the example-level RDP curve, one setting: the smallest
  k eps_1(delta') (on the search grid) with log delta' + log S(eps_1(delta')) <= log delta."""
  log_delta = jnp.log(delta)

  def gap(s):  # >= 0: feasible
    eps = _rdp.epsilon_at_log_delta(composition, log_delta - s)
    return s - _log_geometric_sum(eps, group_size), eps

  grid = jnp.asarray(_LEMMA_GRID)
  gaps, _ = jax.lax.map(gap, grid)
  feasible = gaps >= 0.0
  first = jnp.argmax(feasible)
  found = jnp.any(feasible)
  hi = grid[first]
  lo = jnp.where(first > 0, grid[jnp.maximum(first - 1, 0)], 0.0)

  feasible_sign = lambda s: jnp.where(gap(s)[0] >= 0.0, 1.0, -1.0)
  _, hi = bisect(feasible_sign, lo, hi, _LEMMA_BISECTIONS)
  eps = group_size * gap(hi)[1]
  return jnp.where(found, eps, jnp.inf)


_lemma_run = fast_jit(scoped_gradients(jax.vmap(_lemma_single)))


@float64
def lemma_epsilon(noise_multiplier, steps, delta, group_size, *, sampling_rate=None,
                  batch_size=None, dataset_size=None) -> jax.Array:
  """The baseline: the group-privacy lemma applied to the example-level RDP guarantee (as TF
  Privacy computed group-level epsilon). A valid upper bound on the group epsilon, usually far
  above ``group_epsilon``; +inf when no example-level delta' on the search grid (down to
  delta e^{-1e7}) works. Arrays broadcast into a batch. No gradient flows through the search."""
  delta, group_size = as_leaf(delta), as_leaf(group_size)
  check_delta(delta)
  check_group_size(group_size)
  comp = example_composition(noise_multiplier, steps, sampling_rate=sampling_rate,
                             batch_size=batch_size, dataset_size=dataset_size)
  comp.check(integer_counts=False)
  flat, shape = flatten((comp, delta, group_size))
  return reshaped(_lemma_run(*flat), shape)


@float64
def linear_epsilon(noise_multiplier, steps, delta, group_size, *, sampling_rate=None,
                   batch_size=None, dataset_size=None, accountant="pld") -> Bounds:
  """k times the example-level epsilon at delta: the paper's "lower bound" line, a reference
  rather than a theorem. Every field of the example-level ``Bounds`` is multiplied by k, so its
  lower/upper bracket k eps_1, not the group epsilon."""
  group_size = as_leaf(group_size)
  check_group_size(group_size)
  comp = example_composition(noise_multiplier, steps, sampling_rate=sampling_rate,
                             batch_size=batch_size, dataset_size=dataset_size)
  one = api.epsilon(comp, delta, accountant=accountant)
  k = jnp.asarray(group_size, jnp.float64)
  return Bounds(k * one.lower, k * one.estimate, k * one.upper,
                jnp.broadcast_to(one.status, jnp.broadcast_shapes(one.status.shape, k.shape)))


__all__ = ["GroupSteps", "check_fixed_batch", "check_group_size", "valid_group_size",
           "binomial_log_weights", "example_composition", "fixed_batch_mixture",
           "group_composition", "group_delta", "group_epsilon", "group_mixture", "group_plan",
           "hypergeometric_log_weights", "lemma_epsilon", "linear_epsilon", "poisson_mixture"]
