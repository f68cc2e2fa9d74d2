"""A DP training step with its accounting inside the compiled step.

``private_trainer(config, loss, optimizer, mesh=None)`` returns pure ``init`` / ``step``
functions, Optax style. A step composes small pure functions: ``draw`` the batch with the
configuration's sampler; on each block of examples (the whole dataset, or a device's block on a
mesh) ``clip_and_sum`` the per-example gradients in microbatches, letting the per-example
accountant (filter or bucket counter) see every example's norm and drop the examples it refuses;
add the blocks' sums once; add the noise, drawn once from the step's key; apply the optimiser;
``record`` the step in the ledger -- one ``jit``, no host callback. The ledger (steps accounted,
steps refused, the per-example state) lives in the train state, so it is checkpointed with the
model, and ``privacy_report(state)`` turns it into epsilons at any point.

Data that does not fit on the devices: ``trainer.sample(state)`` gives the batch the next step
draws, the caller gathers its rows from wherever the data lives, and
``trainer.step_on_batch(state, rows, batch)`` takes the same step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from jaxacct._numerics import host_values, is_traced
from jaxacct.training.accounting import FILTERS, check_budget, individual_accountant
from jaxacct.training.gradients import add_noise, all_norms, pad_to, private_sum
from jaxacct.training.mesh import Layout, block_members
from jaxacct.training.sampling import Batch, DPConfig


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
  (pure: ``jax.jit(trainer.step, donate_argnums=0)``); ``sample(state) -> Batch``, the batch
  the next step draws (numpy arrays, the same on every process); ``step_on_batch(state, rows,
  batch) -> (state, StepMetrics)``, that step on the rows ``data[batch.indices]`` gathered by
  the caller; ``place(data)``, the data (this process's block of it) as arrays split over the
  mesh's data axis."""

  init: Callable
  step: Callable
  sample: Callable
  step_on_batch: Callable
  place: Callable


# The Poisson path charges norms from one pass and sums gradients from another (other batch
# shapes): the same norm recomputed may differ by a few float32 ulps, so charges are taken at
# norms raised by this much (a margin far above that round-off).
_RECOMPUTE_MARGIN = 1e-5


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


def chargeable(norms):
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


class BlockPass(NamedTuple):
  """What the per-example pass over one block of examples needs (static): the loss, the
  block's per-example accountant (None for the worst-case ledger), the microbatch size, the
  clip norm, whether the accountant is a filter, and whether it charges every example's norm
  at every step (Poisson with a per-example accountant, Koskela et al., Sec. 5)."""

  loss: Callable
  accountant: object
  microbatch: int
  clip_norm: float
  filters: bool
  all_norms: bool


class Tally(NamedTuple):
  """A block's sums for the step's metrics: losses of the examples summed, how many entered
  the sum, how many of them were clipped."""

  loss: jax.Array
  entered: jax.Array
  clipped: jax.Array


def admit_all(p: BlockPass, individual, params, rows, positions, valid):
  """Every example of the block charged at its norm at this step, in one update; the batch
  keeps the members a filter admits, each clipped to the norm it was charged for (the sum's
  pass recomputes the norms). Returns (state, valid, per-entry clip bounds)."""
  count = jax.tree_util.tree_leaves(rows)[0].shape[0]
  norms = chargeable(all_norms(p.loss, params, rows, count, p.microbatch)
                     * (1.0 + _RECOMPUTE_MARGIN))
  every, listed = jnp.arange(count, dtype=jnp.int32), jnp.ones(count, bool)
  bounds = jnp.minimum(jnp.where(jnp.isfinite(norms), norms, 0.0), p.clip_norm)[positions]
  if p.filters:
    individual, _ = p.accountant.update(individual, norms, every, listed)
    return individual, valid & individual.active[positions], bounds
  return p.accountant.update(individual, norms, every, listed), valid, bounds


def start_filter_step(accountant, individual):
  """A filter's new step with no example yet (DP-GD admits microbatch by microbatch)."""
  empty = (jnp.zeros(1, jnp.float32), jnp.zeros(1, jnp.int32), jnp.zeros(1, bool))
  return accountant.update(individual, *empty, new_step=True)[0]


def weigh_in(accountant, carry, indices, weights, norms):
  """A microbatch's examples admitted (and charged) by the filter before they are summed."""
  carry, admitted = accountant.update(carry, chargeable(norms), indices, weights > 0,
                                      new_step=False)
  return carry, weights * admitted.astype(weights.dtype)


def clip_and_sum(p: BlockPass, params, rows, positions, valid, individual, allowed):
  """One block's part of a step: the clipped gradient sum of ``rows[positions]`` where
  ``valid`` (front-packed), in float32, with the block's per-example accountant charged (its
  ``positions`` are the block's example numbers where it keeps state). Returns (sum, state,
  ``Tally``); nothing is summed or charged per example unless ``allowed``."""
  m = p.microbatch
  chunks = jnp.where(allowed, (jnp.sum(valid) + m - 1) // m, 0)
  weigh, clip = None, p.clip_norm
  if p.all_norms:
    individual, valid, bounds = admit_all(p, individual, params, rows, positions, valid)
    clip = pad_to(bounds, m, 0.0)
  elif p.filters:
    individual = start_filter_step(p.accountant, individual)
    weigh = functools.partial(weigh_in, p.accountant)
  indices = pad_to(positions, m, 0)
  weights = pad_to(valid.astype(jnp.float32), m, 0.0)
  summed, individual, seen = private_sum(p.loss, params, rows, indices, weights, clip, m,
                                         chunks, weigh, individual)
  entered = seen.weights > 0
  if p.accountant is not None and not (p.filters or p.all_norms):
    # DP-GD with the bucket counter: the norms the sum clipped, counted in one update.
    individual = p.accountant.update(individual, chargeable(seen.norms), indices, entered)
  tally = Tally(jnp.sum(seen.losses), jnp.sum(entered),
                jnp.sum(entered & (seen.norms > p.clip_norm)))
  return summed, individual, tally


def step_keys(key):
  """(the next state's key, the batch's key, the noise's key) of a step."""
  return tuple(jax.random.split(key, 3))


def allowed_step(config: DPConfig, batch: Batch, ledger: Ledger):
  """Whether the step may run: not on an overflowing Poisson batch, and, without a filter
  (no per-example budget: the planned T is the budget), not beyond the planned T."""
  allowed = ~batch.overflow
  if config.accountant not in FILTERS:
    allowed &= ledger.steps < config.steps
  return allowed


def noisy_gradient(summed, key, std, expected_batch, params):
  """The sum plus N(0, std^2) noise drawn once from ``key`` (float32), over the expected batch
  size, in each parameter's dtype."""
  noisy = add_noise(summed, key, std)
  return jax.tree_util.tree_map(lambda g, p: (g / expected_batch).astype(p.dtype), noisy, params)


def keep_where(allowed, new, old):
  """``new`` where ``allowed``, else ``old`` (leaf by leaf)."""
  return jax.tree_util.tree_map(lambda a, b: jnp.where(allowed, a, b), new, old)


def record(ledger: Ledger, allowed, overflow, individual) -> Ledger:
  """The ledger after a step: a run or refused-for-overflow step is counted (the refusal is
  accounted too); the per-example state moves only when the step ran."""
  counted = allowed | overflow
  return Ledger(ledger.steps + counted.astype(jnp.int32),
                ledger.refused + overflow.astype(jnp.int32),
                keep_where(allowed, individual, ledger.individual), ledger.config)


def metrics(tally: Tally, batch: Batch, allowed) -> StepMetrics:
  count = jnp.maximum(tally.entered, 1)
  return StepMetrics(tally.loss / count, batch.size, tally.entered, tally.clipped / count,
                     allowed)


def _check_config(config):
  if not isinstance(config, DPConfig):
    raise TypeError(f"config must be a DPConfig; got {type(config).__name__}")


def _check_rows(config: DPConfig, rows):
  """Refuses rows that are not one per entry of the batch buffer."""
  lengths = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree_util.tree_leaves(rows)}
  if lengths != {config.buffer_size}:
    raise ValueError(f"rows must hold one row per entry of the batch buffer "
                     f"({config.buffer_size}: data[batch.indices]); got leading sizes "
                     f"{sorted(map(str, lengths))}")


def _check_host_fed(config: DPConfig):
  """Refuses host-fed steps where the accountant needs rows the batch does not hold."""
  if config.sampler == "poisson" and config.accountant != "worst_case":
    raise ValueError(f"the {config.accountant} accountant charges every example's gradient norm "
                     f"at every Poisson step (Koskela et al., Sec. 5), so it needs all N rows on "
                     f"the devices, not only the batch's: use trainer.step with the data placed "
                     f"on the mesh (trainer.place), or accountant='worst_case'")


def _same_batch(batch: Batch, drawn: Batch):
  """Whether the caller's batch is the one the step draws (its rows are then those accounted)."""
  same = jnp.all(jnp.asarray(batch.indices) == drawn.indices)
  return same & jnp.all(jnp.asarray(batch.valid) == drawn.valid)


def private_trainer(config: DPConfig, loss: Callable, optimizer: optax.GradientTransformation,
                    *, mesh=None, data_axis: str = "data") -> PrivateTrainer:
  """DP-SGD / DP-GD training with ``config``'s sampler, clipping, noise and accountant.

  ``loss(params, example) -> scalar`` for one example (``gradients.nnx_loss`` adapts a Flax NNX
  model). The noisy gradient sum is divided by the expected batch size before ``optimizer``.
  A step the accounting does not allow is not taken (parameters and optimiser unchanged,
  ``ran`` False): a Poisson batch that overflows its buffer (counted in the ledger), or, without
  a filter (worst-case ledger, bucket counter), a step beyond the planned T.

  ``mesh``: a ``jax.sharding.Mesh`` whose ``data_axis`` splits the examples (N a multiple of
  its size): the data and the per-example state are split in blocks over it, each device
  clips and sums its block's examples, the sums are added once per step and the noise is drawn
  once from the step's key. The batches, the ledger and (to float32 round-off) the parameters
  are those of the same run on one device.
  """
  _check_config(config)
  layout = Layout(mesh, data_axis)
  layout.check(config.num_examples)
  check_budget(config)
  n, block = config.num_examples, config.num_examples // layout.shards
  accountant = individual_accountant(config)
  block_pass = BlockPass(loss, individual_accountant(config, block), config.microbatch_size,
                         config.clip_norm, config.accountant in FILTERS,
                         accountant is not None and config.sampler == "poisson")
  draw = config.sampler_fn()
  std = config.noise_multiplier * config.clip_norm
  block_buffer = min(config.buffer_size, block)
  rows_per_block = -(-config.buffer_size // layout.shards)

  def init(params, key, data):
    check_data(config, loss, params, data)
    individual = None
    if accountant is not None:
      shardings = (None if mesh is None else jax.tree_util.tree_map(
          layout.sharding, layout.example_specs(jax.eval_shape(accountant.init), n)))
      individual = jax.jit(accountant.init, out_shardings=shardings)()
    zero = layout.replicate(np.zeros((), np.int32))
    ledger = Ledger(zero, layout.replicate(np.zeros((), np.int32)), individual, config)
    # (copies: a step that donates its state must not delete the caller's arrays)
    params = layout.replicate(params)
    with layout.context():
      opt_state = jax.jit(optimizer.init)(params)
    return TrainState(params, opt_state, ledger, layout.replicate(_key_data(key)))

  def over_blocks(fn, params, rows, selection, individual, allowed):
    """``fn`` on each block (split ``rows`` and per-example state), its sums added."""
    state_specs = (PartitionSpec() if individual is None
                   else layout.example_specs(individual, n))
    split = PartitionSpec(layout.axis)
    selection_spec = PartitionSpec() if isinstance(selection, Batch) else split
    in_specs = (PartitionSpec(), split, selection_spec, state_specs, PartitionSpec())
    run = layout.over_examples(fn, in_specs=in_specs,
                               out_specs=(PartitionSpec(), state_specs, PartitionSpec()))
    # (parameters keep their own layout: replicated over the data axis by init)
    return run(params, *layout.put((rows, selection, individual, allowed), in_specs[1:]))

  def summed_over_blocks(params, rows, positions, valid, individual, allowed):
    summed, individual, tally = clip_and_sum(block_pass, params, rows, positions, valid,
                                             individual, allowed)
    return layout.total(summed), individual, layout.total(tally)

  def on_data_block(params, rows, batch, individual, allowed):
    if mesh is None:
      positions, valid = batch.indices, batch.valid
    else:
      positions, valid = block_members(batch, layout.block_start(block), block, block_buffer)
    return summed_over_blocks(params, rows, positions, valid, individual, allowed)

  def on_row_block(params, rows, valid, individual, allowed):
    positions = jnp.arange(valid.shape[0], dtype=jnp.int32)
    return summed_over_blocks(params, rows, positions, valid, individual, allowed)

  def finish(state, summed, individual, tally, batch, allowed, keys):
    """Noise, optimiser and ledger after the blocks' sum."""
    key, _, noise_key = keys
    gradient = noisy_gradient(summed, noise_key, std, config.expected_batch_size, state.params)
    updates, opt_state = optimizer.update(gradient, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    ledger = record(state.ledger, allowed, batch.overflow, individual)
    new = TrainState(keep_where(allowed, params, state.params),
                     keep_where(allowed, opt_state, state.opt_state), ledger, key)
    return new, metrics(tally, batch, allowed)

  def step(state, data):
    check_same_config(state.ledger.config, config)
    check_lengths(config, data)
    data = jax.tree_util.tree_map(jnp.asarray, data)  # (host arrays, when run without jit)
    keys = step_keys(state.key)
    batch = draw(keys[1])
    allowed = allowed_step(config, batch, state.ledger)
    summed, individual, tally = over_blocks(on_data_block, state.params, data, batch,
                                            state.ledger.individual, allowed)
    return finish(state, summed, individual, tally, batch, allowed, keys)

  @jax.jit
  def sample_of_key(key):
    return draw(step_keys(key)[1])

  def sample(state) -> Batch:
    return Batch(*host_values(tuple(sample_of_key(state.key))))

  def step_on_batch(state, rows, batch):
    check_same_config(state.ledger.config, config)
    _check_host_fed(config)
    _check_rows(config, rows)
    keys = step_keys(state.key)
    drawn = draw(keys[1])
    same = _same_batch(batch, drawn)
    if not is_traced(same) and not bool(same):
      raise ValueError("batch is not the one this step draws: pass trainer.sample(state) of "
                       "the same state")
    allowed = allowed_step(config, drawn, state.ledger) & same
    extra = rows_per_block * layout.shards - config.buffer_size
    pad = lambda x: jnp.pad(jnp.asarray(x), [(0, extra)] + [(0, 0)] * (jnp.ndim(x) - 1))
    summed, individual, tally = over_blocks(on_row_block, state.params,
                                            jax.tree_util.tree_map(pad, rows),
                                            pad(drawn.valid), state.ledger.individual, allowed)
    new, out = finish(state, summed, individual, tally, drawn, allowed, keys)
    # A batch not drawn here leaves the state as it was (nothing released, nothing charged).
    return keep_where(same, new, state), out._replace(ran=out.ran & same)

  def place(data):
    return layout.place(data, n)

  return PrivateTrainer(init, step, sample, step_on_batch, place)


__all__ = ["BlockPass", "Ledger", "PrivateTrainer", "StepMetrics", "Tally", "TrainState",
           "allowed_step", "check_data", "check_lengths", "check_same_config", "chargeable",
           "clip_and_sum", "config_differences", "keep_where", "noisy_gradient",
           "private_trainer", "record", "step_keys"]
