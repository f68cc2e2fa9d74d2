"""How long JAX traces the calibration's programs, beside their lowering and XLA compile.

Tracing is the part of a cold first answer that the persistent compilation cache does not skip:
a process with a warm cache still traces every program it runs (only the front door's PLD
programs and the calibration's reads are exported, ``jaxacct._exported``). This script runs two
calibrations in a fresh process with jaxacct's cache off and prints, for every program compiled,
the seconds JAX spent tracing it, lowering it and compiling it:

* a batch of 12 PLD targets (epsilon 0.5 to 8, delta 1e-5, q = 0.01, T = 1000): the
  saddle-point start, the certified search and the front door's check;
* the calibration notebook's grid: ``jit(vmap(value_and_grad))`` of a saddle-point calibration
  over 32 step counts (the gradient through the search's implicit root)::

    python benchmarks/trace_calibration.py
    PYTHONPATH=/path/to/other/checkout python benchmarks/trace_calibration.py   # A/B, from /tmp
"""

import collections
import os
import time

os.environ["JAXACCT_NO_CACHE"] = "1"  # (a program read from the cache is traced, not compiled)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxacct  # noqa: E402
from jaxacct import calibrate  # noqa: E402

jax.config.update("jax_enable_x64", True)

_PHASES = {"jaxpr_trace_duration": "trace", "jaxpr_to_mlir_module_duration": "lower",
           "backend_compile_duration": "compile"}
_events = []


def _listen(event, seconds, fun_name=None, **_):
  phase = _PHASES.get(event.rsplit("/", 1)[-1])
  if phase:
    _events.append((phase, fun_name, seconds))


def _programs():
  """[program, {phase: seconds}] of the events since the last call, in compile order."""
  rows, current = [], None
  for phase, name, seconds in _events:
    if phase == "trace" or current is None:
      current = collections.defaultdict(float)
      rows.append((name, current))
    current[phase] += seconds
  _events.clear()
  return rows


def _report(label, call):
  start = time.perf_counter()
  jax.block_until_ready(call())
  wall = time.perf_counter() - start
  rows = _programs()
  print(f"{label}: {wall:.1f} s in all")
  for name, phases in rows:
    print(f"  {str(name):<22}" + "".join(f"{p} {phases[p]:6.2f} s   " for p in _PHASES.values()))
  total = lambda phase: sum(phases[phase] for _, phases in rows)
  print(f"  {'total':<22}" + "".join(f"{p} {total(p):6.2f} s   " for p in _PHASES.values()))


def _log_risk(log_steps, epochs=10, size=60_000, dim=100_000):
  """The calibration notebook's objective: log of the excess-risk bound at T = e^log_steps."""
  steps = jnp.exp(log_steps)
  rate = epochs / steps
  sigma = calibrate.noise_multiplier(2.0, 1e-5, rate, steps, accountant="spa")
  return 0.5 * jnp.log((1.0 + dim * sigma**2 / (rate * size) ** 2) / steps)


def main():
  jax.monitoring.register_event_duration_secs_listener(_listen)
  print(f"jaxacct {jaxacct.__version__} from {os.path.dirname(jaxacct.__file__)}, jax "
        f"{jax.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
  targets = np.geomspace(0.5, 8.0, 12)
  _report("12 PLD targets (q 0.01, T 1000)",
          lambda: calibrate.noise_multiplier(targets, 1e-5, 0.01, 1000))
  grid = np.log(np.geomspace(20.0, 150_000.0, 32))  # (numpy: no program of its own)
  risk_and_slope = jax.jit(jax.vmap(jax.value_and_grad(_log_risk)))
  _report("saddle-point gradient grid (32 settings)", lambda: risk_and_slope(grid))


if __name__ == "__main__":
  main()
