"""The command line's start (``--help`` / ``--version`` import no JAX; the package imports its
names on first use) and ``jaxacct report``: a saved training run's privacy from its checkpoint
alone, the numbers of the training process's ``privacy_report``, and bad input refused."""

import importlib
import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest

import jaxacct
import jaxacct.cli
from jaxacct import training

REPO = pathlib.Path(__file__).parent.parent
HEAVY = ("jax", "jaxlib", "numpy", "optax", "orbax", "scipy")


def _python(code):
  """``code`` run by a fresh interpreter on this checkout; its stdout."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                                   os.environ.get("PYTHONPATH")])))
  proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  return proc.stdout


def test_help_and_version_import_no_jax():
  """The parser is built, ``--help`` and ``--version`` answer, and neither JAX nor NumPy is
  imported (what keeps them fast; no timing here)."""
  out = _python(f"""
      import contextlib, io, sys
      import jaxacct.cli
      for argv in (["--help"], ["report", "--help"], ["demo", "--help"], ["--version"]):
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
          try:
            jaxacct.cli.main(argv)
          except SystemExit as done:
            assert done.code == 0, (argv, done.code)
        if argv == ["--version"]:
          print(text.getvalue())
      heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
      assert not heavy, heavy
      """)
  assert out.split() == ["jaxacct", importlib.metadata.version("jaxacct")]
  assert jaxacct.__version__ == importlib.metadata.version("jaxacct")
  entry = pathlib.Path(sys.executable).parent / "jaxacct"  # the installed console script
  if entry.exists():
    proc = subprocess.run([str(entry), "--version"], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == out.split()


def test_the_cache_is_the_librarys_too_and_the_command_shows_and_clears_it(tmp_path):
  """A library call turns JAX's persistent cache on at ``JAXACCT_CACHE_DIR`` (a user's own JAX
  cache directory is kept; ``JAXACCT_NO_CACHE`` turns it off); ``jaxacct cache`` reports the
  directory, its files and bytes, and ``--clear`` empties it, importing no JAX."""
  env = {k: v for k, v in os.environ.items() if k not in (
         "JAXACCT_NO_CACHE", "JAX_COMPILATION_CACHE_DIR")}  # (the test session sets both)
  env["JAXACCT_CACHE_DIR"] = str(tmp_path / "programs")
  code = ("import jax, jaxacct; jaxacct.dpsgd_epsilon(1.0, 0.01, 100, 1e-5, accountant='rdp'); "
          "print(jax.config.jax_compilation_cache_dir)")
  run = lambda env: subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                   text=True, timeout=120, check=True).stdout.strip()
  assert run(env) == str(tmp_path / "programs")
  assert run(dict(env, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "mine"))) == str(tmp_path / "mine")
  assert run(dict(env, JAXACCT_NO_CACHE="1")) == "None"
  shown = tmp_path / "shown"  # (the run above may have cached a program: not counted here)
  shown.mkdir()
  (shown / "a-cache").write_bytes(b"12345")
  (shown / "b-cache").write_bytes(b"678")
  out = _python(f"""
      import contextlib, io, os, sys
      import jaxacct.cli
      os.environ["JAXACCT_CACHE_DIR"] = {str(shown)!r}
      os.environ.pop("JAXACCT_NO_CACHE", None)
      for argv in (["cache", "--json"], ["cache", "--clear", "--json"], ["cache", "--json"]):
        assert jaxacct.cli.main(argv) == 0
      assert not {{m.split(".")[0] for m in sys.modules}} & {set(HEAVY)!r}
      """)
  before, cleared, after = map(json.loads, out.splitlines())
  assert before == {"directory": str(shown), "enabled": True, "files": 2, "bytes": 8}
  assert cleared["removed"] == 2 and after["files"] == 0 and shown.is_dir()


def test_a_later_process_reads_the_saved_exports_and_answers_the_same(tmp_path):
  """With the cache on, the front door's PLD program and the calibration's are exported once
  and saved; a later process reads them back (no tracing) and answers exactly as a process
  without any cache does. The first process compiles those programs and nothing else (no
  eager operation on an input or a result compiles a program of its own)."""
  env = {k: v for k, v in os.environ.items() if k not in (
         "JAXACCT_NO_CACHE", "JAX_COMPILATION_CACHE_DIR")}
  env["JAXACCT_CACHE_DIR"] = str(tmp_path)
  code = textwrap.dedent("""
      import jax, jaxacct
      from jaxacct import _exported
      compiled = []
      jax.monitoring.register_event_duration_secs_listener(lambda event, _, **kw: (
          compiled.append(kw.get("fun_name")) if event.endswith("backend_compile_duration")
          else None))
      bounds = jaxacct.dpsgd_epsilon(1.0, 0.02, 300, 1e-6)
      sigma = jaxacct.calibrate.noise_multiplier(2.0, 1e-6, 0.02, 300)
      print(repr([float(bounds.lower), float(bounds.upper), float(sigma)]))
      print(sorted(key for (key, *_), program in _exported.PROGRAMS.items() if program))
      print(compiled)
      """)
  run = lambda env: subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                   text=True, timeout=300, check=True).stdout.splitlines()
  files = lambda: {path.stem: path.stat().st_mtime_ns for path in (tmp_path / "exports").iterdir()}
  first = run(env)
  saved = files()
  # (the front door's program at each plan size read; the calibration's RDP start compiles none)
  assert len(saved) >= 2 and eval(first[1]) == sorted(saved)  # pylint: disable=eval-used
  # (each export's call is compiled once, and nothing else)
  assert eval(first[2]) == ["jit(call)"] * len(saved), first[2]  # pylint: disable=eval-used
  second = run(env)
  assert second[:2] == first[:2] and files() == saved  # (read back: nothing exported again)
  bounds = jaxacct.dpsgd_epsilon(1.0, 0.02, 300, 1e-6)  # (this session: no cache, plain jit)
  sigma = jaxacct.calibrate.noise_multiplier(2.0, 1e-6, 0.02, 300)
  assert eval(first[0]) == [float(bounds.lower), float(bounds.upper), float(sigma)]


def test_a_first_answer_compiles_its_two_programs_side_by_side(tmp_path):
  """With the cache on, a setting answered as two programs (compose, then query: the command
  line's default setting, answered once, not from its band) has both compiled before either
  runs, each on a thread of its own (``_exported.prepare``; the query's arguments are the
  PLD's shapes read off the composition's export), with the elemental emitters of their own
  (the process's XLA_FLAGS name no emitters here): each compiled once, and the answer is the
  plain jitted programs' bit for bit."""
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if "xla_cpu_use_fusion_emitters" not in f)
  env = {k: v for k, v in os.environ.items() if k not in (
         "JAXACCT_NO_CACHE", "JAX_COMPILATION_CACHE_DIR")}
  env.update(JAXACCT_CACHE_DIR=str(tmp_path), XLA_FLAGS=flags)
  code = textwrap.dedent("""
      import threading, jax, jaxacct
      from jaxacct import _exported
      from jaxacct.pld import accountant
      compiled = []
      jax.monitoring.register_event_duration_secs_listener(lambda event, _, **kw: (
          compiled.append(threading.current_thread().name)
          if event.endswith("backend_compile_duration") else None))
      comp = jaxacct.dpsgd_composition(1.0, 0.01, 10_000)
      with accountant.answering_once():
        bounds = jaxacct.dpsgd_epsilon(1.0, 0.01, 10_000, 1e-5)
      print(repr([float(bounds.lower), float(bounds.estimate), float(bounds.upper)]))
      with jax.enable_x64(True):
        print(accountant._in_two_programs(comp, jaxacct.make_plan(comp, 1e-5)))
      print(sorted(p.compiled is not None for p in _exported.PROGRAMS.values() if p))
      print(sorted(compiled))
      """)
  run = lambda env: subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                   text=True, timeout=300, check=True).stdout.splitlines()
  first = run(env)
  assert first[1] == str(jax.default_backend() == "cpu")
  if first[1] == "True":
    assert first[2:] == [str([True, True]), str([
        "jaxacct-compile-pld.compose.level0", "jaxacct-compile-pld.epsilon.query.level0"])], first
  plain = run(dict(env, JAXACCT_NO_CACHE="1"))
  assert plain[0] == first[0] and plain[2] == "[]" and plain[3] == str(["MainThread"] * 2)
  # (compiled at XLA's lowest back-end level there: the library's full PLD, to round-off)
  from jaxacct.pld import accountant
  compose, query, _ = accountant.single_program("epsilon").tiers[False]
  with jax.enable_x64(True):
    comp = jaxacct.dpsgd_composition(1.0, 0.01, 10_000)
    library = query(compose(comp, jaxacct.make_plan(comp, 1e-5)), 1e-5)
  np.testing.assert_allclose(eval(first[0]), [float(library.lower), float(library.estimate),
                                              float(library.upper)], rtol=1e-10, atol=0.0)


def test_a_process_waits_for_its_compilations_at_exit_and_caches_them(tmp_path):
  """A process that ends while a program ``prepare`` started still compiles waits for it (torn
  down mid-compilation, it aborted: "terminate called ... exception not rethrown"), and the
  library caches what took over 0.2 s to compile (JAX's 1 s skipped a first calibration's
  programs), where the user has not set JAX's threshold."""
  from jaxacct import compile_cache
  env = {k: v for k, v in os.environ.items() if k not in (
         "JAXACCT_NO_CACHE", "JAX_COMPILATION_CACHE_DIR",
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
  env.update(JAXACCT_CACHE_DIR=str(tmp_path))
  code = textwrap.dedent("""
      import sys, jax, jaxacct
      from jaxacct.pld import accountant
      jax.monitoring.register_event_duration_secs_listener(lambda event, _, **kw: (
          sys.stdout.write("compiled\\n") if event.endswith("backend_compile_duration")
          else None))
      comp = jaxacct.dpsgd_composition(1.0, 0.01, 1_000)
      with jax.enable_x64(True):
        plan = jaxacct.make_plan(comp, 1e-5)
      accountant._compose.prepare(comp, plan)  # (then it exits at once)
      sys.stdout.write(f"threshold {jax.config.jax_persistent_cache_min_compile_time_secs}\\n")
      """)
  lines = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.splitlines()
  assert lines == [f"threshold {compile_cache.LIBRARY_MIN_COMPILE_SECS}", "compiled"], lines
  assert compile_cache.LIBRARY_MIN_COMPILE_SECS < 1.0
  assert any(path.name.endswith("-cache") for path in tmp_path.iterdir())  # (written)
  user = dict(env, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="3")
  assert subprocess.run([sys.executable, "-c", code], env=user, capture_output=True, text=True,
                        timeout=300, check=True).stdout.splitlines()[0] == "threshold 3.0"


def test_one_answer_programs_are_compiled_at_the_lowest_level_up_to_a_size(monkeypatch):
  """Within ``answering_once`` (the command line) a setting's full PLD is compiled at XLA's
  lowest back-end level up to ``_ONE_ANSWER_MAX_FFT`` points (it compiles ~2x faster, runs
  slower: a larger plan's runs would spend more than that saves), elsewhere as the library
  compiles it; the option names the level only where the user's XLA_FLAGS do not."""
  from jaxacct import compile_cache
  from jaxacct.pld import accountant
  small, large = (jaxacct.dpsgd_plan(1.0, 0.01, t, 1e-5) for t in (10_000, 300_000))
  assert small.fft_size <= accountant._ONE_ANSWER_MAX_FFT < large.fft_size
  assert not accountant._compiled_for_one_answer(small)
  with accountant.answering_once():
    assert accountant._compiled_for_one_answer(small)
    assert not accountant._compiled_for_one_answer(large)
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
  assert compile_cache.quick_options(one_answer=True) == {
      "xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0}
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=2")
  assert compile_cache.quick_options(one_answer=True) == {"xla_cpu_use_fusion_emitters": False}


def test_a_prepared_program_that_refuses_its_arguments_falls_back_to_its_jitted_call(
    monkeypatch):
  """An executable ``prepare`` compiled for other argument types or placement (TypeError,
  ValueError) is not an error: the program's jitted call answers, from then on."""
  from jaxacct import _exported

  def refuse(*_):
    raise ValueError("compiled for input shardings that disagree")

  jitted = []
  program = _exported._Program(call=lambda x: jitted.append(x) or [x + 1.0],
                               out_tree=jax.tree_util.tree_structure([0]), out_specs=[],
                               compiled=refuse)
  monkeypatch.setattr(_exported, "active", lambda: True)
  monkeypatch.setattr(_exported, "PROGRAMS", {})
  monkeypatch.setattr(_exported, "_entry", lambda *_: (
      ("key", "device"), [1.0], _exported.PROGRAMS.get(("key", "device"), program)))
  assert _exported.call("name", None, None, (1.0,)) == [2.0] == _exported.call(
      "name", None, None, (1.0,))
  assert jitted == [1.0, 1.0] and _exported.PROGRAMS[("key", "device")].compiled is None


def test_first_answers_import_no_scipy_and_lapack_is_set_up_where_a_program_calls_it(tmp_path):
  """A first epsilon and a first calibration, exported or read back, import no scipy (~0.2 s
  each of scipy.special and scipy.linalg): the calibration's host starts use libm and numpy, and
  jax.export's call lowering, which sets up jaxlib's LAPACK kernels from scipy.linalg whatever
  the module holds, skips it for a module that names no LAPACK target. One that calls LAPACK
  keeps it and solves right in a later process (skipped, it would crash)."""
  env = {k: v for k, v in os.environ.items() if k not in (
         "JAXACCT_NO_CACHE", "JAX_COMPILATION_CACHE_DIR")}
  env["JAXACCT_CACHE_DIR"] = str(tmp_path)
  code = textwrap.dedent("""
      import sys, jax, jax.numpy as jnp, numpy as np, jaxacct
      from jaxacct import _exported
      bounds = jaxacct.dpsgd_epsilon(1.0, 0.02, 300, 1e-6)
      sigma = jaxacct.calibrate.noise_multiplier(2.0, 1e-6, 0.02, 300)
      print(sorted(m for m in sys.modules if m.split(".")[0] == "scipy"))
      with jax.enable_x64(True):
        b = np.array([1.0, 2.0])
        sine = _exported.call("test.sin", jnp.sin, None, (b,))
        print(np.asarray(sine).tolist(), "scipy.linalg" in sys.modules)
        x = _exported.call("test.solve", jnp.linalg.solve, None, (np.array([[2.0, 1.0],
                                                                           [1.0, 3.0]]), b))
        print(np.asarray(x).tolist(), "scipy.linalg" in sys.modules)
      """)
  for _ in range(2):  # (exported and saved, then read back by a fresh process)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.splitlines()
    assert out[0] == "[]"
    sine, solved = (eval(line.rsplit(" ", 1)[0]) for line in out[1:])  # pylint: disable=eval-used
    assert sine == pytest.approx(np.sin([1.0, 2.0]), rel=1e-15) and out[1].endswith("False")
    assert solved == pytest.approx([0.2, 0.6], rel=1e-14) and out[2].endswith("True")
  assert len(list((tmp_path / "exports").iterdir())) >= 4


def test_the_lapack_wrapper_goes_only_over_a_setup_that_does_lapacks_alone(monkeypatch):
  """jax.export's backend setup is wrapped (and LAPACK's skipped for our modules) only where
  that setup names nothing but LAPACK's: another jax's, doing more, is left as it is."""
  from jax._src.export import _export as jax_export
  from jaxacct import _exported

  def another_setup(platforms):
    return print(platforms)

  monkeypatch.setattr(jax_export, "_ensure_backends_initialized", another_setup)
  assert _exported._guard_lapack_setup.__wrapped__() is False
  assert jax_export._ensure_backends_initialized is another_setup


def test_a_saved_export_is_read_only_by_the_source_that_made_it(tmp_path, monkeypatch):
  """Saved exports are named by a digest of the package's source as well as its version: an
  install from a later commit (the same version number) computes with its own code, never with
  programs an earlier one saved."""
  from jaxacct import _exported
  package = pathlib.Path(_exported.__file__).parent
  digest = lambda root: (monkeypatch.setattr(_exported, "__file__", str(root / "_exported.py")),
                         _exported.source_digest.__wrapped__())[1]
  copy = shutil.copytree(package, tmp_path / "jaxacct", ignore=shutil.ignore_patterns("*.pyc"))
  assert digest(copy) == digest(package)
  target = copy / "pld" / "query.py"
  target.write_text(target.read_text() + "\n# a later commit\n")
  assert digest(copy) != digest(package)
  key = lambda: _exported._key("pld.epsilon", "tree", [np.zeros(3)])
  this_source = key()
  monkeypatch.setattr(_exported, "source_digest", lambda: "another source")
  assert key() != this_source


def test_the_command_ends_its_process_after_writing_everything(tmp_path):
  """``python -m jaxacct.cli`` (the console script's ``run``) ends the process without the
  interpreter's teardown: its whole answer is printed, the compilation cache written and the
  exit status kept (0 for an answer, 2 for a refused input)."""
  env = {k: v for k, v in os.environ.items() if k not in (
         "JAXACCT_NO_CACHE", "JAX_COMPILATION_CACHE_DIR")}
  env["JAXACCT_CACHE_DIR"] = str(tmp_path)
  run = lambda *argv: subprocess.run([sys.executable, "-m", "jaxacct.cli", *argv], env=env,
                                     cwd=REPO, capture_output=True, text=True, timeout=120)
  argv = ("epsilon", "--accountant", "rdp", "--steps", "100", "--json")
  done = run(*argv)
  assert done.returncode == 0, done.stderr
  answer = json.loads(done.stdout)
  expected = jaxacct.dpsgd_epsilon(1.0, 0.01, 100, 1e-5, accountant="rdp")
  assert answer["upper"] == float(expected.upper) and answer["steps"] == 100
  assert any(tmp_path.rglob("*-cache")), sorted(tmp_path.rglob("*"))  # (XLA's programs)
  refused = run("epsilon", "--delta", "2", "--json")
  assert refused.returncode == 2 and not refused.stdout and "delta" in refused.stderr


def test_a_command_answers_from_the_programs_that_compile_fastest(monkeypatch, capsys):
  """A command answers inside ``answering_once`` (a large setting from its full PLD, not first
  from the PLD's band, whose program compiles longer); the library outside it as before."""
  from jaxacct.pld import accountant
  seen, as_band = [], accountant._as_band
  monkeypatch.setattr(accountant, "_as_band", lambda *a: seen.append(
      accountant._ONE_ANSWER.get()) or as_band(*a))
  assert jaxacct.cli.main(["epsilon", "--steps", "100", "--json"]) == 0
  assert json.loads(capsys.readouterr().out)["steps"] == 100
  assert seen == [True] and not accountant._ONE_ANSWER.get()


def test_the_command_compiles_quickly_unless_the_user_chose(monkeypatch):
  """The console script's process compiles with XLA's elemental emitters (``run`` sets the flag
  before ``main`` starts JAX; ``demo``, which trains, keeps XLA's defaults); the user's other
  flags stay, and a choice of emitters the user made is kept."""
  quick = jaxacct.cli.quick_compile_flags
  assert quick("") == "--xla_cpu_use_fusion_emitters=false"
  assert quick("--xla_force_host_platform_device_count=4").split() == [
      "--xla_force_host_platform_device_count=4", "--xla_cpu_use_fusion_emitters=false"]
  assert quick("--xla_cpu_use_fusion_emitters=true") == "--xla_cpu_use_fusion_emitters=true"
  seen = []
  monkeypatch.setattr(jaxacct.cli, "main", lambda: seen.append(os.environ["XLA_FLAGS"]) or 0)
  monkeypatch.setattr(os, "_exit", seen.append)
  for command in ("epsilon", "demo"):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    monkeypatch.setattr(sys, "argv", ["jaxacct", command])
    jaxacct.cli.run()
  assert seen == ["--xla_cpu_enable_fast_math=false --xla_cpu_use_fusion_emitters=false", 0,
                  "--xla_cpu_enable_fast_math=false", 0]


def test_first_answer_programs_compile_quickly_unless_the_user_chose(monkeypatch):
  """The library's programs of one setting's full PLD compile with the elemental emitters of
  their own (``compile_cache.quick_options``, XLA options for one program), unless the user's
  XLA_FLAGS name the emitters; the command line's flag is the same option."""
  from jaxacct import compile_cache
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
  assert compile_cache.quick_options() == {"xla_cpu_use_fusion_emitters": False}
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=true")
  assert compile_cache.quick_options() == {}
  monkeypatch.delenv("XLA_FLAGS")
  assert compile_cache.quick_options() == {"xla_cpu_use_fusion_emitters": False}
  assert jaxacct.cli.quick_compile_flags("") == "--xla_cpu_use_fusion_emitters=false"


def test_package_imports_its_names_on_first_use():
  """``import jaxacct`` imports no JAX; each public name is the object its module defines, and
  ``dir`` lists them all."""
  _python("""
      import sys, jaxacct
      assert "jax" not in sys.modules and set(jaxacct.__all__) <= set(dir(jaxacct))
      """)
  for name in jaxacct.__all__:
    module = importlib.import_module(jaxacct._EXPORTS[name])
    expected = module if module.__name__ == f"jaxacct.{name}" else getattr(module, name)
    assert getattr(jaxacct, name) is expected, name
  assert jaxacct.results.Bounds is jaxacct.Bounds  # (other submodules too, as before)
  with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
    jaxacct.no_such_name  # pylint: disable=pointless-statement


def test_demo_option_defaults_are_the_demos():
  from jaxacct import demo
  settings = demo.DemoSettings()
  assert jaxacct.cli._DEMO_DEFAULTS == {k: getattr(settings, k)
                                        for k in jaxacct.cli._DEMO_DEFAULTS}


# ---------------------------------------------------------------------------------------------
# jaxacct report

N = 32


def _loss(params, example):
  logits = example["x"] @ params["w"] + params["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, example["y"])


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
  """A tiny run of the README's training example, as DP-GD with the individual GDP filter and a
  budget, saved after its 3 steps, and its report in the training process."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(N, 3)).astype(np.float32) * rng.uniform(0.2, 3.0, size=(N, 1))
  data = {"x": x, "y": (x[:, 0] > 0).astype(np.int32)}
  params = {"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)}
  config = training.DPConfig(num_examples=N, sampler="full", noise_multiplier=2.0, clip_norm=0.5,
                             steps=3, accountant="gdp_filter", target_epsilon=5.0,
                             microbatch_size=N)
  trainer = training.private_trainer(config, _loss, optax.adam(0.05))
  state = trainer.init(params, jax.random.key(0), data)
  step = jax.jit(trainer.step)
  for _ in range(config.steps):
    state, _ = step(state, data)
  directory = tmp_path_factory.mktemp("run")
  training.save_checkpoint(directory, state)
  return directory, training.privacy_report(state), training.planned_epsilon(config)


def _report(argv, capsys):
  assert jaxacct.cli.main(["report", *argv]) == 0
  return capsys.readouterr().out


def test_report_json_is_the_training_processes_report(saved_run, capsys):
  directory, report, planned = saved_run
  out = json.loads(_report([str(directory), "--json"], capsys))
  assert out["epsilon"] == report.epsilon.to_dict()
  assert (out["steps"], out["refused"], out["delta"], out["active"]) == (
      report.steps, report.refused, report.delta, report.active) == (3, 0, 1e-5, N)
  assert (out["guarantee"], out["planned_epsilon"]) == (report.guarantee, planned)
  assert out["target_epsilon"] == 5.0 and planned <= 5.0
  assert out["individual"] == {"quantiles": list(report.individual),
                               "epsilon": list(report.individual.values())}
  assert out["certifies"] == report.certifies and out["checkpoint"] == 3
  assert out["config"] == report.config.fingerprint()


def test_report_text_shows_the_numbers(saved_run, capsys):
  directory, report, _ = saved_run
  out = _report([str(directory), "--step", "3"], capsys)
  assert f"<= {float(report.epsilon.upper):.6g}" in out
  assert f"<= {report.guarantee:.6g}" in out
  assert f"50%: {report.individual[0.5]:.6g}" in out and f"{N} of {N} examples active" in out


def _the_run(run):
  return [str(run)]


def _garble(path):
  path.write_text("{not json")


def _drop_arrays(item):
  for path in item.rglob("*"):
    if path.is_file() and path.parent.name == "d":
      path.unlink()


def _other_rtol(item):
  described = json.loads((item / "metadata").read_text())
  described["accountant"]["rtol"] = 1e-6
  (item / "metadata").write_text(json.dumps(described))


@pytest.mark.parametrize("argv, damage, message", [
    (lambda run: [str(run.parent / "missing")], None, "is not a directory"),
    (lambda run: [str(run / "3")], None, "no complete checkpoint in"),
    (lambda run: [str(run), "--step", "7"], None, "no complete checkpoint 7 in"),
    (_the_run, ("config", lambda item: _garble(item / "metadata")), "cannot be read"),
    # (TensorStore's reads still in flight when Orbax gives up report to a closed event loop)
    pytest.param(_the_run, ("state", _drop_arrays), "cannot be read", marks=pytest.mark.
                 filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")),
    (_the_run, ("ledger", _other_rtol), "rtol"),
])
def test_report_refuses_bad_input_with_one_line(saved_run, tmp_path, capsys, argv, damage,
                                                message):
  run = tmp_path / "run"
  shutil.copytree(saved_run[0], run)
  if damage is not None:
    item, edit = damage
    edit(run / "3" / item)
  assert jaxacct.cli.main(["report", *argv(run)]) == 2
  captured = capsys.readouterr()
  lines = captured.err.strip().splitlines()
  assert captured.out == "" and len(lines) == 1
  assert lines[0].startswith("jaxacct: error: ") and message in lines[0]
