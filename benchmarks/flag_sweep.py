"""Do the approximations' UNRELIABLE flags keep their promise? A broad DP-SGD sweep against the
certified PLD accountant.

What it measures. For every saddle-point method (clt, msd0, msd1) and Edgeworth order (order1..3)
on N random add/remove DP-SGD settings (Poisson-subsampled Gaussian; q = 1 is full-batch DP-GD):
the relative error of the estimate, |eps - eps_pld| / max(1, eps_pld), against jaxacct's
certified PLD accountant at a tight plan (eps_error 1e-3, 3e-3 where that plan's FFT would exceed
2^22 points; its estimate is within ~1e-5 of the truth, far inside its certified bracket); per
method: the fraction flagged UNRELIABLE (status bit 16), the median and max error, the max error
of an unflagged estimate (what the README promises), and whether every finite certified bound is
consistent with the PLD bracket (lower <= pld upper, upper >= pld lower: a miss is a bug).

How the settings are drawn (numpy seed ``SEED``, deterministic): sigma log-uniform in [0.5, 10],
q log-uniform in [1e-4, 1] except a tenth of the draws at q = 1 exactly, T log-uniform in
[1, 1e5] (rounded to an integer), delta log-uniform in [1e-10, 1e-3]. A draw is kept when its RDP
upper bound on epsilon lies in (1e-4, 50] (RDP bounds the truth from above, so every kept
setting has eps <= 50: larger ones are beyond what a DP-SGD user reports, and their PLD grids
are huge); draws are screened in one batch, and the first N kept are the sweep.

Where it stores. ``benchmarks/data/flag_sweep.csv``: the settings and their PLD references (the
slow part, ~30 min on a busy 2-core CPU, mostly compilation: one call per setting, the largest
grids first, sharing compiled programs through a ``SizeCache``); a later run reuses the file
when its settings match.
``benchmarks/data/flag_sweep.json``: the summary table per method (and the worst settings).

Run (from the repository root):
    python benchmarks/flag_sweep.py                  # references (cached) + the table
    python benchmarks/flag_sweep.py --settings 40    # a quick check on fewer settings
    python benchmarks/flag_sweep.py --recompute      # redo the PLD references
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "data"
REFERENCES = DATA / "flag_sweep.csv"
SUMMARY = DATA / "flag_sweep.json"
SEED = 29
SETTINGS = 600
CANDIDATES = 6000
FULL_BATCH_SHARE = 0.1
SIGMA_RANGE, Q_RANGE, STEPS_RANGE, DELTA_RANGE = (0.5, 10.0), (1e-4, 1.0), (1.0, 1e5), (1e-10, 1e-3)
EPS_SCREEN = (1e-4, 50.0)
EPS_ERRORS = (1e-3, 3e-3)  # the tight plan, and the one used where its FFT exceeds MAX_FFT
MAX_FFT = 2**22
PROGRESS_EVERY = 20
UNRELIABLE = 16  # jaxacct.results.UNRELIABLE
METHODS = [("spa", m) for m in ("clt", "msd0", "msd1")] + [
    ("edgeworth", m) for m in ("order1", "order2", "order3")]
FIELDS = ("sigma", "q", "steps", "delta", "eps_error", "lower", "estimate", "upper", "status")


def log_uniform(rng, low, high, size):
  return 10.0 ** rng.uniform(math.log10(low), math.log10(high), size)


def candidates(n, seed=SEED):
  """``n`` raw draws (sigma, q, steps, delta) as float64 arrays."""
  rng = np.random.default_rng(seed)
  sigma = log_uniform(rng, *SIGMA_RANGE, n)
  q = np.where(rng.uniform(size=n) < FULL_BATCH_SHARE, 1.0, log_uniform(rng, *Q_RANGE, n))
  steps = np.round(log_uniform(rng, *STEPS_RANGE, n))
  delta = log_uniform(rng, *DELTA_RANGE, n)
  return sigma, q, steps, delta


def split_call(jaxacct, sigma, q, steps, delta, **options):
  """``dpsgd_epsilon`` on a batch as two vectorised calls, q < 1 and q = 1 (full batch is a
  different model): (lower, estimate, upper, status) as numpy arrays."""
  out = [np.full(sigma.shape, np.nan) for _ in range(3)] + [np.zeros(sigma.shape, np.int64)]
  for full in (False, True):
    index = np.flatnonzero((q == 1.0) == full)
    if index.size:
      r = jaxacct.dpsgd_epsilon(sigma[index], q[index], steps[index], delta[index], **options)
      for column, value in zip(out, (r.lower, r.estimate, r.upper, r.status)):
        column[index] = np.asarray(value)
  return out


def draw_settings(jaxacct, n):
  """The first ``n`` candidates whose RDP upper epsilon lies in EPS_SCREEN, as a dict of arrays."""
  sigma, q, steps, delta = candidates(CANDIDATES)
  rdp = split_call(jaxacct, sigma, q, steps, delta, accountant="rdp")[2]
  keep = np.flatnonzero((rdp > EPS_SCREEN[0]) & (rdp <= EPS_SCREEN[1]))[:n]
  if keep.size < n:
    raise SystemExit(f"only {keep.size} of {CANDIDATES} candidates passed the screen")
  return dict(sigma=sigma[keep], q=q[keep], steps=steps[keep], delta=delta[keep])


def own_plan(jaxacct, s, cache=None):
  """(eps_error, plan) of one setting: the tightest of EPS_ERRORS whose FFT fits MAX_FFT."""
  for eps_error in EPS_ERRORS:
    try:
      plan = jaxacct.dpsgd_plan(*s, eps_error=eps_error, size_cache=cache)
    except ValueError:
      continue
    if plan.fft_size <= MAX_FFT or eps_error == EPS_ERRORS[-1]:
      return eps_error, plan
  return None, None


def references(jaxacct, settings, progress=None):
  """PLD reference rows (dicts of FIELDS), one call per setting at its own plan, largest grid
  first, sharing one ``SizeCache`` (a later, smaller setting reuses a compiled program up to 2x
  its size instead of compiling its own); the rows done so far are written to ``progress``
  every PROGRESS_EVERY settings."""
  import jax
  from tqdm import tqdm
  n = settings["sigma"].size
  points = [tuple(float(settings[k][i]) for k in ("sigma", "q", "steps", "delta"))
            for i in range(n)]
  own = [own_plan(jaxacct, s) for s in points]
  size = lambda i: (0, 0) if own[i][1] is None else (own[i][1].fft_size, own[i][1].per_step_size)
  order = sorted(range(n), key=lambda i: (points[i][1] == 1.0, tuple(-x for x in size(i))))
  cache = jaxacct.SizeCache()
  rows = [None] * n
  for done, i in enumerate(tqdm(order, desc="pld references", mininterval=10.0)):
    eps_error, plan = own_plan(jaxacct, points[i], cache)
    row = dict(zip(("sigma", "q", "steps", "delta"), points[i]), eps_error=eps_error)
    if plan is None:
      rows[i] = dict(row, eps_error=math.nan, lower=math.nan, estimate=math.nan, upper=math.nan,
                     status=-1)
    else:
      r = jax.block_until_ready(jaxacct.dpsgd_epsilon(*points[i], plan=plan))
      rows[i] = dict(row, lower=float(r.lower), estimate=float(r.estimate),
                     upper=float(r.upper), status=int(r.status))
    if progress is not None and done % PROGRESS_EVERY == 0:
      write_references(progress, [row for row in rows if row is not None])
  return rows


def read_references(path):
  with open(path, newline="") as f:
    return [{k: (int(v) if k == "status" else float(v)) for k, v in row.items()}
            for row in csv.DictReader(f)]


def write_references(path, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=FIELDS)
    writer.writeheader()
    for row in rows:
      writer.writerow({k: (row[k] if k == "status" else repr(float(row[k]))) for k in FIELDS})


def same_settings(rows, settings):
  keys = ("sigma", "q", "steps", "delta")
  return len(rows) == settings["sigma"].size and all(
      np.array_equal(np.array([r[k] for r in rows]), settings[k]) for k in keys)


def evaluate(jaxacct, rows):
  """Per method: the arrays of the approximation's fields on the usable rows."""
  from tqdm import tqdm
  column = lambda k: np.array([r[k] for r in rows], np.float64)
  args = [column(k) for k in ("sigma", "q", "steps", "delta")]
  return {(name, method): split_call(jaxacct, *args, accountant=name, method=method)
          for name, method in tqdm(METHODS, desc="approximations")}


def relative_error(estimate, truth):
  """|estimate - truth| / max(1, truth); inf where the estimate is not finite."""
  return np.where(np.isfinite(estimate), np.abs(estimate - truth) / np.maximum(1.0, truth),
                  np.inf)


def summarise(rows, fields):
  """One dict per method: counts, errors, flags and bound checks against the PLD bracket."""
  truth = np.array([r["estimate"] for r in rows])
  pld_lower = np.array([r["lower"] for r in rows])
  pld_upper = np.array([r["upper"] for r in rows])
  lower, estimate, upper, status = fields
  error = relative_error(estimate, truth)
  flagged = (status & UNRELIABLE) != 0
  unflagged = error[~flagged]
  has_lo, has_up = np.isfinite(lower), np.isfinite(upper)
  lo_ok = ~has_lo | (lower <= pld_upper)
  up_ok = ~has_up | (upper >= pld_lower)
  worst = np.flatnonzero(~flagged)[np.argsort(-unflagged)[:3]] if unflagged.size else []
  decade = np.minimum(np.floor(np.log10([r["steps"] for r in rows])), 4).astype(int)
  return dict(
      settings=int(truth.size), flagged=float(np.mean(flagged)),
      median_error=float(np.median(error)), max_error=float(np.max(error)),
      max_unflagged_error=float(unflagged.max(initial=0.0)),
      unflagged=int(unflagged.size),
      unflagged_over_1e_3=int(np.sum(unflagged > 1e-3)),
      finite_lower=int(np.sum(has_lo)), finite_upper=int(np.sum(has_up)),
      lower_holds=int(np.sum(has_lo & lo_ok)), upper_holds=int(np.sum(has_up & up_ok)),
      bounds_hold=bool(np.all(lo_ok & up_ok)),
      flagged_by_decade={f"T 1e{k}..1e{k + 1}": float(np.mean(flagged[decade == k]))
                         for k in range(5) if np.any(decade == k)},
      worst_unflagged=[dict(sigma=rows[i]["sigma"], q=rows[i]["q"], steps=rows[i]["steps"],
                            delta=rows[i]["delta"], truth=float(truth[i]),
                            estimate=float(estimate[i]), error=float(error[i]),
                            status=int(status[i])) for i in worst])


def table(summary):
  lines = ["| accountant | method | settings | flagged | median error | max error | "
           "max unflagged error (unflagged) | finite lower / upper that hold |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for (name, method), s in summary.items():
    lines.append(
        f"| {name} | {method} | {s['settings']} | {s['flagged']:.0%} | "
        f"{s['median_error']:.1e} | {s['max_error']:.2g} | "
        f"{s['max_unflagged_error']:.1e} ({s['unflagged']}) | "
        f"{s['lower_holds']}/{s['finite_lower']}, {s['upper_holds']}/{s['finite_upper']} |")
  return "\n".join(lines)


def decade_table(summary):
  """The fraction flagged per decade of T (the approximations improve with T)."""
  decades = list(next(iter(summary.values()))["flagged_by_decade"])
  lines = ["| accountant | method | " + " | ".join(decades) + " |",
           "| --- | --- |" + " --- |" * len(decades)]
  for (name, method), s in summary.items():
    lines.append(f"| {name} | {method} | "
                 + " | ".join(f"{s['flagged_by_decade'][d]:.0%}" for d in decades) + " |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--settings", type=int, default=SETTINGS,
                      help=f"number of settings ({SETTINGS})")
  parser.add_argument("--recompute", action="store_true", help="redo the PLD references")
  parser.add_argument("--references", type=pathlib.Path, default=REFERENCES)
  parser.add_argument("--summary", type=pathlib.Path, default=SUMMARY)
  args = parser.parse_args()

  sys.path.insert(0, str(ROOT))
  import jax
  import jaxacct
  jax.config.update("jax_enable_x64", True)
  start = time.perf_counter()
  print(f"jax {jax.__version__}, cpus {os.cpu_count()}, load {os.getloadavg()}")
  settings = draw_settings(jaxacct, args.settings)
  rows = None
  if args.references.exists() and not args.recompute:
    rows = read_references(args.references)
    if not same_settings(rows, settings):
      print(f"{args.references} holds other settings: recomputing")
      rows = None
  if rows is None:
    partial = args.references.with_suffix(".partial.csv")
    rows = references(jaxacct, settings, partial)
    write_references(args.references, rows)
    partial.unlink(missing_ok=True)
  usable = [r for r in rows if r["status"] == 0 and np.isfinite(r["estimate"])]
  print(f"{len(usable)} of {len(rows)} settings have a clean PLD reference "
        f"(eps_error 1e-3: {sum(r['eps_error'] == 1e-3 for r in usable)}); "
        f"eps {min(r['estimate'] for r in usable):.2g}..{max(r['estimate'] for r in usable):.3g}, "
        f"PLD half-width median "
        f"{np.median([(r['upper'] - r['lower']) / 2 for r in usable]):.1e}")
  fields = evaluate(jaxacct, usable)
  summary = {key: summarise(usable, f) for key, f in fields.items()}
  print(table(summary))
  print("\nFlagged UNRELIABLE, per decade of T:\n")
  print(decade_table(summary))
  for (name, method), s in summary.items():
    for w in s["worst_unflagged"][:1]:
      print(f"  worst unflagged {name} {method}: {w}")
  args.summary.write_text(json.dumps(
      dict(seed=SEED, settings=len(usable), reference="jaxacct pld estimate (certified bracket)",
           error="|estimate - pld| / max(1, pld)",
           methods={f"{n}/{m}": s for (n, m), s in summary.items()}), indent=1) + "\n")
  print(f"wrote {args.summary} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
  main()
