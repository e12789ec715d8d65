"""Times the FFN's GEMM-with-GELU kernel (`kernels/ffn.py`) against XLA's form, on a Hopper GPU.

  python -m bench.ffn_gemm                       # BERT-Base and -Large FFN shapes at 32768 / 16384 tokens
  python -m bench.ffn_gemm --shapes 32768x768x3072 --tiles 128x128x64x4 --widths 1,8
  python -m bench.ffn_gemm --tiles none --pingpong-stages 4,5,5x64x4,4+saved  # the ping-pong kernels only
  python -m bench.ffn_gemm --tiles none --pingpong-stages '' --ablate  # where the ping-pong kernels' time goes
  ncu --kernel-name regex:mosaic --launch-skip 1 --launch-count 1 --set full -o fwd \
    python -m bench.ffn_gemm --shapes 32768x768x3072 --once forward  # one kernel for a profiler (see below)

Per [tokens, hidden, intermediate] shape, ms per call of h = x @ wi + bias and GELU(h), both written: XLA (a
cuBLAS GEMM with the bias in its epilogue, then the GELU kernel) and cuBLAS' GEMM alone, then per launch
`bias_gelu_matmul` and the same kernel's plain GEMM (`ffn_kernel.matmul`), with the differences from the
XLA form relative to its largest value. Then the ping-pong kernels per launch (ring depth, the epilogue's
[epi, epi] store tiles, the forward's output slots per warpgroup; +saved: the forward writing GELU'(h) for a
backward that multiplies by it, the model's pair with `SAVE_GELU_DERIVATIVE`, else the pair that saves h): the
forward (`bias_gelu_matmul_pingpong`) and the backward's dh = (dy @ wo^T) GELU'(h) with the bias gradient's
column sums (`dgelu_matmul`, the sums in its epilogue), against XLA's backward (its GEMM, then the GELU
backward fused with the sums).

`--ablate` times the ping-pong kernels (the pair that saves h) with parts of their epilogues taken out (patched
in this process only; the results are wrong by design, so no errors are printed): the forward without its
epilogue, writing h only, with the GELU replaced by a copy, and with more output slots (`Tiles.out_slots`); the
backward without GELU'(h)'s arithmetic, without the column sums, and without its epilogue (no h tile read, no
dh written; the sums kept).

`--once forward|backward` runs the model's ping-pong kernel (`PINGPONG_FORWARD_TILES` / default tiles) three
times at the first shape and nothing else: for Nsight Compute as above, or with MOSAIC_GPU_DUMP_PTX=1
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=DIR for its PTX and register count. `bench/ncu_regions.py` summarises
the profile's per-instruction stall samples by code region.
"""

from __future__ import annotations

import argparse
import contextlib

import jax
import jax.numpy as jnp

from bench.timing import time_ms
from bert_jax.kernels import ffn as ffn_kernel
from bert_jax.kernels import ops
from bert_jax.train import step as step_lib


def xla_forward(x, w, bias):
  h = ops.bias_add(jnp.dot(x, w), bias)
  return h, ops.gelu(h)


def xla_backward(dy, wo, h):
  dh = ops._gelu_bwd(False, h, jnp.dot(dy, wo.T))[0]  # noqa: SLF001 -- the model's rule
  return dh, jnp.sum(dh.astype(jnp.float32), axis=0)


def rel_err(a, b) -> float:
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@contextlib.contextmanager
def patched(**attributes):
  """ffn_kernel's module attributes replaced while the kernels are traced anew (jax's caches cleared)."""
  saved = {name: getattr(ffn_kernel, name) for name in attributes}
  for name, value in attributes.items():
    setattr(ffn_kernel, name, value)
  jax.clear_caches()
  try:
    yield
  finally:
    for name, value in saved.items():
      setattr(ffn_kernel, name, value)
    jax.clear_caches()


def _dgelu_sums_only(acc, h_smem, dh_tile, epi, saved=False):
  del h_smem, dh_tile, saved
  return [acc[:epi, en * epi:(en + 1) * epi] for en in range(acc.shape[1] // epi)]


ABLATIONS = {
    "forward": {
        "as shipped": {},
        "no epilogue (GEMM only)": dict(_bias_gelu_epilogue=lambda *args, **kwargs: None),
        "h only (no GELU output)": dict(_bias_gelu_epilogue=lambda acc, bias, smem, tiles, *rest, shipped=(
            ffn_kernel._bias_gelu_epilogue): shipped(acc, bias, smem, tiles[:1], *rest)),  # noqa: SLF001
        "GELU replaced by a copy": dict(gelu=lambda h32: h32),
    },
    "backward": {
        "as shipped": {},
        "GELU'(h) replaced by h": dict(gelu_derivative=lambda h32: h32),
        "no column sums": dict(_dgelu_epilogue=lambda *args, shipped=ffn_kernel._dgelu_epilogue,  # noqa: SLF001
                               **kwargs: (shipped(*args, **kwargs), [])[1]),
        "no epilogue (GEMM + column sums)": dict(_dgelu_epilogue=_dgelu_sums_only),
    },
}


def ablate(x, wi, bias, dy, wo, h, iters: int) -> None:
  for kind, variants in ABLATIONS.items():
    for label, attributes in variants.items():
      slot_options = (2, 4) if kind == "forward" and label == "as shipped" else (2,)
      for slots in slot_options:
        tiles = ffn_kernel.Tiles(out_slots=slots)
        with patched(**attributes):
          if kind == "forward":
            f = jax.jit(lambda x, w, b, t=tiles: ffn_kernel.bias_gelu_matmul_pingpong(x, w, b, t))
            args = (x, wi, bias)
          else:
            f = jax.jit(lambda dy, wo, h, t=tiles: ffn_kernel.dgelu_matmul(dy, wo, h, t))
            args = (dy, wo, h)
          try:
            print(f"  ablation, ping-pong {kind}, {label}, out_slots {slots}: {time_ms(f, *args, iters=iters):.4f}",
                  flush=True)
          except Exception as error:  # noqa: BLE001
            print(f"  ablation, ping-pong {kind}, {label}: fail {type(error).__name__}: {str(error)[:300]}", flush=True)


def pingpong_launches(text: str) -> list[tuple[str, ffn_kernel.Tiles, bool]]:
  """--pingpong-stages: "4,5x64x4,4+saved" -> (label, Tiles, saved) per launch."""
  launches = []
  for spec in filter(None, text.split(",")):
    sizes, *flags = spec.split("+")
    if set(flags) - {"saved"}:
      raise SystemExit(f"--pingpong-stages {spec}: the only flag is +saved")
    stages, epi, slots = ([int(v) for v in sizes.split("x")] + [64, 2])[:3]
    tiles = ffn_kernel.Tiles(stages=stages, epi=epi, out_slots=slots)
    label = f"  ping-pong, ring {stages}, epilogue tiles {epi}, {slots} output slots" + "".join(f" +{f}" for f in flags)
    launches.append((label, tiles, "saved" in flags))
  return launches


def run_once(kind: str, m: int, hidden: int, inter: int) -> None:
  if not ffn_kernel.supported_pingpong(m, hidden, inter, jnp.bfloat16, ffn_kernel.PINGPONG_FORWARD_TILES):
    raise SystemExit(f"--once: the ping-pong kernels do not run here ({jax.devices()[0].device_kind}) or do not take "
                     f"{m} x {hidden} x {inter} (a Hopper GPU and multiples of the tiles)")
  keys = jax.random.split(jax.random.key(0), 3)
  if kind == "forward":
    kernel = jax.jit(lambda x, w, b: ffn_kernel.bias_gelu_matmul_pingpong(
        x, w, b, ffn_kernel.PINGPONG_FORWARD_TILES, derivative=ffn_kernel.SAVE_GELU_DERIVATIVE))
    args = (jax.random.normal(keys[0], (m, hidden), jnp.bfloat16), jax.random.normal(keys[1], (hidden, inter),
            jnp.bfloat16), jnp.zeros((inter,), jnp.float32))
  else:
    kernel = jax.jit(lambda dy, wo, r: ffn_kernel.dgelu_matmul(dy, wo, r, saved=ffn_kernel.SAVE_GELU_DERIVATIVE))
    args = (jax.random.normal(keys[0], (m, hidden), jnp.bfloat16), jax.random.normal(keys[1], (inter, hidden),
            jnp.bfloat16), jax.random.normal(keys[2], (m, inter), jnp.bfloat16))
  for _ in range(3):
    jax.block_until_ready(kernel(*args))
  print(f"ran the ping-pong {kind} kernel 3 times at {m} x {hidden} x {inter}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", default="32768x768x3072,16384x1024x4096")
  parser.add_argument("--tiles", default="128x128x64x4", help="comma-separated m x n x k x stages launches")
  parser.add_argument("--widths", default="8", help="grid_tile_width values")
  parser.add_argument("--pingpong-stages", default="4",
                      help="ping-pong launches, comma-separated ring depth[x epilogue tile[x output slots]] with "
                           "optional +saved (SAVE_GELU_DERIVATIVE's kernels) ('' none)")
  parser.add_argument("--iters", type=int, default=50)
  parser.add_argument("--ablate", action="store_true", help="time the ping-pong kernels with parts taken out")
  parser.add_argument("--once", choices=("forward", "backward"), help="run one ping-pong kernel 3 times, no timing")
  args = parser.parse_args()
  if args.once:
    run_once(args.once, *(int(v) for v in args.shapes.split(",")[0].split("x")))
    return
  launches = pingpong_launches(args.pingpong_stages)
  options = step_lib.compiler_options()
  print(f"FFN GEMM + GELU, ms per call ({jax.devices()[0].device_kind}, jax {jax.__version__})")
  for shape in args.shapes.split(","):
    m, hidden, inter = (int(v) for v in shape.split("x"))
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (m, hidden), jnp.float32).astype(jnp.bfloat16)
    wi = (0.05 * jax.random.normal(keys[1], (hidden, inter), jnp.float32)).astype(jnp.bfloat16)
    bias = 0.1 * jax.random.normal(keys[2], (inter,), jnp.float32)
    fwd = jax.jit(xla_forward, compiler_options=options)
    gemm = jax.jit(jnp.dot, compiler_options=options)
    h_ref, g_ref = fwd(x, wi, bias)
    print(f"{shape}: XLA {time_ms(fwd, x, wi, bias, iters=args.iters):.4f}, its GEMM alone "
          f"{time_ms(gemm, x, wi, iters=args.iters):.4f}", flush=True)
    for spec in (args.tiles.split(",") if args.tiles != "none" else []):
      tm, tn, tk, stages = (int(v) for v in spec.split("x"))
      for width in (int(v) for v in args.widths.split(",")):
        for minor_m in (True, False):
          tiles = ffn_kernel.Tiles(m=tm, n=tn, k=tk, stages=stages, grid_tile_width=width, grid_minor_m=minor_m)
          label = f"  {spec} w{width} minor {'M' if minor_m else 'N'}"
          try:
            kf = jax.jit(lambda x, w, b, t=tiles: ffn_kernel.bias_gelu_matmul(x, w, b, t))
            kg = jax.jit(lambda x, w, t=tiles: ffn_kernel.matmul(x, w, t))
            h, g = kf(x, wi, bias)
            print(f"{label}: kernel {time_ms(kf, x, wi, bias, iters=args.iters):.4f} (h {rel_err(h, h_ref):.2g}, "
                  f"GELU(h) {rel_err(g, g_ref):.2g}), its GEMM alone {time_ms(kg, x, wi, iters=args.iters):.4f}",
                  flush=True)
          except Exception as error:  # noqa: BLE001 -- a launch the compiler refuses is a table line.
            print(f"{label}: fail {type(error).__name__}: {str(error)[:300]}", flush=True)
    dy = jax.random.normal(keys[3], (m, hidden), jnp.float32).astype(jnp.bfloat16)
    wo = (0.05 * jax.random.normal(keys[1], (inter, hidden), jnp.float32)).astype(jnp.bfloat16)
    if args.ablate:
      ablate(x, wi, bias, dy, wo, h_ref, args.iters)
    if not launches:
      continue
    bwd = jax.jit(xla_backward, compiler_options=options)
    dh_ref, sums_ref = bwd(dy, wo, h_ref)
    print(f"  backward, XLA (GEMM, GELU backward + bias gradient) {time_ms(bwd, dy, wo, h_ref, iters=args.iters):.4f}",
          flush=True)
    # SAVE_GELU_DERIVATIVE's residual, GELU'(h) in bf16 (launches with +saved)
    gp_ref = jax.jit(lambda h: ffn_kernel.gelu_derivative(h.astype(jnp.float32)).astype(h.dtype))(h_ref)
    timed_backward = set()
    for label, tiles, saved in launches:
      try:
        kf = jax.jit(lambda x, w, b, t=tiles, d=saved: ffn_kernel.bias_gelu_matmul_pingpong(x, w, b, t, derivative=d))
        r, g = kf(x, wi, bias)
        first = "GELU'(h)" if saved else "h"
        print(f"{label}: forward {time_ms(kf, x, wi, bias, iters=args.iters):.4f} ({first} "
              f"{rel_err(r, gp_ref if saved else h_ref):.2g}, GELU(h) {rel_err(g, g_ref):.2g})", flush=True)
      except Exception as error:  # noqa: BLE001
        print(f"{label}: forward fail {type(error).__name__}: {str(error)[:300]}", flush=True)
      if (tiles.stages, tiles.epi, saved) in timed_backward:  # no output slots there
        continue
      timed_backward.add((tiles.stages, tiles.epi, saved))
      side = gp_ref if saved else h_ref
      try:
        kb = jax.jit(lambda dy, wo, r, t=tiles, s=saved: ffn_kernel.dgelu_matmul(dy, wo, r, t, saved=s),
                     compiler_options=options)
        dh, sums = kb(dy, wo, side)
        print(f"{label}: backward + bias gradient {time_ms(kb, dy, wo, side, iters=args.iters):.4f} "
              f"(dh {rel_err(dh, dh_ref):.2g}, sums {rel_err(sums, sums_ref):.2g})", flush=True)
      except Exception as error:  # noqa: BLE001
        print(f"{label}: backward fail {type(error).__name__}: {str(error)[:300]}", flush=True)


if __name__ == "__main__":
  main()
