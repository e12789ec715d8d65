"""Times the LayerNorm kernels against the XLA forms, at several launch parameters.

  python -m bench.layer_norm                              # BERT-Base and -Large rows of a seq-128 step, bf16
  python -m bench.layer_norm --shapes 256x128 --blocks 32 --step-rows 2 --warps 4   # CPU smoke run (interpreter)

Three tables, one line per [rows, features] input, ms per call:
  * backward: the XLA backward of `ops.layer_norm` (one row-reduction, one
    elementwise and one column-reduction kernel) and
    `layer_norm_kernel.layer_norm_backward`, with the floor of reading x and dy
    and writing dx once at the `--bandwidth` given;
  * residual backward of the post-LN residual LayerNorm(x + dropout(branch + bias)),
    rate 0.1: XLA's form, "split" (the plain backward kernel, then XLA's fusion of
    the dropout's backward and the bias gradient: the arrangement before they
    moved into the kernel) and `layer_norm_kernel.add_layer_norm_backward`, with the floor of reading
    the sum and dy and writing dx and the branch's gradient once;
  * forward of that residual: XLA's form of `ops.add_layer_norm` and
    `layer_norm_kernel.add_layer_norm_forward`, with the floor of reading x and
    the branch and writing the sum and y once.
Each backward kernel is timed for every (block_rows, step_rows, num_warps)
("Nr/Ss/Ww"), the forward for every (block_rows, num_warps) ("Nr/Ww").
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp

from bench.timing import time_ms
from bert_jax.kernels import dropout, ops
from bert_jax.kernels import layer_norm as layer_norm_kernel


def inputs(rows: int, features: int, dtype=jnp.bfloat16):
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (rows, features), jnp.float32).astype(dtype)
  dy = jax.random.normal(keys[1], (rows, features), jnp.float32).astype(dtype)
  scale = 1.0 + 0.1 * jax.random.normal(keys[2], (features,), jnp.float32)
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  rstd = jax.lax.rsqrt(jnp.var(x32, axis=-1, keepdims=True) + 1e-12)
  return x, dy, mean, rstd, scale


def time_backward(rows: int, features: int, launch: tuple[int, int, int] | None, iters: int) -> float:
  """ms per backward call; launch (block_rows, step_rows, num_warps), None: the XLA form."""
  x, dy, mean, rstd, scale = inputs(rows, features)
  if launch is None:
    bias = jnp.zeros_like(scale)
    fn = jax.jit(lambda x, dy, mean, rstd, scale: ops._layer_norm_bwd(  # noqa: SLF001
        1e-12, x.dtype, "xla", (x, mean, rstd, scale, bias), dy))
  else:
    fn = jax.jit(lambda *a: layer_norm_kernel.layer_norm_backward(*a, **_launch_kwargs(launch)))
  return time_ms(fn, x, dy, mean, rstd, scale, iters=iters)


def _launch_kwargs(launch: tuple[int, int, int]) -> dict[str, int]:
  return dict(zip(("block_rows", "step_rows", "num_warps"), launch))


def time_residual_backward(rows: int, features: int, launch: tuple[int, int, int] | str | None, iters: int
                           ) -> float:
  """ms per post-LN residual backward call (dx, dbranch, dscale, dbias, dbranch_bias); launch None: the XLA
  form, "split": the plain backward kernel at its default launch and XLA's dropout backward and bias sum."""
  total, dy, mean, rstd, scale = inputs(rows, features)
  bias, seeds = jnp.zeros_like(scale), jnp.asarray([1, 2], jnp.int32)
  residuals = (total, mean, rstd, scale, bias, seeds, bias)
  if launch is None:
    fn = jax.jit(lambda dy, *r: ops._add_layer_norm_bwd(0.1, 1e-12, total.dtype, "xla", r, dy))  # noqa: SLF001
  elif launch == "split":
    def fn(dy, total, mean, rstd, scale, *_):
      dx, dscale, dbias = layer_norm_kernel.layer_norm_backward(total, dy, mean, rstd, scale)
      dbranch = dropout.apply_mask_backward(dx, seeds, 0.1)
      return dx, dbranch, dscale, dbias, jnp.sum(dbranch.astype(jnp.float32), axis=0)
    fn = jax.jit(fn)
  else:
    fn = jax.jit(lambda dy, total, mean, rstd, scale, *_: layer_norm_kernel.add_layer_norm_backward(
        total, dy, mean, rstd, scale, seeds, 0.1, True, **_launch_kwargs(launch)))
  return time_ms(fn, dy, *residuals, iters=iters)


def time_forward(rows: int, features: int, launch: tuple[int, int, int] | None, iters: int) -> float:
  """ms per residual LayerNorm forward call (y, the sum and the statistics, with the branch's bias); launch
  (block_rows, 0, num_warps), None: the XLA form."""
  x, branch, _, _, scale = inputs(rows, features)
  bias, seeds = jnp.zeros_like(scale), jnp.asarray([1, 2], jnp.int32)
  if launch is None:
    fn = jax.jit(lambda x, branch, scale, bias: ops._add_layer_norm_fwd(  # noqa: SLF001
        x, branch, bias, scale, bias, seeds, 0.1, 1e-12, x.dtype, "xla"))
  else:
    fn = jax.jit(lambda x, branch, scale, bias: layer_norm_kernel.add_layer_norm_forward(
        x, branch, scale, bias, seeds, 0.1, 1e-12, x.dtype, bias, block_rows=launch[0], num_warps=launch[2]))
  return time_ms(fn, x, branch, scale, bias, iters=iters)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", default="32768x768,16384x1024,8192x4096", help="rows x features, comma-separated")
  parser.add_argument("--blocks", default="8,16,32,64", help="block_rows values")
  parser.add_argument("--step-rows", default="1,2", help="the backward kernels' rows per loop step")
  parser.add_argument("--warps", default="1,2,4,8", help="num_warps values")
  parser.add_argument("--passes", default="backward,residual,forward")
  parser.add_argument("--iters", type=int, default=50)
  parser.add_argument("--bandwidth", type=float, default=3.0, help="TB/s for the floor column (H100: ~3.0)")
  args = parser.parse_args()
  numbers = lambda text: [int(n) for n in text.split(",")]  # noqa: E731
  for part in args.passes.split(","):
    timer, arrays, baselines = {"backward": (time_backward, 3, [None]),
                                "residual": (time_residual_backward, 4, [None, "split"]),
                                "forward": (time_forward, 4, [None])}[part]
    steps = [0] if part == "forward" else numbers(args.step_rows)
    launches = baselines + list(itertools.product(numbers(args.blocks), steps, numbers(args.warps)))
    header = ["rows x features", "floor"] + [
        {None: "xla", "split": "split"}.get(l) if not isinstance(l, tuple) else
        f"{l[0]}r/{l[2]}w" if not l[1] else f"{l[0]}r/{l[1]}s/{l[2]}w" for l in launches]
    width = max(len(h) for h in header) + 1
    print(f"\nLayerNorm {part}, ms per call ({jax.devices()[0].device_kind})")
    print("".join(h.rjust(width) for h in header), flush=True)
    for shape in args.shapes.split(","):
      rows, features = (int(n) for n in shape.split("x"))
      floor = arrays * rows * features * 2 / (args.bandwidth * 1e12) * 1e3
      cells = [shape, f"{floor:.3f}"]
      for launch in launches:
        try:
          cells.append(f"{timer(rows, features, launch, args.iters):.3f}")
        except Exception as error:  # noqa: BLE001 -- a launch configuration Triton refuses is a table cell.
          cells.append(f"fail:{type(error).__name__}")
      print("".join(c.rjust(width) for c in cells), flush=True)


if __name__ == "__main__":
  main()
