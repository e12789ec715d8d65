"""Times the MLM loss's row statistics: the Pallas kernel at several launches against XLA's reductions.

  python -m bench.cross_entropy                         # BERT-Base / -Large seq-128 MLM logits, bf16
  python -m bench.cross_entropy --shapes 64x4096 --launches 8/256/8/8 --iters 2   # CPU smoke run (interpreter)

One table, one line per [rows, vocabulary] bfloat16 logits (the padded vocabulary's last columns at the padding
logit), ms per call:
  * floor: reading the logits once at `--bandwidth`;
  * xla: the log-sum-exp, the target's logit and the argmax as `kernels.cross_entropy._row_statistics` computes them without
    the kernel (two passes over the logits: the maximum fused with the argmax, then the sum of exponentials);
  * R/C/S/W: `cross_entropy_kernel.row_statistics` at block_rows R, chunk C, up to S splits of the columns
    (programs a row block), W warps (XLA's combination of the splits and gather of the target logits included);
  * loss xla / loss pallas: `cross_entropy_sums` forward and backward (the gradient in the logits' dtype) with
    each implementation, the kernel at its default launch.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from bench.timing import time_ms
from bert_jax.kernels import cross_entropy as cross_entropy_kernel
from bert_jax.models.model import PAD_LOGIT

VOCAB = 30522


def inputs(rows: int, columns: int):
  keys = jax.random.split(jax.random.key(0), 3)
  logits = (3.0 * jax.random.normal(keys[0], (rows, columns), jnp.float32)).astype(jnp.bfloat16)
  logits = logits.at[:, VOCAB:].set(PAD_LOGIT) if columns > VOCAB else logits
  targets = jax.random.randint(keys[1], (rows,), 0, min(columns, VOCAB))
  weights = (jax.random.uniform(keys[2], (rows,)) > 0.05).astype(jnp.float32)
  return logits, targets, weights


def time_statistics(rows: int, columns: int, launch: str | None, iters: int) -> float:
  """ms per call; launch "R/C/S/W", None: XLA."""
  logits, targets, _ = inputs(rows, columns)
  if launch is None:
    fn = jax.jit(functools.partial(cross_entropy_kernel._row_statistics, kernel=False))  # noqa: SLF001
  else:
    block_rows, chunk, splits, warps = (int(n) for n in launch.split("/"))
    fn = jax.jit(lambda l, t: cross_entropy_kernel._statistics_2d(  # noqa: SLF001
        l, t, interpret=jax.default_backend() != "gpu", block_rows=block_rows, chunk=chunk, splits=splits,
        num_warps=warps, num_stages=1))
  return time_ms(fn, logits, targets, iters=iters)


def time_loss(rows: int, columns: int, implementation: str, iters: int) -> float:
  """ms per forward + backward of the kernels' weighted cross-entropy, its statistics from XLA or the kernel."""
  logits, targets, weights = inputs(rows, columns)
  fn = jax.jit(jax.value_and_grad(lambda l: cross_entropy_kernel.weighted_cross_entropy(
      l, targets, weights, implementation == "pallas")[0]))
  return time_ms(fn, logits, iters=iters)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", default="4864x30592,2432x30592", help="rows x vocabulary, comma-separated")
  parser.add_argument("--launches", default="8/256/1/8,8/256/4/8,8/256/8/8,8/256/15/8,8/256/20/8,4/256/8/4,"
                      "4/256/15/4,16/256/8/8,8/128/8/8,8/512/8/8,4/512/8/4",
                      help="block_rows/chunk/splits/warps, comma-separated")
  parser.add_argument("--iters", type=int, default=100)
  parser.add_argument("--bandwidth", type=float, default=3.0, help="TB/s for the floor column (H100: ~3.0)")
  args = parser.parse_args()
  launches = args.launches.split(",")
  header = ["rows x vocab", "floor", "xla"] + launches + ["loss xla", "loss pallas"]
  width = max(len(h) for h in header) + 1
  print(f"\nMLM cross-entropy row statistics, ms per call ({jax.devices()[0].device_kind})")
  print("".join(h.rjust(width) for h in header), flush=True)
  for shape in args.shapes.split(","):
    rows, columns = (int(n) for n in shape.split("x"))
    cells = [shape, f"{rows * columns * 2 / (args.bandwidth * 1e12) * 1e3:.3f}"]
    timers = ([functools.partial(time_statistics, launch=launch) for launch in [None] + launches]
              + [functools.partial(time_loss, implementation=impl) for impl in ("xla", "pallas")])
    for timer in timers:
      try:
        cells.append(f"{timer(rows, columns, iters=args.iters):.3f}")
      except Exception as error:  # noqa: BLE001 -- a launch Triton refuses is a table cell.
        cells.append(f"fail:{type(error).__name__}")
    print("".join(c.rjust(width) for c in cells), flush=True)


if __name__ == "__main__":
  main()
