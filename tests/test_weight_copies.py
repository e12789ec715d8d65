"""The bf16 weight copies kept between train steps (`train/weight_copies.py`): which parameters get one, their
gradient, and steps with copies equal to steps without (model families, accumulation, replaced parameters,
the AOT-compiled step, meshes)."""

import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.parallel import sharding as sharding_lib
from bert_jax.train import optim, weight_copies
from bert_jax.train.step import make_train_step

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_train_step import build, make_config, synthetic_batch  # noqa: E402

BF16 = jnp.bfloat16


def test_cast_only_leaves_are_the_parameters_read_once_through_a_narrowing_cast():
  @jax.custom_vjp
  def custom(w):
    return w.astype(BF16)

  custom.defvjp(lambda w: (custom(w), None), lambda _, g: (g.astype(jnp.float32),))

  def forward(params, x):
    out = [jnp.dot(x.astype(BF16), params["dot"].astype(BF16)),
           jax.checkpoint(lambda w: w.astype(BF16))(params["remat"]),
           jax.jit(lambda w: w.astype(BF16))(params["jit"]),
           jax.lax.scan(lambda c, w: (c, w.astype(BF16)), 0.0, params["scan"])[1],
           params["also_f32"].astype(BF16) + params["also_f32"].sum().astype(BF16),
           params["two_dtypes"].astype(jnp.float16).astype(BF16) + params["two_dtypes"].astype(BF16),
           params["plain"].astype(BF16) * 0 + params["plain"],
           params["twice"].astype(BF16) + params["twice"].astype(BF16),
           jax.lax.scan(lambda c, _: (c, params["scan_const"].astype(BF16)), 0.0, None, length=2)[1],
           custom(params["custom"]),
           params["ints"].astype(BF16)]
    return sum(o.astype(jnp.float32).sum() for o in out), params["returned"]

  shape = (4, 4)
  params = {name: jnp.ones(shape) for name in ("dot", "remat", "jit", "scan", "also_f32", "two_dtypes", "plain",
                                               "custom", "returned", "twice", "scan_const")}
  params["ints"] = jnp.ones(shape, jnp.int32)
  names = sorted(params)  # a dict's leaves, in order
  found = weight_copies.cast_only_leaves(forward, params, jnp.ones(shape))
  assert {names[i]: dtype for i, dtype in found.items()} == {name: jnp.dtype(BF16)
                                                              for name in ("dot", "remat", "jit", "scan")}


def test_read_through_is_the_cast_forward_and_backward():
  p = jax.random.normal(jax.random.key(0), (64, 32))
  x = jax.random.normal(jax.random.key(1), (8, 64)).astype(BF16)
  loss = lambda w: jnp.sum(jnp.tanh(jnp.dot(x, w).astype(jnp.float32)))  # noqa: E731
  value, grad = jax.value_and_grad(lambda p: loss(p.astype(BF16)))(p)
  value_c, grad_c = jax.value_and_grad(lambda p: loss(weight_copies.read_through(p, p.astype(BF16))))(p)
  assert grad.dtype == grad_c.dtype == jnp.float32
  np.testing.assert_array_equal(value_c, value)
  np.testing.assert_array_equal(grad_c, grad)


ALBERT = dict(num_shared_groups=1, embedding_size=16)  # one shared block read in both layers


def _with_and_without(objective_name, accum_steps, mesh_sizes, model=None):
  """(state, step with copies), (an equal state, step without), mesh: tiny bf16 models with dropout."""
  state, step, mesh, objective, partitioning, shardings = build(
      objective_name, mesh_sizes, accum_steps, dropout=0.1, model_overrides=dict(dtype="bfloat16", **(model or {})))
  tx, schedule = optim.make_optimizer(make_config(objective_name).optim, total_steps=100)
  without = make_train_step(objective, tx, schedule, accum_steps=accum_steps, rng=jax.random.key(1),
                            partitioning=partitioning, state_shardings=shardings, keep_weight_copies=False)
  return (state, step), (jax.tree.map(jnp.copy, state), without), mesh


@pytest.mark.parametrize("objective_name,accum_steps,aot,mesh_sizes,model", [
    ("mlm+nsp", 1, True, {"data": 2}, None), ("mlm+sop", 2, False, {"data": 2, "fsdp": 2}, ALBERT),
    ("rtd", 1, False, {"fsdp": 2}, None)])
def test_steps_with_copies_equal_steps_without(objective_name, accum_steps, aot, mesh_sizes, model):
  """Bit for bit over three steps: the first casts the copies from the state, the second from parameters
  replaced since (a warm start: the copies the first returned are stale), the third uses the copies the second
  returned. Under FSDP the copies are gathered and the gradients reduced in float32, as without them."""
  with_copies, without, mesh = _with_and_without(objective_name, accum_steps, mesh_sizes, model)
  batches = [sharding_lib.global_batch(synthetic_batch(seed=i), mesh) for i in range(3)]
  results = []
  for state, step in (with_copies, without):
    if aot:
      step = step.lower(state, batches[0]).compile()
    losses = []
    for i, batch in enumerate(batches):
      if i == 1:
        state = state.replace(params=jax.tree.map(lambda p: p * 0.5, state.params))
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
    results.append((state, losses, len(step.parts(state, batches[0]).dtypes)))
  (state_a, losses_a, copies), (state_b, losses_b, no_copies) = results
  assert copies > 0 and no_copies == 0
  assert losses_a == losses_b
  for a, b in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_no_copies_under_tensor_parallelism():
  """XLA's partitioner moves weights under tensor parallelism; a copy's gradient would be reduced in bfloat16."""
  for mesh_sizes, expect in (({"data": 2, "tensor": 2}, False), ({"data": 2, "fsdp": 2}, True)):
    state, step, mesh, *_ = build("mlm", mesh_sizes, model_overrides=dict(dtype="bfloat16"))
    assert bool(step.parts(state, sharding_lib.global_batch(synthetic_batch(), mesh)).dtypes) == expect


def test_fsdp_gathers_the_copies():
  """Under FSDP the model reads each copy gathered (bf16 sharding constraints in the lowered step)."""
  with_copies, without, mesh = _with_and_without("mlm", 1, {"fsdp": 4})
  batch = sharding_lib.global_batch(synthetic_batch(), mesh)
  dtypes = [re.findall(r"sdy.sharding_constraint [^:]*: tensor<[0-9x]*x(\w+)>", step.lower(state, batch).as_text())
            for state, step in (with_copies, without)]
  state, step = with_copies
  copies = len(step.parts(state, batch).dtypes)
  assert copies > 0 and dtypes[1].count("bf16") == 0
  assert dtypes[0].count("bf16") == copies
