"""`ops.gelu_feed_forward` (the FFN: two projections, exact GELU) and the pieces of its Hopper kernels that run on CPU.

The kernels themselves (`ffn_kernel.bias_gelu_matmul` and its ping-pong forms, Mosaic GPU) run on a Hopper GPU
only: tests/test_ffn_kernel_gpu.py checks them there against the XLA forms, tests/test_kernels_lower.py lowers
them here. Here: their erf, GELU and GELU' against `lax.erf` / `ops.gelu` / autodiff, both GELU forms against
their float64 closed forms, the custom gradient that the kernel path uses against autodiff of the XLA form, and
that off GPU nothing changes.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import PartitionSpec as P

from bert_jax.kernels import ffn as ffn_kernel
from bert_jax.kernels import ops
from bert_jax.models import model as model_lib
from bert_jax.models.config import ModelConfig


def test_kernel_erf_and_gelu_match_lax_to_float32_rounding():
  x = jnp.linspace(-9.0, 9.0, 100_001, dtype=jnp.float32)
  assert float(jnp.max(jnp.abs(ffn_kernel.erf(x) - jax.lax.erf(x)))) < 1e-6
  assert float(jnp.max(jnp.abs(ffn_kernel.gelu(x) - ops.gelu(x)))) < 2e-6


def test_both_gelu_forms_match_float64_closed_forms():
  """Exact GELU (the kernels' and the XLA form) and the tanh form (ALBERT's gelu_new, the encoder's "gelu_tanh")
  against their formulas evaluated in float64 with the standard library's erf and tanh."""
  x = jnp.linspace(-9.0, 9.0, 20_001, dtype=jnp.float32)
  values = np.asarray(x, np.float64)
  exact = np.array([0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))) for v in values])
  tanh_form = np.array([0.5 * v * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))
                        for v in values])
  # float32 rounding, and the cancellation in 1 + erf (or tanh) where it is near -1: a few ulps of max(|x|, 1).
  bound = 2 * np.finfo(np.float32).eps * np.maximum(np.abs(values), 1.0)
  for candidate in (ffn_kernel.gelu(x), ops.gelu(x), model_lib.activation(ModelConfig(hidden_act="gelu"))(x)):
    assert np.all(np.abs(np.asarray(candidate, np.float64) - exact) <= bound)
  tanh_gelu = model_lib.activation(ModelConfig(hidden_act="gelu_tanh"))
  assert np.all(np.abs(np.asarray(tanh_gelu(x), np.float64) - tanh_form) <= bound)
  assert np.max(np.abs(tanh_form - exact)) > 1e-4  # the two forms are told apart at this bound


def test_kernel_gelu_derivative_matches_autodiff():
  x = jnp.linspace(-9.0, 9.0, 100_001, dtype=jnp.float32)
  reference = jax.vmap(jax.grad(lambda v: 0.5 * v * (1.0 + jax.lax.erf(v / np.sqrt(2.0)))))(x)
  assert float(jnp.max(jnp.abs(ffn_kernel.gelu_derivative(x) - reference))) < 2e-6
  value, derivative = ffn_kernel.gelu_and_derivative(x)  # the forward epilogue's pair (SAVE_GELU_DERIVATIVE)
  np.testing.assert_array_equal(np.asarray(value), np.asarray(ffn_kernel.gelu(x)))
  np.testing.assert_array_equal(np.asarray(derivative), np.asarray(ffn_kernel.gelu_derivative(x)))


def ffn_inputs(dtype, shape=(4, 16, 64), features=256):
  keys = jax.random.split(jax.random.key(3), 6)
  x = jax.random.normal(keys[0], shape, jnp.float32).astype(dtype)
  wi = (0.1 * jax.random.normal(keys[1], (shape[-1], features), jnp.float32)).astype(dtype)
  bi = 0.5 * jax.random.normal(keys[2], (features,), jnp.float32)
  wo = (0.1 * jax.random.normal(keys[3], (features, shape[-1]), jnp.float32)).astype(dtype)
  dy = jax.random.normal(keys[5], shape, jnp.float32).astype(dtype)
  return (x, wi, bi, wo), dy


def xla_feed_forward(x, wi, bi, wo):
  return jnp.dot(ops.gelu(ops.bias_add(jnp.dot(x, wi), bi)), wo)


@pytest.mark.parametrize("save_derivative", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gelu_feed_forward_custom_gradient_equals_autodiff(dtype, save_derivative):
  """The rule the kernel path differentiates with (`_gelu_feed_forward_bwd`), on the XLA forms, against autodiff
  of the FFN: the same ops, so equal to float rounding (with `save_derivative`, GELU'(h) is the residual: one
  more rounding in bf16)."""
  args, dy = ffn_inputs(dtype)
  custom = lambda *a: ops._gelu_feed_forward(*a, False, False, save_derivative)  # noqa: E731, SLF001
  y_ref, vjp_ref = jax.vjp(xla_feed_forward, *args)
  y, vjp = jax.vjp(custom, *args)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
  for name, a, b in zip(("dx", "dwi", "dbi", "dwo"), vjp(dy), vjp_ref(dy)):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2  # bf16: the GEMMs' output rounding, summation order
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < tol, name


def test_feed_forward_off_gpu_is_the_xla_form():
  args, _ = ffn_inputs(jnp.bfloat16)
  assert not ffn_kernel.applies(args[0], args[1]) and not ffn_kernel.applies_dgelu(args[0], args[1])  # CPU
  np.testing.assert_array_equal(np.asarray(ops.gelu_feed_forward(*args), np.float32),
                                np.asarray(xla_feed_forward(*args), np.float32))


def test_supported_shapes_and_dtype():
  tiles = ffn_kernel.Tiles()
  assert not ffn_kernel.supported(32768, 768, 3072, jnp.float32, tiles)
  assert not ffn_kernel.supported(100, 768, 3072, jnp.bfloat16, tiles)  # rows not a multiple of 128
  assert not ffn_kernel.supported_pingpong(32768, 768, 3072, jnp.float32)
  assert not ffn_kernel.supported_pingpong(32768, 736, 3072, jnp.bfloat16)  # K not a multiple of 64


def test_config_rejects_unknown_kernels_setting():
  with pytest.raises(ValueError, match="ModelConfig.kernels='pallas'"):
    ModelConfig(kernels="pallas")


def emulated_kernels(monkeypatch):
  """The Hopper kernels replaced by XLA programs with their rounding (h rounded once after the bias, dh from a
  float32 product), and `_hopper` true: the model's kernel path, its custom VJP and its per-shard wrappers run on
  CPU."""
  def bias_gelu_matmul(x, w, bias, tiles=None, derivative=False):
    h = (jnp.dot(x, w, preferred_element_type=jnp.float32) + bias).astype(x.dtype)
    g, gp = ffn_kernel.gelu_and_derivative(h.astype(jnp.float32))
    return (gp if derivative else h).astype(x.dtype), g.astype(x.dtype)

  def dgelu_matmul(dy, wo, h, tiles=None, saved=False):
    dg = jnp.dot(dy, wo.T, preferred_element_type=jnp.float32)
    h32 = h.astype(jnp.float32)
    dh = (dg * (h32 if saved else ffn_kernel.gelu_derivative(h32))).astype(h.dtype)
    return dh, jnp.sum(dh.astype(jnp.float32), axis=0)

  monkeypatch.setattr(ffn_kernel, "_hopper", lambda dtype: jnp.dtype(dtype) == jnp.bfloat16)
  monkeypatch.setattr(ffn_kernel, "bias_gelu_matmul", bias_gelu_matmul)  # either forward schedule
  monkeypatch.setattr(ffn_kernel, "bias_gelu_matmul_pingpong", bias_gelu_matmul)
  monkeypatch.setattr(ffn_kernel, "dgelu_matmul", dgelu_matmul)


def encoder_value_and_grad(kernels, ids, target, mesh=None):
  from bert_jax.models.model import Encoder
  model = Encoder(ModelConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=4, intermediate_size=512,
                              max_position_embeddings=64, dtype="bfloat16", hidden_dropout=0.0,
                              attention_dropout=0.0, kernels=kernels))
  params = model.init(jax.random.key(0), ids)

  def loss(params):  # a random projection: gradients of the activations' order, no LayerNorm-flattened loss
    return jnp.mean(model.apply(params, ids)["hidden"].astype(jnp.float32) * target)

  step = jax.jit(jax.value_and_grad(loss))
  if mesh is None:
    return step(params), step.lower(params).as_text()
  import flax.linen as nn

  from bert_jax.parallel import sharding as sharding_lib
  with mesh, nn.logical_axis_rules(sharding_lib.DEFAULT_RULES):
    return step(params), step.lower(params).as_text()


@pytest.mark.parametrize("sharded, save_derivative", [(False, False), (True, False), (False, True)])
@pytest.mark.slow
def test_kernel_path_gradients_equal_the_xla_form(monkeypatch, sharded, save_derivative):
  """The FFN's kernel path (`ops.gelu_feed_forward` with both kernels, emulated) in an encoder against its XLA form
  (the same model before the emulation, where the kernels do not apply):
  the custom VJP's wiring (dh and the bias gradient from `dgelu`), under a 4-way batch mesh the per-shard
  wrappers, whose column sums are added across shards, and with `SAVE_GELU_DERIVATIVE` GELU'(h) as the
  residual."""
  from bert_jax.parallel import sharding as sharding_lib
  ids = jax.random.randint(jax.random.key(1), (16, 32), 5, 512)  # 128 rows per shard under the mesh: one tile
  target = jax.random.normal(jax.random.key(2), (16, 32, 256), jnp.float32)
  mesh = sharding_lib.create_mesh({"data": 4}, devices=jax.devices()[:4]) if sharded else None
  (loss_x, grads_x), _ = encoder_value_and_grad("auto", ids, target, mesh)
  emulated_kernels(monkeypatch)
  monkeypatch.setattr(ffn_kernel, "SAVE_GELU_DERIVATIVE", save_derivative)
  assert ffn_kernel.applies_dgelu(jnp.zeros((512, 256), jnp.bfloat16), jnp.zeros((256, 512), jnp.bfloat16))
  (loss_k, grads_k), hlo = encoder_value_and_grad("auto", ids, target, mesh)
  if sharded:
    assert "manual_computation" in hlo or "shard_map" in hlo  # each device runs the kernels on its own rows
  assert abs(float(loss_k) - float(loss_x)) < 1e-2 * abs(float(loss_x))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_k), jax.tree.leaves(grads_x), strict=True):
    name = jax.tree_util.keystr(path)
    if "['key']['bias']" in name:  # softmax ignores a per-query shift of the scores: not trained
      assert not np.any(a) and not np.any(b), name
      continue
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 3e-2, name  # bf16: where each form rounds


def test_a_kernel_lowered_once_is_embedded_verbatim_in_every_program():
  """`_lowered_once`: a kernel whose every lowering differs (as a Mosaic GPU kernel's, stamped with a
  process-wide count) is lowered once per mode, tiles and operand types, so two programs calling it lower to the
  same text, which the persistent compilation cache keys on; its values, also per shard under a shard_map."""
  count = itertools.count()

  def body(mode, a, b, side, tiles):
    del mode, tiles
    return (a @ b + side + next(count),)  # the count: a constant of this lowering

  call = ffn_kernel._lowered_once(body, platforms=("cpu",))
  a = jax.random.normal(jax.random.key(0), (8, 4))
  b = jax.random.normal(jax.random.key(1), (4, 3))
  side = jnp.arange(3.0)
  stamped = [jax.jit(lambda a, b, side: body("plain", a, b, side, None)[0]) for _ in range(2)]
  assert stamped[0].lower(a, b, side).as_text() != stamped[1].lower(a, b, side).as_text()
  programs = [jax.jit(lambda a, b, side: 2 * call("plain", a, b, side, ffn_kernel.Tiles())[0]) for _ in range(2)]
  texts = [program.lower(a, b, side).as_text() for program in programs]
  assert texts[0] == texts[1]
  first = 2  # the one lowering through `call`, after the two stamped ones
  np.testing.assert_allclose(programs[1](a, b, side), 2 * (a @ b + side + first), rtol=1e-6)
  assert call.exported.cache_info().misses == 1

  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  sharded = jax.jit(jax.shard_map(lambda a, b, side: call("plain", a, b, side, ffn_kernel.Tiles()), mesh=mesh,
                                  in_specs=(P("data"), P(), P()), out_specs=(P("data"),)))
  rows = jax.device_put(a, jax.sharding.NamedSharding(mesh, P("data")))
  np.testing.assert_allclose(sharded(rows, b, side)[0], a @ b + side + first + 1, rtol=1e-6)
  assert call.exported.cache_info().misses == 2  # the shards' rows: one more shape
