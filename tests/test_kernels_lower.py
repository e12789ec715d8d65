"""The GPU kernels lowered for CUDA on this CPU (jax's cross-platform lowering, `lowering_platforms=("cuda",)`;
`lower_for` also serves the TPU lowering of the whole steps, tests/test_tpu_lowering.py).

CI has no GPU: the GPU test files skip, and the CPU tests run the Triton kernels in Pallas' interpreter, which
checks their arithmetic but not that Pallas can lower them for a GPU. Lowering builds the kernels' Triton IR
(flash attention, the LayerNorm kernels, the cross-entropy statistics) and the Mosaic GPU module (the FFN kernel:
its layouts and its shared memory against the H100's 227 KB), so a jax upgrade or an edit that breaks a GPU-only
path fails here. Compiling and running them needs the GPU (tests/test_*_gpu.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from bert_jax.kernels import cross_entropy as cross_entropy_kernel
from bert_jax.kernels import ffn as ffn_kernel
from bert_jax.kernels import flash_attention
from bert_jax.kernels import layer_norm as layer_norm_kernel

shape = jax.ShapeDtypeStruct


def lower_for(platform: str, fn, *args) -> jax.stages.Lowered:
  """`fn` (a function, or a step already jitted with its shardings) traced on `args` (arrays or ShapeDtypeStructs)
  and lowered for `platform` ("cuda", "tpu") on this CPU; tests/test_tpu_lowering.py lowers the steps with it."""
  jitted = fn if isinstance(fn, jax.stages.Wrapped) else jax.jit(fn)
  return jitted.trace(*args).lower(lowering_platforms=(platform,))


def lower_for_cuda(fn, *args) -> str:
  return lower_for("cuda", fn, *args).as_text()


@pytest.mark.parametrize("packed, bias", [(False, True), (True, False)])
def test_flash_attention_forward_and_backward_lower(packed, bias):
  """With the fused bias, the backward kernels also sum its gradient on the tensor cores (`_column_sums`)."""
  qkv = shape((8, 128, 12, 3, 64), jnp.bfloat16)
  pack_ids = jnp.ones((8, 128), jnp.int32)

  def loss(qkv, bias_h3d):
    out = flash_attention.flash_attention(qkv, pack_ids=pack_ids, packed=packed, dropout_rate=0.1,
                                          dropout_rng=jax.random.key(1), bias_h3d=bias_h3d)
    return jnp.sum(out.astype(jnp.float32))

  bias_h3d = shape((12, 3, 64), jnp.float32) if bias else None
  text = lower_for_cuda(jax.grad(loss, argnums=(0, 1) if bias else 0), qkv, bias_h3d)
  assert text.count("triton") >= 3  # the forward, dQ and dK/dV kernels


@pytest.mark.parametrize("rate, branch_sums", [(0.0, False), (0.1, True), (0.0, True)])
def test_layer_norm_kernels_lower(rate, branch_sums):
  """Both kernels, as `ops.layer_norm` (the plain backward) and the post-LN residual (with and without the
  dropout mask, with the branch bias) call them."""
  rows, features = 4096, 768
  x, stats, vector = shape((rows, features), jnp.bfloat16), shape((rows,), jnp.float32), shape((features,), jnp.float32)
  meta = shape((3,), jnp.int32)
  step_rows, num_warps = layer_norm_kernel.backward_launch(features, branch_sums)
  backward = lambda *a: layer_norm_kernel._backward_2d(  # noqa: E731, SLF001
      *a, rate=rate, branch_sums=branch_sums, interpret=False, block_rows=layer_norm_kernel.BLOCK_ROWS,
      step_rows=step_rows, num_warps=num_warps)
  assert "triton" in lower_for_cuda(backward, meta, x, x, stats, stats, vector)
  forward = lambda meta, x, branch, scale, bias, branch_bias: layer_norm_kernel._forward_2d(  # noqa: E731, SLF001
      meta, x, branch, scale, bias, branch_bias, rate=rate, epsilon=1e-12, dtype=jnp.bfloat16, interpret=False,
      block_rows=layer_norm_kernel.FORWARD_BLOCK_ROWS, num_warps=layer_norm_kernel.FORWARD_NUM_WARPS)
  assert "triton" in lower_for_cuda(forward, meta, x, x, vector, vector, vector if branch_sums else None)


@pytest.mark.parametrize("rows, columns", [(4864, 30592), (2560, 30592), (64, 4096)])
def test_cross_entropy_statistics_lower(rows, columns):
  """The MLM loss's row statistics: the split chunk loop and the last, overlapping chunk (30592 = 119.5 x 256)."""
  statistics = functools.partial(cross_entropy_kernel._statistics_2d, interpret=False)  # noqa: SLF001
  assert "triton" in lower_for_cuda(statistics, shape((rows, columns), jnp.bfloat16), shape((rows,), jnp.int32))


class _H100:
  core_count = 132  # the persistent grid's size


@pytest.fixture
def h100(monkeypatch):
  """jax.devices() answering an H100 while the test runs; the FFN kernels lowered meanwhile (for its core count)
  are then dropped from the kernel module's caches, so no later test in this process reuses them."""
  monkeypatch.setattr(jax, "devices", lambda *_: [_H100()])
  yield
  for call in (ffn_kernel._call, ffn_kernel._pingpong_call):  # noqa: SLF001
    call.exported.cache_clear()
    call.clear_cache()


@pytest.mark.parametrize("tokens, hidden, intermediate", [(32768, 768, 3072), (16384, 1024, 4096)])
@pytest.mark.usefixtures("h100")
def test_ffn_kernel_lowers(tokens, hidden, intermediate):
  args = (shape((tokens, hidden), jnp.bfloat16), shape((hidden, intermediate), jnp.bfloat16),
          shape((intermediate,), jnp.float32))
  assert "mosaic_gpu" in lower_for_cuda(ffn_kernel.bias_gelu_matmul, *args)
  derivative = functools.partial(ffn_kernel.bias_gelu_matmul, derivative=True)  # SAVE_GELU_DERIVATIVE's forward
  assert "mosaic_gpu" in lower_for_cuda(derivative, *args)


@pytest.mark.parametrize("tokens, hidden, intermediate", [(32768, 768, 3072), (16384, 1024, 4096)])
@pytest.mark.usefixtures("h100")
def test_pingpong_kernels_lower(tokens, hidden, intermediate):
  """The ping-pong forward (with the model's ring depth) and the backward (dh) kernels: their hand-built ring,
  barriers and epilogues, within the shared-memory budget."""
  x, h = shape((tokens, hidden), jnp.bfloat16), shape((tokens, intermediate), jnp.bfloat16)
  wi, wo = shape((hidden, intermediate), jnp.bfloat16), shape((intermediate, hidden), jnp.bfloat16)
  forward = functools.partial(ffn_kernel.bias_gelu_matmul_pingpong, tiles=ffn_kernel.PINGPONG_FORWARD_TILES)
  assert "mosaic_gpu" in lower_for_cuda(forward, x, wi, shape((intermediate,), jnp.float32))
  assert "mosaic_gpu" in lower_for_cuda(ffn_kernel.dgelu_matmul, x, wo, h)
  # SAVE_GELU_DERIVATIVE's pair: the forward writing GELU'(h), the backward multiplying by it.
  bias = shape((intermediate,), jnp.float32)
  assert "mosaic_gpu" in lower_for_cuda(functools.partial(forward, derivative=True), x, wi, bias)
  assert "mosaic_gpu" in lower_for_cuda(functools.partial(ffn_kernel.dgelu_matmul, saved=True), x, wo, h)


def test_triton_ir_and_launch_of_each_flash_kernel_extracted_for_the_offline_register_count():
  """bench/triton_registers.py reads each Pallas Triton kernel's IR and launch out of the CUDA lowering (then
  compiles them with pip's Triton, not installed here). Newer jax compiles the kernels while lowering (skipped)."""
  from conftest import bench_module

  tool = bench_module("triton_registers")
  qkv = shape((8, 128, 12, 3, 64), jnp.bfloat16)

  def loss(qkv):
    out = flash_attention.flash_attention(qkv, pack_ids=None, dropout_rate=0.1, dropout_rng=jax.random.key(1))
    return jnp.sum(out.astype(jnp.float32))

  try:
    kernels = tool.triton_kernels(jax.grad(loss), qkv)
  except SystemExit as error:
    pytest.skip(str(error))
  launches = {name: (warps, stages) for name, warps, stages, _ in kernels}
  params = flash_attention.KERNEL_PARAMS
  assert launches == {f"flash_attention_{k}": (params[k].num_warps, params[k].num_stages)
                      for k in ("forward", "dq", "dkdv")}
  assert all("tt.func" in ttir for *_, ttir in kernels)


@pytest.mark.usefixtures("h100")
def test_ffn_kernel_is_lowered_once_for_every_program():
  """Two programs calling the FFN kernels lower to one text (`ffn._lowered_once` lowers each kernel once: from jax
  0.11 Mosaic GPU stamps every kernel module it lowers with a process-wide count), so a second fine-tuning task of
  the same shapes reads the first's compilation from the persistent cache."""
  x, wi, wo = shape((2048, 256), jnp.bfloat16), shape((256, 1024), jnp.bfloat16), shape((1024, 256), jnp.bfloat16)

  def program(x, wi, wo, bias):
    h, _ = ffn_kernel.bias_gelu_matmul_pingpong(x, wi, bias, derivative=True)
    return ffn_kernel.dgelu_matmul(x, wo, h, saved=True)

  texts = [lower_for_cuda(lambda *args: program(*args), x, wi, wo, shape((1024,), jnp.float32)) for _ in range(2)]
  assert "mosaic_gpu" in texts[0] and texts[0] == texts[1]
