"""`bert-jax compression-runs`: the stages' steps and their order, and docs/compression.md rendered from fake
results."""

import argparse
import json
import pathlib

import pytest

from bert_jax.experiments import compression_runs as driver


def _args(**overrides):
  values = dict(stage="tasks,speed", tasks="sst2", seeds="1,2,3", smoke=False, general_steps=6000,
                general_seconds=300.0)
  return argparse.Namespace(**{**values, **overrides})


def test_students_quantisation_and_pruning_wait_for_their_teacher_and_the_bench_for_all_four(tmp_path):
  steps = {step.name: step for step in driver.plan(_args(), tmp_path / "data", tmp_path / "minilm", tmp_path / "runs")}
  assert list(steps) == ["sst2/teacher", "sst2/distilled", "sst2/baseline", "sst2/int8", "sst2/int8 evaluate",
                         "sst2/pruned", "sst2/pruned evaluate", "speed/inference", "speed/inference int8"]
  assert steps["sst2/baseline"].after == () and steps["sst2/distilled"].after == ("sst2/teacher",)
  assert f"--config.distill.teacher={tmp_path / 'runs' / 'sst2' / 'teacher'}" in steps["sst2/distilled"].argv
  assert "--config.init.layers=3" in steps["sst2/baseline"].argv and "--config.seeds=(1, 2, 3)" in \
      steps["sst2/teacher"].argv
  bench_step = steps["speed/inference"]
  assert bench_step.after == tuple(list(steps)[:7])  # a quiet GPU
  assert steps["speed/inference int8"].after == ("speed/inference",)
  assert f"--variant=pruned={tmp_path / 'runs' / 'sst2' / 'pruned' / 'pruned_model'}" in bench_step.argv
  assert driver._command(steps["sst2/int8"]).startswith("bert-jax quantize --workdir ")


def test_speed_alone_derives_one_seed_of_sst2_and_general_fine_tunes_its_student(tmp_path):
  steps = driver.plan(_args(stage="speed,general", tasks="mrpc,rte"), tmp_path / "data", tmp_path / "m",
                     tmp_path / "runs")
  names = [step.name for step in steps]
  assert names[:3] == ["general/prepare", "general/pretrain", "mrpc/general"]
  teacher = next(step for step in steps if step.name == "sst2/teacher")
  assert teacher.stage == "speed" and "--config.seeds=(1,)" in teacher.argv
  assert str(tmp_path / "runs" / "speed" / "models" / "sst2" / "teacher") in teacher.argv
  pretrain = steps[1]
  assert pretrain.stop_after == 300.0 and "--config.distill.alpha=0.0" in pretrain.argv
  assert f"--config.init.model={tmp_path / 'runs' / 'general' / 'pretrain'}" in steps[2].argv
  assert driver._stage_paths("general", steps, tmp_path / "runs", "mrpc-rte") == [
      pathlib.Path(p) for p in ("general/pretrain", "general/wiki", "logs/general", "mrpc/general",
                                "reports/general_mrpc-rte.json", "rte/general")]


def _finetune_results(scores, params, metric="accuracy"):
  return {"selection_metric": metric, "num_params": params,
          "summary": {"dev": {metric: {"mean": sum(scores) / len(scores), "std": 0.5, "values": scores}}},
          "seeds": [{"seed": seed, "selected": {"metrics": {"dev": {metric: score}}}}
                    for seed, score in enumerate(scores, 1)]}


def _write(path, content):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(content))


def _fake_results(root):
  """A results folder as the three calls leave it, with made-up scores."""
  for task, teacher in (("sst2", [90.0, 92.0, 91.0]), ("mrpc", [80.0, 80.0, 80.0])):
    _write(root / task / "teacher" / "results.json", _finetune_results(teacher, 22_000_000))
    _write(root / task / "distilled" / "results.json", _finetune_results([x - 10 for x in teacher], 17_600_000))
    _write(root / task / "baseline" / "results.json", _finetune_results([x - 20 for x in teacher], 17_600_000))
    _write(root / task / "int8" / "quantization.json", {"seed": 2, "param_bytes": {"compression": 3.9}})
    _write(root / task / "int8" / "evaluate_dev.json", {"2": {"dev": {"accuracy": teacher[1] - 1}}})
    _write(root / task / "pruned" / "results.json",
           {"heads": {"metric": "accuracy", "base_score": teacher[1]},
            "prune": {"pruned_score": teacher[1] / 2, "params": [22_000_000, 20_000_000], "heads_removed": 29}})
  rows = [{"model": model, "batch": batch, "length": 128, "ours_seq_per_s": rate * batch}
          for model, rate in (("teacher", 100.0), ("distilled_3l", 200.0), ("int8", 150.0), ("pruned", 125.0))
          for batch in (1, 256)]
  rows[0].update(ours_p50_ms=1.5, ours_p90_ms=2.0)
  for name, part in (("float", rows[:2] + rows[2:4] + rows[6:]), ("int8", rows[4:6])):
    _write(root / "speed" / name / "inference_NVIDIA_H200.json", {"device": "NVIDIA H200", "backend": "gpu",
                                                                 "dtype": "bfloat16", "rows": part})
  _write(root / "sst2" / "pruned" / "pruned_model" / "finetune_run.json", {"best_seed": 2})
  _write(root / "sst2" / "pruned" / "pruned_model" / "evaluate_dev.json", {"2": {"dev": {"accuracy": 45.0}}})
  _write(root / "sst2" / "general" / "results.json", _finetune_results([86.0, 86.0], 17_600_000))
  _write(root / "general" / "pretrain" / "config.json", {"train": {"steps": 6000, "batch_size": 256},
                                                          "data": {"seq_len": 128}})
  (root / "general" / "pretrain" / "metrics.jsonl").write_text("\n".join(json.dumps(row) for row in (
      {"step": 100, "train/loss": 9.0, "train/mlm_loss": 8.5, "train/cos_loss": 0.5},
      {"step": 4000, "train/loss": 3.0, "train/mlm_loss": 2.9, "train/cos_loss": 0.1},
      {"step": 4000, "eval/mlm_loss": 3.1, "eval/mlm_accuracy": 0.45})) + "\n")
  report = {"stage": "tasks", "tasks": ["sst2", "mrpc"], "card": "1 x NVIDIA H200", "date": "2026-12-01T10:00:00",
            "versions": {"jax": "0.11.2"}, "argv": ["run", "--stage", "tasks"], "seconds": 400.0, "smoke": False,
            "steps": [{"name": "sst2/teacher", "seconds": 130.0, "status": 0, "command": "bert-jax finetune ..."}]}
  _write(root / "reports" / "tasks_sst2-mrpc.json", report)


def test_the_page_has_the_seeds_columns_with_ratios_against_the_teacher(tmp_path):
  root = tmp_path / "results"
  _fake_results(root)
  page = driver.render(driver.collect([root]))
  summary = {line.split(" | ")[1]: line.split(" | ")[2:5] for line in page.splitlines() if line.startswith("| ")}
  assert summary[driver.SUMMARY_ROWS[0][2]] == ["×1.25", f"{100 * 151 / 171:.0f}%", "×2.0"]  # (81+70)/(91+80)
  assert summary[driver.SUMMARY_ROWS[2][2]] == ["×1.25", f"{100 * 131 / 171:.0f}%", "×2.0"]
  assert summary[driver.SUMMARY_ROWS[3][2]] == ["×3.90", f"{100 * 170 / 172:.0f}%", "×1.5"]  # seed 2: 92 and 80
  assert summary[driver.SUMMARY_ROWS[4][2]] == ["×1.10", f"{100 * 85 / 172:.0f}%", "×1.2"]  # evaluated, analysed
  assert summary[driver.SUMMARY_ROWS[1][2]] == ["×1.25", f"{100 * 86 / 91:.0f}%", "×2.0"]  # SST-2 alone
  assert "| SST-2 | accuracy | 91.00 ± 0.50 | 81.00 ± 0.50 (89%) | 71.00 ± 0.50 (78%) | 86.00 ± 0.50 (95%) | " \
         "91.00 (99%) | 45.00 (49%) |" in page
  assert "| MRPC | accuracy | 80.00 ± 0.50 | 70.00 ± 0.50 (88%) | 60.00 ± 0.50 (75%) | - |" in page
  assert "trained 4,000 of 6,000 steps at batch 256 and length 128" in page and "accuracy 0.450." in page
  assert "| distilled_3l | 256 | 128 | 51,200 | ×2.00 | - |" in page
  assert "| teacher | 1 | 128 | 100 | ×1.00 | 1.50 / 2.00 |" in page
  assert "1 x NVIDIA H200" in page and "`bert-jax finetune ...`" in page and "SMOKE" not in page


def test_the_kept_files_render_the_same_page_and_the_page_takes_findings_a_figure_and_pytorch(tmp_path):
  root, kept = tmp_path / "results", tmp_path / "kept"
  _fake_results(root)
  _write(root / "sst2" / "teacher" / "checkpoints" / "state.json", {})  # never kept
  assert driver.keep([root], kept) > 0
  assert not (kept / "sst2" / "teacher" / "checkpoints").exists()
  collected = driver.collect([kept])
  assert driver.render(collected) == driver.render(driver.collect([root]))
  against = {"device": "NVIDIA H200", "reference_device": "NVIDIA H200", "dtype": "bfloat16",
             "compile_backend": "inductor", "versions": {"torch": "2.11"},
             "rows": [{"model": "bert-base", "batch": 256, "length": 128, "ours_seq_per_s": 300.0,
                       "eager_seq_per_s": 100.0, "compiled_seq_per_s": 200.0}]}
  page = driver.render(collected, "## What the table shows\n\nThe findings.", against, "compression/compression.png")
  assert "| bert-base | 256 | 128 | 300 | 100 | 200 | **1.50x** | - | - |" in page
  assert "The findings." in page and "](compression/compression.png)" in page
  driver.figure(collected, tmp_path / "compression.png")
  assert (tmp_path / "compression.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_steps_wait_for_what_they_need_and_stop_at_their_limit_or_the_deadline(tmp_path):
  """A failed step's dependents do not run; a step past its stop_after gets SIGTERM (and counts as done when it
  exits cleanly, as a pre-training run does); what still runs at the deadline is stopped, what waits never starts."""
  sleep = ["-c", "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); time.sleep(30)"]
  steps = [driver.Step("fails", "tasks", ["-c", "raise SystemExit(3)"]),
           driver.Step("after fails", "tasks", ["-c", "pass"], ("fails",)),
           driver.Step("stopped", "general", sleep, stop_after=0.5),
           driver.Step("after stopped", "general", ["-c", "pass"], ("stopped",)),
           driver.Step("slow", "speed", ["-c", "import time; time.sleep(30)"]),
           driver.Step("after slow", "speed", ["-c", "pass"], ("slow",))]
  recorded = {}
  status = driver.execute(steps, 4, driver.time.time() + 4.0, dict(driver.os.environ), tmp_path,
                         lambda step, shown, seconds, started: recorded.update({step.name: (shown, seconds)}))
  assert status["fails"] == 3 and status["after fails"] == "not run: fails failed"
  assert status["stopped"] == 0 and recorded["stopped"][0].startswith("0 (stopped after 0 s")
  assert status["after stopped"] == 0
  assert status["slow"].startswith("stopped at the deadline") and recorded["slow"][1] < 10
  assert status["after slow"] == "not started: deadline"
  assert (tmp_path / "tasks" / "fails.log").exists()
