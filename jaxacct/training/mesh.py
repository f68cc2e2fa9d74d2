"""Where a training run's arrays live: one device, or a mesh with the examples split over an axis.

On a mesh (``jax.sharding.Mesh``) the examples -- the data's leading axis and every per-example
state (a filter's ledger, the bucket counter) -- are split in contiguous blocks over
``data_axis``; parameters, optimiser state and the key are replicated over it (other mesh axes
stay with the user's own shardings). Each device computes the per-example gradients of its own
block's sampled examples; the clipped sums are added across the axis once per step (``psum``).
With several processes (``jax.distributed``) each process holds the blocks of its own devices:
``place`` builds the global arrays from every process's block.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxacct.training.sampling import Batch


@dataclasses.dataclass(frozen=True)
class Layout:
  """``mesh`` (None: JAX's default device) and the mesh axis the examples are split over."""

  mesh: jax.sharding.Mesh | None = None
  axis: str = "data"

  @property
  def shards(self) -> int:
    """How many blocks the examples are split into (1 without a mesh)."""
    return 1 if self.mesh is None else int(self.mesh.shape[self.axis])

  def check(self, num_examples: int):
    """Refuses a mesh without the axis, or N that the axis does not divide."""
    if self.mesh is None:
      return
    if not isinstance(self.mesh, jax.sharding.Mesh):
      raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(self.mesh).__name__}")
    if self.axis not in self.mesh.axis_names:
      raise ValueError(f"data_axis {self.axis!r} is not an axis of the mesh "
                       f"{tuple(self.mesh.axis_names)}")
    if num_examples % self.shards:
      raise ValueError(f"num_examples ({num_examples}) must be a multiple of the "
                       f"{self.shards} devices on mesh axis {self.axis!r} (the examples are "
                       f"split in equal blocks)")

  def sharding(self, spec=PartitionSpec()):
    return NamedSharding(self.mesh, spec)

  def example_specs(self, tree, num_examples: int):
    """The partition of each leaf of ``tree``: split over the axis when its leading axis holds
    the ``num_examples`` examples, replicated otherwise."""
    def spec(x):
      shape = np.shape(x)
      return PartitionSpec(self.axis) if shape and shape[0] == num_examples else PartitionSpec()
    return jax.tree_util.tree_map(spec, tree)

  def place(self, data, num_examples: int):
    """``data`` as global arrays split over the axis. Each process passes its own contiguous
    block of the examples (N / process count of them, in process order); with one process,
    all of them."""
    if self.mesh is None:
      return jax.tree_util.tree_map(jnp.asarray, data)
    local = num_examples // jax.process_count()

    def one(x):
      x = np.asarray(x)
      if x.ndim == 0 or x.shape[0] != local:
        raise ValueError(f"every data array needs a leading axis of this process's {local} "
                         f"examples (num_examples / process count); got shape {x.shape}")
      return jax.make_array_from_process_local_data(
          self.sharding(PartitionSpec(self.axis)), x, (num_examples,) + x.shape[1:])
    return jax.tree_util.tree_map(one, data)

  def replicate(self, tree):
    """``tree`` replicated over the data axis (the same values on every process): a leaf
    already laid out on this mesh without the data axis keeps its layout (the user's sharding
    over other axes), others are copied to every device."""
    if self.mesh is None:
      return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), tree)
    return jax.tree_util.tree_map(self._replicated, tree)

  def _replicated(self, x):
    sharding = getattr(x, "sharding", None)
    if (isinstance(sharding, NamedSharding) and sharding.mesh == self.mesh
        and self.axis not in jax.tree_util.tree_leaves(tuple(sharding.spec))):
      return jnp.array(x, copy=True)
    return jax.make_array_from_process_local_data(self.sharding(), np.asarray(x), np.shape(x))

  def put(self, tree, specs):
    """``tree`` laid out by ``specs`` (a prefix of it) on the mesh: a transfer, or inside
    ``jit`` a resharding (explicit mesh axes need their inputs laid out as ``shard_map`` reads
    them). The identity without a mesh."""
    if self.mesh is None:
      return tree
    shardings = jax.tree_util.tree_map(self.sharding, specs,
                                       is_leaf=lambda x: isinstance(x, PartitionSpec))
    return jax.device_put(tree, shardings)

  def context(self):
    """The mesh as JAX's current mesh (its explicit axes then type-check), or no scope."""
    return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

  def over_examples(self, fn, in_specs, out_specs):
    """``fn`` run on each block of examples (``shard_map`` over the axis; the identity without
    a mesh). Inside, ``total`` adds a value across the blocks."""
    if self.mesh is None:
      return fn
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names={self.axis}, check_vma=False)

  def total(self, tree):
    """``tree`` summed over the blocks (inside ``over_examples``)."""
    if self.mesh is None:
      return tree
    return jax.lax.psum(tree, self.axis)

  def block_start(self, block_size: int):
    """The global index of this block's first example (inside ``over_examples``)."""
    if self.mesh is None:
      return 0
    return jax.lax.axis_index(self.axis) * block_size


def block_members(batch: Batch, start, count: int, size: int):
  """The entries of ``batch`` whose example lies in the block [start, start + count), in the
  batch's order: (their positions in the block [size], valid [size]). ``size`` must hold them
  all (min(buffer, count) does: a batch lists an example at most once)."""
  inside = batch.valid & (batch.indices >= start) & (batch.indices < start + count)
  slots = jnp.nonzero(inside, size=size, fill_value=0)[0]
  valid = jnp.arange(size) < jnp.sum(inside)
  return jnp.where(valid, batch.indices[slots] - start, 0).astype(jnp.int32), valid


__all__ = ["Layout", "block_members"]
