"""Accuracy and speed of every jaxacct accountant on the stored DP-SGD reference settings.

What it measures. For each single-entry, add/remove, Poisson-subsampled Gaussian setting
(sigma, q, T, delta) of ``tests/data/references.json`` it calls the front door
``jaxacct.dpsgd_epsilon(sigma, q, T, delta, accountant=A, method=M)`` for every accountant A of
``jaxacct.api.ACCOUNTANTS`` and each of its methods M (read at run time, so an accountant added
there appears here; today pld, spa/clt, spa/msd0, spa/msd1, rdp and gdp; the method column is
"-" for an accountant with a single method), and compares the result with the truth:

* truth = the file's ``reference`` field by default (dp-accounting's fine PLD, Richardson-
  extrapolated from its 2e-5 and 1e-5 grids; every stored value lies in prv-accountant's bracket),
  or ``--truth dpa_1e5`` for dp-accounting's finest grid as is (a pessimistic value). Caveat:
  where dp-accounting's value grows under refinement (large epsilon) the extrapolated reference
  lies above both of its certified upper values, by up to ~1e-4, so exact or tight upper bounds
  can "miss" it by that much without being wrong (the miss list says whether a miss is provable).
* relative error |estimate - truth| / max(1, truth): median and max;
* under-reports: fraction of settings with estimate < truth (strictly);
* bounds hold: among settings with at least one finite certified bound, the fraction where every
  finite bound holds, lower <= truth + tol and upper >= truth - tol, with tol = |dpa_2e5 - dpa_1e5|
  + 1e-9 max(1, truth) (the reference's own discretisation spread); every miss at tol = 0 is also
  listed below the table, with whether it is provable (lower > min(dpa_2e5, dpa_1e5), a certified
  upper bound of the truth, or upper < prv-accountant's certified lower bound);
* UNRELIABLE: fraction with status bit 16 ("-" for pld, rdp and gdp, which never set it);
* warm time per setting: pld is called one setting at a time (each plan has its own grid sizes,
  so it compiles per distinct plan), a cold pass then a timed warm pass, median per call; the
  CGF accountants run as one batched call per model kind (q < 1: subsampled; q = 1: Gaussian),
  so each compiles once per kind, and the warm time is the second batched call / settings.

A second small table gives the median relative error per decade of T, per method.

T above 10^5 is absent from the file, so a third table runs six settings at T = 10^6
(q in {1e-3, 1e-4}, sigma in {0.8, 1, 2}, delta 1e-5) for every accountant but pld against its
certified pld accountant. Each pld reference runs in a child process and is skipped when it takes
longer than ``--pld-timeout`` seconds (60). There the truth is pld's estimate, and "bounds hold"
means the certified intervals overlap (tol = pld's half-bracket on the relevant side).

``--references sweep`` instead reads ``benchmarks/data/sweep_references.json`` (made by
``benchmarks/sweep_references.py``: ~60 settings spread evenly over log10 T in [1, 6], q 1e-4..1,
sigma 0.5..10, delta 1e-10..1e-3, eps <= 50, each with jaxacct's certified pld bracket at
eps_error 1e-3, or 1e-2 where that was too slow). There the truth is the stored pld estimate
and "bounds hold" means every finite certified bound of an accountant is consistent with pld's
certified bracket: lower <= pld upper and upper >= pld lower (a miss beyond that is provable,
i.e. a bug). pld itself is not run (it is the reference) and neither is the T = 10^6 table.

Run (from the repository root):
    python benchmarks/compare_accountants.py              # everything: ~15 min on a busy 2-core
                                                          # CPU, ~12 of them pld compilations
    python benchmarks/compare_accountants.py --limit 5    # a quick check on the first 5 settings
    python benchmarks/compare_accountants.py --skip-large # without the T = 10^6 table
    python benchmarks/compare_accountants.py --references sweep   # the broad sweep, no pld
    python benchmarks/compare_accountants.py --accountants spa,rdp --skip-large  # a subset
    python benchmarks/compare_accountants.py --jaxacct-root DIR   # measure the jaxacct in DIR
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import queue
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
REFERENCE_FILE = ROOT / "tests" / "data" / "references.json"
SWEEP_FILE = ROOT / "benchmarks" / "data" / "sweep_references.json"
UNRELIABLE = 16  # jaxacct.results.UNRELIABLE (kept literal: the bit the table reports)
NO_RELIABILITY_FLAG = ("pld", "rdp", "gdp")  # accountants that never set UNRELIABLE
LARGE_STEPS = 10**6
LARGE_RATES = (1e-3, 1e-4)
LARGE_SIGMAS = (0.8, 1.0, 2.0)
LARGE_DELTA = 1e-5
CHILD_STARTUP_SECONDS = 30.0  # allowance for a child's import of jax before its first setting


def load_settings(truth_key, limit):
  """Single-entry add/remove settings of the reference file, as dicts."""
  rows = json.loads(REFERENCE_FILE.read_text())
  out = []
  for row in rows:
    if row["relation"] != "add_remove" or len(row["entries"]) != 1:
      continue
    sigma, rate, steps = row["entries"][0]
    truth = row[truth_key]
    out.append(dict(
        sigma=float(sigma), q=float(rate), T=int(steps), delta=float(row["delta"]),
        truth=float(truth),
        tol=abs(row["dpa_2e5"] - row["dpa_1e5"]) + 1e-9 * max(1.0, truth),
        certified_above=min(row["dpa_2e5"], row["dpa_1e5"]),
        certified_below=row.get("prv_lower", -math.inf)))
  return out if limit is None else out[:limit]


def load_sweep(limit):
  """Kept settings of the sweep file; truth = pld's estimate, certified by [lower, upper]."""
  rows = [row for row in json.loads(SWEEP_FILE.read_text()) if row["dropped"] is None]
  out = [dict(sigma=row["sigma"], q=row["q"], T=int(row["steps"]), delta=row["delta"],
              truth=row["estimate"], tol=0.0, certified_above=row["upper"],
              certified_below=row["lower"], eps_error=row["eps_error"]) for row in rows]
  return out if limit is None else out[:limit]


def accountant_pairs(include_pld=True, only=None):
  """(accountant, method) for every accountant of jaxacct.api.ACCOUNTANTS (or those named in
  ``only``) and each of its methods, in their order; method None (the default) for an
  accountant with a single method."""
  from jaxacct.api import ACCOUNTANTS
  pairs = []
  for name, (_, methods) in ACCOUNTANTS.items():
    if (name == "pld" and not include_pld) or (only and name not in only):
      continue
    pairs += [(name, None)] if len(methods) == 1 else [(name, m) for m in methods]
  return pairs


def settings_label(s):
  return f"sigma={s['sigma']:.6g}, q={s['q']:.6g}, T={s['T']}, delta={s['delta']:.6g}"


def block(result):
  import jax
  return jax.block_until_ready(result)


def as_arrays(result):
  return (np.asarray(result.lower, np.float64), np.asarray(result.estimate, np.float64),
          np.asarray(result.upper, np.float64), np.asarray(result.status, np.int64))


def run_pld_loop(jaxacct, settings):
  """pld one setting at a time: a cold pass (compiles), then a timed warm pass."""
  for s in settings:
    block(jaxacct.dpsgd_epsilon(s["sigma"], s["q"], s["T"], s["delta"]))
  fields, times = [], []
  for s in settings:
    start = time.perf_counter()
    result = block(jaxacct.dpsgd_epsilon(s["sigma"], s["q"], s["T"], s["delta"]))
    times.append(time.perf_counter() - start)
    fields.append([float(x) for x in as_arrays(result)])
  lower, estimate, upper, status = (np.array(col) for col in zip(*fields))
  return (lower, estimate, upper, status.astype(np.int64)), statistics.median(times)


def run_batched(jaxacct, settings, accountant, method):
  """A CGF accountant as one batched call per model kind (cold, then a timed warm call)."""
  n = len(settings)
  lower, estimate, upper = (np.full(n, np.nan) for _ in range(3))
  status = np.zeros(n, np.int64)
  warm = 0.0
  for full_batch in (False, True):
    index = np.array([i for i, s in enumerate(settings) if (s["q"] == 1.0) == full_batch], int)
    if index.size == 0:
      continue
    args = [np.array([settings[i][key] for i in index], np.float64)
            for key in ("sigma", "q", "T", "delta")]
    call = lambda: block(jaxacct.dpsgd_epsilon(*args, accountant=accountant, method=method))
    call()
    start = time.perf_counter()
    result = call()
    warm += time.perf_counter() - start
    lower[index], estimate[index], upper[index], status[index] = as_arrays(result)
  return (lower, estimate, upper, status), warm / n


def summarise(name, settings, fields, seconds, truth_above=None, truth_below=None):
  """One table row plus the list of strict bound misses.

  ``truth_above`` / ``truth_below``: per-setting tolerances for the lower / upper bound checks.
  """
  lower, estimate, upper, status = fields
  truth = np.array([s["truth"] for s in settings])
  tol_lo = np.array([s["tol"] for s in settings]) if truth_above is None else truth_above
  tol_up = tol_lo if truth_below is None else truth_below
  scale = np.maximum(1.0, truth)
  rel = np.where(np.isfinite(estimate), np.abs(estimate - truth) / scale, np.inf)
  under = estimate < truth
  has_lo, has_up = np.isfinite(lower), np.isfinite(upper)
  checked = has_lo | has_up
  ok_lo = ~has_lo | (lower <= truth + tol_lo)
  ok_up = ~has_up | (upper >= truth - tol_up)
  holds = ok_lo & ok_up
  misses = []
  for i in np.flatnonzero(checked & ((has_lo & (lower > truth)) | (has_up & (upper < truth)))):
    s = settings[i]
    side, bound = ("lower", lower[i]) if has_lo[i] and lower[i] > truth[i] else ("upper", upper[i])
    provable = (bound > s["certified_above"] if side == "lower" else bound < s["certified_below"])
    tol = (tol_lo if side == "lower" else tol_up)[i]
    misses.append(f"{name}: {side} {bound:.10g} vs truth {truth[i]:.10g} "
                  f"(miss {abs(bound - truth[i]):.2e}, tol {tol:.2e}"
                  f", within tol: {bool(holds[i])}, provable: {bool(provable)}; "
                  f"[{lower[i]:.10g}, {estimate[i]:.10g}, {upper[i]:.10g}] status {status[i]}) "
                  f"at {settings_label(s)}")
  accountant, method = name.split("/")
  cells = [accountant, method, str(len(settings))]
  nonfinite = int(np.sum(~np.isfinite(estimate)))
  if nonfinite:
    cells[2] += f" ({nonfinite} non-finite)"
  cells += [f"{np.median(rel):.2e}", f"{np.max(rel):.2e}", f"{np.mean(under):.2f}"]
  if np.any(checked):
    cells += [f"{np.sum(holds & checked)}/{np.sum(checked)} = {np.mean(holds[checked]):.2f}",
              f"{np.sum(has_lo)}/{np.sum(has_up)}"]
  else:
    cells += ["n/a (no finite bound)", "0/0"]
  cells.append("-" if accountant in NO_RELIABILITY_FLAG
               else f"{np.mean((status & UNRELIABLE) != 0):.2f}")
  cells.append(f"{1e3 * seconds:.2f}")
  return "| " + " | ".join(cells) + " |", misses, rel


HEADER = ("| accountant | method | settings | median rel err | max rel err | under-reports | "
          "bounds hold | finite lower/upper | UNRELIABLE | warm ms/setting |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def decade_table(settings, errors):
  """Median relative error per decade of T (columns) per method (rows), as markdown.

  ``errors``: list of (name, per-setting relative errors) in table order."""
  decades = np.floor(np.log10([s["T"] for s in settings]) + 1e-12).astype(int)
  present = sorted(set(decades.tolist()))
  lines = ["| accountant/method | " + " | ".join(
               f"T 10^{k}..10^{k + 1} ({np.sum(decades == k)})" for k in present) + " |",
           "| --- |" + " --- |" * len(present)]
  for name, rel in errors:
    lines.append(f"| {name} | " + " | ".join(f"{np.median(rel[decades == k]):.1e}"
                                             for k in present) + " |")
  return "\n".join(lines)


def print_ranges(settings):
  for key, fmt in (("q", ".3g"), ("sigma", ".3g"), ("T", "d"), ("delta", ".2e")):
    values = [s[key] for s in settings]
    print(f"  {key}: {min(values):{fmt}} .. {max(values):{fmt}}")


# ---------------------------------------------------------------------------------------------
# T = 10^6: pld references in a child process (so a slow one can be stopped)


def child_main(payload, jaxacct_root):
  sys.path.insert(0, jaxacct_root)
  import jaxacct
  for sigma, rate, steps, delta in json.loads(payload):
    start = time.perf_counter()
    result = block(jaxacct.dpsgd_epsilon(sigma, rate, steps, delta))
    seconds = time.perf_counter() - start
    lower, estimate, upper, status = (float(x) for x in as_arrays(result))
    print(json.dumps(dict(lower=lower, estimate=estimate, upper=upper, status=int(status),
                          seconds=seconds)), flush=True)


def pld_references(cases, timeout, jaxacct_root):
  """pld (lower, estimate, upper, status, seconds) per case, or None when it exceeded timeout."""
  out, pending = [], list(cases)
  while pending:
    proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(pending),
                             "--jaxacct-root", jaxacct_root], stdout=subprocess.PIPE, text=True)
    lines = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True)
    reader.start()
    first = True
    while pending:
      try:
        line = lines.get(timeout=timeout + (CHILD_STARTUP_SECONDS if first else 0.0))
      except queue.Empty:
        line = None
      first = False
      if line is None:
        proc.kill()
        proc.wait()
        out.append(None)
        pending.pop(0)
        break
      out.append(json.loads(line))
      pending.pop(0)
    else:
      proc.wait()
  return out


def run_large(jaxacct, timeout, jaxacct_root, only=None):
  cases = [(sigma, rate, LARGE_STEPS, LARGE_DELTA) for rate in LARGE_RATES
           for sigma in LARGE_SIGMAS]
  print(f"\n## T = 10^6 against jaxacct's pld (delta {LARGE_DELTA:g}, pld timeout {timeout:g} s)\n")
  refs = pld_references(cases, timeout, jaxacct_root)
  settings, above, below = [], [], []
  for (sigma, rate, steps, delta), ref in zip(cases, refs):
    label = f"sigma={sigma:g}, q={rate:g}, T={steps}, delta={delta:g}"
    if ref is None:
      print(f"  pld SKIPPED (over {timeout:g} s): {label}")
      continue
    print(f"  pld [{ref['lower']:.6f}, {ref['estimate']:.6f}, {ref['upper']:.6f}] status "
          f"{ref['status']} in {ref['seconds']:.1f} s (cold, incl. compilation): {label}")
    settings.append(dict(sigma=sigma, q=rate, T=steps, delta=delta, truth=ref["estimate"],
                         tol=0.0, certified_above=ref["upper"], certified_below=ref["lower"]))
    above.append(ref["upper"] - ref["estimate"])
    below.append(ref["estimate"] - ref["lower"])
  if not settings:
    print("  no pld reference finished: no table")
    return []
  rows, misses = [], []
  for accountant, method in accountant_pairs(include_pld=False, only=only):
    fields, seconds = run_batched(jaxacct, settings, accountant, method)
    row, miss, _ = summarise(f"{accountant}/{method or '-'}", settings, fields, seconds,
                             np.array(above), np.array(below))
    rows.append(row)
    misses += miss
  print("\n" + HEADER)
  print("\n".join(rows))
  return misses


# ---------------------------------------------------------------------------------------------


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--limit", type=int, default=None, help="run only the first N settings")
  parser.add_argument("--truth", choices=("reference", "dpa_1e5"), default="reference",
                      help="which stored value is the truth (default: reference)")
  parser.add_argument("--references", choices=("stored", "sweep"), default="stored",
                      help="stored: tests/data/references.json (default); sweep: "
                           "benchmarks/data/sweep_references.json against its pld brackets")
  parser.add_argument("--skip-large", action="store_true", help="skip the T = 10^6 table")
  parser.add_argument("--accountants", default=None,
                      help="comma-separated accountants to run (default: all), e.g. spa,rdp")
  parser.add_argument("--pld-timeout", type=float, default=60.0,
                      help="seconds allowed per T = 10^6 pld reference (default 60)")
  parser.add_argument("--jaxacct-root", default=str(ROOT),
                      help="directory holding the jaxacct package to measure (default: this "
                           "checkout; e.g. a frozen copy from `git archive HEAD jaxacct`)")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child is not None:
    child_main(args.child, args.jaxacct_root)
    return

  sys.path.insert(0, args.jaxacct_root)
  start_all = time.perf_counter()
  import jax
  import jaxacct

  sweep = args.references == "sweep"
  print(f"jax {jax.__version__}, cpus {os.cpu_count()}, load {os.getloadavg()}")
  if sweep:
    settings = load_sweep(args.limit)
    # pld's certified bracket is the tolerance: a lower bound must stay <= pld upper, an upper
    # bound >= pld lower.
    above = np.array([s["certified_above"] - s["truth"] for s in settings])
    below = np.array([s["truth"] - s["certified_below"] for s in settings])
    half = 0.5 * (above + below)
    print(f"{len(settings)} settings from {SWEEP_FILE.relative_to(ROOT)} (truth: jaxacct pld "
          f"estimate; eps_error 1e-3 for "
          f"{sum(s['eps_error'] == 1e-3 for s in settings)}, 1e-2 for the rest; bracket "
          f"half-width median {np.median(half):.1e}, max {np.max(half):.1e}); ranges:")
  else:
    settings = load_settings(args.truth, args.limit)
    above = below = None
    print(f"{len(settings)} single-entry add/remove settings from "
          f"{REFERENCE_FILE.relative_to(ROOT)} (truth: {args.truth!r}); ranges:")
  print_ranges(settings)

  rows, misses, errors = [], [], []
  only = args.accountants.split(",") if args.accountants else None
  for accountant, method in accountant_pairs(include_pld=not sweep, only=only):
    begin = time.perf_counter()
    name = f"{accountant}/{method or '-'}"
    if accountant == "pld":
      fields, seconds = run_pld_loop(jaxacct, settings)
    else:
      fields, seconds = run_batched(jaxacct, settings, accountant, method)
    row, miss, rel = summarise(name, settings, fields, seconds, above, below)
    rows.append(row)
    misses += miss
    errors.append((name, rel))
    print(f"  {name} done in {time.perf_counter() - begin:.1f} s (cold + warm)", flush=True)
  print("\n## Sweep references (truth: jaxacct pld)\n" if sweep else "\n## Stored references\n")
  print(HEADER)
  print("\n".join(rows))
  print("\nMedian relative error per decade of T (settings per decade in brackets):\n")
  print(decade_table(settings, errors))

  if not args.skip_large and not sweep:
    misses += run_large(jaxacct, args.pld_timeout, args.jaxacct_root, only)

  print("\nBound misses at tol = 0 (a provable one would be a bug):")
  print("\n".join("  " + m for m in misses) if misses else "  none")
  print(f"\ntotal wall time {time.perf_counter() - start_all:.1f} s")


if __name__ == "__main__":
  main()
