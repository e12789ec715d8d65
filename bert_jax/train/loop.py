"""The training loop that pre-training and fine-tuning share: `run(train_step, state, batches, ...)`.

It steps the state, reads each log step's metrics once the next step is
dispatched (`metrics.PendingMetrics`), stops with an error naming the step
when the loss or gradients turn non-finite, and after every step gives each
hook its turn, in order: evaluation, checkpoints, preemption and early
stopping are hooks. A hook that is due sees the metrics of every step before
it already read. Python's full garbage collections skip the setup's objects
(`heap.frozen_setup`): frozen after the first step and after each hook's
first run (an evaluation compiles its own step).

With `multi_step` (k steps a call, `step.make_train_step(steps_per_call=k)`)
the loop takes k steps a call wherever the call ends at or before the next
scheduled point: the next log step, the next step a hook with a schedule
(`next_due`, as `Every`) is due, and `total_steps`; elsewhere single steps.
So logs and scheduled hooks keep their steps whatever k (a fine-tuning
epoch's end is where the data put it); intervals that are multiples of k
keep every call at k steps. A hook without `next_due` is asked only at the
end of each call.
"""

from __future__ import annotations

import collections
import dataclasses
import signal
from typing import Any, Callable, Iterator, Protocol, Sequence

from jax.experimental import multihost_utils

import jax

from bert_jax import progress as progress_lib
from bert_jax.train import checkpoint as checkpoint_lib
from bert_jax.train import heap
from bert_jax.train import metrics as metrics_lib


@dataclasses.dataclass(frozen=True)
class Instruments:
  """What a benchmark wraps around a pre-training run's loop, so that it times the real loop without patching it:
  `step` wraps each jitted step function (single and multi-step), `batches` the device batch iterator,
  `make_train_step` stands in for `step.make_train_step` (same arguments), and `on_loop_end` runs when the loop
  returns or raises, before the run's writers close."""

  step: Callable[[Callable], Callable] | None = None
  batches: Callable[[Iterator[Any]], Iterator[Any]] | None = None
  make_train_step: Callable[..., Callable] | None = None
  on_loop_end: Callable[[], None] | None = None


class NonFiniteLossError(FloatingPointError):
  """The loss or gradients became NaN/Inf."""


class Hook(Protocol):
  """Something the loop runs after a step: `due(step, last)` says when, `__call__` returns True to stop.

  A hook may also have `next_due(step) -> int | None`: the first step after `step` where its schedule makes it
  due (None: none), so that a call of several steps never runs past it.
  """

  def due(self, step: int, last: bool) -> bool: ...

  def __call__(self, step: int, state: Any) -> bool: ...


def next_multiple(step: int, every: int) -> int | None:
  """The first multiple of `every` after `step` (None when `every` is 0: never)."""
  return (step // every + 1) * every if every else None


class Every:
  """A hook that calls `fn(step, state) -> stop?` every `every` steps (0: never) and after the last step."""

  def __init__(self, every: int, fn: Callable[[int, Any], bool | None], at_last: bool = True):
    self.every, self.fn, self.at_last = every, fn, at_last

  def due(self, step: int, last: bool) -> bool:
    return bool(self.every) and (step % self.every == 0 or (last and self.at_last))

  def next_due(self, step: int) -> int | None:
    return next_multiple(step, self.every)

  def __call__(self, step: int, state: Any) -> bool:
    return bool(self.fn(step, state))


class FinishedSteps:
  """The newest step the device has finished, asked without waiting: a call's metrics are ready once its steps ran
  (the calls run in order). The progress bar counts these, not the steps dispatched ahead of the device."""

  def __init__(self, step: int):
    self.step = step
    self._calls: collections.deque[tuple[int, Any]] = collections.deque()  # (step after the call, a metric)

  def add(self, step: int, metrics: Any) -> None:
    self._calls.append((step, jax.tree.leaves(metrics)[0]))

  def newest(self) -> int:
    if self._calls and _ready(self._calls[-1][1]):  # the newest call done: every earlier one is
      self.step = self._calls[-1][0]
      self._calls.clear()
    while self._calls and _ready(self._calls[0][1]):
      self.step = self._calls.popleft()[0]
    return self.step


def _ready(value: Any) -> bool:
  return getattr(value, "is_ready", lambda: True)()


def run(train_step: Callable[[Any, Any], tuple[Any, Any]], state: Any, batches: Iterator[Any], *, start_step: int,
        total_steps: int, log_every: int, on_log: Callable[[int, dict[str, float]], None],
        nonfinite_message: Callable[[int, dict[str, float]], str], hooks: Sequence[Hook] = (),
        progress: Any = None, multi_step: Callable[[Any, Sequence[Any]], tuple[Any, Any]] | None = None,
        steps_per_call: int = 1) -> tuple[Any, int, bool]:
  """Steps `state` from `start_step` to `total_steps` over `batches`.

  Args:
    train_step: `(state, batch) -> (state, metrics)`; metrics hold "nonfinite" (`step.make_train_step`).
    state: the state at `start_step`.
    batches: device batches, read one per step.
    log_every: log the mean metrics of every `log_every` steps through `on_log(step, averaged)`.
    nonfinite_message: `(step, its metrics) -> text` of the `NonFiniteLossError` raised at a non-finite step.
    hooks: run in order after each step where due; one returning True stops the loop after that step.
    progress: a `progress.Progress` (or tqdm-like bar) advanced to the newest finished step once a call, or None.
    multi_step: `(state, steps_per_call batches) -> (state, metrics over those steps)`, or None.
    steps_per_call: the steps of one `multi_step` call.

  Returns:
    (state, the last step taken, whether a hook stopped the loop).
  """

  def next_stop(step: int) -> int:
    """The first step after `step` where the loop must be between calls: a log, a scheduled hook, the end."""
    stops = [total_steps, next_multiple(step, log_every) or total_steps]
    for hook in hooks:
      if (due := getattr(hook, "next_due", None)) is not None and (at := due(step)) is not None:
        stops.append(at)
    return min(stops)

  def read(step: int, averaged: dict[str, float], nonfinite) -> None:
    if nonfinite is not None:
      raise NonFiniteLossError(nonfinite_message(*nonfinite))
    on_log(step, averaged)

  pending = metrics_lib.PendingMetrics(read)
  step, stopped = start_step, False
  finished = FinishedSteps(start_step)

  def show_finished() -> None:
    if progress is not None:  # its count starts at start_step
      progress.update(finished.newest() - progress.n)

  with heap.frozen_setup() as freeze_setup:
    while step < total_steps and not stopped:
      if multi_step is not None and step + steps_per_call <= next_stop(step):
        taken = steps_per_call
        state, step_metrics = multi_step(state, [next(batches) for _ in range(taken)])
      else:
        taken = 1
        state, step_metrics = train_step(state, next(batches))
      freeze_setup()
      step += taken
      pending.add(step_metrics, taken)
      finished.add(step, step_metrics)
      if step % log_every == 0:
        pending.log_next(step)
      last = step == total_steps
      for index, hook in enumerate(hooks):
        if hook.due(step, last):
          pending.flush(step)
          stopped = hook(step, state) or stopped
          freeze_setup(f"hook {index}")
      show_finished()
    pending.flush(step)
  show_finished()
  return state, step, stopped


def run_and_close(train_step, state, batches, *, closers: Callable[[bool], Sequence[Callable[[], Any]]],
                  **run_args) -> tuple[Any, int, bool]:
  """`run`, then closes its progress bar and `closers(abandon)` whatever happened: `abandon` after a Ctrl-C in the
  loop (wait for no write); after a failure a closer's storage error is not raised over the run's own."""
  failed = abandon = False
  try:
    return run(train_step, state, batches, **run_args)
  except KeyboardInterrupt:
    failed = abandon = True
    raise
  except BaseException:
    failed = True
    raise
  finally:
    if run_args.get("progress") is not None:
      run_args["progress"].close()
    close_all(closers(abandon), quiet=failed)


def close_all(closers: Sequence[Callable[[], Any]], quiet: bool) -> None:
  """Calls every closer; then raises the first storage error among them, unless `quiet` (the run already failed:
  a write failing after it, on the same full disk, adds nothing)."""
  first = None
  for close in closers:
    try:
      close()
    except OSError as error:
      first = first or error
  if first is not None and not quiet:
    raise first


class Stopped(InterruptedError):
  """The run stopped at a stop request (SIGTERM or Ctrl-C) after saving what the same command resumes from."""


class CheckpointHook:
  """Saves `contents(step, state) -> (state tree, data state, meta)` with `checkpointer` every `every` steps (0:
  never), after the last step (`at_last`) and on a stop request (`Preemption`), where it returns True: the loop
  stops. `on_save()` runs after each save starts (the metrics logged so far made durable with it). A stop's
  checkpoint is waited for; `stop_line(step)`, if given, is printed once it is complete."""

  def __init__(self, checkpointer, every: int, preemption: "Preemption",
               contents: Callable[[int, Any], tuple[Any, dict[str, Any], dict[str, Any]]], *,
               on_save: Callable[[], None] = lambda: None, progress: Any = None,
               stop_line: Callable[[int], str] | None = None, at_last: bool = True):
    self.checkpointer, self.every, self.preemption, self.contents = checkpointer, every, preemption, contents
    self.on_save, self.progress, self.stop_line, self.at_last = on_save, progress, stop_line, at_last
    self.preempted = False
    self.requested: int | None = None  # the newest step a save was started for
    self.saved_on_stop: int | None = None  # the stop's checkpoint, once complete

  def due(self, step: int, last: bool) -> bool:
    self.checkpointer.check()  # A failed asynchronous save (a full disk) stops the run now, not at the next save.
    self.preempted = self.preemption.should_stop(step)  # every process asks after every call
    return self.preempted or bool(self.every and step % self.every == 0) or (last and self.at_last)

  def next_due(self, step: int) -> int | None:
    return next_multiple(step, self.every)

  def __call__(self, step: int, state) -> bool:
    self.requested = step
    tree, data_state, meta = self.contents(step, state)
    self.checkpointer.save(step, tree, data_state, meta, force=True)
    self.on_save()
    if self.preempted:
      self.checkpointer.wait()
      self.saved_on_stop = step
      if self.preemption.interrupted:  # A second Ctrl-C whose KeyboardInterrupt Python dropped (it hit a __del__).
        raise KeyboardInterrupt
      if self.stop_line is not None:
        progress_lib.print_line(self.progress, self.stop_line(step))
    return self.preempted

  def interrupted(self) -> InterruptedError:
    """The error of a second Ctrl-C, saying which checkpoint is complete (no save is waited for)."""
    complete = self.checkpointer.complete_steps()
    if self.saved_on_stop is not None:
      said = f"after the checkpoint at step {self.saved_on_stop} was saved"
    elif self.requested is not None and self.requested not in complete:
      said = f"no checkpoint was saved (the one of step {self.requested} was not complete; its files are never read)"
    else:
      said = "no checkpoint was saved"
    which = "a second Ctrl-C" if self.preemption.interrupted else "Ctrl-C"
    return InterruptedError(f"stopped by {which}: {said}; {checkpoint_lib.resume_point(complete)} in "
                            f"{self.checkpointer.directory}, where the same command resumes")


class Preemption:
  """Turns SIGTERM (and, on one process, Ctrl-C) into a stop that every process takes after the same step.

  One process: a Python handler sets a flag the loop reads between steps; a
  second Ctrl-C raises KeyboardInterrupt at once (and sets `interrupted`), so the
  caller stops without waiting for the stop's checkpoint and says which one is
  complete. Several processes: a per-process flag would stop the signalled process while
  the others enter the next step's collectives, and all would hang. JAX's
  preemption service (started by `jax.distributed.initialize`) takes SIGTERM on
  any process instead and names the step at which all of them stop, so no
  Python handler is installed there.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.requested = False
    self.interrupted = False  # a second Ctrl-C came: the run stops at once, waiting for no write
    self._previous = {}
    self._multiprocess = jax.process_count() > 1
    self._calls = 0  # the calls of the step so far, reported to JAX's preemption service

  def __enter__(self):
    if self._multiprocess:
      return self
    try:
      self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
    except ValueError:  # Not in the main thread: no handler.
      self._previous = {}
    return self

  def _handle(self, signum, frame):
    del frame
    if self.requested and signum == signal.SIGINT:  # A second Ctrl-C: stop at once, without the checkpoint.
      self.interrupted = True
      raise KeyboardInterrupt
    self.requested = True

  def should_stop(self, step: int) -> bool:
    """Whether to save and stop after `step`; call it after every call of the step (one step or several), on every
    process.

    JAX's service names the next count after the furthest any process has reported. The calls are counted, not the
    steps: a step inside a call of several steps could be named after the call has taken it, and no process would
    ever stop; the next call is always still ahead, and every process takes the same calls.
    """
    if self._multiprocess:
      self._calls += 1
      return multihost_utils.reached_preemption_sync_point(self._calls)
    return self.requested

  def __exit__(self, exc_type, exc, tb):
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    # The signal also reaches the processes this one started (XLA's ptxas, for one, in its process group): a failure
    # of theirs after a stop request is the stop, not the run's error. Nothing of the unfinished step was saved, so
    # the same command resumes from the last saved state.
    if self.requested and exc is not None and not isinstance(exc, (InterruptedError, KeyboardInterrupt)):
      raise Stopped(f"stop requested (SIGTERM or Ctrl-C) while {type(exc).__name__}: {str(exc).strip()[:200]}; "
                    "nothing after the last saved state was kept, and the same command resumes from it") from exc
