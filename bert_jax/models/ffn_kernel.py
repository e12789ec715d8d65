"""A Hopper GEMM with the feed-forward block's bias and GELU in its epilogue (Pallas, Mosaic GPU backend, wgmma).

The `wi` projection of a BERT FFN is h = x @ wi + bias, then the exact-erf
GELU(h). cuBLAS (which XLA calls) adds the bias in its epilogue but has no
exact-GELU epilogue, so XLA runs the GELU as a separate memory-bound kernel that
reads h back and writes GELU(h). `bias_gelu_matmul(x, w, bias)` computes both
from the accumulator while it is still in registers and writes h (the backward
pass's residual) and GELU(h) (the `wo` matmul's input) once each.

The GEMM is a persistent kernel: one CTA per SM loops over output tiles; in each,
a memory warpgroup streams [tile_m, tile_k] and [tile_k, 2 tile_n] blocks of the
operands into shared memory (TMA, `stages` deep) and two compute warpgroups each
accumulate a [tile_m, tile_n] half with wgmma; the epilogue writes [epi, epi]
sub-tiles through two shared-memory slots per warpgroup.

Measured on an H100 (bench/ffn_gemm.py, bench/NOTES.md session 11): at
[32768, 768] @ [768, 3072] the kernel takes 0.324 ms against XLA's 0.390 (cuBLAS
GEMM with the bias, then the GELU kernel). Its plain GEMM is ~0.02 ms slower
than cuBLAS; the epilogue's GELU is not overlapped with the next tile's
matmuls. A backward counterpart (dh = (dy @ wo^T) * GELU'(h) in the epilogue)
was no faster than XLA's GEMM plus its fused GELU backward and bias-gradient
reduction, so the backward pass stays in XLA (`ops.dense_gelu`).

The kernel runs on Hopper GPUs only (`supported`; Pallas has no interpreter for
Mosaic GPU kernels in jax 0.10); elsewhere `ops.dense_gelu` uses the XLA form,
the same values up to rounding (the kernel rounds h to bf16 once, after the bias;
its erf is a polynomial within 5e-7 of `lax.erf`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from bert_jax.parallel import sharding as sharding_lib

Array = jax.Array

_SQRT_HALF = float(np.sqrt(0.5))


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Launch parameters. Each CTA computes a [m, 2 n] output tile (one [m, n] half per compute warpgroup)."""

  m: int = 128
  n: int = 128
  k: int = 64
  stages: int = 4
  epi: int = 64
  grid_tile_width: int = 8
  grid_minor_m: bool = True  # consecutive tiles walk along M (the weight tile stays in L2)
  approx_math: bool = True  # ex2.approx and rcp.approx in the epilogue's GELU (-0.01 ms per BERT-Base call)


def supported(m: int, k: int, n: int, dtype, tiles: Tiles = Tiles()) -> bool:
  """Whether the kernels take an [m, k] @ [k, n] product: a Hopper GPU, bf16, shapes that the tiles divide."""
  if jnp.dtype(dtype) != jnp.bfloat16 or jax.default_backend() != "gpu":
    return False
  if m % tiles.m or n % (2 * tiles.n) or k % tiles.k:
    return False
  try:
    importlib.import_module("jax.experimental.pallas.mosaic_gpu")
  except ImportError:
    return False
  return getattr(jax.devices()[0], "compute_capability", "") in ("9.0", "9.0a")


# Abramowitz & Stegun 7.1.26: erf(x) = 1 - t (a1 + t (a2 + ... + t a5)) exp(-x^2), t = 1 / (1 + p |x|), absolute
# error under 1.5e-7 (a thousandth of a bfloat16 ulp at 1). Mosaic GPU has exp but no erf in its kernels.
_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def erf(x: Array) -> Array:
  """erf of float32 x from exp, a division and a select (the kernels' erf)."""
  t = 1.0 / (1.0 + _ERF_P * jnp.abs(x))
  poly = _ERF_A[4]
  for a in reversed(_ERF_A[:4]):
    poly = poly * t + a
  y = 1.0 - poly * t * jnp.exp(-x * x)
  return jnp.where(x < 0.0, -y, y)


def gelu(h32: Array) -> Array:
  """The exact GELU h Phi(h), float32 (with `erf`)."""
  return 0.5 * h32 * (1.0 + erf(h32 * _SQRT_HALF))


def _kernel(a_gmem, b_gmem, bias_gmem, *out_gmems, tiles: Tiles, mode: str):
  """mode "bias_gelu": out_gmems (h, GELU(h)), h = a @ b + bias; mode "plain": (a @ b,) (the bench's reference)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  dtype = a_gmem.dtype
  m, k = a_gmem.shape
  n = b_gmem.shape[1]
  tile_m, tile_n, tile_k, epi = tiles.m, tiles.n, tiles.k, tiles.epi
  cta_n = 2 * tile_n
  m_iters, n_iters, k_iters = m // tile_m, n // cta_n, k // tile_k
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(tile_k * itemsize * 8)
  transforms = (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
  out_swizzle = plgpu.find_swizzle(epi * itemsize * 8)
  out_transforms = (plgpu.TilingTransform((8, out_swizzle // itemsize)), plgpu.SwizzleTransform(out_swizzle))
  with_bias = mode == "bias_gelu"

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_iters,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((tile_m, tile_k), lambda kk: (0, kk), transforms=transforms, memory_space=plgpu.SMEM),
            plgpu.BlockSpec((tile_k, cta_n), lambda kk: (kk, 0), transforms=transforms, memory_space=plgpu.SMEM),
        ],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=tiles.stages,
        compute_context=compute_context,
    )

  ignore = lambda *_, **__: None  # noqa: E731 -- the allocations do not depend on the body

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
      out_smem=plgpu.SMEM((2, 2, epi, epi), dtype, transforms=out_transforms),  # (warpgroup, slot)
      bias_smem=plgpu.SMEM((2, tile_n), jnp.float32),
      barriers=plgpu.Barrier(num_barriers=2),  # the bias tile's copy, per warpgroup
      collective_axes="wg",
  )
  def scope(pipeline_allocs, out_smem, bias_smem, barriers):
    wg = lax.axis_index("wg")

    @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cluster_grid")
    def tile_loop(info):
      (linear,) = info.index
      mi, ni = plgpu.planar_snake(linear, (m_iters, n_iters), 0 if tiles.grid_minor_m else 1, tiles.grid_tile_width)
      m_slice = pl.ds(mi * tile_m, tile_m)
      n_slice = pl.ds(ni * cta_n, cta_n)
      wg_n = pl.ds(wg * tile_n, tile_n)

      def compute_context(eval_pipeline):
        if with_bias:  # lands during the main loop
          plgpu.copy_gmem_to_smem(bias_gmem.at[n_slice].at[wg_n], bias_smem.at[wg], barriers.at[wg])

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
        def _(acc_ref):
          eval_pipeline(acc_ref)
          acc = acc_ref[...]
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          if with_bias:
            plgpu.barrier_wait(barriers.at[wg])
          slot = 0
          for em in range(tile_m // epi):
            for en in range(tile_n // epi):
              part = acc[em * epi:(em + 1) * epi, en * epi:(en + 1) * epi]
              if with_bias:
                bias = plgpu.load(bias_smem.at[wg, pl.ds(en * epi, epi)], (), layout=plgpu.Layout.WGMMA.reduce(0))
                part = part + lax.broadcast_in_dim(bias, (epi, epi), [1])
              h = part.astype(dtype)
              values = [h, gelu(h.astype(jnp.float32)).astype(dtype)] if with_bias else [h]
              for value, ref in zip(values, out_gmems):
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the slot's previous store has read it
                out_smem[wg, slot] = value
                plgpu.commit_smem()
                dst = ref.at[m_slice, n_slice].at[:, wg_n].at[pl.ds(em * epi, epi), pl.ds(en * epi, epi)]
                plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], dst)
                slot ^= 1

      def mma(_, a_smem, b_smem, acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem.at[:, wg_n])
        plgpu.wgmma_wait(0)
        return acc_ref

      pipeline(mma, compute_context)(a_gmem.at[m_slice, :], b_gmem.at[:, n_slice], allocations=pipeline_allocs)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


# A jit of its own: the layers' call sites of one shape share one lowering (jax caches an inner jit's lowering per
# module), so the step compiles the kernel once instead of once per layer. BERT-Base seq-128 step on an H200
# (bench/NOTES.md, session 12): +7.4 s of compile time over ffn_impl="xla" with it, +22.8 s without; on an
# H100 with it, 41.5 s against 41.9.
@functools.partial(jax.jit, static_argnums=(0, 4))
def _call(mode: str, a: Array, b: Array, side: Array, tiles: Tiles):
  from jax.experimental.pallas import mosaic_gpu as plgpu
  m, n = a.shape[0], b.shape[1]
  out = jax.ShapeDtypeStruct((m, n), a.dtype)
  out_type = (out, out) if mode == "bias_gelu" else (out,)
  fn = plgpu.kernel(
      functools.partial(_kernel, tiles=tiles, mode=mode),
      out_type=out_type,
      grid=(jax.devices()[0].core_count,),
      grid_names=("cluster_grid",),
      cluster=(1,),
      cluster_names=("cluster",),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                           approx_math=tiles.approx_math),
  )
  return fn(a, b, side)


def _shards(x: Array, w: Array):
  """`sharding_lib.row_shards` of x, or None where the mesh splits x's other dims or the weight's output dim
  ("mlp": tensor parallelism, which the kernel does not do)."""
  shards = sharding_lib.row_shards(x)
  if shards is None or shards[0] is None:
    return shards
  mesh = shards[0]
  if any(sharding_lib.split_axes(("length",) * (x.ndim - 2) + ("embed",), x.shape[1:], mesh)):
    return None
  if sharding_lib.split_axes(("embed", "mlp"), w.shape, mesh)[1]:
    return None
  return shards


def applies(x: Array, w: Array, tiles: Tiles = Tiles()) -> bool:
  """Whether `bias_gelu` takes x [..., K] @ w [K, N] here: `supported` on each shard of x's rows."""
  if x.ndim < 2 or x.dtype != w.dtype:
    return False
  shards = _shards(x, w)
  return shards is not None and supported(shards[2], *w.shape, x.dtype, tiles)


def bias_gelu(x: Array, w: Array, bias: Array, tiles: Tiles = Tiles()) -> tuple[Array, Array]:
  """(h, GELU(h)) of x [..., K] @ w [K, N] + bias (`bias_gelu_matmul`), per shard of x's rows under a mesh (the
  weights replicated to each). Only where `applies`."""
  mesh, row_axes, _ = _shards(x, w)
  k, n = w.shape

  def run(x, w, bias):
    h, g = bias_gelu_matmul(x.reshape(-1, k), w, bias, tiles)
    return h.reshape(*x.shape[:-1], n), g.reshape(*x.shape[:-1], n)

  if mesh is None:
    return run(x, w, bias)
  spec = P(row_axes or None, *([None] * (x.ndim - 1)))
  return jax.shard_map(run, mesh=mesh, in_specs=(spec, P(), P()), out_specs=(spec, spec), check_vma=False)(x, w, bias)


def bias_gelu_matmul(x: Array, w: Array, bias: Array, tiles: Tiles = Tiles()) -> tuple[Array, Array]:
  """(h, GELU(h)) with h = x @ w + bias: x [M, K], w [K, N] bf16, bias [N] (any float dtype) -> two [M, N] bf16."""
  return _call("bias_gelu", x, w, bias.astype(jnp.float32), tiles)


def matmul(a: Array, b: Array, tiles: Tiles = Tiles()) -> Array:
  """a @ b (bf16) by the same GEMM without the epilogue's work: the bench's measure of what the epilogue costs."""
  return _call("plain", a, b, jnp.zeros((b.shape[1],), jnp.float32), tiles)[0]
