"""bench/input_pipeline.py on a CPU: the host's batch rate and the loop around a trivial step, with the per-step
split, the sampled stacks and the report written."""

import json

import pytest

from test_trainer import prepared  # noqa: F401 - the session fixture (prepared built-in corpus)

from conftest import bench_module


@pytest.mark.slow
def test_input_pipeline_bench_smoke(prepared, tmp_path, capsys):  # noqa: F811
  bench = bench_module("input_pipeline")
  out = tmp_path / "out"
  assert bench.main(["--out", str(out), "--scratch", str(tmp_path / "scratch"), "--data", str(prepared),
                     "--formats", "segment_pair", "--batches", "8", "--workers", "0", "--seconds", "0.3",
                     "--sizes", "mini", "--batch", "8", "--mini-batch", "8", "--loop-formats", "packed",
                     "--loop-steps", "200", "--loop-on-cpu", "--loop-step", "trivial", "--loop-profile",
                     "--steps-per-call", "1,2"]) == 0
  report = json.loads((out / "input_pipeline.json").read_text())
  (host,) = report["host"]
  assert host["format"] == "segment_pair" and host["batches_per_s"] > 0
  assert [loop["steps_per_call"] for loop in report["loop"]] == [1, 2]
  for loop in report["loop"]:
    assert loop["format"] == "packed" and loop["loop_seq_per_s"] > 0 and loop["timed_steps"] > 0
    assert loop["timed_steps"] == loop["timed_calls"] * loop["steps_per_call"]
    # The headline rate is the per-step table's window: its mean wall time a step.
    assert abs(loop["loop_step_us"] - loop["step_wall_us"]["mean"]) <= 1e-6 * loop["loop_step_us"]
    for part in ("step_wall_us", "step_wait_us", "step_dispatch_us", "step_rest_us"):
      assert loop[part]["p50"] <= loop[part]["p90"] <= loop[part]["max"], part
    assert "main" in dict(loop["profile"]["thread_cores"]) and loop["profile"]["seconds"] > 0
    # Busiest first; which thread leads depends on the host's load (a Grain prefetch thread can), so not checked.
    cores = [used for _, used in loop["profile"]["thread_cores"]]
    assert cores == sorted(cores, reverse=True)
  assert sorted(path.name for path in out.iterdir()) == ["input_pipeline.json", "input_pipeline.md", "loop.log"]
  printed = capsys.readouterr().out
  assert "| mini/packed/8/trivial #1" in printed and "| mini/packed/8/trivial/k2 #1" in printed
