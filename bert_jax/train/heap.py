"""Python's garbage collector in the training loop: the setup's objects frozen out of its full collections.

By its first step a loop's heap holds hundreds of thousands of objects (JAX's tracing and compilation caches,
the model's pytrees, the input pipeline). Python's full (generation-2) collections walk all of them with the
interpreter's lock held; while one runs the dispatching thread waits and the device can run out of queued
steps. `gc.freeze()` after the first step (compiled by then) moves those objects to a generation the collector
never walks, which keeps full collections short (docs/performance.md). The training loop (`loop.run`) freezes
after its first step and once more after each hook's first run (an evaluation's compiled step and caches).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Callable, Iterator


@contextlib.contextmanager
def frozen_setup() -> Iterator[Callable[..., None]]:
  """Yields `freeze(phase="step")`: the first call for a phase collects once and freezes every live object; later
  calls for that phase do nothing. A loop freezes after its first step ("step") and again after the first run of
  anything that compiles or caches more (an evaluation).
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
