"""`ops.dense_gelu` (the FFN's projection + bias + exact GELU) and the pieces of its Hopper kernel that run on CPU.

The kernel itself (`ffn_kernel.bias_gelu_matmul`, Mosaic GPU) runs on a Hopper GPU only: tests/test_ffn_kernel_gpu.py
checks it there against the XLA form. Here: its erf and GELU against `lax.erf` / `ops.gelu`, the custom
gradient that the kernel path uses against autodiff of the XLA form, and that off GPU nothing changes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.models import ffn_kernel, ops
from bert_jax.models.config import ModelConfig


def test_kernel_erf_and_gelu_match_lax_to_float32_rounding():
  x = jnp.linspace(-9.0, 9.0, 100_001, dtype=jnp.float32)
  assert float(jnp.max(jnp.abs(ffn_kernel.erf(x) - jax.lax.erf(x)))) < 1e-6
  assert float(jnp.max(jnp.abs(ffn_kernel.gelu(x) - ops.gelu(x)))) < 2e-6


def ffn_inputs(dtype, shape=(4, 16, 64), features=256):
  keys = jax.random.split(jax.random.key(3), 4)
  x = jax.random.normal(keys[0], shape, jnp.float32).astype(dtype)
  kernel = (0.1 * jax.random.normal(keys[1], (shape[-1], features), jnp.float32)).astype(dtype)
  bias = 0.5 * jax.random.normal(keys[2], (features,), jnp.float32)
  dg = jax.random.normal(keys[3], shape[:-1] + (features,), jnp.float32).astype(dtype)
  return x, kernel, bias, dg


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_gelu_custom_gradient_equals_autodiff(dtype):
  """The rule the kernel path differentiates with (`_dense_gelu_bwd`), on the XLA forward pass, against autodiff
  of gelu(bias_add(x @ kernel, bias)): the same ops, so equal to float rounding."""
  x, kernel, bias, dg = ffn_inputs(dtype)
  reference = lambda x, k, b: ops.gelu(ops.bias_add(jnp.dot(x, k), b))  # noqa: E731
  custom = lambda x, k, b: ops._dense_gelu(x, k, b, False)  # noqa: E731, SLF001
  y_ref, vjp_ref = jax.vjp(reference, x, kernel, bias)
  y, vjp = jax.vjp(custom, x, kernel, bias)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
  for name, a, b in zip(("dx", "dkernel", "dbias"), vjp(dg), vjp_ref(dg)):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2  # bf16: the GEMMs' output rounding, summation order
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < tol, name


def test_dense_gelu_off_gpu_is_the_xla_form():
  x, kernel, bias, _ = ffn_inputs(jnp.bfloat16)
  assert not ffn_kernel.applies(x, kernel)  # CPU
  for impl in ("auto", "xla"):
    np.testing.assert_array_equal(np.asarray(ops.dense_gelu(x, kernel, bias, impl), np.float32),
                                  np.asarray(ops.gelu(ops.bias_add(jnp.dot(x, kernel), bias)), np.float32))


def test_supported_shapes_and_dtype():
  tiles = ffn_kernel.Tiles()
  assert not ffn_kernel.supported(32768, 768, 3072, jnp.float32, tiles)
  assert not ffn_kernel.supported(100, 768, 3072, jnp.bfloat16, tiles)  # rows not a multiple of 128


def test_config_rejects_unknown_ffn_impl():
  with pytest.raises(ValueError, match="ffn_impl"):
    ModelConfig(ffn_impl="pallas")
