"""``jaxacct`` command line: certified epsilon / delta of DP-SGD.

    jaxacct epsilon --noise-multiplier 1.0 --sampling-rate 0.01 --steps 10000 --delta 1e-5
    jaxacct delta --noise-multiplier 1.0 --sampling-rate 0.01 --steps 10000 --epsilon 3 --json

Bad input prints one line on stderr and exits with status 2. Compiled programs are cached in
``~/.cache/jaxacct`` (set ``JAXACCT_NO_CACHE=1`` to disable) so later runs start faster.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jaxacct", description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  for name, target in (("epsilon", "--delta"), ("delta", "--epsilon")):
    cmd = sub.add_parser(name, help=f"certified {name} of DP-SGD with Poisson sampling")
    cmd.add_argument("--noise-multiplier", type=float, default=1.0,
                     help="noise standard deviation / clip norm (default 1.0)")
    cmd.add_argument("--sampling-rate", type=float, default=0.01,
                     help="Poisson sampling probability q in (0, 1] (default 0.01)")
    cmd.add_argument("--steps", type=float, default=10_000, help="number of steps (default 10000)")
    if target == "--delta":
      cmd.add_argument("--delta", type=float, default=1e-5, help="target delta (default 1e-5)")
    else:
      cmd.add_argument("--epsilon", type=float, default=1.0, help="target epsilon (default 1)")
    cmd.add_argument("--relation", choices=("add_remove", "replace_one"), default="add_remove",
                     help="neighbouring relation (default add_remove: worse of both directions)")
    cmd.add_argument("--eps-error", type=float, default=0.01,
                     help="target half-width of the certified bracket (default 0.01)")
    cmd.add_argument("--json", action="store_true", help="print one JSON object on stdout")
  return parser


def _enable_compile_cache():
  if os.environ.get("JAXACCT_NO_CACHE"):
    return
  import jax
  path = os.path.join(os.path.expanduser("~"), ".cache", "jaxacct", "xla")
  try:
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
  except (OSError, AttributeError):
    pass  # a read-only home or an older JAX: run without the cache


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  _enable_compile_cache()
  import jaxacct

  common = dict(relation=args.relation, eps_error=args.eps_error)
  try:
    if args.command == "epsilon":
      result = jaxacct.dpsgd_epsilon(args.noise_multiplier, args.sampling_rate, args.steps,
                                     args.delta, **common)
      query = {"delta": args.delta}
    else:
      result = jaxacct.dpsgd_delta(args.noise_multiplier, args.sampling_rate, args.steps,
                                   args.epsilon, **common)
      query = {"epsilon": args.epsilon}
  except ValueError as err:
    print(f"jaxacct: error: {err}", file=sys.stderr)
    return 2
  setting = {"noise_multiplier": args.noise_multiplier, "sampling_rate": args.sampling_rate,
             "steps": args.steps, "relation": args.relation}
  out = result.to_dict(quantity=args.command, accountant="pld", **query, **setting)
  if args.json:
    print(json.dumps(out))
    return 0
  label = ", ".join(f"{k}={v}" for k, v in {**setting, **query}.items())
  print(f"{args.command} of DP-SGD ({label}), PLD accountant:")
  for key in ("lower", "estimate", "upper"):
    value = out[key]
    shown = "n/a" if value is None else f"{value:.6g}"
    tag = "   <- certified guarantee to report" if key == "upper" else ""
    print(f"  {key:<9}{shown}{tag}")
  for note in out["notes"]:
    print(f"  note: {note}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
