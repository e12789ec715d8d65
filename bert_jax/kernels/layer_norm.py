"""LayerNorm backward pass as one Pallas (Triton) kernel for GPU.

`ops.layer_norm`'s backward in XLA is a row-reduction kernel (two sums per
row), an elementwise kernel for dx and a column-reduction kernel for the
scale and bias gradients, each reading x and dy: several times the time it
takes to read x and dy once and write dx.

Here one kernel does all of it. Each program takes `BLOCK_ROWS` rows and
walks them `STEP_ROWS` at a time in a loop: a step loads its rows once (in
column chunks of 256, or 128 where the width is not a multiple of 256: the
Triton lowering needs power-of-two tiles), reduces each row along the features
(the two row sums), writes dx, and adds dy * xhat and dy into column
accumulators held per thread. The accumulators are reduced across rows once
per program, and XLA adds the programs' partial sums (one array of
[rows / BLOCK_ROWS, sums x features], small). The arithmetic is that of
`ops._layer_norm_bwd` (float32), so the results agree to rounding.

Reading each block once and reducing the column sums once per program is
what makes it fast; a kernel that read its block twice and reduced across the
block in every chunk was register-bound (docs/performance.md).

Under a mesh the kernel runs per shard of the batch (`jax.shard_map`, the
rules' "batch" axes; replicated over the other mesh axes, as the activations
are); the partial sums are added across shards by XLA.
Off GPU it runs in Pallas' interpreter (slow; for tests).

The default on GPU (`ModelConfig.kernels="auto"`).

`add_layer_norm_backward` is the same kernel for a post-LN residual,
LayerNorm(x + dropout(branch + bias)): it also hashes the dropout mask again,
writes the branch's gradient beside dx, and sums that gradient's columns (the
branch bias's gradient) in a third set of accumulators, instead of a separate
XLA fusion reading dx back.

`add_layer_norm_forward` is the forward pass of a post-LN residual,
LayerNorm(x + dropout(branch + bias)), as one kernel: it reads x and the branch once
and writes the sum (the backward pass's input) and the normalised output; the
hashed dropout mask (`dropout.keep_mask`'s, element for element) is computed
in the kernel. XLA took three kernels for it (dropout and add, writing the
sum and the mask; the row statistics; the normalisation), reading the sum
twice more.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from bert_jax.kernels.dropout import keep_index
from bert_jax.parallel import sharding as sharding_lib

Array = jax.Array

# The backward kernel's launch: 32 rows per program, 2 rows per step of its loop, in column chunks of 256 (128 where
# the width is not a multiple of 256), one warp per 768 columns (`backward_warps`); the best of 30 launches on an
# large GPU at both BERT widths (bench/layer_norm.py).
BLOCK_ROWS = 32
STEP_ROWS = 2
CHUNK = 128
# The forward kernel keeps its rows in registers; 8 rows and 8 warps were the best of six launches
# (bench/layer_norm.py). A row loop like the backward's was slower at every launch tried.
FORWARD_BLOCK_ROWS = 8
FORWARD_NUM_WARPS = 8


# The residual backward (`add_layer_norm_backward` with the branch bias's sums: a third set of accumulators) as
# (rows per step, warps) by width, at 32 rows a program: the best of 14 launches (16-64 rows a program,
# bench/layer_norm.py). Other widths: one row a step, twice the plain kernel's warps.
RESIDUAL_LAUNCH = {768: (1, 2), 1024: (2, 2)}


def backward_warps(features: int) -> int:
  """The backward kernel's warps for a width: enough that a thread holds at most ~48 values of each [2, features]
  step tile (a power of two: 1 at 768, 2 at 1024; faster than the other choice at both widths)."""
  return 1 << max(0, -(-features // 768) - 1).bit_length()


def backward_launch(features: int, branch_sums: bool) -> tuple[int, int]:
  """(rows per loop step, warps) of the backward kernel for a width, with or without the branch bias's sums."""
  if branch_sums:
    return RESIDUAL_LAUNCH.get(features, (1, 2 * backward_warps(features)))
  return STEP_ROWS, backward_warps(features)


def supported(rows: int, features: int, block_rows: int = BLOCK_ROWS) -> bool:
  """Whether the kernel takes a [rows, features] input (else `ops.layer_norm` uses XLA)."""
  return features % CHUNK == 0 and rows % block_rows == 0 and rows > 0


def _row_shards(x: Array, block_rows: int):
  """(features, leading shape, mesh, row axes, rows a shard) of [..., E] `x` under `sharding_lib.row_shards`, or None
  where the kernel does not apply (`supported`, per device)."""
  shards = sharding_lib.row_shards(x)
  if shards is None or not supported(shards[2], x.shape[-1], block_rows):
    return None
  return (x.shape[-1], x.shape[:-1], *shards)


def _meta(seeds: Array, row_axes, rows: int) -> Array:
  """int32[3] for the kernels' mask: the two seeds and this shard's first global row (inside `shard_map` over
  `row_axes`, `rows` rows a shard; 0 without a mesh), since the mask hashes global row indices."""
  offset = jax.lax.axis_index(row_axes) * rows if row_axes else 0
  return jnp.stack([seeds[0], seeds[1], jnp.asarray(offset, jnp.int32)]).astype(jnp.int32)


def _dropout(values: Array, rows: Array, first_col: int, features: int, seed0: Array, seed1: Array,
             rate: float) -> Array:
  """Inverted dropout of a kernel's tile: `values` [len(rows), width] at global rows `rows` and columns
  first_col.. of a [.., features] array, with `dropout.keep_mask`'s bits (the row-major global element index); the
  product with the float32 multiplier rounded once to values' dtype, as `dropout.apply_mask`."""
  index = rows[:, None] * features + (first_col + jnp.arange(values.shape[1], dtype=jnp.int32))[None, :]
  keep = keep_index(index, seed0, seed1, rate)
  return (values.astype(jnp.float32) * jnp.where(keep, 1.0 / (1.0 - rate), 0.0)).astype(values.dtype)


def _kernel(meta_ref, x_ref, dy_ref, mean_ref, rstd_ref, scale_ref, *out_refs, features: int, block_rows: int,
            step_rows: int, chunk: int, rate: float, branch_sums: bool):
  """The backward over `block_rows` rows, `step_rows` at a time in a loop: each step loads its rows once (every
  column chunk), reduces them along the features, writes dx and adds dy * xhat and dy into column accumulators
  of the step's shape, reduced across rows once at the end (no cross-thread column reduction per step).

  The post-LN residual's backward (`add_layer_norm_backward`) adds: with `rate` > 0, the branch's gradient
  dx * dropout multiplier (the mask hashed from `meta_ref`'s seeds and the global element index, as the forward
  kernel's), written beside dx; with `branch_sums`, that gradient's column sums (the branch bias's gradient) in a
  third set of accumulators."""
  dx_ref, *out_refs = out_refs
  dbranch_ref = out_refs.pop(0) if rate > 0 else None
  sums_ref, = out_refs
  chunks = [pl.ds(c * chunk, chunk) for c in range(features // chunk)]
  scales = [scale_ref[cols].astype(jnp.float32)[None, :] for cols in chunks]
  first_row = meta_ref[2] + pl.program_id(0) * block_rows
  seed0, seed1 = meta_ref[0], meta_ref[1]

  def step(i, accumulators):
    rows = pl.ds(pl.multiple_of(i * step_rows, step_rows), step_rows)
    mean = mean_ref[rows][:, None]
    rstd = rstd_ref[rows][:, None]
    dys = [dy_ref[rows, cols].astype(jnp.float32) for cols in chunks]
    xhats = [(x_ref[rows, cols].astype(jnp.float32) - mean) * rstd for cols in chunks]
    gs = [dy * scale for dy, scale in zip(dys, scales)]
    mean_g = (sum(jnp.sum(g, axis=1) for g in gs) / features)[:, None]
    mean_gx = (sum(jnp.sum(g * xhat, axis=1) for g, xhat in zip(gs, xhats)) / features)[:, None]
    row = first_row + i * step_rows + jnp.arange(step_rows, dtype=jnp.int32)  # global, for the mask's index
    dbranches = []
    for c, (cols, g, xhat) in enumerate(zip(chunks, gs, xhats)):
      dx = (rstd * (g - mean_g - xhat * mean_gx)).astype(dx_ref.dtype)
      dx_ref[rows, cols] = dx
      if rate > 0:
        dx = _dropout(dx, row, c * chunk, features, seed0, seed1, rate)
        dbranch_ref[rows, cols] = dx
      if branch_sums:
        dbranches.append(dx.astype(jnp.float32))
    dscale, dbias, dbranch_bias = accumulators
    if branch_sums:
      dbranch_bias = tuple(a + d for a, d in zip(dbranch_bias, dbranches))
    return (tuple(a + dy * xhat for a, dy, xhat in zip(dscale, dys, xhats)),
            tuple(a + dy for a, dy in zip(dbias, dys)), dbranch_bias)

  zeros = tuple(jnp.zeros((step_rows, chunk), jnp.float32) for _ in chunks)
  dscale, dbias, dbranch_bias = jax.lax.fori_loop(0, block_rows // step_rows, step,
                                                  (zeros, zeros, zeros if branch_sums else ()))
  for k, accumulator in enumerate((dscale, dbias) + ((dbranch_bias,) if branch_sums else ())):
    for c in range(len(chunks)):
      sums_ref[pl.ds(k * features + c * chunk, chunk)] = jnp.sum(accumulator[c], axis=0)


def _backward_2d(meta: Array, x: Array, dy: Array, mean: Array, rstd: Array, scale: Array, *, rate: float,
                 branch_sums: bool, interpret: bool, block_rows: int, step_rows: int, num_warps: int) -> list[Array]:
  """[R, E] x and dy, [R] statistics -> dx [R, E], (with `rate` > 0) the branch gradient [R, E], and partial
  sums [R / block_rows, n * E] of dy * xhat, dy and (with `branch_sums`) the branch gradient, side by side in one
  array: XLA adds the programs' partial sums of all n in one reduction (one launch, not one per sum)."""
  rows, features = x.shape
  blocks = rows // block_rows
  row_block = pl.BlockSpec((block_rows, features), lambda i: (i, 0))
  stats = pl.BlockSpec((block_rows,), lambda i: (i,))
  partial = pl.BlockSpec((None, (2 + branch_sums) * features), lambda i: (i, 0))
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as plgpu
    compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
  step_rows = step_rows if block_rows % step_rows == 0 else 1
  chunk = 2 * CHUNK if features % (2 * CHUNK) == 0 else CHUNK
  full = jax.ShapeDtypeStruct(x.shape, x.dtype)
  sums = jax.ShapeDtypeStruct((blocks, (2 + branch_sums) * features), jnp.float32)
  out_shape = [full] + [full] * (rate > 0) + [sums]
  out_specs = [row_block] + [row_block] * (rate > 0) + [partial]
  return pl.pallas_call(
      functools.partial(_kernel, features=features, block_rows=block_rows, step_rows=step_rows, chunk=chunk,
                        rate=rate, branch_sums=branch_sums),
      grid=(blocks,),
      in_specs=[pl.BlockSpec((3,), lambda i: (0,)), row_block, row_block, stats, stats,
                pl.BlockSpec((features,), lambda i: (0,))],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=compiler_params,
      interpret=interpret,
      name="layer_norm_backward",
  )(meta, x, dy, mean, rstd, scale)


def _backward(x: Array, dy: Array, mean: Array, rstd: Array, scale: Array, seeds: Array | None, rate: float,
              branch_sums: bool, block_rows: int, step_rows: int | None, num_warps: int | None
              ) -> list[Array] | None:
  """`_backward_2d` on [..., E] arrays, per row shard under a mesh; the partial sums added. None where the kernel
  does not apply."""
  shards = _row_shards(x, block_rows)
  if shards is None:
    return None
  features, lead, mesh, row_axes, rows = shards
  full_outputs = 1 + (rate > 0)
  default_step_rows, default_warps = backward_launch(features, branch_sums)

  def run(x, dy, mean, rstd, scale, seeds):
    return tuple(_backward_2d(_meta(seeds, row_axes, rows), x, dy, mean, rstd, scale, rate=rate,
                              branch_sums=branch_sums, interpret=jax.default_backend() != "gpu",
                              block_rows=block_rows, step_rows=step_rows or default_step_rows,
                              num_warps=num_warps or default_warps))

  run = sharding_lib.per_row_shard(run, mesh, row_axes, "rrvvpp", "r" * (full_outputs + 1))
  seeds = jnp.zeros((2,), jnp.int32) if seeds is None else seeds
  outputs = run(x.reshape(-1, features), dy.reshape(-1, features), mean.reshape(-1), rstd.reshape(-1), scale,
                seeds)
  sums = jnp.sum(outputs[full_outputs], axis=0).reshape(-1, features)
  return [a.reshape(*lead, features) for a in outputs[:full_outputs]] + list(sums)


def layer_norm_backward(x: Array, dy: Array, mean: Array, rstd: Array, scale: Array, *,
                        block_rows: int = BLOCK_ROWS, step_rows: int | None = None, num_warps: int | None = None
                        ) -> tuple[Array, Array, Array] | None:
  """(dx, dscale, dbias) of LayerNorm over the last axis; x, dy [..., E], mean and rstd [..., 1] float32.

  dscale and dbias are float32 sums over every row. None where the kernel
  does not apply: a width that is not a multiple of CHUNK, or rows (per shard,
  under a mesh) that are not a multiple of `block_rows`; the caller then uses
  the XLA form. `block_rows`, `step_rows` and `num_warps` (None:
  `backward_launch`'s) are the launch parameters (`bench/layer_norm.py` sweeps
  them).
  """
  outputs = _backward(x, dy, mean, rstd, scale, None, 0.0, False, block_rows, step_rows, num_warps)
  return None if outputs is None else tuple(outputs)


def add_layer_norm_backward(total: Array, dy: Array, mean: Array, rstd: Array, scale: Array, seeds: Array,
                            rate: float, branch_sums: bool, *, block_rows: int = BLOCK_ROWS,
                            step_rows: int | None = None, num_warps: int | None = None
                            ) -> tuple[Array, Array, Array, Array, Array | None] | None:
  """The backward of the post-LN residual y = LayerNorm(total), total = x + dropout(branch (+ its bias)):
  (dtotal, dbranch, dscale, dbias, dbranch_bias) from one kernel.

  dtotal is also x's gradient; dbranch = dtotal times `dropout.keep_mask(seeds, total.shape, rate)`'s multiplier
  (the mask hashed again in the kernel; dtotal itself where rate is 0), in total's dtype; dbranch_bias its float32
  column sums with `branch_sums`, else None. None where the kernel does not apply; the launch parameters: as
  `layer_norm_backward`'s.
  """
  outputs = _backward(total, dy, mean, rstd, scale, seeds, rate, branch_sums, block_rows, step_rows, num_warps)
  if outputs is None:
    return None
  if rate == 0:
    outputs.insert(1, outputs[0])
  dtotal, dbranch, dscale, dbias = outputs[:4]
  return dtotal, dbranch, dscale, dbias, outputs[4] if branch_sums else None


def _forward_kernel(meta_ref, x_ref, branch_ref, scale_ref, bias_ref, *refs, features: int, block_rows: int,
                    rate: float, epsilon: float, branch_bias: bool):
  """The forward over `block_rows` rows: reads x and the branch once, writes the sum, keeps it in registers for
  the row statistics, and writes y."""
  branch_bias_ref = refs[0] if branch_bias else None
  y_ref, s_ref, mean_ref, rstd_ref = refs[1:] if branch_bias else refs
  rows = meta_ref[2] + pl.program_id(0) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
  sums, total = [], jnp.zeros((block_rows,), jnp.float32)
  for c in range(features // CHUNK):
    cols = pl.ds(c * CHUNK, CHUNK)
    d = branch_ref[:, cols]
    if branch_bias:  # ops.bias_add's value: the bias rounded to the branch's dtype, the sum rounded once
      bias = branch_bias_ref[cols].astype(d.dtype).astype(jnp.float32)
      d = (d.astype(jnp.float32) + bias[None, :]).astype(d.dtype)
    if rate > 0:
      d = _dropout(d, rows, c * CHUNK, features, meta_ref[0], meta_ref[1], rate)
    total_chunk = (x_ref[:, cols].astype(jnp.float32) + d.astype(jnp.float32)).astype(s_ref.dtype)
    s_ref[:, cols] = total_chunk
    sums.append(total_chunk.astype(jnp.float32))
    total += jnp.sum(sums[-1], axis=1)
  mean = total / features
  var = sum(jnp.sum(jnp.square(chunk - mean[:, None]), axis=1) for chunk in sums) / features
  rstd = jax.lax.rsqrt(var + epsilon)
  for c, chunk in enumerate(sums):
    cols = pl.ds(c * CHUNK, CHUNK)
    scale = scale_ref[cols].astype(jnp.float32)[None, :]
    y_ref[:, cols] = ((chunk - mean[:, None]) * (rstd[:, None] * scale)
                      + bias_ref[cols].astype(jnp.float32)[None, :]).astype(y_ref.dtype)
  mean_ref[...] = mean
  rstd_ref[...] = rstd


def _forward_2d(meta, x, branch, scale, bias, branch_bias, *, rate, epsilon, dtype, interpret, block_rows,
                num_warps):
  rows, features = x.shape
  row_block = pl.BlockSpec((block_rows, features), lambda i: (i, 0))
  stats = pl.BlockSpec((block_rows,), lambda i: (i,))
  vector = pl.BlockSpec((features,), lambda i: (0,))
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as plgpu
    compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
  vectors = (scale, bias) if branch_bias is None else (scale, bias, branch_bias)
  return pl.pallas_call(
      functools.partial(_forward_kernel, features=features, block_rows=block_rows, rate=rate, epsilon=epsilon,
                        branch_bias=branch_bias is not None),
      grid=(rows // block_rows,),
      in_specs=[pl.BlockSpec((3,), lambda i: (0,)), row_block, row_block] + [vector] * len(vectors),
      out_specs=[row_block, row_block, stats, stats],
      out_shape=[jax.ShapeDtypeStruct(x.shape, dtype), jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct((rows,), jnp.float32), jax.ShapeDtypeStruct((rows,), jnp.float32)],
      compiler_params=compiler_params,
      interpret=interpret,
      name="add_layer_norm_forward",
  )(meta, x, branch, *vectors)


def add_layer_norm_forward(x: Array, branch: Array, scale: Array, bias: Array, seeds: Array, rate: float,
                           epsilon: float, dtype, branch_bias: Array | None = None, *,
                           block_rows: int = FORWARD_BLOCK_ROWS,
                           num_warps: int = FORWARD_NUM_WARPS) -> tuple[Array, Array, Array, Array] | None:
  """(y, s, mean, rstd) of y = LayerNorm(s), s = x + dropout(branch + branch_bias) (in x's dtype), over the last
  axis.

  x and branch [..., E] of one dtype; `branch_bias` [E] or None (no bias), added as `ops.bias_add` adds it;
  `seeds` int32[2] of `dropout.keep_mask` (its mask, element for element, of the global [..., E] array; ignored
  when rate is 0); mean and rstd [..., 1] float32; y in `dtype`. None where the kernel does not apply (as
  `layer_norm_backward`): the caller then uses XLA. The launch: `block_rows` a program, `num_warps`.
  """
  shards = _row_shards(x, block_rows)
  if shards is None:
    return None
  features, lead, mesh, row_axes, rows = shards
  interpret = jax.default_backend() != "gpu"

  def call(x, branch, scale, bias, seeds, branch_bias):
    return _forward_2d(_meta(seeds, row_axes, rows), x, branch, scale, bias, branch_bias, rate=rate,
                       epsilon=epsilon, dtype=dtype, interpret=interpret, block_rows=block_rows,
                       num_warps=num_warps)

  call = sharding_lib.per_row_shard(call, mesh, row_axes, "rrpppp", "rrvv")
  y, s, mean, rstd = call(x.reshape(-1, features), branch.reshape(-1, features), scale, bias, seeds, branch_bias)
  return (y.reshape(*lead, features), s.reshape(*lead, features), mean.reshape(*lead, 1),
          rstd.reshape(*lead, 1))
