"""Hopper GEMMs with the feed-forward block's bias and GELU in their epilogues (Pallas, Mosaic GPU backend, wgmma).

The `wi` projection of a BERT FFN is h = x @ wi + bias, then the exact-erf
GELU(h). cuBLAS (which XLA calls) adds the bias in its epilogue but has no
exact-GELU epilogue, so XLA runs the GELU as a separate memory-bound kernel that
reads h back and writes GELU(h). `bias_gelu_matmul(x, w, bias)` computes both
from the accumulator while it is still in registers and writes h (the backward
pass's residual; with `derivative`, GELU'(h) instead) and GELU(h) (the `wo`
matmul's input) once each.

The backward pass of the FFN needs dh = (dy @ wo^T) * GELU'(h) and the bias
gradient, dh's column sums. XLA writes d GELU(h) from the GEMM, then reads it and
h back to write dh and sum it. `dgelu_matmul(dy, wo, h)` reads h's tile (with
`saved`, GELU'(h)'s) during the GEMM's main loop and writes only dh and the sums
of each tile's columns.

Two schedules of one persistent kernel (one CTA per SM looping over output tiles,
a memory warpgroup streaming operand blocks through shared memory by TMA, two
compute warpgroups with wgmma):
- cooperative (`bias_gelu_matmul`, `_kernel`): both compute warpgroups work on
  one [tile_m, 2 tile_n] tile, each on a half, through Pallas'
  `emit_pipeline_warp_specialized`; the epilogue is not overlapped with matmuls.
- ping-pong (`bias_gelu_matmul_pingpong`, `dgelu_matmul`, `_pingpong_kernel`):
  each compute warpgroup owns whole [tile_m, tile_n] tiles, alternate ones, and
  the warpgroups take turns on the tensor cores, so one's epilogue runs under the
  other's matmuls. A hand-built ring of operand slots and barriers.

At BERT-Base's and BERT-Large's FFN shapes both schedules beat XLA's GEMM plus
its elementwise kernels, forward and backward, and ping-pong beats cooperative
(bench/ffn_gemm.py; docs/performance.md). The model uses the ping-pong kernels
both ways (`FORWARD_SCHEDULE`, `PINGPONG_FORWARD_TILES`, `BACKWARD_KERNEL`), and
the forward writes GELU'(h) in place of h, so that the backward's epilogue only
multiplies (`SAVE_GELU_DERIVATIVE`). Their main loop is as fast as cuBLAS' GEMM
alone; what they take beyond it is the epilogue's per-element arithmetic,
longer than the other warpgroup's matmuls (Nsight Compute), hence
`normal_tail`'s few instructions.

The kernels run on Hopper GPUs only (`supported`, `supported_pingpong`; Pallas
has no interpreter for Mosaic GPU kernels in jax 0.10); elsewhere
`ops.gelu_feed_forward` uses the XLA forms, the same values up to rounding (the
kernels round h to bf16 once, after the bias; their GELU and GELU' are A&S 7.1.26
in float32, within 1e-6 of `ops.gelu` and of its autodiff gradient).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from bert_jax.parallel import sharding as sharding_lib

Array = jax.Array

_SQRT_HALF = float(np.sqrt(0.5))
_INV_SQRT_2PI = float(1.0 / np.sqrt(2.0 * np.pi))


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Launch parameters. Each compute warpgroup computes [m, n] output tiles, through a ring of `stages` slots of
  [m, k] and [k, n] operand blocks: in the cooperative kernel both halves of a CTA's [m, 2 n] tile, in the
  ping-pong kernels alternate tiles."""

  m: int = 128
  n: int = 128
  k: int = 64
  stages: int = 4
  epi: int = 64
  out_slots: int = 2  # the ping-pong forward's shared-memory slots per warpgroup for [epi, epi] output stores
  grid_tile_width: int = 8
  grid_minor_m: bool = True  # consecutive tiles walk along M (the weight tile stays in L2)
  approx_math: bool = True  # ex2.approx and rsqrt.approx in the epilogue's GELU: fewer instructions


def supported(m: int, k: int, n: int, dtype, tiles: Tiles = Tiles()) -> bool:
  """Whether the kernels take an [m, k] @ [k, n] product: a Hopper GPU, bf16, shapes that the tiles divide."""
  return not (m % tiles.m or n % (2 * tiles.n) or k % tiles.k) and _hopper(dtype)


def _hopper(dtype) -> bool:
  """bf16 on a Hopper GPU with Pallas' Mosaic GPU backend."""
  if jnp.dtype(dtype) != jnp.bfloat16 or jax.default_backend() != "gpu":
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
# The same in terms of h = x sqrt 2, which the kernels hold: Phi(-|h|) = erfc(|x|) / 2.
_TAIL_P = _ERF_P * _SQRT_HALF
_TAIL_A = tuple(a / 2 for a in _ERF_A)
_NEG_HALF_LOG2E = float(-0.5 / np.log(2.0))


def normal_tail(h32: Array) -> tuple[Array, Array]:
  """Phi(-|h|), the standard normal's mass beyond |h|, and exp(-h^2 / 2), float32 (A&S 7.1.26).

  Written for the kernels' epilogues, where these per-element instructions run under the other warpgroup's matmuls
  only if they are few: 1 / d as rsqrt(d)^2 (d >= 1; Mosaic GPU's approximate
  division guards against denormals in seven instructions, rsqrt in two), exp(-h^2 / 2) as exp2 of a prescaled
  argument (one multiply fewer than exp), the polynomial's 1/2 folded into its coefficients.
  """
  r = lax.rsqrt(1.0 + _TAIL_P * jnp.abs(h32))
  t = r * r
  poly = _TAIL_A[4]
  for a in reversed(_TAIL_A[:4]):
    poly = poly * t + a
  e = jnp.exp2(h32 * (h32 * _NEG_HALF_LOG2E))
  return poly * t * e, e


def erf(x: Array) -> Array:
  """erf of float32 x by `normal_tail`, the polynomial under the kernels' GELU and GELU' (for tests)."""
  y = 1.0 - 2.0 * normal_tail(x * float(np.sqrt(2.0)))[0]
  return jnp.where(x < 0.0, -y, y)


def _gelu_from_tail(h32: Array, tail: Array) -> Array:
  return jnp.maximum(h32, 0.0) - jnp.abs(h32) * tail


def _gelu_derivative_from_tail(h32: Array, tail: Array, e: Array) -> Array:
  return jnp.where(h32 < 0.0, tail, 1.0 - tail) + h32 * (_INV_SQRT_2PI * e)


def gelu(h32: Array) -> Array:
  """The exact GELU h Phi(h), float32: max(h, 0) - |h| Phi(-|h|) (`normal_tail`), no select."""
  return _gelu_from_tail(h32, normal_tail(h32)[0])


def _forward_values(h: Array, mode: str) -> list[Array]:
  """The forward epilogue's outputs from h (rounded to the output dtype): mode "bias_gelu" (h, GELU(h)),
  "bias_gelu_derivative" (GELU'(h), GELU(h)), both functions of the rounded h."""
  h32 = h.astype(jnp.float32)
  if mode == "bias_gelu_derivative":
    value, derivative = gelu_and_derivative(h32)
    return [derivative.astype(h.dtype), value.astype(h.dtype)]
  return [h, gelu(h32).astype(h.dtype)]


def gelu_derivative(h32: Array) -> Array:
  """GELU'(h) = Phi(h) + h phi(h), float32, by `normal_tail` (the density shares its exp)."""
  return _gelu_derivative_from_tail(h32, *normal_tail(h32))


def gelu_and_derivative(h32: Array) -> tuple[Array, Array]:
  """(GELU(h), GELU'(h)), float32, from one `normal_tail`: the forward epilogue's values where it saves GELU'(h)
  for the backward pass instead of h (`SAVE_GELU_DERIVATIVE`)."""
  tail, e = normal_tail(h32)
  return _gelu_from_tail(h32, tail), _gelu_derivative_from_tail(h32, tail, e)


def _kernel(a_gmem, b_gmem, bias_gmem, *out_gmems, tiles: Tiles, mode: str):
  """mode "bias_gelu": out_gmems (h, GELU(h)), h = a @ b + bias; "bias_gelu_derivative": (GELU'(h), GELU(h));
  "plain": (a @ b,) (the bench's reference)."""
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
  with_bias = mode.startswith("bias_gelu")

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
              values = _forward_values(h, mode) if with_bias else [h]
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


def _pingpong_kernel(a_gmem, b_gmem, side_gmem, *out_gmems, tiles: Tiles, mode: str, num_ctas: int):
  """A persistent GEMM whose two compute warpgroups own alternate output tiles ("ping-pong").

  One memory warpgroup streams each tile's [m, k] and [k, n] operand blocks through one ring of `tiles.stages`
  slots, tile after tile. The compute warpgroups take turns on the tensor cores: warpgroup w waits for the
  other's main loop to finish (`order` barriers), runs its own, signals, then runs its epilogue while the other
  warpgroup's matmuls proceed. Each warpgroup has its own "full" barrier per slot (the memory warpgroup arrives
  on the tile owner's): Mosaic GPU keeps a barrier's expected phase per thread, flipped by the thread's own
  waits, so a barrier must only complete phases that its waiter waits for.

  mode "bias_gelu": a [M, K] @ b [K, N] + side (the bias, float32 [N]) -> out_gmems (h, GELU(h)); mode
  "bias_gelu_derivative": the same with GELU'(h) in place of h.
  mode "dgelu": (a [M, K] @ b [N, K]^T) * GELU'(side) with side = h [M, N] -> out_gmems (dh, its column sums
  per row of tiles [M / m, N] float32): the FFN's backward from d GELU(h) = dy @ wo^T to dh and (summed over
  the rows of tiles) the bias gradient; mode "dgelu_saved": the same with side = GELU'(h). The side tile is
  read through TMA during the main loop and dh written back through the same shared memory. The column sums
  reduce across warps through Mosaic GPU's one reduction scratch buffer, so the warpgroups take turns
  (`sum_order` barriers) as they do on the tensor cores.
  """
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  dtype = a_gmem.dtype
  m, k = a_gmem.shape
  transposed_b = mode.startswith("dgelu")
  n = b_gmem.shape[0] if transposed_b else b_gmem.shape[1]
  tile_m, tile_n, tile_k, epi, stages = tiles.m, tiles.n, tiles.k, tiles.epi, tiles.stages
  m_iters, n_iters, k_iters = m // tile_m, n // tile_n, k // tile_k
  num_tiles = m_iters * n_iters
  itemsize = jnp.dtype(dtype).itemsize

  def transforms(minor: int):
    swizzle = plgpu.find_swizzle(minor * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)

  b_block = (tile_n, tile_k) if transposed_b else (tile_k, tile_n)
  smem = dict(
      a_smem=plgpu.SMEM((stages, tile_m, tile_k), dtype, transforms=transforms(tile_k)),
      b_smem=plgpu.SMEM((stages, *b_block), dtype, transforms=transforms(b_block[1])),
      full=plgpu.Barrier(num_arrivals=2, num_barriers=2 * stages),  # (owner, slot): both operand blocks landed
      consumed=plgpu.Barrier(num_arrivals=1, num_barriers=stages),  # a compute warpgroup is done with a slot
      order=plgpu.Barrier(num_arrivals=1, num_barriers=2),  # warpgroup w finished a main loop
      side_barrier=plgpu.Barrier(num_arrivals=1, num_barriers=2),  # the bias or h tile, per warpgroup
  )
  if transposed_b:
    smem["side_smem"] = plgpu.SMEM((2, tile_m, tile_n), dtype, transforms=transforms(tile_n))
    smem["sums_smem"] = plgpu.SMEM((2, tile_n), jnp.float32)
    smem["sum_order"] = plgpu.Barrier(num_arrivals=1, num_barriers=2)  # warpgroup w's column sums are done
  else:
    smem["side_smem"] = plgpu.SMEM((2, tile_n), jnp.float32)
    smem["out_smem"] = plgpu.SMEM((2, tiles.out_slots, epi, epi), dtype, transforms=transforms(epi))  # (wg, slot)

  def tile_slices(linear):
    mi, ni = plgpu.planar_snake(linear, (m_iters, n_iters), 0 if tiles.grid_minor_m else 1, tiles.grid_tile_width)
    return mi, pl.ds(mi * tile_m, tile_m), pl.ds(ni * tile_n, tile_n)

  @functools.partial(pl.run_scoped, **smem, collective_axes="wg")
  def scope(a_smem, b_smem, full, consumed, order, side_barrier, side_smem, out_smem=None, sums_smem=None,
            sum_order=None):
    wg = lax.axis_index("wg")
    cta = lax.axis_index("sm")
    num_local = (num_tiles - cta + num_ctas - 1) // num_ctas  # this CTA's tiles: cta, cta + num_ctas, ...

    @pl.when(wg == 2)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")

      @pl.loop(0, num_local)
      def _tile(j):
        _, m_slice, n_slice = tile_slices(cta + j * num_ctas)
        owner = lax.rem(j, 2)  # the compute warpgroup of tile j

        @pl.loop(0, k_iters)
        def _step(kk):
          step = j * k_iters + kk
          slot = lax.rem(step, stages)
          landed = full.at[owner * stages + slot]

          @pl.when(step >= stages)
          def _():
            plgpu.barrier_wait(consumed.at[slot])

          k_slice = pl.ds(kk * tile_k, tile_k)
          plgpu.copy_gmem_to_smem(a_gmem.at[m_slice, k_slice], a_smem.at[slot], landed)
          b_src = b_gmem.at[n_slice, k_slice] if transposed_b else b_gmem.at[k_slice, n_slice]
          plgpu.copy_gmem_to_smem(b_src, b_smem.at[slot], landed)

      # The last slots' consumptions, so that no arrival is left pending on a barrier when the kernel ends.
      total = num_local * k_iters

      @pl.loop(jnp.maximum(total - stages, 0), total)
      def _drain(step):
        plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      mine = (num_local - wg + 1) // 2  # warpgroup w takes the CTA's tiles w, w + 2, ...

      @pl.loop(0, mine)
      def _tile(i):
        j = 2 * i + wg
        mi, m_slice, n_slice = tile_slices(cta + j * num_ctas)
        if transposed_b:  # h's tile, into the buffer that the previous tile's dh store has finished reading
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          plgpu.copy_gmem_to_smem(side_gmem.at[m_slice, n_slice], side_smem.at[wg], side_barrier.at[wg])
        else:
          plgpu.copy_gmem_to_smem(side_gmem.at[n_slice], side_smem.at[wg], side_barrier.at[wg])

        @pl.when(j > 0)
        def _():
          plgpu.barrier_wait(order.at[1 - wg])  # the other warpgroup's main loop is done

        def main_loop(acc_ref):
          def step(kk, _):
            slot = lax.rem(j * k_iters + kk, stages)
            plgpu.barrier_wait(full.at[wg * stages + slot])
            b = plgpu.transpose_ref(b_smem.at[slot], (1, 0)) if transposed_b else b_smem.at[slot]
            plgpu.wgmma(acc_ref, a_smem.at[slot], b)
            plgpu.wgmma_wait(1)  # the previous step's wgmma is done: release its slot

            @pl.when(kk > 0)
            def _():
              plgpu.barrier_arrive(consumed.at[lax.rem(j * k_iters + kk - 1, stages)])

          lax.fori_loop(0, k_iters, step, None)
          plgpu.barrier_arrive(order.at[wg])  # the tensor cores are the other warpgroup's
          plgpu.wgmma_wait(0)
          plgpu.barrier_arrive(consumed.at[lax.rem(j * k_iters + k_iters - 1, stages)])
          return acc_ref[...]

        acc = pl.run_scoped(main_loop, plgpu.ACC((tile_m, tile_n), jnp.float32))
        plgpu.barrier_wait(side_barrier.at[wg])
        if transposed_b:
          sums = _dgelu_epilogue(acc, side_smem.at[wg], out_gmems[0].at[m_slice, n_slice], epi,
                                 saved=mode == "dgelu_saved")

          @pl.when(j > 0)
          def _():
            plgpu.barrier_wait(sum_order.at[1 - wg])  # the other warpgroup's reduction is done

          for en, part in enumerate(sums):
            sums_smem[wg, pl.ds(en * epi, epi)] = jnp.sum(part, axis=0)
          plgpu.barrier_arrive(sum_order.at[wg])
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(sums_smem.at[wg], out_gmems[1].at[mi, n_slice])
        else:
          _bias_gelu_epilogue(acc, side_smem.at[wg], out_smem.at[wg], [ref.at[m_slice, n_slice] for ref in out_gmems],
                              epi, dtype, mode)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _bias_gelu_epilogue(acc, bias_smem, out_smem, out_tiles, epi: int, dtype, mode: str = "bias_gelu"):
  """h = acc + bias rounded to `dtype`, then `_forward_values` (h or GELU'(h), and GELU(h)), stored by [epi, epi]
  sub-tiles through out_smem's slots in turn."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  tile_m, tile_n = acc.shape
  slots = out_smem.shape[0]
  slot = 0
  for em in range(tile_m // epi):
    for en in range(tile_n // epi):
      part = acc[em * epi:(em + 1) * epi, en * epi:(en + 1) * epi]
      bias = plgpu.load(bias_smem.at[pl.ds(en * epi, epi)], (), layout=plgpu.Layout.WGMMA.reduce(0))
      h = (part + lax.broadcast_in_dim(bias, (epi, epi), [1])).astype(dtype)
      for value, tile in zip(_forward_values(h, mode), out_tiles):
        plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)  # the slot's previous store has read it
        out_smem[slot] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[slot], tile.at[pl.ds(em * epi, epi), pl.ds(en * epi, epi)])
        slot = (slot + 1) % slots


def _dgelu_epilogue(acc, h_smem, dh_tile, epi: int, saved: bool = False) -> list[Array]:
  """dh = acc * GELU'(h) over h's tile in shared memory (with `saved`, the tile holds GELU'(h) itself), by
  [epi, epi] parts, written in place and stored. Returns per column block the rows' sum of dh's parts (float32
  [epi, epi], of dh rounded as stored)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  tile_m, tile_n = acc.shape
  sums = [None] * (tile_n // epi)
  for em in range(tile_m // epi):
    for en in range(tile_n // epi):
      part = h_smem.at[pl.ds(em * epi, epi), pl.ds(en * epi, epi)]
      h = plgpu.load(part, (), layout=plgpu.Layout.WGMMA)
      dg = acc[em * epi:(em + 1) * epi, en * epi:(en + 1) * epi]
      dh = (dg * (h.astype(jnp.float32) if saved else gelu_derivative(h.astype(jnp.float32)))).astype(h.dtype)
      part[...] = dh
      sums[en] = dh.astype(jnp.float32) if sums[en] is None else sums[en] + dh.astype(jnp.float32)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(h_smem, dh_tile)
  return sums


def _lowered_once(body, platforms: tuple[str, ...] = ("cuda",)):
  """body(mode, a, b, side, tiles) as `call(mode, a, b, side, tiles)`, whose kernel is lowered once per process
  for each mode, tiles and operand types (a `jax.export` of it for `platforms`) and embedded verbatim in every
  program calling it.

  Mosaic GPU stamps each kernel module it lowers with a process-wide count, so a program lowering the kernel
  again (the next fine-tuning task's step, of the same shapes) would differ from the first in its text and miss
  the persistent compilation cache.
  """
  @functools.cache
  def exported(mode: str, tiles: Tiles, types: tuple) -> jax.export.Exported:
    fun = jax.jit(functools.partial(body, mode, tiles=tiles))
    checks = [jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")]
    return jax.export.export(fun, platforms=platforms, disabled_checks=checks)(
        *(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in types))

  # A jit of its own: the layers' call sites of one shape share one lowering (jax caches an inner jit's lowering
  # per module), so the step compiles the kernel once instead of once per layer (a third of the compile time it
  # adds).
  @functools.partial(jax.jit, static_argnums=(0, 4))
  def call(mode: str, a: Array, b: Array, side: Array, tiles: Tiles):
    return exported(mode, tiles, tuple((x.shape, jnp.dtype(x.dtype)) for x in (a, b, side))).call(a, b, side)

  call.exported = exported
  return call


@_lowered_once
def _call(mode: str, a: Array, b: Array, side: Array, tiles: Tiles):
  m, n = a.shape[0], b.shape[1]
  out = jax.ShapeDtypeStruct((m, n), a.dtype)
  return _launch(functools.partial(_kernel, tiles=tiles, mode=mode), (out, out) if mode != "plain" else (out,),
                 tiles, grid_names=("cluster_grid",), cluster=(1,), cluster_names=("cluster",))(a, b, side)


@_lowered_once
def _pingpong_call(mode: str, a: Array, b: Array, side: Array, tiles: Tiles):
  n = b.shape[0] if mode.startswith("dgelu") else b.shape[1]
  out = jax.ShapeDtypeStruct((a.shape[0], n), a.dtype)
  sums = jax.ShapeDtypeStruct((a.shape[0] // tiles.m, n), jnp.float32)
  body = functools.partial(_pingpong_kernel, tiles=tiles, mode=mode, num_ctas=jax.devices()[0].core_count)
  return _launch(body, (out, sums) if mode.startswith("dgelu") else (out, out), tiles, grid_names=("sm",))(a, b, side)


def _launch(body, out_type, tiles: Tiles, **mesh):
  """A persistent kernel: one CTA per SM, three warpgroups (two compute, one memory), warpgroup semantics."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu.kernel(
      body,
      out_type=out_type,
      grid=(jax.devices()[0].core_count,),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                           approx_math=tiles.approx_math),
      **mesh,
  )


def _shards(x: Array, w: Array):
  """`sharding_lib.row_shards` of x, or None where the mesh splits x's other dims or the weight's output dim
  ("mlp": tensor parallelism, which the kernels do not do).

  x's dims are resolved together, as the model constrains its activations (under FSDP "batch" takes the "fsdp"
  axis, so "embed" is not split), and mesh axes of size 1 split nothing."""
  shards = sharding_lib.row_shards(x)
  if shards is None or shards[0] is None:
    return shards
  mesh = shards[0]
  splits = lambda axes: math.prod(mesh.shape[a] for a in axes) > 1  # noqa: E731
  logical = ("batch",) + ("length",) * (x.ndim - 2) + ("embed",)
  if any(map(splits, sharding_lib.split_axes(logical, x.shape, mesh)[1:])):
    return None
  if splits(sharding_lib.split_axes(("embed", "mlp"), w.shape, mesh)[1]):
    return None
  return shards


# Which kernels the model uses (`bias_gelu`, `dgelu`); bench/ffn_gemm.py and bench/ffn_step_variants.py flip them.
FORWARD_SCHEDULE = "pingpong"  # or "cooperative": the forward GEMM by `bias_gelu_matmul`
# The forward's ring is one slot deeper than the backward's, which keeps h's tile in shared memory (faster at
# BERT-Large's FFN shape, equal at BERT-Base's).
PINGPONG_FORWARD_TILES = Tiles(stages=5)
BACKWARD_KERNEL = True  # the FFN's dh by `dgelu_matmul` (else XLA's GEMM, then its GELU backward)
# The forward kernel writes GELU'(h) instead of h for the backward pass, whose epilogue then multiplies by it
# instead of computing it (`ops.gelu_feed_forward`, where either kernel runs). dh is rounded twice (GELU'(h) to
# bf16, then dh), not once; the backward gains more than the forward loses.
SAVE_GELU_DERIVATIVE = True


def supported_pingpong(m: int, k: int, n: int, dtype, tiles: Tiles = Tiles()) -> bool:
  """Whether the ping-pong kernels take an [m, k] @ [k, n] product: a Hopper GPU, bf16, shapes the tiles divide."""
  return not (m % tiles.m or n % tiles.n or k % tiles.k) and _hopper(dtype)


def applies(x: Array, w: Array, tiles: Tiles = Tiles()) -> bool:
  """Whether `bias_gelu` takes x [..., K] @ w [K, N] here: `supported` on each shard of x's rows."""
  if x.ndim < 2 or x.dtype != w.dtype:
    return False
  shards = _shards(x, w)
  return shards is not None and supported(shards[2], *w.shape, x.dtype, tiles)


def applies_dgelu(x: Array, wi: Array, tiles: Tiles = Tiles()) -> bool:
  """Whether `dgelu` takes the backward pass of an FFN with input x [..., K] and first kernel wi [K, N]: the
  switch `BACKWARD_KERNEL`, and `supported_pingpong` for dy [rows, K] @ wo^T [K, N] on each shard of the rows."""
  if not BACKWARD_KERNEL or x.ndim < 2 or x.dtype != wi.dtype:
    return False
  shards = _shards(x, wi)
  return shards is not None and supported_pingpong(shards[2], *wi.shape, x.dtype, tiles)


def _over_row_shards(run, rows: tuple[Array, ...], weights: tuple[Array, ...], x: Array, w: Array,
                     out_ndims: tuple[int, ...]):
  """run(*rows, *weights) per shard of the row operands' leading dim under a mesh (weights replicated); its
  outputs (of these ranks) are split the same way."""
  mesh, row_axes, _ = _shards(x, w)
  if mesh is None:
    return run(*rows, *weights)
  split = lambda ndim: P(row_axes or None, *([None] * (ndim - 1)))  # noqa: E731
  return jax.shard_map(run, mesh=mesh, in_specs=(*map(split, (r.ndim for r in rows)), *([P()] * len(weights))),
                       out_specs=tuple(map(split, out_ndims)), check_vma=False)(*rows, *weights)


def bias_gelu(x: Array, w: Array, bias: Array, tiles: Tiles = Tiles(),
              derivative: bool = False) -> tuple[Array, Array]:
  """(h, GELU(h)) of x [..., K] @ w [K, N] + bias, or with `derivative` (GELU'(h), GELU(h)) (`bias_gelu_matmul`,
  or its ping-pong form with FORWARD_SCHEDULE "pingpong"), per shard of x's rows under a mesh (the weights
  replicated to each). Only where `applies`."""
  k, n = w.shape

  def run(x, w, bias):
    x2 = x.reshape(-1, k)
    if FORWARD_SCHEDULE == "pingpong" and supported_pingpong(x2.shape[0], k, n, x.dtype, PINGPONG_FORWARD_TILES):
      h, g = bias_gelu_matmul_pingpong(x2, w, bias, PINGPONG_FORWARD_TILES, derivative=derivative)
    else:
      h, g = bias_gelu_matmul(x2, w, bias, tiles, derivative=derivative)
    return h.reshape(*x.shape[:-1], n), g.reshape(*x.shape[:-1], n)

  return _over_row_shards(run, (x,), (w, bias), x, w, (x.ndim, x.ndim))


def dgelu(dy: Array, wo: Array, h: Array, x: Array, wi: Array,
          tiles: Tiles = Tiles(), saved: bool = False) -> tuple[Array, Array]:
  """(dh, its float32 sum over the rows) with dh = (dy @ wo^T) * GELU'(h), for an FFN of input x and first kernel
  wi (`dgelu_matmul`): dy [..., K], wo [N, K], h [..., N] (with `saved`, GELU'(h) in its place), per shard of the
  rows under a mesh. Only where `applies_dgelu(x, wi)`."""
  n, k = wo.shape

  def run(dy, h, wo):
    dh, sums = dgelu_matmul(dy.reshape(-1, k), wo, h.reshape(-1, n), tiles, saved=saved)
    return dh.reshape(h.shape), sums[None]

  dh, sums = _over_row_shards(run, (dy, h), (wo,), x, wi, (h.ndim, 2))
  return dh, jnp.sum(sums, axis=0)


def bias_gelu_matmul(x: Array, w: Array, bias: Array, tiles: Tiles = Tiles(),
                     derivative: bool = False) -> tuple[Array, Array]:
  """(h, GELU(h)) with h = x @ w + bias: x [M, K], w [K, N] bf16, bias [N] (any float dtype) -> two [M, N] bf16.
  With `derivative`, (GELU'(h), GELU(h)): the backward pass's residual instead of h."""
  return _call("bias_gelu_derivative" if derivative else "bias_gelu", x, w, bias.astype(jnp.float32), tiles)


def matmul(a: Array, b: Array, tiles: Tiles = Tiles()) -> Array:
  """a @ b (bf16) by the same GEMM without the epilogue's work: the bench's measure of what the epilogue costs."""
  return _call("plain", a, b, jnp.zeros((b.shape[1],), jnp.float32), tiles)[0]


def bias_gelu_matmul_pingpong(x: Array, w: Array, bias: Array, tiles: Tiles = Tiles(),
                              derivative: bool = False) -> tuple[Array, Array]:
  """`bias_gelu_matmul` by the ping-pong kernel (one warpgroup's epilogue under the other's matmuls)."""
  return _pingpong_call("bias_gelu_derivative" if derivative else "bias_gelu", x, w, bias.astype(jnp.float32), tiles)


def dgelu_matmul(dy: Array, wo: Array, h: Array, tiles: Tiles = Tiles(),
                 saved: bool = False) -> tuple[Array, Array]:
  """(dh, dh's column sums): dh = (dy @ wo^T) * GELU'(h) with dy [M, K], wo [N, K] (the FFN's output kernel,
  K = hidden), h [M, N], all bf16 -> [M, N] bf16, and its sums over the rows, float32 [N] (the first
  projection's bias gradient). The FFN's backward pass from its output gradient to the pre-GELU gradient,
  without writing d GELU(h) or reading dh back for the sum. With `saved`, h is GELU'(h) (`bias_gelu_matmul`'s
  `derivative`) and the epilogue only multiplies."""
  dh, sums = _pingpong_call("dgelu_saved" if saved else "dgelu", dy, wo, h, tiles)
  return dh, jnp.sum(sums, axis=0)
