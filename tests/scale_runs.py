"""Runs for the scale-out tests, each in a fresh process with forced host devices (the device
count is fixed when jax starts). ``python scale_runs.py NAME`` prints one JSON line.

* ``devices``: every sampler and accountant, 10 steps on 1 and 4 devices, and pairs that hold
  every sampler and every accountant on 2 and 8: batches, ledgers and parameters compared with
  the one-device run; the noise of a step on 4 devices
  against one draw from the step's key; ``sample`` + ``step_on_batch`` on a mesh; a 2-D mesh
  whose parameters are split over its other axis.
* ``placement``: with JAX's default device set to another device, where the host accounting
  runs (the accountant's entry points record the default device in effect).
* ``process ID PORT DIR`` (2 CPU devices, one of 2 processes under ``jax.distributed``): a run
  of 10 steps on a 4-device mesh over both processes, each passing its own block of the
  examples; the processes also save a checkpoint and restore it, and ask for the privacy report
  and the per-example report (on the mesh). Each writes its figures to DIR.
"""

import json
import os
import sys

_DEVICES = {"process": 2}.get(sys.argv[1] if len(sys.argv) > 1 else "", 8)
os.environ["XLA_FLAGS"] = " ".join(filter(None, [  # (after the suite's own flags: conftest)
    os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={_DEVICES}"]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxacct import api, training  # noqa: E402
from scale_setting import COMBOS, N, config, data, loss, params  # noqa: E402
from jaxacct._numerics import host_values  # noqa: E402
from jaxacct.individual import dpsgd  # noqa: E402

def mesh_of(count, *, shape=None, names=("data",)):
  if count == 1 and shape is None:
    return None
  auto = (jax.sharding.AxisType.Auto,) * len(names)
  return jax.make_mesh(shape or (count,), names, axis_types=auto,
                       devices=jax.devices()[:count])


def run(cfg, mesh, steps=10, host_fed=False, start=None):
  """(final state, the batches' indices) of ``steps`` jitted steps."""
  trainer = training.private_trainer(cfg, loss, optax.sgd(0.5), mesh=mesh)
  state = trainer.init(start or params(), jax.random.key(3), data())
  placed, step, fed = trainer.place(data()), jax.jit(trainer.step), jax.jit(trainer.step_on_batch)
  batches = []
  for _ in range(steps):
    batch = trainer.sample(state)
    batches.append(np.asarray(batch.indices).tolist())
    if host_fed:
      rows = {k: v[np.asarray(batch.indices)] for k, v in data().items()}
      state, _ = fed(state, rows, batch)
    else:
      state, _ = step(state, placed)
  return state, batches


def differences(a, b):
  """(largest relative difference of the parameters, whether the ledgers' integer and boolean
  arrays are identical, largest relative difference of their float arrays)."""
  rel = lambda x, y: float(np.max(np.abs(x - y) / np.maximum(np.abs(x), 1e-6), initial=0.0))
  leaves = lambda tree: [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
  params = max(rel(x, y) for x, y in zip(leaves(a.params), leaves(b.params)))
  pairs = list(zip(leaves(a.ledger), leaves(b.ledger)))
  exact = all(np.array_equal(x, y) for x, y in pairs if not np.issubdtype(x.dtype, np.floating))
  floating = [(x, y) for x, y in pairs if np.issubdtype(x.dtype, np.floating)]
  scale = max([float(np.max(np.abs(x), initial=0.0)) for x, _ in floating], default=1.0)
  # (against the ledger's largest value: a double word's low part is round-off itself)
  floats = max([float(np.max(np.abs(x - y), initial=0.0)) / max(scale, 1e-30)
                for x, y in floating], default=0.0)
  return dict(params=params, exact=exact, floats=floats)


def noise_draw():
  """A step whose gradients are all zero, on 4 devices: the update is the noise alone; it must
  equal one draw from the step key (gradients.add_noise of the step's noise key)."""
  zero_loss = lambda p, example: 0.0 * (loss(p, example) + jnp.sum(p["w"]))
  cfg = config("poisson", "worst_case")
  trainer = training.private_trainer(cfg, zero_loss, optax.sgd(1.0), mesh=mesh_of(4))
  state = trainer.init(params(), jax.random.key(3), data())
  after, _ = jax.jit(trainer.step)(state, trainer.place(data()))
  noise_key = training.step.step_keys(state.key)[2]
  zeros = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, jnp.float32), params())
  noise = training.gradients.add_noise(zeros, noise_key, cfg.noise_multiplier * cfg.clip_norm)
  return max(float(np.max(np.abs(np.asarray(state.params[k]) - np.asarray(after.params[k])
                                 - np.asarray(noise[k]) / cfg.expected_batch_size)))
             for k in noise)


EVERY_COUNT = [("poisson", "rdp_filter"), ("poisson", "bucket_counter"), ("fixed", "worst_case"),
               ("full", "gdp_filter")]


def devices():
  out, bases = {}, {}
  for sampler, accountant in COMBOS:
    cfg = config(sampler, accountant)
    base, batches = bases[sampler, accountant] = run(cfg, None)
    # Every pair on 4 devices; on 2 and 8 pairs that hold every sampler and every accountant.
    for count in (2, 4, 8) if (sampler, accountant) in EVERY_COUNT else (4,):
      state, seen = run(cfg, mesh_of(count))
      out[f"{sampler}/{accountant}/{count}"] = dict(differences(base, state),
                                                    batches=seen == batches)
  for sampler, accountant in [("poisson", "worst_case"), ("fixed", "worst_case"),
                              ("full", "gdp_filter")]:
    cfg = config(sampler, accountant)
    base, batches = bases[sampler, accountant]
    state, seen = run(cfg, mesh_of(4), host_fed=True)
    out[f"host-fed {sampler}/{accountant}/4"] = dict(differences(base, state),
                                                      batches=seen == batches)
  mesh = mesh_of(8, shape=(4, 2), names=("data", "model"))
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model"))
  start = dict(params(), w=jax.device_put(params()["w"], split))
  cfg = config("poisson", "rdp_filter")
  state, _ = run(cfg, mesh, steps=3, start=start)
  base, _ = run(cfg, None, steps=3)
  out["2-D mesh"] = dict(differences(base, state), batches=True,
                         spec=str(state.params["w"].sharding.spec))
  out["noise"] = noise_draw()
  try:
    training.private_trainer(config("fixed", "worst_case", num_examples=30), loss, optax.sgd(0.1),
                             mesh=mesh_of(4))
  except ValueError as error:
    out["indivisible"] = str(error)
  return out


class Recorded(Exception):
  """Raised by a recorded entry point once it has noted the default device (the test needs
  only where each path starts accounting, not its answer)."""


def placement():
  """Where each host accounting path runs with the default device set elsewhere: the PLD
  accountant's entry point and the per-example report's first plan note the default device in
  effect when they are called, then stop the path."""
  seen, recording = [], [False]
  for module, name in ((api, "epsilon"), (dpsgd, "_worst_epsilon")):
    original = getattr(module, name)

    def noted(*args, _original=original, **kwargs):
      if recording[0]:
        seen.append(str(jax.config.jax_default_device))
        raise Recorded
      return _original(*args, **kwargs)
    setattr(module, name, noted)

  def where(path, *args, **kwargs):
    recording[0] = True
    try:
      path(*args, **kwargs)
    except Recorded:
      pass
    recording[0] = False
    found = sorted(set(seen))
    seen.clear()
    return found

  out = {}
  cfg = config("poisson", "bucket_counter", target_epsilon=30.0)
  with jax.default_device(jax.devices()[5]):
    out["check_budget"] = where(training.private_trainer, cfg, loss, optax.sgd(0.5))
    trainer = training.private_trainer(cfg, loss, optax.sgd(0.5))
    state = trainer.init(params(), jax.random.key(3), data())
    state, _ = jax.jit(trainer.step)(state, data())
    out["step_device"] = str(next(iter(state.params["w"].devices())))
    out["privacy_report"] = where(training.privacy_report, state)
    out["calibrate"] = where(training.calibrate, cfg, 40.0)
    out["asked"] = where(training.privacy_report, state, device=jax.devices()[6])
    counter = training.accounting.individual_accountant(cfg)
    out["per_example_report"] = where(counter.report, jax.device_get(state.ledger.individual),
                                      cfg.delta)
  out["cpu"] = str(jax.devices("cpu")[0])
  return out


def multi_process_run(directory, name, mesh=None):
  """10 steps of the bucket counter under Poisson sampling on ``mesh`` (default: a 4-device
  mesh over all processes' devices), each process passing its block of the examples; the
  figures (every process: its view of the global values) written to ``directory/name.json``."""
  if mesh is None:
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  cfg = config("poisson", "bucket_counter")
  trainer = training.private_trainer(cfg, loss, optax.sgd(0.5), mesh=mesh)
  block = N // jax.process_count()
  first = jax.process_index() * block
  placed = trainer.place({k: v[first:first + block] for k, v in data().items()})
  state = trainer.init(params(), jax.random.key(3), placed)
  step = jax.jit(trainer.step)
  for _ in range(10):
    state, _ = step(state, placed)
  report = training.privacy_report(state)
  counter = training.accounting.individual_accountant(cfg)
  per_example = counter.report(state.ledger.individual, cfg.delta, eps_error=0.5, mesh=mesh)
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, "checkpoints")
  training.save_checkpoint(path, state)
  restored = training.restore_checkpoint(
      path, trainer.init(params(), jax.random.key(9), placed))
  host = lambda tree: [np.asarray(x).tolist() for x in jax.tree_util.tree_leaves(
      host_values(tree))]
  out = dict(params=host(state.params), ledger=host(state.ledger),
             restored=host(restored) == host(state), epsilon=float(report.epsilon.upper),
             individual=report.individual[1.0],
             per_example=np.asarray(per_example.pld.upper).tolist())
  with open(os.path.join(directory, f"{name}.json"), "w") as f:
    json.dump(out, f)


def process(index, port, directory):
  jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=int(index))
  multi_process_run(directory, f"process{index}")


if __name__ == "__main__":
  result = globals()[sys.argv[1]](*sys.argv[2:])
  if result is not None:
    print(json.dumps(result))
