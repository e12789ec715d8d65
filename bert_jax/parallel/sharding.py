"""One mesh with three named axes (data, fsdp, tensor) and the logical-axis rules.

Model code names axes logically (batch, length, embed, heads, kv, mlp, vocab);
the rules below map them onto the mesh. Flax applies the rules in order and
never uses a mesh axis twice in one array, so an activation
("batch", "length", "embed") whose batch takes "fsdp" leaves embed unsharded,
while the parameter ("vocab", "embed") shards embed over "fsdp".

  data parallel:   mesh data=N               (params replicated)
  FSDP / ZeRO-3:   mesh fsdp=N               (params and batch sharded)
  tensor parallel: mesh tensor=N             (heads, mlp, vocab split)
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import flax.linen as nn
import flax.struct
import jax
import jax.experimental.mesh_utils
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("embed", "fsdp"),
    ("kv", None),
    ("length", None),
)


def mesh_shape(sizes: Mapping[str, int], num_devices: int) -> tuple[int, int, int]:
  """Resolves the sizes of (data, fsdp, tensor); one of them may be -1 (fill the rest).

  Raises:
    ValueError naming the mesh key when the sizes do not multiply to the
    device count.
  """
  unknown = set(sizes) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"unknown mesh axes {sorted(unknown)}; expected {MESH_AXES}")
  shape = [int(sizes.get(axis, 1)) for axis in MESH_AXES]
  fills = [i for i, s in enumerate(shape) if s == -1]
  if len(fills) > 1:
    raise ValueError(f"config.mesh: only one axis may be -1, got {dict(zip(MESH_AXES, shape))}")
  if any(s == 0 or s < -1 for s in shape):
    raise ValueError(f"config.mesh: sizes must be positive or -1, got {dict(zip(MESH_AXES, shape))}")
  known = int(np.prod([s for s in shape if s != -1]))
  if fills:
    if num_devices % known:
      raise ValueError(f"config.mesh.{MESH_AXES[fills[0]]}=-1: {num_devices} devices are not divisible by the "
                       f"other axes' product {known}")
    shape[fills[0]] = num_devices // known
  if int(np.prod(shape)) != num_devices:
    raise ValueError(f"config.mesh {dict(zip(MESH_AXES, shape))} needs {int(np.prod(shape))} devices, "
                     f"but {num_devices} are present")
  return tuple(shape)


def create_mesh(sizes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(sizes, len(devices))
  try:
    device_array = jax.experimental.mesh_utils.create_device_mesh(shape, devices)
  except Exception:  # Fake CPU devices and odd topologies: plain order is fine.
    device_array = np.asarray(devices).reshape(shape)
  return Mesh(device_array, MESH_AXES)


def rules_from_config(rules: Sequence[Sequence[Any]] | None) -> tuple[tuple[str, Any], ...]:
  if not rules:
    return DEFAULT_RULES
  out = []
  for rule in rules:
    logical, mesh_axes = rule
    if mesh_axes is not None:
      for axis in (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes:
        if axis not in MESH_AXES:
          raise ValueError(f"config.mesh.rules: {logical!r} maps to unknown mesh axis {axis!r}")
    out.append((logical, tuple(mesh_axes) if isinstance(mesh_axes, list) else mesh_axes))
  return tuple(out)


def logical_shardings(abstract_tree: Any, mesh: Mesh, rules) -> Any:
  """NamedShardings for a tree of (possibly boxed) abstract values with logical axes.

  A dimension that the mesh axes do not divide (a 30522-word vocabulary over
  4 tensor shards) is left unsharded rather than failing.
  """
  mesh_specs = nn.logical_to_mesh(nn.get_partition_spec(abstract_tree), rules)
  shapes = nn.unbox(abstract_tree)

  def fit(spec: PartitionSpec, value) -> NamedSharding:
    if not hasattr(value, "shape"):  # An empty optimizer-state node (optax.MaskedNode): nothing to place.
      return value
    axes = []
    for dim, axis in zip(value.shape, tuple(spec) + (None,) * (len(value.shape) - len(spec))):
      names = () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
      size = int(np.prod([mesh.shape[name] for name in names])) if names else 1
      axes.append(axis if dim % size == 0 else None)
    return NamedSharding(mesh, PartitionSpec(*axes))

  return jax.tree.map(fit, mesh_specs, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def gathered(shardings: Any, axis: str = "fsdp") -> Any:
  """The same shardings with `axis` removed: FSDP parameters as the forward pass uses them (whole)."""
  def drop(sharding):
    if not isinstance(sharding, NamedSharding):
      return sharding
    def entry(e):
      if e == axis:
        return None
      if isinstance(e, tuple):
        rest = tuple(a for a in e if a != axis)
        return rest or None
      return e
    return NamedSharding(sharding.mesh, PartitionSpec(*(entry(e) for e in sharding.spec)))

  return jax.tree.map(drop, shardings, is_leaf=lambda x: isinstance(x, NamedSharding))


@flax.struct.dataclass
class GatherOnUse(flax.core.meta.AxisMetadata):
  """A parameter that Flax hands to the module reading it gathered to `sharding` (with_sharding_constraint).

  Flax unboxes `AxisMetadata` where a module reads its parameter, so the
  gather happens at the point of use: inside a rematerialised block it is
  part of what the backward pass recomputes, and only that block's weights
  are whole at a time (ZeRO-3). The gradient flows back through the
  constraint into the sharded value.
  """

  value: Any
  sharding: NamedSharding = flax.struct.field(pytree_node=False)

  def unbox(self) -> Any:
    return jax.lax.with_sharding_constraint(self.value, self.sharding)

  def replace_boxed(self, val: Any) -> "GatherOnUse":
    return self.replace(value=val)

  def add_axis(self, index: int, params: dict[Any, Any]) -> "GatherOnUse":
    raise NotImplementedError("GatherOnUse parameters cannot go through nn.scan / nn.vmap")

  def remove_axis(self, index: int, params: dict[Any, Any]) -> "GatherOnUse":
    raise NotImplementedError("GatherOnUse parameters cannot go through nn.scan / nn.vmap")


def current_mesh() -> Any:
  """The mesh of the enclosing `with mesh:` / `jax.set_mesh` scope, or None."""
  from jax._src import mesh as mesh_lib  # The legacy `with mesh:` scope has no public getter.
  physical = mesh_lib.thread_resources.env.physical_mesh
  if not physical.empty:
    return physical
  abstract = jax.sharding.get_abstract_mesh()
  return None if abstract.empty else abstract


def split_axes(logical: Sequence[str], shape: Sequence[int], mesh: Any) -> tuple[tuple[str, ...], ...]:
  """Per dimension, the mesh axes the logical-axis rules in scope give an array of `logical` axes.

  For kernels run per shard (`jax.shard_map`). A dimension whose mesh axes do
  not divide it (e.g. a one-row init batch) is left whole: ().
  """
  result = []
  for entry, size in zip(nn.logical_to_mesh_axes(tuple(logical)), shape):
    axes = () if entry is None else tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)
    result.append(axes if size % math.prod(mesh.shape[a] for a in axes) == 0 else ())
  return tuple(result)


def row_shards(x: Any) -> tuple[Any, tuple[str, ...], int] | None:
  """(mesh, row axes, rows per device) for running a kernel per shard of x's rows [..., E] (`jax.shard_map`).

  Rows are every dim but the last. Mesh None outside a mesh scope (or on one device); under one, the rules'
  "batch" axes split the leading dim (() if they do not divide it: each device takes every row). None for a
  1-D x under a mesh.
  """
  rows = x.size // x.shape[-1]
  mesh = current_mesh()
  if mesh is None or mesh.size == 1:
    return None, (), rows
  if x.ndim < 2:
    return None
  row_axes = split_axes(("batch",), x.shape[:1], mesh)[0]
  return mesh, row_axes, rows // math.prod(mesh.shape[axis] for axis in row_axes)


def per_row_shard(fn, mesh, row_axes, in_kinds: str, out_kinds: str):
  """fn on [rows, E] arrays ("r"), row vectors [rows] ("v") and replicated operands ("p"), as `in_kinds` and
  `out_kinds` spell them: inside a mesh, a `jax.shard_map` splitting the rows over `row_axes` (`row_shards`); fn
  itself without one."""
  if mesh is None:
    return fn
  specs = {"r": PartitionSpec(row_axes or None, None), "v": PartitionSpec(row_axes or None), "p": PartitionSpec()}
  return jax.shard_map(fn, mesh=mesh, in_specs=tuple(specs[k] for k in in_kinds),
                       out_specs=tuple(specs[k] for k in out_kinds), check_vma=False)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis split over data x fsdp; other axes replicated."""
  return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def data_parallel_size(mesh: Mesh) -> int:
  return mesh.shape["data"] * mesh.shape["fsdp"]


def global_batch(local_batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Assembles each process's rows into global arrays sharded along the batch axis."""
  sharding = batch_sharding(mesh)
  if jax.process_count() == 1:  # One call for every field: cheaper on the host than one call each.
    return jax.device_put({k: np.asarray(v) for k, v in local_batch.items()}, sharding)
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()}
