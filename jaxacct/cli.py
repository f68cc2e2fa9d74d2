"""``jaxacct`` command line: certified epsilon / delta of DP-SGD.

    jaxacct epsilon --noise-multiplier 1.0 --sampling-rate 0.01 --steps 10000 --delta 1e-5
    jaxacct delta --noise-multiplier 1.0 --sampling-rate 0.01 --steps 10000 --epsilon 3 --json
    jaxacct epsilon --accountant spa ...      (saddle point; see ``jaxacct compare``)
    jaxacct compare --noise-multiplier 1.0 --sampling-rate 0.01 --steps 10000 --delta 1e-5
    jaxacct calibrate --epsilon 2 --delta 1e-5 --sampling-rate 0.01 --steps 1000
    jaxacct calibrate --solve-for steps --epsilon 2 --delta 1e-5 --noise-multiplier 1 --json
    jaxacct demo --epsilon 2 --delta 1e-5 --epochs 30 --out jaxacct-demo   (needs the demo extra)
    jaxacct epsilon --group-size 4 --noise-multiplier 1 --sampling-rate 0.01 --steps 2000 \
        --delta 1e-6                                   (group-level DP: groups of 4 examples)
    jaxacct epsilon --group-size 4 --sampling fixed --batch-size 500 --dataset-size 50000 ...
    jaxacct report checkpoints/ --json      (a saved training run's privacy, from its checkpoint)
    jaxacct cache --info | --clear          (the compiled programs kept between runs)
    jaxacct --version

Bad input prints one line on stderr and exits with status 2 (every command, ``compare`` too;
``report``: a missing directory or checkpoint, or one that cannot be read).
``--json`` prints one JSON object: a bound the method does not give is ``null``, an infinite one
the string ``"inf"`` (no guarantee). Compiled programs are cached in ``~/.cache/jaxacct/xla``
(``jaxacct.compile_cache``: ``$JAXACCT_CACHE_DIR`` moves it, ``JAXACCT_NO_CACHE=1`` turns it
off, ``jaxacct cache --clear`` empties it) so later runs start faster. Building the parser
imports no JAX (``--help`` and ``--version`` answer at once): each command imports what it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jaxacct import __version__, compile_cache


_ACCOUNTANTS = ("pld", "spa", "edgeworth", "gdp", "rdp")


class number(float):  # pylint: disable=invalid-name  (argparse names the type in its errors)
  """A number from the command line that keeps the text typed, so a message can quote it."""

  def __new__(cls, text):
    value = super().__new__(cls, text)
    value.typed = text
    return value


def _typed(value):
  """The text the user typed for an option's value (its default's value where none was)."""
  return getattr(value, "typed", f"{value:g} (the default)" if value is not None else "none")


def _setting_arguments(cmd, steps, when="", kind=float):
  """The DP-SGD setting's options (``when``: a note on when they are read; ``kind``: the type
  of their values)."""
  cmd.add_argument("--noise-multiplier", type=kind, default=1.0,
                   help=f"noise standard deviation / clip norm{when} (default 1.0)")
  cmd.add_argument("--sampling-rate", type=kind, default=None,
                   help=f"Poisson sampling probability q in (0, 1]{when} (default 0.01)")
  cmd.add_argument("--steps", type=kind, default=steps,
                   help=f"number of steps, a whole number{when} (default {steps})")


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jaxacct", description=__doc__.split("\n")[0])
  parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
  sub = parser.add_subparsers(dest="command", required=True)
  for name, target in (("epsilon", "--delta"), ("delta", "--epsilon"), ("compare", "--delta")):
    help_text = (f"certified {name} of DP-SGD with Poisson sampling" if name != "compare" else
                 "epsilon of DP-SGD by every accountant, side by side")
    cmd = sub.add_parser(name, help=help_text)
    _setting_arguments(cmd, 10_000)
    if target == "--delta":
      cmd.add_argument("--delta", type=float, default=1e-5, help="target delta (default 1e-5)")
    else:
      cmd.add_argument("--epsilon", type=float, default=1.0, help="target epsilon (default 1)")
    cmd.add_argument("--relation", choices=("add_remove", "replace_one"), default="add_remove",
                     help="neighbouring relation (default add_remove: worse of both directions)")
    cmd.add_argument("--eps-error", type=number, default=None,
                     help="pld accountant only: target half-width of its certified bracket "
                          "(default 0.01; refused by the other accountants)")
    if name != "compare":
      cmd.add_argument("--accountant", choices=_ACCOUNTANTS, default="pld",
                       help="pld (certified FFT, default), spa (saddle point), edgeworth, gdp, rdp")
      cmd.add_argument("--method", default=None,
                       help="the accountant's estimate: clt|msd0|msd1 for spa, "
                            "order1|order2|order3 for edgeworth")
    if name != "compare":
      _group_arguments(cmd)
    cmd.add_argument("--json", action="store_true", help="print one JSON object on stdout")
  cal = sub.add_parser("calibrate", help="the DP-SGD parameter whose certified upper epsilon "
                       "meets a budget (noise multiplier by default)")
  cal.add_argument("--solve-for", choices=("noise-multiplier", "sampling-rate", "steps"),
                   default="noise-multiplier", help="the unknown (default noise-multiplier)")
  cal.add_argument("--epsilon", type=number, default=2.0, help="epsilon budget (default 2)")
  cal.add_argument("--delta", type=number, default=1e-5, help="delta (default 1e-5)")
  _setting_arguments(cal, 1000, when=", when not solved for", kind=number)
  cal.add_argument("--relation", choices=("add_remove", "replace_one"), default="add_remove",
                   help="neighbouring relation (default add_remove)")
  cal.add_argument("--accountant", choices=("pld", "spa", "rdp"), default="pld",
                   help="a certifying accountant: pld (default), spa, rdp")
  cal.add_argument("--eps-error", type=number, default=None,
                   help="pld accountant only: its accuracy (default 0.01); a larger one serves "
                        "settings whose plans would be too large")
  _group_arguments(cal, kind=number)
  cal.add_argument("--json", action="store_true", help="print one JSON object on stdout")
  _demo_arguments(sub)
  _report_arguments(sub)
  _cache_arguments(sub)
  return parser


def _group_arguments(cmd, kind=float):
  """Group-level DP (Ganesh 2024): the options of ``jaxacct.group_epsilon`` (``kind``: the type
  of their values)."""
  cmd.add_argument("--group-size", type=kind, default=None,
                   help="account for groups of k examples (add or remove up to k) by the "
                        "mixture-of-Gaussians accountant (default: example level)")
  cmd.add_argument("--sampling", choices=("poisson", "fixed"), default="poisson",
                   help="poisson (rate --sampling-rate, default) or fixed (a batch of "
                        "--batch-size from a dataset of at least --dataset-size examples)")
  cmd.add_argument("--batch-size", type=kind, default=None, help="fixed batch size B")
  cmd.add_argument("--dataset-size", type=kind, default=None,
                   help="n: a lower bound on the dataset's size (fixed batch)")


def _is_group(args):
  """Any group option given (a fixed batch is accounted by the group mixture, k = 1 by default)."""
  return args.command in ("epsilon", "delta", "calibrate") and (
      args.group_size is not None or args.sampling == "fixed" or args.batch_size is not None
      or args.dataset_size is not None)


def _group_options(args):
  """The group functions' sampling keywords from the command line (checked there)."""
  if args.sampling == "fixed":
    if args.batch_size is None or args.dataset_size is None:
      raise ValueError("--sampling fixed needs --batch-size and --dataset-size")
    if args.rate_given:
      raise ValueError("--sampling-rate goes with --sampling poisson (a fixed batch's rate is "
                       "--batch-size / --dataset-size)")
    return {"batch_size": args.batch_size, "dataset_size": args.dataset_size}
  if args.batch_size is not None or args.dataset_size is not None:
    raise ValueError("--batch-size and --dataset-size go with --sampling fixed")
  return {"sampling_rate": args.sampling_rate}


def _group_setting(args):
  """The setting's fields for the output (group runs)."""
  out = {"noise_multiplier": args.noise_multiplier, "steps": _whole(args.steps),
         "group_size": _whole(1.0 if args.group_size is None else args.group_size),
         "sampling": args.sampling}
  if args.sampling == "fixed":
    out.update(batch_size=_whole(args.batch_size), dataset_size=_whole(args.dataset_size))
  else:
    out["sampling_rate"] = args.sampling_rate
  return out


def _whole(value):
  return int(value) if value is not None and float(value).is_integer() else value


# ``jaxacct.demo.DemoSettings()``'s values (equal: tests/test_cli.py), kept here because the demo
# module imports JAX.
_DEMO_DEFAULTS = dict(epsilon=2.0, delta=1e-5, epochs=30, out="jaxacct-demo", seed=0)


def _demo_arguments(sub):
  default = argparse.Namespace(**_DEMO_DEFAULTS)
  demo = sub.add_parser("demo", help="DP-SGD on scikit-learn's bundled digits with every "
                        "example's privacy accounted in the step; plots and a summary")
  demo.add_argument("--epsilon", type=float, default=default.epsilon,
                    help=f"privacy budget: certified epsilon (default {default.epsilon:g})")
  demo.add_argument("--delta", type=float, default=default.delta,
                    help=f"delta (default {default.delta:g})")
  demo.add_argument("--epochs", type=float, default=default.epochs,
                    help=f"training epochs (default {default.epochs})")
  demo.add_argument("--out", default=default.out,
                    help=f"folder for the PNG plots and summary.json (default {default.out})")
  demo.add_argument("--filter", action="store_true",
                    help="train past the worst-case budget with the individual RDP filter: the "
                         "budget is that of the first half of the steps, and an example whose "
                         "budget is spent is retired")
  demo.add_argument("--seed", type=int, default=default.seed,
                    help=f"seed of the split, the model and the sampler (default {default.seed})")
  demo.add_argument("--json", action="store_true",
                    help="print the summary as one JSON object on stdout (no progress bar)")


def _report_arguments(sub):
  report = sub.add_parser("report", help="a saved training run's privacy from its checkpoint "
                          "alone (jaxacct.training.save_checkpoint): certified epsilon of the "
                          "steps taken, filter guarantee, individual epsilon quantiles")
  report.add_argument("directory", help="the checkpoint directory of the run")
  report.add_argument("--step", type=int, default=None,
                      help="the checkpoint's step (default the newest)")
  report.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _cache_arguments(sub):
  cache = sub.add_parser("cache", help="the compiled programs kept between runs "
                         "(jaxacct.compile_cache): where, how many, how large; or clear them")
  action = cache.add_mutually_exclusive_group()
  action.add_argument("--info", action="store_true", help="show the cache (the default)")
  action.add_argument("--clear", action="store_true", help="remove every cached program")
  cache.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _cache(args) -> int:
  """``jaxacct cache``: the cache's directory, files and size, or clear it (no JAX import)."""
  out = compile_cache.info()
  if args.clear:
    out = dict(out, removed=compile_cache.clear(), files=0, bytes=0)
  if args.json:
    print(json.dumps(out))
    return 0
  state = "on" if out["enabled"] else "off (JAXACCT_NO_CACHE is set)"
  if args.clear:
    print(f"removed {out['removed']} cached programs from {out['directory']}")
  else:
    print(f"compiled programs: {out['directory']} ({state})\n  {out['files']} files, "
          f"{out['bytes'] / 2**20:.1f} MiB (clear with: jaxacct cache --clear)")
  return 0


_OPTIONAL = ("eps_error", "group_size", "batch_size", "dataset_size")  # (None: not given)


def _check_options(args, names, accountant="pld"):
  """Each option of ``names`` checked as a calibration argument
  (``jaxacct.calibrate.check_argument``) before anything is computed; a message names the
  option and the text typed (``--sampling-rate 0: sampling_rate must be ...``)."""
  from jaxacct.calibrate import check_argument
  for name in names:
    value = getattr(args, name)
    if value is None and name in _OPTIONAL:
      continue
    try:
      check_argument(name, value, accountant=accountant)
    except ValueError as err:
      raise ValueError(f"--{name.replace('_', '-')} {_typed(value)}: {err}") from None


def _check_calibration(args, unknown):
  """Every number the calibration reads (not the unknown; no rate for a fixed batch)."""
  names = [name for name in ("epsilon", "delta", "noise_multiplier", "sampling_rate", "steps")
           if name != unknown and not (name == "sampling_rate" and args.sampling == "fixed")]
  _check_options(args, names + list(_OPTIONAL), args.accountant)


class _Progress:
  """The calibration's stages on stderr, for long runs: a tqdm bar (the 'demo' extra) that shows
  after two seconds and only on a terminal; without tqdm, nothing."""

  def __init__(self, enabled):
    self.bar = None
    if enabled:
      try:
        from tqdm import tqdm
      except ImportError:
        return
      self.bar = tqdm(total=None, desc="calibrating", unit=" stage", delay=2.0,
                      file=sys.stderr, leave=False, disable=None)

  def __call__(self, text):
    if self.bar is not None:
      self.bar.set_description_str(text)
      self.bar.update(1)

  def close(self):
    if self.bar is not None:
      self.bar.close()


def _with_progress(args, solve):
  """``solve(progress)`` with a progress bar unless ``--json``."""
  progress = _Progress(not args.json)
  try:
    return solve(progress)
  finally:
    progress.close()


def _calibrate(jaxacct, args) -> int:
  """``jaxacct calibrate``: check, solve, then report the certified upper epsilon at the
  answer."""
  unknown = args.solve_for.replace("-", "_")
  _check_calibration(args, unknown)
  if _is_group(args):
    return _calibrate_group(jaxacct, args, unknown)
  setting = {"noise_multiplier": args.noise_multiplier, "sampling_rate": args.sampling_rate,
             "steps": args.steps}
  known = {k: float(v) for k, v in setting.items() if k != unknown}
  value = float(_with_progress(args, lambda progress: getattr(jaxacct.calibrate, unknown)(
      float(args.epsilon), float(args.delta), **known, accountant=args.accountant,
      relation=args.relation, eps_error=_plain(args.eps_error), progress=progress)))
  setting = {k: float(v) for k, v in setting.items()}
  setting[unknown] = int(value) if unknown == "steps" else value
  setting["steps"] = int(setting["steps"])
  bounds = jaxacct.dpsgd_epsilon(setting["noise_multiplier"], setting["sampling_rate"],
                                 setting["steps"], float(args.delta), relation=args.relation,
                                 accountant=args.accountant, eps_error=_plain(args.eps_error))
  out = {"solve_for": unknown, **setting, "epsilon": float(bounds.upper),
         "target_epsilon": args.epsilon, "delta": args.delta, "relation": args.relation,
         "accountant": args.accountant, "eps_error": _plain(args.eps_error)}
  if args.json:
    print(json.dumps(out))
    return 0
  print(f"{unknown} = {setting[unknown]:.10g} for epsilon <= {args.epsilon:g} at delta = "
        f"{args.delta:g} ({args.accountant} accountant, {args.relation})")
  print(f"  noise_multiplier {setting['noise_multiplier']:.10g}, sampling_rate "
        f"{setting['sampling_rate']:.10g}, steps {setting['steps']}")
  print(f"  certified upper epsilon at that value: {out['epsilon']:.6f}")
  return 0


def _calibrate_group(jaxacct, args, unknown) -> int:
  """``jaxacct calibrate --group-size k``: the noise multiplier for a group budget."""
  if unknown != "noise_multiplier":
    raise ValueError("against groups, calibrate solves for the noise multiplier only")
  if args.relation != "add_remove":
    raise ValueError("group-level DP is accounted for add/remove of up to k examples only")
  group_size = 1.0 if args.group_size is None else args.group_size
  options = _group_options(args)
  sigma = float(_with_progress(args, lambda progress: jaxacct.calibrate.group_noise_multiplier(
      float(args.epsilon), float(args.delta), float(args.steps), group_size,
      accountant=args.accountant, eps_error=_plain(args.eps_error), progress=progress,
      **options)))
  args.noise_multiplier = sigma
  bounds = jaxacct.group_epsilon(sigma, float(args.steps), float(args.delta), group_size,
                                 accountant=args.accountant, eps_error=_plain(args.eps_error),
                                 **options)
  out = {"solve_for": unknown, **_group_setting(args), "epsilon": float(bounds.upper),
         "target_epsilon": args.epsilon, "delta": args.delta, "accountant": args.accountant,
         "eps_error": _plain(args.eps_error)}
  if args.json:
    print(json.dumps(out))
    return 0
  print(f"noise_multiplier = {sigma:.10g} for epsilon <= {args.epsilon:g} at delta = "
        f"{args.delta:g} against groups of {out['group_size']} ({args.accountant} accountant)")
  print(f"  certified upper epsilon at that value: {out['epsilon']:.6f}")
  return 0


def _plain(value):
  """A number as a plain float (None stays None)."""
  return None if value is None else float(value)


def _demo(args) -> int:
  """``jaxacct demo``: train, plot, summarise (the summary as JSON with ``--json``)."""
  from jaxacct import demo
  epochs = int(args.epochs) if float(args.epochs).is_integer() else args.epochs
  settings = demo.DemoSettings(epsilon=args.epsilon, delta=args.delta, epochs=epochs,
                               out=args.out, filtering=args.filter, seed=args.seed)
  summary = demo.run(settings, progress=not args.json)
  if args.json:
    print(json.dumps(summary))
    return 0
  print(demo.describe(summary))
  return 0


def _report(args) -> int:
  """``jaxacct report``: a saved run's privacy (``jaxacct.training.checkpoint_report``)."""
  from jaxacct.training import checkpoint_report
  report = checkpoint_report(args.directory, step=args.step)
  if args.json:
    print(json.dumps(report))
    return 0
  print(_report_text(report))
  return 0


def _report_text(report) -> str:
  """A checkpoint's report as a few lines (the numbers of ``privacy_report``'s text)."""
  from jaxacct.training import DPConfig
  config, epsilon = report["config"], report["epsilon"]
  rate = DPConfig(**config).sampling_rate
  lines = [f"checkpoint {report['checkpoint']} in {report['directory']}: {report['steps']} of "
           f"{config['steps']} planned steps, delta = {report['delta']:g}",
           f"  {config['sampler']} sampling, q = {rate:.6g}, sigma = "
           f"{config['noise_multiplier']:g}, C = {config['clip_norm']:g}, "
           f"{config['accountant']} accountant",
           f"  {'epsilon of the steps taken':<28}<= {_shown(epsilon['upper'])}   (certified; "
           f"lower {_shown(epsilon['lower'])}, estimate {_shown(epsilon['estimate'])})",
           f"  {'epsilon of the planned run':<28}<= {_shown(report['planned_epsilon'])}"]
  if report["target_epsilon"] is not None:
    lines.append(f"  {'target epsilon':<28}{_shown(report['target_epsilon'])}")
  if report["guarantee"] is not None:
    lines.append(f"  {'filter guarantee':<28}<= {_shown(report['guarantee'])}   (every example)")
  if report["refused"]:
    lines.append(f"  {report['refused']} steps refused (batch buffer overflow)")
  if report["individual"] is not None:
    individual = report["individual"]
    shown = ", ".join(f"{100 * q:g}%: {_shown(v)}" for q, v in zip(individual["quantiles"],
                                                                   individual["epsilon"]))
    lines.append(f"  individual epsilon quantiles: {shown}")
    lines.append(f"  {report['active']} of {config['num_examples']} examples active")
    lines.append(f"  note: {report['certifies']}")
  lines += [f"  note: {note}" for note in epsilon["notes"]]
  return "\n".join(lines)


def _query(jaxacct, args, accountant, method=None):
  """The requested quantity by one accountant (raises ValueError on bad input)."""
  common = dict(relation=args.relation, accountant=accountant, method=method)
  if accountant == "pld" or args.command != "compare":
    common["eps_error"] = _plain(args.eps_error)  # (compare: the pld rows only)
  if args.command != "compare" and _is_group(args):
    if args.relation != "add_remove":
      raise ValueError("group-level DP is accounted for add/remove of up to k examples only "
                       "(see docs/group_privacy.md on replace adjacency)")
    del common["relation"]
    group_size = 1.0 if args.group_size is None else args.group_size
    fn, x = ((jaxacct.group_delta, args.epsilon) if args.command == "delta"
             else (jaxacct.group_epsilon, args.delta))
    return fn(args.noise_multiplier, args.steps, x, group_size, **_group_options(args),
              **common)
  if args.command == "delta":
    return jaxacct.dpsgd_delta(args.noise_multiplier, args.sampling_rate, args.steps,
                               args.epsilon, **common)
  return jaxacct.dpsgd_epsilon(args.noise_multiplier, args.sampling_rate, args.steps, args.delta,
                               **common)


def _is_number(value):
  return isinstance(value, float)


def _shown(value):
  return "n/a" if value is None else value if isinstance(value, str) else f"{value:.6g}"


def _compare(jaxacct, args, setting):
  """Every available accountant on one setting: a table (or a JSON object with a list). The
  inputs are checked first (bad input exits 2 like the other commands)."""
  jaxacct.dpsgd_composition(args.noise_multiplier, args.sampling_rate, args.steps, args.relation)
  _check_options(args, ("delta", "eps_error"))
  rows = []
  for accountant, (_, methods) in jaxacct.api.ACCOUNTANTS.items():
    for method in methods:
      result = _query(jaxacct, args, accountant, None if len(methods) == 1 else method)
      rows.append(result.to_dict(accountant=accountant, method=method))
  if args.json:
    print(json.dumps({"quantity": "epsilon", "delta": args.delta, **setting, "results": rows}))
    return 0
  label = ", ".join(f"{k}={v}" for k, v in {**setting, "delta": args.delta}.items())
  print(f"epsilon of DP-SGD ({label}):")
  print(f"  {'accountant':<11}{'method':<14}{'lower':>12}{'estimate':>12}{'upper':>12}  notes")
  for row in rows:
    notes = "; ".join(row["notes"])
    print(f"  {row['accountant']:<11}{row['method']:<14}{_shown(row['lower']):>12}"
          f"{_shown(row['estimate']):>12}{_shown(row['upper']):>12}  {notes}")
  return 0


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  if hasattr(args, "sampling_rate"):  # (None: not given; the default rate is 0.01)
    args.rate_given = args.sampling_rate is not None
    args.sampling_rate = 0.01 if args.sampling_rate is None else args.sampling_rate
  if args.command == "cache":
    return _cache(args)
  compile_cache.enable(min_compile_secs=0.0)  # (every program: this process is the command's)
  import jaxacct
  from jaxacct.pld.accountant import answering_once

  if args.command in ("demo", "report"):
    try:
      return _demo(args) if args.command == "demo" else _report(args)
    except ValueError as err:
      print(f"jaxacct: error: {err}", file=sys.stderr)
      return 2
  setting = {"noise_multiplier": args.noise_multiplier, "sampling_rate": args.sampling_rate,
             "steps": _whole(args.steps), "relation": args.relation}
  if _is_group(args):
    setting = {**_group_setting(args), "relation": args.relation}
  try:
    with answering_once():  # (one question: the programs that compile fastest)
      if args.command == "calibrate":
        return _calibrate(jaxacct, args)
      if args.command == "compare":
        return _compare(jaxacct, args, setting)
      result = _query(jaxacct, args, args.accountant, args.method)
  except ValueError as err:
    print(f"jaxacct: error: {err}", file=sys.stderr)
    return 2
  query = {"delta": args.delta} if args.command == "epsilon" else {"epsilon": args.epsilon}
  out = result.to_dict(quantity=args.command, accountant=args.accountant, **query, **setting)
  if args.json:
    print(json.dumps(out))
    return 0
  label = ", ".join(f"{k}={v}" for k, v in {**setting, **query}.items())
  level = f" against groups of {setting['group_size']}" if _is_group(args) else ""
  print(f"{args.command} of DP-SGD{level} ({label}), {args.accountant} accountant:")
  for key in ("lower", "estimate", "upper"):
    tag = ("   <- certified guarantee to report" if key == "upper" and _is_number(out[key])
           else "   (no guarantee)" if key == "upper" else "")
    print(f"  {key:<9}{_shown(out[key])}{tag}")
  for note in out["notes"]:
    print(f"  note: {note}")
  return 0


_QUICK_COMPILE = f"--{compile_cache.EMITTERS_OPTION}=false"


def quick_compile_flags(flags: str) -> str:
  """``XLA_FLAGS`` for a process that answers one question: XLA's CPU kernels from its
  elemental emitters rather than the (default) fusion emitters. A PLD program then compiles in
  ~1.5-2.5 s less (of ~4-6 s with an empty cache) and runs ~10-20 % slower warm; the answers
  agree to round-off (~1e-12 relative, 1.6e-8 at most on 23 stored settings; docs/cli.md). A
  choice the user made is kept."""
  if compile_cache.EMITTERS_OPTION in flags:
    return flags
  return " ".join(filter(None, [flags, _QUICK_COMPILE]))


def run() -> None:
  """The console script (and ``python -m jaxacct.cli``): ``main``, then the process ends at once.

  The process compiles quickly (``quick_compile_flags``: set before JAX starts its backend;
  ``demo`` keeps XLA's defaults, since it trains). The output is flushed and the process exits
  without the interpreter's teardown of JAX's runtime, ~0.3 s of a warm answer's ~1.7 s (every
  file the command writes, the compilation cache's included, is written before ``main``
  returns). An error still unwinds as usual.
  """
  if sys.argv[1:2] != ["demo"]:
    os.environ["XLA_FLAGS"] = quick_compile_flags(os.environ.get("XLA_FLAGS", ""))
  code = main()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


if __name__ == "__main__":
  run()
