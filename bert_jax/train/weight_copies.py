"""Low-precision copies of the parameters that the model reads once, through a cast, kept between steps.

With bfloat16 compute and float32 parameters, every step casts each weight
matrix to bfloat16 before its GEMMs: one pass reading 4 bytes and writing 2
per parameter (0.28 ms of a 41 ms BERT-Base seq-128 step on an H100, 0.77 ms at
BERT-Large; bench/NOTES.md, session 19). `TrainStep` keeps those casts instead:
the update that writes the new float32 parameters also writes their bfloat16
copies (one more output of the same fusion, 2 bytes per parameter), and the
next step's forward pass reads the copies (measured: -0.16 ms at BERT-Base
seq 128, -0.36 ms at BERT-Large, session 20). The numbers do not change: a copy
holds exactly the cast the model would have made, and the gradient reaches the
float32 parameter as through the cast (`read_through`). Under FSDP the copies
are what gets gathered, half the bytes, and the gradient is converted to
float32 before it is reduced into the shards, as the cast's would be
(`GatherCopyOnUse`). Under tensor parallelism `make_train_step` keeps no
copies: XLA's partitioner moves weights there on its own, and the transpose
of moving a copy would reduce its gradient in bfloat16.

Which parameters: those the forward pass reads exactly once, through a cast
to a narrower dtype, found in the traced forward pass (`cast_only_leaves`),
not by name: a `Projection` kernel qualifies; the word-embedding table
(gathered in float32, and read again by the tied output projection) does not;
nor does a fine-tuning head computing in float32, which has no cast at all.

The copies live inside `TrainStep`, not in the train state: checkpoints,
warm starts and fine-tuning's initial weights see the same state as before.
A step whose state is not the one the previous step returned (a restored or
warm-started state, any replaced parameter) first recasts its parameters, so
a copy is never stale.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from bert_jax.parallel import sharding as sharding_lib

Array = jax.Array

# Primitives whose single sub-jaxpr takes the operands in order: a parameter passed in is read as the matching
# input inside (scan: per slice, which casts slice by slice). Anything else that takes a parameter (a custom
# derivative rule, a loop, a kernel) counts as a read that is not a cast.
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint", "scan"})


@jax.custom_jvp
def read_through(param: Array, copy: Array) -> Array:
  """`copy` (= param.astype(copy.dtype)) in the forward pass; differentiated as that cast of `param`."""
  del param
  return copy


@read_through.defjvp
def _read_through_jvp(primals, tangents):
  param, copy = primals
  del param
  return copy, tangents[0].astype(copy.dtype)


def _cast_uses(jaxpr: jax_core.Jaxpr, var: Any) -> list[Any] | None:
  """The dtype of each cast of `var` in `jaxpr` if every use of it is a cast; None if any use is not."""
  if any(out is var for out in jaxpr.outvars):
    return None
  uses: list[Any] = []
  for eqn in jaxpr.eqns:
    for position, operand in enumerate(eqn.invars):
      if operand is not var:
        continue
      if eqn.primitive.name == "convert_element_type":
        uses.append(jnp.dtype(eqn.params["new_dtype"]))
        continue
      sub = eqn.params.get("jaxpr") if eqn.primitive.name in _CALLS else None
      sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
      if not isinstance(sub, jax_core.Jaxpr) or len(sub.invars) != len(eqn.invars):
        return None
      if eqn.primitive.name == "scan" and position < eqn.params["num_consts"] + eqn.params["num_carry"]:
        return None  # read in every iteration: its gradient would be summed over them in the copy's dtype
      inner = _cast_uses(sub, sub.invars[position])
      if inner is None:
        return None
      uses += inner
  return uses


def cast_only_leaves(forward: Callable[..., Any], params: Any, *args: Any) -> dict[int, Any]:
  """{leaf index of `params`: dtype} for the floating-point leaves that `forward(params, *args)` reads exactly
  once, through a cast to a narrower dtype (traced, not run).

  Once: a copy read in several places would have its gradients summed in its own dtype (the cotangents of
  one value), where each cast's gradient is converted back on its own and the sum taken in float32. So a
  parameter that ALBERT's shared block reads in every layer, or the word-embedding table that both the
  embedding lookup and the tied output projection read, keeps its casts.
  """
  leaves, treedef = jax.tree.flatten(params)
  closed = jax.make_jaxpr(lambda leaves, *rest: forward(treedef.unflatten(leaves), *rest))(leaves, *args)
  found = {}
  for index, (leaf, var) in enumerate(zip(leaves, closed.jaxpr.invars)):
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      continue
    uses = _cast_uses(closed.jaxpr, var)
    if uses and len(uses) == 1:
      (dtype,) = uses
      if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < jnp.dtype(leaf.dtype).itemsize:
        found[index] = dtype
  return found


@flax.struct.dataclass
class GatherCopyOnUse(sharding_lib.GatherOnUse):
  """`sharding_lib.GatherOnUse` for a parameter with a copy: the module reading it gets the copy gathered, read
  through the parameter gathered (`read_through`). The forward pass moves only the copy (half the bytes of a
  float32 parameter); the backward pass converts the gradient to float32 before reducing it into the shards,
  as the cast's gradient would be."""

  copy: Any = None

  def unbox(self) -> Any:
    gather = lambda x: jax.lax.with_sharding_constraint(x, self.sharding)  # noqa: E731
    return read_through(gather(self.value), gather(self.copy))


def substitute(params: Any, copies: dict[int, Array], gather_to: Any = None) -> Any:
  """What the model reads: `params` with each leaf that has a copy read through it (`read_through`).

  With `gather_to` (shardings of `params`' structure: FSDP's whole parameters) every leaf is boxed to be
  gathered where a module reads it (`sharding_lib.GatherOnUse`), those with a copy as `GatherCopyOnUse`.
  """
  leaves, treedef = jax.tree.flatten(params)
  if gather_to is None:
    if not copies:
      return params
    for index, copy in copies.items():
      leaves[index] = read_through(leaves[index], copy)
  else:
    shardings = treedef.flatten_up_to(gather_to)
    leaves = [GatherCopyOnUse(leaf, sharding, copies[index]) if index in copies else
              sharding_lib.GatherOnUse(leaf, sharding) for index, (leaf, sharding) in enumerate(zip(leaves, shardings))]
  return treedef.unflatten(leaves)


def cast(params: Any, dtypes: dict[int, Any]) -> dict[int, Array]:
  """The copies of `params`: {leaf index: leaf.astype(dtype)}."""
  leaves = jax.tree.leaves(params)
  return {index: leaves[index].astype(dtype) for index, dtype in dtypes.items()}


@dataclasses.dataclass(frozen=True)
class StepParts:
  """What `TrainStep` runs, built from the first state and batch it sees.

  Attributes:
    step: `(state, copies, batch) -> (state, copies, metrics)`, jitted with the state and copies donated.
    recast: params -> their copies (`cast`, jitted into the copies' shardings; `recast.eval_shape` gives the
      copies' `jax.ShapeDtypeStruct`s for lowering).
    dtypes: {leaf index of the parameters: its copy's dtype} (`cast_only_leaves`); empty: no copies.
  """

  step: Callable[..., Any]
  recast: Any  # a jitted params -> copies
  dtypes: dict[int, Any]


class TrainStep:
  """`train_step(state, batch) -> (state, metrics)`, keeping the parameters' copies between calls.

  `build(state, batch) -> StepParts` runs at the first call (or `lower`). The
  copies a call returns serve the next call only if its state's parameters
  are the very arrays that call returned (the state is donated, so a step gets
  either that state or a new one: restored, warm-started, edited); otherwise
  they are cast again from the state. `lower(state, batch).compile()` gives
  the same interface over the AOT-compiled step.
  """

  def __init__(self, build: Callable[[Any, Any], StepParts] | None = None, parts: StepParts | None = None):
    self._build, self._parts = build, parts
    self._source: list[Array] | None = None
    self._copies: dict[int, Array] = {}

  def parts(self, state: Any, batch: Any) -> StepParts:
    if self._parts is None:
      self._parts = self._build(state, batch)
    return self._parts

  def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
    parts = self.parts(state, batch)
    leaves = jax.tree.leaves(state.params)
    fresh = self._source is not None and len(leaves) == len(self._source) and all(
        a is b for a, b in zip(leaves, self._source))
    copies = self._copies if fresh else parts.recast(state.params)
    self._source, self._copies = None, {}  # donated below: gone whatever happens
    state, copies, metrics = parts.step(state, copies, batch)
    self._source, self._copies = jax.tree.leaves(state.params), copies
    return state, metrics

  def lower(self, state: Any, batch: Any) -> "LoweredTrainStep":
    parts = self.parts(state, batch)
    return LoweredTrainStep(parts.step.lower(state, parts.recast.eval_shape(state.params), batch), parts)


class LoweredTrainStep:
  """A lowered `TrainStep`: `compile()` gives a `TrainStep` over the executable; other attributes are the
  lowered step's (`as_text`, ...)."""

  def __init__(self, lowered: Any, parts: StepParts):
    self._lowered, self._parts = lowered, parts

  def compile(self, *args, **kwargs) -> "CompiledTrainStep":
    compiled = self._lowered.compile(*args, **kwargs)
    return CompiledTrainStep(parts=dataclasses.replace(self._parts, step=compiled))

  def __getattr__(self, name: str) -> Any:
    if name.startswith("_"):
      raise AttributeError(name)
    return getattr(self._lowered, name)


class CompiledTrainStep(TrainStep):
  """A `TrainStep` over a compiled executable; other attributes are the executable's (`as_text`, ...)."""

  def lower(self, state: Any, batch: Any) -> "LoweredTrainStep":
    raise TypeError("a compiled train step cannot be lowered again")

  def __getattr__(self, name: str) -> Any:
    if name.startswith("_"):
      raise AttributeError(name)
    return getattr(self._parts.step, name)
