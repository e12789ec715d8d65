"""Fused attention with attention-probability dropout: Pallas (Triton) kernels for GPU.

BERT drops 10% of every attention probability during pre-training. cuDNN's
fused kernel cannot draw a fresh mask per layer and step through JAX, so
without this module a dropout step falls back to XLA's unfused path
(float32 [batch, heads, L, L] logits, softmax and mask written to memory and
read back). These kernels follow FlashAttention-2: the forward pass keeps a
running max and sum per query row and never writes the probabilities; the
backward pass recomputes them from the saved log-sum-exp.

The dropout mask is a pure function of (seed, global batch row, head, query,
key), `keep_mask` below: a 32-bit integer hash (MurmurHash3 finalisers, as
`dropout.py`) compared with (1 - rate) * 2^31. The backward kernels recompute it instead of
storing it, the XLA path of `attention.py` uses the same function (so both
implementations drop the same probabilities), and under a sharded mesh every
device hashes only its own rows and heads, with global indices, so the mask
does not depend on how the batch is split.

Masking: `pack_ids` [B, L] (0 = padding, else the packed example id); a query
attends to keys of its own example only. Fully masked (padding) query rows
give zeros, as on the XLA path.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from bert_jax.models.dropout import dropout_seeds, element_index, fmix32, keep_bits
from bert_jax.parallel import sharding as sharding_lib

Array = jax.Array

_GOLDEN = int(np.array(0x9E3779B9, np.uint32).view(np.int32))
_NEG = -1e30  # Logit of a masked pair: finite, so fully masked rows never make inf - inf.
BLOCK_Q = 64
BLOCK_K = 64
# Triton launch parameters (num_warps, num_stages) per kernel; bench/attention.py --sweep measures others.
KERNEL_PARAMS = {"forward": (4, 2), "dkdv": (4, 2), "dq": (4, 2)}


def _row_keys(rows: Array, seed0: Array) -> Array:
  return fmix32(rows ^ seed0)


def _keep(row_keys: Array, cols: Array, seed1: Array, rate: float) -> Array:
  """[rows] x [cols] -> bool keep mask."""
  return keep_bits(fmix32((row_keys[:, None] + cols[None, :] * _GOLDEN) ^ seed1), rate)


def keep_mask(seeds: Array, batch: int, heads: int, q_len: int, k_len: int, rate: float) -> Array:
  """The [batch, heads, q_len, k_len] boolean keep mask of attention dropout.

  Element (b, h, q, k) is kept iff hash(seeds, ((b * heads + h) * q_len + q), k)
  falls under (1 - rate) of the 31-bit range: i.i.d. Bernoulli(1 - rate) for
  practical purposes (tests check the keep rate and pairwise independence).
  """
  keys = _row_keys(element_index((batch, heads, q_len)).reshape(-1), seeds[0])
  keep = _keep(keys, jnp.arange(k_len, dtype=jnp.int32), seeds[1], rate)
  return keep.reshape(batch, heads, q_len, k_len)


def supported(*, head_dim: int, q_len: int, k_len: int) -> bool:
  """Whether the kernels take these shapes (power-of-two head size, lengths in whole blocks)."""
  power_of_two = head_dim >= 16 and head_dim & (head_dim - 1) == 0 and head_dim <= 128
  return power_of_two and q_len % 16 == 0 and k_len % 16 == 0


def _block(length: int, preferred: int) -> int:
  block = min(preferred, length)
  while length % block:
    block //= 2
  return block


def _dot(a: Array, b: Array) -> Array:
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _scores(q, k, pack_q, pack_k, q_pos, k_pos, *, scale: float, causal: bool):
  """Masked float32 logits [bq, bk] and the allowed-pair mask."""
  s = _dot(q, k.T) * scale
  allowed = (pack_q[:, None] == pack_k[None, :]) & (pack_k[None, :] > 0)
  if causal:
    allowed &= q_pos[:, None] >= k_pos[None, :]
  return jnp.where(allowed, s, _NEG), allowed


def _forward_kernel(meta_ref, pack_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, causal, rate, block_k,
                    num_heads, q_len):
  iq, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  block_q = q_ref.shape[0]
  q = q_ref[...]
  q_pos = iq * block_q + jnp.arange(block_q, dtype=jnp.int32)
  pack_q = pack_ref[pl.ds(iq * block_q, block_q)]
  if rate > 0:
    batch_row = meta_ref[2] + b
    head = meta_ref[3] + h
    row_keys = _row_keys((batch_row * num_heads + head) * q_len + q_pos, meta_ref[0])
    seed1 = meta_ref[1]

  def body(ik, carry):
    acc, m, l = carry
    k_pos = ik * block_k + jnp.arange(block_k, dtype=jnp.int32)
    k = k_ref[pl.ds(ik * block_k, block_k), :]
    v = v_ref[pl.ds(ik * block_k, block_k), :]
    s, allowed = _scores(q, k, pack_q, pack_ref[pl.ds(ik * block_k, block_k)], q_pos, k_pos, scale=scale,
                         causal=causal)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    correction = jnp.exp(m - m_new)
    p = jnp.where(allowed, jnp.exp(s - m_new[:, None]), 0.0)
    l = l * correction + jnp.sum(p, axis=1)
    if rate > 0:
      p = jnp.where(_keep(row_keys, k_pos, seed1, rate), p, 0.0)
    acc = acc * correction[:, None] + _dot(p.astype(v.dtype), v)
    return acc, m_new, l

  acc = jnp.zeros(q.shape, jnp.float32)
  m = jnp.full((block_q,), _NEG, jnp.float32)
  l = jnp.zeros((block_q,), jnp.float32)
  acc, m, l = lax.fori_loop(0, k_ref.shape[0] // block_k, body, (acc, m, l))
  nonempty = l > 0
  inv = jnp.where(nonempty, 1.0 / ((1.0 - rate) * jnp.where(nonempty, l, 1.0)), 0.0)
  o_ref[...] = (acc * inv[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(nonempty, m + jnp.log(jnp.where(nonempty, l, 1.0)), -_NEG)


def _dkdv_kernel(meta_ref, pack_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, scale,
                 causal, rate, block_q, num_heads, q_len):
  ik, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  block_k = k_ref.shape[0]
  k, v = k_ref[...], v_ref[...]
  k_pos = ik * block_k + jnp.arange(block_k, dtype=jnp.int32)
  pack_k = pack_ref[pl.ds(ik * block_k, block_k)]
  if rate > 0:
    row_base = ((meta_ref[2] + b) * num_heads + meta_ref[3] + h) * q_len
    seed0, seed1 = meta_ref[0], meta_ref[1]

  def body(iq, carry):
    dk, dv = carry
    q_pos = iq * block_q + jnp.arange(block_q, dtype=jnp.int32)
    rows = pl.ds(iq * block_q, block_q)
    q, do = q_ref[rows, :], do_ref[rows, :]
    s, _ = _scores(q, k, pack_ref[rows], pack_k, q_pos, k_pos, scale=scale, causal=causal)
    p = jnp.exp(s - lse_ref[rows][:, None])
    dp = _dot(do, v.T)
    if rate > 0:
      keep = _keep(_row_keys(row_base + q_pos, seed0), k_pos, seed1, rate)
      p_dropped = jnp.where(keep, p, 0.0) * (1.0 / (1.0 - rate))
      dp = jnp.where(keep, dp, 0.0) * (1.0 / (1.0 - rate))
    else:
      p_dropped = p
    dv = dv + _dot(p_dropped.astype(do.dtype).T, do)
    ds = p * (dp - delta_ref[rows][:, None]) * scale
    dk = dk + _dot(ds.astype(q.dtype).T, q)
    return dk, dv

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, q_ref.shape[0] // block_q, body, (zeros, zeros))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(meta_ref, pack_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, causal, rate,
               block_k, num_heads, q_len):
  iq, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  block_q = q_ref.shape[0]
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  q_pos = iq * block_q + jnp.arange(block_q, dtype=jnp.int32)
  pack_q = pack_ref[pl.ds(iq * block_q, block_q)]
  if rate > 0:
    row_keys = _row_keys(((meta_ref[2] + b) * num_heads + meta_ref[3] + h) * q_len + q_pos, meta_ref[0])
    seed1 = meta_ref[1]

  def body(ik, dq):
    k_pos = ik * block_k + jnp.arange(block_k, dtype=jnp.int32)
    cols = pl.ds(ik * block_k, block_k)
    k, v = k_ref[cols, :], v_ref[cols, :]
    s, _ = _scores(q, k, pack_q, pack_ref[cols], q_pos, k_pos, scale=scale, causal=causal)
    p = jnp.exp(s - lse[:, None])
    dp = _dot(do, v.T)
    if rate > 0:
      dp = jnp.where(_keep(row_keys, k_pos, seed1, rate), dp, 0.0) * (1.0 / (1.0 - rate))
    ds = p * (dp - delta[:, None]) * scale
    return dq + _dot(ds.astype(k.dtype), k)

  dq = lax.fori_loop(0, k_ref.shape[0] // block_k, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _compiler_params(kernel: str):
  from jax.experimental.pallas import triton as plgpu
  num_warps, num_stages = KERNEL_PARAMS[kernel]
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _specs(batch_len: int, head_dim: int, block: int | None, index):
  """BlockSpec of a [B, L, H, D] operand: one (batch, head), `block` rows (None: all) at index(i)."""
  rows = batch_len if block is None else block
  return pl.BlockSpec((None, rows, None, head_dim), lambda i, b, h: (b, index(i), h, 0))


def _common_specs(length: int):
  return [pl.BlockSpec((4,), lambda i, b, h: (0,)), pl.BlockSpec((None, length), lambda i, b, h: (b, 0))]


def _forward(q, k, v, pack_ids, meta, scale, causal, rate, num_heads, interpret):
  batch, q_len, heads, head_dim = q.shape
  k_len = k.shape[1]
  block_q, block_k = _block(q_len, BLOCK_Q), _block(k_len, BLOCK_K)
  kernel = functools.partial(_forward_kernel, scale=scale, causal=causal, rate=rate, block_k=block_k,
                             num_heads=num_heads, q_len=q_len)
  out, lse = pl.pallas_call(
      kernel,
      grid=(q_len // block_q, batch, heads),
      in_specs=[*_common_specs(k_len), _specs(q_len, head_dim, block_q, lambda i: i),
                _specs(k_len, head_dim, None, lambda i: 0), _specs(k_len, head_dim, None, lambda i: 0)],
      out_specs=[_specs(q_len, head_dim, block_q, lambda i: i),
                 pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)],
      compiler_params=None if interpret else _compiler_params("forward"),
      interpret=interpret,
      name="flash_attention_forward",
  )(meta, pack_ids, q, k, v)
  return out, lse


def _backward(q, k, v, pack_ids, meta, out, lse, d_out, scale, causal, rate, num_heads, interpret):
  batch, q_len, heads, head_dim = q.shape
  k_len = k.shape[1]
  delta = jnp.einsum("blhd,blhd->bhl", out.astype(jnp.float32), d_out.astype(jnp.float32))
  block_q, block_k = _block(q_len, BLOCK_Q), _block(k_len, BLOCK_K)
  common = dict(scale=scale, causal=causal, rate=rate, num_heads=num_heads, q_len=q_len)
  full_q, full_k = _specs(q_len, head_dim, None, lambda i: 0), _specs(k_len, head_dim, None, lambda i: 0)
  row_stats = pl.BlockSpec((None, None, q_len), lambda i, b, h: (b, h, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, block_q=block_q, **common),
      grid=(k_len // block_k, batch, heads),
      in_specs=[*_common_specs(k_len), full_q, _specs(k_len, head_dim, block_k, lambda i: i),
                _specs(k_len, head_dim, block_k, lambda i: i), full_q, row_stats, row_stats],
      out_specs=[_specs(k_len, head_dim, block_k, lambda i: i)] * 2,
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=None if interpret else _compiler_params("dkdv"),
      interpret=interpret,
      name="flash_attention_dkdv",
  )(meta, pack_ids, q, k, v, d_out, lse, delta)
  row_block = pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, block_k=block_k, **common),
      grid=(q_len // block_q, batch, heads),
      in_specs=[*_common_specs(k_len), _specs(q_len, head_dim, block_q, lambda i: i), full_k, full_k,
                _specs(q_len, head_dim, block_q, lambda i: i), row_block, row_block],
      out_specs=_specs(q_len, head_dim, block_q, lambda i: i),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=None if interpret else _compiler_params("dq"),
      interpret=interpret,
      name="flash_attention_dq",
  )(meta, pack_ids, q, k, v, d_out, lse, delta)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _flash(q, k, v, pack_ids, meta, scale, causal, rate, num_heads, interpret):
  return _forward(q, k, v, pack_ids, meta, scale, causal, rate, num_heads, interpret)[0]


def _flash_fwd(q, k, v, pack_ids, meta, scale, causal, rate, num_heads, interpret):
  out, lse = _forward(q, k, v, pack_ids, meta, scale, causal, rate, num_heads, interpret)
  return out, (q, k, v, pack_ids, meta, out, lse)


def _flash_bwd(scale, causal, rate, num_heads, interpret, residuals, d_out):
  q, k, v, pack_ids, meta, out, lse = residuals
  dq, dk, dv = _backward(q, k, v, pack_ids, meta, out, lse, d_out, scale, causal, rate, num_heads, interpret)
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(query_blhd: Array, key_blhd: Array, value_blhd: Array, *, pack_ids: Array | None,
                    causal: bool = False, dropout_rate: float = 0.0, dropout_rng: Array | None = None,
                    interpret: bool = False) -> Array:
  """Fused attention with dropout; [B, L, H, D] in and out (see the module docstring).

  Inside a mesh scope the kernels run per shard (`shard_map`) with batch and
  heads split as the logical axis rules say ("batch", "heads"); the dropout
  mask stays that of the unsharded call.
  """
  batch, q_len, heads, head_dim = query_blhd.shape
  if not supported(head_dim=head_dim, q_len=q_len, k_len=key_blhd.shape[1]):
    raise ValueError(f"flash attention needs a power-of-two head size in [16, 128] and lengths that are multiples "
                     f"of 16 (head_dim={head_dim}, q_len={q_len}, k_len={key_blhd.shape[1]})")
  rate = float(dropout_rate) if dropout_rng is not None else 0.0
  seeds = dropout_seeds(dropout_rng) if rate > 0 else jnp.zeros((2,), jnp.int32)
  if pack_ids is None:
    pack_ids = jnp.ones((batch, key_blhd.shape[1]), jnp.int32)
  if pack_ids.shape != (batch, key_blhd.shape[1]) or q_len != key_blhd.shape[1]:
    raise ValueError(f"flash attention: self-attention with pack_ids [batch, length] expected, got query "
                     f"{query_blhd.shape}, key {key_blhd.shape}, pack_ids {pack_ids.shape}")
  pack_ids = pack_ids.astype(jnp.int32)
  scale = 1.0 / math.sqrt(head_dim)
  run = functools.partial(_flash, scale=scale, causal=causal, rate=rate, num_heads=heads, interpret=interpret)

  mesh = sharding_lib.current_mesh()
  if mesh is None or mesh.size == 1:
    meta = jnp.concatenate([seeds, jnp.zeros((2,), jnp.int32)])
    return run(query_blhd, key_blhd, value_blhd, pack_ids, meta)

  from jax.sharding import PartitionSpec as P
  batch_axes, _, head_axes, _ = sharding_lib.split_axes(("batch", "length", "heads", "kv"), query_blhd.shape, mesh)
  qkv_spec = P(batch_axes or None, None, head_axes or None, None)

  def per_shard(q, k, v, pack, seeds):
    b_offset = lax.axis_index(batch_axes) * q.shape[0] if batch_axes else 0
    h_offset = lax.axis_index(head_axes) * q.shape[2] if head_axes else 0
    meta = jnp.stack([seeds[0], seeds[1], jnp.int32(b_offset), jnp.int32(h_offset)]).astype(jnp.int32)
    return run(q, k, v, pack, meta)

  return jax.shard_map(per_shard, mesh=mesh, in_specs=(qkv_spec, qkv_spec, qkv_spec, P(batch_axes or None, None), P()),
                       out_specs=qkv_spec, check_vma=False)(query_blhd, key_blhd, value_blhd, pack_ids, seeds)
