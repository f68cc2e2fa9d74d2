"""``jaxacct demo``: private training on bundled data with every example's privacy accounted.

A small MLP learns scikit-learn's handwritten digits (1,797 8x8 images, bundled with the
package: nothing is downloaded) by DP-SGD with Poisson sampling. The noise multiplier is
calibrated by ``jaxacct.calibrate`` so that the certified worst-case epsilon of the whole run,
``dpsgd_epsilon(sigma, q, T, delta).upper``, meets the budget. Inside the compiled step every
example's gradient norm is counted on a noise grid (Koskela et al., Sec. 5), so at the end each
example has its own epsilon, by PLD and by RDP.

With ``filtering=True`` the run goes on past the worst-case budget, as in Koskela et al.'s
MIMIC-III study: the budget is that of the first ``budget_fraction`` of the steps and each
example has its own Renyi budget (Feldman and Zrnic's individual RDP filter: the certified filter
for Poisson-subsampled steps); an example whose budget is spent is retired, the others go on
learning. The guarantee is then the filter's.

Needs the ``demo`` extra (scikit-learn for the data, matplotlib for the plots, tqdm for the
progress bar).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

# The noisiest run the demo trains. Measured at the defaults (30 epochs): test accuracy 0.86 at
# sigma 6, 0.61 at 20, 0.35 at 40 (chance 0.10); beyond ~30 the model learns little.
SIGMA_MAX = 30.0
HIDDEN = 64


class DemoError(ValueError):
  """A demo setting that cannot run (the message says what can)."""


@dataclasses.dataclass(frozen=True)
class DemoSettings:
  """What the demo runs: the budget (``epsilon`` at ``delta``), the epochs, the batch (the
  expected Poisson batch size), the clip norm, the Adam learning rate, the seed, the output
  folder, and whether to filter (``budget_fraction``: the share of the steps the worst-case
  budget covers when filtering)."""

  epsilon: float = 2.0
  delta: float = 1e-5
  epochs: int = 30
  batch_size: int = 64
  clip_norm: float = 4.0
  learning_rate: float = 1e-2
  seed: int = 0
  out: str = "jaxacct-demo"
  filtering: bool = False
  budget_fraction: float = 0.5


def check_settings(s: DemoSettings):
  """Refuses bad settings before anything is computed."""
  if not (math.isfinite(s.epsilon) and s.epsilon > 0):
    raise DemoError(f"epsilon must be a positive number; got {s.epsilon!r}")
  if not 0 < s.delta < 1:
    raise DemoError(f"delta must be in (0, 1); got {s.delta!r}")
  if int(s.epochs) != s.epochs or s.epochs < 1:
    raise DemoError(f"epochs must be a whole number >= 1; got {s.epochs!r}")
  if not 0 < s.budget_fraction <= 1:
    raise DemoError(f"budget_fraction must be in (0, 1]; got {s.budget_fraction!r}")
  if not (s.clip_norm > 0 and s.learning_rate > 0):
    raise DemoError("clip_norm and learning_rate must be positive")


def check_output_folder(path):
  """Creates ``path`` and proves it writable (a clear error before training, not after)."""
  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path):
      pass
  except OSError as err:
    raise DemoError(f"cannot write to the output folder {path!r}: {err.strerror or err}") from None


# ----------------------------------------------------------------------------------------------
# Data and model


def load_digits(seed=0):
  """scikit-learn's digits, pixels scaled to [0, 1], split 80/20 stratified by class."""
  from sklearn.datasets import load_digits as sklearn_digits
  from sklearn.model_selection import train_test_split
  x, y = sklearn_digits(return_X_y=True)
  x_train, x_test, y_train, y_test = train_test_split(
      (x / 16.0).astype(np.float32), y.astype(np.int32), test_size=0.2, stratify=y,
      random_state=seed)
  return {"x": x_train, "y": y_train}, {"x": x_test, "y": y_test}


def init_mlp(key, sizes=(64, HIDDEN, 10)):
  """A tanh MLP's parameters (scaled normal weights, zero biases)."""
  layers = []
  for key, (n_in, n_out) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes, sizes[1:])):
    w = jax.random.normal(key, (n_in, n_out), jnp.float32) / np.sqrt(n_in)
    layers.append({"w": w, "b": jnp.zeros(n_out, jnp.float32)})
  return layers


def logits(params, x):
  for layer in params[:-1]:
    x = jnp.tanh(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def example_loss(params, example):
  """Cross-entropy of one example (jaxacct.training vmaps its gradient)."""
  return optax.softmax_cross_entropy_with_integer_labels(logits(params, example["x"]),
                                                         example["y"])


@jax.jit
def accuracy(params, data):
  return jnp.mean(jnp.argmax(logits(params, data["x"]), axis=-1) == data["y"])


# ----------------------------------------------------------------------------------------------
# The plan: sigma for the budget


@dataclasses.dataclass(frozen=True)
class Plan:
  """The run's privacy parameters: q, the steps run, the steps the budget covers, sigma, and the
  training configuration that holds them."""

  sampling_rate: float
  steps: int
  budget_steps: int
  noise_multiplier: float
  config: "training.DPConfig"


def _config(s: DemoSettings, n: int, budget_steps: int, sigma: float):
  """The run's ``training.DPConfig`` at noise multiplier ``sigma``."""
  from jaxacct import training
  return training.DPConfig(
      num_examples=n, noise_multiplier=sigma, clip_norm=s.clip_norm, batch_size=s.batch_size,
      steps=budget_steps, delta=s.delta,
      accountant="rdp_filter" if s.filtering else "bucket_counter", microbatch_size=64)


def plan_run(s: DemoSettings, n: int) -> Plan:
  """Calibrates sigma (``training.calibrate``: the certified worst case of the run's steps, or,
  when filtering, the individual RDP filter's guarantee, meets the budget); refuses a budget that
  would need more noise than the demo can train with."""
  from jaxacct import training
  q = s.batch_size / n
  steps_per_epoch = round(n / s.batch_size)
  steps = int(s.epochs) * steps_per_epoch
  budget_steps = max(1, round(s.budget_fraction * steps)) if s.filtering else steps
  lowest = training.planned_epsilon(_config(s, n, budget_steps, SIGMA_MAX))
  if s.epsilon < lowest:
    raise DemoError(
        f"epsilon {s.epsilon:g} is out of reach: {s.epochs} epochs at q = {q:.4g} need a noise "
        f"multiplier above {SIGMA_MAX:g}, where this model learns little. Reachable: epsilon >= "
        f"{lowest:.4g} at delta {s.delta:g} (or train fewer epochs)")
  config = training.calibrate(_config(s, n, budget_steps, SIGMA_MAX), s.epsilon)
  return Plan(q, steps, budget_steps, config.noise_multiplier, config)


# ----------------------------------------------------------------------------------------------
# The run


@dataclasses.dataclass
class History:
  """Per-epoch records: steps done, test accuracy, mean training loss, epsilon spent (the
  worst case of the steps so far; with the filter, the most any example has spent), examples
  active (not retired)."""

  steps: list = dataclasses.field(default_factory=list)
  accuracy: list = dataclasses.field(default_factory=list)
  loss: list = dataclasses.field(default_factory=list)
  epsilon: list = dataclasses.field(default_factory=list)
  active: list = dataclasses.field(default_factory=list)


def _epoch_runner(trainer, steps_per_epoch):
  """One compiled call per epoch: ``steps_per_epoch`` private steps by ``lax.scan``."""
  def epoch(state, data):
    return jax.lax.scan(lambda st, _: trainer.step(st, data), state, None,
                        length=steps_per_epoch)
  return jax.jit(epoch, donate_argnums=0)


def _epsilon_curve(plan, delta, epochs, steps_per_epoch):
  """Worst-case certified epsilon after each epoch (one batched call, for the progress bar)."""
  import jaxacct
  counts = np.arange(1, epochs + 1) * steps_per_epoch
  with jax.enable_x64(True):
    return np.asarray(jaxacct.dpsgd_epsilon(plan.noise_multiplier, plan.sampling_rate,
                                            jnp.asarray(counts), delta).upper, np.float64)


def train(s: DemoSettings, progress=True):
  """Runs the demo; returns (summary, each example's epsilon by method, the training data,
  the per-epoch history)."""
  from jaxacct import training
  check_settings(s)
  check_output_folder(s.out)
  train_data, test_data = load_digits(s.seed)
  n = len(train_data["y"])
  plan = plan_run(s, n)
  config = plan.config
  trainer = training.private_trainer(config, example_loss, optax.adam(s.learning_rate))
  key_model, key_train = jax.random.split(jax.random.key(s.seed))
  state = trainer.init(init_mlp(key_model), key_train, train_data)
  steps_per_epoch = plan.steps // s.epochs
  run_epoch = _epoch_runner(trainer, steps_per_epoch)
  curve = None if s.filtering else _epsilon_curve(plan, s.delta, s.epochs, steps_per_epoch)
  accountant = training.accounting.individual_accountant(config)
  history = History()
  started = time.perf_counter()
  bar = _progress(s.epochs, progress)
  for epoch in range(s.epochs):
    state, metrics = run_epoch(state, train_data)
    history.steps.append(int(state.ledger.steps))
    history.accuracy.append(float(accuracy(state.params, test_data)))
    history.loss.append(float(jnp.mean(metrics.loss)))
    if s.filtering:  # the filter holds each example: the most any has spent so far
      active = int(jnp.sum(state.ledger.individual.active))
      spent = np.asarray(accountant.odometer(state.ledger.individual, s.delta), np.float64)
      history.epsilon.append(float(spent.max()))
    else:
      active = n
      history.epsilon.append(float(curve[epoch]))
    history.active.append(active)
    bar.set_postfix(loss=f"{history.loss[-1]:.3f}", acc=f"{history.accuracy[-1]:.3f}",
                    eps=f"{history.epsilon[-1]:.3f}", active=active)
    bar.update(1)
  bar.close()
  report = training.privacy_report(state)
  if s.filtering:
    individual = {"rdp": spent}  # (the last epoch's odometer: the final state's)
  else:
    per_example = accountant.report(state.ledger.individual, s.delta)
    individual = {"pld": per_example.epsilons("pld"), "rdp": per_example.epsilons("rdp_epsilon")}
  summary = _summary(s, plan, report, history, individual, n, time.perf_counter() - started)
  return summary, individual, train_data, history


def _progress(epochs, enabled):
  from tqdm.auto import tqdm
  return tqdm(total=epochs, desc="DP-SGD epochs", unit="epoch", disable=not enabled,
              dynamic_ncols=True)


def _quantiles(values):
  qs = (0.0, 0.1, 0.5, 0.9, 1.0)
  return {f"{int(100 * q)}%": float(v) for q, v in zip(qs, np.quantile(values, qs))}


def _summary(s, plan, report, history, individual, n, seconds):
  """The run's summary (JSON-ready). ``epsilon`` is the certified upper epsilon of the run:
  without filtering the worst case of its T steps, with filtering the filter's guarantee."""
  from jaxacct.individual import COUNTER_CERTIFIES, FILTER_CERTIFIES
  worst = float(report.epsilon.upper)
  epsilon = report.guarantee if s.filtering else worst
  retired = n - history.active[-1]
  out = {
      "epsilon": float(epsilon),
      "delta": s.delta,
      "target_epsilon": s.epsilon,
      "guarantee": ("individual RDP filter (Feldman and Zrnic): every example's Renyi "
                    "divergence within that of the budget's steps" if s.filtering else
                    "worst case of the run: dpsgd_epsilon(noise_multiplier, sampling_rate, "
                    "steps, delta).upper"),
      "noise_multiplier": plan.noise_multiplier,
      "sampling_rate": plan.sampling_rate,
      "steps": plan.steps,
      "budget_steps": plan.budget_steps,
      "epochs": s.epochs,
      "batch_size": s.batch_size,
      "clip_norm": s.clip_norm,
      "num_examples": n,
      "test_accuracy": history.accuracy[-1],
      "examples_retired": retired,
      "individual_epsilon": {name: _quantiles(v) for name, v in individual.items()},
      "individual_epsilon_certifies": FILTER_CERTIFIES if s.filtering else COUNTER_CERTIFIES,
      "train_seconds": round(seconds, 1),
      "plots": [],
  }
  if s.filtering:
    out["epsilon_worst_case_all_steps"] = worst  # what the run would cost without the filter
  return out


# ----------------------------------------------------------------------------------------------
# Plots


def plot_all(summary, individual, train_data, history, out):
  """Writes the three PNG figures into ``out``; returns their paths."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  figures = {"individual_epsilon.png": _plot_histogram(plt, summary, individual),
             "training.png": _plot_training(plt, summary, history),
             "epsilon_by_class.png": _plot_classes(plt, summary, individual, train_data)}
  paths = []
  for name, fig in figures.items():
    paths.append(os.path.join(out, name))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
  return paths


def _filtered(summary):
  """Whether the summary's run was held by the individual RDP filter."""
  return "epsilon_worst_case_all_steps" in summary


def _plot_histogram(plt, summary, individual):
  fig, ax = plt.subplots(figsize=(7, 4.2))
  top = max(float(np.max(v)) for v in individual.values())
  bins = np.linspace(0.0, top * 1.02, 40)
  labels = {"pld": "PLD (per-example composition)", "rdp": "RDP (per-example, orders)"}
  for name, values in individual.items():
    ax.hist(values, bins=bins, alpha=0.6, label=labels[name])
  filtering = _filtered(summary)
  adaptive = "filter's guarantee" if filtering else "worst case"
  ax.axvline(summary["epsilon"], color="k", ls="--",
             label=f"{adaptive} {summary['epsilon']:.3f} (holds under adaptivity)")
  spent = ("spent so far by the filter's ledger" if filtering
           else "realised norms taken as fixed in advance")
  ax.set_xlabel(f"individual epsilon at delta = {summary['delta']:g} ({spent})")
  ax.set_ylabel("training examples")
  ax.set_title(f"Individual privacy of {summary['num_examples']} examples after "
               f"{summary['steps']} DP-SGD steps")
  ax.legend(loc="upper left")
  fig.tight_layout()
  return fig


def _plot_training(plt, summary, history):
  fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
  axes[0].plot(history.steps, history.accuracy, marker=".")
  axes[0].set_ylabel("test accuracy")
  axes[0].set_ylim(0, 1)
  axes[1].plot(history.steps, history.epsilon, marker=".", color="C3")
  axes[1].axhline(summary["target_epsilon"], color="k", ls="--", label="budget")
  axes[1].set_ylabel("epsilon spent (most by any example)" if _filtered(summary)
                     else "worst-case epsilon spent")
  axes[1].legend()
  axes[2].plot(history.steps, history.active, marker=".", color="C2")
  axes[2].set_ylabel("examples active (not retired)")
  axes[2].set_ylim(0, summary["num_examples"] * 1.05)
  if summary["budget_steps"] < summary["steps"]:
    for ax in axes:
      ax.axvline(summary["budget_steps"], color="grey", ls=":")
  for ax in axes:
    ax.set_xlabel("DP-SGD steps")
  fig.suptitle(f"sigma = {summary['noise_multiplier']:.3f}, q = {summary['sampling_rate']:.4f}")
  fig.tight_layout()
  return fig


def _plot_classes(plt, summary, individual, train_data):
  name = "pld" if "pld" in individual else "rdp"
  values = individual[name]
  labels = train_data["y"]
  fig, ax = plt.subplots(figsize=(7, 4.2))
  ax.boxplot([values[labels == c] for c in range(10)], showfliers=True)
  ax.set_xticks(range(1, 11), [str(c) for c in range(10)])
  ax.set_xlabel("digit class")
  ax.set_ylabel(f"individual epsilon ({name.upper()})")
  ax.set_title("Individual privacy by class (realised norms taken as fixed in advance)"
               if name == "pld" else "Individual privacy spent by class (filter's ledger)")
  fig.tight_layout()
  return fig


def describe(summary):
  """The summary as a few lines for a person."""
  lines = [
      f"DP-SGD on {summary['num_examples']} digits: {summary['steps']} steps over "
      f"{summary['epochs']} epochs, Poisson rate q = {summary['sampling_rate']:.4f}, noise "
      f"multiplier {summary['noise_multiplier']:.4f} (calibrated by jaxacct), clip norm "
      f"{summary['clip_norm']:g}",
      f"test accuracy {summary['test_accuracy']:.3f}",
      f"certified epsilon <= {summary['epsilon']:.4f} at delta = {summary['delta']:g} "
      f"(budget {summary['target_epsilon']:g}): {summary['guarantee']}"]
  if "epsilon_worst_case_all_steps" in summary:
    lines.append(f"  without the filter the {summary['steps']} steps would cost epsilon <= "
                 f"{summary['epsilon_worst_case_all_steps']:.4f}; the budget is that of "
                 f"{summary['budget_steps']} worst-case steps")
  for name, qs in summary["individual_epsilon"].items():
    shown = ", ".join(f"{k} {v:.3f}" for k, v in qs.items())
    lines.append(f"individual epsilon ({name.upper()}) quantiles: {shown}")
  lines.append(f"  {summary['individual_epsilon_certifies']}")
  lines.append(f"examples retired (budget spent): {summary['examples_retired']} of "
               f"{summary['num_examples']}")
  lines.append("plots: " + ", ".join(summary["plots"]))
  return "\n".join(lines)


def check_dependencies():
  """The demo extra's packages, or a clear error naming the install command."""
  missing = []
  for module in ("sklearn", "matplotlib", "tqdm"):
    try:
      __import__(module)
    except ImportError:
      missing.append(module)
  if missing:
    raise DemoError(f"the demo needs {', '.join(missing)}: pip install 'jaxacct[demo]'")


def run(s: DemoSettings, progress=True):
  """Trains, plots and writes ``summary.json``; returns the summary."""
  check_dependencies()
  summary, individual, train_data, history = train(s, progress)
  summary["plots"] = plot_all(summary, individual, train_data, history, s.out)
  with open(os.path.join(s.out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  return summary
