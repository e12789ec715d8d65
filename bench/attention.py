"""Times one attention call (forward, forward + backward) for each implementation, and tunes the flash kernels.

  python -m bench.attention                       # B=256 L=128 and B=64 L=512, 12 heads x 64, bf16
  python -m bench.attention --sweep               # also flash tiles and (num_warps, num_stages) per kernel
  python -m bench.attention --shapes 2x64 --impls xla,flash   # CPU smoke run (flash in Pallas' interpreter)

Implementations: "xla" (the reference path, with dropout), "flash" (Pallas
kernels, with dropout), "cudnn" (GPU only, without dropout: cuDNN's fused
attention has no per-call dropout seed), "flash-nodrop", and
"mgpu-nomask": jax's own FlashAttention-3-style kernel for Hopper
(`jax.experimental.pallas.ops.gpu.attention_mgpu`: warp-specialised, wgmma),
which has no padding mask and no dropout, so it is not a path of the model; it
measures what that kernel design gives at BERT's shapes (`--mgpu-blocks`; float16
inputs). Measured on an H100: no faster than "flash-nodrop" in forward + backward.

  python -m bench.attention --impls flash-nodrop,mgpu-nomask --heads 16 --shapes 128x128,32x512

The sweep varies the tiles and Triton launch parameters of
`flash_attention.KERNEL_PARAMS`: the forward kernel timed alone, the two
backward kernels together in the forward + backward time. Prints one table per
part.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp

from bench.timing import time_ms
from bert_jax.kernels import flash_attention
from bert_jax.kernels.attention import dot_product_attention, self_attention

IMPLS = {"xla": ("xla", 0.1), "flash": ("flash", 0.1), "cudnn": ("cudnn", 0.0), "flash-nodrop": ("flash", 0.0),
         "mgpu-nomask": ("mgpu", 0.0)}


def mgpu_attention(blocks: str):
  """jax's Hopper attention kernel with `blocks` = "block_q x block_kv x stages x bwd_block_q x bwd_block_kv x
  bwd_warpgroups" (the same backward blocks for its dQ and dK/dV kernels)."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu
  bq, bkv, stages, bwd_q, bwd_kv, wgs = (int(v) for v in blocks.split("x"))
  config = attention_mgpu.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=stages,
                                       block_q_dkv=bwd_q, block_kv_dkv=bwd_kv, block_q_dq=bwd_q,
                                       block_kv_dq=bwd_kv, compute_wgs_bwd=wgs)
  return lambda q, k, v: attention_mgpu.attention(q, k, v, config)


def time_attention(batch: int, length: int, impl: str, *, heads: int = 12, head_dim: int = 64,
                   iters: int = 20, mgpu_blocks: str = "64x64x2x64x64x1") -> tuple[float, float]:
  """(forward ms, forward + backward ms) of one bf16 attention call with every token real.

  The flash kernels get the fused [B, L, H, 3, D] projections the encoder gives them (`self_attention`); the
  other implementations get separate query, key and value.
  """
  implementation, rate = IMPLS[impl]
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, cotangent = (jax.random.normal(key, (batch, length, heads, head_dim), jnp.bfloat16) for key in keys)
  pack = jnp.ones((batch, length), jnp.int32)
  options = dict(pack_ids=pack, implementation=implementation, dropout_rate=rate,
                 dropout_rng=jax.random.key(1) if rate else None)
  if implementation == "flash":
    inputs = (flash_attention.fuse_qkv(q, k, v),)
    attend = lambda qkv: self_attention(qkv, **options)[0]  # noqa: E731
  elif implementation == "mgpu":  # float16: jax 0.11.2's kernel rejects bf16 inputs (a float16 buffer inside)
    inputs = (q.astype(jnp.float16), k.astype(jnp.float16), v.astype(jnp.float16))
    attend = mgpu_attention(mgpu_blocks)
  else:
    inputs = (q, k, v)
    attend = lambda q, k, v: dot_product_attention(q, k, v, **options)[0]  # noqa: E731

  def loss(*inputs):
    return jnp.sum(attend(*inputs).astype(jnp.float32) * cotangent.astype(jnp.float32))

  forward = jax.jit(loss)
  backward = jax.jit(jax.grad(loss, argnums=tuple(range(len(inputs)))))
  return time_ms(forward, *inputs, iters=iters), time_ms(backward, *inputs, iters=iters)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", default="256x128,64x512", help="BATCHxLENGTH,...")
  parser.add_argument("--impls", default="xla,cudnn,flash,flash-nodrop")
  parser.add_argument("--heads", type=int, default=12, help="heads of 64 (BERT-Large: 16)")
  parser.add_argument("--mgpu-blocks", default="64x64x2x64x64x1",
                      help="comma-separated launches of mgpu-nomask (see `mgpu_attention`)")
  parser.add_argument("--sweep", action="store_true", help="tune flash tiles, num_warps and num_stages")
  parser.add_argument("--iters", type=int, default=20)
  args = parser.parse_args()
  shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
  gpu = jax.default_backend() == "gpu"
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)

  rows = ["| shape | impl | fwd ms | fwd+bwd ms |", "|---|---|---|---|"]
  runs = [(impl, None) for impl in args.impls.split(",") if impl != "mgpu-nomask"]
  if "mgpu-nomask" in args.impls.split(","):
    runs += [("mgpu-nomask", blocks) for blocks in args.mgpu_blocks.split(",")]
  for (batch, length), (impl, blocks) in itertools.product(shapes, runs):
    if impl in ("cudnn", "mgpu-nomask") and not gpu:
      continue
    name = f"{impl} {blocks}" if blocks else impl
    try:
      fwd, both = time_attention(batch, length, impl, heads=args.heads, iters=args.iters,
                                 **({"mgpu_blocks": blocks} if blocks else {}))
      rows.append(f"| B={batch} L={length} H={args.heads} | {name} | {fwd:.3f} | {both:.3f} |")
    except Exception as error:  # noqa: BLE001 -- a failed config is a row, not the end of the sweep.
      rows.append(f"| B={batch} L={length} H={args.heads} | {name} | failed: {repr(error)[:300]} | |")
    print(rows[-1], flush=True)

  if args.sweep:
    default = dict(flash_attention.KERNEL_PARAMS)
    rows += ["", "| shape | kernels | block_q | block_k | num_warps | num_stages | fwd ms | fwd+bwd ms |",
             "|---|---|---|---|---|---|---|---|"]
    grid = itertools.product(shapes, ((64, 64), (128, 64), (64, 128), (128, 128)), (4, 8), (2, 3))
    for (batch, length), (block_q, block_k), warps, stages in grid:
      for part in ("forward", "backward"):
        flash_attention.KERNEL_PARAMS.update(default)
        kernels = ("forward",) if part == "forward" else ("dkdv", "dq")
        for kernel in kernels:
          flash_attention.KERNEL_PARAMS[kernel] = flash_attention.KernelParams(block_q, block_k, warps, stages)
        config = f"| B={batch} L={length} | {'+'.join(kernels)} | {block_q} | {block_k} | {warps} | {stages} |"
        try:
          fwd, both = time_attention(batch, length, "flash", iters=args.iters)
          rows.append(f"{config} {fwd:.3f} | {both:.3f} |")
        except Exception as error:  # noqa: BLE001
          rows.append(f"{config} failed: {repr(error)[:120]} | |")
        print(rows[-1], flush=True)
    flash_attention.KERNEL_PARAMS.update(default)
  print("\n".join(rows))


if __name__ == "__main__":
  main()
