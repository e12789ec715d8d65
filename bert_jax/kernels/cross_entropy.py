"""The row statistics of a softmax cross-entropy over a vocabulary, in one Pallas (Triton) kernel for GPU.

The MLM loss needs, for each predicted position's row of logits [V]: the
log-sum-exp, the target's logit and (for the accuracy metric) the first index
of the row's maximum. XLA reads the [rows, V] logits twice for them: once for
the maximum fused with the argmax (a (value, index) reduction), once for the
sum of exponentials (at BERT-Base seq 128, 4864 x 30592 bfloat16 logits). XLA's
own one-pass form (one variadic reduction with an online-softmax combiner) was
slower still: its emitter runs the combiner's two exponentials per element
unvectorised.

Here one kernel reads the logits once. Its grid is (row blocks of `block_rows`,
`splits` of the columns): the row blocks alone would be about one wave of a
large GPU's resident warps (one warp a row), so each block's columns are split
over up to 8 programs, whose per-split statistics XLA combines ([8, rows],
a few kB). A program walks its columns in chunks of `chunk`: per chunk it
reduces each row to its maximum only; the sum of exp(x - running maximum)
(rescaled when the maximum grows: the online softmax) and each column slot's
best value and where it was first seen accumulate per slot and are reduced
across the columns once, at the end; the target's logit is one load a row.
The arithmetic is float32 on the logits' values, as `jax.nn.logsumexp` of the
float32 logits, in base 2 (exp2 is one instruction, exp a libdevice routine:
the loop went from ~200 to ~110 instructions per 8 logits); the sums' order
differs, so the log-sum-exp agrees to rounding (GPU: within 1.1e-7 relative);
the target's logit and the argmax (ties: the first index, as `jnp.argmax`) are
exact.

It runs in under half the time of XLA's reductions, near one read of the
logits (bench/cross_entropy.py; docs/performance.md).

Under a mesh the kernel runs per shard of the rows (`jax.shard_map` over the
rules' "batch" axes); where the rules split the vocabulary (tensor
parallelism) it does not apply and the caller uses XLA, which reduces across
the shards. Off GPU it runs in Pallas' interpreter (slow; for tests).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from bert_jax.parallel import sharding as sharding_lib

Array = jax.Array

_LOG2E = math.log2(math.e)
# Rows narrower than this are left to XLA (classification heads, span logits): the kernel is for vocabularies.
MIN_COLUMNS = 4096
# The launch: rows a program, columns a chunk, programs a row block (each taking 1 / SPLITS of the columns: at
# most SPLITS, as many as divide the chunks evenly), warps, pipeline stages of the chunk loop.
BLOCK_ROWS = 8
CHUNK = 256
SPLITS = 8
NUM_WARPS = 8
NUM_STAGES = 1


def supported(rows: int, columns: int, block_rows: int = BLOCK_ROWS) -> bool:
  """Whether the kernel takes [rows, columns] logits (else the caller uses XLA)."""
  return columns >= MIN_COLUMNS and rows % block_rows == 0 and rows > 0


def _kernel(logits_ref, targets_ref, maximum_ref, total_ref, index_ref, target_logit_ref, *, columns: int,
            chunk: int, chunks_per_split: int):
  """Online softmax statistics of `block_rows` rows over one split of their columns, chunk by chunk.

  Only the rows' running maximum is reduced across a chunk's columns (the exponentials need it); the sum of
  exponentials (rescaled when the maximum grows) and each column slot's best value and the start of the chunk
  that held it first accumulate per slot of a [rows, chunk] tile and are reduced across the columns once, after
  the split's last chunk, in base 2 (exp2 of the logits times log2(e), as the flash kernels'). Where `chunk` does
  not divide the columns, the last chunk of a split starts at most `chunk` columns before the end and skips the
  columns an earlier chunk took (the vocabulary's last chunk overlaps its predecessor). Every split also loads
  the rows' target logits (one element a row) and writes them, the same values, to the rows' one block."""
  rows = maximum_ref.shape[0]
  target_logit_ref[...] = logits_ref[jnp.arange(rows), targets_ref[...]].astype(jnp.float32)
  first_chunk = pl.program_id(1) * chunks_per_split

  def update(k, carry, overlap=False):
    maximum, total, best, start_of_best = carry
    first = k * chunk
    start = jnp.minimum(first, columns - chunk) if overlap else pl.multiple_of(first, chunk)
    x = logits_ref[:, pl.ds(start, chunk)].astype(jnp.float32)
    if overlap:
      x = jnp.where(start + jnp.arange(chunk, dtype=jnp.int32)[None, :] >= first, x, -jnp.inf)
    new_max = jnp.maximum(maximum, jnp.max(x, axis=1))
    scaled_max = (new_max * _LOG2E)[:, None]
    total = total * jnp.exp2((maximum - new_max) * _LOG2E)[:, None] + jnp.exp2(x * _LOG2E - scaled_max)
    better = x > best
    return new_max, total, jnp.where(better, x, best), jnp.where(better, start, start_of_best)

  tile = (rows, chunk)
  carry = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros(tile, jnp.float32),
           jnp.full(tile, -jnp.inf, jnp.float32), jnp.zeros(tile, jnp.int32))
  overlap = columns % chunk != 0
  carry = jax.lax.fori_loop(0, chunks_per_split - overlap, lambda j, c: update(first_chunk + j, c), carry)
  if overlap:
    carry = update(first_chunk + chunks_per_split - 1, carry, overlap=True)
  maximum, total, best, start_of_best = carry
  index = start_of_best + jnp.arange(chunk, dtype=jnp.int32)[None, :]
  maximum_ref[...] = maximum
  total_ref[...] = jnp.sum(total, axis=1)
  index_ref[...] = jnp.min(jnp.where(best == maximum[:, None], index, columns), axis=1)


def _statistics_2d(logits: Array, targets: Array, *, interpret: bool, block_rows: int = BLOCK_ROWS,
                   chunk: int = CHUNK, splits: int = SPLITS, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES
                   ) -> tuple[Array, Array, Array]:
  """(log_z, target_logit, argmax) of [rows, columns] logits: the kernel's statistics per split of the columns,
  combined."""
  rows, columns = logits.shape
  targets = jnp.where(targets < 0, targets + columns, targets)
  chunk = min(chunk, 1 << (columns.bit_length() - 1))
  chunks = -(-columns // chunk)
  splits = max(s for s in range(1, splits + 1) if chunks % s == 0)  # every split the same number of chunks
  partial = pl.BlockSpec((None, block_rows), lambda i, s: (s, i))
  row_block = pl.BlockSpec((block_rows,), lambda i, s: (i,))
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as plgpu
    compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  f32 = jax.ShapeDtypeStruct((splits, rows), jnp.float32)
  maximum, total, index, target_logit = pl.pallas_call(
      functools.partial(_kernel, columns=columns, chunk=chunk, chunks_per_split=chunks // splits),
      grid=(rows // block_rows, splits),
      in_specs=[pl.BlockSpec((block_rows, columns), lambda i, s: (i, 0)), row_block],
      out_specs=[partial] * 3 + [row_block],
      out_shape=[f32, f32, jax.ShapeDtypeStruct((splits, rows), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.float32)],
      compiler_params=compiler_params,
      interpret=interpret,
      name="cross_entropy_statistics",
  )(logits, jnp.clip(targets, 0, columns - 1))
  # As `jnp.take_along_axis`: a negative id counts from the end, one outside the vocabulary reads as NaN.
  target_logit = jnp.where((targets >= 0) & (targets < columns), target_logit, jnp.nan)
  overall = jnp.max(maximum, axis=0)
  log_z = overall + jnp.log(jnp.sum(total * jnp.exp(maximum - overall), axis=0))
  argmax = jnp.min(jnp.where(maximum == overall, index, columns), axis=0)
  return log_z, target_logit, argmax


def row_statistics(logits: Array, targets: Array, *, block_rows: int = BLOCK_ROWS, chunk: int = CHUNK,
                   splits: int = SPLITS, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES
                   ) -> tuple[Array, Array, Array] | None:
  """(log_z, target_logit, argmax) of logits [..., V] and int targets [...]: logsumexp(logits) and
  logits[target] in float32, and the first index of each row's maximum (int32), each [...].

  None where the kernel does not apply (`supported`, per device; the vocabulary split by the mesh): the caller
  then uses XLA. The launch: `block_rows` rows a program, up to `splits` programs a row block, columns `chunk`
  at a time, `num_warps`, `num_stages`.
  """
  columns = logits.shape[-1]
  lead = logits.shape[:-1]
  shards = sharding_lib.row_shards(logits)
  if shards is None:
    return None
  mesh, row_axes, rows = shards
  if not supported(rows, columns, block_rows):
    return None
  vocab_axes = sharding_lib.split_axes(("vocab",), (columns,), mesh)[0] if mesh is not None else ()
  if math.prod(mesh.shape[axis] for axis in vocab_axes) > 1:
    return None

  def call(logits, targets):
    return _statistics_2d(logits, targets, interpret=jax.default_backend() != "gpu", block_rows=block_rows,
                          chunk=chunk, splits=splits, num_warps=num_warps, num_stages=num_stages)

  call = sharding_lib.per_row_shard(call, mesh, row_axes, "rv", "vvv")
  outputs = call(logits.reshape(-1, columns), targets.reshape(-1).astype(jnp.int32))
  return tuple(a.reshape(lead) for a in outputs)


def cross_entropy_sums(logits: Array, targets: Array, weights: Array) -> tuple[Array, Array]:
  """Weighted sums of token cross-entropy and of correct argmax predictions (float32), with a one-pass backward.

  The rows' statistics come from `row_statistics` on GPU where it applies, from XLA elsewhere (narrow rows, a
  vocabulary split by the mesh, other backends).

  Args:
    logits: [..., V] in any float dtype (the arithmetic is float32).
    targets: [...] int class ids.
    weights: [...] per-token weights (0 for padding predictions).

  Returns:
    (sum of weight * (logsumexp(logits) - logits[target]), sum of weight * [argmax == target]).
  """
  return weighted_cross_entropy(logits, targets.astype(jnp.int32), weights.astype(jnp.float32), use_kernel())


def use_kernel() -> bool:
  """Whether `cross_entropy_sums` tries the kernel: on GPU (tests force it, to run it in Pallas' interpreter)."""
  return jax.default_backend() == "gpu"


def _row_statistics(logits: Array, targets: Array, kernel: bool) -> tuple[Array, Array, Array]:
  """(log-sum-exp, target logit, first argmax) of each row of logits, the first two in float32."""
  if kernel:
    statistics = row_statistics(logits, targets)
    if statistics is not None:
      return statistics
  logits32 = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits32, axis=-1)
  target_logit = jnp.take_along_axis(logits32, targets[..., None], axis=-1)[..., 0]
  return log_z, target_logit, jnp.argmax(logits, axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def weighted_cross_entropy(logits: Array, targets: Array, weights: Array, kernel: bool) -> tuple[Array, Array]:
  """`cross_entropy_sums` of int32 targets and float32 weights; `kernel`: the rows' statistics from
  `row_statistics` where it applies (off GPU in Pallas' interpreter, for tests)."""
  return _weighted_cross_entropy_fwd(logits, targets, weights, kernel)[0]


def _weighted_cross_entropy_fwd(logits, targets, weights, kernel):
  log_z, target_logit, argmax = _row_statistics(logits, targets, kernel)
  token_loss = log_z - target_logit
  correct = (argmax == targets).astype(jnp.float32)
  return ((jnp.sum(token_loss * weights), jnp.sum(correct * weights)),
          (logits, targets, weights, log_z, token_loss, correct))


def _weighted_cross_entropy_bwd(kernel, residuals, g):
  """d/dlogits = g * weight * (softmax - one_hot(target)), written in one elementwise pass in the logits' dtype.

  Autodiff of the forward gives a float32 [..., V] softmax plus a scatter-add for the target pick: for the sparse
  MLM head a few [B * M, vocab] float32 arrays per step. The correct-prediction count has no gradient.
  """
  del kernel
  logits, targets, weights, log_z, token_loss, correct = residuals
  g_loss, g_correct = g
  scale = (g_loss * weights)[..., None]
  softmax = jnp.exp(logits.astype(jnp.float32) - log_z[..., None])
  one_hot = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == targets[..., None]
  dlogits = (scale * (softmax - one_hot)).astype(logits.dtype)
  return dlogits, None, g_loss * token_loss + g_correct * correct


weighted_cross_entropy.defvjp(_weighted_cross_entropy_fwd, _weighted_cross_entropy_bwd)
