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

``checkpoint_report(directory)`` reads a saved run's privacy without the model code: the ledger's
arrays alone are restored from the state, its configuration and description from their JSON
(``jaxacct report DIRECTORY`` on the command line).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxacct.results import json_number
from jaxacct.training.accounting import (QUANTILES, individual_accountant, planned_epsilon,
                                         privacy_report)
from jaxacct.training.sampling import DPConfig
from jaxacct.training.step import Ledger, TrainState, config_differences

# The version of what a checkpoint holds and how its ledger reads; a checkpoint of another
# version is refused. 2: the ledger's description (accountant spec, array dtypes) is saved.
FORMAT = 2


def _manager(directory, max_to_keep=None):
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
  handlers = dict(state=ocp.StandardCheckpointHandler(), config=ocp.JsonCheckpointHandler(),
                  ledger=ocp.JsonCheckpointHandler())
  return ocp.CheckpointManager(os.path.abspath(os.fspath(directory)), options=options,
                               item_handlers=handlers)


def _reader(directory):
  """A read-only manager of an existing checkpoint directory whose state restores in part (the
  ledger without the model)."""
  path = os.path.abspath(os.fspath(directory))
  if not os.path.isdir(path):
    raise ValueError(f"{directory} is not a directory")
  options = ocp.CheckpointManagerOptions(create=False)
  handlers = dict(state=ocp.PyTreeCheckpointHandler(), config=ocp.JsonCheckpointHandler(),
                  ledger=ocp.JsonCheckpointHandler())
  return ocp.CheckpointManager(path, options=options, item_handlers=handlers)


def _plain(value):
  """A value through JSON (tuples become lists, numpy scalars Python numbers)."""
  return json.loads(json.dumps(value, default=lambda v: np.asarray(v).tolist()))


def _arrays(tree):
  """Each array of ``tree`` by its path: "dtype[shape]"."""
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  return {jax.tree_util.keystr(path).lstrip("."): f"{np.dtype(x.dtype).name}{list(x.shape)}"
          for path, x in leaves}


def ledger_description(state) -> dict:
  """What gives ``state``'s ledger (a train state's, or a ``Ledger``, abstract too) its
  meaning, as JSON values: the format version, the per-example accountant's spec (None for the
  worst-case ledger) and the ledger's arrays."""
  ledger = getattr(state, "ledger", state)
  accountant = individual_accountant(ledger.config)
  return _plain({"format": FORMAT,
                 "accountant": None if accountant is None else accountant.spec,
                 "arrays": _arrays(ledger)})


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


def _check_ledger(saved, expected, step, directory, reading=False):
  """Refuses a saved ledger description that differs from the run's (``reading``: from what
  this jaxacct reads for the checkpoint's configuration)."""
  if saved.get("format") != FORMAT:
    raise ValueError(f"checkpoint {step} in {directory} has checkpoint format "
                     f"{saved.get('format', 1)}, this jaxacct reads format {FORMAT}: its ledger "
                     f"cannot be {'read' if reading else 'continued'} here")
  differ = _differences(saved, expected)
  if differ:
    kept, other, harm = (("this jaxacct reads", "this jaxacct", "reading it would reinterpret")
                         if reading else ("this run's", "run",
                                          "restoring it would reinterpret or round"))
    raise ValueError(f"checkpoint {step} in {directory} holds a ledger kept otherwise than "
                     f"{kept} (checkpoint vs {other}: {'; '.join(differ)}); {harm} its recorded "
                     f"privacy spending")


def _chosen_step(manager, step, directory):
  """``step`` (default the newest), refused unless it is a complete checkpoint."""
  step = manager.latest_step() if step is None else int(step)
  if step is None or step not in manager.all_steps():
    raise ValueError(f"no complete checkpoint{'' if step is None else f' {step}'} in "
                     f"{directory}")
  return step


def _descriptions(manager, step, directory):
  """Checkpoint ``step``'s configuration and ledger description ({} where format 1 saved
  none)."""
  described = "ledger" in _saved_items(manager, step, directory)
  saved = _read(manager, step, directory, config=ocp.args.JsonRestore(),
                **({"ledger": ocp.args.JsonRestore()} if described else {}))
  return saved.config, saved.ledger if described else {}


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
    step = _chosen_step(manager, step, directory)
    if step != latest and not rewind:
      raise ValueError(f"checkpoint {step} is older than the newest ({latest}): restoring it "
                       f"rewinds the privacy ledger (pass rewind=True only if the steps since "
                       f"were never released)")
    config, described = _descriptions(manager, step, directory)
    differ = config_differences(config, _plain(target.ledger.config.fingerprint()))
    if differ:
      raise ValueError(f"checkpoint {step} in {directory} was written by a run of another "
                       f"configuration (checkpoint vs run: {differ}); refusing to continue its "
                       f"privacy ledger under different settings")
    _check_ledger(described, ledger_description(target), step, directory)
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
    restored = _read(manager, step, directory, state=ocp.args.StandardRestore(abstract))
  return restored.state


def _saved_config(fingerprint, step, directory) -> DPConfig:
  """The run's configuration from its saved fingerprint."""
  try:
    return DPConfig(**fingerprint)
  except (TypeError, ValueError) as error:
    raise ValueError(f"checkpoint {step} in {directory} holds a configuration this jaxacct "
                     f"cannot read ({error})") from None


def _abstract_ledger(config: DPConfig) -> Ledger:
  """The shapes and dtypes of a ledger of ``config`` (its floats in the scope's dtype)."""
  accountant = individual_accountant(config)
  count = jax.ShapeDtypeStruct((), np.int32)
  individual = None if accountant is None else jax.eval_shape(accountant.init)
  return Ledger(count, count, individual, config)


def _saved_ledger(manager, step, directory, config, described) -> Ledger:
  """Checkpoint ``step``'s ledger alone (numpy arrays; not the model's), once its description
  is the one this jaxacct reads for ``config``."""
  abstract = _abstract_ledger(config)
  _check_ledger(described, ledger_description(abstract), step, directory, reading=True)
  item = {"ledger": abstract}
  as_numpy = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
  restored = _read(manager, step, directory,
                   state=ocp.args.PyTreeRestore(item, as_numpy, partial_restore=True))
  return restored.state["ledger"]


def checkpoint_report(directory, step=None, quantiles=QUANTILES) -> dict:
  """A saved run's privacy, as JSON values, without the model code (``jaxacct report``).

  ``privacy_report`` of checkpoint ``step``'s (default the newest) ledger -- ``epsilon``: the
  certified worst-case epsilon (``Bounds.to_dict``) of the ``steps`` it recorded, at the
  configuration's ``delta``; ``guarantee``: the epsilon a filter holds every example to;
  ``individual``: the examples' epsilon ``quantiles``, and what they ``certify``; ``active``
  examples -- with ``planned_epsilon`` (what the whole planned run certifies), the configuration
  and the checkpoint's step. Only the ledger's arrays are restored; its configuration and
  description come from the checkpoint's JSON, and it is read in its own dtype (float64 for an
  x64 run), by the accountant its description names (refused, naming the field, where this
  jaxacct would read it otherwise). ValueError when the directory or the checkpoint is missing
  or cannot be read."""
  with _reader(directory) as manager:
    step = _chosen_step(manager, step, directory)
    fingerprint, described = _descriptions(manager, step, directory)
    config = _saved_config(fingerprint, step, directory)
    spec = described.get("accountant") or {}
    with jax.enable_x64(spec.get("dtype") == "float64"):
      report = privacy_report(_saved_ledger(manager, step, directory, config, described),
                              quantiles=quantiles)
      planned = planned_epsilon(config)
  individual = None if report.individual is None else {
      "quantiles": list(report.individual),
      "epsilon": [json_number(value) for value in report.individual.values()]}
  return {"directory": os.path.abspath(os.fspath(directory)), "checkpoint": step,
          "steps": report.steps, "refused": report.refused, "delta": report.delta,
          "epsilon": report.epsilon.to_dict(), "planned_epsilon": json_number(planned),
          "target_epsilon": config.target_epsilon,
          "guarantee": None if report.guarantee is None else json_number(report.guarantee),
          "individual": individual, "certifies": report.certifies, "active": report.active,
          "config": _plain(config.fingerprint())}


__all__ = ["FORMAT", "checkpoint_report", "latest_step", "ledger_description",
           "restore_checkpoint", "save_checkpoint"]
