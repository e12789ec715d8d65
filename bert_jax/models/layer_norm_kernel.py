"""LayerNorm backward pass as one Pallas (Triton) kernel for GPU.

`ops.layer_norm`'s backward in XLA is a row-reduction kernel (two sums per
row), an elementwise kernel for dx and a column-reduction kernel for the
scale and bias gradients, each reading x and dy. On the H200 the 25
LayerNorms of a BERT-Base seq-128 step spent 6.1 ms in their backward pass
(bench/NOTES.md, session-2 profile; ~4.9 ms after `ops.layer_norm`'s own
gradient), against ~1 ms to read x and dy once and write dx.

Here one kernel does all of it for a block of rows: a first pass over the
row block computes the two row sums, a second writes dx and this block's
partial column sums of dy * xhat and dy; XLA adds the partial sums of the
blocks (an array of [rows / block, features], small). The features are
walked in chunks of `CHUNK` columns (the Triton lowering needs power-of-two
tiles; BERT's widths 128-1024 are multiples of 128). The arithmetic is that
of `ops._layer_norm_bwd` (float32), so the results agree to rounding.

Under a mesh the kernel runs per shard of the batch (`jax.shard_map`, the
rules' "batch" axes; replicated over the other mesh axes, as the activations
are); the partial sums are added across shards by XLA.
Off GPU it runs in Pallas' interpreter (slow; for tests).

Measured (H100, bench/NOTES.md session 5): BERT-Base seq-128 step 60.8 ->
58.8 ms (-3.0%); BERT-Large seq 128 unchanged (+0.5%). The default on GPU
(`ModelConfig.layer_norm_impl="auto"`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from bert_jax.parallel import sharding as sharding_lib

Array = jax.Array

BLOCK_ROWS = 32
CHUNK = 128
NUM_WARPS = 4


def supported(rows: int, features: int, block_rows: int = BLOCK_ROWS) -> bool:
  """Whether the kernel takes a [rows, features] input (else `ops.layer_norm` uses XLA)."""
  return features % CHUNK == 0 and rows % block_rows == 0 and rows > 0


def _kernel(x_ref, dy_ref, mean_ref, rstd_ref, scale_ref, dx_ref, dscale_ref, dbias_ref, *, features: int,
            block_rows: int):
  mean = mean_ref[...][:, None]
  rstd = rstd_ref[...][:, None]

  def chunk(c):
    cols = pl.ds(c * CHUNK, CHUNK)
    dy = dy_ref[:, cols].astype(jnp.float32)
    xhat = (x_ref[:, cols].astype(jnp.float32) - mean) * rstd
    return cols, dy, xhat, dy * scale_ref[cols].astype(jnp.float32)[None, :]

  sum_g = jnp.zeros((block_rows,), jnp.float32)
  sum_gx = jnp.zeros((block_rows,), jnp.float32)
  for c in range(features // CHUNK):
    _, _, xhat, g = chunk(c)
    sum_g += jnp.sum(g, axis=1)
    sum_gx += jnp.sum(g * xhat, axis=1)
  mean_g = (sum_g / features)[:, None]
  mean_gx = (sum_gx / features)[:, None]
  for c in range(features // CHUNK):
    cols, dy, xhat, g = chunk(c)
    dx_ref[:, cols] = (rstd * (g - mean_g - xhat * mean_gx)).astype(dx_ref.dtype)
    dscale_ref[cols] = jnp.sum(dy * xhat, axis=0)
    dbias_ref[cols] = jnp.sum(dy, axis=0)


def _backward_2d(x: Array, dy: Array, mean: Array, rstd: Array, scale: Array, interpret: bool, block_rows: int,
                 num_warps: int):
  """[R, E] x and dy, [R] statistics -> dx [R, E], partial sums [R / block_rows, E] of dy * xhat and dy."""
  rows, features = x.shape
  blocks = rows // block_rows
  row_block = pl.BlockSpec((block_rows, features), lambda i: (i, 0))
  stats = pl.BlockSpec((block_rows,), lambda i: (i,))
  partial = pl.BlockSpec((None, features), lambda i: (i, 0))
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as plgpu
    compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
  return pl.pallas_call(
      functools.partial(_kernel, features=features, block_rows=block_rows),
      grid=(blocks,),
      in_specs=[row_block, row_block, stats, stats, pl.BlockSpec((features,), lambda i: (0,))],
      out_specs=[row_block, partial, partial],
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((blocks, features), jnp.float32),
                 jax.ShapeDtypeStruct((blocks, features), jnp.float32)],
      compiler_params=compiler_params,
      interpret=interpret,
  )(x, dy, mean, rstd, scale)


def layer_norm_backward(x: Array, dy: Array, mean: Array, rstd: Array, scale: Array, *,
                        block_rows: int = BLOCK_ROWS, num_warps: int = NUM_WARPS) -> tuple[Array, Array, Array] | None:
  """(dx, dscale, dbias) of LayerNorm over the last axis; x, dy [..., E], mean and rstd [..., 1] float32.

  dscale and dbias are float32 sums over every row. None where the kernel
  does not apply: a width that is not a multiple of CHUNK, or rows (per shard,
  under a mesh) that are not a multiple of `block_rows`; the caller then uses
  the XLA form. `block_rows` and `num_warps` are the launch parameters
  (`bench/layer_norm.py` sweeps them).
  """
  features = x.shape[-1]
  lead = x.shape[:-1]
  rows = x.size // features
  interpret = jax.default_backend() != "gpu"
  run = functools.partial(_backward_2d, interpret=interpret, block_rows=block_rows, num_warps=num_warps)

  mesh = sharding_lib.current_mesh()
  if mesh is not None and mesh.size > 1:
    if not lead:
      return None
    row_axes = sharding_lib.split_axes(("batch",), lead[:1], mesh)[0]  # () if they do not divide the batch.
    for axis in row_axes:
      rows //= mesh.shape[axis]
    row_spec, vector = P(row_axes or None, None), P(row_axes or None)
    run = jax.shard_map(run, mesh=mesh, in_specs=(row_spec, row_spec, vector, vector, P()),
                        out_specs=(row_spec, row_spec, row_spec), check_vma=False)
  if not supported(rows, features, block_rows):
    return None
  dx, dscale, dbias = run(x.reshape(-1, features), dy.reshape(-1, features), mean.reshape(-1), rstd.reshape(-1),
                          scale)
  return dx.reshape(*lead, features), jnp.sum(dscale, axis=0), jnp.sum(dbias, axis=0)
