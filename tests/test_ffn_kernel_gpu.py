"""The FFN's Hopper kernels (`ffn_kernel`, Mosaic GPU) on a Hopper GPU, against XLA: the GEMM + bias + GELU
(cooperative and ping-pong) and the backward's dh = (dy @ wo^T) * GELU'(h).

Skipped without a Hopper GPU. The kernel rounds h = x @ w + bias to bfloat16 once (XLA: the GEMM's output,
then the bias add), and its erf is a polynomial: differences are bfloat16 rounding. `pytest -s` prints them.
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.kernels import ffn as ffn_kernel
from bert_jax.kernels import ops
from bert_jax.models.config import ModelConfig
from bert_jax.models.model import Encoder
from bert_jax.parallel import sharding as sharding_lib

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu" or not ffn_kernel.supported(256, 64, 256, jnp.bfloat16),
    reason="needs a Hopper GPU (Mosaic GPU wgmma)")


def relative(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# Ping-pong shapes with a few tiles per CTA, fewer tiles than CTAs (warpgroups with one tile or none), odd counts.
PINGPONG_SHAPES = [(32768, 768, 3072), (16384, 1024, 4096), (2048, 256, 512), (256, 256, 512), (384, 512, 384)]
FORWARD_CASES = ([("cooperative", s) for s in [(32768, 768, 3072), (16384, 1024, 4096), (2048, 256, 512)]]
                 + [("pingpong", s) for s in PINGPONG_SHAPES])


FORWARD_KERNELS = {"cooperative": ffn_kernel.bias_gelu_matmul, "pingpong": ffn_kernel.bias_gelu_matmul_pingpong}


def forward_inputs(keys, shape, w_scale: float):
  """x [m, k], w [k, n] (bf16, w scaled by w_scale) and a float32 bias [n] from three keys."""
  m, k, n = shape
  x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
  w = (w_scale * jax.random.normal(keys[1], (k, n), jnp.float32)).astype(jnp.bfloat16)
  return x, w, 0.1 * jax.random.normal(keys[2], (n,), jnp.float32)


@pytest.mark.parametrize("schedule, shape", FORWARD_CASES)
def test_bias_gelu_matmul_equals_xla(schedule, shape):
  x, w, bias = forward_inputs(jax.random.split(jax.random.key(0), 3), shape, 0.05)
  h, g = jax.jit(FORWARD_KERNELS[schedule])(x, w, bias)
  h_ref = jnp.dot(x, w, preferred_element_type=jnp.float32) + bias
  g_ref = ops.gelu(h_ref)
  errors = relative(h, h_ref), relative(g, g_ref)
  print(f"{schedule} {shape}: h {errors[0]:.2e}, GELU(h) {errors[1]:.2e}")
  assert max(errors) < 4e-3  # bfloat16 rounding of the outputs (2^-9 relative at most, ~2e-3 in norm)


@pytest.mark.parametrize("shape", PINGPONG_SHAPES)
def test_dgelu_matmul_equals_xla(shape):
  m, k, n = shape
  keys = jax.random.split(jax.random.key(1), 3)
  dy = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
  wo = (0.05 * jax.random.normal(keys[1], (n, k), jnp.float32)).astype(jnp.bfloat16)
  h = (2.0 * jax.random.normal(keys[2], (m, n), jnp.float32)).astype(jnp.bfloat16)
  dh, sums = jax.jit(ffn_kernel.dgelu_matmul)(dy, wo, h)
  dg = jnp.dot(dy, wo.T, preferred_element_type=jnp.float32)
  reference = dg * jax.vmap(jax.grad(lambda v: ops.gelu(v)))(h.astype(jnp.float32).ravel()).reshape(m, n)
  errors = relative(dh, reference), relative(sums, jnp.sum(dh.astype(jnp.float32), axis=0))
  print(f"{shape}: dh {errors[0]:.2e}, column sums {errors[1]:.2e}")
  assert errors[0] < 4e-3 and errors[1] < 1e-5  # the sums: of dh as stored, float32 in another order


@pytest.mark.parametrize("schedule, shape", [("pingpong", (32768, 768, 3072)), ("pingpong", (384, 512, 384)),
                                             ("cooperative", (2048, 256, 512))])
def test_saved_gelu_derivative_forward_and_backward(schedule, shape):
  """`derivative` forward kernels write GELU'(h) in h's place, and `dgelu_matmul(saved=True)` multiplies by it
  (`SAVE_GELU_DERIVATIVE`)."""
  m, k, n = shape
  keys = jax.random.split(jax.random.key(2), 4)
  x, w, bias = forward_inputs(keys, shape, 0.1)
  gp, g = jax.jit(lambda *a: FORWARD_KERNELS[schedule](*a, derivative=True))(x, w, bias)
  h_ref = jnp.dot(x, w, preferred_element_type=jnp.float32) + bias
  gp_ref = jax.vmap(jax.grad(lambda v: ops.gelu(v)))(h_ref.ravel()).reshape(m, n)
  errors = relative(gp, gp_ref), relative(g, ops.gelu(h_ref))
  print(f"{schedule} {shape}: GELU'(h) {errors[0]:.2e}, GELU(h) {errors[1]:.2e}")
  assert max(errors) < 4e-3
  if schedule == "cooperative":
    return
  dy = jax.random.normal(keys[3], (m, k), jnp.float32).astype(jnp.bfloat16)
  wo = w.T
  dh, sums = jax.jit(lambda *a: ffn_kernel.dgelu_matmul(*a, saved=True))(dy, wo, gp)
  reference = jnp.dot(dy, wo.T, preferred_element_type=jnp.float32) * gp_ref
  errors = relative(dh, reference), relative(sums, jnp.sum(dh.astype(jnp.float32), axis=0))
  print(f"{shape} saved: dh {errors[0]:.2e}, column sums {errors[1]:.2e}")
  assert errors[0] < 6e-3 and errors[1] < 1e-5  # dh: GELU'(h) and the product each rounded to bf16


@pytest.mark.parametrize("save_derivative, sharded", [(False, False), (True, False), (True, True)])
def test_model_gradients_with_the_kernel_equal_xla(monkeypatch, save_derivative, sharded):
  """An encoder's loss and gradients with the FFN kernels (on this GPU; with `save_derivative`, GELU'(h) as the
  backward's residual) and without them (`ffn_kernel.applies` false: the kernels' XLA form); with `sharded`, both under a data-parallel mesh of every GPU
  here (the kernels per shard of the rows, `ffn_kernel._over_row_shards`; needs two GPUs or more).

  The loss is a random projection of the output, so that every gradient is of the order of the activations: a
  loss that the final LayerNorm makes nearly flat leaves gradients of pure rounding noise, which no two
  implementations share. The key projection's bias is not trained (softmax ignores a per-query shift of the
  scores: `flash_attention.add_qkv_bias`) and is left out.
  """
  kwargs = dict(vocab_size=1024, hidden_size=256, num_layers=2, num_heads=4, intermediate_size=1024,
                max_position_embeddings=128, dtype="bfloat16", hidden_dropout=0.0, attention_dropout=0.0)
  if sharded and jax.device_count() < 2:
    pytest.skip("needs two GPUs or more")
  ids = jax.random.randint(jax.random.key(1), (16, 128), 5, 1024)
  target = jax.random.normal(jax.random.key(2), (16, 128, 256), jnp.float32)
  monkeypatch.setattr(ffn_kernel, "SAVE_GELU_DERIVATIVE", save_derivative)
  context = contextlib.nullcontext()
  if sharded:
    mesh = sharding_lib.create_mesh({"data": jax.device_count()})
    context = contextlib.ExitStack()
    context.enter_context(mesh)
    context.enter_context(nn.logical_axis_rules(sharding_lib.DEFAULT_RULES))
  results = []
  params = None
  with context:
    for impl in ("auto", "xla"):
      if impl == "xla":
        monkeypatch.setattr(ffn_kernel, "applies", lambda *args, **kw: False)
      model = Encoder(ModelConfig(**kwargs))
      params = params or model.init(jax.random.key(0), ids)

      def loss(params):
        return jnp.mean(model.apply(params, ids)["hidden"].astype(jnp.float32) * target)

      if impl == "auto":
        lowered = jax.jit(jax.grad(loss)).lower(params)
        hlo = lowered.compile().as_text().lower()
        assert "mosaic" in hlo  # the kernels, not the XLA form
        if ffn_kernel.BACKWARD_KERNEL:  # the backward's dh kernel is there too
          monkeypatch.setattr(ffn_kernel, "BACKWARD_KERNEL", False)
          forward_only = jax.jit(jax.grad(loss)).lower(params).compile().as_text().lower()
          monkeypatch.setattr(ffn_kernel, "BACKWARD_KERNEL", True)
          assert hlo.count("mosaic") > forward_only.count("mosaic")
        if sharded:  # each GPU runs the kernels on its own rows
          assert "manual_computation" in lowered.as_text() or "shard_map" in lowered.as_text()
      results.append(jax.jit(jax.value_and_grad(loss))(params))
  (loss_k, grads_k), (loss_x, grads_x) = results
  assert abs(float(loss_k) - float(loss_x)) < 1e-2 * abs(float(loss_x))
  errors = {jax.tree_util.keystr(path): error for path, error in
            jax.tree_util.tree_leaves_with_path(jax.tree.map(relative, grads_k, grads_x))
            if "['key']['bias']" not in jax.tree_util.keystr(path)}
  worst = max(errors, key=errors.get)
  print(f"worst gradient leaf: {worst} relative {errors[worst]:.2e}")
  assert errors[worst] < 2e-2  # bfloat16 rounding (~4e-3 where the kernels' rounding is emulated on CPU)
