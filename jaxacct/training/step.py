"""A DP training step with its accounting inside the compiled step.

``private_trainer(config, loss, optimizer)`` returns pure ``init`` / ``step`` functions, Optax
style. ``step(state, data)`` draws the batch with the configuration's sampler, computes the
clipped per-example gradients in microbatches, lets the per-example accountant (filter or bucket
counter) see every example's norm and drop the examples it refuses, adds the noise, applies the
optimiser and records the step in the ledger -- one ``jit``, no host callback. The ledger (steps
accounted, steps refused, the per-example state) lives in the train state, so it is checkpointed
with the model, and ``privacy_report(state)`` turns it into epsilons at any point.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxacct import api, gdp
from jaxacct.individual import (COUNTER_CERTIFIES, DEFAULT_RTOL, FILTER_CERTIFIES, bucket_counter,
                                gdp_filter, rdp_budget, rdp_filter)
from jaxacct.results import Bounds
from jaxacct.training import gradients as _grads
from jaxacct.training.sampling import DPConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Ledger:
  """The privacy ledger of a run: ``steps`` accounted, of which ``refused`` were Poisson steps
  refused for an overflowing batch; ``individual`` the per-example accountant's state (None for
  the worst-case accountant); ``config`` (static) what decides the guarantee."""

  steps: jax.Array
  refused: jax.Array
  individual: object
  config: DPConfig = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  """Parameters, optimiser state, privacy ledger and the PRNG key (raw uint32 key data)."""

  params: object
  opt_state: object
  ledger: Ledger
  key: jax.Array


class StepMetrics(NamedTuple):
  """What a step reports: the mean loss of the examples summed, the sampled batch size, how
  many examples entered the sum, the fraction of them clipped, and whether the step ran.

  These are computed from the private data without noise: they are for your own monitoring,
  not covered by the DP guarantee (do not release them)."""

  loss: jax.Array
  batch_size: jax.Array
  active: jax.Array
  clipped_fraction: jax.Array
  ran: jax.Array


class PrivateTrainer(NamedTuple):
  """``init(params, key, data) -> TrainState``; ``step(state, data) -> (state, StepMetrics)``
  (pure: ``jax.jit(trainer.step, donate_argnums=0)``)."""

  init: Callable
  step: Callable


# The Poisson path charges norms from one pass and sums gradients from another (other batch
# shapes): the same norm recomputed may differ by a few float32 ulps, so charges are taken at
# norms raised by this much (a margin far above that round-off).
_RECOMPUTE_MARGIN = 1e-5


def individual_accountant(config: DPConfig):
  """The per-example accountant of ``config`` (None for "worst_case"), its ledger in float32, or
  float64 when x64 is enabled.

  Budgets: the GDP filter's mu is that of ``target_epsilon`` at ``delta`` when given, else that
  of T clipped DP-GD steps, sqrt(T) / sigma; the RDP filter's is the RDP of T worst-case steps
  (``rdp_budget``). Every example is then held to at least the planned run's worst case."""
  return _accountant(config, jnp.zeros(()).dtype.name)


@functools.lru_cache(maxsize=32)
def _accountant(config: DPConfig, dtype: str):
  """``individual_accountant`` with its ledger's dtype (built once per configuration and dtype)."""
  sigma, clip, n, q = (config.noise_multiplier, config.clip_norm, config.num_examples,
                       config.sampling_rate)
  if config.accountant == "gdp_filter":
    if config.target_epsilon is None:
      mu = math.sqrt(config.steps) / sigma
    else:  # (lowered so that the filter's guarantee, B sqrt(1 + rtol), stays <= the target)
      mu = gdp.mu_of_eps_delta(config.target_epsilon, config.delta)
      mu = float(mu) / math.sqrt(1.0 + DEFAULT_RTOL) * (1.0 - 1e-12)
    return gdp_filter(float(mu), clip, sigma, n, config.may_return, dtype=dtype)
  if config.accountant == "rdp_filter":
    return rdp_filter(rdp_budget(sigma, q, config.steps), clip, sigma, n, config.may_return,
                      sampling_rate=q, dtype=dtype)
  if config.accountant == "bucket_counter":
    return bucket_counter(sigma, clip, q, n, dtype=dtype)
  return None


def planned_epsilon(config: DPConfig) -> float:
  """The epsilon at ``config.delta`` a run of ``config`` certifies: the worst-case upper of its
  T steps (its own sampler's composition, with a small buffer's allowance) and, for the filters,
  the epsilon each example is held to, whichever is larger."""
  planned = float(worst_case_epsilon(config, config.steps).upper)
  if config.accountant in ("gdp_filter", "rdp_filter"):
    planned = max(planned, individual_accountant(config).guarantee(config.delta))
  return planned


def check_budget(config: DPConfig):
  """Refuses a configuration whose ``planned_epsilon`` exceeds ``target_epsilon``."""
  if config.target_epsilon is None:
    return
  planned = planned_epsilon(config)
  if planned > config.target_epsilon:
    raise ValueError(
        f"noise_multiplier {config.noise_multiplier:g} does not reach target_epsilon "
        f"{config.target_epsilon:g}: {config.steps} steps of this sampler ({config.sampler}, "
        f"q = {config.sampling_rate:.6g}) with the {config.accountant} accountant give epsilon "
        f"<= {planned:.4g} at delta {config.delta:g} (jaxacct.training.calibrate(config, "
        f"{config.target_epsilon:g}) sets the noise multiplier this run needs)")


def check_lengths(config: DPConfig, data):
  """Refuses data whose arrays do not all have a leading axis of N (static shapes: also under
  ``jit``, where an index past the end would otherwise be clamped silently)."""
  leaves = jax.tree_util.tree_leaves(data)
  if not leaves:
    raise ValueError("data has no arrays")
  lengths = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
  if lengths != {config.num_examples}:
    raise ValueError(f"every data array needs a leading axis of num_examples "
                     f"({config.num_examples}); got leading sizes {sorted(map(str, lengths))}")


def check_data(config: DPConfig, loss, params, data):
  """Refuses data whose leading axis is not N, or on which ``loss`` does not give a scalar."""
  check_lengths(config, data)
  example = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), data)
  try:
    out = jax.eval_shape(loss, params, example)
  except Exception as error:  # the model's own shape error, said in the user's terms
    raise ValueError(f"the loss cannot be evaluated on one example of the data (shapes "
                     f"{jax.tree_util.tree_map(lambda s: s.shape, example)}): {error}") from error
  if getattr(out, "shape", None) != ():
    raise ValueError(f"loss(params, example) must return a scalar; got {out}")


def config_differences(saved: dict, expected: dict) -> str:
  """The fields in which two configurations' fingerprints differ, said for an error."""
  return "; ".join(f"{k}: {saved.get(k)!r} vs {v!r}" for k, v in expected.items()
                   if saved.get(k) != v)


def check_same_config(ledger_config: DPConfig, config: DPConfig):
  """Refuses a state whose ledger was kept under another configuration than this trainer's."""
  if ledger_config != config:
    raise ValueError("the state's privacy ledger was kept under another configuration than "
                     "this trainer's (ledger vs trainer: "
                     f"{config_differences(ledger_config.fingerprint(), config.fingerprint())})")


def _chargeable(norms):
  """Gradient norms for an accountant: one that is not finite (its gradient is left out of the
  sum) as +inf, which every accountant charges as clipped, with or without ``jit``."""
  return jnp.where(norms >= 0, norms, jnp.inf)


def _key_data(key):
  """A copy of the key as raw key data of the default PRNG implementation."""
  key = jnp.asarray(key)
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    default = jax.random.key_impl(jax.random.key(0))
    if jax.random.key_impl(key) != default:
      raise ValueError(f"the key's PRNG implementation ({jax.random.key_impl(key)}) is not the "
                       f"default ({default}); pass a key of the default implementation")
    key = jax.random.key_data(key)
  return jnp.array(key, copy=True)


def private_trainer(config: DPConfig, loss: Callable,
                    optimizer: optax.GradientTransformation) -> PrivateTrainer:
  """DP-SGD / DP-GD training with ``config``'s sampler, clipping, noise and accountant.

  ``loss(params, example) -> scalar`` for one example (``gradients.nnx_loss`` adapts a Flax NNX
  model). The noisy gradient sum is divided by the expected batch size before ``optimizer``.
  A step the accounting does not allow is not taken (parameters and optimiser unchanged,
  ``ran`` False): a Poisson batch that overflows its buffer (counted in the ledger), or, without
  a filter (worst-case ledger, bucket counter), a step beyond the planned T.
  """
  if not isinstance(config, DPConfig):
    raise TypeError(f"config must be a DPConfig; got {type(config).__name__}")
  check_budget(config)
  accountant = individual_accountant(config)
  sample = config.sampler_fn()
  m, n = config.microbatch_size, config.num_examples
  std = config.noise_multiplier * config.clip_norm
  needs_all_norms = accountant is not None and config.sampler == "poisson"
  filters = config.accountant in ("gdp_filter", "rdp_filter")

  def init(params, key, data):
    check_data(config, loss, params, data)
    individual = None if accountant is None else accountant.init()
    ledger = Ledger(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), individual, config)
    # (copies: a step that donates its state must not delete the caller's arrays)
    params = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), params)
    return TrainState(params, optimizer.init(params), ledger, _key_data(key))

  def account_all(individual, params, data, batch):
    """Poisson with a per-example accountant: every example's norm at this step (Koskela et
    al., Sec. 5), charged in one update; the batch keeps the members the filter admits, each
    clipped to the norm it was charged for (the sum's pass recomputes the norms)."""
    norms = _chargeable(_grads.all_norms(loss, params, data, n, m) * (1.0 + _RECOMPUTE_MARGIN))
    every, listed = jnp.arange(n, dtype=jnp.int32), jnp.ones(n, bool)
    bounds = jnp.minimum(jnp.where(jnp.isfinite(norms), norms, 0.0), config.clip_norm)
    bounds = bounds[batch.indices]
    if filters:
      individual, _ = accountant.update(individual, norms, every, listed)
      return individual, batch.valid & individual.active[batch.indices], bounds
    return accountant.update(individual, norms, every, listed), batch.valid, bounds

  def weigh_in_step(carry, indices, weights, norms):
    """DP-GD with a filter: each microbatch's examples admitted (and charged) as they come."""
    carry, admitted = accountant.update(carry, _chargeable(norms), indices, weights > 0,
                                        new_step=False)
    return carry, weights * admitted.astype(weights.dtype)

  def step(state, data):
    ledger = state.ledger
    check_same_config(ledger.config, config)
    check_lengths(config, data)
    data = jax.tree_util.tree_map(jnp.asarray, data)  # (host arrays, when run without jit)
    key, sample_key, noise_key = jax.random.split(state.key, 3)
    batch = sample(sample_key)
    allowed = ~batch.overflow
    if not filters:  # (no per-example budget: the planned T is the budget)
      allowed &= ledger.steps < config.steps
    individual, valid, weigh, clip = ledger.individual, batch.valid, None, config.clip_norm
    if needs_all_norms:
      individual, valid, bounds = account_all(individual, state.params, data, batch)
      clip = _grads.pad_to(bounds, m, 0.0)
    elif filters:  # DP-GD: start the step, then admit microbatch by microbatch
      empty = (jnp.zeros(1, jnp.float32), jnp.zeros(1, jnp.int32), jnp.zeros(1, bool))
      individual = accountant.update(individual, *empty, new_step=True)[0]
      weigh = weigh_in_step
    indices = _grads.pad_to(batch.indices, m, 0)
    weights = _grads.pad_to(valid.astype(jnp.float32), m, 0.0)
    chunks = jnp.where(allowed, (batch.size + m - 1) // m, 0)
    summed, individual, seen = _grads.private_sum(
        loss, state.params, data, indices, weights, clip, m, chunks, weigh, individual)
    if accountant is not None and not (filters or needs_all_norms):
      # DP-GD with the bucket counter: the norms the sum clipped, counted in one update.
      individual = accountant.update(individual, _chargeable(seen.norms), indices,
                                     seen.weights > 0)
    gradient = jax.tree_util.tree_map(lambda g: g / config.expected_batch_size,
                                      _grads.add_noise(summed, noise_key, std))
    updates, opt_state = optimizer.update(gradient, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree_util.tree_map(
        lambda a, b: jnp.where(allowed, a, b), new, old)
    counted = allowed | batch.overflow  # a refused Poisson step is accounted too
    ledger = Ledger(ledger.steps + counted.astype(jnp.int32),
                    ledger.refused + batch.overflow.astype(jnp.int32),
                    keep(individual, ledger.individual), config)
    state = TrainState(keep(params, state.params), keep(opt_state, state.opt_state), ledger, key)
    entered = seen.weights > 0
    count = jnp.maximum(jnp.sum(entered), 1)
    metrics = StepMetrics(jnp.sum(seen.losses) / count, batch.size, jnp.sum(entered),
                          jnp.sum(entered & (seen.norms > config.clip_norm)) / count, allowed)
    return state, metrics

  return PrivateTrainer(init, step)


# ----------------------------------------------------------------------------------------------
# The report


@dataclasses.dataclass(frozen=True)
class PrivacyReport:
  """Where a run's privacy stands.

  ``epsilon``: certified bounds on the worst-case epsilon at ``delta`` of the ``steps``
  accounted (the composition of ``config.composition(steps)``, plus the overflow allowance of a
  Poisson buffer below N + 1). ``guarantee``: the epsilon every example is held to by a filter
  (None without one). ``individual``: quantiles of the examples' epsilons so far (their
  odometers: GDP for the GDP filter, RDP for the RDP filter and the bucket counter);
  ``certifies`` says what they certify (a filter's guarantee holds under full adaptivity, a
  bucket counter's individual epsilon only for the realised norms taken as fixed in advance).
  ``active``: examples in the latest step (admitted by a filter; all listed ones otherwise).
  """

  epsilon: Bounds
  delta: float
  steps: int
  refused: int
  guarantee: float | None
  individual: dict | None
  active: int | None
  config: DPConfig
  certifies: str | None = None

  def __str__(self):
    lines = [f"{self.steps} steps ({self.config.sampler} sampling, q = "
             f"{self.config.sampling_rate:.6g}, sigma = {self.config.noise_multiplier:g}, "
             f"C = {self.config.clip_norm:g}): worst-case epsilon <= "
             f"{float(self.epsilon.upper):.4f} at delta = {self.delta:g}"]
    if self.refused:
      lines.append(f"{self.refused} steps refused (batch buffer overflow)")
    if self.guarantee is not None:
      lines.append(f"every example held to epsilon <= {self.guarantee:.4f} by its filter")
    if self.individual is not None:
      shown = ", ".join(f"{int(100 * q)}%: {v:.4f}" for q, v in self.individual.items())
      lines.append(f"individual epsilon quantiles: {shown}")
      lines.append(self.certifies)
    if self.active is not None:
      lines.append(f"{self.active} of {self.config.num_examples} examples active")
    return "\n".join(lines)


QUANTILES = (0.0, 0.1, 0.5, 0.9, 1.0)


def _on_host(bounds: Bounds) -> Bounds:
  """Bounds as numpy values (float64 outside an x64 scope too)."""
  return jax.tree_util.tree_map(np.asarray, bounds)


def worst_case_epsilon(config: DPConfig, steps: int, delta=None) -> Bounds:
  """Certified epsilon at ``delta`` (default the config's) of ``steps`` steps of ``config``.

  A Poisson buffer below N + 1 overflows with probability beta per step; the run then differs
  from Poisson DP-SGD on an event of probability <= T beta under either dataset, so its delta is
  at most delta_Poisson(eps) + (1 + e^eps) T beta. The upper bound solves that by a short
  monotone iteration, each candidate checked with a margin of 1/2 in eps."""
  delta = config.delta if delta is None else float(delta)
  if steps == 0:
    zero = np.zeros(())
    return Bounds(zero, zero, zero, np.zeros((), np.int32))
  composition = config.composition(steps)
  slack = steps * config.overflow_per_step
  if slack == 0.0:
    return _on_host(api.epsilon(composition, delta))
  eps = 0.0
  for _ in range(8):
    allowance = (1.0 + math.exp(min(eps + 0.5, 700.0))) * slack
    if allowance >= delta:
      break
    upper = api.epsilon(composition, delta - allowance)
    if float(upper.upper) <= eps + 0.5:  # its allowance at eps + 1/2 covers its own
      lower = api.epsilon(composition, min(delta + allowance, 0.5))
      return _on_host(Bounds(lower.lower, upper.estimate, upper.upper,
                             upper.status | lower.status))
    eps = float(upper.upper)
  raise ValueError(f"the Poisson buffer's overflow allowance ({slack:.3g} per run) is not small "
                   f"against delta = {delta:g}: raise capacity")


def privacy_report(state: TrainState, delta=None, quantiles=QUANTILES) -> PrivacyReport:
  """The worst-case certified epsilon, the individual epsilon quantiles and the active-set size
  of a run (host side; cheap enough to call every few hundred steps)."""
  ledger = state.ledger
  config = ledger.config
  delta = config.delta if delta is None else float(delta)
  steps = int(ledger.steps)
  accountant = individual_accountant(config)
  guarantee = individual = active = certifies = None
  if accountant is not None:
    filtered = config.accountant in ("gdp_filter", "rdp_filter")
    certifies = FILTER_CERTIFIES if filtered else COUNTER_CERTIFIES
    kept = jax.tree_util.tree_map(jnp.asarray, ledger.individual)  # (also a host copy)
    eps = np.asarray(accountant.odometer(kept, delta), np.float64)
    individual = dict(zip(quantiles, np.quantile(eps, quantiles, method="higher").tolist()))
    if filtered:
      guarantee = accountant.guarantee(delta)
      active = int(jnp.sum(ledger.individual.active))
    else:
      active = config.num_examples
  return PrivacyReport(worst_case_epsilon(config, steps, delta), delta, steps,
                       int(ledger.refused), guarantee, individual, active, config, certifies)


__all__ = ["Ledger", "PrivacyReport", "PrivateTrainer", "StepMetrics", "TrainState",
           "check_budget", "check_data", "check_lengths", "individual_accountant",
           "planned_epsilon", "private_trainer", "privacy_report", "worst_case_epsilon"]
