"""Reference epsilons for a broad DP-SGD sweep, from jaxacct's certified PLD accountant.

What it produces. ``benchmarks/data/sweep_references.json``: single-entry, add/remove,
Poisson-subsampled Gaussian settings (noise sigma, rate q, steps T, delta) spread evenly over
log10 T in [1, 6], each with jaxacct's certified PLD bracket at a tight plan, for
``compare_accountants.py --references sweep`` (the issue's ">= 50 DP-SGD settings, q 1e-4..1,
sigma 0.5..10, T 10..10^6, delta 1e-10..1e-3, eps <= 50").

How the settings are drawn (numpy seed ``SEED``, fully deterministic):

* each decade [10^k, 10^(k+1)), k = 1..5, gets ``--per-decade`` settings (12 by default, 60 in
  all); within a decade log10 T is uniform, T rounded to an integer;
* q log-uniform in [1e-4, 1], sigma log-uniform in [0.5, 10], delta log-uniform in
  [1e-10, 1e-3];
* q = 1 exactly (full-batch DP-GD) for a sixth of the settings of decades 1-3 (2 of 12 each,
  10 % of all), from their own random streams. Not above: at sigma <= 10, eps <= 50 needs
  sqrt(T) / sigma below ~8, impossible for T >= 10^4 (a first run that drew q = 1 with
  probability 0.1 in every decade kept none, as the screen rejected them all);
* the issue restricts to eps <= 50, and a cheap screen rejects a draw whose estimated epsilon
  is > 50 or <= 1e-6 (saddle-point "clt" estimate for q < 1, the exact Gaussian-DP value for
  q = 1) and draws again. This is rejection sampling of the issue's distribution conditioned on
  0 < eps <= 50; without it the top decades would keep few settings (most large-T, large-q draws
  have eps in the thousands). The screen only chooses which settings get a reference: a setting
  is kept only if the PLD reference itself has 1e-6 < upper and estimate <= 50.

The reference. ``jaxacct.dpsgd_epsilon(sigma, q, T, delta, eps_error=1e-3)`` (certified
[lower, upper], half-width ~1e-3), each in its own child process: when it runs longer than
``--timeout`` seconds (60) or fails (e.g. its plan is refused as too large), it is retried
with eps_error = 1e-2 (``--timeout-coarse``, 180 s); a setting where that also fails is recorded
as dropped, with the reasons in ``attempts``. ``eps_error`` and ``seconds`` (cold: includes
planning and compilation) are stored.

Cross-check. Where T <= 2e4, dp-accounting's PLD accountant (value_discretization_interval 1e-4,
PoissonSampledDpEvent(q, GaussianDpEvent(sigma)) self-composed T times, ADD_OR_REMOVE_ONE)
runs in a child process with a 30 s limit. Its epsilon is pessimistic by up to about its grid
(1e-4 per step in loss, ~1e-3 max(1, eps) in epsilon), so it must lie in jaxacct's bracket
widened by tol = 1e-3 max(1, eps); ``dpa_in_bracket`` is that test, ``dpa_in_strict`` the one at
tol = 0. Where it fails, dp-accounting runs again at interval 1e-6 (``dpa_fine``; tol
1e-5 max(1, eps), ``dpa_fine_in_bracket``): its 1e-4 grid is too coarse for eps of a few 1e-3
(the rounding of each step's loss adds up over T steps). A value outside the bracket at the
fine grid too would be a bug in one of the two accountants (below the lower bound: certainly,
as dp-accounting's value is pessimistic).

File format: a JSON list of dicts, one per setting that reached the PLD stage, with sigma, q,
steps, delta, lower, estimate, upper, status, eps_error, seconds, dpa (null when not run),
dpa_seconds, dpa_in_bracket, dpa_in_strict, dpa_fine (null unless rerun at the fine grid),
dpa_fine_in_bracket, dropped (null for a kept setting, else the reason),
attempts (what happened at each eps_error). Consumers use the rows with ``dropped`` null.
The file is rewritten after every setting, so an interrupted run keeps what it has.

Run (from the repository root; ~20-40 min on a busy 2-core CPU):
    python benchmarks/sweep_references.py
    # against a frozen jaxacct while the working tree is being edited (what the stored file used):
    git archive HEAD jaxacct | tar -x -C /tmp/jaxacct_head
    python benchmarks/sweep_references.py --jaxacct-root /tmp/jaxacct_head
    python benchmarks/sweep_references.py --per-decade 2 --output /tmp/s.json   # a quick check
    python benchmarks/sweep_references.py --recheck   # redo only the dp-accounting cross-checks
    python benchmarks/sweep_references.py --screen-only   # list the drawn settings, nothing else
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import queue
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "benchmarks" / "data" / "sweep_references.json"
SEED = 3
DECADES = (1, 2, 3, 4, 5)  # decade k holds T in [10^k, 10^(k+1))
Q_RANGE, SIGMA_RANGE, DELTA_RANGE = (1e-4, 1.0), (0.5, 10.0), (1e-10, 1e-3)
FULL_BATCH_DECADES, FULL_BATCH_SHARE = (1, 2, 3), 1 / 6  # q = 1: a sixth of these decades
EPS_MAX, EPS_ZERO = 50.0, 1e-6
EPS_ERRORS = (1e-3, 1e-2)  # tight plan first, the coarser one when it is too slow or too large
DPA_MAX_STEPS = 20_000
DPA_INTERVAL = 1e-4
DPA_TOL = 1e-3  # times max(1, eps): dp-accounting's own discretisation allowance
DPA_FINE_INTERVAL, DPA_FINE_TOL = 1e-6, 1e-5  # the rerun where the 1e-4 grid disagrees
STARTUP_SECONDS = 90.0  # a child's imports (jax) before it starts timing, on a loaded machine
MAX_DRAWS_PER_STREAM = 1000


def log_uniform(rng, low, high):
  return float(10.0 ** rng.uniform(math.log10(low), math.log10(high)))


def draw(rng, decade, full_batch):
  """One candidate setting of the given decade of T (q = 1 when ``full_batch``)."""
  steps = int(round(10.0 ** rng.uniform(decade, decade + 1)))
  q = 1.0 if full_batch else log_uniform(rng, *Q_RANGE)
  sigma = log_uniform(rng, *SIGMA_RANGE)
  delta = log_uniform(rng, *DELTA_RANGE)
  return dict(sigma=sigma, q=q, steps=steps, delta=delta)


def screen_estimate(jaxacct, s):
  """Cheap epsilon estimate for the screen: exact Gaussian DP at q = 1, saddle point below."""
  accountant = "gdp" if s["q"] == 1.0 else "spa"
  result = jaxacct.dpsgd_epsilon(s["sigma"], s["q"], s["steps"], s["delta"],
                                 accountant=accountant)
  return float(np.asarray(result.estimate))


def draw_settings(per_decade, jaxacct_root):
  """``per_decade`` screened settings per decade, plus (drawn, accepted) counts per decade."""
  sys.path.insert(0, jaxacct_root)
  import jaxacct
  settings, counts = [], {}
  for decade in DECADES:
    full = round(FULL_BATCH_SHARE * per_decade) if decade in FULL_BATCH_DECADES else 0
    accepted = drawn = 0
    for full_batch, quota in ((False, per_decade - full), (True, full)):
      rng = np.random.default_rng([SEED, decade, int(full_batch)])
      mine = tried = 0
      while mine < quota and tried < MAX_DRAWS_PER_STREAM:
        s = draw(rng, decade, full_batch)
        tried += 1
        estimate = screen_estimate(jaxacct, s)
        # nan (no estimate) passes: the PLD reference decides.
        if not (estimate > EPS_MAX or estimate <= EPS_ZERO):
          settings.append(s)
          mine += 1
      accepted += mine
      drawn += tried
    counts[decade] = (drawn, accepted)
  return settings, counts


# ---------------------------------------------------------------------------------------------
# Child processes: one per computation, so a slow one can be stopped.


def child_main(kind, payload, jaxacct_root):
  """Prints "ready" once imported, then one JSON line with the result (or the error)."""
  args = json.loads(payload)
  if kind == "pld":
    sys.path.insert(0, jaxacct_root)
    import jax
    import jaxacct
  else:
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant
  print("ready", flush=True)
  start = time.perf_counter()
  try:
    if kind == "pld":
      sigma, q, steps, delta, eps_error = args
      r = jax.block_until_ready(jaxacct.dpsgd_epsilon(sigma, q, steps, delta,
                                                      eps_error=eps_error))
      out = dict(lower=float(r.lower), estimate=float(r.estimate), upper=float(r.upper),
                 status=int(r.status))
    else:
      sigma, q, steps, delta, *interval = args  # interval optional (default DPA_INTERVAL)
      interval = interval[0] if interval else DPA_INTERVAL
      accountant = pld_privacy_accountant.PLDAccountant(
          dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
          value_discretization_interval=interval)
      event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
      accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
      out = dict(epsilon=float(accountant.get_epsilon(delta)))
  except ValueError as error:  # e.g. a plan refused as too large
    out = dict(error=str(error))
  out["seconds"] = time.perf_counter() - start
  print(json.dumps(out), flush=True)


def run_child(kind, args, timeout, jaxacct_root=str(ROOT)):
  """The child's result dict, or None when it did not answer within ``timeout`` seconds of
  starting its computation (STARTUP_SECONDS allowed for the imports before that)."""
  proc = subprocess.Popen([sys.executable, __file__, "--child", kind, json.dumps(args),
                           "--jaxacct-root", jaxacct_root], stdout=subprocess.PIPE, text=True)
  lines = queue.Queue()
  threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)],
                   daemon=True).start()
  result = None
  try:
    ready = lines.get(timeout=STARTUP_SECONDS)
    if ready is not None and ready.strip() == "ready":
      line = lines.get(timeout=timeout)
      result = (dict(error=f"child exited with code {proc.wait()}") if line is None
                else json.loads(line))
  except queue.Empty:
    pass
  if proc.poll() is None:
    proc.kill()
  proc.wait()
  return result


# ---------------------------------------------------------------------------------------------


def reference(s, timeouts, jaxacct_root):
  """Adds the pld fields (or ``dropped``) to setting ``s``, trying each eps_error in turn."""
  s["attempts"] = []
  args = [s["sigma"], s["q"], s["steps"], s["delta"]]
  for eps_error, timeout in zip(EPS_ERRORS, timeouts):
    out = run_child("pld", args + [eps_error], timeout, jaxacct_root)
    if out is None:
      s["attempts"].append(f"eps_error {eps_error:g}: no answer within {timeout:g} s")
      continue
    if "error" in out:  # e.g. plan refused as too large: the coarser plan may do
      s["attempts"].append(f"eps_error {eps_error:g}: {out['error']}")
      continue
    s["attempts"].append(f"eps_error {eps_error:g}: ok in {out['seconds']:.1f} s")
    s.update(lower=out["lower"], estimate=out["estimate"], upper=out["upper"],
             status=out["status"], eps_error=eps_error, seconds=out["seconds"])
    if not out["estimate"] <= EPS_MAX:
      s["dropped"] = f"eps > {EPS_MAX:g}"
    elif out["upper"] <= EPS_ZERO:
      s["dropped"] = f"eps == 0 (upper <= {EPS_ZERO:g})"
    else:
      s["dropped"] = None
    return s
  s["dropped"] = "no pld reference at any eps_error"
  return s


def cross_check(s, timeout):
  """dp-accounting's epsilon and whether it lies in jaxacct's bracket (widened by its tol);
  where it does not, again at the fine grid."""
  s.update(dpa=None, dpa_seconds=None, dpa_in_bracket=None, dpa_in_strict=None, dpa_fine=None,
           dpa_fine_in_bracket=None)
  s.pop("dpa_note", None)
  if s["dropped"] is not None or s["steps"] > DPA_MAX_STEPS:
    return s
  args = [s["sigma"], s["q"], s["steps"], s["delta"]]
  out = run_child("dpa", args + [DPA_INTERVAL], timeout)
  if out is None or "error" in out:
    s["dpa_note"] = "no answer within the limit" if out is None else out["error"]
    return s
  eps, scale = out["epsilon"], max(1.0, s["estimate"])
  s.update(dpa=eps, dpa_seconds=out["seconds"],
           dpa_in_bracket=bool(s["lower"] - DPA_TOL * scale <= eps <= s["upper"] + DPA_TOL * scale),
           dpa_in_strict=bool(s["lower"] <= eps <= s["upper"]))
  if not s["dpa_in_bracket"]:
    out = run_child("dpa", args + [DPA_FINE_INTERVAL], 10 * timeout)
    if out is None or "error" in out:
      s["dpa_note"] = "fine grid: " + ("no answer within the limit" if out is None
                                       else out["error"])
      return s
    tol = DPA_FINE_TOL * scale
    s.update(dpa_fine=out["epsilon"],
             dpa_fine_in_bracket=bool(s["lower"] - tol <= out["epsilon"] <= s["upper"] + tol))
  return s


def label(s):
  return f"sigma={s['sigma']!r}, q={s['q']!r}, T={s['steps']}, delta={s['delta']!r}"


def summary(rows, counts):
  kept = [s for s in rows if s["dropped"] is None]
  print(f"\n{len(kept)} settings kept of {len(rows)} that reached the PLD stage")
  print("| decade of T | drawn | passed screen | kept | q = 1 | eps_error 1e-2 | "
        "eps range | dpa checked | dpa in bracket (tol) | dpa in bracket (strict) |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  for decade in DECADES:
    mine = [s for s in kept if decade <= math.log10(s["steps"]) < decade + 1]
    checked = [s for s in mine if s["dpa"] is not None]
    eps = [s["estimate"] for s in mine]
    drawn, accepted = counts.get(decade, ("-", "-"))
    print(f"| 10^{decade}..10^{decade + 1} | {drawn} | {accepted} | {len(mine)} | "
          f"{sum(s['q'] == 1.0 for s in mine)} | {sum(s['eps_error'] == 1e-2 for s in mine)} | "
          + (f"{min(eps):.3g}..{max(eps):.3g}" if eps else "-")
          + f" | {len(checked)} | {sum(s['dpa_in_bracket'] for s in checked)} | "
          f"{sum(s['dpa_in_strict'] for s in checked)} |")
  for s in rows:
    if s["dropped"] is not None:
      print(f"  dropped ({s['dropped']}; {'; '.join(s['attempts'])}): {label(s)}")
  for s in kept:
    if s["steps"] <= DPA_MAX_STEPS and s["dpa"] is None:
      print(f"  dpa not run ({s.get('dpa_note')}): {label(s)}")
  outside = [s for s in kept if s["dpa"] is not None and not s["dpa_in_bracket"]]
  print(f"dp-accounting (interval {DPA_INTERVAL:g}) outside jaxacct's bracket beyond tol: "
        f"{len(outside)}")
  for s in outside:
    fine = ("not run" if s.get("dpa_fine") is None else
            f"{s['dpa_fine']!r}, in bracket: {s['dpa_fine_in_bracket']}")
    print(f"  outside: dpa {s['dpa']!r} vs [{s['lower']!r}, {s['estimate']!r}, {s['upper']!r}];"
          f" at interval {DPA_FINE_INTERVAL:g}: {fine} ({label(s)})")
  serious = [s for s in outside if s.get("dpa_fine_in_bracket") is not True]
  print(f"outside at the fine grid too (or not rerun): {len(serious)}"
        + "".join(f"\n  SERIOUS: {label(s)}" for s in serious))
  checked = [s for s in kept if s["dpa"] is not None]
  if checked:
    diff = [(s["dpa"] - s["estimate"]) / max(1.0, s["estimate"]) for s in checked]
    print(f"(dpa - pld estimate) / max(1, eps): min {min(diff):.2e}, median "
          f"{float(np.median(diff)):.2e}, max {max(diff):.2e}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--per-decade", type=int, default=12, help="settings per decade (12)")
  parser.add_argument("--timeout", type=float, default=60.0,
                      help="seconds for a pld reference at eps_error 1e-3 (60)")
  parser.add_argument("--timeout-coarse", type=float, default=180.0,
                      help="seconds for the retry at eps_error 1e-2 (180)")
  parser.add_argument("--dpa-timeout", type=float, default=30.0,
                      help="seconds for a dp-accounting cross-check (30)")
  parser.add_argument("--output", type=pathlib.Path, default=OUTPUT)
  parser.add_argument("--jaxacct-root", default=str(ROOT),
                      help="directory holding the jaxacct package to use (default: this "
                           "checkout; e.g. a frozen copy from `git archive HEAD jaxacct`)")
  parser.add_argument("--recheck", action="store_true",
                      help="redo only the dp-accounting cross-checks of the existing output "
                           "(the screen is redrawn for its counts and checked against the file)")
  parser.add_argument("--screen-only", action="store_true",
                      help="print the screened settings and stop")
  parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child is not None:
    child_main(*args.child, args.jaxacct_root)
    return

  start = time.perf_counter()
  settings, counts = draw_settings(args.per_decade, args.jaxacct_root)
  print(f"screen: {sum(c[0] for c in counts.values())} draws, {len(settings)} passed "
        f"({time.perf_counter() - start:.0f} s)", flush=True)
  if args.screen_only:
    print(f"(drawn, passed) per decade: {counts}")
    for s in settings:
      print(f"  {label(s)}")
    return
  if args.recheck:
    rows = json.loads(args.output.read_text())
    keys = ("sigma", "q", "steps", "delta")
    if [[s[k] for k in keys] for s in settings] != [[s[k] for k in keys] for s in rows]:
      print("WARNING: the file's settings differ from this screen's (other seed or jaxacct?)")
    for s in rows:
      cross_check(s, args.dpa_timeout)
    args.output.write_text(json.dumps(rows, indent=1) + "\n")
    summary(rows, counts)
    print(f"\nrechecked {args.output} ({time.perf_counter() - start:.0f} s)")
    return
  args.output.parent.mkdir(parents=True, exist_ok=True)
  rows = []
  for i, s in enumerate(settings):
    reference(s, (args.timeout, args.timeout_coarse), args.jaxacct_root)
    cross_check(s, args.dpa_timeout)
    rows.append(s)
    args.output.write_text(json.dumps(rows, indent=1) + "\n")
    bracket = (f"[{s['lower']:.6f}, {s['estimate']:.6f}, {s['upper']:.6f}] eps_error "
               f"{s['eps_error']:g} in {s['seconds']:.1f} s" if "estimate" in s else "no pld")
    check = "" if s.get("dpa") is None else (f"; dpa {s['dpa']:.6f} in bracket: "
                                             f"{s['dpa_in_bracket']} (strict {s['dpa_in_strict']})")
    print(f"{i + 1}/{len(settings)} {label(s)}: {bracket}{check}"
          f"{'' if s['dropped'] is None else ' DROPPED: ' + s['dropped']}"
          f" [{time.perf_counter() - start:.0f} s]", flush=True)
  summary(rows, counts)
  print(f"\nwrote {args.output} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
  main()
