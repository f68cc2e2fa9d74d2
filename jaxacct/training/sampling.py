"""Batch samplers under ``jit``, each paired with the composition it must be accounted with.

One ``DPConfig`` yields both the sampler that draws a step's batch and the ``Composition`` of
the steps taken, so what is accounted is what was run:

* ``"poisson"``: each example joins a step independently with probability q = batch_size / N
  (the analysis of ``dpsgd_epsilon``). The batch is a fixed-shape buffer of ``capacity`` indices
  with a validity mask. By default the buffer holds N + 1 indices, so no batch ever overflows,
  on this dataset or a neighbour one example larger, and the run is exactly Poisson-subsampled
  DP-SGD. A smaller ``capacity`` must keep the chance
  that a step's batch overflows it (on N + 1 examples, the larger of two neighbouring datasets)
  below ``overflow_probability``; an overflowing step is *refused* (nothing is released, the
  parameters are unchanged), never truncated. The refusal makes the run differ from Poisson
  DP-SGD only on that event, so its delta grows by (1 + e^eps) T beta (beta the overflow
  probability of a step): ``privacy_report`` reports the epsilon whose delta, with that
  allowance, is the configured one. (Such a buffer is for the worst-case accountant only.)
* ``"fixed"``: batch_size examples drawn uniformly without replacement. Adding or removing one
  example swaps it for another in the batch with probability at most B/N, which moves the noisy
  sum by at most 2C, so the steps are accounted as Poisson-subsampled Gaussians of sensitivity
  2 (noise sigma / 2) at rate B/N, the worse of both directions: Ganesh 2024, Thm. 3.3 with one
  example, under add/remove between datasets of N and N +- 1 examples -- never as Poisson at
  sigma. (The guarantee is stated for add/remove; replace-one is not claimed here.)
* ``"full"``: every example in every step (DP-GD): T Gaussian mechanisms.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxacct._inputs import check_choice, check_delta, check_range
from jaxacct.composition import Composition
from jaxacct.dp_event import to_dp_event
from jaxacct.models import Gaussian, PoissonSampled

SAMPLERS = ("poisson", "fixed", "full")
ACCOUNTANTS = ("worst_case", "gdp_filter", "rdp_filter", "bucket_counter")
DEFAULT_OVERFLOW_PROBABILITY = 1e-12


class Batch(NamedTuple):
  """A step's batch: ``indices`` [capacity] into the dataset, ``valid`` [capacity] marks the
  sampled entries (the rest is padding), ``size`` how many were sampled, ``overflow`` whether
  more were sampled than the buffer holds (the step is then refused)."""

  indices: jax.Array
  valid: jax.Array
  size: jax.Array
  overflow: jax.Array


def _whole(name, value, low=1):
  if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= low):
    raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")


def _bernoulli_threshold(rate):
  """floor(q 2^32) as uint32: a uniform 32-bit word below it has probability <= q (exactly
  floor(q 2^32) / 2^32; a float comparison could round q up)."""
  return np.uint32(min(math.floor(rate * 2.0 ** 32), 2 ** 32 - 1))


def binomial_overflow(capacity, num_examples, rate):
  """P(Binomial(N + 1, q) > capacity): the chance that a Poisson batch of the larger of two
  neighbouring datasets does not fit the buffer."""
  from scipy import stats
  if capacity >= num_examples + 1:
    return 0.0
  return float(stats.binom.sf(capacity, num_examples + 1, rate))


def smallest_capacity(num_examples, rate, overflow_probability):
  """The smallest buffer whose overflow probability is <= ``overflow_probability``."""
  from scipy import stats
  capacity = int(stats.binom.isf(overflow_probability, num_examples + 1, rate))
  while capacity > 0 and binomial_overflow(capacity - 1, num_examples, rate) \
      <= overflow_probability:
    capacity -= 1
  while binomial_overflow(capacity, num_examples, rate) > overflow_probability:
    capacity += 1
  return min(capacity, num_examples + 1)


@dataclasses.dataclass(frozen=True)
class DPConfig:
  """Everything that decides a DP training run's privacy, in one place (hashable, static).

  Args:
    num_examples: N, the dataset size (the data's leading axis).
    noise_multiplier: sigma; the noise added to the summed clipped gradient has std sigma C.
    clip_norm: C > 0, the per-example gradient clip norm.
    batch_size: the expected batch size of "poisson" (q = batch_size / N), the batch size of
      "fixed"; ignored (N) for "full".
    steps: T, the steps the run is planned for. The worst-case accountant refuses steps beyond
      it; the filters derive their per-example budgets from it (every example gets at least
      the worst-case guarantee of T steps, examples with small gradients run longer).
    delta: the delta of every epsilon reported.
    sampler: "poisson", "fixed" or "full" (module docstring).
    accountant: "worst_case" (the ledger of steps only), "gdp_filter" (DP-GD: Koskela et al.'s
      individual GDP filter), "rdp_filter" (individual Renyi filter, DP-GD or Poisson), or
      "bucket_counter" (per-example noise-ratio counts for a per-example PLD report). With
      Poisson sampling the individual accountants need every example's gradient norm at every
      step (Koskela et al., Sec. 5): the step computes them for all N, at the cost of a pass
      over the dataset.
    target_epsilon: optional; checked against the planned run (a noise multiplier that does not
      reach it is refused before training); the GDP filter's budget then comes from it.
    microbatch_size: examples per vmapped per-example-gradient chunk (memory bound).
    capacity: the Poisson batch buffer (default N + 1: never overflows).
    overflow_probability: the bound a smaller ``capacity`` must meet per step; T beta must
      also stay below delta / 1000 (else the allowance would dominate the guarantee).
    may_return: the filters' Algorithm-1 behaviour (refused examples may join later steps).
  """

  num_examples: int
  noise_multiplier: float
  clip_norm: float
  batch_size: int | None = None
  steps: int = 1000
  delta: float = 1e-5
  sampler: str = "poisson"
  accountant: str = "worst_case"
  target_epsilon: float | None = None
  microbatch_size: int = 64
  capacity: int | None = None
  overflow_probability: float = DEFAULT_OVERFLOW_PROBABILITY
  may_return: bool = True

  def __post_init__(self):
    check_choice("sampler", self.sampler, SAMPLERS)
    check_choice("accountant", self.accountant, ACCOUNTANTS)
    _whole("num_examples", self.num_examples)
    _whole("steps", self.steps)
    _whole("microbatch_size", self.microbatch_size)
    check_range("noise_multiplier", self.noise_multiplier, 0.0, math.inf)
    check_range("clip_norm", self.clip_norm, 0.0, math.inf)
    check_delta(self.delta)
    check_range("overflow_probability", self.overflow_probability, 0.0, 1.0)
    if self.target_epsilon is not None:
      check_range("target_epsilon", self.target_epsilon, 0.0, math.inf)
    if self.sampler == "full":
      if self.batch_size not in (None, self.num_examples):
        raise ValueError(f"the 'full' sampler takes every example (batch_size {self.batch_size}"
                         f" != num_examples {self.num_examples}); leave batch_size unset")
    else:
      if self.batch_size is None:
        raise ValueError(f"the {self.sampler!r} sampler needs a batch_size")
      _whole("batch_size", self.batch_size)
      if self.batch_size > self.num_examples:
        raise ValueError(f"batch_size ({self.batch_size}) exceeds num_examples "
                         f"({self.num_examples})")
    if self.capacity is not None:
      if self.sampler != "poisson":
        raise ValueError("capacity applies to the 'poisson' sampler only")
      _whole("capacity", self.capacity)
      beta = binomial_overflow(self.capacity, self.num_examples, self.sampling_rate)
      if beta > self.overflow_probability:
        need = smallest_capacity(self.num_examples, self.sampling_rate,
                                 self.overflow_probability)
        raise ValueError(f"a Poisson buffer of {self.capacity} overflows with probability "
                         f"{beta:.3g} per step, above overflow_probability="
                         f"{self.overflow_probability:g}; it needs capacity >= {need}")
      if self.steps * beta > 1e-3 * self.delta:
        raise ValueError(f"a Poisson buffer of {self.capacity} overflows with probability "
                         f"{beta:.3g} per step: over {self.steps} steps that is not small "
                         f"against delta = {self.delta:g} (T beta must be <= delta / 1000); "
                         f"raise capacity")
      if self.accountant != "worst_case" and beta > 0:
        raise ValueError("a Poisson buffer below N + 1 is for the worst-case accountant only "
                         "(the individual accountants assume no step is refused)")
    if self.accountant == "gdp_filter" and self.sampler != "full":
      raise ValueError("the GDP filter is for DP-GD (sampler='full'); with Poisson sampling use "
                       "accountant='rdp_filter' or 'bucket_counter'")
    if self.accountant != "worst_case" and self.sampler == "fixed":
      raise ValueError("individual accounting is not available for fixed-size batches (no "
                       "per-example analysis of sampling without replacement here); use "
                       "sampler='poisson' or accountant='worst_case'")

  @property
  def sampling_rate(self) -> float:
    """q: batch_size / N ("poisson", "fixed"), 1 ("full")."""
    return 1.0 if self.sampler == "full" else self.batch_size / self.num_examples

  @property
  def expected_batch_size(self) -> float:
    """The sum's normaliser: q N (its expectation for Poisson; exact for the others)."""
    return self.sampling_rate * self.num_examples

  @property
  def buffer_size(self) -> int:
    """The batch buffer's length (before padding to whole microbatches)."""
    if self.sampler == "poisson":
      return self.num_examples + 1 if self.capacity is None else self.capacity
    return self.batch_size if self.sampler == "fixed" else self.num_examples

  @property
  def overflow_per_step(self) -> float:
    """beta: a step's overflow probability (0 unless a Poisson buffer is below N + 1)."""
    if self.sampler != "poisson":
      return 0.0
    return binomial_overflow(self.buffer_size, self.num_examples, self.sampling_rate)

  def composition(self, steps=None) -> Composition:
    """The composition that accounts ``steps`` (default: the planned T) steps of this run."""
    steps = self.steps if steps is None else steps
    sigma, q = self.noise_multiplier, self.sampling_rate
    if self.sampler == "full":
      model = Gaussian(sigma)
    elif self.sampler == "fixed":
      model = PoissonSampled(Gaussian(sigma, 2.0), q)
    else:
      model = PoissonSampled(Gaussian(sigma), q)
    return Composition.of((model, steps))

  def dp_event(self, steps=None):
    """The dp-accounting ``DpEvent`` of ``steps`` (default: the planned T) steps of this run,
    as it is accounted (``to_dp_event(self.composition(steps))``): Poisson-sampled Gaussians,
    the "fixed" sampler's steps as Poisson-sampled Gaussians of noise sigma / 2, "full" as
    Gaussians; add/remove adjacency. A Poisson buffer below N + 1 is refused: its overflow
    allowance (a delta term) has no ``DpEvent``."""
    if self.overflow_per_step > 0.0:
      raise ValueError(f"a Poisson buffer of {self.capacity} (below N + 1) adds an overflow "
                       "allowance to delta that no DpEvent expresses; use capacity=None to "
                       "export the run")
    return to_dp_event(self.composition(steps))

  def fingerprint(self) -> dict:
    """The configuration as plain JSON values (what a checkpoint must match)."""
    return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

  def sampler_fn(self):
    """``sample(key) -> Batch``, pure and jit-able, of this configuration's sampler."""
    n, size = self.num_examples, self.buffer_size
    if self.sampler == "full":
      def sample(key):
        del key
        return Batch(jnp.arange(n, dtype=jnp.int32), jnp.ones(n, bool),
                     jnp.asarray(n, jnp.int32), jnp.asarray(False))
    elif self.sampler == "fixed":
      batch = self.batch_size

      def sample(key):
        indices = jax.random.choice(key, n, (batch,), replace=False).astype(jnp.int32)
        return Batch(indices, jnp.ones(batch, bool), jnp.asarray(batch, jnp.int32),
                     jnp.asarray(False))
    else:
      threshold = _bernoulli_threshold(self.sampling_rate)

      def sample(key):
        chosen = jax.random.bits(key, (n,), jnp.uint32) < threshold
        count = jnp.sum(chosen, dtype=jnp.int32)
        indices = jnp.nonzero(chosen, size=size, fill_value=0)[0].astype(jnp.int32)
        valid = jnp.arange(size) < count
        return Batch(indices, valid, count, count > size)
    return sample


__all__ = ["ACCOUNTANTS", "Batch", "DPConfig", "SAMPLERS", "binomial_overflow",
           "smallest_capacity"]
