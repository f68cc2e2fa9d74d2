"""Scale-out: a run on a device mesh is the one-device run (forced host devices, in a fresh
process), the host-fed loop (``sample`` + ``step_on_batch``) is ``step``, the host accounting
runs on the CPU backend, and the numerics that hold on accelerators (float32 norms and sums at
full precision, bf16 parameters, a clip that holds for 10^7 parameters)."""

import json
import math
import os
import pathlib
import socket
import subprocess
import sys
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scale_setting
from jaxacct import training
from jaxacct.training import gradients
from jaxacct.training.sampling import smallest_capacity

HERE = pathlib.Path(__file__).parent


def _scale_run(name):
  env = dict(os.environ, PYTHONPATH=str(HERE.parent))
  done = subprocess.run([sys.executable, str(HERE / "scale_runs.py"), name], capture_output=True,
                        text=True, timeout=600, env=env, cwd=HERE)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_mesh_run_is_the_one_device_run():
  """Every sampler and accountant on 4 devices, and every sampler and every accountant on 2
  and 8 (also host-fed on 4, and a 2-D mesh whose parameters are split over its other axis):
  the same batches, the same integer ledger (steps, counts, admissions), float ledgers and
  parameters within float32 round-off of the order the blocks' sums are added in (1e-5); the
  noise is one draw from the step's key."""
  out = _scale_run("devices")
  noise = out.pop("noise")
  assert noise < 1e-6
  assert out.pop("indivisible").startswith("num_examples (30) must be a multiple of the 4")
  assert out["2-D mesh"]["spec"] == "P(None, 'model')"
  assert len(out) == 8 + 4 * 2 + 3 + 1
  for name, got in out.items():
    assert got["batches"] and got["exact"], name
    assert got["params"] < 1e-5 and got["floats"] < 1e-5, (name, got)


def test_host_accounting_runs_on_the_cpu_backend():
  """With JAX's default device set to another device: the budget check, the report, the
  calibration and the per-example report's plans run on the CPU backend, the step where the
  state lives, and a report asked for on a device runs there."""
  out = _scale_run("placement")
  for path in ("check_budget", "privacy_report", "calibrate", "per_example_report"):
    assert out[path] == [out["cpu"]], path
  assert out["step_device"] == "cpu:5"
  assert out["asked"] == ["cpu:6"]


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_are_the_one_device_run(tmp_path):
  """2 processes x 2 CPU devices under jax.distributed, a 4-device mesh, each process passing
  its own block of the examples, against the same run on one device here (which a 4-device run
  equals: the test above): the same ledger, parameters within 1e-5, the same privacy report on
  both processes, the per-example report split over the 4 devices equal to the one-device
  report, and a checkpoint saved by both processes restores."""
  env = dict(os.environ, PYTHONPATH=str(HERE.parent))
  port = _free_port()
  runs = [subprocess.Popen([sys.executable, str(HERE / "scale_runs.py"), "process", str(index),
                            str(port), str(tmp_path)], env=env, cwd=HERE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
          for index in (0, 1)]
  cfg = scale_setting.config("poisson", "bucket_counter")
  trainer = training.private_trainer(cfg, scale_setting.loss, optax.sgd(0.5))
  state = trainer.init(scale_setting.params(), jax.random.key(3), scale_setting.data())
  step = jax.jit(trainer.step)
  for _ in range(10):
    state, _ = step(state, scale_setting.data())
  counter = training.accounting.individual_accountant(cfg)
  one_device = counter.report(state.ledger.individual, cfg.delta, eps_error=0.5)
  for run in runs:
    _, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-3000:]
  got = [json.loads((tmp_path / f"process{index}.json").read_text()) for index in (0, 1)]
  leaves = lambda tree: [np.asarray(x).tolist() for x in jax.tree_util.tree_leaves(tree)]
  for one in got:
    assert one["restored"]
    assert one["ledger"] == leaves(state.ledger)
    for a, b in zip(one["params"], leaves(state.params)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)
  assert got[0]["epsilon"] == got[1]["epsilon"] > 0
  assert got[0]["individual"] == got[1]["individual"] > 0
  # The per-example report split over both processes' 4 devices is the one-device report.
  for one in got:
    np.testing.assert_array_equal(one["per_example"], np.asarray(one_device.pld.upper))
  assert np.all(np.isfinite(got[0]["per_example"]))


_config, _data, _loss, _params = (scale_setting.config, scale_setting.data, scale_setting.loss,
                                  scale_setting.params)
_SMALL_BUFFER = smallest_capacity(scale_setting.N, 0.25, 1e-9)


@pytest.mark.parametrize("config", [
    _config("poisson", "worst_case"),
    _config("poisson", "worst_case", capacity=_SMALL_BUFFER, overflow_probability=1e-9,
            delta=1e-3),
    _config("fixed", "worst_case"), _config("full", "gdp_filter"),
    _config("full", "bucket_counter")],
    ids=["poisson", "poisson-capacity", "fixed", "full-gdp-filter", "full-bucket-counter"])
def test_sample_and_step_on_batch_are_the_step(config):
  """The host-fed loop -- the batch from ``sample``, its rows gathered on the host,
  ``step_on_batch`` -- gives the state and metrics of ``step`` for the same key."""
  trainer = training.private_trainer(config, _loss, optax.adam(0.05))
  data = _data()
  by_step = by_batch = trainer.init(_params(), jax.random.key(4), data)
  step, fed = jax.jit(trainer.step), jax.jit(trainer.step_on_batch)
  for _ in range(3):
    batch = trainer.sample(by_batch)
    rows = {k: v[np.asarray(batch.indices)] for k, v in data.items()}
    by_batch, metrics_fed = fed(by_batch, rows, batch)
    by_step, metrics = step(by_step, data)
    assert bool(metrics_fed.ran) and int(metrics_fed.batch_size) == int(metrics.batch_size)
  for a, b in zip(jax.tree_util.tree_leaves(by_step), jax.tree_util.tree_leaves(by_batch)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)


def test_host_fed_steps_refuse_what_they_cannot_account():
  """Poisson with a per-example accountant needs every example's norm (refused, saying why);
  rows that are not one per buffer entry are refused; a batch that is not the step's draw is
  refused eagerly and, compiled, leaves the state as it was (nothing released or charged)."""
  data = _data()
  counter = training.private_trainer(_config("poisson", "rdp_filter"), _loss, optax.sgd(0.1))
  state = counter.init(_params(), jax.random.key(0), data)
  with pytest.raises(ValueError, match="every example's gradient norm"):
    counter.step_on_batch(state, data, counter.sample(state))
  trainer = training.private_trainer(_config("fixed", "worst_case"), _loss, optax.sgd(0.1))
  state = trainer.init(_params(), jax.random.key(0), data)
  batch = trainer.sample(state)
  with pytest.raises(ValueError, match="one row per entry"):
    trainer.step_on_batch(state, data, batch)
  other = batch._replace(indices=batch.indices[::-1])
  rows = {k: v[np.asarray(other.indices)] for k, v in data.items()}
  with pytest.raises(ValueError, match="not the one this step draws"):
    trainer.step_on_batch(state, rows, other)
  after, metrics = jax.jit(trainer.step_on_batch)(state, rows, other)
  assert not bool(metrics.ran)
  for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(after)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_mesh_without_the_data_axis_is_refused():
  mesh = jax.make_mesh((1,), ("batch",))
  with pytest.raises(ValueError, match="data_axis 'data' is not an axis"):
    training.private_trainer(_config("fixed", "worst_case"), _loss, optax.sgd(0.1), mesh=mesh)


def test_bf16_parameters_train():
  """bf16 parameters: per-example gradients upcast before their norms, the clipped sum and
  the noise in float32, the update cast back: the parameters stay bf16 and the loss falls."""
  config = _config("full", "worst_case", noise_multiplier=0.3, clip_norm=5.0, steps=40)
  trainer = training.private_trainer(config, _loss, optax.sgd(0.5))
  data = _data()
  state = trainer.init(_params(jnp.bfloat16), jax.random.key(1), data)
  mean_loss = lambda p: float(jnp.mean(jax.vmap(_loss, (None, 0))(p, data)))
  before = mean_loss(state.params)
  step = jax.jit(trainer.step)
  for _ in range(30):
    state, metrics = step(state, data)
  assert {x.dtype for x in jax.tree_util.tree_leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
  assert bool(metrics.ran) and mean_loss(state.params) < 0.7 * before


def test_clip_margin_covers_the_float32_rounding():
  """The clip margin s satisfies (1 - s)(1 + u)^3 <= (1 - u) sqrt(1 - gamma), in exact
  arithmetic (module docstring of ``clip_margin``), for float32 and float64 norms."""
  for dtype in (jnp.float32, jnp.float64):
    u = Fraction(float(jnp.finfo(dtype).eps)) / 2
    gamma = Fraction(gradients.norm_error(dtype))
    s = Fraction(gradients.clip_margin(dtype))
    lhs = ((1 - s) * (1 + u) ** 3 / (1 - u)) ** 2
    assert lhs <= 1 - gamma
    assert s < 1e-4 if dtype == jnp.float32 else s < 1e-13


def test_no_clipped_contribution_exceeds_the_clip_norm_at_ten_million_parameters():
  """One example of 10^7 float32 coordinates (a spread of magnitudes): the norm is within its
  stated error of the float64 norm, and at clip norms on both sides of it and of the computed
  norm, the clipped contribution's float64 norm never exceeds C."""
  size = 10_000_000
  rng = np.random.default_rng(7)
  x = (rng.uniform(0.5, 1.5, size) * np.exp(rng.normal(0, 2, size)) * 1e-4).astype(np.float32)
  exact = math.sqrt(float(np.sum(x.astype(np.float64) ** 2)))
  grads = {"w": jnp.asarray(x)[None, :size // 2], "v": jnp.asarray(x)[None, size // 2:]}
  norm = float(gradients.global_norms(grads)[0])
  assert abs(norm ** 2 / exact ** 2 - 1) <= gradients.norm_error()
  clipped = jax.jit(lambda c: gradients.clipped_sum(grads, gradients.global_norms(grads),
                                                    jnp.ones(1), c))
  steps = [-2e-5, -1e-5, -3e-6, -1e-6, -1e-7, -1e-8, 0.0, 1e-8, 1e-7, 1e-6, 1e-5]
  for centre in (exact, norm):
    for c in (centre * (1 + k) for k in steps):
      out = clipped(c)
      total = sum(float(np.sum(np.asarray(v, np.float64) ** 2)) for v in out.values())
      assert math.sqrt(total) <= c, (c, math.sqrt(total) / c - 1)


def test_norms_read_empty_and_bf16_leaves_in_float32():
  """An empty leaf adds nothing; a bf16 leaf is squared in float32; the norm is within its
  stated error of the float64 norm."""
  rng = np.random.default_rng(2)
  wide = rng.normal(size=(3, 1000))
  grads = {"empty": jnp.zeros((3, 0)), "half": jnp.asarray(wide, jnp.bfloat16),
           "full": jnp.asarray(wide[:, :7], jnp.float32)}
  norms = gradients.global_norms(grads)
  assert norms.dtype == jnp.float32
  exact = np.sqrt(np.sum(np.asarray(grads["half"], np.float64) ** 2, axis=1)
                  + np.sum(np.asarray(grads["full"], np.float64) ** 2, axis=1))
  assert np.all(np.abs(np.asarray(norms, np.float64) ** 2 / exact ** 2 - 1)
                <= gradients.norm_error())
