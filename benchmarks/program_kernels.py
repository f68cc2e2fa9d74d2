"""What one compiled PLD accountant is made of: its XLA kernels, by size and by jaxacct function.

XLA's CPU backend compiles every kernel (a fusion, or an op left alone) as its own LLVM module,
~10-20 ms each on one core even when it works on a single value, so a program's first call
costs about its kernel count: the figure that the compile-time work of issue 32 has to bring
down. This script compiles the front door's single-setting program as one program (as
``jaxacct.pld.accountant.single_program`` runs smaller settings; with ``--band`` the program
that answers larger ones from the PLD kept as its band, as it runs the default setting on CPU)
for one DP-SGD setting, then again with XLA's dump on, and prints the compile time, the kernels (the
dump's object files) by the size of their output (a tiny one is scalar bookkeeping) and by the
innermost jaxacct function that made them (from the HLO's stack frames). Then, compiled once
more under JAX's profiler, where XLA's compile time goes: its phases (HLO passes, emitting the
kernels, LLVM's machine code) and the cost of one kernel's emission against its op count (a
fixed cost per kernel, whatever its size, is what makes many small kernels expensive)::

    python benchmarks/program_kernels.py                      # q 0.01, sigma 1, T 10^4, delta 1e-5
    python benchmarks/program_kernels.py --q 1 --sigma 10 --steps 100 --top 40
    python benchmarks/program_kernels.py --band    # the program answering from the PLD's band
"""

import argparse
import collections
import math
import os
import re
import sys
import tempfile
import time

os.environ["JAXACCT_NO_CACHE"] = "1"  # (a program read from the cache is not compiled or dumped)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxacct  # noqa: E402
from jaxacct._numerics import scoped_gradients  # noqa: E402
from jaxacct.pld.accountant import _band_single, _epsilon_single  # noqa: E402


def _table(text, name):
  """Rows of one of the HLO dump's tables (FileNames, FunctionNames, FileLocations, ...)."""
  start = text.index("\n" + name + "\n") + len(name) + 2
  return text[start:text.index("\n\n", start)].split("\n")


def _frames(text):
  """stack frame id -> (file, function) of the frame itself: the innermost jaxacct function."""
  files = {int(r.split()[0]): r.split(None, 1)[1].strip('"').rsplit("/", 1)[-1]
           for r in _table(text, "FileNames")}
  functions = {int(r.split()[0]): r.split(None, 1)[1].strip('"')
               for r in _table(text, "FunctionNames")}
  locations = {}
  for row in _table(text, "FileLocations"):
    m = re.match(r"(\d+) \{file_name_id=(\d+) function_name_id=(\d+)", row)
    locations[int(m[1])] = (files[int(m[2])], functions[int(m[3])])
  frames = {}
  for row in _table(text, "StackFrames"):
    m = re.match(r"(\d+) \{file_location_id=(\d+)", row)
    frames[int(m[1])] = locations[int(m[2])]
  return frames


def _instructions(text):
  """name -> (output elements, the largest of a tuple's; innermost jaxacct function) of every
  instruction of the optimised module."""
  frames = _frames(text)
  out = {}
  for line in text.split("\n"):
    m = re.match(r"\s+(?:ROOT )?%(\S+) = (.*?) [\w-]+\(", line)
    if not m:
      continue
    elements = max([math.prod(int(d) for d in dims.split(",") if d)
                    for dims in re.findall(r"\[([\d,]*)\]", m[2])], default=1)
    frame = re.search(r"stack_frame_id=(\d+)", line)
    where = frames.get(int(frame[1])) if frame else None
    out[m[1]] = (elements, f"{where[0]}:{where[1]}" if where else "(no frame)")
  return out


def kernels(dump):
  """(output elements, innermost jaxacct function) of every kernel XLA compiled: one object
  file each in the dump (``obj-file.<instruction>[_elemental]_kernel_module.o``), joined to
  its instruction in the optimised HLO by name (reduction bodies and library calls, which get
  no object of their own, are not counted)."""
  text = open(next(os.path.join(dump, f) for f in os.listdir(dump)
                   if f.endswith("cpu_after_optimizations.txt"))).read()
  instructions = _instructions(text)
  out = []
  for name in sorted(os.listdir(dump)):
    m = re.search(r"obj-file\.(?:__compute_module_)?(.+?)(?:_elemental)?(?:_kernel_module)?\.o$",
                  name)
    if m:
      out.append(instructions.get(m[1], (0, "(not in the HLO)")))
  return out


_PHASES = (("HLO passes", ("HLO passes through layout assignment",
                            "HLO passes after layout assignment")),
           ("kernel emission", ("ThunkEmitter::EmitEntryComputation",
                                "ThunkEmitter::ConsumeKernels")),
           ("LLVM machine code", ("JitCompiler::Compile",)))


def compile_phases(lowered):
  """Compiles ``lowered`` under JAX's profiler: (seconds of each of ``_PHASES`` on the compiling
  thread, the number of threads that emitted kernels, [(ops, milliseconds)] of each kernel's
  emission, XLA's ``FusionCompiler::Compile``)."""
  with tempfile.TemporaryDirectory(prefix="jaxacct-trace-") as folder:
    jax.profiler.start_trace(folder)
    try:  # (the option names XLA's own trace events; it also keys a compilation of its own)
      lowered.compile(compiler_options={"xla_cpu_enable_xprof_traceme": True})
    finally:
      jax.profiler.stop_trace()
    path = next(os.path.join(d, f) for d, _, files in os.walk(folder) for f in files
                if f.endswith(".xplane.pb"))
    profile = jax.profiler.ProfileData.from_file(path)
  phases, emitters, emitted = collections.Counter(), set(), []
  for plane in profile.planes:
    for line in plane.lines:
      for event in line.events:
        for phase, names in _PHASES:
          if any(event.name.startswith(n) for n in names):
            phases[phase] += event.duration_ns / 1e9
        if event.name.startswith("FusionCompiler::Compile"):
          emitters.add((plane.name, line.name))
          emitted.append((int(dict(event.stats).get("op_count", 0)), event.duration_ns / 1e6))
  return phases, len(emitters), emitted


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--q", type=float, default=0.01)
  parser.add_argument("--sigma", type=float, default=1.0)
  parser.add_argument("--steps", type=int, default=10_000)
  parser.add_argument("--delta", type=float, default=1e-5)
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("--band", action="store_true",
                      help="the program that answers from the PLD kept as its band")
  args = parser.parse_args(argv)
  with jax.enable_x64(True):
    plan = jaxacct.dpsgd_plan(args.sigma, args.q, args.steps, args.delta)
    comp = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64),
                                  jaxacct.dpsgd_composition(args.sigma, args.q, args.steps))
    delta = jnp.asarray(args.delta, jnp.float64)
    single = _band_single("epsilon") if args.band else _epsilon_single
    program = jax.jit(scoped_gradients(single))  # (one program, whatever the size)
    start = time.perf_counter()
    lowered = program.trace(comp, delta, plan).lower()
    traced = time.perf_counter() - start
    start = time.perf_counter()
    lowered.compile()
    compiled = time.perf_counter() - start
    # Compiled again with XLA's dump on (slower: it writes every kernel's IR), for its kernels.
    with tempfile.TemporaryDirectory(prefix="jaxacct-hlo-") as dump:
      lowered.compile(compiler_options={"xla_dump_to": dump, "xla_dump_hlo_as_text": True})
      found = kernels(dump)
    phases, emitters, emitted = compile_phases(lowered)
  sizes = collections.Counter("<= 16" if n <= 16 else "<= 1,024" if n <= 1024 else
                              "<= 100,000" if n <= 100_000 else "> 100,000" for n, _ in found)
  print(f"{'band' if args.band else 'one'} program, "
        f"setting q={args.q:g} sigma={args.sigma:g} T={args.steps} delta={args.delta:g}; "
        f"plan sizes {plan.sizes}; jax {jax.__version__}, {os.cpu_count()} CPUs")
  print(f"trace + lower {traced:.2f} s, XLA compile {compiled:.2f} s: {len(found)} kernels, "
        f"{1e3 * compiled / max(len(found), 1):.1f} ms each")
  print("kernels by output elements: " + ", ".join(
      f"{k}: {sizes[k]}" for k in ("<= 16", "<= 1,024", "<= 100,000", "> 100,000")))
  tiny = collections.Counter(w.split(":")[0] for n, w in found if n <= 16)
  print("kernels of <= 16 elements by file: " + ", ".join(f"{f} {c}" for f, c in
                                                         tiny.most_common()))
  print(f"kernels by the jaxacct function that made them (top {args.top}):")
  for where, count in collections.Counter(w for _, w in found).most_common(args.top):
    print(f"  {count:4d}  {where}")
  print("XLA's compile, traced: " + ", ".join(f"{name} {phases[name]:.2f} s"
                                              for name, _ in _PHASES))
  if emitted:
    ops, ms = np.array(emitted, float).T
    slope, fixed = np.polyfit(ops, ms, 1)
    small = ops < 50
    print(f"kernel emission on {emitters} threads: {len(ops)} kernels, {ms.sum() / 1e3:.2f} s; "
          f"~{fixed:.1f} ms a kernel + {1e3 * slope:.0f} us an op (least squares); the "
          f"{small.sum()} kernels of < 50 ops took {ms[small].sum() / 1e3:.2f} s of it")


if __name__ == "__main__":
  sys.exit(main())
