"""The timing loop the kernel benchmarks share."""

import time

import jax


def time_ms(fn, *args, iters: int) -> float:
  """Milliseconds per call of `fn(*args)`: one call to compile and warm up, then `iters` calls back to back, waited
  for once at the end (the device queue stays full, as in a training step)."""
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  for _ in range(iters):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / iters * 1e3
