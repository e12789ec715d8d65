"""Fused attention (cuDNN; our flash kernels with dropout) vs the XLA path on a GPU, in bfloat16.

Skipped without a GPU. Each fused path and XLA's bf16 path are compared with a
float32 XLA reference on the same inputs (relative error ||a - ref|| / ||ref||
over the real query rows) and with each other, forward and gradients; with
dropout all paths drop the same probabilities (one hash mask). `pytest -s`
prints the figures. The flash kernels' sums of the fused bias's gradient
against XLA's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.kernels import attention, flash_attention
from bert_jax.kernels.attention import dot_product_attention

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (cuDNN)")

# bf16 has an 8-bit mantissa (relative rounding 2**-9 ~ 2e-3); attention sums
# of a few hundred terms land at ~1e-2 in the worst element.
RELATIVE_TOLERANCE = 2e-2


def attention_errors(batch: int, length: int, heads: int, head_dim: int, packed: bool, seed: int = 0,
                     candidate: str = "cudnn", dropout_rate: float = 0.0, causal: bool = False) -> dict:
  """Max-abs and relative errors of out, dq, dk, dv: `candidate` vs XLA, and each vs float32.

  Rows have random real lengths (padding at the end); with `packed`, each row
  holds two examples (block-diagonal attention). Errors count real query rows
  and keys only.
  """
  keys = jax.random.split(jax.random.key(seed), 5)
  shape = (batch, length, heads, head_dim)
  q, k, v, cotangent = (jax.random.normal(key, shape, jnp.float32) for key in keys[:4])
  lengths = jax.random.randint(keys[4], (batch,), length // 2, length + 1)
  positions = jnp.arange(length)[None, :]
  pack_ids = (positions < lengths[:, None]).astype(jnp.int32)
  if packed:
    pack_ids = pack_ids * jnp.where(positions < lengths[:, None] // 2, 1, 2)
  real = (pack_ids > 0)[:, :, None, None]

  def loss(implementation, dtype):
    def f(q, k, v):
      out, _ = dot_product_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), pack_ids=pack_ids,
                                     packed=packed, causal=causal, implementation=implementation,
                                     dropout_rate=dropout_rate,
                                     dropout_rng=jax.random.key(seed + 1) if dropout_rate else None)
      out = jnp.where(real, out.astype(jnp.float32), 0.0)
      return jnp.sum(out * cotangent), out
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

  with jax.default_matmul_precision("highest"):
    (_, out_ref), grads_ref = loss("xla", jnp.float32)(q, k, v)
  results = {}
  outputs = {}
  for implementation in (candidate, "xla"):
    (_, out), grads = loss(implementation, jnp.bfloat16)(q, k, v)
    outputs[implementation] = (out,) + tuple(grads)
  reference = (out_ref,) + tuple(grads_ref)
  for name, index in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
    def compare(a, b):
      a, b = np.asarray(jnp.where(real, a, 0.0)), np.asarray(jnp.where(real, b, 0.0))
      return float(np.max(np.abs(a - b))), float(np.linalg.norm(a - b) / np.linalg.norm(b))
    results[name] = {"fused_vs_xla": compare(outputs[candidate][index], outputs["xla"][index]),
                     "fused_vs_f32": compare(outputs[candidate][index], reference[index]),
                     "xla_vs_f32": compare(outputs["xla"][index], reference[index])}
  return results


CASES = [("cudnn", 128, False, 0.0, False), ("cudnn", 512, False, 0.0, False), ("cudnn", 128, True, 0.0, False),
         ("flash", 128, False, 0.1, False), ("flash", 512, False, 0.1, False), ("flash", 128, True, 0.1, False),
         ("flash", 384, False, 0.0, True)]


@pytest.mark.parametrize("candidate,length,packed,dropout_rate,causal", CASES)
def test_fused_attention_matches_xla_in_bf16(candidate, length, packed, dropout_rate, causal):
  errors = attention_errors(batch=4, length=length, heads=12, head_dim=64, packed=packed, candidate=candidate,
                            dropout_rate=dropout_rate, causal=causal)
  for name, pairs in errors.items():
    print(f"{candidate} L={length} packed={packed} dropout={dropout_rate} causal={causal} {name}: " + ", ".join(
        f"{pair} max-abs {max_abs:.2e} rel {rel:.2e}" for pair, (max_abs, rel) in pairs.items()))
    for pair, (_, rel) in pairs.items():
      assert rel < RELATIVE_TOLERANCE, (name, pair, rel)
    # The fused path is no further from float32 than XLA's own bf16 path is, give or take rounding.
    assert pairs["fused_vs_f32"][1] < 2 * pairs["xla_vs_f32"][1] + 1e-3, (name, pairs)


@pytest.mark.parametrize("length,packed", [(128, False), (512, False), (128, True)])
def test_flash_kernels_sum_the_bias_gradient_as_xla_does(length, packed):
  """The fused bias's gradient from the backward kernels' tile sums (`flash_attention(bias_h3d=)`) against XLA's
  row sum of the same bf16 d(qkv) (`add_qkv_bias` before the kernels): the same output and d(qkv) bit for bit,
  the same sums up to float32 summation order, the key slot 0 in both."""
  batch, heads, head_dim = 8, 12, 64
  keys = jax.random.split(jax.random.key(0), 4)
  qkv = jax.random.normal(keys[0], (batch, length, heads, 3, head_dim), jnp.bfloat16)
  bias = 0.1 * jax.random.normal(keys[1], (heads, 3, head_dim), jnp.float32)
  cotangent = jax.random.normal(keys[2], (batch, length, heads, head_dim), jnp.bfloat16)
  lengths = jax.random.randint(keys[3], (batch,), length // 2, length + 1)
  positions = jnp.arange(length)[None, :]
  pack_ids = (positions < lengths[:, None]).astype(jnp.int32)
  if packed:
    pack_ids = pack_ids * jnp.where(positions < lengths[:, None] // 2, 1, 2)
  attend = functools.partial(flash_attention.flash_attention, pack_ids=pack_ids, packed=packed, dropout_rate=0.1,
                             dropout_rng=jax.random.key(1))

  def kernel_sums(qkv, bias):
    return attend(qkv, bias_h3d=bias)

  def xla_sums(qkv, bias):
    return attend(flash_attention.add_qkv_bias(qkv, bias))

  @jax.jit
  def both(qkv, bias, cotangent):
    results = []
    for f in (kernel_sums, xla_sums):
      out, pull = jax.vjp(f, qkv, bias)
      results.append((out, *pull(cotangent)))
    return results

  (out, d_qkv, d_bias), (want_out, want_qkv, want_bias) = both(qkv, bias, cotangent)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
  np.testing.assert_array_equal(np.asarray(d_qkv, np.float32), np.asarray(want_qkv, np.float32))
  d_bias, want_bias = np.asarray(d_bias), np.asarray(want_bias)
  scale = np.abs(want_bias).max()
  print(f"L={length} packed={packed}: bias gradient max |kernel - xla| {np.abs(d_bias - want_bias).max():.2e} of "
        f"{scale:.2e}")
  np.testing.assert_allclose(d_bias, want_bias, atol=1e-5 * scale)
  assert not np.any(d_bias[:, flash_attention.KEY]) and not np.any(want_bias[:, flash_attention.KEY])
