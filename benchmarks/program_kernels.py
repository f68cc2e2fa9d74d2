"""What one compiled PLD accountant is made of: its XLA kernels, by size and by jaxacct function.

XLA's CPU backend compiles every kernel (a fusion, or an op left alone) as its own LLVM module,
~10 ms each on one core whatever its size, so a program's first call costs about its kernel
count: the figure that the compile-time work of issue 32 has to bring down. This script compiles
the front door's single-setting program (``jaxacct.pld.accountant.single_program``) for one
DP-SGD setting with XLA's dump on, then prints the compile time, the kernels by the size of their
output (a tiny one is scalar bookkeeping) and by the innermost jaxacct function that made them
(from the HLO's stack frames)::

    python benchmarks/program_kernels.py                      # q 0.01, sigma 1, T 10^4, delta 1e-5
    python benchmarks/program_kernels.py --q 1 --sigma 10 --steps 100 --top 40
"""

import argparse
import collections
import os
import re
import sys
import tempfile
import time

os.environ["JAXACCT_NO_CACHE"] = "1"  # (a program read from the cache is not compiled or dumped)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxacct  # noqa: E402
from jaxacct.pld.accountant import single_program  # noqa: E402

_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
                "conditional", "call"}


def _table(text, name):
  """Rows of one of the HLO dump's tables (FileNames, FunctionNames, FileLocations, ...)."""
  start = text.index("\n" + name + "\n") + len(name) + 2
  return text[start:text.index("\n\n", start)].split("\n")


def _frames(text):
  """stack frame id -> [(file, function), ...] from the innermost frame out."""
  files = {int(r.split()[0]): r.split(None, 1)[1].strip('"').rsplit("/", 1)[-1]
           for r in _table(text, "FileNames")}
  functions = {int(r.split()[0]): r.split(None, 1)[1].strip('"')
               for r in _table(text, "FunctionNames")}
  locations = {}
  for row in _table(text, "FileLocations"):
    m = re.match(r"(\d+) \{file_name_id=(\d+) function_name_id=(\d+)", row)
    locations[int(m[1])] = (files[int(m[2])], functions[int(m[3])])
  parents = {}
  for row in _table(text, "StackFrames"):
    m = re.match(r"(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", row)
    parents[int(m[1])] = (int(m[2]), int(m[3]))

  def chain(frame):
    out, seen = [], set()
    while frame in parents and frame not in seen:
      seen.add(frame)
      location, frame = parents[frame]
      if not out or out[-1] != locations[location]:  # (one entry per function, not per line)
        out.append(locations[location])
    return out
  return chain


def kernels(text):
  """(output elements, innermost jaxacct function) of every kernel of the optimised
  module: the instructions of its non-fused computations that are not bookkeeping."""
  chain = _frames(text)
  out = []
  for computation in re.split(r"\n(?=\S)", text):
    head = computation.split("\n", 1)[0]
    if not head.startswith(("%", "ENTRY")) or head.startswith(("%fused", "%wrapped")):
      continue
    for line in computation.split("\n")[1:]:
      m = re.match(r"\s+(?:ROOT )?%\S+ = (.*?) (\w[\w-]*)\(", line)
      if not m or m[2] in _NOT_KERNELS:
        continue
      shape = re.search(r"\[([\d,]*)\]", m[1])  # (a tuple's first element)
      elements = 1
      for d in (shape[1].split(",") if shape and shape[1] else []):
        elements *= int(d)
      frame = re.search(r"stack_frame_id=(\d+)", line)
      where = chain(int(frame[1]))[:1] if frame else []
      out.append((elements, "".join(f"{f}:{fn}" for f, fn in where) or "(no frame)"))
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--q", type=float, default=0.01)
  parser.add_argument("--sigma", type=float, default=1.0)
  parser.add_argument("--steps", type=int, default=10_000)
  parser.add_argument("--delta", type=float, default=1e-5)
  parser.add_argument("--top", type=int, default=25)
  args = parser.parse_args(argv)
  with jax.enable_x64(True):
    plan = jaxacct.dpsgd_plan(args.sigma, args.q, args.steps, args.delta)
    comp = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64),
                                  jaxacct.dpsgd_composition(args.sigma, args.q, args.steps))
    delta = jnp.asarray(args.delta, jnp.float64)
    program = jax.jit(single_program("epsilon").__wrapped__)
    start = time.perf_counter()
    lowered = program.trace(comp, delta, plan).lower()
    traced = time.perf_counter() - start
    start = time.perf_counter()
    lowered.compile()
    compiled = time.perf_counter() - start
    # Compiled again with XLA's dump on (slower: it writes every kernel's IR), for its HLO.
    dump = tempfile.mkdtemp(prefix="jaxacct-hlo-")
    lowered.compile(compiler_options={"xla_dump_to": dump, "xla_dump_hlo_as_text": True})
  dumps = [f for f in os.listdir(dump) if f.endswith("cpu_after_optimizations.txt")]
  text = open(os.path.join(dump, dumps[0])).read()
  found = kernels(text)
  sizes = collections.Counter("<= 16" if n <= 16 else "<= 1,024" if n <= 1024 else
                              "<= 100,000" if n <= 100_000 else "> 100,000" for n, _ in found)
  print(f"setting q={args.q:g} sigma={args.sigma:g} T={args.steps} delta={args.delta:g}; "
        f"plan sizes {plan.sizes}; jax {jax.__version__}, {os.cpu_count()} CPUs")
  print(f"trace + lower {traced:.2f} s, XLA compile {compiled:.2f} s: {len(found)} kernels, "
        f"{1e3 * compiled / max(len(found), 1):.1f} ms each")
  print("kernels by output elements: " + ", ".join(
      f"{k}: {sizes[k]}" for k in ("<= 16", "<= 1,024", "<= 100,000", "> 100,000")))
  print(f"kernels by the jaxacct function that made them (top {args.top}):")
  for where, count in collections.Counter(w for _, w in found).most_common(args.top):
    print(f"  {count:4d}  {where}")


if __name__ == "__main__":
  sys.exit(main())
