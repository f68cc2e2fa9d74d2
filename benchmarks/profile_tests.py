"""Where the test suite's time goes: JAX tracing, lowering and XLA compilation per test.

A pytest plugin that records, in each test, the seconds of JAX's monitoring events
(``jaxpr_trace_duration``, ``jaxpr_to_mlir_module_duration``, ``backend_compile_duration``) and
the persistent cache's hits, misses and the compile time its hits saved; each pytest worker writes
its figures to ``$PROFILE_DIR/profile-<worker>.json`` at the end of the session, and the compile
seconds of each program (by its function's name), over the run and in each test, to
``programs-<worker>.json``. Then this file as a script prints the totals and the tests, files
and programs that compile the most::

    PYTHONPATH=benchmarks PROFILE_DIR=/tmp/prof python -m pytest -q -n 2 -p profile_tests
    python benchmarks/profile_tests.py /tmp/prof

(Notebooks, the CLI's and the scale tests' subprocesses are timed but their programs are not
seen: only each worker's own events are.)
"""

import collections
import functools
import json
import os
import pathlib
import sys
import time

_NAMES = {"jaxpr_trace_duration": "trace", "jaxpr_to_mlir_module_duration": "lower",
          "backend_compile_duration": "compile", "compile_time_saved_sec": "saved",
          "cache_hits": "hits", "cache_misses": "misses"}
_figures = collections.defaultdict(lambda: collections.defaultdict(float))
_programs = collections.defaultdict(lambda: [0, 0.0])  # program name -> [compiles, seconds]
_by_test = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
_current = ["<outside a test>"]


@functools.cache
def _listen():
  """Registers the listeners once, after conftest has set JAX's environment."""
  import jax.monitoring

  def timed(event, seconds, fun_name=None, **_):
    name = _NAMES.get(event.rsplit("/", 1)[-1])
    if name:
      _figures[_current[0]][name] += seconds
    if name == "compile" and fun_name:
      for table in (_programs, _by_test[_current[0]]):
        table[fun_name][0] += 1
        table[fun_name][1] += seconds

  def counted(event, **_):
    name = _NAMES.get(event.rsplit("/", 1)[-1])
    if name:
      _figures[_current[0]][name] += 1

  jax.monitoring.register_event_duration_secs_listener(timed)
  jax.monitoring.register_event_listener(counted)


def pytest_runtest_setup(item):
  _listen()
  _current[0] = item.nodeid
  _figures[item.nodeid]["start"] = time.time()


def pytest_runtest_teardown(item):
  _figures[item.nodeid]["wall"] = time.time() - _figures[item.nodeid].pop("start")


def pytest_sessionfinish(session):
  folder = pathlib.Path(os.environ.get("PROFILE_DIR", "."))
  folder.mkdir(parents=True, exist_ok=True)
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  (folder / f"profile-{worker}.json").write_text(json.dumps(_figures))
  (folder / f"programs-{worker}.json").write_text(json.dumps({"all": _programs,
                                                             "tests": _by_test}))


def _summary(folder, top=20):
  tests = {}
  programs = collections.defaultdict(lambda: [0, 0.0])
  for path in sorted(pathlib.Path(folder).glob("profile-*.json")):
    tests.update(json.loads(path.read_text()))
  for path in sorted(pathlib.Path(folder).glob("programs-*.json")):
    for name, (count, seconds) in json.loads(path.read_text())["all"].items():
      programs[name][0] += count
      programs[name][1] += seconds
  keys = ("wall", "compile", "trace", "lower", "misses", "hits", "saved")
  row = lambda name, f: (f"{f.get('wall', 0):8.1f} {f.get('compile', 0):8.1f} "
                         f"{f.get('trace', 0):7.1f} {f.get('lower', 0):6.1f} "
                         f"{int(f.get('misses', 0)):6d} {int(f.get('hits', 0)):5d} "
                         f"{f.get('saved', 0):6.1f}  {name}")
  header = (f"{'wall s':>8} {'compile':>8} {'trace':>7} {'lower':>6} {'misses':>6} {'hits':>5} "
            f"{'saved':>6}")
  total = {k: sum(f.get(k, 0) for f in tests.values()) for k in keys}
  print(header + "  (all tests)\n" + row("total", total))
  files = collections.defaultdict(lambda: collections.defaultdict(float))
  for name, f in tests.items():
    for k in keys:
      files[name.split("::")[0]][k] += f.get(k, 0)
  for title, table in (("files", files), ("tests", tests)):
    print(f"\n{header}  ({title} by compile time)")
    for name, f in sorted(table.items(), key=lambda kv: -kv[1].get("compile", 0))[:top]:
      print(row(name, f))
  print(f"\n{'compile':>8} {'count':>6}  (programs by compile time)")
  for name, (count, seconds) in sorted(programs.items(), key=lambda kv: -kv[1][1])[:top]:
    print(f"{seconds:8.1f} {count:6d}  {name}")


if __name__ == "__main__":
  _summary(sys.argv[1] if len(sys.argv) > 1 else ".")
