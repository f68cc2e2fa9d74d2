"""Checkpoints of a train state with its privacy ledger (Orbax).

A checkpoint holds the state's arrays (parameters, optimiser state, ledger, key), the run's
configuration, and a description of the ledger: the checkpoint format's version, the
per-example accountant's ``spec`` (its kind, dtype, Renyi orders, noise grid, rounding
tolerance) and the dtype and shape of every ledger array. ``restore_checkpoint`` refuses a
checkpoint that differs from the run it is restored into in any of these, naming the field:
losing or resetting a privacy ledger silently, continuing it under another sigma, C, q, sampler
or budget, reading its numbers under other orders or another grid, or rounding a float64 ledger
into a float32 one (which lowers recorded spending) is a privacy failure. Orbax writes each step
into a temporary directory and renames it when complete, so a crash mid-save leaves the
previous checkpoint the latest one. A checkpoint that cannot be read (files deleted or damaged)
raises ValueError.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxacct.training.accounting import individual_accountant
from jaxacct.training.step import TrainState, config_differences

# The version of what a checkpoint holds and how its ledger reads; a checkpoint of another
# version is refused. 2: the ledger's description (accountant spec, array dtypes) is saved.
FORMAT = 2


def _manager(directory, max_to_keep=None):
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
  handlers = dict(state=ocp.StandardCheckpointHandler(), config=ocp.JsonCheckpointHandler(),
                  ledger=ocp.JsonCheckpointHandler())
  return ocp.CheckpointManager(os.path.abspath(os.fspath(directory)), options=options,
                               item_handlers=handlers)


def _plain(value):
  """A value through JSON (tuples become lists, numpy scalars Python numbers)."""
  return json.loads(json.dumps(value, default=lambda v: np.asarray(v).tolist()))


def _arrays(tree):
  """Each array of ``tree`` by its path: "dtype[shape]"."""
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  return {jax.tree_util.keystr(path).lstrip("."): f"{np.dtype(x.dtype).name}{list(np.shape(x))}"
          for path, x in leaves}


def ledger_description(state: TrainState) -> dict:
  """What gives ``state``'s ledger its meaning, as JSON values: the format version, the
  per-example accountant's spec (None for the worst-case ledger) and the ledger's arrays."""
  accountant = individual_accountant(state.ledger.config)
  return _plain({"format": FORMAT,
                 "accountant": None if accountant is None else accountant.spec,
                 "arrays": _arrays(state.ledger)})


def save_checkpoint(directory, state: TrainState, step=None, max_to_keep=None) -> int:
  """Saves ``state``, its configuration and its ledger's description as checkpoint ``step``
  (default: the ledger's step count) under ``directory``; waits until it is written. Returns the
  step."""
  if not isinstance(state, TrainState):
    raise TypeError(f"state must be a TrainState; got {type(state).__name__}")
  step = int(state.ledger.steps) if step is None else int(step)
  config = _plain(state.ledger.config.fingerprint())
  with _manager(directory, max_to_keep) as manager:
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(config),
        ledger=ocp.args.JsonSave(ledger_description(state))), force=True)
    manager.wait_until_finished()
  return step


def latest_step(directory):
  """The newest complete checkpoint's step, or None."""
  with _manager(directory) as manager:
    return manager.latest_step()


def _differences(saved: dict, expected: dict, prefix="") -> list:
  """The fields (dotted paths) in which two descriptions differ, each said as saved vs run."""
  out = []
  for key in sorted(set(saved) | set(expected)):
    a, b = saved.get(key), expected.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      out += _differences(a, b, f"{prefix}{key}.")
    elif a != b:
      shown = lambda v: repr(v) if len(repr(v)) < 60 else repr(v)[:57] + "..."
      out.append(f"{prefix}{key}: {shown(a)} vs {shown(b)}")
  return out


def _unreadable(step, directory, error):
  return ValueError(f"checkpoint {step} in {directory} cannot be read (files missing or "
                    f"damaged: {type(error).__name__}: {str(error)[:300]})")


def _read(manager, step, directory, **items):
  """``manager.restore`` of ``items``; ValueError naming the checkpoint when it cannot be read."""
  try:
    return manager.restore(step, args=ocp.args.Composite(**items))
  except Exception as error:  # Orbax and TensorStore raise many kinds for missing or bad files
    raise _unreadable(step, directory, error) from error


def _saved_items(manager, step, directory):
  """The names of the items checkpoint ``step`` holds."""
  try:
    return set(manager.item_metadata(step).keys())
  except Exception as error:
    raise _unreadable(step, directory, error) from error


def _check_ledger(saved, expected, step, directory):
  """Refuses a saved ledger description that differs from the run's."""
  if saved.get("format") != FORMAT:
    raise ValueError(f"checkpoint {step} in {directory} has checkpoint format "
                     f"{saved.get('format', 1)}, this jaxacct reads format {FORMAT}: its ledger "
                     f"cannot be continued here")
  differ = _differences(saved, expected)
  if differ:
    raise ValueError(f"checkpoint {step} in {directory} holds a ledger kept otherwise than this "
                     f"run's (checkpoint vs run: {'; '.join(differ)}); restoring it would "
                     f"reinterpret or round its recorded privacy spending")


def restore_checkpoint(directory, target: TrainState, step=None, rewind=False) -> TrainState:
  """The newest complete checkpoint restored into ``target``'s structure (e.g.
  ``trainer.init(...)`` of the resumed run). ValueError when there is none, when it cannot be
  read, or when its configuration or ledger description differs from ``target``'s (module
  docstring). An older ``step`` is refused unless ``rewind=True``: its ledger lacks the steps
  run since (they still cost privacy) and its key would draw the same noise again."""
  if not isinstance(target, TrainState):
    raise TypeError(f"target must be a TrainState; got {type(target).__name__}")
  with _manager(directory) as manager:
    latest = manager.latest_step()
    step = latest if step is None else int(step)
    if step is None or step not in manager.all_steps():
      raise ValueError(f"no complete checkpoint{'' if step is None else f' {step}'} in "
                       f"{directory}")
    if step != latest and not rewind:
      raise ValueError(f"checkpoint {step} is older than the newest ({latest}): restoring it "
                       f"rewinds the privacy ledger (pass rewind=True only if the steps since "
                       f"were never released)")
    described = "ledger" in _saved_items(manager, step, directory)
    saved = _read(manager, step, directory, config=ocp.args.JsonRestore(),
                  **({"ledger": ocp.args.JsonRestore()} if described else {}))
    expected = _plain(target.ledger.config.fingerprint())
    differ = config_differences(saved.config, expected)
    if differ:
      raise ValueError(f"checkpoint {step} in {directory} was written by a run of another "
                       f"configuration (checkpoint vs run: {differ}); refusing to continue its "
                       f"privacy ledger under different settings")
    # (format 1 saved no description)
    _check_ledger(saved.ledger if described else {}, ledger_description(target), step, directory)
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
    restored = _read(manager, step, directory, state=ocp.args.StandardRestore(abstract))
  return restored.state


__all__ = ["FORMAT", "latest_step", "ledger_description", "restore_checkpoint",
           "save_checkpoint"]
