"""Python's garbage collector in the training loops: the setup's objects frozen out of its full collections.

By its first step a loop's heap holds hundreds of thousands of objects (JAX's tracing and compilation caches,
the model's pytrees, the input pipeline): ~515,000 in `bert-jax pretrain` at BERT-base on an H200's 16-core
host. Python's full (generation-2) collections walk all of them with the interpreter's lock held; there they
took up to 262 ms. With the real input pipeline's allocations one falls about every hundred steps: the
dispatching thread waits, the device runs out of queued steps, and those 10-step intervals ran at 3,900-4,600
seq/s against ~6,800 (300 steps: 6,305 seq/s overall). `gc.freeze()` after the first step (compiled by then)
moves those objects to a generation the collector never walks: the loop's full collections then took
1.7-4.2 ms and the run 6,795 seq/s (bench/NOTES.md, session 25). Both the pre-training and the fine-tuning
loop use it, and freeze once more after their first evaluation (its compiled step and caches).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Callable, Iterator


@contextlib.contextmanager
def frozen_setup() -> Iterator[Callable[..., None]]:
  """Yields `freeze(phase="step")`: the first call for a phase collects once and freezes every live object; later
  calls for that phase do nothing. A loop freezes after its first step ("step") and again after its first
  evaluation ("evaluation"), whose compilation adds ~55,000 objects at BERT-base on an H200 (bench/NOTES.md,
  session 26: the loop's later full collections 17-26 ms without the second freeze, 1.7-4.1 ms with it).
  On exit the frozen objects return to the collector (`gc.unfreeze()`, which also returns anything another library
  froze), so what the loop dropped, cycles included, is freed by the next full collection (a fine-tuning sweep
  runs one loop per seed in one process)."""
  frozen: set[str] = set()

  def freeze(phase: str = "step") -> None:
    if phase not in frozen:
      gc.collect()
      gc.freeze()
      frozen.add(phase)

  try:
    yield freeze
  finally:
    if frozen:
      gc.unfreeze()
