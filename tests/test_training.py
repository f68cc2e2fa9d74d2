"""DP training: the step's noisy gradient against a plain per-example loop, padded and refused
examples, the samplers' distributions, the reported epsilon against independent references,
checkpoints (exact resume, mismatched restore, a crash mid-save) and bad input."""

import dataclasses
import functools
import json
import math
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

import jaxacct
from jaxacct import individual, training
from jaxacct.training import gradients
from conftest import gaussian_epsilon

N, D, H = 96, 5, 8


def _data(n=N, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, D)).astype(np.float32) * rng.uniform(0.2, 3.0, size=(n, 1))
  return {"x": jnp.asarray(x.astype(np.float32)), "y": jnp.asarray((x[:, 0] > 0).astype(np.int32))}


def _params(seed=0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return {"w1": jax.random.normal(k1, (D, H)) * 0.5, "b1": jnp.zeros(H),
          "w2": jax.random.normal(k2, (H, 2)) * 0.5, "b2": jnp.zeros(2)}


def _loss(params, example):
  hidden = jnp.tanh(example["x"] @ params["w1"] + params["b1"])
  logits = hidden @ params["w2"] + params["b2"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, example["y"])


def _config(**changes):
  base = dict(num_examples=N, noise_multiplier=1.3, clip_norm=0.7, batch_size=24, steps=50,
              microbatch_size=16)
  base.update(changes)
  if base.get("sampler") == "full":
    base.pop("batch_size")
  return training.DPConfig(**base)


@functools.lru_cache(maxsize=None)
def _trainer(config, lr=0.3):
  """The trainer of ``config`` and its compiled step (compiled once per configuration)."""
  trainer = training.private_trainer(config, _loss, optax.sgd(lr))
  return trainer, jax.jit(trainer.step)


def _run(config, steps, data=None, state=None):
  data = _data() if data is None else data
  trainer, step = _trainer(config)
  if state is None:
    state = trainer.init(_params(), jax.random.PRNGKey(7), data)
  metrics = []
  for _ in range(steps):
    state, m = step(state, data)
    metrics.append(jax.device_get(m))
  return jax.device_get(state), metrics


def _reference_step(config, params, key, data, lr, admitted=None):
  """One step by hand: the same batch and noise keys, each example's gradient by its own
  jax.grad call, clipped and summed in float64, the noise drawn leaf by leaf, SGD."""
  _, sample_key, noise_key = jax.random.split(key, 3)
  batch = config.sampler_fn()(sample_key)
  members = np.asarray(batch.indices)[np.asarray(batch.valid)]
  leaves, treedef = jax.tree_util.tree_flatten(params)
  total = [np.zeros(x.shape, np.float64) for x in leaves]
  for i in members:
    if admitted is not None and not admitted[i]:
      continue
    example = {k: v[i] for k, v in data.items()}
    grad = jax.tree_util.tree_leaves(jax.grad(_loss)(params, example))
    norm = math.sqrt(sum(float(np.sum(np.asarray(g, np.float64) ** 2)) for g in grad))
    scale = min(1.0, config.clip_norm / norm)
    total = [t + scale * np.asarray(g, np.float64) for t, g in zip(total, grad)]
  keys = jax.random.split(noise_key, len(leaves))
  std = config.noise_multiplier * config.clip_norm
  noisy = [t + std * np.asarray(jax.random.normal(k, x.shape, x.dtype), np.float64)
           for t, k, x in zip(total, keys, leaves)]
  new = [np.asarray(x, np.float64) - lr * g / config.expected_batch_size
         for x, g in zip(leaves, noisy)]
  return jax.tree_util.tree_unflatten(treedef, new), len(members)


@pytest.mark.parametrize("sampler", ["poisson", "fixed", "full"])
def test_step_equals_a_per_example_loop(sampler):
  config = _config(sampler=sampler)
  data, lr = _data(), 0.3
  trainer, step = _trainer(config, lr)
  state = trainer.init(_params(), jax.random.PRNGKey(3), data)
  for _ in range(2):
    expected, members = _reference_step(config, state.params, state.key, data, lr)
    state, metrics = step(state, data)
    assert int(metrics.batch_size) == members and bool(metrics.ran)
    for got, want in zip(jax.tree_util.tree_leaves(state.params),
                         jax.tree_util.tree_leaves(expected)):
      np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-6)


def test_filter_refused_examples_are_not_in_the_step():
  """DP-GD with the GDP filter: the step's update is the loop over the admitted examples only,
  and the ledger holds each admitted example's (min(||g||, C) / C)^2."""
  config = _config(sampler="full", accountant="gdp_filter", steps=3, noise_multiplier=0.6)
  data, lr = _data(), 0.3
  trainer, step = _trainer(config, lr)
  state = trainer.init(_params(), jax.random.PRNGKey(3), data)
  spent = np.zeros(N)
  budget = config.steps  # sqrt(T) / sigma, in units of clipped steps: T
  for _ in range(6):
    grads = jax.vmap(jax.grad(_loss), in_axes=(None, 0))(state.params, data)
    norms = np.sqrt(sum(np.sum(np.asarray(g, np.float64).reshape(N, -1) ** 2, axis=1)
                        for g in jax.tree_util.tree_leaves(grads)))
    charge = np.minimum(norms / config.clip_norm, 1.0) ** 2
    admitted = spent + charge <= budget * (1 + 1e-9)
    expected, _ = _reference_step(config, state.params, state.key, data, lr, admitted)
    state, metrics = step(state, data)
    spent = np.where(admitted, spent + charge, spent)
    assert int(metrics.active) == int(np.sum(admitted))
    np.testing.assert_array_equal(np.asarray(state.ledger.individual.active), admitted)
    for got, want in zip(jax.tree_util.tree_leaves(state.params),
                         jax.tree_util.tree_leaves(expected)):
      np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-6)
  assert 0 < int(np.sum(admitted)) < N  # some examples were refused in the last steps
  recorded = np.asarray(jaxacct.individual.spent_mu(state.ledger.individual), np.float64)
  np.testing.assert_allclose(recorded, np.sqrt(spent) / config.noise_multiplier, rtol=1e-5)


def test_padding_and_zero_weights_contribute_exactly_zero():
  """Entries of weight 0 add exactly nothing, even when their gradient is NaN or huge."""
  data = _data()
  poisoned = {"x": data["x"].at[5].set(jnp.nan).at[9].set(1e30), "y": data["y"]}
  params = _params()
  indices = jnp.asarray([0, 5, 1, 9, 2, 5, 3, 5], jnp.int32)
  weights = jnp.asarray([1, 0, 1, 0, 1, 0, 1, 0], jnp.float32)
  summed, _, seen = gradients.private_sum(_loss, params, poisoned, indices, weights, 0.7, 4)
  clean, _, _ = gradients.private_sum(_loss, params, data, indices[::2], weights[::2], 0.7, 4)
  for a, b in zip(jax.tree_util.tree_leaves(summed), jax.tree_util.tree_leaves(clean)):
    assert np.all(np.isfinite(np.asarray(a)))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  assert np.all(np.asarray(seen.weights)[1::2] == 0)
  zero, _, _ = gradients.private_sum(_loss, params, poisoned, indices, jnp.zeros(8), 0.7, 4)
  assert all(np.all(np.asarray(z) == 0) for z in jax.tree_util.tree_leaves(zero))


def test_unclippable_gradients_are_left_out():
  """A sampled example whose gradient norm is NaN or inf cannot be clipped: it adds nothing
  (a NaN in one coordinate must not let its other coordinates in unclipped)."""
  grads = {"a": jnp.asarray([[1.0, 2.0], [jnp.nan, 1e6], [3e30, 3e30], [jnp.inf, 0.0]]),
           "b": jnp.asarray([[0.5], [1.0], [0.0], [1.0]])}
  norms = gradients.global_norms(grads)
  summed = gradients.clipped_sum(grads, norms, jnp.ones(4), 1.0)
  first = np.array([1.0, 2.0, 0.5]) * min(1.0, 1.0 / math.sqrt(5.25)) * (
      1 - gradients.clip_margin())
  np.testing.assert_allclose(np.concatenate([np.asarray(summed["a"]), np.asarray(summed["b"])]),
                             first, rtol=2e-6)
  clipped = gradients.clipped_sum(grads, norms, jnp.asarray([0, 0, 1.0, 0]), 1.0)
  assert np.linalg.norm(np.concatenate([np.asarray(v) for v in clipped.values()])) <= 1.0


def test_microbatch_size_does_not_change_the_sum():
  data, params = _data(), _params()
  indices = jnp.arange(N, dtype=jnp.int32)
  sums = [gradients.private_sum(_loss, params, data, indices, jnp.ones(N), 0.7, m)[0]
          for m in (8, 32, 96)]
  for other in sums[1:]:
    for a, b in zip(jax.tree_util.tree_leaves(sums[0]), jax.tree_util.tree_leaves(other)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_poisson_batch_sizes_are_binomial():
  """Chi-square goodness of fit of 4,000 batch sizes against Binomial(N, q) (fixed seed), and
  each example's inclusion frequency against q."""
  config = training.DPConfig(num_examples=400, noise_multiplier=1.0, clip_norm=1.0,
                             batch_size=40, capacity=90, overflow_probability=1e-9)
  sample = jax.jit(jax.vmap(config.sampler_fn()))
  batches = sample(jax.random.split(jax.random.PRNGKey(11), 4000))
  sizes = np.asarray(batches.size)
  assert np.all(np.asarray(jnp.sum(batches.valid, axis=1)) == sizes)
  edges = np.concatenate([[-0.5], np.arange(28.5, 52.5, 2.0), [400.5]])
  observed = np.histogram(sizes, edges)[0]
  cdf = stats.binom.cdf(np.floor(edges[1:]), 400, 0.1) - stats.binom.cdf(np.floor(edges[:-1]),
                                                                         400, 0.1)
  chi2 = np.sum((observed - 4000 * cdf) ** 2 / (4000 * cdf))
  assert stats.chi2.sf(chi2, len(observed) - 1) > 1e-3
  counts = np.zeros(400)
  for idx, valid in zip(np.asarray(batches.indices), np.asarray(batches.valid)):
    counts[idx[valid]] += 1
  assert stats.chisquare(counts).pvalue > 1e-3 and abs(counts.mean() / 4000 - 0.1) < 2e-3
  # the members are distinct and sorted; padding past the size
  idx, valid = np.asarray(batches.indices[0]), np.asarray(batches.valid[0])
  assert np.all(np.diff(idx[valid]) > 0)


def test_poisson_inclusion_probability_never_exceeds_q():
  """The uint32 threshold gives each example probability floor(q 2^32) / 2^32: <= q, within
  2^-32 of it, for rates down to 1e-9 (a float comparison could round q up)."""
  from jaxacct.training.sampling import _bernoulli_threshold
  rates = np.concatenate([np.geomspace(1e-9, 1.0, 300, endpoint=False),
                          np.random.default_rng(0).uniform(0, 1, 300)])
  for q in rates:
    p = int(_bernoulli_threshold(q)) / 2.0 ** 32
    assert q - 2.0 ** -32 < p <= q


def test_fixed_batches_are_uniform_without_replacement():
  config = _config(sampler="fixed", batch_size=12)
  sample = jax.jit(jax.vmap(config.sampler_fn()))
  indices = np.asarray(sample(jax.random.split(jax.random.PRNGKey(5), 3000)).indices)
  assert all(len(set(row)) == 12 for row in indices)
  counts = np.bincount(indices.ravel(), minlength=N)
  assert stats.chisquare(counts).pvalue > 1e-3


def test_worst_case_epsilon_of_each_sampler():
  """After T steps the report's certified epsilon is dpsgd_epsilon's (Poisson), the Gaussian
  mechanism's closed form (full batch) and dp-accounting's PLD of the Poisson-subsampled
  Gaussian at sigma / 2 (fixed-size batches, sensitivity 2)."""
  from dp_accounting import dp_event as E, pld as dpl
  state, metrics = _run(_config(steps=7), 9)
  assert [bool(m.ran) for m in metrics] == [True] * 7 + [False] * 2  # planned T refused beyond
  report = training.privacy_report(state)
  want = jaxacct.dpsgd_epsilon(1.3, 24 / N, 7, 1e-5)  # the same plan: bit for bit
  assert report.steps == 7 and float(report.epsilon.upper) == float(want.upper)
  assert report.individual is None and report.guarantee is None
  accountant = dpl.PLDAccountant()  # and an independent one (its value is pessimistic)
  accountant.compose(E.PoissonSampledDpEvent(24 / N, E.GaussianDpEvent(1.3)), 7)
  ref = accountant.get_epsilon(1e-5)
  assert report.epsilon.lower <= ref * (1 + 1e-9)
  assert ref * (1 - 2e-3) <= report.epsilon.upper <= ref * 1.02 + 1e-3

  full = _config(sampler="full", steps=4)
  exact = gaussian_epsilon(1e-5, 2 / 1.3)
  got = training.worst_case_epsilon(full, 4)
  assert got.lower <= exact <= got.upper and got.upper - exact < 0.02 * exact

  for sigma, q, steps in [(1.3, 0.25, 4), (3.0, 0.05, 60)]:
    fixed = _config(sampler="fixed", noise_multiplier=sigma, batch_size=int(q * N) or 1,
                    steps=steps)
    ours = training.worst_case_epsilon(fixed, steps)
    accountant = dpl.PLDAccountant()
    accountant.compose(E.PoissonSampledDpEvent(fixed.sampling_rate,
                                               E.GaussianDpEvent(sigma / 2)), steps)
    ref = accountant.get_epsilon(1e-5)  # dp-accounting's is pessimistic
    assert ours.upper >= ref * (1 - 2e-3) and ours.upper <= ref * 1.02 + 1e-3
  # (the last setting:) never accounted as Poisson at sigma
  poisson = training.worst_case_epsilon(_config(noise_multiplier=sigma,
                                                batch_size=fixed.batch_size), steps)
  assert ours.lower > 1.5 * poisson.upper


def test_small_poisson_buffer_reports_its_overflow_allowance():
  big = _config(steps=20)
  small = _config(steps=20, capacity=52, overflow_probability=1e-9)
  beta = small.overflow_per_step
  assert 1e-10 < beta <= 1e-9
  assert beta == pytest.approx(stats.binom.sf(52, N + 1, 24 / N), rel=1e-9)
  exact, padded = (training.worst_case_epsilon(c, 20) for c in (big, small))
  allowance = 20 * (1 + math.exp(float(padded.upper))) * beta
  assert allowance > 1e-3 * 1e-5  # the allowance moves delta by more than 0.1%
  shifted = jaxacct.dpsgd_epsilon(1.3, 24 / N, 20, 1e-5 - allowance)
  assert padded.upper >= float(shifted.upper) > exact.upper
  assert padded.upper - exact.upper < 0.2  # (the allowance is ~30% of delta at eps 5.3)
  with pytest.raises(ValueError, match="not small"):  # T beta must be <= delta / 1000
    _config(steps=20, capacity=50, overflow_probability=1e-3)
  with pytest.raises(ValueError, match="worst-case accountant only"):
    _config(steps=20, capacity=57, overflow_probability=1e-9, accountant="rdp_filter")


def test_overflowing_batch_is_refused_and_accounted(monkeypatch):
  """A batch over its buffer is refused: parameters and optimiser state unchanged, the step
  counted in the ledger (a sampler forced to overflow every other step)."""
  config = _config(steps=30, capacity=57, overflow_probability=1e-9)
  honest = config.sampler_fn()

  def every_other(self):
    def sample(key):
      batch = honest(key)
      return batch._replace(overflow=jax.random.bits(key, (), jnp.uint32) % 2 == 0)
    return sample
  monkeypatch.setattr(training.DPConfig, "sampler_fn", every_other)
  trainer = training.private_trainer(config, _loss, optax.adam(0.01))
  state = trainer.init(_params(), jax.random.PRNGKey(7), _data())
  step = jax.jit(trainer.step)
  refused = 0
  for _ in range(8):
    before = jax.device_get(state)
    state, metrics = step(state, _data())
    if not bool(metrics.ran):
      refused += 1
      for a, b in zip(jax.tree_util.tree_leaves((before.params, before.opt_state)),
                      jax.tree_util.tree_leaves((state.params, state.opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert 0 < refused < 8
  assert int(state.ledger.refused) == refused and int(state.ledger.steps) == 8


def test_poisson_with_rdp_filter_and_counter():
  """Every example's norm is charged at every Poisson step (Koskela et al. Sec. 5): the RDP
  odometers of the filter and the counter agree, and both are below the worst case."""
  state_f, metrics = _run(_config(accountant="rdp_filter", steps=6), 6)
  state_c, metrics_c = _run(_config(accountant="bucket_counter", steps=6), 7)
  assert not bool(metrics_c[-1].ran)  # no filter: the planned T is the budget
  np.testing.assert_array_equal(np.asarray(state_c.ledger.individual.counts).sum(axis=1), 6)
  report_f = training.privacy_report(state_f)
  report_c = training.privacy_report(state_c)
  worst = jaxacct.rdp.epsilon(jaxacct.dpsgd_composition(1.3, 24 / N, 6), 1e-5)
  assert report_f.individual[1.0] <= report_f.guarantee + 1e-6
  assert report_f.guarantee <= float(worst.upper) * 1.001
  assert report_f.individual[0.0] < 0.9 * report_f.individual[1.0]
  for q in report_f.individual:
    assert report_c.individual[q] == pytest.approx(report_f.individual[q], rel=2e-2)
  assert report_f.active == N
  # what the individual figures certify, said where they appear
  assert report_f.certifies == individual.FILTER_CERTIFIES and "full adaptivity" in str(report_f)
  assert report_c.certifies == individual.COUNTER_CERTIFIES
  assert "as if it had been fixed in advance" in str(report_c)
  assert training.privacy_report(_run(_config(), 1)[0]).certifies is None
  # run on past T: the filter refuses the examples that spent their budget, sampled or not
  step = _trainer(_config(accountant="rdp_filter", steps=6))[1]
  refused_seen = False
  for _ in range(6):
    state_f, m = step(state_f, _data())
    assert int(m.active) <= int(m.batch_size)
    refused_seen |= int(m.active) < int(m.batch_size)
  assert refused_seen and training.privacy_report(state_f).active < N
  assert training.privacy_report(state_f).individual[1.0] <= report_f.guarantee + 1e-6


def test_resume_from_checkpoint_is_exact(tmp_path):
  config = _config(sampler="full", accountant="gdp_filter", steps=4, noise_multiplier=0.8)
  straight, _ = _run(config, 8)
  half, _ = _run(config, 4)
  training.save_checkpoint(tmp_path, half)
  fresh = _trainer(config)[0].init(_params(seed=1), jax.random.PRNGKey(0), _data())
  restored = training.restore_checkpoint(tmp_path, fresh)
  resumed, _ = _run(config, 4, state=restored)
  for a, b in zip(jax.tree_util.tree_leaves(straight), jax.tree_util.tree_leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert jax.tree_util.tree_structure(straight) == jax.tree_util.tree_structure(resumed)
  assert training.privacy_report(resumed).individual == training.privacy_report(
      straight).individual
  training.save_checkpoint(tmp_path, resumed)
  with pytest.raises(ValueError, match="rewinds the privacy ledger"):
    training.restore_checkpoint(tmp_path, fresh, step=4)
  assert int(training.restore_checkpoint(tmp_path, fresh, step=4,
                                         rewind=True).ledger.steps) == 4


def test_donated_steps_leave_the_callers_arrays():
  params, key = _params(), jax.random.key(3)
  trainer, _ = _trainer(_config())
  state = trainer.init(params, key, _data())
  state, _ = jax.jit(trainer.step, donate_argnums=0)(state, _data())
  assert np.all(np.isfinite(np.asarray(params["w1"]))) and jax.random.key_data(key).shape


@pytest.mark.parametrize("change", [dict(noise_multiplier=1.2), dict(batch_size=25),
                                    dict(sampler="fixed"), dict(num_examples=N + 1),
                                    dict(clip_norm=0.5), dict(steps=51)])
def test_restore_into_another_configuration_is_refused(tmp_path, change):
  config = _config()
  state, _ = _run(config, 1)
  training.save_checkpoint(tmp_path, state)
  other = _config(**change)
  data = _data(other.num_examples)
  target = training.private_trainer(other, _loss, optax.sgd(0.3)).init(
      _params(), jax.random.PRNGKey(0), data)
  with pytest.raises(ValueError, match=list(change)[0]):
    training.restore_checkpoint(tmp_path, target)
  with pytest.raises(ValueError, match="another configuration"):
    jax.jit(training.private_trainer(other, _loss, optax.sgd(0.3)).step)(state, data)


def test_crash_during_save_leaves_the_previous_checkpoint(tmp_path):
  """A process killed while writing checkpoint 2 (after its files, before the commit): the
  directory's newest complete checkpoint is still 1, and it restores exactly."""
  script = textwrap.dedent(f"""
      import os, sys
      sys.path.insert(0, {os.path.dirname(__file__)!r})
      import jax, optax
      from orbax.checkpoint._src.path import atomicity
      from jaxacct import training
      import test_training as t
      config = t._config()
      state, _ = t._run(config, 1)
      training.save_checkpoint({str(tmp_path)!r}, state)
      state, _ = t._run(config, 1, state=state)
      async def crash(self, *args, **kwargs):
        os._exit(3)
      for name in dir(atomicity):
        cls = getattr(atomicity, name)
        if isinstance(cls, type) and hasattr(cls, "finalize"):
          cls.finalize = crash
      training.save_checkpoint({str(tmp_path)!r}, state)
      """)
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 3, done.stderr[-2000:]
  assert any(p.name.startswith("2") for p in tmp_path.iterdir())  # the unfinished write
  assert training.checkpoint.latest_step(tmp_path) == 1
  config = _config()
  first, _ = _run(config, 1)
  target = _trainer(config)[0].init(_params(seed=2), jax.random.PRNGKey(9), _data())
  restored = training.restore_checkpoint(tmp_path, target)
  for a, b in zip(jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(restored)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_nnx_model_and_plain_function_agree():
  from flax import nnx

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.hidden = nnx.Linear(D, H, rngs=rngs)
      self.out = nnx.Linear(H, 2, rngs=rngs)

    def __call__(self, x):
      return self.out(jnp.tanh(self.hidden(x)))

  model = MLP(nnx.Rngs(0))
  params, loss = training.nnx_loss(model, lambda m, ex: optax.softmax_cross_entropy_with_integer_labels(
      m(ex["x"]), ex["y"]))
  as_dict = {"w1": params["hidden"]["kernel"][...], "b1": params["hidden"]["bias"][...],
             "w2": params["out"]["kernel"][...], "b2": params["out"]["bias"][...]}
  data = _data()
  ex = jax.tree_util.tree_map(lambda v: v[:10], data)
  _, g_nnx = gradients.per_example_gradients(loss, params, ex)
  _, g_plain = gradients.per_example_gradients(_loss, as_dict, ex)
  np.testing.assert_allclose(np.asarray(g_nnx["hidden"]["kernel"][...]), np.asarray(g_plain["w1"]),
                             rtol=1e-5, atol=1e-6)
  config = _config(steps=3)
  trainer = training.private_trainer(config, loss, optax.adam(1e-2))
  state = trainer.init(params, jax.random.PRNGKey(0), data)
  step = jax.jit(trainer.step)
  for _ in range(3):
    state, _ = step(state, data)
  nnx.update(model, state.params)
  np.testing.assert_array_equal(np.asarray(model.out.kernel[...]),
                                np.asarray(state.params["out"]["kernel"][...]))
  assert training.privacy_report(state).steps == 3


def test_private_aggregate_is_clip_sum_and_noise():
  data, params = _data(), _params()
  ex = jax.tree_util.tree_map(lambda v: v[:16], data)
  _, per_example = gradients.per_example_gradients(_loss, params, ex)
  key = jax.random.PRNGKey(4)
  transform = optax.chain(training.private_aggregate(0.7, 1.1, key), optax.scale(-0.1))
  updates, _ = transform.update(per_example, transform.init(params))
  norms = np.asarray(gradients.global_norms(per_example), np.float64)
  leaves = jax.tree_util.tree_leaves(per_example)
  noise_keys = jax.random.split(jax.random.split(key)[0], len(leaves))
  for got, g, k in zip(jax.tree_util.tree_leaves(updates), leaves, noise_keys):
    scale = np.minimum(1.0, 0.7 / norms).reshape((-1,) + (1,) * (g.ndim - 1))
    want = np.sum(np.asarray(g, np.float64) * scale, axis=0)
    want = want + 0.77 * np.asarray(jax.random.normal(k, g.shape[1:], g.dtype))
    np.testing.assert_allclose(np.asarray(got), -0.1 * want, rtol=2e-5, atol=1e-6)
  with pytest.raises(ValueError, match="clip_norm"):
    training.private_aggregate(0.0, 1.0, key)


@pytest.mark.parametrize("change, match", [
    (dict(clip_norm=0.0), "clip_norm"), (dict(clip_norm=-1.0), "clip_norm"),
    (dict(noise_multiplier=0.0), "noise_multiplier"), (dict(batch_size=N + 1), "batch_size"),
    (dict(batch_size=0), "batch_size"), (dict(sampler="shuffle"), "sampler"),
    (dict(capacity=30, overflow_probability=1e-9), "capacity >= "),
    (dict(accountant="gdp_filter"), "DP-GD"),
    (dict(sampler="fixed", accountant="rdp_filter"), "fixed-size"),
    (dict(target_epsilon=0.5), None), (dict(delta=0.0), "delta"),
    (dict(microbatch_size=0), "microbatch_size")])
def test_bad_configuration_is_refused(change, match):
  if "target_epsilon" in change:  # a sigma that does not reach the budget: refused at build
    config = _config(**change)
    with pytest.raises(ValueError, match="does not reach target_epsilon"):
      training.private_trainer(config, _loss, optax.sgd(0.1))
    return
  with pytest.raises(ValueError, match=match):
    _config(**change)


def test_bad_data_is_refused():
  config = _config()
  trainer = training.private_trainer(config, _loss, optax.sgd(0.1))
  with pytest.raises(ValueError, match="leading axis of num_examples"):
    trainer.init(_params(), jax.random.PRNGKey(0), _data(N - 1))
  wrong = {"x": jnp.zeros((N, D + 2)), "y": jnp.zeros(N, jnp.int32)}
  with pytest.raises(ValueError, match="cannot be evaluated on one example"):
    trainer.init(_params(), jax.random.PRNGKey(0), wrong)
  state = trainer.init(_params(), jax.random.PRNGKey(0), _data())
  with pytest.raises(ValueError, match="leading axis of num_examples"):
    jax.jit(trainer.step)(state, _data(N + 5))
  with pytest.raises(ValueError, match="scalar"):
    training.private_trainer(config, lambda p, ex: p["w1"] * 1.0, optax.sgd(0.1)).init(
        _params(), jax.random.PRNGKey(0), _data())


def test_docs_training_example_runs(tmp_path, capsys):
  """The training guide's example (docs/training.md) runs as written; its report is
  dpsgd_epsilon's, ``jaxacct report`` of its checkpoint prints the same numbers, and the model
  learns the (separable) task."""
  import json
  import pathlib
  import re

  from jaxacct import cli
  path = pathlib.Path(__file__).parent.parent / "docs" / "training.md"
  text = path.read_text()
  code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
  namespace = {}
  exec(compile(code, str(path), "exec"), namespace)  # noqa: S102 - our own documentation
  state, data = namespace["state"], namespace["data"]
  report = training.privacy_report(state)
  assert report.steps == 300
  assert float(report.epsilon.upper) == float(jaxacct.dpsgd_epsilon(1.0, 0.05, 300, 1e-5).upper)
  training.save_checkpoint(tmp_path, state)
  capsys.readouterr()  # (what the example printed)
  assert cli.main(["report", str(tmp_path), "--json"]) == 0
  saved = json.loads(capsys.readouterr().out)
  assert (saved["steps"], saved["delta"]) == (report.steps, report.delta)
  assert saved["epsilon"] == report.epsilon.to_dict()
  logits = data["x"] @ np.asarray(state.params["w"]) + np.asarray(state.params["b"])
  assert np.mean(np.argmax(logits, axis=1) == data["y"]) > 0.85
  # The mesh example (a mesh of this process's one device) and the host-fed loop after it.
  for title in ("## On several devices", "## Data that lives on the host"):
    block = re.search(r"```python\n(.*?)```", text[text.index(title):], re.S).group(1)
    exec(compile(block, str(path), "exec"), namespace)  # noqa: S102
  assert int(namespace["state"].ledger.steps) == 4
  assert namespace["trainer"].sample(namespace["state"]).indices.shape == (2001,)


def test_private_aggregate_keeps_its_weights_inside_a_chain():
  """The issue's case: per-example grads [[1, 0], [0, 1], [100, 0]], weights [1, 1, 0], clip 1,
  inside optax.chain(private_aggregate, sgd(1)): the weight-0 row adds nothing (-1, -1), also
  compiled and when the row is not finite."""
  grads = {"w": jnp.array([[1.0, 0.0], [0.0, 1.0], [100.0, 0.0]])}
  chain = optax.chain(training.private_aggregate(1.0, 1e-7, jax.random.PRNGKey(0)),
                      optax.sgd(1.0))
  state = chain.init({"w": jnp.zeros(2)})
  weights = jnp.array([1.0, 1.0, 0.0])
  for update in (chain.update, jax.jit(chain.update)):
    out, _ = update(grads, state, weights=weights)
    np.testing.assert_allclose(np.asarray(out["w"]), [-1.0, -1.0], atol=1e-5)
  nan_row = {"w": grads["w"].at[2].set(jnp.nan)}
  out, _ = chain.update(nan_row, state, weights=weights)
  np.testing.assert_allclose(np.asarray(out["w"]), [-1.0, -1.0], atol=1e-5)
  out, _ = chain.update(grads, state)  # no weights: every row, each clipped to 1
  np.testing.assert_allclose(np.asarray(out["w"]), [-2.0, -1.0], rtol=2e-5)


@pytest.mark.parametrize("changes", [dict(), dict(sampler="full", accountant="gdp_filter"),
                                     dict(accountant="bucket_counter")],
                         ids=["poisson", "full_gdp_filter", "poisson_counter"])
def test_step_runs_without_jit_on_host_data(changes):
  """trainer.step called eagerly with numpy data gives the compiled step's result, also with
  an example whose gradient is not finite (left out of the sum, charged as clipped)."""
  config = _config(**changes)
  trainer, step = _trainer(config)
  data = _data()
  data["x"] = data["x"].at[3, 0].set(jnp.nan)
  host = jax.tree_util.tree_map(np.asarray, data)
  state = trainer.init(_params(), jax.random.PRNGKey(7), host)
  eager, metrics = trainer.step(state, host)
  compiled, _ = step(state, data)
  assert bool(metrics.ran) and np.all(np.isfinite(np.asarray(eager.params["w1"])))
  for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(compiled)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_dp_gd_bucket_counter_counts_each_example_once_per_step_at_its_norm():
  """DP-GD with the bucket counter: one count per example and step, at the norm its gradient
  was clipped with (against the counter fed the per-example norms computed apart)."""
  config = _config(sampler="full", accountant="bucket_counter", steps=3)
  trainer, step = _trainer(config)
  state = trainer.init(_params(), jax.random.PRNGKey(7), _data())
  counter = training.accounting.individual_accountant(config)
  reference = counter.init()
  for _ in range(3):
    _, grads = gradients.per_example_gradients(_loss, state.params, _data())
    reference = counter.update(reference, gradients.global_norms(grads), jnp.arange(N),
                               jnp.ones(N, bool))
    state, _ = step(state, _data())
  counts = np.asarray(state.ledger.individual.counts)
  assert counts.sum(axis=1).tolist() == [3] * N
  assert np.abs(counts - np.asarray(reference.counts)).sum() <= 4  # (a few boundary ulps)


@pytest.mark.parametrize("target", [0.3, 1.0, 4.0])
def test_gdp_filter_guarantee_stays_at_or_below_its_target(target):
  config = _config(sampler="full", accountant="gdp_filter", steps=4, noise_multiplier=20.0,
                   target_epsilon=target)
  guarantee = training.accounting.individual_accountant(config).guarantee(config.delta)
  assert target * (1 - 1e-9) <= guarantee <= target


def _ledger_file(directory, step):
  return pathlib.Path(directory) / str(step) / "ledger" / "metadata"


def _edit_ledger(directory, step, edit):
  """Rewrites a saved ledger description as another library version might have written it."""
  path = _ledger_file(directory, step)
  described = json.loads(path.read_text())
  edit(described)
  path.write_text(json.dumps(described))


@pytest.mark.parametrize("accountant, edit, field", [
    ("rdp_filter", lambda d: d["accountant"].update(orders=d["accountant"]["orders"][:-1]),
     "orders"),
    ("rdp_filter", lambda d: d["accountant"].update(rtol=1e-6), "rtol"),
    ("rdp_filter", lambda d: d.update(format=1), "format"),
    ("bucket_counter", lambda d: d["accountant"].update(
        sigma_grid=[2 * s for s in d["accountant"]["sigma_grid"]]), "sigma_grid")])
def test_checkpoint_of_a_ledger_kept_otherwise_is_refused(tmp_path, accountant, edit, field):
  config = _config(accountant=accountant, steps=3)
  state, _ = _run(config, 1)
  training.save_checkpoint(tmp_path, state)
  target = _trainer(config)[0].init(_params(), jax.random.PRNGKey(0), _data())
  assert int(training.restore_checkpoint(tmp_path, target).ledger.steps) == 1
  _edit_ledger(tmp_path, 1, edit)
  with pytest.raises(ValueError, match=field):
    training.restore_checkpoint(tmp_path, target)


def test_float64_ledger_is_not_rounded_into_a_float32_run(tmp_path, x64_off):
  """A float64 rdp_filter ledger saved by an x64 run and restored into a float32 run would be
  rounded to nearest (recorded spending lowered): refused, naming the dtype."""
  config = _config(accountant="rdp_filter", steps=3, noise_multiplier=1.31)
  with jax.enable_x64(True):
    trainer = training.private_trainer(config, _loss, optax.sgd(0.3))
    state = trainer.init(_params(), jax.random.PRNGKey(7), _data())
    state, _ = jax.jit(trainer.step)(state, _data())
    assert state.ledger.individual.spent.dtype == jnp.float64
    training.save_checkpoint(tmp_path, state)
  trainer = training.private_trainer(config, _loss, optax.sgd(0.3))
  target = trainer.init(_params(), jax.random.PRNGKey(7), _data())
  assert target.ledger.individual.spent.dtype == jnp.float32
  with pytest.raises(ValueError, match="dtype: 'float64' vs 'float32'"):
    training.restore_checkpoint(tmp_path, target)


@pytest.mark.parametrize("damage", ["state", "config", "ledger"])
def test_damaged_checkpoint_is_refused_with_a_value_error(tmp_path, damage):
  config = _config(steps=3)
  state, _ = _run(config, 1)
  training.save_checkpoint(tmp_path, state)
  item = tmp_path / "1" / damage
  if damage == "state":  # the array data deleted
    for path in item.rglob("*"):
      if path.is_file() and path.parent.name == "d":
        path.unlink()
  else:  # the JSON garbled
    (item / "metadata").write_text("{not json")
  target = _trainer(config)[0].init(_params(), jax.random.PRNGKey(0), _data())
  with pytest.raises(ValueError, match="cannot be read"):
    training.restore_checkpoint(tmp_path, target)


def test_calibrate_meets_a_fixed_batch_runs_own_target():
  """The fixed-size sampler is accounted at sensitivity 2: its calibrated sigma certifies the
  target (checked against dp-accounting's PLD of the Poisson-subsampled Gaussian at sigma / 2),
  about twice what Poisson DP-SGD at the same rate needs; the trainer accepts it."""
  from dp_accounting import dp_event as E, pld as dpl
  config = _config(sampler="fixed", steps=40)
  tuned = training.calibrate(config, 2.0)
  planned = training.planned_epsilon(tuned)
  assert 0.99 * 2.0 < planned <= 2.0 and tuned.target_epsilon == 2.0
  accountant = dpl.PLDAccountant(value_discretization_interval=1e-4)
  accountant.compose(E.PoissonSampledDpEvent(0.25, E.GaussianDpEvent(
      tuned.noise_multiplier / 2)), 40)
  assert accountant.get_epsilon(1e-5) == pytest.approx(planned, rel=2e-3)
  poisson = float(jaxacct.calibrate.noise_multiplier(2.0, 1e-5, 0.25, 40))
  assert tuned.noise_multiplier > 1.8 * poisson
  training.private_trainer(tuned, _loss, optax.sgd(0.1))  # check_budget passes
  with pytest.raises(ValueError, match=r"training.calibrate\(config, 2\)"):
    training.private_trainer(dataclasses.replace(tuned, noise_multiplier=poisson), _loss,
                             optax.sgd(0.1))


def test_calibrate_meets_the_rdp_filters_guarantee():
  """With the RDP filter the run certifies the filter's guarantee (its RDP at its orders,
  converted): equal to dp-accounting's RDP accountant at those orders, <= the target."""
  from dp_accounting import dp_event as E
  from dp_accounting.rdp import rdp_privacy_accountant
  tuned = training.calibrate(_config(accountant="rdp_filter", steps=30), 1.5)
  planned = training.planned_epsilon(tuned)
  assert 0.99 * 1.5 < planned <= 1.5
  accountant = rdp_privacy_accountant.RdpAccountant(orders=list(individual.DEFAULT_ORDERS))
  accountant.compose(E.PoissonSampledDpEvent(0.25, E.GaussianDpEvent(tuned.noise_multiplier)),
                     30)
  assert accountant.get_epsilon(1e-5) == pytest.approx(planned, rel=1e-5)
  with pytest.raises(ValueError, match="target_epsilon"):
    training.calibrate(tuned, 0.0)
  floor = individual.rdp_epsilon(np.zeros(len(individual.DEFAULT_ORDERS)),
                                 individual.DEFAULT_ORDERS, 1e-5)
  with pytest.raises(ValueError, match=f"epsilon > {float(floor):.4g} whatever the noise"):
    training.calibrate(tuned, 0.9 * float(floor))
