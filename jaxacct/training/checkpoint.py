"""Checkpoints of a train state with its privacy ledger (Orbax).

A checkpoint holds the state's arrays (parameters, optimiser state, ledger, key) and the run's
configuration as JSON. ``restore_checkpoint`` refuses a checkpoint whose configuration differs
from the run it is restored into: losing or resetting a privacy ledger silently, or continuing
it under another sigma, C, q, sampler or budget, is a privacy failure. Orbax writes each step
into a temporary directory and renames it when complete, so a crash mid-save leaves the
previous checkpoint the latest one.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxacct.training.step import TrainState, config_differences


def _manager(directory, max_to_keep=None):
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
  return ocp.CheckpointManager(os.path.abspath(os.fspath(directory)), options=options)


def _plain(fingerprint):
  """The configuration through JSON (tuples become lists, numpy scalars Python numbers)."""
  return json.loads(json.dumps(fingerprint, default=lambda v: np.asarray(v).tolist()))


def save_checkpoint(directory, state: TrainState, step=None, max_to_keep=None) -> int:
  """Saves ``state`` (and its configuration) as checkpoint ``step`` (default: the ledger's step
  count) under ``directory``; waits until it is written. Returns the step."""
  if not isinstance(state, TrainState):
    raise TypeError(f"state must be a TrainState; got {type(state).__name__}")
  step = int(state.ledger.steps) if step is None else int(step)
  config = _plain(state.ledger.config.fingerprint())
  with _manager(directory, max_to_keep) as manager:
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                               config=ocp.args.JsonSave(config)), force=True)
    manager.wait_until_finished()
  return step


def latest_step(directory):
  """The newest complete checkpoint's step, or None."""
  with _manager(directory) as manager:
    return manager.latest_step()


def restore_checkpoint(directory, target: TrainState, step=None, rewind=False) -> TrainState:
  """The newest complete checkpoint restored into ``target``'s structure (e.g.
  ``trainer.init(...)`` of the resumed run). ValueError when there is none, or when its
  configuration differs from ``target``'s. An older ``step`` is refused unless ``rewind=True``:
  its ledger lacks the steps run since (they still cost privacy) and its key would draw the
  same noise again."""
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
    saved = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    expected = _plain(target.ledger.config.fingerprint())
    differ = config_differences(saved.config, expected)
    if differ:
      raise ValueError(f"checkpoint {step} in {directory} was written by a run of another "
                       f"configuration (checkpoint vs run: {differ}); refusing to continue its "
                       f"privacy ledger under different settings")
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract)))
  return restored.state


__all__ = ["latest_step", "restore_checkpoint", "save_checkpoint"]
