"""First answers of compositions of several entries of one kind, each in a fresh process.

A schedule of phases (sigma or q changing during training) or a ledger of events of one type is a
composition of k entries of one kind of model. Its accountant's program is traced and compiled
on its first answer; since 12-05 (stop 61) the entries of one kind are traced once and vmapped
over (``jaxacct.composition.map_entries`` / ``counted_sum``), so the program's size no longer
grows with k. This prints, per accountant and k, the first answer's seconds in a fresh process
with no compilation cache (import excluded), and the seconds JAX spent tracing and compiling
(its monitoring events). ``--against PATH`` runs another checkout of jaxacct beside this one,
alternated, on the same settings (k subsampled Gaussians, sigma 1.0, 1.1, ..., q 0.01, 1,000
steps each; delta 1e-6).

Run:  python benchmarks/bench_entries.py [--entries 1 4 8] [--accountants pld spa]
      [--against /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

ONE_RUN = """
import collections, json, sys, time
import jax
jax.config.update("jax_enable_x64", True)
from jax import monitoring
seconds = collections.Counter()
monitoring.register_event_duration_secs_listener(
    lambda name, duration, **_: seconds.update({name.rsplit("/", 1)[-1]: duration}))
import jaxacct
accountant, k = sys.argv[1], int(sys.argv[2])
entries = [(jaxacct.PoissonSampled(jaxacct.Gaussian(1.0 + 0.1 * j), 0.01), 1000) for j in range(k)]
start = time.perf_counter()
bounds = jaxacct.epsilon(jaxacct.Composition.of(*entries), 1e-6, accountant=accountant)
print(json.dumps(dict(seconds=time.perf_counter() - start, upper=float(bounds.upper),
                      module=jaxacct.__file__,
                      compile=seconds["backend_compile_duration"],
                      trace=seconds["jaxpr_trace_duration"])))
"""


HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout


def first_answer(accountant, k, checkout):
  """One fresh process's first answer on ``checkout``'s jaxacct (no compilation cache; run
  from a directory of its own, so that neither checkout is on the path by accident)."""
  env = dict(os.environ, JAXACCT_NO_CACHE="1", PYTHONPATH=checkout)
  with tempfile.TemporaryDirectory() as cwd:
    out = subprocess.run([sys.executable, "-c", ONE_RUN, accountant, str(k)], env=env,
                         cwd=cwd, check=True, capture_output=True, text=True).stdout
  row = json.loads(out.strip().splitlines()[-1])
  assert row["module"].startswith(checkout), (row["module"], checkout)
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--entries", type=int, nargs="+", default=[1, 2, 4, 8])
  parser.add_argument("--accountants", nargs="+", default=["pld", "spa", "edgeworth", "rdp"])
  parser.add_argument("--against", default=None, help="another checkout, run alternated")
  args = parser.parse_args()
  print(f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
  builds = [("this", HERE)] + ([("against", os.path.abspath(args.against))]
                              if args.against else [])
  print(f"{'accountant':10s} {'k':>3s} {'build':8s} {'first s':>8s} {'compile':>8s} "
        f"{'trace':>6s}  upper")
  for accountant in args.accountants:
    for k in args.entries:
      for name, checkout in builds:
        row = first_answer(accountant, k, checkout)
        print(f"{accountant:10s} {k:3d} {name:8s} {row['seconds']:8.2f} {row['compile']:8.2f} "
              f"{row['trace']:6.2f}  {row['upper']:.12g}", flush=True)


if __name__ == "__main__":
  main()
