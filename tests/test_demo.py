"""``jaxacct demo``: the run's certified epsilon against the front door, the per-example
figures against the worst case, the plots written, and bad input refused before training."""

import json
import os
import time

import jax
import numpy as np
import pytest

import jaxacct
from jaxacct import cli, demo


def _run_json(capsys, *args):
  code = cli.main(["demo", "--json", *args])
  out = capsys.readouterr()
  return code, out


def _png(path):
  with open(path, "rb") as f:
    return f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 10_000


@pytest.mark.slow
def test_demo_certified_epsilon_is_the_front_doors(capsys, tmp_path):
  code, out = _run_json(capsys, "--epsilon", "3", "--epochs", "4", "--out", str(tmp_path))
  assert code == 0, out.err
  summary = json.loads(out.out)
  for key in ("epsilon", "delta", "noise_multiplier", "sampling_rate", "steps", "test_accuracy",
              "plots"):
    assert key in summary
  assert summary == json.load(open(tmp_path / "summary.json"))
  assert summary["epsilon"] <= 3.0
  with jax.enable_x64(True):
    reference = float(jaxacct.dpsgd_epsilon(summary["noise_multiplier"], summary["sampling_rate"],
                                            summary["steps"], summary["delta"]).upper)
  assert summary["epsilon"] == pytest.approx(reference, rel=1e-12)
  assert summary["epsilon"] > 2.95  # calibrated: sigma no larger than needed
  assert summary["steps"] == 4 * round(1437 / 64) and summary["sampling_rate"] == 64 / 1437
  assert summary["test_accuracy"] > 0.6  # chance is 0.1
  assert summary["examples_retired"] == 0
  pld, rdp = summary["individual_epsilon"]["pld"], summary["individual_epsilon"]["rdp"]
  assert pld["100%"] <= summary["epsilon"] * (1 + 1e-9)  # nobody above the worst case
  assert pld["0%"] < 0.9 * summary["epsilon"]  # examples with small gradients spend less
  assert all(rdp[k] >= pld[k] * 0.999 for k in pld)  # RDP's conversion is the looser one
  assert len(summary["plots"]) == 3 and all(_png(p) for p in summary["plots"])


@pytest.mark.slow
def test_demo_filter_retires_examples_and_certifies_by_rdp(capsys, tmp_path):
  code, out = _run_json(capsys, "--filter", "--epsilon", "2", "--epochs", "6", "--out",
                        str(tmp_path))
  assert code == 0, out.err
  s = json.loads(out.out)
  assert s["epsilon"] <= 2.0 and s["budget_steps"] == s["steps"] // 2
  with jax.enable_x64(True):
    all_steps = float(jaxacct.dpsgd_epsilon(s["noise_multiplier"], s["sampling_rate"],
                                            s["steps"], s["delta"]).upper)
    budget = jaxacct.dpsgd_epsilon(s["noise_multiplier"], s["sampling_rate"], s["budget_steps"],
                                   s["delta"], accountant="rdp")
  assert s["epsilon_worst_case_all_steps"] == pytest.approx(all_steps, rel=1e-12)
  assert all_steps > 2.0  # the run went past what the budget buys without a filter
  # The filter's guarantee is RDP's epsilon of the budget's worst-case steps (its own orders).
  assert s["epsilon"] == pytest.approx(float(budget.upper), rel=0.02)
  assert s["examples_retired"] > 0
  # (the odometer is rounded up in float32: a few ulps above the float64 guarantee)
  assert s["individual_epsilon"]["rdp"]["100%"] <= s["epsilon"] * (1 + 1e-6)


def test_unreachable_budget_names_the_reachable_range(capsys, tmp_path):
  started = time.perf_counter()
  code, out = _run_json(capsys, "--epsilon", "0.05", "--epochs", "30", "--out", str(tmp_path))
  assert code == 2
  assert "out of reach" in out.err and "Reachable: epsilon >=" in out.err
  lowest = float(out.err.split("Reachable: epsilon >= ")[1].split()[0])
  q, steps = 64 / 1437, 30 * round(1437 / 64)
  with jax.enable_x64(True):
    reference = float(jaxacct.dpsgd_epsilon(demo.SIGMA_MAX, q, steps, 1e-5).upper)
  assert lowest == pytest.approx(reference, rel=1e-3)
  assert not os.listdir(tmp_path)  # nothing trained, nothing written
  assert time.perf_counter() - started < 120


@pytest.mark.parametrize("args, message", [
    (["--epsilon", "-1"], "epsilon must be a positive number"),
    (["--epsilon", "nan"], "epsilon must be a positive number"),
    (["--delta", "1.5"], "delta must be in (0, 1)"),
    (["--epochs", "0"], "epochs must be a whole number"),
    (["--epochs", "2.5"], "epochs must be a whole number"),
])
def test_bad_settings_are_refused(capsys, tmp_path, args, message):
  code, out = _run_json(capsys, *args, "--out", str(tmp_path))
  assert code == 2 and message in out.err


def test_unwritable_output_folder_is_refused_before_training(capsys, tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a folder")
  code, out = _run_json(capsys, "--out", str(blocker / "plots"))
  assert code == 2 and "cannot write to the output folder" in out.err


def test_digits_split_is_stratified_and_scaled():
  train, test = demo.load_digits(0)
  assert train["x"].shape == (1437, 64) and test["x"].shape == (360, 64)
  assert train["x"].min() >= 0 and train["x"].max() <= 1
  counts = np.bincount(test["y"], minlength=10)
  assert counts.min() >= 35 and counts.max() <= 37
