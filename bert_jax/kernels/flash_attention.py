"""Fused attention with attention-probability dropout: Pallas (Triton) kernels for GPU.

BERT drops 10% of every attention probability during pre-training. cuDNN's
fused kernel cannot draw a fresh mask per layer and step through JAX, so
without this module a dropout step falls back to XLA's unfused path
(float32 [batch, heads, L, L] logits, softmax and mask written to memory and
read back). These kernels follow FlashAttention-2: the forward pass keeps a
running max and sum per query row and never writes the probabilities; the
backward pass recomputes them from the saved log-sum-exp.

The kernels read the query, key and value projections in place from one fused
[B, L, H, 3, D] array (`fuse_qkv`; order key, value, query): the encoder
computes it as one GEMM. The backward pass runs the dQ kernel first (it also
computes delta = rowsum(out * d_out) for its rows), then the dK/dV kernel,
which writes keys and values as one 2-wide block into the same gradient array.
Given the projections' fused bias (`bias_h3d`), the backward kernels also sum
their dQ and dV tiles over the rows: the bias's gradient without another
pass over d(qkv).

The dropout mask is a pure function of (seed, global batch row, head, query,
key), `keep_mask` below: a 32-bit integer hash (MurmurHash3's finaliser, as
`dropout.py`) of (row, key pair) whose low and high 16 bits decide keys 2j and
2j + 1, each kept iff its half is under (1 - rate) * 2^16. The hash is most of
the kernels' non-matmul arithmetic; one per two probabilities halves it
(docs/performance.md). The backward
kernels recompute the mask instead of storing it, the XLA path of
`attention.py` uses the same function (so both implementations drop the same
probabilities), and under a sharded mesh every device hashes only its own rows
and heads, with global indices, so the mask does not depend on how the batch
is split.

Masking: `pack_ids` [B, L] (0 = padding, else the packed example id); a query
attends to keys of its own example only. Fully masked (padding) query rows
give zeros, as on the XLA path. Padding keys are masked by a bias added in the
multiply-add that scales the logits; only packed rows (`packed=True`) pay a
per-pair compare of pack ids. At head size 64 the kernels are bound by this
per-pair arithmetic rather than by the tensor cores, so constant factors (the
dropout and softmax scales) are applied once per tile, not per pair.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from bert_jax.kernels.dropout import dropout_seeds, element_index, fmix32
from bert_jax.parallel import sharding as sharding_lib

Array = jax.Array

_GOLDEN = int(np.array(0x9E3779B9, np.uint32).view(np.int32))
_NEG = -1e30  # Logit of a masked pair: finite, so fully masked rows never make inf - inf.
# The kernels keep logits, running maxima and the log-sum-exp in base 2 (logits times log2(e)): exp2 is one
# hardware instruction where exp is a short libdevice routine, once per probability in each of the three kernels.
_LOG2E = math.log2(math.e)
# Position of each projection on the fused array's axis 3: key and value first, so that the dK/dV kernel
# writes them as one block of two.
KEY, VALUE, QUERY = 0, 1, 2


class KernelParams(NamedTuple):
  """Tiles and Triton launch parameters of one kernel (bench/attention.py --sweep measures others).

  block_q, block_k: query rows and key rows per tile (shrunk to divide the length).
  """

  block_q: int
  block_k: int
  num_warps: int
  num_stages: int


# 64 x 64 tiles with 4 warps were the best of 16 tile and launch settings at lengths 128 and 512 (bench/attention.py);
# 3 pipeline stages made the two backward kernels faster than 2.
KERNEL_PARAMS = {"forward": KernelParams(64, 64, 4, 2), "dkdv": KernelParams(64, 64, 4, 3),
                 "dq": KernelParams(64, 64, 4, 3)}


def _row_keys(rows: Array, seed0: Array, seed1: Array) -> Array:
  """Per query row: the hash of (seed0, global row index), xor seed1 (so the per-pair hash needs no seed)."""
  return fmix32(rows ^ seed0) ^ seed1


def _kernel_row_keys(meta_ref, b, h, q_pos: Array, *, num_heads: int, q_len: int) -> Array:
  """`_row_keys` of query rows q_pos of the kernel's (batch b, head h): global indices, the shard's batch and head
  offsets and the seeds read from meta = [seed0, seed1, batch offset, head offset]."""
  rows = ((meta_ref[2] + b) * num_heads + meta_ref[3] + h) * q_len + q_pos
  return _row_keys(rows, meta_ref[0], meta_ref[1])


def keep_threshold16(rate: float) -> int:
  """Keep iff a 16-bit half of the hash is below this: probability 1 - rate to within 2^-17."""
  return int(round((1.0 - rate) * 2 ** 16))


def _keep(row_keys: Array, first_col: Array | int, num_cols: int, rate: float) -> Array:
  """[rows] x columns [first_col, first_col + num_cols) -> bool keep mask; first_col and num_cols even.

  One hash per (row, column pair): its low 16 bits decide the even column, its high 16 bits the odd one.
  """
  pairs = first_col // 2 + jnp.arange(num_cols // 2, dtype=jnp.int32)
  bits = fmix32(row_keys[:, None] + pairs[None, :] * _GOLDEN)
  halves = jnp.stack([bits & 0xFFFF, lax.shift_right_logical(bits, 16)], axis=-1)
  return halves.reshape(row_keys.shape[0], num_cols) < keep_threshold16(rate)


def keep_mask(seeds: Array, batch: int, heads: int, q_len: int, k_len: int, rate: float,
              query_positions: Array | None = None) -> Array:
  """The [batch, heads, q_len, k_len] boolean keep mask of attention dropout.

  Element (b, h, q, k) is kept iff half k % 2 of hash(seeds, (b * heads + h) * q_len + q, k // 2) falls
  under (1 - rate) of the 16-bit range: i.i.d. Bernoulli(1 - rate) for practical purposes (tests check the
  keep rate and the independence of neighbours along every axis, the two halves of a pair included).

  query_positions: [batch, Q] int, the mask's rows at these queries of a self-attention over k_len positions
  ([batch, heads, Q, k_len], row q of it row query_positions[b, q] of the full mask; q_len is ignored).
  """
  if query_positions is not None:
    heads_bh1 = jnp.arange(heads, dtype=jnp.int32)[None, :, None]
    rows = (jnp.arange(batch, dtype=jnp.int32)[:, None, None] * heads + heads_bh1) * k_len
    rows = rows + query_positions.astype(jnp.int32)[:, None, :]
    q_len = query_positions.shape[1]
  else:
    rows = element_index((batch, heads, q_len))
  keys = _row_keys(rows.reshape(-1), seeds[0], seeds[1])
  padded = k_len + k_len % 2
  keep = _keep(keys, 0, padded, rate)[:, :k_len]
  return keep.reshape(batch, heads, q_len, k_len)


def supported(*, head_dim: int, q_len: int, k_len: int) -> bool:
  """Whether the kernels take these shapes (power-of-two head size, lengths in whole blocks)."""
  power_of_two = head_dim >= 16 and head_dim & (head_dim - 1) == 0 and head_dim <= 128
  return power_of_two and q_len % 16 == 0 and k_len % 16 == 0


def _block(length: int, preferred: int) -> int:
  """The largest power of two <= `preferred` that divides `length` (Triton tiles are powers of two)."""
  block = min(preferred, 1 << (length.bit_length() - 1))
  while length % block:
    block //= 2
  return block


def _dot(a: Array, b: Array) -> Array:
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _key_bias(pack_k: Array) -> Array:
  """[bk] float32 added to the logits: 0 for a real key, _NEG for padding (masks padding keys in the same
  multiply-add that scales the logits, instead of a compare and a select per pair)."""
  return jnp.where(pack_k > 0, 0.0, _NEG)


def _scores(q, k, key_bias, pack_q, pack_k, q_pos, k_pos, *, scale: float, packed: bool, causal: bool):
  """Float32 logits [bq, bk] times `scale`, masked pairs at _NEG (see `_forward_kernel` for padding rows)."""
  s = _dot(q, k.T) * scale + key_bias[None, :]
  if packed:
    s = jnp.where(pack_q[:, None] == pack_k[None, :], s, _NEG)
  if causal:
    s = jnp.where(q_pos[:, None] >= k_pos[None, :], s, _NEG)
  return s


def _forward_kernel(meta_ref, pack_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, packed, causal, rate,
                    block_k, num_heads, q_len):
  """Output and base-2 log-sum-exp of one query tile.

  Every query row but padding has at least one allowed key (itself), so its running maximum is a real logit
  after the last tile and masked pairs (at _NEG) contribute exp2(_NEG - max) = 0 to its sums. A padding row
  (pack id 0) has none: its sums are garbage, so its output is set to 0 and its log-sum-exp to -_NEG, which
  makes every probability the backward kernels recompute for it 0. Hence no select per pair here.
  """
  iq, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  block_q = q_ref.shape[0]
  q = q_ref[...]
  q_pos = iq * block_q + jnp.arange(block_q, dtype=jnp.int32)
  pack_q = pack_ref[pl.ds(iq * block_q, block_q)]
  if rate > 0:
    row_keys = _kernel_row_keys(meta_ref, b, h, q_pos, num_heads=num_heads, q_len=q_len)

  def body(ik, carry):
    acc, m, l = carry
    k_pos = ik * block_k + jnp.arange(block_k, dtype=jnp.int32)
    cols = pl.ds(ik * block_k, block_k)
    k, v, pack_k = k_ref[cols, :], v_ref[cols, :], pack_ref[cols]
    s = _scores(q, k, _key_bias(pack_k), pack_q, pack_k, q_pos, k_pos, scale=scale * _LOG2E, packed=packed,
                causal=causal)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    correction = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l = l * correction + jnp.sum(p, axis=1)
    if rate > 0:
      p = jnp.where(_keep(row_keys, ik * block_k, block_k, rate), p, 0.0)
    acc = acc * correction[:, None] + _dot(p.astype(v.dtype), v)
    return acc, m_new, l

  acc = jnp.zeros(q.shape, jnp.float32)
  m = jnp.full((block_q,), _NEG, jnp.float32)
  l = jnp.zeros((block_q,), jnp.float32)
  acc, m, l = lax.fori_loop(0, k_ref.shape[0] // block_k, body, (acc, m, l))
  live = pack_q > 0
  inv = jnp.where(live, 1.0 / ((1.0 - rate) * l), 0.0)
  o_ref[...] = (acc * inv[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(live, m + jnp.log2(l), -_NEG)


# The backward kernels leave the constant factors of the gradients out of the per-pair arithmetic. With c =
# 1 / (1 - rate) and keep the dropout mask, the logits' gradient is ds = p * (c * keep * dp - delta) * scale
# = (c * scale) * p * (keep * dp - (1 - rate) * delta): the kernels compute p * (keep * dp - (1 - rate) * delta)
# (the factor on delta once per row) and apply c * scale to dK and dQ once per tile, and c to dV.

def _column_sums(tile: Array) -> Array:
  """[rows, D] (bf16) -> [D] float32 sums over the rows, on the tensor cores: ones[16, rows] @ tile, then the
  maximum of its 16 equal rows.

  The tile's rows are spread over the program's warps, so `jnp.sum(tile, axis=0)` is a cross-warp reduction:
  dozens of warp shuffles and several barriers a program, which made the backward kernels markedly slower. With
  16 rows the product's columns are spread over the warps, each warp holding all 16 (equal) rows of its columns:
  the maximum over them stays inside a warp; the few extra shuffles and barriers cost far less than the separate
  pass over d(qkv) that the sums replace.
  The sum is over the bf16 values the kernel stores, with float32 accumulation, as XLA's reduction of d(qkv).
  """
  ones = jnp.ones((16, tile.shape[0]), tile.dtype)
  return jnp.max(jnp.dot(ones, tile, preferred_element_type=jnp.float32), axis=0)


def _dkdv_kernel(meta_ref, pack_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dkv_ref, *sums_ref,
                 scale, packed, causal, rate, block_q, num_heads, q_len):
  """dK and dV of one key tile (and, with `sums_ref`, dV's sums over the tile's rows: the value bias's
  gradient)."""
  del dq_ref  # The dQ kernel's output, aliased to this kernel's: only its key and value slots are written here.
  ik, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  block_k = k_ref.shape[0]
  k, v = k_ref[...], v_ref[...]
  k_pos = ik * block_k + jnp.arange(block_k, dtype=jnp.int32)
  pack_k = pack_ref[pl.ds(ik * block_k, block_k)]
  key_bias = _key_bias(pack_k)

  def body(iq, carry):
    dk, dv = carry
    q_pos = iq * block_q + jnp.arange(block_q, dtype=jnp.int32)
    rows = pl.ds(iq * block_q, block_q)
    q, do = q_ref[rows, :], do_ref[rows, :]
    s = _scores(q, k, key_bias, pack_ref[rows], pack_k, q_pos, k_pos, scale=scale * _LOG2E, packed=packed,
                causal=causal)
    p = jnp.exp2(s - lse_ref[rows][:, None])
    dp = _dot(do, v.T)
    if rate > 0:
      keep = _keep(_kernel_row_keys(meta_ref, b, h, q_pos, num_heads=num_heads, q_len=q_len), ik * block_k,
                   block_k, rate)
      p_kept = jnp.where(keep, p, 0.0)
      dp = jnp.where(keep, dp, 0.0)
    else:
      p_kept = p
    dv = dv + _dot(p_kept.astype(do.dtype).T, do)
    ds = p * (dp - ((1.0 - rate) * delta_ref[rows])[:, None])
    dk = dk + _dot(ds.astype(q.dtype).T, q)
    return dk, dv

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, q_ref.shape[0] // block_q, body, (zeros, zeros))
  dkv_ref[:, KEY, :] = (dk * (scale / (1.0 - rate))).astype(dkv_ref.dtype)
  dv = (dv * (1.0 / (1.0 - rate))).astype(dkv_ref.dtype)
  dkv_ref[:, VALUE, :] = dv
  if sums_ref:
    sums_ref[0][...] = _column_sums(dv)


def _dq_kernel(meta_ref, pack_ref, q_ref, k_ref, v_ref, o_ref, do_ref, lse_ref, dq_ref, delta_ref, *sums_ref,
               scale, packed, causal, rate, block_k, num_heads, q_len):
  """dQ of one query tile, and delta = rowsum(out * d_out) of its rows for the dK/dV kernel (which runs
  after this one: no separate pass over the output and its gradient); with `sums_ref`, dQ's sums over the
  tile's rows (the query bias's gradient)."""
  iq, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  block_q = q_ref.shape[0]
  q, do, lse = q_ref[...], do_ref[...], lse_ref[...]
  delta = jnp.sum(o_ref[...].astype(jnp.float32) * do.astype(jnp.float32), axis=1)
  delta_ref[...] = delta
  delta_kept = (1.0 - rate) * delta
  q_pos = iq * block_q + jnp.arange(block_q, dtype=jnp.int32)
  pack_q = pack_ref[pl.ds(iq * block_q, block_q)]
  if rate > 0:
    row_keys = _kernel_row_keys(meta_ref, b, h, q_pos, num_heads=num_heads, q_len=q_len)

  def body(ik, dq):
    k_pos = ik * block_k + jnp.arange(block_k, dtype=jnp.int32)
    cols = pl.ds(ik * block_k, block_k)
    k, v, pack_k = k_ref[cols, :], v_ref[cols, :], pack_ref[cols]
    s = _scores(q, k, _key_bias(pack_k), pack_q, pack_k, q_pos, k_pos, scale=scale * _LOG2E, packed=packed,
                causal=causal)
    p = jnp.exp2(s - lse[:, None])
    dp = _dot(do, v.T)
    if rate > 0:
      dp = jnp.where(_keep(row_keys, ik * block_k, block_k, rate), dp, 0.0)
    ds = p * (dp - delta_kept[:, None])
    return dq + _dot(ds.astype(k.dtype), k)

  dq = lax.fori_loop(0, k_ref.shape[0] // block_k, body, jnp.zeros(q.shape, jnp.float32))
  dq = (dq * (scale / (1.0 - rate))).astype(dq_ref.dtype)
  dq_ref[...] = dq
  if sums_ref:
    sums_ref[0][...] = _column_sums(dq)


def _compiler_params(kernel: str):
  from jax.experimental.pallas import triton as plgpu
  params = KERNEL_PARAMS[kernel]
  return plgpu.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages)


def _blocks(kernel: str, length: int) -> tuple[int, int]:
  params = KERNEL_PARAMS[kernel]
  return _block(length, params.block_q), _block(length, params.block_k)


def _fused_spec(length: int, head_dim: int, block: int | None, index, slot: int):
  """BlockSpec of one projection (`slot`) of the fused [B, L, H, 3, D] array: one (batch, head), `block` rows
  (None: all) at index(i)."""
  rows = length if block is None else block
  return pl.BlockSpec((None, rows, None, None, head_dim), lambda i, b, h: (b, index(i), h, slot, 0))


def _specs(length: int, head_dim: int, block: int | None, index):
  """BlockSpec of a [B, L, H, D] operand: one (batch, head), `block` rows (None: all) at index(i)."""
  rows = length if block is None else block
  return pl.BlockSpec((None, rows, None, head_dim), lambda i, b, h: (b, index(i), h, 0))


def _common_specs(length: int):
  return [pl.BlockSpec((4,), lambda i, b, h: (0,)), pl.BlockSpec((None, length), lambda i, b, h: (b, 0))]


def _forward(qkv, pack_ids, meta, scale, packed, causal, rate, num_heads, interpret):
  batch, length, heads, _, head_dim = qkv.shape
  block_q, block_k = _blocks("forward", length)
  kernel = functools.partial(_forward_kernel, scale=scale, packed=packed, causal=causal, rate=rate,
                             block_k=block_k, num_heads=num_heads, q_len=length)
  everything = lambda slot: _fused_spec(length, head_dim, None, lambda i: 0, slot)  # noqa: E731
  out, lse = pl.pallas_call(
      kernel,
      grid=(length // block_q, batch, heads),
      in_specs=[*_common_specs(length), _fused_spec(length, head_dim, block_q, lambda i: i, QUERY),
                everything(KEY), everything(VALUE)],
      out_specs=[_specs(length, head_dim, block_q, lambda i: i),
                 pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))],
      out_shape=[jax.ShapeDtypeStruct((batch, length, heads, head_dim), qkv.dtype),
                 jax.ShapeDtypeStruct((batch, heads, length), jnp.float32)],
      compiler_params=None if interpret else _compiler_params("forward"),
      interpret=interpret,
      name="flash_attention_forward",
  )(meta, pack_ids, qkv, qkv, qkv)
  return out, lse


def _backward(qkv, pack_ids, meta, out, lse, d_out, scale, packed, causal, rate, num_heads, interpret, bias_sums):
  """d(qkv) [B, L, H, 3, D]: the dQ kernel writes slot QUERY (and delta), then the dK/dV kernel slots KEY and
  VALUE in place. With `bias_sums`, also the float32 sums of the query and value slots over all rows, [H, 2, D]
  (value, query: `fuse_qkv`'s order), each kernel's per-tile sums added up here."""
  batch, length, heads, _, head_dim = qkv.shape

  def tile_sums(block):  # [B, tiles, H, D] float32, one row per program
    return ([pl.BlockSpec((None, None, None, head_dim), lambda i, b, h: (b, i, h, 0))],
            [jax.ShapeDtypeStruct((batch, length // block, heads, head_dim), jnp.float32)])

  common = dict(scale=scale, packed=packed, causal=causal, rate=rate, num_heads=num_heads, q_len=length)
  all_rows = lambda slot: _fused_spec(length, head_dim, None, lambda i: 0, slot)  # noqa: E731

  block_q, block_k = _blocks("dq", length)
  q_rows = _fused_spec(length, head_dim, block_q, lambda i: i, QUERY)
  out_rows = _specs(length, head_dim, block_q, lambda i: i)
  row_block = pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))
  sum_specs, sum_shapes = tile_sums(block_q) if bias_sums else ([], [])
  d_qkv, delta, *q_sums = pl.pallas_call(
      functools.partial(_dq_kernel, block_k=block_k, **common),
      grid=(length // block_q, batch, heads),
      in_specs=[*_common_specs(length), q_rows, all_rows(KEY), all_rows(VALUE), out_rows, out_rows, row_block],
      out_specs=[q_rows, row_block, *sum_specs],
      out_shape=[jax.ShapeDtypeStruct(qkv.shape, qkv.dtype),
                 jax.ShapeDtypeStruct((batch, heads, length), jnp.float32), *sum_shapes],
      compiler_params=None if interpret else _compiler_params("dq"),
      interpret=interpret,
      name="flash_attention_dq",
  )(meta, pack_ids, qkv, qkv, qkv, out, d_out, lse)

  block_q, block_k = _blocks("dkdv", length)
  k_rows = lambda slot: _fused_spec(length, head_dim, block_k, lambda i: i, slot)  # noqa: E731
  kv_block = pl.BlockSpec((None, block_k, None, 2, head_dim), lambda i, b, h: (b, i, h, 0, 0))
  row_stats = pl.BlockSpec((None, None, length), lambda i, b, h: (b, h, 0))
  sum_specs, sum_shapes = tile_sums(block_k) if bias_sums else ([], [])
  d_qkv, *v_sums = pl.pallas_call(
      functools.partial(_dkdv_kernel, block_q=block_q, **common),
      grid=(length // block_k, batch, heads),
      in_specs=[*_common_specs(length), all_rows(QUERY), k_rows(KEY), k_rows(VALUE),
                _specs(length, head_dim, None, lambda i: 0), row_stats, row_stats, kv_block],
      out_specs=[kv_block, *sum_specs],
      out_shape=[jax.ShapeDtypeStruct(qkv.shape, qkv.dtype), *sum_shapes],
      input_output_aliases={8: 0},
      compiler_params=None if interpret else _compiler_params("dkdv"),
      interpret=interpret,
      name="flash_attention_dkdv",
  )(meta, pack_ids, qkv, qkv, qkv, d_out, lse, delta, d_qkv)
  if not bias_sums:
    return d_qkv, None
  sums = jnp.stack([jnp.sum(s, axis=(0, 1)) for s in (*v_sums, *q_sums)], axis=1)  # [H, 2, D]: VALUE, QUERY
  return d_qkv, sums


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _flash(qkv, pack_ids, meta, bias, scale, packed, causal, rate, num_heads, interpret):
  """The kernels' attention of `qkv`. `bias` ([H, 3, D] or None) is not read: it is the fused bias the caller
  has already added to `qkv` (without a gradient through that add); its gradient comes from here, the backward
  kernels' row sums of the query and value slots, and 0 for the key slot (`add_qkv_bias`)."""
  del bias
  return _forward(qkv, pack_ids, meta, scale, packed, causal, rate, num_heads, interpret)[0]


def _flash_fwd(qkv, pack_ids, meta, bias, scale, packed, causal, rate, num_heads, interpret):
  out, lse = _forward(qkv, pack_ids, meta, scale, packed, causal, rate, num_heads, interpret)
  return out, (qkv, pack_ids, meta, bias, out, lse)


def _flash_bwd(scale, packed, causal, rate, num_heads, interpret, residuals, d_out):
  qkv, pack_ids, meta, bias, out, lse = residuals
  d_qkv, sums = _backward(qkv, pack_ids, meta, out, lse, d_out, scale, packed, causal, rate, num_heads,
                          interpret, bias_sums=bias is not None)
  return d_qkv, None, None, None if bias is None else _bias_gradient(sums, bias.dtype)


_flash.defvjp(_flash_fwd, _flash_bwd)


def fuse_qkv(query: Array, key: Array, value: Array) -> Array:
  """The kernels' fused layout of separate projections [..., H, D] -> [..., H, 3, D] (a copy: the encoder fuses
  its weights [E, H, D] and biases [H, D] with this and computes the fused projection as one GEMM)."""
  parts = [None] * 3
  parts[QUERY], parts[KEY], parts[VALUE] = query, key, value
  return jnp.stack(parts, axis=-2)


@jax.custom_vjp
def add_qkv_bias(qkv: Array, bias_h3d: Array) -> Array:
  """qkv [..., H * 3 * D] or [..., H, 3, D] + the fused bias [H, 3, D] (`fuse_qkv`'s layout), in qkv's dtype, as
  `ops.bias_add` (the add XLA fuses into the GEMM that produces qkv); the gradient of the query and value slots
  summed over the rows in float32, the key slot's exactly 0.

  A key bias adds q . b_k to every score of query q, a shift of the whole row that the softmax ignores: it has
  no effect on the output whatever its value (padding, packing and causal masks are per-pair and leave it a
  shift too; rotary positions, which rotate b_k by key position, do not take this path). Autodiff would sum
  only the rounding noise of the key gradients there, a third of the reduction's reads, and AdamW would turn that
  noise into updates of the learning rate's size.
  """
  return _add_bias(qkv, bias_h3d)


def _add_bias(qkv: Array, bias_h3d: Array) -> Array:
  """qkv [..., H * 3 * D] or [..., H, 3, D] plus the fused bias [H, 3, D], in qkv's dtype, on the [rows, H * 3 *
  D] view: the add XLA fuses into the epilogue of the GEMM that produces qkv."""
  width = bias_h3d.size
  return (qkv.reshape(-1, width) + bias_h3d.reshape(width).astype(qkv.dtype)).reshape(qkv.shape)


def _add_qkv_bias_fwd(qkv, bias_h3d):
  return add_qkv_bias(qkv, bias_h3d), bias_h3d


def _add_qkv_bias_bwd(bias_h3d, d_qkv):
  heads, three, head_dim = bias_h3d.shape
  assert three == 3
  rows = d_qkv.reshape(-1, heads, 3, head_dim)[:, :, KEY + 1:, :]
  return d_qkv, _bias_gradient(jnp.sum(rows.astype(jnp.float32), axis=0), bias_h3d.dtype)


def _bias_gradient(sums_h2d: Array, dtype) -> Array:
  """The fused bias's gradient [H, 3, D] from the float32 sums of its trained slots [H, 2, D] (value, query):
  the key slot's is 0 (`add_qkv_bias`)."""
  assert KEY == 0, "the trained slots (value, query) are the last two"
  return jnp.concatenate([jnp.zeros_like(sums_h2d[:, :1]), sums_h2d], axis=1).astype(dtype)


add_qkv_bias.defvjp(_add_qkv_bias_fwd, _add_qkv_bias_bwd)


def split_qkv(qkv: Array) -> tuple[Array, Array, Array]:
  """(query, key, value) [..., H, D] of a fused [..., H, 3, D] array."""
  return qkv[..., QUERY, :], qkv[..., KEY, :], qkv[..., VALUE, :]


def flash_attention(qkv_blh3d: Array, *, pack_ids: Array | None, packed: bool = False, causal: bool = False,
                    dropout_rate: float = 0.0, dropout_rng: Array | None = None, bias_h3d: Array | None = None,
                    interpret: bool = False) -> Array:
  """Fused self-attention with dropout: [B, L, H, 3, D] projections in (`fuse_qkv`), [B, L, H, D] out.

  pack_ids: [B, L] int, 0 for padding, else the packed example id (None: no padding). packed: whether rows may
  hold several examples; if False, pack_ids must be 0 or 1 and only padding is masked (no per-pair compare).
  bias_h3d: the projections' fused bias [H, 3, D] (`fuse_qkv`'s layout), added to qkv_blh3d first, with
  `add_qkv_bias`'s value and gradient: the backward kernels sum the query and value slots of d(qkv) over their
  tiles' rows as they write them (instead of a separate pass over d(qkv)), and the key slot's gradient is 0.

  See the module docstring. Inside a mesh scope the kernels run per shard
  (`shard_map`) with batch and heads split as the logical axis rules say
  ("batch", "heads"); the dropout mask stays that of the unsharded call.
  """
  batch, length, heads, three, head_dim = qkv_blh3d.shape
  if three != 3 or not supported(head_dim=head_dim, q_len=length, k_len=length):
    raise ValueError(f"flash attention needs fused [batch, length, heads, 3, head_dim] projections with a "
                     f"power-of-two head size in [16, 128] and a length that is a multiple of 16, got "
                     f"{qkv_blh3d.shape}")
  rate = float(dropout_rate) if dropout_rng is not None else 0.0
  seeds = dropout_seeds(dropout_rng) if rate > 0 else jnp.zeros((2,), jnp.int32)
  if pack_ids is None:
    pack_ids = jnp.ones((batch, length), jnp.int32)
  if pack_ids.shape != (batch, length):
    raise ValueError(f"flash attention: pack_ids [batch, length] = {(batch, length)} expected, got "
                     f"{pack_ids.shape}")
  pack_ids = pack_ids.astype(jnp.int32)
  if bias_h3d is not None:
    if bias_h3d.shape != (heads, 3, head_dim):
      raise ValueError(f"flash attention: bias [heads, 3, head_dim] = {(heads, 3, head_dim)} expected, got "
                       f"{bias_h3d.shape}")
    # Outside the kernels' custom VJP and shard_map, so that XLA fuses the add into the GEMM that made qkv; the
    # bias's gradient comes from the kernels (`_flash`).
    qkv_blh3d = _add_bias(qkv_blh3d, lax.stop_gradient(bias_h3d))
  scale = 1.0 / math.sqrt(head_dim)
  # The mask hashes global (batch row, head) indices: the unsharded head count, the shard's offsets in meta.
  run = functools.partial(_flash, scale=scale, packed=packed, causal=causal, rate=rate, num_heads=heads,
                          interpret=interpret)

  mesh = sharding_lib.current_mesh()
  if mesh is None or mesh.size == 1:
    meta = jnp.concatenate([seeds, jnp.zeros((2,), jnp.int32)])
    return run(qkv_blh3d, pack_ids, meta, bias_h3d)

  from jax.sharding import PartitionSpec as P
  batch_axes, _, head_axes, _ = sharding_lib.split_axes(("batch", "length", "heads", "kv"),
                                                        (batch, length, heads, head_dim), mesh)
  out_spec = P(batch_axes or None, None, head_axes or None, None)
  qkv_spec = P(batch_axes or None, None, head_axes or None, None, None)

  bias_spec = P() if bias_h3d is None else P(head_axes or None, None, None)

  def per_shard(qkv, pack, seeds, bias):
    b_offset = lax.axis_index(batch_axes) * qkv.shape[0] if batch_axes else 0
    h_offset = lax.axis_index(head_axes) * qkv.shape[2] if head_axes else 0
    meta = jnp.stack([seeds[0], seeds[1], jnp.int32(b_offset), jnp.int32(h_offset)]).astype(jnp.int32)
    return run(qkv, pack, meta, bias)

  # The bias's gradient: each shard's sums over its own rows, which shard_map's transpose adds over the batch axes.
  return jax.shard_map(per_shard, mesh=mesh, in_specs=(qkv_spec, P(batch_axes or None, None), P(), bias_spec),
                       out_specs=out_spec, check_vma=False)(qkv_blh3d, pack_ids, seeds, bias_h3d)
