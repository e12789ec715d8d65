"""Progress of long-running commands: plain periodic lines when not on a terminal, an ETA that skips compilation."""

from __future__ import annotations

import io
import re
import time

from bert_jax import progress as progress_lib


def test_lines_when_not_a_terminal_with_rate_eta_and_postfix():
  out = io.StringIO()
  progress = progress_lib.Progress(4, "seed 1", unit="ex", unit_scale=32, every_seconds=0, stream=out)
  assert progress.plain  # a StringIO is no terminal: no carriage returns
  progress.update()
  for _ in range(3):
    progress.set_postfix({"loss": "0.693"})
    progress.update()
  progress.write("seed 1 step 4 (epoch 1): dev accuracy=50.00")
  progress.close()
  lines = out.getvalue().splitlines()
  assert "\r" not in out.getvalue() and lines[0] == "seed 1: 32/128 ex (25%)"
  assert lines[-2].startswith("seed 1: 128/128 ex (100%), ") and " ex/s, " in lines[-2] and "left" in lines[-2]
  assert lines[-2].endswith("loss=0.693") and lines[-1].startswith("seed 1 step 4")


def test_the_clock_starts_after_the_first_compiled_step():
  out = io.StringIO()
  progress = progress_lib.Progress(1000, "pretrain", every_seconds=0, stream=out)
  time.sleep(0.3)  # the first step: compilation
  progress.update()
  progress.update()
  # Counting the first step's 0.3 s, 998 steps would take minutes; from the first step on, a second or two.
  assert re.search(r", 00:0\d left$", out.getvalue().splitlines()[-1]), out.getvalue()
  bar = progress_lib.Progress(1000, "pretrain", stream=out, plain=False)
  time.sleep(0.3)
  bar.update()
  assert bar._bar.format_dict["elapsed"] < 0.1 and bar._bar.format_dict["initial"] == 1
  bar.close()


def test_counts_without_a_total():
  out = io.StringIO()
  progress = progress_lib.Progress(None, "prepare", unit="doc", every_seconds=0, stream=out)
  progress.update(1500)
  progress.update(1500)
  assert out.getvalue().splitlines()[-1].startswith("prepare: 3,000 doc, ") and "left" not in out.getvalue()


class FakeClock:
  def __init__(self):
    self.now = 100.0

  def __call__(self) -> float:
    return self.now


def test_the_time_left_over_all_seeds_from_a_fake_clock():
  clock, out = FakeClock(), io.StringIO()
  # Seed 2 of 3: 100 steps here, 100 for seed 3 after it.
  progress = progress_lib.Progress(100, "seed 2 (2/3)", every_seconds=0, stream=out, after=100, clock=clock)
  clock.now += 30.0  # the first step compiles: its time is not counted
  progress.update(1)
  clock.now += 10.0
  progress.update(20)  # 2 steps a second
  assert progress.time_left() == (39.5, 89.5)
  assert out.getvalue().splitlines()[-1] == (
      "seed 2 (2/3): 21/100 step (21%), 2.00 step/s, 00:10 elapsed, 00:40 left, 01:30 for all seeds")
  last = progress_lib.Progress(100, "seed 3 (3/3)", every_seconds=0, stream=out, clock=clock)
  last.update(1)
  clock.now += 5.0
  last.update(10)
  assert last.time_left() == (44.5, None) and "for all seeds" not in out.getvalue().splitlines()[-1]


def test_a_bar_shows_the_time_for_all_seeds_beside_its_own():
  clock = FakeClock()
  bar = progress_lib.Progress(10, "seed 1 (1/2)", stream=io.StringIO(), plain=False, after=10, clock=clock)
  bar.update(1)
  clock.now += 4.0
  bar.update(4)  # a step a second: 5 left here, 15 in all
  bar.set_postfix({"loss": "0.5"})
  assert bar._bar.postfix == "loss=0.5, all seeds=00:15 left"
  bar.close()


class FakeMetric:
  """A step's metric that the device finishes when the test says so."""

  def __init__(self):
    self.ready = False

  def is_ready(self) -> bool:
    return self.ready


def test_the_count_is_of_finished_steps_not_dispatched_ones():
  from bert_jax.train import loop

  finished = loop.FinishedSteps(10)  # a resumed run starts at step 10
  calls = [(11, FakeMetric()), (12, FakeMetric()), (16, FakeMetric())]  # one step, one step, a call of four
  for step, metric in calls:
    finished.add(step, {"loss": metric})
  assert finished.newest() == 10  # dispatched, none run yet
  calls[0][1].ready = True
  assert finished.newest() == 11
  calls[2][1].ready = True  # calls finish in order: the newest one done means every earlier one is
  assert finished.newest() == 16
