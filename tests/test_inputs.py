"""Documented behaviour on bad input, at the numerical floor, and of the command line."""

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxacct
import jaxacct.cli
from jaxacct import results

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOOD = dict(noise_multiplier=1.0, sampling_rate=0.01, steps=1000, delta=1e-5)
DPSGD_EPS_1E5 = 1.8282  # dp-accounting's reference epsilon for GOOD (add/remove)


def _name(name):
  """Regex that matches ``name`` as a whole word (so "delta" does not match "delta_error")."""
  return rf"(?<![\w]){name}(?![\w])"


# ---------------------------------------------------------------------------------------------
# 1. Scalar bad input: ValueError naming the parameter, raised before any heavy computation.

BAD_DPSGD = [
    ("noise_multiplier", 0.0),
    ("noise_multiplier", -1.0),
    ("noise_multiplier", float("nan")),
    ("noise_multiplier", float("inf")),
    ("sampling_rate", 0.0),
    ("sampling_rate", -0.1),
    ("sampling_rate", 1.5),
    ("sampling_rate", float("nan")),
    ("steps", -1),
    ("steps", 2.5),
    ("steps", float("inf")),
    ("delta", 0.0),
    ("delta", 1.0),
    ("delta", 1.5),
    ("delta", -1e-5),
    ("delta", float("nan")),
]


@pytest.mark.parametrize("name,value", BAD_DPSGD, ids=[f"{n}={v}" for n, v in BAD_DPSGD])
def test_dpsgd_epsilon_rejects_bad_scalar(name, value):
  args = {**GOOD, name: value}
  with pytest.raises(ValueError, match=_name(name)):
    jaxacct.dpsgd_epsilon(**args)


@pytest.mark.parametrize("eps", [-1.0, -1e-9, float("nan")])
def test_dpsgd_delta_rejects_bad_epsilon(eps):
  with pytest.raises(ValueError, match=_name("epsilon")):
    jaxacct.dpsgd_delta(1.0, 0.01, 1000, eps)


@pytest.mark.parametrize("fn", [jaxacct.dpsgd_epsilon, jaxacct.dpsgd_delta])
def test_bogus_relation(fn):
  last = GOOD["delta"] if fn is jaxacct.dpsgd_epsilon else 1.0
  with pytest.raises(ValueError, match=_name("relation")):
    fn(1.0, 0.01, 1000, last, relation="bogus")


@pytest.mark.parametrize("eps_error", [0.0, 2.0])
def test_bad_eps_error(eps_error):
  with pytest.raises(ValueError, match=_name("eps_error")):
    jaxacct.dpsgd_epsilon(**GOOD, eps_error=eps_error)


BAD_MODELS = [
    ("gaussian_sigma_negative", lambda: jaxacct.Gaussian(-1.0), r"sigma.*-1\.0"),
    ("gaussian_sensitivity_nan", lambda: jaxacct.Gaussian(1.0, float("nan")), r"sensitivity"),
    ("gaussian_batch_one_bad", lambda: jaxacct.Gaussian([1.0, -2.0]), r"sigma"),
    ("laplace_scale_zero", lambda: jaxacct.Laplace(0.0), r"scale.*0\.0"),
    ("epsilon_delta_delta_1.5", lambda: jaxacct.EpsilonDelta(1.0, 1.5), r"delta.*1\.5"),
    ("pure_dp_negative", lambda: jaxacct.PureDP(-0.1), r"epsilon"),
    ("poisson_rate_zero", lambda: jaxacct.PoissonSampled(jaxacct.Gaussian(1.0), 0.0), r"rate"),
    ("replace_one_rate_2", lambda: jaxacct.SampledGaussianReplaceOne(1.0, 2.0), r"rate"),
]


@pytest.mark.parametrize("make,pattern", [c[1:] for c in BAD_MODELS],
                         ids=[c[0] for c in BAD_MODELS])
def test_bad_models_fail_at_construction(make, pattern):
  with pytest.raises(ValueError, match=pattern):
    make()


def test_models_stay_traceable():
  """Traced parameters are not checked (their values are unknown): a model built inside jit or
  vmap works, and JAX rebuilding a model from its leaves never runs the checks."""
  f = jax.jit(lambda s: jaxacct.Gaussian(s).sigma * 2.0)
  assert float(f(-1.0)) == -2.0
  sigmas = jax.vmap(lambda s: jaxacct.PoissonSampled(jaxacct.Gaussian(s), 0.5).base.sigma)
  np.testing.assert_array_equal(np.asarray(sigmas(np.array([1.0, 2.0]))), [1.0, 2.0])
  rebuilt = jax.tree_util.tree_map(lambda x: x - 5.0, jaxacct.Gaussian(1.0))
  assert float(rebuilt.sigma) == -4.0


def test_empty_composition():
  for fn, x in ((jaxacct.epsilon, 1e-5), (jaxacct.delta, 1.0)):
    with pytest.raises(ValueError, match="composition"):
      fn(jaxacct.Composition((), ()), x)


# ---------------------------------------------------------------------------------------------
# 2. Batches: one invalid entry is enough to reject the call.

BAD_BATCHES = [
    ("noise_multiplier", np.array([1.0, -1.0])),
    ("sampling_rate", np.array([0.01, 1.5])),
    ("steps", np.array([1000.0, 2.5])),
    ("delta", np.array([1e-5, 0.0])),
    ("delta", np.array([1e-5, np.nan])),
]


@pytest.mark.parametrize("name,value", BAD_BATCHES,
                         ids=[f"{n}={v.tolist()}" for n, v in BAD_BATCHES])
def test_batch_with_one_bad_entry(name, value):
  args = {**GOOD, name: value}
  with pytest.raises(ValueError, match=_name(name)):
    jaxacct.dpsgd_epsilon(**args)


def test_batch_with_one_bad_epsilon():
  with pytest.raises(ValueError, match=_name("epsilon")):
    jaxacct.dpsgd_delta(1.0, 0.01, 1000, np.array([1.0, -1.0]))


def test_lists_are_batches_like_arrays():
  # Python lists of parameters or counts batch like arrays (not a pytree of scalars).
  from conftest import gaussian_epsilon
  r = jaxacct.epsilon([(jaxacct.Gaussian([3.0, 4.0]), [10, 40])], [1e-5, 1e-6])
  for i, (sigma, steps, delta) in enumerate([(3.0, 10, 1e-5), (4.0, 40, 1e-6)]):
    exact = gaussian_epsilon(delta, math.sqrt(steps) / sigma)
    assert float(r.lower[i]) <= exact <= float(r.upper[i])
    assert abs(float(r.estimate[i]) - exact) <= 1e-4
  listed = jaxacct.dpsgd_epsilon([1.0, 2.0], 0.01, [1000, 100], 1e-5)
  arrays = jaxacct.dpsgd_epsilon(np.array([1.0, 2.0]), 0.01, np.array([1000, 100]), 1e-5)
  np.testing.assert_array_equal(np.asarray(listed.upper), np.asarray(arrays.upper))
  assert float(listed.lower[0]) <= DPSGD_EPS_1E5 <= float(listed.upper[0])
  # (Only at construction: a model rebuilt by JAX keeps its leaves as they are.)
  pairs = jax.tree_util.tree_map(lambda x: (x, 2 * x), jaxacct.Gaussian(1.0))
  assert pairs.sigma == (1.0, 2.0)


# ---------------------------------------------------------------------------------------------
# 3. A delta far below what the grid resolves never yields a wrong finite epsilon.

def test_tiny_delta_never_gives_wrong_finite_upper():
  try:
    r = jaxacct.dpsgd_epsilon(1.0, 0.01, 1000, 1e-300)
  except ValueError:
    return  # refusing is allowed
  upper, status = float(np.asarray(r.upper)), int(np.asarray(r.status))
  assert not math.isnan(upper)
  if math.isinf(upper):
    assert upper > 0
    assert status & results.BELOW_FLOOR, f"upper=+inf but status={status} lacks BELOW_FLOOR"
  else:
    # A finite upper must not claim to be below the floor, and must be a valid upper bound:
    # epsilon(1e-300) > epsilon(1e-10) >= certified lower at 1e-10.
    assert not status & results.BELOW_FLOOR, f"finite upper {upper} with BELOW_FLOOR set"
    reference = float(np.asarray(jaxacct.dpsgd_epsilon(1.0, 0.01, 1000, 1e-10).lower))
    assert upper >= reference


# ---------------------------------------------------------------------------------------------
# 4. Command line.

CLI_SETTING = ["--noise-multiplier", "1.0", "--sampling-rate", "0.01", "--steps", "1000"]


def _run_cli(*args, env=None):
  env = dict(os.environ if env is None else env)  # a copy: PYTHONPATH is prepended below
  env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  return subprocess.run([sys.executable, "-m", "jaxacct.cli", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


def _nonempty_lines(text):
  return [line for line in text.splitlines() if line.strip()]


def _is_number(v):
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def test_cli_caches_compiled_programs_unless_told_not_to(tmp_path):
  """The command caches compiled programs under ~/.cache/jaxacct; JAXACCT_NO_CACHE turns it off
  (the test session sets it, so tests never write into the user's cache)."""
  env = {k: v for k, v in os.environ.items() if k not in (
         "JAXACCT_NO_CACHE", "JAX_COMPILATION_CACHE_DIR")}  # (the test session sets both)
  env["HOME"] = str(tmp_path)
  argv = ["epsilon", "--accountant", "spa", "--steps", "3000", "--json"]
  assert _run_cli(*argv, env=env).returncode == 0
  assert os.listdir(tmp_path / ".cache" / "jaxacct" / "xla")
  env["HOME"] = str(tmp_path / "off")
  env["JAXACCT_NO_CACHE"] = "1"
  assert _run_cli(*argv, env=env).returncode == 0
  assert not (tmp_path / "off" / ".cache").exists()


def test_cli_epsilon_json():
  proc = _run_cli("epsilon", *CLI_SETTING, "--delta", "1e-5", "--json")
  assert proc.returncode == 0, proc.stderr
  assert len(_nonempty_lines(proc.stdout)) == 1, proc.stdout
  out = json.loads(proc.stdout)
  assert isinstance(out, dict)
  for key in ("lower", "estimate", "upper"):
    assert _is_number(out[key]), (key, out[key])
  assert out["lower"] <= out["estimate"] <= out["upper"]
  assert abs(out["estimate"] - DPSGD_EPS_1E5) < 1e-3, out


def test_cli_epsilon_text():
  proc = _run_cli("epsilon", *CLI_SETTING, "--delta", "1e-5")
  assert proc.returncode == 0, proc.stderr
  for key in ("lower", "estimate", "upper"):
    assert key in proc.stdout
  with pytest.raises(json.JSONDecodeError):
    json.loads(proc.stdout)


def test_cli_delta_json():
  proc = _run_cli("delta", *CLI_SETTING, "--epsilon", "2", "--json")
  assert proc.returncode == 0, proc.stderr
  assert len(_nonempty_lines(proc.stdout)) == 1, proc.stdout
  out = json.loads(proc.stdout)
  for key in ("lower", "estimate", "upper"):
    assert _is_number(out[key]), (key, out[key])
  assert 0 < out["lower"] <= out["estimate"] <= out["upper"] < 1, out


def test_cli_bad_value_subprocess():
  proc = _run_cli("epsilon", *CLI_SETTING[:2], "--sampling-rate", "2", "--steps", "1000",
                  "--delta", "1e-5")
  assert proc.returncode == 2
  assert proc.stdout == ""
  lines = _nonempty_lines(proc.stderr)
  assert len(lines) == 1, proc.stderr
  assert lines[0].startswith("jaxacct: error:")
  assert "sampling_rate" in lines[0]


def test_cli_non_number_subprocess():
  proc = _run_cli("epsilon", "--steps", "abc")
  assert proc.returncode == 2
  assert proc.stdout == ""
  assert "abc" in proc.stderr


BAD_CLI = [
    (["epsilon", "--sampling-rate", "2"], "sampling_rate"),
    (["epsilon", "--noise-multiplier", "-1"], "noise_multiplier"),
    (["epsilon", "--delta", "0"], "delta"),
    (["delta", "--epsilon", "-1"], "epsilon"),
]


@pytest.mark.parametrize("argv,name", BAD_CLI, ids=[" ".join(a) for a, _ in BAD_CLI])
def test_cli_bad_value_in_process(argv, name, capsys):
  assert jaxacct.cli.main(argv) == 2
  captured = capsys.readouterr()
  assert captured.out == ""
  lines = _nonempty_lines(captured.err)
  assert len(lines) == 1, captured.err
  assert lines[0].startswith("jaxacct: error:")
  assert name in lines[0]


def test_cli_non_number_in_process(capsys):
  with pytest.raises(SystemExit) as info:
    jaxacct.cli.main(["epsilon", "--steps", "abc"])
  assert info.value.code == 2
  assert capsys.readouterr().out == ""


# ---------------------------------------------------------------------------------------------
# 5. Bounds.to_dict: nan / inf become None, and the dict is JSON-serialisable.

def test_bounds_to_dict_tells_infinite_from_absent():
  """In JSON an absent bound (nan) is null and an infinite one the string "inf" (no guarantee),
  so a script can tell them apart; float("inf") reads the string back."""
  b = jaxacct.Bounds(lower=np.float64("nan"), estimate=np.float64(1.0),
                     upper=np.float64("inf"), status=np.int32(4))
  d = b.to_dict(quantity="epsilon")
  assert d["lower"] is None
  assert d["estimate"] == 1.0
  assert d["upper"] == "inf" and float(d["upper"]) == float("inf")
  assert d["status"] == 4 and isinstance(d["status"], int)
  assert d["notes"] == [results.STATUS_TEXT[results.LOWER_VACUOUS]]
  assert d["quantity"] == "epsilon"
  text = json.dumps(d, allow_nan=False)
  assert json.loads(text) == d


BAD_COMPARE = [(["--sampling-rate", "2"], "sampling_rate"), (["--delta", "0"], "delta"),
               (["--steps", "1.5"], "steps"), (["--eps-error", "0"], "eps_error")]


@pytest.mark.parametrize("argv,name", BAD_COMPARE, ids=[" ".join(a) for a, _ in BAD_COMPARE])
def test_cli_compare_bad_input_exits_2(argv, name, capsys):
  assert jaxacct.cli.main(["compare", *argv]) == 2
  captured = capsys.readouterr()
  assert captured.out == ""
  lines = _nonempty_lines(captured.err)
  assert len(lines) == 1 and lines[0].startswith("jaxacct: error:") and name in lines[0]


def test_cli_refuses_options_an_accountant_does_not_use(capsys):
  assert jaxacct.cli.main(["epsilon", "--accountant", "spa", "--eps-error", "0.1"]) == 2
  assert "eps_error" in capsys.readouterr().err


def test_cli_json_infinite_and_absent_bounds(capsys):
  """Edgeworth's certified upper at 100 steps and delta = 1e-5 is vacuous (+inf, "inf") and its
  lower absent (null): a script can tell "no guarantee" from "no lower bound"."""
  argv = ["epsilon", "--accountant", "edgeworth", "--steps", "100", "--json"]
  assert jaxacct.cli.main(argv) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["upper"] == "inf" and out["lower"] is None
  assert out["status"] & results.UPPER_VACUOUS and out["status"] & results.LOWER_VACUOUS
  assert _is_number(out["estimate"])


def test_cli_no_steps_answers_at_once(capsys):
  """Steps = 0: epsilon = delta = 0 for every command, and nothing is compiled."""
  compiled = []
  listen = lambda event, seconds, **kw: compiled.append((event, kw.get("fun_name")))
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    for command in (["epsilon"], ["delta"], ["compare"]):
      assert jaxacct.cli.main([*command, "--steps", "0", "--json"]) == 0
      out = json.loads(capsys.readouterr().out)
      rows = out["results"] if command == ["compare"] else [out]
      for row in rows:
        assert (row["lower"], row["estimate"], row["upper"], row["status"]) == (0, 0, 0, 0), row
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert not [c for c in compiled if c[0].endswith("backend_compile_duration")], compiled


# ---------------------------------------------------------------------------------------------
# 6. The calibrate command: its numbers checked before anything is computed; a progress bar.

BAD_CALIBRATE = [(["--sampling-rate", "0"], "--sampling-rate 0: sampling_rate"),
                 (["--steps", "2.5"], "--steps 2.5: steps"),
                 (["--delta", "1"], "--delta 1: delta"),
                 (["--epsilon", "-1"], "--epsilon -1: epsilon"),
                 (["--solve-for", "steps", "--noise-multiplier", "0"],
                  "--noise-multiplier 0: noise_multiplier"),
                 (["--eps-error", "2"], "--eps-error 2: eps_error")]


@pytest.mark.parametrize("argv,named", BAD_CALIBRATE, ids=[" ".join(a) for a, _ in BAD_CALIBRATE])
def test_cli_calibrate_checks_its_numbers_before_computing(argv, named, capsys, monkeypatch):
  """`jaxacct calibrate --sampling-rate 0` computed for 10 s before saying "got array([0., 0.])":
  the option and the text typed are named at once (nothing is computed: the calibration
  functions here fail if called)."""
  def computed(*args, **kwargs):
    raise AssertionError("a calibration ran")

  for name in ("noise_multiplier", "sampling_rate", "steps", "group_noise_multiplier"):
    monkeypatch.setattr(jaxacct.calibrate, name, computed)
  assert jaxacct.cli.main(["calibrate", *argv]) == 2
  captured = capsys.readouterr()
  lines = _nonempty_lines(captured.err)
  assert captured.out == "" and len(lines) == 1 and named in lines[0], captured.err


def test_cli_calibrate_shows_its_stages_on_a_progress_bar(capsys, monkeypatch):
  """tqdm (the 'demo' extra) draws the stages, shown after 2 s and only on a terminal (tqdm's
  disable=None); --json runs draw none; without tqdm nothing is drawn."""
  import types
  bars = []

  class Bar:
    def __init__(self, **kwargs):
      self.kwargs, self.stages, self.closed = kwargs, [], False
      bars.append(self)

    def set_description_str(self, text):
      self.stages.append(text)

    def update(self, _):
      pass

    def close(self):
      self.closed = True

  monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=Bar))
  argv = ["calibrate", "--accountant", "rdp", "--steps", "100"]
  assert jaxacct.cli.main(argv) == 0
  (bar,) = bars
  assert bar.closed and bar.kwargs["delay"] >= 2 and bar.kwargs["disable"] is None
  assert bar.stages[0].startswith("starting point") and "certified search 1" in bar.stages
  assert "noise_multiplier =" in capsys.readouterr().out
  assert jaxacct.cli._Progress(enabled=False).bar is None and len(bars) == 1  # (--json)
  monkeypatch.setitem(sys.modules, "tqdm", None)  # (import tqdm raises ImportError)
  quiet = jaxacct.cli._Progress(enabled=True)
  quiet("a stage")
  assert quiet.bar is None and len(bars) == 1
