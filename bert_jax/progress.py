"""Progress of every long-running command: a tqdm bar on a terminal, plain periodic lines otherwise.

  progress = Progress(total_steps, "pretrain", initial=start_step)
  progress.update(1); progress.set_postfix({"loss": "2.31"}); progress.write("eval @ 400: ..."); progress.close()

Both show the count, the rate and the time left. The clock of the rate and
the ETA starts at the first `update`: the first step of a run compiles, and
counting that time would promise hours for a run of minutes. Callers count
steps the device has finished, not ones dispatched to it (`loop.FinishedSteps`):
dispatch runs ahead of the device, and counting it would promise too little
time. With `after` (the steps of later bars: a fine-tuning run's other
seeds) the time left for all of them is shown too. Redirected output (a log
file, CI, a pipe) gets one line every `every_seconds` instead of a bar's
carriage returns.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Mapping, TextIO


def _clock(seconds: float) -> str:
  minutes, seconds = divmod(int(round(seconds)), 60)
  hours, minutes = divmod(minutes, 60)
  return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes:02d}:{seconds:02d}"


class Progress:
  """A count towards `total` (None: unknown) shown as a bar or as lines; tqdm's update/set_postfix/write/close.

  Args:
    total: steps (or items) to go to; None shows the count and rate without an ETA.
    desc: the label in front.
    initial: the count already done (a resumed run).
    unit: what is counted ("step", "doc", "row").
    unit_scale: units per `update(1)`: a fine-tuning step of 32 examples counts 32 "ex".
    every_seconds: the interval of the plain lines; 0 prints a line at every update.
    stream: where it writes (stdout by default).
    plain: lines even on a terminal (None: lines exactly when `stream` is not a terminal).
    clock_after_first: start the clock at the first update (its time was compilation) rather than now; a
      plain line is printed then, and every `every_seconds` after.
    after: steps still to come after this bar's total, at this bar's rate (a fine-tuning run's later seeds);
      when positive the time left for all of them is shown too, "for `after_label`".
    after_label: what the time left with `after` is for.
    clock: the time in seconds (tests give a fake one).
  """

  def __init__(self, total: int | None, desc: str, *, initial: int = 0, unit: str = "step", unit_scale: int = 1,
               every_seconds: float = 30.0, stream: TextIO | None = None, plain: bool | None = None,
               clock_after_first: bool = True, after: int = 0, after_label: str = "all seeds",
               clock: Callable[[], float] = time.perf_counter):
    self.total, self.desc, self.n, self.unit, self.unit_scale = total, desc, initial, unit, unit_scale
    self.every_seconds, self.after, self.after_label, self.clock = every_seconds, after, after_label, clock
    self.stream = sys.stdout if stream is None else stream
    self.plain = not _is_terminal(self.stream) if plain is None else plain
    self.postfix: dict[str, str] = {}
    # (time, count) where the rate's clock starts
    self._started: tuple[float, int] | None = None if clock_after_first else (clock(), initial)
    self._last_line = 0.0
    self._bar = None
    if not self.plain:
      from tqdm import tqdm
      self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, unit_scale=unit_scale if unit_scale > 1
                       else False, dynamic_ncols=True, mininterval=1.0, file=self.stream)

  def update(self, count: int = 1) -> None:
    """`count` more steps done (finished, not only dispatched)."""
    if count <= 0:
      return
    self.n += count
    if self._started is None:
      self._started = (self.clock(), self.n)
      if self._bar is not None:  # Restart tqdm's clock too: the time so far was compilation.
        self._bar.reset(total=self.total)
        self._bar.initial = self._bar.n = self._bar.last_print_n = self.n
        self._bar.refresh()
        return
    if self._bar is not None:
      if self.after:  # tqdm shows this bar's time left; the time for all goes beside it.
        self._bar.set_postfix(self._bar_postfix(), refresh=False)
      self._bar.update(count)
    elif self.clock() - self._last_line >= self.every_seconds or self.n == self.total:
      self._print_status()

  def set_postfix(self, postfix: Mapping[str, Any], refresh: bool = False) -> None:
    self.postfix = {key: str(value) for key, value in postfix.items()}
    if self._bar is not None:
      self._bar.set_postfix(self._bar_postfix(), refresh=refresh)

  def _bar_postfix(self) -> dict[str, str]:
    left_all = self.time_left()[1]
    return {**self.postfix, **({self.after_label: f"{_clock(left_all)} left"} if left_all is not None else {})}

  def rate(self) -> float | None:
    """Steps a second since the clock started (None before two updates)."""
    if self._started is None:
      return None
    elapsed, done = self.clock() - self._started[0], self.n - self._started[1]
    return done / elapsed if elapsed > 0 and done > 0 else None

  def time_left(self) -> tuple[float | None, float | None]:
    """(seconds left for this bar, seconds left with `after` or None without it), at the rate so far."""
    rate = self.rate()
    if rate is None or not self.total:
      return None, None
    left = max(self.total - self.n, 0) / rate
    return left, (left + self.after / rate if self.after else None)

  def write(self, text: str) -> None:
    """A line of its own that the bar does not overwrite."""
    if self._bar is not None:
      self._bar.write(text, file=self.stream)
    else:
      print(text, file=self.stream, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
    elif self._started is not None and self._last_line and self.n != self.total:
      self._print_status()

  def status(self) -> str:
    """The plain line: count, percentage, rate, elapsed and left, postfix (counts in units times unit_scale)."""
    scale = self.unit_scale
    parts = [f"{self.n * scale:,}/{self.total * scale:,} {self.unit} ({100 * self.n / self.total:.0f}%)"
             if self.total else f"{self.n * scale:,} {self.unit}"]
    rate = self.rate()
    if rate is not None:
      per_second = rate * scale
      parts.append(f"{per_second:,.{2 if per_second < 10 else 1}f} {self.unit}/s" if per_second >= 1 else
                   f"{1 / per_second:,.1f} s/{self.unit}")
      left, left_all = self.time_left()
      parts.append(f"{_clock(self.clock() - self._started[0])} elapsed"
                   + (f", {_clock(left)} left" if left is not None else "")
                   + (f", {_clock(left_all)} for {self.after_label}" if left_all is not None else ""))
    parts += [f"{key}={value}" for key, value in self.postfix.items()]
    return f"{self.desc}: " + ", ".join(parts)

  def _print_status(self) -> None:
    self._last_line = self.clock()
    print(self.status(), file=self.stream, flush=True)


def metrics_postfix(metrics: Mapping[str, float]) -> dict[str, str]:
  """The bar's summary of a training log row: loss, MLM accuracy, tokens/s, MFU (those present)."""
  out = {"loss": f"{metrics['loss']:.3f}"} if "loss" in metrics else {}
  if "mlm_accuracy" in metrics:
    out["mlm_acc"] = f"{metrics['mlm_accuracy']:.3f}"
  if "tokens_per_second" in metrics:
    out["tok/s"] = f"{metrics['tokens_per_second']:.0f}"
  if "mfu" in metrics:
    out["mfu"] = f"{100 * metrics['mfu']:.1f}%"
  return out


def print_line(progress: Progress | None, text: str) -> None:
  """`text` on a line of its own, through the bar when there is one."""
  if progress is not None:
    progress.write(text)
  else:
    print(text, flush=True)


def _is_terminal(stream: TextIO) -> bool:
  try:
    return stream.isatty()
  except (AttributeError, ValueError):
    return False
