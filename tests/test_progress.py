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
