"""Times the exact GELU's XLA kernels with two erf evaluations: `lax.erf` and the Abramowitz-Stegun form.

  python -m bench.gelu                                   # BERT-Base / -Large FFN activations, bf16
  python -m bench.gelu --shapes 256x512 --iters 2        # CPU smoke run

Per [tokens, intermediate] shape, ms per call of the forward GELU (read h, write GELU(h)) and of the backward
pass as the train step fuses it (read h and dy, write dh = dy GELU'(h), and the bias gradient, the float32
column sums of dh), each with erf from `lax.erf` ("lax": `ops.gelu`'s rules) and from the kernels'
Abramowitz-Stegun 7.1.26 polynomial ("as": the Hopper kernels' `ffn_kernel.gelu` and `gelu_derivative`, whose
exp(-h^2 / 2) the backward shares with the normal density).
The "floor" rows do the same memory traffic with a multiply in place of the GELU: the memory-bound time.

Measured on an H100: "lax" is at the floor (backward 0.257 against 0.256 ms at
32768 x 3072) and "as" is slower (0.479), so `ops.gelu` keeps `lax.erf`. (That run wrote the polynomial inline
with a division and exp; `ffn_kernel.gelu` and `gelu_derivative` now evaluate it through `normal_tail`, with
rsqrt and exp2. Not re-timed since.)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from bench.timing import time_ms
from bert_jax.kernels import ffn as ffn_kernel
from bert_jax.kernels import ops
from bert_jax.train import step as step_lib


def forward(h, erf):
  if erf == "floor":
    return h * h
  h32 = h.astype(jnp.float32)
  return (ffn_kernel.gelu(h32) if erf == "as" else ops._gelu_value(h32, False)).astype(h.dtype)


def backward(h, dy, erf):
  h32 = h.astype(jnp.float32)
  if erf == "floor":
    slope = h32
  elif erf == "as":
    slope = ffn_kernel.gelu_derivative(h32)
  else:
    slope = ops._gelu_derivative(h32, False)
  dh = (dy.astype(jnp.float32) * slope).astype(h.dtype)
  return dh, jnp.sum(dh.astype(jnp.float32), axis=0)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", default="32768x3072,16384x4096")
  parser.add_argument("--iters", type=int, default=50)
  args = parser.parse_args()
  options = step_lib.compiler_options()
  print(f"exact GELU, ms per call ({jax.devices()[0].device_kind}, jax {jax.__version__})")
  rows = ["| shape | erf | forward ms | backward + bias gradient ms | max abs diff from lax (fwd, bwd) |",
          "|---|---|---|---|---|"]
  for shape in args.shapes.split(","):
    tokens, width = (int(v) for v in shape.split("x"))
    keys = jax.random.split(jax.random.key(0), 2)
    h = (1.5 * jax.random.normal(keys[0], (tokens, width), jnp.float32)).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[1], (tokens, width), jnp.float32).astype(jnp.bfloat16)
    ref = None
    for erf in ("lax", "as", "floor"):
      fwd = jax.jit(lambda h, e=erf: forward(h, e), compiler_options=options)
      bwd = jax.jit(lambda h, dy, e=erf: backward(h, dy, e), compiler_options=options)
      outs = (fwd(h), bwd(h, dy)[0])
      ref = outs if ref is None else ref
      diffs = ", ".join(f"{float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))):.2g}"
                        for a, b in zip(outs, ref))
      rows.append(f"| {shape} | {erf} | {time_ms(fwd, h, iters=args.iters):.4f} | "
                  f"{time_ms(bwd, h, dy, iters=args.iters):.4f} | {diffs} |")
      print(rows[-1], flush=True)
  print("\n".join(rows))


if __name__ == "__main__":
  main()
