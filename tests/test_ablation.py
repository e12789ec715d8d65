"""Ablation tables end to end on CPU: pre-training, a one-task downstream suite, scoring and `bert-jax table`."""

import csv
import dataclasses
import io
import json
import math
import os
import pathlib
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from bert_jax import paths
from bert_jax.experiments import ablation, suite, table
from bert_jax.tasks import evaluate as evaluate_lib
from bert_jax.tasks import glue as glue_lib
from bert_jax.train import config_lib, pretrain_config, trainer

REPO = pathlib.Path(__file__).resolve().parents[1]
# Words the built-in corpus (Python's documentation) holds, so the tiny WordPiece vocabulary keeps them whole.
WORDS = ["the", "function", "list", "file", "value", "object", "module", "string", "return", "class", "call",
         "name", "type", "data", "line"]

TABLE_CONFIG = '''
from bert_jax.experiments import ablation, suite

SUITE = suite.Suite(tasks=("sst2",), seeds=(1, 2), lrs=(3e-3,), epochs=1, max_len=32, batch_size=16,
                    overrides=("train.eval_batch_size=32", "train.log_every=4"))
PUBLISHED = {
    "paper": "A test paper", "table": "Table T", "source": "made up for the test",
    "columns": {"mlm_ppl": "LM (ppl)", "sst2": "SST-2"},
    "higher_is_better": {"mlm_ppl": False, "sst2": True},
    "rows": {"MLM+NSP": {"mlm_ppl": 5.0, "sst2": 92.0}, "broken": {}, "MLM": {"mlm_ppl": 6.0, "sst2": 91.0}},
}


def get_config(arg=None):
  config = ablation.base_config("bert.py:size=base,phase=1", "tiny")
  config.train.steps = config.train.eval_every = config.train.checkpoint_every = 8
  config.train.log_every, config.train.eval_batches, config.optim.warmup_steps = 4, 2, 2
  return config


def get_sweep(arg=None):
  return [{"name": "MLM+NSP", "overrides": {}},
          {"name": "broken", "overrides": {"model.num_heads": 3}},  # 64 is not divisible by 3 heads.
          {"name": "MLM", "overrides": {"objective": "mlm", "data.format": "full_sentences"}}]


def get_suite(arg=None):
  return SUITE
'''


def _glue_sst2(root: pathlib.Path) -> pathlib.Path:
  """SST-2 layout; label 1 when the sentence holds 'good', 0 when it holds 'bad'."""
  rng = np.random.default_rng(0)
  directory = root / "SST-2"
  directory.mkdir(parents=True)
  for split, count in (("train", 96), ("dev", 32)):
    rows = ["sentence\tlabel"]
    for _ in range(count):
      label = int(rng.integers(2))
      words = [str(w) for w in rng.choice(WORDS, 5)]
      words.insert(int(rng.integers(6)), "good" if label else "bad")
      rows.append(f"{' '.join(words)}\t{label}")
    (directory / f"{split}.tsv").write_text("\n".join(rows) + "\n")
  return root


@pytest.fixture(scope="session")
def setup(tmp_path_factory):
  """(table config file, data folders, their folder), written once for xdist's workers."""
  from conftest import built_once

  def build(root):
    (root / "table_t.py").write_text(TABLE_CONFIG)
    _glue_sst2(root / "glue")

  root = built_once(tmp_path_factory, "ablation", build)
  return str(root / "table_t.py"), {"glue": str(root / "glue")}, root


@pytest.fixture(scope="session")
def swept_once(setup, tmp_path_factory):
  """(results, workdir) of the real sweep, run once for xdist's workers."""
  from conftest import built_once
  spec, data_dirs, _ = setup

  def build(root):
    results = ablation.run_sweep(ablation.load_table(spec), root / "run", data_dirs)
    (root / "results.json").write_text(json.dumps(results))

  built = built_once(tmp_path_factory, "ablation_sweep", build)
  return json.loads((built / "results.json").read_text()), built / "run"


@pytest.fixture
def swept(swept_once):
  """The real sweep, one test at a time across xdist's workers: a test may change its workdir and put it back."""
  import filelock
  results, workdir = swept_once
  with filelock.FileLock(str(workdir) + ".lock"):
    yield results, workdir


def _main_table(markdown: str) -> str:
  """The score table without the run facts (wall times differ between runs)."""
  return markdown.split("## Runs")[0]


@pytest.mark.slow
def test_sweep_pretrains_finetunes_scores_and_renders(swept, capsys):
  results, workdir = swept
  by_name = {row["name"]: row for row in results["rows"]}
  assert [row["name"] for row in results["rows"]] == ["MLM+NSP", "broken", "MLM"]
  for name in ("MLM+NSP", "MLM"):
    row = by_name[name]
    assert row["status"] == "done", row
    pretrain = row["pretrain"]
    assert pretrain["step"] == 8 and pretrain["tokens_seen"] == 8 * 16 * 64
    assert 0 < pretrain["epochs"] < 1 and pretrain["perplexity"] > 1 and "cpu" in pretrain["device"].lower()
    sst2 = row["tasks"]["sst2"]
    assert sst2["seeds_done"] == 2 and len(sst2["values"]) == 2 and sst2["best_lr"] == 3e-3
    assert sst2["min"] <= sst2["median"] <= sst2["max"] and 0 <= sst2["median"] <= 100
  assert by_name["MLM+NSP"]["pretrain"]["eval"]["sentence_accuracy"] >= 0
  assert (workdir / "rows" / "MLM" / "state" / "finetune_sst2_lr0.003_seed2.json").exists()
  assert (workdir / "rows" / "MLM" / "finetune" / "sst2" / "lr0.003" / "seed_2" / "result.json").exists()

  assert table.main([str(workdir)]) == 0
  markdown = (workdir / "table.md").read_text()
  assert "# Table T: A test paper" in markdown
  assert "| LM (ppl) ours | LM (ppl) paper | SST-2 ours | SST-2 paper |" in markdown
  assert "| MLM+NSP | done | " in markdown and "| 5.00 | " in markdown
  assert "published ordering reproduced" in markdown
  ordering_line = next(line for line in markdown.splitlines() if line.startswith("| published ordering"))
  assert ordering_line.count("(1/1 pairs") + ordering_line.count("(0/1 pairs") == 2
  with open(workdir / "table.csv") as handle:
    rows = list(csv.DictReader(handle))
  assert [row["row"] for row in rows][:3] == ["MLM+NSP", "broken", "MLM"]
  assert float(rows[0]["sst2_median"]) == results["rows"][0]["tasks"]["sst2"]["median"]
  assert rows[0]["mlm_ppl_published"] == "5.0"
  for figure in ("pretrain_loss.png", "downstream.png"):
    assert (workdir / figure).stat().st_size > 10_000
  assert "Written:" in capsys.readouterr().out


def test_a_row_stopped_before_its_state_plots_its_loss_against_tokens(tmp_path):
  """A row whose pre-training never finished (no recorded state) still draws its curve on the tokens axis, from
  the config its run wrote."""
  pretrain_dir = tmp_path / "pretrain"
  pretrain_dir.mkdir()
  done = {"status": "done", "pretrain": {"batch_size": 256, "seq_len": 128}}
  assert table._tokens_per_step(done, pretrain_dir) == 256 * 128
  stopped = {"status": "incomplete", "pretrain": None}
  assert table._tokens_per_step(stopped, pretrain_dir) == 0  # Nothing says: the plot falls back to steps.
  (pretrain_dir / "config.json").write_text(json.dumps({"train": {"batch_size": 32}, "data": {"seq_len": 64}}))
  assert table._tokens_per_step(stopped, pretrain_dir) == 32 * 64


@pytest.mark.slow
def test_a_failing_row_is_recorded_and_the_others_go_on(swept):
  results, workdir = swept
  broken = results["rows"][1]
  assert broken["status"] == "failed" and broken["phase"] == "pretrain"
  assert "num_heads" in broken["error"] or "divisible" in broken["error"]
  assert results["rows"][2]["status"] == "done"  # The row after the failure ran.
  assert json.loads((workdir / "rows" / "broken" / "row.json").read_text())["status"] == "failed"
  assert "pretrain: " in (workdir / "table.md").read_text()


class Killed(BaseException):
  """A kill (BaseException: no row-level handler records it as a failure)."""


def _fake_phases(monkeypatch, log, kill_at=None):
  """Pre-training and fine-tuning stand-ins that record their calls and can be killed at the n-th call."""

  def pretrain(config, row_dir, cross=()):
    if (row_dir / "state" / "pretrain.json").exists():  # As the real phase: a recorded pre-training is kept.
      return json.loads((row_dir / "state" / "pretrain.json").read_text())
    log.append(("pretrain", row_dir.name))
    if len(log) == kill_at:
      raise Killed()
    state = {"objective": config.objective, "eval": {"mlm_perplexity": 4.0 + len(row_dir.name)}}
    paths.write_json(row_dir / "state" / "pretrain.json", state)
    return state

  def finetune(config, directory):
    log.append(("finetune", directory.name))
    if len(log) == kill_at:
      raise Killed()
    row_name = directory.parent.parent.parent.name
    return {"seeds": [{"seed": seed, "selected": {"metrics": {"dev": {"accuracy": 50.0 + seed + len(row_name)}}}}
                      for seed in config.seeds]}

  monkeypatch.setattr(ablation, "pretrain_phase", pretrain)
  return finetune


@pytest.mark.parametrize("storage", ["local", "gs"])
def test_a_killed_sweep_resumes_where_it_stopped(setup, tmp_path, monkeypatch, request, storage):
  spec, data_dirs, _ = setup
  tab = ablation.load_table(spec)
  log = []
  root = tmp_path if storage == "local" else request.getfixturevalue("gcs_bucket")  # an emulated bucket
  killed = f"{root}/killed"
  with pytest.raises(Killed):  # Killed in the second seed of the last row.
    ablation.run_sweep(tab, killed, data_dirs, finetune=_fake_phases(monkeypatch, log, kill_at=6))
  lr = ("finetune", "lr0.003")
  assert log == [("pretrain", "MLM+NSP"), lr, ("pretrain", "broken"), lr, ("pretrain", "MLM"), lr]
  log.clear()
  resumed = ablation.run_sweep(tab, killed, data_dirs, finetune=_fake_phases(monkeypatch, log))
  assert log == [lr]  # Nothing recorded runs again.
  log.clear()
  whole = ablation.run_sweep(tab, tmp_path / "whole", data_dirs, finetune=_fake_phases(monkeypatch, log))
  assert [row["tasks"] for row in resumed["rows"]] == [row["tasks"] for row in whole["rows"]]
  assert _main_table(table.render_markdown(resumed)) == _main_table(table.render_markdown(whole))
  written = table.render(killed)  # `bert-jax table` on the sweep's own workdir
  assert _main_table(written["markdown"].read_text()) == _main_table(table.render_markdown(whole))
  assert written["csv"].exists() and written["downstream"].read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_a_real_sweep_resumed_after_a_kill_gives_the_same_table(setup, swept):
  """What a kill in the last row's second seed leaves, resumed: that seed alone runs again, the table is the same."""
  spec, data_dirs, _ = setup
  workdir = swept[1]
  table.render(workdir)  # on its own: another xdist worker may have run the test that renders it
  reference = _main_table((workdir / "table.md").read_text())
  (workdir / "rows" / "MLM" / "row.json").unlink()
  (workdir / "rows" / "MLM" / "state" / "finetune_sst2_lr0.003_seed2.json").unlink()
  shutil.rmtree(workdir / "rows" / "MLM" / "finetune" / "sst2" / "lr0.003" / "seed_2")
  seed_1 = workdir / "rows" / "MLM" / "finetune" / "sst2" / "lr0.003" / "seed_1" / "result.json"
  seed_1_written = seed_1.stat().st_mtime_ns
  calls = []

  def counting(config, directory):
    from bert_jax.tasks import finetune as finetune_lib

    results = finetune_lib.finetune(config, directory)
    calls.append(sorted(path.name for path in directory.glob("seed_*")))
    return results

  results = ablation.run_sweep(ablation.load_table(spec), workdir, data_dirs, indices=[2], finetune=counting)
  assert calls == [["seed_1", "seed_2"]] and results["rows"][2]["status"] == "done"
  assert seed_1.stat().st_mtime_ns == seed_1_written  # Seed 1's result was reused, not trained again.
  table.render(workdir)
  assert _main_table((workdir / "table.md").read_text()) == reference


def _reproduce():
  from bert_jax.experiments import reproduce

  return reproduce


def test_reproduce_counts_the_rows_other_sweeps_put_on_the_accelerator(monkeypatch):
  """Two `bert-jax reproduce run` processes on one GPU: each call's sweeps split its memory by every row on it, when
  told."""
  reproduce = _reproduce()
  monkeypatch.delenv(ablation.SHARING_ENV, raising=False)
  assert reproduce._rows_per_device(2) == "2"
  monkeypatch.setenv(ablation.SHARING_ENV, "4")
  assert reproduce._rows_per_device(2) == "4" and reproduce._rows_per_device(6) == "6"


def test_reproduce_marks_spans_only_for_the_rows_it_runs():
  """SpanBERT's masking table: only its entity and noun-phrase rows (2, 3) need the corpus' spans marked first."""
  reproduce = _reproduce()
  assert reproduce._needs_spans("spanbert_masking", "tiny", [])
  assert not reproduce._needs_spans("spanbert_masking", "tiny", ["--rows", "0,4", "--config.seed=2"])
  assert reproduce._needs_spans("spanbert_masking", "tiny", ["--rows", "0,3"])
  assert not reproduce._needs_spans("bert_table5", "tiny", [])
  with pytest.raises(ValueError, match="spanbert_masking has rows 0 to 4"):
    reproduce._needs_spans("spanbert_masking", "tiny", ["--rows", "5"])


def test_reproduce_runs_the_rows_side_by_side_or_pipelined(tmp_path, monkeypatch):
  """`run` starts one sweep of the table: its rows at once, splitting the accelerator, or with --pipeline two at a
  time, one pre-training beside the fine-tuning of the one before (in the order given), and says which."""
  reproduce = _reproduce()
  for name in (ablation.SHARING_ENV, "BERT_JAX_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR"):
    monkeypatch.delenv(name, raising=False)
  started = []

  class Sweep:
    pid = 0

    def __init__(self, command, env, **_):
      started.append((command, env))
      self.stdout = io.StringIO(f"ran {len(started)}\n")

    def wait(self, timeout=None):
      return 0

  monkeypatch.setattr(reproduce, "prepare_corpus", lambda *_: tmp_path / "wiki")
  monkeypatch.setattr(reproduce.carry_lib, "card", lambda: "cpu")  # It runs nvidia-smi through Popen too.
  monkeypatch.setattr(reproduce.subprocess, "Popen", Sweep)
  monkeypatch.setattr(reproduce, "_collect", lambda workdir, out, report: out.mkdir(parents=True) or {})

  def launched(rows, *flags):
    started.clear()
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    assert reproduce.main(["run", "--table", "electra_variants", "--scale", "tiny", "--devices", "1", "--out",
                           str(out), "--scratch", str(tmp_path / "scratch"), *flags, "--rows", rows]) == 0
    [(command, env)] = started
    report = json.loads((out / "electra_variants" / "reproduce.json").read_text())
    return command[command.index("--parallel") + 1], env[ablation.SHARING_ENV], report["pipeline"], command

  parallel, sharing, pipeline, command = launched("3,1,0")
  assert (parallel, sharing, pipeline) == ("3", "3", False) and "--pipeline" not in command
  parallel, sharing, pipeline, command = launched("3,1,0", "--pipeline")
  assert (parallel, sharing, pipeline) == ("2", "2", True) and "--pipeline" in command
  assert command[command.index("--rows") + 1] == "3,1,0"
  # Compiled steps are cached in the scratch, which a lent machine keeps between calls.
  assert started[0][1]["BERT_JAX_COMPILATION_CACHE"] == str((tmp_path / "scratch" / "xla_cache").resolve())
  parallel, _, _, command = launched("3", "--pipeline")  # One row: nothing to overlap.
  assert parallel == "1" and "--pipeline" not in command
  # Each call's output is appended to the sweep's log (packed with it), after the command it ran.
  log = (tmp_path / "scratch" / "runs" / "electra_variants" / "sweep.log").read_text().splitlines()
  assert [line.split(" ", 1)[1].startswith("$ bert-jax sweep") for line in log] == [True, False] * 3
  assert log[1] == log[3] == "ran 1" and "--parallel 2" in log[2]
  # A row that starts from another row's pre-training runs with that row, or after it finished on this scratch.
  ernie = ["run", "--table", "ernie_masking", "--scale", "tiny", "--devices", "1", "--out", str(tmp_path / "e"),
           "--scratch", str(tmp_path / "scratch")]
  started.clear()
  with pytest.raises(ValueError, match="'stage 2: phrase-level' starts from row 'stage 1: basic-level'.*add row 1"):
    reproduce.main([*ernie, "--rows", "2"])
  assert not started and not (tmp_path / "e").exists()


def test_reproduce_packs_only_with_the_wheels_the_gpu_machine_lacks(tmp_path):
  """`pack --wheels DIR` names the carried packages DIR has no wheel of, before copying anything."""
  reproduce = _reproduce()
  for name in ("grain-0.2.13-cp312-cp312-manylinux2014_x86_64.whl", "ml_collections-1.1.0-py3-none-any.whl",
               "tensorboardx-2.6.5-py3-none-any.whl", "portpicker-1.6.0-py3-none-any.whl",
               "qwix-0.1.8-py3-none-any.whl"):
    (tmp_path / name).touch()
  assert reproduce.missing_wheels(tmp_path) == ["array_record", "dm_tree"]
  with pytest.raises(ValueError, match="no wheel of array_record, dm_tree"):
    reproduce.pack(tmp_path / "carry", tmp_path)
  assert not (tmp_path / "carry").exists()


def test_gap_by_budget_subtracts_the_rows_medians_per_task_and_plots_them(tmp_path):
  """`bert-jax reproduce gap`: one table run at two budgets; per task, first minus second at the first row's steps, the
  seed spreads added in quadrature; a task one row lacks is left out of that run; a wrong row name is one line."""
  def run(steps, a, b, a_std=3.0, b_std=4.0):
    task = lambda median, std: {"median": median, "std": std}  # noqa: E731
    return {"published": {"table": "Table 6"}, "suite": {"tasks": ["mrpc", "squad1.1_f1"]},
            "rows": [{"name": "Spans", "pretrain": {"step": steps}, "tasks": {"mrpc": task(a, a_std),
                                                                             "squad1.1_f1": task(a, a_std)}},
                     {"name": "Tokens", "pretrain": {"step": steps}, "tasks": {"mrpc": task(b, b_std)}}]}

  tables = [("long", run(18000, 70.0, 60.0)), ("short", run(3000, 50.0, 62.5, a_std=0.0, b_std=0.0))]
  assert table.gap_by_budget(tables, "Spans", "Tokens") == {"mrpc": [(3000, -12.5, 0.0), (18000, 10.0, 5.0)]}
  assert table.plot_gap_by_budget(tables, "Spans", "Tokens", tmp_path / "gap.png").read_bytes()[:4] == b"\x89PNG"
  with pytest.raises(ValueError, match="long: no row named 'Words'; its rows are 'Spans', 'Tokens'"):
    table.gap_by_budget(tables, "Words", "Tokens")


def test_across_runs_gives_each_rows_medians_over_runs_at_one_budget(tmp_path):
  """`bert-jax reproduce runs`: per row and task each run's median; a row or task a run lacks is left out of it; the
  markdown's cell is the mean over runs, the range and the count, and per pair of rows the difference of means ±
  its standard error (closed form below; blank under two runs a row, a pair with no such cell left out); rows at two
  budgets are one line."""
  def run(squad, mrpc=None, spans=True, steps=30000):
    task = lambda median: {"median": median, "std": 1.0}  # noqa: E731
    rows = [{"name": "Tokens", "pretrain": {"step": steps},
             "tasks": {"squad1.1_f1": task(squad), **({"mrpc": task(mrpc)} if mrpc is not None else {})}}]
    if spans:
      rows.append({"name": "Spans", "pretrain": {"step": steps}, "tasks": {"squad1.1_f1": task(squad + 1.0)}})
    rows.append({"name": "Not run", "pretrain": None, "tasks": {}})
    return {"published": {"table": "Table 6"}, "suite": {"tasks": ["mrpc", "squad1.1_f1"]}, "rows": rows}

  tables = [("seed0", run(43.0, mrpc=72.5)), ("seed2", run(38.5, spans=False)), ("repeat", run(41.0))]
  assert table.across_runs(tables) == {
      "Tokens": {"mrpc": [("seed0", 72.5)], "squad1.1_f1": [("seed0", 43.0), ("seed2", 38.5), ("repeat", 41.0)]},
      "Spans": {"squad1.1_f1": [("seed0", 44.0), ("repeat", 42.0)]}}
  # Tokens' SQuAD: mean 40.83, sample variance 61/12, standard error sqrt(61/36); Spans': 43.0, 2, 1.
  error = math.sqrt(61 / 36 + 1)
  assert f"{error:.1f}" == "1.6"
  assert table.runs_markdown(tables).splitlines()[2:] == [
      "| Tokens | 72.5 (1 run) | 40.8 (38.5 to 43.0, 3 runs) |", "| Spans |  | 43.0 (42.0 to 44.0, 2 runs) |", "",
      "| difference of means ± standard error | MRPC (Acc) | SQuAD 1.1 (F1) |", "|---|---|---|",
      "| Spans minus Tokens |  | +2.2 ± 1.6 |"]
  # A row of one run has no pair with a cell; with no pair at all, no second table.
  once = run(40.0)
  once["rows"].append({"name": "Entities", "pretrain": {"step": 30000},
                       "tasks": {"squad1.1_f1": {"median": 39.0, "std": 1.0}}})
  markdown = table.runs_markdown(tables + [("entities", once)])
  assert "| Entities |  | 39.0 (1 run) |" in markdown and "Entities minus" not in markdown
  assert "difference of means" not in table.runs_markdown([("seed0", run(43.0))])
  assert table.plot_across_runs(tables, tmp_path / "runs.png").read_bytes()[:4] == b"\x89PNG"
  with pytest.raises(ValueError, match="row 'Tokens': 3000 pre-training steps in short, 30000 in seed0; runs at "
                     "several budgets compare with `gap`"):
    table.across_runs(tables + [("short", run(20.0, steps=3000))])
  with pytest.raises(ValueError, match="no row of empty has finished a downstream task"):
    table.across_runs([("empty", {"suite": {"tasks": ["mrpc"]}, "rows": [{"name": "Tokens", "pretrain": None}]})])


def test_across_runs_adds_the_glue_score_where_the_table_has_that_column():
  """A table with a GLUE-score column (ELECTRA's) gets it over runs too, first: per run, the median over seeds of
  each seed's mean over the GLUE tasks (closed form below), named as the published table names it; a run where a row
  lacks a GLUE task has no GLUE score for it."""
  def run(cola, mrpc, squad=40.0):
    task = lambda values: {"median": statistics.median(values), "values": values}  # noqa: E731
    return {"published": {"table": "Table 1", "columns": {"glue": "GLUE score"}},
            "suite": {"tasks": ["cola", "mrpc", "squad1.1_f1"]},
            "rows": [{"name": "ELECTRA", "pretrain": {"step": 30000},
                      "tasks": {"cola": task(cola), "mrpc": task(mrpc), "squad1.1_f1": task([squad])}},
                     {"name": "MLM", "pretrain": {"step": 38164}, "tasks": {"cola": task(cola)}}]}

  # seed0's per-seed means (20+80)/2, (30+70)/2, (10+60)/2 = 50, 50, 35: median 50; seed2's 60, 60, 45: median 60.
  tables = [("seed0", run([20.0, 30.0, 10.0], [80.0, 70.0, 60.0])),
            ("seed2", run([40.0, 30.0, 20.0], [80.0, 90.0, 70.0]))]
  scores = table.across_runs(tables)
  assert scores["ELECTRA"]["glue"] == [("seed0", 50.0), ("seed2", 60.0)]
  assert "glue" not in scores["MLM"]
  markdown = table.runs_markdown(tables).splitlines()
  assert markdown[0] == "| row | GLUE score | CoLA (MCC) | MRPC (Acc) | SQuAD 1.1 (F1) |"
  assert markdown[2].startswith("| ELECTRA | 55.0 (50.0 to 60.0, 2 runs) |")


def test_reproduce_runs_prints_the_rows_over_runs_and_names_a_folder_without_results(tmp_path, capsys):
  reproduce = _reproduce()
  results = {"published": {"table": "Table 7"}, "suite": {"tasks": ["rte"]},
             "rows": [{"name": "1seq", "pretrain": {"step": 10}, "tasks": {"rte": {"median": 60.0, "std": 0.5}}}]}
  for name, score in (("t_seed0", 60.0), ("t_seed2", 57.0)):
    (tmp_path / name).mkdir()
    results["rows"][0]["tasks"]["rte"]["median"] = score
    (tmp_path / name / "results.json").write_text(json.dumps(results))
  assert reproduce.main(["runs", str(tmp_path / "t_seed0"), str(tmp_path / "t_seed2"), "--out",
                         str(tmp_path / "runs.png")]) == 0
  assert "| 1seq | 58.5 (57.0 to 60.0, 2 runs) |" in capsys.readouterr().out
  assert (tmp_path / "runs.png").read_bytes()[:4] == b"\x89PNG"
  with pytest.raises(ValueError, match=f"{tmp_path / 'absent'}: no results.json; give folders that `publish` wrote"):
    reproduce.main(["runs", str(tmp_path / "absent"), "--out", str(tmp_path / "x.png")])


@pytest.mark.slow
def test_rows_brought_back_by_several_calls_publish_as_one_table(swept, tmp_path, capsys):
  """`bert-jax reproduce`: each call packs the rows it ran; publishing the calls' folders gives the whole table, a row
  that came back twice from the call that got further in it (the later on a tie)."""
  reproduce = _reproduce()
  results, workdir = swept
  calls = [tmp_path / "call1" / "table_t", tmp_path / "call2" / "table_t", tmp_path / "call3" / "table_t"]

  def pack(folder, keep):
    reproduce.carry_lib.pack_results(workdir, folder / "sweep.tar.gz",
                           skip=lambda relative: relative.parts[0] == "rows" and relative.parts[1] not in keep)
    (folder / "reproduce.json").write_text(json.dumps({"table": "table_t", "rows": sorted(keep)}))

  pack(calls[0], {"MLM+NSP", "broken"})
  pack(calls[1], {"MLM"})
  docs = tmp_path / "docs"
  name = reproduce.run_name(calls[0], docs)  # The table's, its budget and pre-training seed.
  config = config_lib.load_config(results["config"])
  assert name == f"table_t/runs/{config.train.steps}-seed{config.seed}"
  reproduce.publish(calls[:2], docs)
  assert capsys.readouterr().out.endswith(f"published {name} to {docs / name} (2 calls)\n")
  published = docs / name
  merged = json.loads((published / "results.json").read_text())
  assert json.dumps(merged["rows"], sort_keys=True) == json.dumps(results["rows"], sort_keys=True)
  assert [call["rows"] for call in json.loads((published / "reproduce.json").read_text())["calls"]] == [
      ["MLM+NSP", "broken"], ["MLM"]]
  # A row run again, whose call ran out of time in it (unfinished, fewer seeds): the earlier call's finished run
  # stays, whole; given the other way round, the finished run replaces the unfinished one, whole.
  (workdir / "rows" / "MLM" / "row.json").rename(workdir / "row.json.done")
  seeds_done = sorted((workdir / "rows" / "MLM" / "state").glob("finetune_*.json"))
  assert len(seeds_done) > 1
  try:
    for state in seeds_done[1:]:
      state.rename(state.with_suffix(".kept"))
    pack(calls[2], {"MLM"})
  finally:
    (workdir / "row.json.done").rename(workdir / "rows" / "MLM" / "row.json")
    for state in seeds_done[1:]:
      state.with_suffix(".kept").rename(state)
  capsys.readouterr()
  reproduce.publish(calls, docs, name)  # The same run again, by its name: its rows replaced.
  assert f"row 'MLM': from {calls[1]}, not {calls[2]}, which got less far in it" in capsys.readouterr().out
  merged = json.loads((published / "results.json").read_text())
  assert json.dumps(merged["rows"], sort_keys=True) == json.dumps(results["rows"], sort_keys=True)
  report = json.loads((published / "reproduce.json").read_text())
  assert (report["rows_replaced"], report["rows_not_taken"]) == ({}, {"MLM": str(calls[2])})
  reproduce.publish([calls[2], calls[0], calls[1]], docs, name)
  statuses = {row["name"]: row["status"] for row in json.loads((published / "results.json").read_text())["rows"]}
  assert statuses == {"MLM+NSP": "done", "broken": "failed", "MLM": "done"}
  report = json.loads((published / "reproduce.json").read_text())
  assert (report["rows_replaced"], report["rows_not_taken"]) == ({"MLM": str(calls[2])}, {})
  reproduce.publish([calls[1], calls[1]], tmp_path / "tie")  # the same run twice: the later, as on any tie
  assert json.loads((tmp_path / "tie" / name / "reproduce.json").read_text())["rows_replaced"] == {
      "MLM": str(calls[1])}
  # A published folder keeps what its table is rendered from: given again with a later call's, it takes the rows.
  reproduce.publish(calls[:1], tmp_path / "earlier")
  kept = tmp_path / "earlier" / name
  with tarfile.open(kept / "sweep.tar.gz") as tar:
    assert not [name for name in tar.getnames() if "tensorboard" in name or name.endswith(".png")]
  reproduce.publish([kept, calls[1]], tmp_path / "later")
  merged = json.loads((tmp_path / "later" / name / "results.json").read_text())
  assert json.dumps(merged["rows"], sort_keys=True) == json.dumps(results["rows"], sort_keys=True)
  assert [call["rows"] for call in json.loads((tmp_path / "later" / name / "reproduce.json").read_text())[
      "calls"]] == [["MLM+NSP", "broken"], ["MLM"]]
  assert (tmp_path / "later" / name / "pretrain_loss.png").exists() and not (kept / "sweep").exists()
  # --as names the table, whatever the folders are called: a run at another budget, then its rows of a later call.
  assert reproduce.main(["publish", "--as", "table_t_long", "--docs", str(tmp_path / "named"), str(calls[0])]) == 0
  named = tmp_path / "named" / "table_t_long"
  assert reproduce.main(["publish", "--as", "table_t_long", "--docs", str(tmp_path / "named"), str(named),
                         str(calls[1])]) == 0
  merged = json.loads((named / "results.json").read_text())
  assert json.dumps(merged["rows"], sort_keys=True) == json.dumps(results["rows"], sort_keys=True)
  assert json.loads((named / "reproduce.json").read_text())["table"] == "table_t_long"
  assert f"published table_t_long to {named} (2 calls)" in capsys.readouterr().out
  assert sorted(path.name for path in (tmp_path / "named").iterdir()) == ["table_t_long"]
  # Without a name, a second run of one seed is published beside the first, not over it.
  reproduce.publish(calls[:1], docs)
  assert (docs / f"{name}-b" / "results.json").exists()
  # Calls that prepared the corpus in different scratch folders still make one table; other overrides may not differ.
  spec = {"config": "t.py", "overrides": ["--config.data.prepared=/tmp/s1/wiki", "--config.train.steps=30"]}
  assert reproduce.comparable(spec) == reproduce.comparable(
      {**spec, "overrides": ["--config.data.prepared=/tmp/s5/wiki", "--config.train.steps=30"]})
  assert reproduce.comparable(spec) != reproduce.comparable({**spec, "overrides": ["--config.train.steps=30"] * 2})


@pytest.mark.slow
def test_publish_takes_a_row_of_another_table_run_with_the_same_config_and_suite(swept, tmp_path, capsys):
  """`publish --row-from`: a row of another published table joins this one where its pre-training config (model
  resolved: a preset's field spelled out is the same model) and fine-tuning suite are this row's, marked where it
  ran, and stays on publishing again; another config, another suite, a row already held or a name neither table has
  is one line."""
  reproduce = _reproduce()
  results, workdir = swept
  call = tmp_path / "call" / "table_t"
  reproduce.carry_lib.pack_results(workdir, call / "sweep.tar.gz")
  (call / "reproduce.json").write_text(json.dumps({"table": "table_t"}))
  docs = tmp_path / "docs"
  reproduce.publish([call], docs)
  name_t = reproduce.run_name(call, tmp_path / "elsewhere")
  published_t = docs / name_t
  spec_u = tmp_path / "table_u.py"
  spec_u.write_text(TABLE_CONFIG + """
def get_sweep(arg=None):
  return [{"name": "masked LM", "overrides": {"objective": "mlm", "data.format": "full_sentences",
                                              "model.layer_norm_eps": 1e-12}},
          {"name": "three layers", "overrides": {"model.num_layers": 3}}]
""")

  def returned(name, **changes):  # Table U as a call brings it back before any of its rows has run.
    sweep = tmp_path / name / "sweep"
    sweep.mkdir(parents=True)
    spec = {**json.loads((workdir / "sweep.json").read_text()), "config": str(spec_u),
            "table": ablation.table_record(ablation.load_table(str(spec_u))), **changes}
    (sweep / "sweep.json").write_text(json.dumps(spec))
    folder = tmp_path / name / "table_u"
    reproduce.carry_lib.pack_results(sweep, folder / "sweep.tar.gz")
    (folder / "reproduce.json").write_text(json.dumps({"table": "table_u"}))
    return folder

  capsys.readouterr()
  reproduce.publish([returned("u")], docs, "table_u", take=[(str(published_t), "MLM", "masked LM")])
  assert f"row 'masked LM': {published_t}'s row 'MLM' (the same pre-training config and suite)" in (
      capsys.readouterr().out)
  rows = {row["name"]: row for row in json.loads((docs / "table_u" / "results.json").read_text())["rows"]}
  mlm = next(row for row in results["rows"] if row["name"] == "MLM")
  taken = rows["masked LM"]
  assert (taken["status"], taken["from"]) == ("done", f"{name_t}'s row 'MLM'")
  assert json.dumps([taken["pretrain"], taken["tasks"]]) == json.dumps([mlm["pretrain"], mlm["tasks"]])
  assert rows["three layers"]["status"] == "not run" and "from" not in rows["three layers"]
  assert f"| masked LM | done (run as {name_t}'s row 'MLM') |" in (docs / "table_u" / "table.md").read_text()
  record = {"masked LM": f"{name_t}'s row 'MLM'"}
  assert json.loads((docs / "table_u" / "reproduce.json").read_text())["rows_from_other_tables"] == record
  reproduce.publish([docs / "table_u"], docs)  # Published again: the row and its record stay.
  assert json.loads((docs / "table_u" / "reproduce.json").read_text())["rows_from_other_tables"] == record
  assert json.loads((docs / "table_u" / "results.json").read_text())["rows"][0]["from"] == record["masked LM"]

  refusals = [
      ([docs / "table_u"], ("MLM", "masked LM"), f"row 'masked LM' already holds {name_t}'s row 'MLM'; a row is taken"),
      ([returned("u2")], ("MLM+NSP", "masked LM"),
       f"{published_t}'s row 'MLM\\+NSP' pre-trained another config than row 'masked LM' would: data.format: "
       "'segment_pair' there, 'full_sentences' here; objective: 'mlm\\+nsp' there, 'mlm' here"),
      ([returned("u3")], ("MLM", "three layers"), "model.num_layers: 2 there, 3 here; objective: 'mlm' there"),
      ([returned("u4", suite={**json.loads((workdir / "sweep.json").read_text())["suite"], "seeds": [1]})],
       ("MLM", "masked LM"), "one row's scores count in two tables only with one suite"),
      ([returned("u5")], ("BERT", "masked LM"), "has no row 'BERT'; its rows are 'MLM\\+NSP', 'broken', 'MLM'"),
      ([returned("u6")], ("MLM", "MLM"), "this table has no row 'MLM'; its rows are 'masked LM', 'three layers'")]
  for folders, (there, here), message in refusals:
    with pytest.raises(ValueError, match=message):
      reproduce.publish(folders, tmp_path / "refused", "table_u", take=[(str(published_t), there, here)])
  with pytest.raises(ValueError, match="no sweep.tar.gz; give a folder that `publish` wrote"):
    reproduce.main(["publish", "--docs", str(tmp_path / "refused"), str(returned("u7")), "--row-from",
                    str(tmp_path / "absent"), "MLM", "masked LM"])


def test_row_subsets_and_collect_only(setup, tmp_path, monkeypatch, capsys):
  spec, data_dirs, _ = setup
  tab = ablation.load_table(spec)
  log = []
  ablation.run_sweep(tab, tmp_path, data_dirs, indices=[2], finetune=_fake_phases(monkeypatch, log))
  assert log == [("pretrain", "MLM"), ("finetune", "lr0.003")]
  results = ablation.collect(tmp_path)
  assert [row["status"] for row in results["rows"]] == ["not run", "not run", "done"]
  assert results["rows"][2]["tasks"]["sst2"]["median"] == 51.5 + 3
  assert ablation.main(["--workdir", str(tmp_path), "--collect"]) == 0
  printed = capsys.readouterr().out
  assert "1/3 rows done" in printed and "sweep: 1/1 row (100%), " in printed
  with pytest.raises(ValueError, match="out of range"):
    ablation.run_sweep(tab, tmp_path, data_dirs, indices=[5])
  assert ablation.main(["--config", spec, "--workdir", str(tmp_path), "--rows", "0,2", "--data-dir", "glue"]) == 1


def test_suite_picks_the_best_learning_rate_by_median():
  summary = suite.summarize({1e-5: [80.0, 90.0, 70.0], 2e-5: [95.0, 79.0, 10.0]})
  assert summary["best_lr"] == 1e-5 and summary["median"] == 80.0 and summary["min"] == 70.0
  assert suite.summarize({1.0: [5.0], 2.0: [4.0]}, higher_is_better=False)["best_lr"] == 2.0
  tiny = suite.scaled(suite.Suite(tasks=("mnli_m", "squad1.1_f1")), "tiny")
  assert tiny.tasks == ("rte",) and tiny.seeds == (1, 2)
  with pytest.raises(ValueError, match="nope"):
    suite.Suite(tasks=("nope",))


TABLE_CONFIGS = sorted((REPO / "configs" / "ablations").glob("*.py"))
EXPECTED = {"bert_table5", "bert_table6", "roberta_table1", "roberta_table2", "albert_sentence", "albert_sharing",
            "albert_embedding", "electra_compute", "electra_generator", "electra_variants", "spanbert_masking",
            "spanbert_sbo", "structbert_objectives", "ernie_masking"}
# Rows that name a config key the code lacks (a missing capability); every other row must load.
MISSING = {}
SPAN_TABLES = {"spanbert_masking", "ernie_masking"}


def test_every_paper_table_has_a_config():
  assert {path.stem for path in TABLE_CONFIGS} == EXPECTED


@pytest.mark.parametrize("path", TABLE_CONFIGS, ids=lambda path: path.stem)
@pytest.mark.parametrize("scale", ["tiny", "gpu", "paper"])
def test_every_table_config_expands_to_its_papers_rows(path, scale):
  tab = ablation.load_table(f"{path}:scale={scale}")
  published = tab.published
  assert published["paper"] and published["table"] and published["source"]
  assert [row.name for row in tab.rows] == list(published["rows"])
  assert set(published["higher_is_better"]) == set(published["columns"])
  for name, numbers in published["rows"].items():
    assert set(numbers) <= set(published["columns"]), name
  for task in tab.suite.tasks:
    assert task in suite.TASKS
  # The paper's columns (a GLUE score is the average over the GLUE tasks), or at scale=gpu the fixed suite of the
  # tasks whose data is here.
  paper_tasks = set(published["columns"]) | (set(suite.GLUE) if "glue" in published["columns"] else set())
  assert set(tab.suite.tasks) <= paper_tasks | {tab.suite.tiny_task} | set(suite.GPU_TASKS)
  if scale == "tiny":
    assert tab.suite.tasks == (tab.suite.tiny_task,) and len(tab.suite.seeds) * len(tab.suite.lrs) <= 2
  for row in tab.rows:
    if row.name in MISSING.get(path.stem, set()):
      with pytest.raises(config_lib.ConfigError):
        ablation.row_config(tab, row)
      continue
    config = ablation.row_config(tab, row)
    pretrain_config.validate(config, data_parallel=1)  # e.g. every interval a multiple of the steps a call takes
    if scale == "tiny":
      # A table that masks by marked spans reads a marked prepared corpus instead of the built-in one.
      assert config.data.builtin != (path.stem in SPAN_TABLES)
      assert config.train.steps <= 100 and config.model.hidden_size <= 64


def _sweep_commands(text: str) -> list[list[str]]:
  """The `bert-jax sweep --config ...` commands of a document, continuation lines joined, as argument lists."""
  joined = re.sub(r"\\\n\s*", " ", text)
  return [shlex.split(match)[2:] for match in re.findall(r"bert-jax sweep --config [^\n`\"]*", joined)
          if "..." not in match]


def test_the_documented_sweep_commands_give_every_task_its_data_folder():
  """A sweep checks its data folders before pre-training; the commands the configs, the module and the README
  show must pass that check (scale=gpu fine-tunes on GLUE, SQuAD and CoNLL-2003 whatever the paper's tasks)."""
  pages = sorted((REPO / "docs/reproductions").glob("*/README.md"))  # Each table's page, one command each.
  assert len(pages) == len(TABLE_CONFIGS)
  documents = [*TABLE_CONFIGS, REPO / "bert_jax/experiments/ablation.py", REPO / "README.md", *pages]
  texts = {str(path.relative_to(REPO)): path.read_text() for path in documents}
  commands = [(name, argv) for name, text in texts.items() for argv in _sweep_commands(text)]
  assert {name for name, _ in commands} == set(texts)
  for name, argv in commands:
    args, _ = ablation._parser().parse_known_args(argv)
    needed = {suite.TASKS[task].data for task in ablation.load_table(args.config).suite.tasks}
    assert needed <= {item.partition("=")[0] for item in args.data_dir}, (name, args.data_dir, needed)


def test_published_numbers_from_the_seeds():
  t5 = ablation.load_table(str(REPO / "configs/ablations/bert_table5.py")).published
  assert t5["rows"]["+ BiLSTM"] == {"mnli_m": 82.1, "qnli": 84.1, "mrpc": 75.7, "sst2": 91.6, "squad1.1_f1": 84.9}
  t6 = ablation.load_table(str(REPO / "configs/ablations/bert_table6.py")).published
  assert t6["rows"]["L=24 H=1024 A=16"]["mlm_ppl"] == 3.23 and not t6["higher_is_better"]["mlm_ppl"]
  r2 = ablation.load_table(str(REPO / "configs/ablations/roberta_table2.py")).published
  assert r2["rows"]["SENTENCE-PAIR"]["squad2.0_f1"] == 76.2


def test_published_numbers_read_from_the_papers():
  albert = ablation.load_table(str(REPO / "configs/ablations/albert_sentence.py")).published
  assert albert["rows"]["NSP"]["sop_acc"] == 52.0 and albert["rows"]["SOP"]["nsp_acc"] == 78.9
  sharing = ablation.load_table(str(REPO / "configs/ablations/albert_sharing.py")).published
  assert sharing["rows"]["E=768 shared-attention"]["race"] == 67.7
  electra = ablation.load_table(str(REPO / "configs/ablations/electra_variants.py")).published
  assert set(electra["columns"]) == {"glue"} and electra["rows"]["All-Tokens MLM"] == {"glue": 84.3}
  span = ablation.load_table(str(REPO / "configs/ablations/spanbert_sbo.py")).published
  assert span["rows"]["Span Masking (1seq) + SBO"] == {"squad2.0_f1": 86.8, "mnli_m": 87.6, "qnli": 93.9}
  # A figure whose points the text does not state has no numbers.
  generator = ablation.load_table(str(REPO / "configs/ablations/electra_generator.py")).published
  assert not any(generator["rows"].values())


def test_parallel_runs_each_row_as_a_subprocess_on_its_own_accelerator(setup, tmp_path, monkeypatch):
  spec, data_dirs, _ = setup
  started = []

  class FakeProcess:
    def __init__(self, command, env, stdout, stderr, preexec_fn):
      started.append((command, env["CUDA_VISIBLE_DEVICES"]))
      self.returncode = 0

    def poll(self):
      return 0

  monkeypatch.setattr(ablation.subprocess, "Popen", FakeProcess)
  monkeypatch.setattr(ablation.time, "sleep", lambda seconds: None)
  tab = ablation.load_table(spec, ["--config.train.steps=4"])
  results = ablation.run_sweep(tab, tmp_path, data_dirs, parallel=2, child_args=["--data-dir=glue=DATA"])
  assert [device for _, device in started] == ["0", "1", "0"]  # The third row takes the first freed accelerator.
  # Each row runs as `bert-jax sweep --row-index I` does: with the CLI's persistent compilation cache, shared by rows.
  assert started[0][0][1:4] == ["-m", "bert_jax.cli", "sweep"]
  assert started[2][0][-6:] == ["--workdir", str(tmp_path), "--row-index", "2", "--data-dir=glue=DATA",
                                "--config.train.steps=4"]
  assert [row["status"] for row in results["rows"]] == ["incomplete"] * 3


@pytest.mark.parametrize("pretrained_before", [None, 0, 1])
def test_pipeline_starts_a_row_once_the_one_before_has_pre_trained(setup, tmp_path, monkeypatch, pretrained_before):
  """--pipeline: one pre-training at a time. A row that pre-trains starts when the running one has recorded its
  pre-training (and goes on beside its fine-tuning); a row pre-trained in an earlier call starts at once."""
  spec, data_dirs, _ = setup
  tab = ablation.load_table(spec)
  events = []

  def pretrained(index):
    state = tmp_path / "rows" / tab.rows[index].slug / "state"
    state.mkdir(parents=True, exist_ok=True)
    (state / "pretrain.json").write_text("{}")

  if pretrained_before is not None:
    pretrained(pretrained_before)

  class FakeProcess:  # A row: pre-trained at its second poll, finished at its fourth.
    def __init__(self, command, env, stdout, stderr, preexec_fn):
      self.index, self.polls, self.returncode = int(command[command.index("--row-index") + 1]), 0, None
      events.append(f"start {self.index}")

    def poll(self):
      self.polls += 1
      if self.polls == 2 and self.index != pretrained_before:
        pretrained(self.index)
        events.append(f"pretrained {self.index}")
      if self.polls == 4:
        self.returncode = 0
        events.append(f"exit {self.index}")
      return self.returncode

  monkeypatch.setattr(ablation.subprocess, "Popen", FakeProcess)
  monkeypatch.setattr(ablation.time, "sleep", lambda seconds: None)
  ablation.run_sweep(tab, tmp_path, data_dirs, parallel=2, devices=1, pipeline=True)
  if pretrained_before is None:
    assert events[:3] == ["start 0", "pretrained 0", "start 1"] and events.index("start 1") < events.index("exit 0")
    assert events.index("pretrained 1") < events.index("start 2") < events.index("exit 1")
  else:  # Both slots taken at once: the third row waits for one to free, and for the pre-training to end.
    assert events[:2] == ["start 0", "start 1"]
    assert events.index(f"exit {pretrained_before}") < events.index("start 2")
    assert events.index(f"pretrained {1 - pretrained_before}") < events.index("start 2")


def test_a_row_process_that_crashes_is_started_once_more(setup, tmp_path, monkeypatch, capsys):
  """A row killed by a fault (SIGSEGV) runs again, once, to go on from its checkpoints; a row stopped by SIGTERM, or
  crashing a second time, is left as it is."""
  spec, data_dirs, _ = setup
  codes = {0: [-signal.SIGSEGV, 0], 1: [-signal.SIGTERM], 2: [-signal.SIGSEGV, -signal.SIGSEGV, 0]}
  started = []

  class FakeProcess:
    def __init__(self, command, env, stdout, stderr, preexec_fn):
      index = int(command[command.index("--row-index") + 1])
      started.append(index)
      self.returncode = codes[index].pop(0)

    def poll(self):
      return self.returncode

  monkeypatch.setattr(ablation.subprocess, "Popen", FakeProcess)
  monkeypatch.setattr(ablation.time, "sleep", lambda seconds: None)
  ablation.run_sweep(ablation.load_table(spec), tmp_path, data_dirs, parallel=2)
  assert sorted(started) == [0, 0, 1, 2, 2]
  assert codes == {0: [], 1: [], 2: [0]}
  out = capsys.readouterr().out
  assert out.count("crashed (SIGSEGV): starting it again from its last checkpoint (1 of 1)") == 2


def test_electras_mlm_row_scales_the_steps_given_on_the_command_line():
  tab = ablation.load_table(str(REPO / "configs/ablations/electra_compute.py:scale=gpu"), ["--config.train.steps=4000"])
  mlm, electra = (ablation.row_config(tab, row) for row in tab.rows)
  assert electra.train.steps == 4000 and mlm.objective == "mlm"
  # At equal compute as the paper counts it, by hand: 6 x (matmuls + the vocabulary head on the 20 predicted of
  # 128 tokens) + 6 x attention, per token; the token embedding a one-hot matmul (128 x 30522) in every network.
  E, V, S, P = 128, 30522, 128, 20 / 128

  def network(hidden, ffn, layers, head):
    matmul = 4 * hidden * hidden * layers + 2 * hidden * ffn * layers + (E * hidden if E != hidden else 0) + E * V
    return 6 * (matmul + head * (hidden * E + E * V)) + 6 * 2 * S * hidden * layers

  ratio = (network(512, 2048, 4, 0) + network(128, 512, 4, P)) / network(512, 2048, 4, P)
  assert 1.25 < ratio < 1.3
  # To the nearest multiple of the steps a call takes.
  per_call = electra.train.steps_per_call
  assert mlm.train.steps == per_call * round(4000 * ratio / per_call)
  # results.json records the computed values.
  assert ablation.resolved_overrides(tab, tab.rows[0])["train.steps"] == mlm.train.steps


def test_a_row_stopped_by_sigterm_stops_the_sweep(setup, tmp_path, monkeypatch):
  spec, data_dirs, _ = setup
  ran = []

  def fake_pretrain(config, row_dir, cross=()):
    ran.append(row_dir.name)
    raise InterruptedError(f"pre-training of {row_dir.name} was stopped at step 3")

  monkeypatch.setattr(ablation, "pretrain_phase", fake_pretrain)
  results = ablation.run_sweep(ablation.load_table(spec), tmp_path, data_dirs)
  assert len(ran) == 1 and [row["status"] for row in results["rows"]] == ["incomplete", "not run", "not run"]


def test_a_finetuning_task_stopped_by_sigterm_stops_the_sweep_instead_of_moving_on(setup, tmp_path, monkeypatch):
  spec, data_dirs, _ = setup
  tasks = []

  def fake_finetune(config, directory):
    tasks.append(config.task)
    raise InterruptedError("stop requested: seed 1's state saved at step 4")

  monkeypatch.setattr(ablation, "pretrain_phase", lambda config, row_dir, cross=(): None)
  results = ablation.run_sweep(ablation.load_table(spec), tmp_path, data_dirs, finetune=fake_finetune)
  assert len(tasks) == 1 and [row["status"] for row in results["rows"]] == ["incomplete", "not run", "not run"]


def test_a_rows_pretraining_wall_time_adds_up_over_the_calls_that_trained_it(tmp_path, monkeypatch):
  """A row stopped at a call's deadline and resumed in the next records the time of both calls, and the devices
  each ran on; a call that failed counts too."""
  import ml_collections

  config = ml_collections.ConfigDict({"objective": "mlm", "train": {"batch_size": 4}, "data": {"seq_len": 8}})
  clock, calls = iter([0.0, 100.0, 500.0, 530.0, 1000.0, 1250.0]), iter([{"preempted": True, "step": 30}, None,
                                                                          {"step": 50}])

  def fake_train(config, workdir):
    call = next(calls)
    if call is None:
      raise RuntimeError("out of memory")
    return {**call, "prepared_dir": str(tmp_path / "absent"), "eval": {"mlm_perplexity": 9.0}}

  monkeypatch.setattr(trainer, "train_and_evaluate", fake_train)
  monkeypatch.setattr(ablation.time, "perf_counter", lambda: next(clock))
  devices = iter(["1 x H200, shared by 2 rows", "1 x H200", "1 x H200"])
  monkeypatch.setattr(ablation, "_device", lambda: next(devices))
  row_dir = tmp_path / "row"
  with pytest.raises(InterruptedError, match="stopped at step 30"):
    ablation.pretrain_phase(config, row_dir)
  with pytest.raises(RuntimeError, match="out of memory"):
    ablation.pretrain_phase(config, row_dir)
  state = ablation.pretrain_phase(config, row_dir)
  assert state["wall_seconds"] == 100.0 + 30.0 + 250.0 and state["tokens_seen"] == 50 * 4 * 8
  assert state["device"] == "1 x H200, shared by 2 rows; 1 x H200"
  assert [segment["step"] for segment in state["segments"]] == [30, None, 50]
  results = {"config": "t.py", "overrides": [], "published": {}, "rows": [{"name": "r", "status": "done",
              "pretrain": state, "tasks": {}}], "suite": {"tasks": [], "seeds": [1], "lrs": [1e-4]}}
  assert "| 380.0 (3 calls) |" in table.render_markdown(results)


def test_rows_sharing_an_accelerator_split_its_memory_and_the_hosts_cores(monkeypatch):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  monkeypatch.setattr(ablation.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
  slots = [ablation._slot_environment(slot, parallel=4, devices=2) for slot in range(4)]
  assert [env["CUDA_VISIBLE_DEVICES"] for env, _ in slots] == ["0", "1", "0", "1"]
  assert {env["XLA_PYTHON_CLIENT_MEM_FRACTION"] for env, _ in slots} == {"0.450"}
  assert {env[ablation.SHARING_ENV] for env, _ in slots} == {"2"}
  assert [cores for _, cores in slots] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
  env, cores = ablation._slot_environment(1, parallel=2, devices=2)  # One row per accelerator: memory untouched.
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env and env[ablation.SHARING_ENV] == "1" and cores == list(range(8, 16))
  monkeypatch.setenv(ablation.SHARING_ENV, "4")  # Another sweep's two rows share the accelerator too.
  env, _ = ablation._slot_environment(1, parallel=2, devices=1)
  assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.225" and env[ablation.SHARING_ENV] == "4"


def test_a_one_row_sweep_beside_other_sweeps_takes_only_its_share_of_the_memory(setup, tmp_path, monkeypatch):
  """A sweep running its row in-process (no --parallel) on an accelerator other sweeps announce
  ($BERT_JAX_ROWS_PER_DEVICE) sets its memory share before JAX starts: XLA's default preallocation of most of the
  memory made the other sweeps' rows fail to start."""
  spec, data_dirs, _ = setup
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  monkeypatch.setenv(ablation.SHARING_ENV, "5")
  ablation.run_sweep(ablation.load_table(spec), tmp_path / "run", data_dirs, indices=[])
  assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.180"
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # The user's own setting stays.
  monkeypatch.setenv(ablation.SHARING_ENV, "2")
  ablation.run_sweep(ablation.load_table(spec), tmp_path / "run2", data_dirs, indices=[])
  assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"


def test_a_sweep_given_some_gpus_numbers_its_accelerators_within_them(monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
  slots = [ablation._slot_environment(slot, parallel=4, devices=2) for slot in range(4)]
  assert [env["CUDA_VISIBLE_DEVICES"] for env, _ in slots] == ["3", "5", "3", "5"]
  with pytest.raises(SystemExit, match="--devices 3 but CUDA_VISIBLE_DEVICES=3,5"):
    ablation._slot_environment(0, parallel=3, devices=3)


@pytest.mark.slow
def test_one_row_from_the_command_line_records_its_failure(setup, tmp_path):
  """`--row-index I` as a cluster job runs it: the row fails (3 heads do not divide width 64) and says so."""
  spec, data_dirs, _ = setup
  out = subprocess.run([sys.executable, "-m", "bert_jax.experiments.ablation", "--config", spec, "--workdir",
                        str(tmp_path), "--row-index", "1", "--data-dir", f"glue={data_dirs['glue']}"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stdout + out.stderr
  assert "0/3 rows done; failed: ['broken']" in out.stdout
  assert json.loads((tmp_path / "rows" / "broken" / "row.json").read_text())["phase"] == "pretrain"


def test_a_sweep_missing_a_tasks_data_folder_stops_before_any_row_runs(setup, tmp_path, capsys):
  spec, data_dirs, _ = setup
  for data_dir, message in ((["--tasks", "rte,squad1.1_f1"], "need --data-dir squad=PATH (for squad1.1_f1)"),
                            (["--data-dir", f"glue={tmp_path / 'nowhere'}"], "nowhere: no such folder")):
    args = data_dir if data_dir[0] == "--data-dir" else [*data_dir, "--data-dir", f"glue={data_dirs['glue']}"]
    assert ablation.main(["--config", spec, "--workdir", str(tmp_path / "run"), *args]) == 1
    printed = capsys.readouterr().err
    assert message in printed and "nothing was run" in printed and len(printed.splitlines()) == 1, printed
    assert not (tmp_path / "run" / "rows").exists()


def test_the_command_line_replaces_the_suite_and_collect_keeps_it(setup, tmp_path, monkeypatch, capsys):
  spec, data_dirs, _ = setup
  glue = ["--data-dir", f"glue={data_dirs['glue']}"]
  seen = []
  monkeypatch.setattr(ablation, "run_row", lambda table, index, *args, **kwargs: seen.append(table.suite) or {
      "status": "done"})
  assert ablation.main(["--config", spec, "--workdir", str(tmp_path), "--rows", "0", "--tasks", "mrpc,rte",
                        "--seeds", "3,4,5", "--lrs", "1e-4", "--finetune", "optim.layerwise_lr_decay=0.8",
                        "--config.data.prepared=/scratch/s1/wiki", "--config.train.steps=7", *glue]) == 0
  assert seen[0].tasks == ("mrpc", "rte") and seen[0].seeds == (3, 4, 5) and seen[0].lrs == (1e-4,)
  assert seen[0].overrides[-1] == "optim.layerwise_lr_decay=0.8"
  results = ablation.collect(tmp_path)
  assert list(results["suite"]["seeds"]) == [3, 4, 5]
  assert "`optim.layerwise_lr_decay=0.8`" in table.render_markdown(results)
  # The table records the command that runs it again, its data under data/: parsed back, the same table.
  rerun = shlex.split(results["rerun"])
  assert rerun[:2] == ["bert-jax", "sweep"] and f"`{results['rerun']}`" in table.render_markdown(results)
  args, rest = ablation._parser().parse_known_args(rerun[2:])
  assert rest == ["--config.data.prepared=data/wiki", "--config.train.steps=7"] and args.data_dir == ["glue=data/glue"]
  assert args.rows is None and ablation._suite_from_args(ablation.load_table(args.config).suite, args) == seen[0]
  assert ablation.rerun_command(ablation.load_table(spec), ablation.load_table(spec).suite) == (
      f"bert-jax sweep --config {spec} --workdir runs/{pathlib.Path(spec).stem} --data-dir glue=data/glue")
  tab = dataclasses.replace(ablation.load_table(spec), suite=seen[0])
  config = ablation.finetune_config(tab, tab.rows[0], suite.TASKS["rte"], 1e-4, tmp_path, {"glue": "DATA"})
  assert config.optim.layerwise_lr_decay == 0.8
  assert ablation.main(["--config", spec, "--workdir", str(tmp_path), "--seeds", "x"]) == 1
  for bad in ("optim.layerwise_decay=0.8", "optim.layerwise_lr_decay"):
    assert ablation.main(["--config", spec, "--workdir", str(tmp_path), "--finetune", bad]) == 1
  assert "bert-jax sweep: error: --finetune: " in capsys.readouterr().err
  # The sweep fine-tuned with the decay: resuming it without would mix scores of both recipes.
  assert ablation.main(["--config", spec, "--workdir", str(tmp_path), "--rows", "0", "--tasks", "mrpc,rte", *glue]) == 1
  assert "run it with the same --finetune, or give a new --workdir" in capsys.readouterr().err
  gpu = suite.scaled(suite.Suite(tasks=("mnli_m", "mrpc", "sst2", "squad1.1_f1"), lrs=(5e-5, 3e-5, 2e-5)), "gpu")
  assert gpu.tasks == suite.GPU_TASKS and gpu.seeds == (1, 2, 3) and gpu.lrs == (suite.GPU_LR,)


def test_a_row_can_fine_tune_another_rows_pretrained_model(setup, tmp_path, monkeypatch):
  """BERT Table 5's "+ BiLSTM": no pre-training of its own, the named row's model, waiting for it; run after it."""
  _, data_dirs, root = setup
  shared = root / "table_shared.py"
  broken = '{"name": "broken", "overrides": {"model.num_heads": 3}},  # 64 is not divisible by 3 heads.'
  shared.write_text(TABLE_CONFIG.replace(
      broken, '{"name": "on MLM", "pretrained": "MLM", "finetune": {"top_bilstm": True}},'))
  tab = ablation.load_table(str(shared))
  log, models = [], []
  fake = _fake_phases(monkeypatch, log)

  def finetune(config, directory):
    models.append((directory.parent.parent.parent.name, pathlib.Path(config.init.model).parent.name,
                   config.top_bilstm))
    return fake(config, directory)

  results = ablation.run_sweep(tab, tmp_path / "run", data_dirs, finetune=finetune)
  assert [entry for entry in log if entry[0] == "pretrain"] == [("pretrain", "MLM+NSP"), ("pretrain", "MLM")]
  assert models == [("MLM+NSP", "MLM+NSP", False), ("MLM", "MLM", False), ("on_MLM", "MLM", True)]
  row = results["rows"][1]
  assert row["status"] == "done" and row["pretrain"]["pretrained_by"] == "MLM" and row["tasks"]["sst2"]
  assert "the model of MLM" in table.render_markdown(results)
  # The named row failed: the waiting row says so instead of waiting for ever.
  (tmp_path / "run" / "rows" / "MLM" / "state" / "pretrain.json").unlink()
  paths.write_json(tmp_path / "run" / "rows" / "MLM" / "row.json", {"status": "failed", "error": "boom"})
  with pytest.raises(RuntimeError, match="'MLM'.* ended failed without one: boom"):
    ablation.wait_for_pretraining(tab, tab.rows[1].pretrained, tmp_path / "run", poll_seconds=0.01)
  for bad, match in (('"pretrained": "nowhere"', "not a row that pre-trains"),
                     ('"pretrained": "MLM", "overrides": {"objective": "mlm"}', "no pre-training of its own")):
    shared.write_text(TABLE_CONFIG.replace('"overrides": {"model.num_heads": 3}', bad))
    with pytest.raises(config_lib.ConfigError, match=match):
      ablation.load_table(str(shared))


def test_a_row_can_continue_an_earlier_rows_pretraining(setup, tmp_path, monkeypatch):
  """ERNIE's stages: a row pre-trains from an earlier row's final parameters (train.init_from), after it; the
  chain is recorded, and a row may continue only an earlier row that pre-trains."""
  _, data_dirs, root = setup
  chained = root / "table_chained.py"
  broken = '{"name": "broken", "overrides": {"model.num_heads": 3}},  # 64 is not divisible by 3 heads.'
  chained.write_text(TABLE_CONFIG.replace(broken, "").replace(
      '"data.format": "full_sentences"}}]',
      '"data.format": "full_sentences"}}, {"name": "MLM, then MLM+NSP", "overrides": {}, "continues": "MLM"}]'))
  tab = ablation.load_table(str(chained))
  assert tab.rows[2].continues == "MLM" and ablation.row_config(tab, tab.rows[2]).train.init_from is None
  log, starts = [], {}
  fake = _fake_phases(monkeypatch, log)
  recorded = ablation.pretrain_phase

  def pretrain(config, row_dir, cross=()):
    starts[row_dir.name] = config.train.init_from
    return recorded(config, row_dir, cross)

  monkeypatch.setattr(ablation, "pretrain_phase", pretrain)
  results = ablation.run_sweep(tab, tmp_path / "run", data_dirs, indices=[2, 0, 1], finetune=fake)
  assert [entry[1] for entry in log if entry[0] == "pretrain"] == ["MLM+NSP", "MLM", "MLM_then_MLM+NSP"]
  assert starts == {"MLM+NSP": None, "MLM": None,
                    "MLM_then_MLM+NSP": str(tmp_path / "run" / "rows" / "MLM" / "pretrain")}
  assert [row["status"] for row in results["rows"]] == ["done"] * 3
  assert results["rows"][2]["continues"] == "MLM" and ", after MLM's |" in table.render_markdown(results)
  recorded_table, _ = ablation._recorded_table(json.loads((tmp_path / "run" / "sweep.json").read_text()),
                                               tmp_path / "run", None)
  assert recorded_table.rows[2].continues == "MLM"
  for bad, match in (('"continues": "nowhere"', "not an earlier row that pre-trains"),
                     ('"continues": "MLM", "pretrained": "MLM"', "no pre-training of its own")):
    chained.write_text(TABLE_CONFIG.replace(broken, "{" + f'"name": "bad", {bad}' + "},"))
    with pytest.raises(config_lib.ConfigError, match=match):
      ablation.load_table(str(chained))


def test_rows_side_by_side_start_their_suites_at_different_tasks(setup, tmp_path):
  """Row i starts at task i (wrapping), so rows sharing a machine compile different tasks first."""
  spec, data_dirs, _ = setup
  tab = ablation.load_table(spec)
  tab = dataclasses.replace(tab, suite=dataclasses.replace(tab.suite, tasks=("mrpc", "rte", "cola"), seeds=(1,)))
  order = []

  def finetune(config, directory):
    order.append(directory.parent.name)
    return {"seeds": [{"seed": 1, "selected": {"metrics": {"dev": {"accuracy": 1.0, "mcc": 1.0}}}}]}

  ablation.finetune_phase(tab, tab.rows[0], tmp_path, data_dirs, finetune, first_task=4)
  assert order == ["rte", "cola", "mrpc"]
  ablation.finetune_phase(tab, tab.rows[0], tmp_path, data_dirs, finetune)
  assert order == ["rte", "cola", "mrpc"]  # Every task's seeds are recorded: nothing runs again.


def test_the_gpu_suite_trains_every_row_on_the_same_subset_and_scores_the_last_evaluation(setup, tmp_path):
  spec, data_dirs, _ = setup
  tab = ablation.load_table(spec)
  tab = dataclasses.replace(tab, suite=suite.scaled(tab.suite, "gpu"))
  config = ablation.finetune_config(tab, tab.rows[0], suite.TASKS["sst2"], suite.GPU_LR, tmp_path, data_dirs)
  assert config.train_examples == suite.GPU_TRAIN_EXAMPLES
  assert (config.train.eval_every, config.train.selection, config.train.steps_per_call) == ("end", "last", 4)
  examples = list(range(50))
  picked = evaluate_lib.subset(examples, 20)
  assert picked == evaluate_lib.subset(examples, 20) == sorted(picked) and len(set(picked)) == 20
  assert evaluate_lib.subset(examples, 50) is examples and evaluate_lib.subset(examples, None) is examples


def test_a_finetuning_configs_sweep_runs_each_row_as_one_finetune(tmp_path):
  calls = []

  def fake_finetune(config, directory):
    calls.append(config.optim.lr)
    return {"task": config.task, "summary": {"dev": {"accuracy": {
        "mean": config.optim.lr * 1e6, "median": config.optim.lr * 1e6, "std": 0.0, "min": 1.0, "max": 99.0,
        "values": [config.optim.lr * 1e6]}}}}

  tab = ablation.load_table(str(REPO / "configs/finetune/glue.py:task=rte"))
  results = ablation.run_sweep(tab, tmp_path, finetune=fake_finetune)
  assert calls == [5e-5, 3e-5, 2e-5] and [row["status"] for row in results["rows"]] == ["done"] * 3
  assert results["rows"][0]["name"] == "optim.lr=5e-05"
  assert results["rows"][1]["tasks"]["dev/accuracy"]["median"] == pytest.approx(30.0)
  table.render(tmp_path)
  assert "| optim.lr=2e-05 | done | 20.0 ± 0.0 |" in (tmp_path / "table.md").read_text()


def test_ordering_counts_the_pairs_of_rows_ordered_as_published():
  def results(*ours):
    rows = [{"name": f"r{i}", "tasks": {"a": {"median": value, "std": 0.0, "min": value, "max": value}},
             "pretrain": {"eval": {"mlm_perplexity": value}}} for i, value in enumerate(ours)]
    published = {"columns": {"a": "A", "mlm_ppl": "ppl"}, "higher_is_better": {"a": True, "mlm_ppl": False},
                 "rows": {"r0": {"a": 3.0, "mlm_ppl": 3.0}, "r1": {"a": 2.0, "mlm_ppl": 2.0}, "r2": {"a": 1.0}}}
    return {"published": published, "rows": rows, "suite": {"tasks": ["a"]}}

  assert table.ordering(results(30.0, 20.0, 10.0), "a") == (3, 3, 0)
  assert table.ordering(results(30.0, 10.0, 20.0), "a") == (2, 3, 0)
  assert table.ordering(results(5.0, 5.0, 5.0), "a") == (0, 3, 3)
  assert table.ordering(results(30.0, 20.0, 10.0), "mlm_ppl") == (1, 1, 0)  # r2 has no published perplexity.
  assert table._ordering_cell(None) == "n/a" and table._ordering_cell((2, 3, 1)) == "no (2/3 pairs, 1 tied)"


def test_sentence_columns_of_a_row_trained_on_another_task_come_from_its_cross_evaluation():
  row = {"tasks": {}, "pretrain": {"objective": "mlm+nsp", "eval": {"sentence_accuracy": 0.9, "mlm_accuracy": 0.5},
                                   "cross_eval": {"mlm+sop": {"sentence_accuracy": 0.55}}}}
  assert table.ours(row, "nsp_acc")["median"] == pytest.approx(90.0)
  assert table.ours(row, "sop_acc")["median"] == pytest.approx(55.0)
  assert table.ours({"tasks": {}, "pretrain": {"objective": "mlm", "eval": {}}}, "sop_acc") is None


def test_the_glue_score_averages_each_seeds_glue_tasks_then_takes_the_median():
  row = {"tasks": {"cola": {"values": [40.0, 30.0, 50.0]}, "rte": {"values": [60.0, 70.0, 50.0]},
                   "squad1.1_f1": {"values": [1.0, 2.0, 3.0]}}}
  score = table.ours(row, "glue", ["cola", "rte", "squad1.1_f1"])  # per seed: 50, 50, 50
  assert score["median"] == 50.0 and score["std"] == 0.0
  assert table.ours(row, "glue", ["cola", "rte", "mrpc"]) is None  # MRPC was not scored: no score


def test_sweep_records_its_dev_sets_and_refuses_other_ones(tmp_path):
  glue = tmp_path / "glue"
  (glue / "SST-2").mkdir(parents=True)
  (glue / "SST-2" / "dev.tsv").write_text("sentence\tlabel\na fine film\t1\n")
  table = dataclasses.replace(ablation.load_table(str(REPO / "configs/ablations/bert_table5.py:scale=tiny")),
                              suite=suite.Suite(tasks=("sst2", "mrpc"), tiny_task="sst2"))
  workdir = tmp_path / "sweep"
  ablation._write_sweep_file(table, workdir, {"glue": str(glue)})
  recorded = json.loads((workdir / "sweep.json").read_text())["dev_sets"]
  assert recorded == {"sst2": glue_lib.dev_set_fingerprint(glue / "SST-2" / "dev.tsv")}  # MRPC's is absent here.
  (glue / "SST-2" / "dev.tsv").write_text("sentence\tlabel\nanother carve\t0\n")
  with pytest.raises(config_lib.ConfigError, match=r"dev sets of \['sst2'\] differ"):
    ablation._write_sweep_file(table, workdir, {"glue": str(glue)})
  # A sweep begun before dev sets were recorded keeps no record: its scores' dev sets stay unknown.
  legacy = tmp_path / "legacy"
  legacy.mkdir()
  (legacy / "sweep.json").write_text(json.dumps({"config": table.spec}))
  ablation._write_sweep_file(table, legacy, {"glue": str(glue)})
  assert "dev_sets" not in json.loads((legacy / "sweep.json").read_text())


def test_rendering_a_results_folder_runs_no_code_from_it(tmp_path, capsys):
  """`bert-jax table` and `sweep --collect` read the table a sweep recorded as data; a sweep.json that names a config
  file and records no table is refused in one line, the file never imported."""
  evil = tmp_path / "evil.py"
  evil.write_text(f"import pathlib\npathlib.Path({str(tmp_path / 'ran')!r}).write_text('ran')\n")
  spec = str(REPO / "configs/ablations/bert_table5.py:scale=tiny")
  record = ablation.table_record(ablation.load_table(spec))
  suite_data = dataclasses.asdict(ablation.load_table(spec).suite)
  shared = tmp_path / "shared"
  shared.mkdir()
  (shared / "sweep.json").write_text(json.dumps({"config": str(evil), "overrides": [], "suite": suite_data}))
  assert table.main([str(shared)]) == 1
  err = capsys.readouterr().err
  assert "records no table" in err and "--config" in err and len(err.strip().splitlines()) == 1
  assert ablation.main(["--workdir", str(shared), "--collect"]) == 1
  (shared / "sweep.json").write_text(json.dumps({"config": str(evil), "overrides": [], "suite": suite_data,
                                                  "table": record}))
  assert table.main([str(shared)]) == 0  # The recorded table: rendered, nothing run.
  assert not (tmp_path / "ran").exists()


def test_a_run_is_named_by_its_tables_budget_not_its_first_rows_steps(tmp_path):
  """ELECTRA's compute table gives its MLM row (row 0) more steps at equal compute: the run is named by the
  table's budget."""
  reproduce = _reproduce()
  spec = f"{REPO / 'configs/ablations/electra_compute.py'}:scale=gpu"
  tab = ablation.load_table(spec, ["--config.seed=2"])
  assert ablation.row_config(tab, tab.rows[0]).train.steps > config_lib.load_config(spec).train.steps == 3000
  sweep = tmp_path / "sweep.json"
  sweep.write_text(json.dumps({"config": spec, "overrides": ["--config.seed=2"],
                               "suite": dataclasses.asdict(tab.suite)}))
  with tarfile.open(tmp_path / "sweep.tar.gz", "w:gz") as tar:
    tar.add(sweep, "sweep.json")
  assert reproduce.run_name(tmp_path, tmp_path / "docs") == "electra_compute/runs/3000-seed2"
