"""Hand-written gradients (`kernels/ops.py`, the MLM cross-entropy) against autodiff of the textbook forms."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.kernels import cross_entropy as cross_entropy_kernel
from bert_jax.kernels import ops
from bert_jax.kernels.cross_entropy import cross_entropy_sums
from bert_jax.kernels.layers import LayerNorm
from bert_jax.parallel.sharding import DEFAULT_RULES


def _close(a, b, rtol, atol):
  np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.slow
def test_layer_norm_matches_flax_values_and_gradients(dtype):
  keys = jax.random.split(jax.random.key(0), 4)
  x = (3.0 + 2.0 * jax.random.normal(keys[0], (4, 7, 96))).astype(dtype)
  dy = jax.random.normal(keys[1], x.shape).astype(dtype)
  ours = LayerNorm(1e-12, dtype, jnp.float32)
  reference = nn.LayerNorm(epsilon=1e-12, dtype=dtype, param_dtype=jnp.float32, use_fast_variance=False)
  params = reference.init(keys[2], x)
  params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(keys[3], p.shape), params)
  assert jax.tree.structure(nn.unbox(ours.init(keys[2], x))) == jax.tree.structure(params)

  def loss(module, params, x):
    return jnp.sum(module.apply(params, x).astype(jnp.float32) * dy.astype(jnp.float32))

  tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  _close(ours.apply(params, x).astype(jnp.float32), reference.apply(params, x).astype(jnp.float32), **tol)
  ours_grads = jax.grad(loss, argnums=(1, 2))(ours, params, x)
  reference_grads = jax.grad(loss, argnums=(1, 2))(reference, params, x)
  for a, b in zip(jax.tree.leaves(ours_grads), jax.tree.leaves(reference_grads)):
    assert a.dtype == b.dtype
    _close(a, b, rtol=1e-4, atol=1e-4) if dtype == jnp.float32 else _close(a, b, rtol=3e-2, atol=5e-2)


def layer_norm_grads(implementation, x, dy, scale, bias):
  """(dx, dscale, dbias) of sum(layer_norm(x) * dy) with the given backward implementation (jitted)."""
  def loss(x, scale, bias):
    out = ops.layer_norm(x, scale, bias, 1e-12, x.dtype, implementation)
    return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, scale, bias)


def layer_norm_inputs(shape, dtype, seed=2):
  """x (offset, spread), dy, and a perturbed scale and bias for the LayerNorm backward tests."""
  keys = jax.random.split(jax.random.key(seed), 4)
  x = (1.0 + 3.0 * jax.random.normal(keys[0], shape)).astype(dtype)
  dy = jax.random.normal(keys[1], shape).astype(dtype)
  return x, dy, 1.0 + 0.1 * jax.random.normal(keys[2], shape[-1:]), 0.1 * jax.random.normal(keys[3], shape[-1:])


@pytest.mark.parametrize("dtype,shape", [(jnp.float32, (64, 128)), (jnp.float32, (2, 32, 384)),
                                         (jnp.bfloat16, (4, 16, 256))])
def test_layer_norm_pallas_backward_equals_xla(dtype, shape):
  """The one-kernel backward (Pallas' interpreter here) against the XLA form: same sums, rounding apart."""
  x, dy, scale, bias = layer_norm_inputs(shape, dtype)
  pallas = layer_norm_grads("pallas", x, dy, scale, bias)
  xla = layer_norm_grads("xla", x, dy, scale, bias)
  tol = dict(rtol=1e-5, atol=1e-4) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)
  for a, b in zip(pallas, xla):
    assert a.dtype == b.dtype and a.shape == b.shape
    _close(a, b, **tol)


def test_layer_norm_pallas_falls_back_to_xla_where_unsupported():
  x = jax.random.normal(jax.random.key(3), (5, 96))  # 96 features: not a multiple of the kernel's chunk.
  dy = jnp.ones_like(x)
  for a, b in zip(layer_norm_grads("pallas", x, dy, jnp.ones(96), jnp.zeros(96)),
                  layer_norm_grads("xla", x, dy, jnp.ones(96), jnp.zeros(96))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_layer_norm_auto_is_the_xla_form_off_gpu(monkeypatch):
  """"auto" (the default) runs the kernel on GPU only; here, on CPU, it must not run the interpreter."""
  from bert_jax.kernels import layer_norm as layer_norm_kernel
  monkeypatch.setattr(layer_norm_kernel, "layer_norm_backward", lambda *a: pytest.fail("kernel used off GPU"))
  x, dy, scale, bias = layer_norm_inputs((64, 128), jnp.float32)
  for a, b in zip(layer_norm_grads("auto", x, dy, scale, bias), layer_norm_grads("xla", x, dy, scale, bias)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_layer_norm_pallas_backward_per_shard_equals_unsharded():
  """Under a 4-way batch mesh the kernel runs per shard and the partial column sums are added across shards."""
  from bert_jax.parallel import sharding as sharding_lib
  mesh = sharding_lib.create_mesh({"data": 4}, devices=jax.devices()[:4])
  keys = jax.random.split(jax.random.key(4), 2)
  x = jax.random.normal(keys[0], (8, 16, 128))
  dy = jax.random.normal(keys[1], x.shape)
  scale, bias = jnp.full((128,), 1.5), jnp.zeros(128)
  expected = layer_norm_grads("xla", x, dy, scale, bias)
  batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  with mesh, nn.logical_axis_rules(sharding_lib.DEFAULT_RULES):
    got = jax.jit(functools.partial(layer_norm_grads, "pallas"))(jax.device_put(x, batch),
                                                                  jax.device_put(dy, batch), scale, bias)
    hlo = jax.jit(functools.partial(layer_norm_grads, "pallas")).lower(x, dy, scale, bias).as_text()
  assert "manual_computation" in hlo  # the shard_map: each device runs the kernel on its own rows
  for a, b in zip(got, expected):
    _close(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("offset, spread", [(0.0, 1.0), (1e3, 1.0), (1e4, 0.1), (-50.0, 3.0)])
def test_layer_norm_statistics_are_float64_accurate_for_offset_rows(offset, spread):
  # One pass over the row (sums of x minus its first element): no cancellation when |mean| >> std.
  x = (offset + spread * np.random.default_rng(0).standard_normal((64, 768))).astype(np.float32)
  mean, rstd = ops._statistics(jnp.asarray(x), 1e-12)  # noqa: SLF001
  x64 = x.astype(np.float64)
  np.testing.assert_allclose(np.asarray(rstd), 1 / np.sqrt(x64.var(-1, keepdims=True) + 1e-12), rtol=2e-6)
  np.testing.assert_allclose(np.asarray(mean), x64.mean(-1, keepdims=True), rtol=1e-7, atol=spread * 1e-6)


@pytest.mark.parametrize("approximate", [False, True])
def test_gelu_matches_jax_in_float32(approximate):
  x = jnp.linspace(-8.0, 8.0, 4001, dtype=jnp.float32)
  _close(ops.gelu(x, approximate), jax.nn.gelu(x, approximate=approximate), rtol=1e-6, atol=1e-6)
  ours = jax.grad(lambda x: jnp.sum(ops.gelu(x, approximate)))(x)
  reference = jax.grad(lambda x: jnp.sum(jax.nn.gelu(x, approximate=approximate)))(x)
  # The tanh form's derivative cancels at the negative tail (1 + tanh(u) ~ 0 in float32): there any float32 form of
  # it, jax's autodiff as much as ours, is up to ~1e-5 from the float64 value, depending on how XLA compiles tanh.
  _close(ours, reference, rtol=1e-5, atol=2e-5 if approximate else 1e-6)


def test_gelu_bfloat16_is_the_rounded_float32_value():
  x = jax.random.normal(jax.random.key(1), (1000,)).astype(jnp.bfloat16)
  out = ops.gelu(x, False)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.nn.gelu(x.astype(jnp.float32), False)
                                                           .astype(jnp.bfloat16)))
  grad = jax.grad(lambda x: jnp.sum(ops.gelu(x, False).astype(jnp.float32)))(x)
  assert grad.dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cross_entropy_gradient_matches_autodiff(dtype):
  keys = jax.random.split(jax.random.key(2), 3)
  logits = (4.0 * jax.random.normal(keys[0], (3, 5, 50))).astype(dtype)
  targets = jax.random.randint(keys[1], (3, 5), 0, 50)
  weights = (jax.random.uniform(keys[2], (3, 5)) > 0.3).astype(jnp.float32)

  def reference(logits, weights):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0] * weights)

  loss, correct = cross_entropy_sums(logits, targets, weights)
  _close(loss, reference(logits, weights), rtol=1e-5, atol=1e-4)
  expected_correct = np.sum((np.argmax(np.asarray(logits, np.float32), -1) == np.asarray(targets))
                            * np.asarray(weights))
  assert float(correct) == expected_correct
  ours = jax.grad(lambda l, w: cross_entropy_sums(l, targets, w)[0], argnums=(0, 1))(logits, weights)
  expected = jax.grad(reference, argnums=(0, 1))(logits, weights)
  assert ours[0].dtype == dtype
  tol = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=1e-2, atol=4e-3)
  _close(ours[0], expected[0], **tol)
  _close(ours[1], expected[1], rtol=1e-5, atol=1e-4)


def logits_with_ties(shape, key, dtype=jnp.bfloat16):
  """Random logits with, in row 1, the maximum twice (first index 7) and every row's target drawn at random."""
  keys = jax.random.split(key, 2)
  logits = (4.0 * jax.random.normal(keys[0], shape)).astype(dtype)
  row = (0,) * (len(shape) - 2) + (1,)
  logits = logits.at[row + (7,)].set(30.0).at[row + (shape[-1] - 3,)].set(30.0)
  return logits, jax.random.randint(keys[1], shape[:-1], 0, shape[-1])


@pytest.mark.parametrize("columns", [4096, 4352, 30522, 30592])  # 4352: 17 chunks, one split; 30522: overlap
@pytest.mark.slow
def test_cross_entropy_kernel_statistics_match_xla(columns):
  """The kernel's log-sum-exp to float32 rounding, the target's logit and the first argmax (ties) exactly."""
  logits, targets = logits_with_ties((4, 4, columns), jax.random.key(5))
  log_z, target_logit, argmax = cross_entropy_kernel.row_statistics(logits, targets)
  logits32 = logits.astype(jnp.float32)
  _close(log_z, jax.nn.logsumexp(logits32, axis=-1), rtol=2e-6, atol=0)
  np.testing.assert_array_equal(target_logit, jnp.take_along_axis(logits32, targets[..., None], axis=-1)[..., 0])
  np.testing.assert_array_equal(argmax, jnp.argmax(logits, axis=-1))
  assert int(argmax[0, 1]) == 7
  ids = targets.at[0, 0].set(columns).at[0, 2].set(-1).at[0, 3].set(-columns - 1)  # as jnp.take_along_axis
  np.testing.assert_array_equal(cross_entropy_kernel.row_statistics(logits, ids)[1],
                                jnp.take_along_axis(logits32, ids[..., None], axis=-1)[..., 0])


def test_cross_entropy_kernel_leaves_narrow_rows_and_odd_row_counts_to_xla():
  assert cross_entropy_kernel.row_statistics(jnp.zeros((8, 384)), jnp.zeros((8,), jnp.int32)) is None
  assert cross_entropy_kernel.row_statistics(jnp.zeros((6, 4096)), jnp.zeros((6,), jnp.int32)) is None
  assert cross_entropy_kernel.row_statistics(jnp.zeros((8, 4000)), jnp.zeros((8,), jnp.int32)) is None


@pytest.mark.parametrize("mesh_shape", [None, (2, 4, 1), (2, 2, 2)])
def test_cross_entropy_sums_with_the_kernel_equal_xla(mesh_shape):
  """Loss, count and gradients through the kernel against XLA's rows: per row shard on a data x fsdp
  mesh; on a mesh splitting the vocabulary (tensor 2) the kernel steps aside and XLA reduces across shards."""
  logits, targets = logits_with_ties((16, 4, 4096), jax.random.key(6))
  targets = targets.at[:, ::2].set(jnp.argmax(logits, axis=-1)[:, ::2])  # half the predictions right
  weights = (jax.random.uniform(jax.random.key(7), (16, 4)) > 0.3).astype(jnp.float32)

  def run(implementation):
    def loss_and_grads(logits, weights):
      kernel = implementation == "pallas"
      sums = cross_entropy_kernel.weighted_cross_entropy(logits, targets, weights, kernel)
      grads = jax.grad(lambda l, w: cross_entropy_kernel.weighted_cross_entropy(l, targets, w, kernel)[0],
                       argnums=(0, 1))
      return sums, grads(logits, weights)
    uses_kernel = "pallas_call" in str(jax.make_jaxpr(loss_and_grads)(logits, weights))
    assert uses_kernel == (implementation == "pallas" and mesh_shape != (2, 2, 2))
    return jax.jit(loss_and_grads)(logits, weights)

  if mesh_shape is None:
    (loss, correct), grads = run("pallas")
    (ref_loss, ref_correct), ref_grads = run("xla")
  else:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(mesh_shape), ("data", "fsdp", "tensor"))
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
      sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
      logits, weights = jax.device_put(logits, sharding), jax.device_put(weights, sharding)
      (loss, correct), grads = run("pallas")
      (ref_loss, ref_correct), ref_grads = run("xla")
  _close(loss, ref_loss, rtol=1e-6, atol=0)
  assert float(correct) == float(ref_correct) and float(correct) > 0
  np.testing.assert_array_equal(grads[0].astype(jnp.float32), ref_grads[0].astype(jnp.float32))
  _close(grads[1], ref_grads[1], rtol=1e-6, atol=1e-5)  # the token losses: log-sum-exps to float32 rounding


def test_bias_add_sums_its_gradient_in_float32():
  rows = 4096
  dy = (1.0 + 0.01 * jax.random.normal(jax.random.key(3), (rows, 8))).astype(jnp.bfloat16)
  y = jnp.zeros((rows, 8), jnp.bfloat16)
  bias = jnp.zeros((8,), jnp.float32)
  out, vjp = jax.vjp(ops.bias_add, y, bias)
  assert out.dtype == jnp.bfloat16
  dy_back, dbias = vjp(dy)
  np.testing.assert_array_equal(np.asarray(dy_back), np.asarray(dy))
  exact = np.asarray(dy, np.float64).sum(axis=0)
  np.testing.assert_allclose(np.asarray(dbias), exact, rtol=1e-6)
  # The autodiff form sums in bfloat16: around 4096 its spacing is 16 (summation order decides how close it gets).
  naive = jax.grad(lambda b: jnp.sum((y + b.astype(jnp.bfloat16)) * dy).astype(jnp.float32))(bias)
  assert np.max(np.abs(np.asarray(naive) - exact)) > np.max(np.abs(np.asarray(dbias) - exact))


def add_layer_norm_outputs(implementation, x, branch, dy, scale, bias, seeds, rate, branch_bias=None):
  """(y, dx, dbranch, dscale, dbias[, dbranch_bias]) of ops.add_layer_norm with the given implementation
  (jitted)."""
  def loss(x, branch, scale, bias, branch_bias):
    y = ops.add_layer_norm(x, branch, scale, bias, seeds, rate, 1e-12, x.dtype, implementation, branch_bias)
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y
  argnums = (0, 1, 2, 3) if branch_bias is None else (0, 1, 2, 3, 4)
  (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(x, branch, scale, bias,
                                                                                   branch_bias)
  return (y, *grads)


def add_layer_norm_reference(x, branch, dy, scale, bias, seeds, rate, branch_bias=None):
  """The same from the ops apart, by autodiff: layer_norm(x + Dropout(bias_add(branch, branch_bias))) (the mask
  of `seeds`)."""
  from bert_jax.kernels import dropout
  def loss(x, branch, scale, bias, branch_bias):
    if branch_bias is not None:
      branch = ops.bias_add(branch, branch_bias)
    dropped = dropout.apply_mask(branch, seeds, rate) if rate else branch
    y = ops.layer_norm(x + dropped, scale, bias, 1e-12, x.dtype, "xla")
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y
  argnums = (0, 1, 2, 3) if branch_bias is None else (0, 1, 2, 3, 4)
  (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(x, branch, scale, bias,
                                                                                   branch_bias)
  return (y, *grads)


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
@pytest.mark.parametrize("dtype,shape,rate,with_bias", [
    (jnp.float32, (4, 16, 256), 0.1, True), (jnp.float32, (64, 128), 0.0, True),
    (jnp.float32, (2, 32, 128), 0.2, False), (jnp.bfloat16, (2, 32, 384), 0.3, True)])
def test_add_layer_norm_equals_dropout_then_layer_norm(implementation, dtype, shape, rate, with_bias):
  """The post-LN residual op (Pallas kernels in the interpreter, or XLA) against the ops apart, with and without
  the branch's bias."""
  x, dy, scale, bias = layer_norm_inputs(shape, dtype)
  branch = jax.random.normal(jax.random.key(7), shape).astype(dtype)
  branch_bias = 0.3 * jax.random.normal(jax.random.key(8), shape[-1:]) if with_bias else None
  seeds = jnp.asarray([123456789, -987654321], jnp.int32)
  ours = add_layer_norm_outputs(implementation, x, branch, dy, scale, bias, seeds, rate, branch_bias)
  expected = add_layer_norm_reference(x, branch, dy, scale, bias, seeds, rate, branch_bias)
  # bfloat16: XLA may keep the reference's rounded intermediates in float32 (excess precision), so the
  # column sums over rows (dscale, dbias, dbranch_bias) differ by bfloat16 rounding of their terms.
  tol = dict(rtol=1e-5, atol=1e-4) if dtype == jnp.float32 else dict(rtol=3e-2, atol=5e-2)
  assert len(ours) == len(expected) == 5 + with_bias
  for name, a, b in zip(("y", "dx", "dbranch", "dscale", "dbias", "dbranch_bias"), ours, expected):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    _close(a, b, **tol)
  if rate:  # the dropped elements get no gradient, the kept ones 1 / (1 - rate) times the sum's
    dropped = np.asarray(ours[2]) == 0
    assert abs(dropped.mean() - rate) < 0.05


def test_add_layer_norm_backward_kernel_hashes_the_forward_mask():
  """The backward kernel's branch gradient: exactly dx times the forward's multiplier, element for element, and
  its column sums those of that array (the interpreter; bfloat16, rounded where XLA's form rounds)."""
  from bert_jax.kernels import dropout
  from bert_jax.kernels import layer_norm as layer_norm_kernel
  x, dy, scale, _ = layer_norm_inputs((4, 32, 256), jnp.bfloat16)
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, -1, keepdims=True)
  rstd = jax.lax.rsqrt(jnp.var(x32, -1, keepdims=True) + 1e-12)
  seeds = jnp.asarray([3, -77], jnp.int32)
  dtotal, dbranch, dscale, dbias, dbranch_bias = layer_norm_kernel.add_layer_norm_backward(
      x, dy, mean, rstd, scale, seeds, 0.25, branch_sums=True, step_rows=2)
  plain = layer_norm_kernel.layer_norm_backward(x, dy, mean, rstd, scale, step_rows=2)  # the same summation order
  for a, b in zip((dtotal, dscale, dbias), plain):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  np.testing.assert_array_equal(np.asarray(dbranch, np.float32),
                                np.asarray(dropout.apply_mask(dtotal, seeds, 0.25), np.float32))
  _close(dbranch_bias, jnp.sum(dbranch.astype(jnp.float32), axis=(0, 1)), rtol=1e-6, atol=1e-5)
  assert layer_norm_kernel.add_layer_norm_backward(x, dy, mean, rstd, scale, seeds, 0.25, False)[4] is None


def test_add_layer_norm_kernels_per_shard_equal_unsharded():
  """Under a 4-way batch mesh each device hashes its own rows with their global indices, in both kernels: the same
  mask; the branch bias's partial sums are added across shards."""
  from bert_jax.parallel import sharding as sharding_lib
  mesh = sharding_lib.create_mesh({"data": 4}, devices=jax.devices()[:4])
  x, dy, scale, bias = layer_norm_inputs((8, 16, 128), jnp.float32)
  branch = jax.random.normal(jax.random.key(8), x.shape)
  seeds = jnp.asarray([5, 6], jnp.int32)
  branch_bias = 0.3 * jax.random.normal(jax.random.key(9), x.shape[-1:])
  expected = add_layer_norm_reference(x, branch, dy, scale, bias, seeds, 0.2, branch_bias)
  batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  run = functools.partial(add_layer_norm_outputs, "pallas")
  with mesh, nn.logical_axis_rules(sharding_lib.DEFAULT_RULES):
    got = run(*(jax.device_put(a, batch) for a in (x, branch, dy)), scale, bias, seeds, 0.2, branch_bias)
    hlo = jax.jit(lambda *a: run(*a, seeds, 0.2, branch_bias)).lower(x, branch, dy, scale, bias).as_text()
  assert "manual_computation" in hlo
  for a, b in zip(got, expected):
    _close(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_layer_norm_module_residual_form_draws_the_dropout_mask_of_the_dropout_module(monkeypatch, implementation):
  """LayerNorm(x, branch, dropout) == LayerNorm(x + dropout(branch)): the same key, so the same mask."""
  from bert_jax.kernels.dropout import Dropout
  if implementation == "pallas":
    monkeypatch.setattr(ops, "use_kernel", lambda implementation: True)

  class Residual(nn.Module):
    fused: bool

    @nn.compact
    def __call__(self, x, branch):
      norm, dropout = LayerNorm(1e-12, jnp.float32, jnp.float32), Dropout(0.3)
      if self.fused:
        return norm(x, branch, dropout, deterministic=False)
      return norm(x + dropout(branch, deterministic=False))

  x, _, _, _ = layer_norm_inputs((2, 16, 128), jnp.float32)
  branch = jax.random.normal(jax.random.key(9), x.shape)
  rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
  params = Residual(True).init(rngs, x, branch)
  outs = [Residual(fused).apply(params, x, branch, rngs={"dropout": jax.random.key(1)}) for fused in (True, False)]
  _close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
  norm, norm_params = LayerNorm(1e-12, jnp.float32, jnp.float32), {"params": params["params"]["LayerNorm_0"]}
  deterministic = norm.apply(norm_params, x, branch, Dropout(0.3), True)  # no dropout: LayerNorm(x + branch)
  _close(deterministic, norm.apply(norm_params, x + branch), rtol=1e-6, atol=1e-6)
