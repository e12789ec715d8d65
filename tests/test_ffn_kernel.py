"""`ops.gelu_feed_forward` (the FFN: two projections, exact GELU) and the pieces of its Hopper kernels that run on CPU.

The kernels themselves (`ffn_kernel.bias_gelu_matmul` and its ping-pong forms, Mosaic GPU) run on a Hopper GPU
only: tests/test_ffn_kernel_gpu.py checks them there against the XLA forms, tests/test_kernels_lower.py lowers
them here. Here: their erf, GELU and GELU' against `lax.erf` / `ops.gelu` / autodiff, the custom gradient that
the kernel path uses against autodiff of the XLA form, the ring depths, and that off GPU nothing changes.
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


def test_kernel_gelu_derivative_matches_autodiff():
  x = jnp.linspace(-9.0, 9.0, 100_001, dtype=jnp.float32)
  reference = jax.vmap(jax.grad(lambda v: 0.5 * v * (1.0 + jax.lax.erf(v / np.sqrt(2.0)))))(x)
  assert float(jnp.max(jnp.abs(ffn_kernel.gelu_derivative(x) - reference))) < 2e-6


def ffn_inputs(dtype, shape=(4, 16, 64), features=256):
  keys = jax.random.split(jax.random.key(3), 6)
  x = jax.random.normal(keys[0], shape, jnp.float32).astype(dtype)
  wi = (0.1 * jax.random.normal(keys[1], (shape[-1], features), jnp.float32)).astype(dtype)
  bi = 0.5 * jax.random.normal(keys[2], (features,), jnp.float32)
  wo = (0.1 * jax.random.normal(keys[3], (features, shape[-1]), jnp.float32)).astype(dtype)
  bo = 0.5 * jax.random.normal(keys[4], (shape[-1],), jnp.float32)
  dy = jax.random.normal(keys[5], shape, jnp.float32).astype(dtype)
  return (x, wi, bi, wo, bo), dy


def xla_feed_forward(x, wi, bi, wo, bo):
  return ops.bias_add(jnp.dot(ops.gelu(ops.bias_add(jnp.dot(x, wi), bi)), wo), bo)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gelu_feed_forward_custom_gradient_equals_autodiff(dtype):
  """The rule the kernel path differentiates with (`_gelu_feed_forward_bwd`), on the XLA forms, against autodiff
  of the FFN: the same ops, so equal to float rounding."""
  args, dy = ffn_inputs(dtype)
  custom = lambda *a: ops._gelu_feed_forward(*a, False, False)  # noqa: E731, SLF001
  y_ref, vjp_ref = jax.vjp(xla_feed_forward, *args)
  y, vjp = jax.vjp(custom, *args)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
  for name, a, b in zip(("dx", "dwi", "dbi", "dwo", "dbo"), vjp(dy), vjp_ref(dy)):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2  # bf16: the GEMMs' output rounding, summation order
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < tol, name


def test_feed_forward_off_gpu_is_the_xla_form():
  args, _ = ffn_inputs(jnp.bfloat16)
  assert not ffn_kernel.applies(args[0], args[1]) and not ffn_kernel.applies_dgelu(args[0], args[1])  # CPU
  np.testing.assert_array_equal(np.asarray(ops.gelu_feed_forward(*args), np.float32),
                                np.asarray(xla_feed_forward(*args), np.float32))


@pytest.mark.parametrize("k, stages", [(768, 3), (1024, 4), (512, 4), (256, 2), (640, None), (100, None)])
def test_pingpong_ring_depth_fills_each_slot_an_even_number_of_times(k, stages):
  assert ffn_kernel.pingpong_stages(k) == stages
  if stages:
    assert (k // 64) % (2 * stages) == 0


def test_supported_shapes_and_dtype():
  tiles = ffn_kernel.Tiles()
  assert not ffn_kernel.supported(32768, 768, 3072, jnp.float32, tiles)
  assert not ffn_kernel.supported(100, 768, 3072, jnp.bfloat16, tiles)  # rows not a multiple of 128
  assert not ffn_kernel.supported_pingpong(32768, 640, 3072, jnp.bfloat16)  # no even ring depth for K=640


def test_config_rejects_unknown_ffn_impl():
  with pytest.raises(ValueError, match="ffn_impl"):
    ModelConfig(ffn_impl="pallas")
