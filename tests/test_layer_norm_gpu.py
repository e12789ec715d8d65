"""The Pallas LayerNorm kernels compiled for the GPU (Triton) vs the XLA forms, in bfloat16 and float32.

Skipped without a GPU (on CPU, tests/test_ops.py runs the same kernels in
Pallas' interpreter). Shapes are BERT-Base and BERT-Large activations of the
benchmark rows; the kernel and XLA compute in float32 from the same inputs,
so they differ by summation order only. `pytest -s` prints the errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.kernels import ops
from test_ops import add_layer_norm_outputs, layer_norm_grads, layer_norm_inputs

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Triton)")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [(256, 128, 768), (128, 128, 1024), (64, 76, 768)])
def test_pallas_layer_norm_backward_on_gpu_equals_xla(shape, dtype):
  x, dy, scale, bias = layer_norm_inputs(shape, dtype)
  hlo = jax.jit(jax.grad(lambda x: jnp.sum(ops.layer_norm(x, scale, bias, 1e-12, dtype, "pallas").astype(
      jnp.float32) * dy.astype(jnp.float32)))).lower(x).compile().as_text()
  assert "triton" in hlo.lower()  # the kernel, not the XLA fallback
  for name, a, b in zip(("dx", "dscale", "dbias"), layer_norm_grads("pallas", x, dy, scale, bias),
                        layer_norm_grads("xla", x, dy, scale, bias)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    relative = np.linalg.norm(a - b) / np.linalg.norm(b)
    print(f"{shape} {jnp.dtype(dtype).name} {name}: relative {relative:.2e}, max-abs {np.max(np.abs(a - b)):.2e}")
    assert relative < (1e-2 if dtype == jnp.bfloat16 and name == "dx" else 1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [(256, 128, 768), (32, 512, 1024), (64, 76, 768)])
def test_pallas_add_layer_norm_on_gpu_equals_xla(shape, dtype):
  """The post-LN residual's kernels (forward: bias, dropout, sum, LayerNorm; backward: LayerNorm's, the mask hashed
  again, the branch gradient and its bias's): the same mask (exactly), values to rounding."""
  x, dy, scale, bias = layer_norm_inputs(shape, dtype)
  branch = jax.random.normal(jax.random.key(11), shape).astype(dtype)
  branch_bias = 0.3 * jax.random.normal(jax.random.key(12), shape[-1:])
  seeds = jnp.asarray([17, -3], jnp.int32)
  hlo = jax.jit(jax.grad(lambda x: jnp.sum(ops.add_layer_norm(
      x, branch, scale, bias, seeds, 0.1, 1e-12, dtype, "pallas", branch_bias).astype(jnp.float32)))).lower(
      x).compile().as_text()
  assert hlo.lower().count("triton") >= 2  # both kernels
  pallas = add_layer_norm_outputs("pallas", x, branch, dy, scale, bias, seeds, 0.1, branch_bias)
  xla = add_layer_norm_outputs("xla", x, branch, dy, scale, bias, seeds, 0.1, branch_bias)
  np.testing.assert_array_equal(np.asarray(pallas[2]) == 0, np.asarray(xla[2]) == 0)  # dbranch: the same mask
  for name, a, b in zip(("y", "dx", "dbranch", "dscale", "dbias", "dbranch_bias"), pallas, xla):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    relative = np.linalg.norm(a - b) / np.linalg.norm(b)
    print(f"{shape} {jnp.dtype(dtype).name} {name}: relative {relative:.2e}, max-abs {np.max(np.abs(a - b)):.2e}")
    assert relative < (1e-2 if dtype == jnp.bfloat16 else 1e-5)
