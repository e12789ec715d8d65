r"""Run a paper's ablation table end to end: pre-train every row, fine-tune the downstream suite, score, collect.

  bert-jax sweep --config configs/ablations/bert_table5.py:scale=gpu --workdir runs/bert_table5 \
      --data-dir glue=data/glue --data-dir squad=data/squad --data-dir conll2003=data/conll2003 \
      --config.data.prepared=data/wiki --parallel 8
  bert-jax table runs/bert_table5

The config file gives `get_config(arg)` (the base pre-training config),
`get_sweep(arg)` (the rows: `{"name": ..., "overrides": {key: value},
"finetune": {key: value}}`, or plain override dicts; an override's value may be
a function of the config the row starts from; a row with `"pretrained": NAME`
fine-tunes row NAME's pre-trained model, waiting for it, instead of its own; a row with `"continues": NAME`
pre-trains from the final parameters of an earlier row NAME, waiting for them, with a fresh optimizer and
schedule: ERNIE's stages), `get_suite(arg)` (the
downstream suite, `bert_jax.experiments.suite.Suite`) and `PUBLISHED` (the
paper's numbers). For every row, in `WORKDIR/rows/<row>/`:

  pretrain/            `train_and_evaluate` (resumes from its checkpoints)
  finetune/<task>/lr<lr>/   one `finetune` per learning rate over the suite's
                       seeds, from the row's final pre-training checkpoint
  state/*.json         one file per finished phase and task/lr/seed: a killed
                       sweep run again skips what is recorded there
  row.json             done, or failed with the phase and error (and, for a row
                       run in another table with the same config, which)

A cluster runs one row per job, all into one shared workdir, then collects:

  sbatch --array=0-3 --gres=gpu:1 --wrap "bert-jax sweep --config ... --workdir /shared/runs/t5 \
      --row-index \$SLURM_ARRAY_TASK_ID --data-dir glue=/shared/data/glue"
  bert-jax sweep --workdir /shared/runs/t5 --collect && bert-jax table /shared/runs/t5

Every task's --data-dir is checked before the first row starts. A failing row
is recorded and the other rows go on; a row process that
crashes (killed by SIGSEGV and the like, or by the out-of-memory killer) is
started once more and goes on from its last checkpoint. `--parallel N` runs rows
as N subprocesses, one per local accelerator (CUDA_VISIBLE_DEVICES), or
sharing `--devices D` of them, each with its share of the host's cores
(`--pipeline`: one row pre-trains at a time, beside the fine-tuning of the
row before it, e.g. `--parallel 2 --devices 1` on one GPU);
`--rows 0,2` or `--row-index I` runs a subset (one job of a SLURM array or
one TPU slice per row, all writing into one shared workdir). Each run ends by
collecting `WORKDIR/results.json` from whatever rows have finished; `--collect`
only collects.

Recorded per row: tokens seen (batch x sequence length x steps: positions fed,
padding included), epochs over the corpus's training tokens, the wall time of
the pre-training call that finished it, the device, the held-out MLM perplexity
and every task's best-lr median over seeds with its spread; per table, the
`bert-jax sweep` command that runs it again (results.json's `rerun`, on table.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, MutableMapping, Sequence

from etils import epath

from bert_jax import paths
from bert_jax import progress as progress_lib
from bert_jax.experiments import suite as suite_lib
from bert_jax.train import config_lib

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


@dataclasses.dataclass(frozen=True)
class Row:
  """One table row: its display name, pre-training overrides and fine-tuning overrides; or, with `pretrained`,
  the name of the row whose pre-trained model it fine-tunes (BERT Table 5's "+ BiLSTM" on the LTR model) instead
  of pre-training its own; with `continues`, the name of an earlier row whose final parameters its pre-training
  starts from (`train.init_from`)."""
  name: str
  overrides: dict[str, Any]
  finetune: dict[str, Any] = dataclasses.field(default_factory=dict)
  pretrained: str | None = None
  continues: str | None = None

  @property
  def slug(self) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", self.name).strip("_") or "row"


@dataclasses.dataclass(frozen=True)
class Table:
  spec: str
  base_overrides: tuple[str, ...]
  rows: tuple[Row, ...]
  suite: suite_lib.Suite
  published: dict[str, Any]


def _row_from(entry: dict[str, Any]) -> Row:
  if "overrides" in entry or "name" in entry:
    unknown = set(entry) - {"name", "overrides", "finetune", "pretrained", "continues"}
    if unknown:
      raise config_lib.ConfigError(f"sweep row {entry.get('name')!r}: unknown fields {sorted(unknown)}; "
                                   "a row has name, overrides, finetune, pretrained and continues")
    if entry.get("pretrained") and (entry.get("overrides") or entry.get("continues")):
      raise config_lib.ConfigError(f"sweep row {entry.get('name')!r}: a row that fine-tunes the model of row "
                                   f"{entry['pretrained']!r} has no pre-training of its own (overrides, continues)")
    return Row(entry["name"], dict(entry.get("overrides", {})), dict(entry.get("finetune", {})),
               entry.get("pretrained"), entry.get("continues"))
  text = ",".join(f"{k}={v}" for k, v in entry.items()) or "base"
  return Row(text, dict(entry))


def load_table(spec: str, base_overrides: Sequence[str] = ()) -> Table:
  """Reads a table config `path.py[:arg]`: its rows, suite and published numbers."""
  path, arg = config_lib.resolve_config_path(spec)
  module = config_lib._load_module(path)
  if not hasattr(module, "get_sweep"):
    raise config_lib.ConfigError(f"{path} defines no get_sweep(arg): it is not a sweep config")
  rows = tuple(_row_from(entry) for entry in module.get_sweep(arg))
  slugs = [row.slug for row in rows]
  if len(set(slugs)) != len(slugs):
    raise config_lib.ConfigError(f"{path}: two sweep rows share a name: {[row.name for row in rows]}")
  trained = {row.name for row in rows if row.pretrained is None}
  for index, row in enumerate(rows):
    if row.pretrained is not None and row.pretrained not in trained:
      raise config_lib.ConfigError(f"{path}: row {row.name!r} fine-tunes the model of {row.pretrained!r}, which is "
                                   f"not a row that pre-trains; rows that do: {sorted(trained)}")
    # An earlier row only: a chain of continued rows then always ends, and runs in the table's order.
    earlier = [other.name for other in rows[:index] if other.pretrained is None]
    if row.continues is not None and row.continues not in earlier:
      raise config_lib.ConfigError(f"{path}: row {row.name!r} continues {row.continues!r}, which is not an earlier "
                                   f"row that pre-trains; those are {earlier}")
  suite = module.get_suite(arg) if hasattr(module, "get_suite") else suite_lib.Suite(tasks=())
  published = getattr(module, "PUBLISHED", {})
  return Table(spec, tuple(base_overrides), rows, suite, published)


def resolved_overrides(table: Table, row: Row, config=None) -> dict[str, Any]:
  """The row's overrides with each callable value computed from the config before any of the row's overrides
  (steps scaled from the command line's, say)."""
  if config is None and any(callable(value) for value in row.overrides.values()):
    config = config_lib.load_config(table.spec, list(table.base_overrides))
  return {key: value(config) if callable(value) else value for key, value in row.overrides.items()}


def row_config(table: Table, row: Row):
  """The row's pre-training config: the file's config, the command line's overrides, then the row's."""
  config = config_lib.load_config(table.spec, list(table.base_overrides))
  for key, value in resolved_overrides(table, row, config).items():
    config_lib.set_by_path(config, key, str(value))
  return config


def comparable_config(config: dict) -> dict:
  """A row's pre-training config with its model section resolved (preset and overrides -> every field), so that
  two spellings of one model (a preset's name and the fields that override all of it) compare equal."""
  import ml_collections

  from bert_jax.train import pretrain_config

  model = dict(config.get("model") or {})
  resolved = pretrain_config.build_model_config(ml_collections.ConfigDict(model), model.get("vocab_size") or 1)
  return {**config, "model": {**dataclasses.asdict(resolved), "generator_fraction": model.get("generator_fraction")}}


SCALES = suite_lib.SCALES


def base_config(recipe: str, scale: str):
  """A paper recipe (`configs/<recipe>`, e.g. "bert.py:size=base") at an ablation scale.

  paper: the recipe unchanged. gpu: a BERT-Small-sized encoder (4 layers, width 512, bf16) for 3,000 steps of
  256 x 128 tokens (98M tokens), 4 steps a jitted call, so that four rows with their suites (`suite.scaled`) run
  side by side on one GPU in under ten minutes. tiny: a 2-layer, width-64 float32 encoder for 40 steps of 16 x 64
  tokens on the built-in corpus, under a minute a row on a 2-core CPU. A row's overrides apply on top.
  """
  if scale not in SCALES:
    raise config_lib.ConfigError(f"scale must be one of {SCALES}, got {scale!r}")
  config = config_lib.load_config(str(CONFIGS / recipe))
  if scale == "paper":
    return config
  model, train, optim = config.model, config.train, config.optim
  if scale == "gpu":
    model.num_layers, model.hidden_size, model.num_heads, model.intermediate_size = 4, 512, 8, 2048
    model.max_position_embeddings = 512
    if model.family in ("albert", "electra"):
      model.embedding_size = 128
    config.data.seq_len, config.masking.max_predictions = 128, 20
    train.batch_size, train.steps, train.log_every, train.eval_every = 256, 3000, 100, 3000
    train.eval_batches, train.checkpoint_every = 50, 1000
    # Rows share a GPU and their steps are short: one call a step would leave the host, not the GPU, the limit.
    train.steps_per_call = 4
    optim.warmup_steps, optim.end_lr = 300, 0.0
    optim.lr = 2e-3 if optim.name == "lamb" else 5e-4
    return config
  model.num_layers, model.hidden_size, model.num_heads, model.intermediate_size = 2, 64, 2, 128
  # Room for RoBERTa's position offset at 64 tokens.
  model.max_position_embeddings, model.dtype = 128, "float32"
  if model.family in ("albert", "electra"):
    model.embedding_size = 64
  config.data.builtin, config.data.builtin_vocab_size = True, 2000
  config.data.seq_len, config.masking.max_predictions = 64, 10
  train.batch_size, train.steps, train.log_every, train.eval_every = 16, 40, 5, 40
  train.eval_batches, train.checkpoint_every = 4, 40
  optim.lr, optim.warmup_steps, optim.end_lr = 2e-3, 5, 0.0
  return config


# State files ----------------------------------------------------------------------------------------------------

def _read_json(path: epath.Path) -> Any:
  return json.loads(path.read_text()) if path.exists() else None


def _pretrain_state(row_dir: epath.Path) -> epath.Path:
  return row_dir / "state" / "pretrain.json"


def _pretrain_segments(row_dir: epath.Path) -> epath.Path:
  """The stopped pre-training calls of an unfinished row (wall seconds, device, last step), for its total."""
  return row_dir / "state" / "pretrain_segments.json"


def _finetune_state(row_dir: epath.Path, task: str, lr: float, seed: int) -> epath.Path:
  return row_dir / "state" / f"finetune_{task}_lr{lr:g}_seed{seed}.json"


# Phases ---------------------------------------------------------------------------------------------------------

# Rows per accelerator, set by `--parallel` for its rows (or beforehand by whoever runs several sweeps on the same
# accelerators, e.g. `bert-jax reproduce run`): wall times of shared devices say so, and memory is split by it.
SHARING_ENV = "BERT_JAX_ROWS_PER_DEVICE"


def _device() -> str:
  import jax

  devices = jax.devices()
  sharing = int(os.environ.get(SHARING_ENV, "1"))
  return f"{len(devices)} x {devices[0].device_kind}" + (f", shared by {sharing} rows" if sharing > 1 else "")


def _last_eval(metrics_file: epath.Path) -> dict[str, float]:
  """The last eval row of a metrics.jsonl (a finished run resumed again logs none)."""
  last = {}
  if metrics_file.exists():
    for line in metrics_file.read_text().splitlines():
      try:
        row = json.loads(line)
      except ValueError:
        continue
      evals = {k.removeprefix("eval/"): v for k, v in row.items() if k.startswith("eval/")}
      if evals:
        last = evals
  return last


def _train_tokens(prepared_dir: str) -> int | None:
  """Tokens of the corpus's training documents (held-out documents excluded)."""
  try:
    import numpy as np

    from bert_jax.data.prepare import open_prepared

    corpus = open_prepared(prepared_dir)
    total = int(corpus.sentence_starts[-1])
    held = np.asarray(corpus.eval_documents, np.int64)
    first = corpus.sentence_starts[corpus.document_starts[held]]
    last = corpus.sentence_starts[corpus.document_starts[held + 1]]
    return total - int(np.sum(last - first))
  except (OSError, ValueError, KeyError, IndexError):
    return None


def pretrain_phase(config, row_dir: epath.Path, cross: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
  """Pre-trains the row (resuming its checkpoints) and records tokens, epochs, wall time and device (over every
  call that trained it), perplexity; `cross`: (objective, example format) pairs the final model is also scored
  with (`trainer.evaluate_run`)."""
  state_file = _pretrain_state(row_dir)
  state = _read_json(state_file)
  if state is not None:
    return state
  from bert_jax.train import trainer

  segments_file = _pretrain_segments(row_dir)
  segments = _read_json(segments_file) or []
  started = time.perf_counter()

  def segment(step) -> dict[str, Any]:
    return {"wall_seconds": time.perf_counter() - started, "device": _device(), "step": step}

  try:
    result = trainer.train_and_evaluate(config, row_dir / "pretrain")
  except BaseException:
    paths.write_json(segments_file, [*segments, segment(None)])  # A failed call's time is spent too.
    raise
  if result.get("preempted"):
    paths.write_json(segments_file, [*segments, segment(int(result["step"]))])
    raise InterruptedError(f"pre-training of {row_dir.name} was stopped at step {result['step']}")
  segments.append(segment(int(result["step"])))
  devices = list(dict.fromkeys(part["device"] for part in segments))
  evaluation = dict(result.get("eval") or {}) or _last_eval(row_dir / "pretrain" / "metrics.jsonl")
  tokens = int(result["step"]) * config.train.batch_size * config.data.seq_len
  corpus_tokens = _train_tokens(result["prepared_dir"])
  state = {"step": int(result["step"]), "tokens_seen": tokens, "corpus_train_tokens": corpus_tokens,
           "epochs": tokens / corpus_tokens if corpus_tokens else None,
           "wall_seconds": sum(part["wall_seconds"] for part in segments), "device": "; ".join(devices),
           "num_params": int(result.get("num_params", 0)), "perplexity": evaluation.get("mlm_perplexity"),
           "eval": evaluation, "objective": config.objective, "batch_size": config.train.batch_size,
           "seq_len": config.data.seq_len,
           "cross_eval": {objective: trainer.evaluate_run(row_dir / "pretrain", [f"objective={objective}",
                                                                                f"data.format={example_format}"])
                          for objective, example_format in cross}}
  if len(segments) > 1:
    state["segments"] = segments
  paths.write_json(state_file, state)
  return state


def finetune_config(table: Table, row: Row, task: suite_lib.SuiteTask, lr: float, model_dir: epath.Path,
                    data_dirs: dict[str, str]):
  suite = table.suite
  if task.data not in data_dirs:
    raise ValueError(f"task {task.name} reads {task.data} data: give --data-dir {task.data}=PATH")
  recipe = {"train.epochs": suite.epochs, "max_len": suite.max_len, "train.batch_size": suite.batch_size,
            "train_examples": suite.train_examples}
  overrides = [f"init.model={model_dir}", f"data_dir={data_dirs[task.data]}", f"optim.lr={lr}",
               f"seeds={tuple(suite.seeds)}", *(f"{key}={value}" for key, value in recipe.items() if value is not None),
               "train.save_checkpoint=False", *suite.overrides,
               *(f"{key}={value}" for key, value in row.finetune.items())]
  return config_lib.load_config(str(CONFIGS / task.config), overrides)


def folder_of(table: Table, name: str, workdir: epath.Path) -> epath.Path:
  """The folder of the table's row `name` in the sweep `workdir`."""
  return workdir / "rows" / next(other.slug for other in table.rows if other.name == name)


def pretrained_dir(table: Table, row: Row, workdir: epath.Path) -> epath.Path:
  """The row folder whose pre-training `row` fine-tunes from: its own, or that of the row it names."""
  return folder_of(table, row.pretrained or row.name, workdir)


def pretraining_recorded(table: Table, name: str, workdir: epath.Path) -> bool:
  """Whether the row `name` has finished its pre-training in the sweep `workdir`."""
  return _pretrain_state(folder_of(table, name, workdir)).exists()


def wait_for_pretraining(table: Table, name: str, workdir: epath.Path, poll_seconds: float = 5.0) -> dict[str, Any]:
  """The pre-training state of the row `name`, once that row (run by this sweep, side by side, or by another job)
  has recorded it; raises if that row ended without it."""
  source_dir = folder_of(table, name, workdir)
  while True:
    state = _read_json(_pretrain_state(source_dir))
    if state is not None:
      return state
    status = _read_json(source_dir / "row.json")
    if status is not None:
      raise RuntimeError(f"row {name!r}, whose pre-trained model this row starts from, ended "
                         f"{status.get('status')} without one: {status.get('error')}")
    time.sleep(poll_seconds)


def finetune_phase(table: Table, row: Row, row_dir: epath.Path, data_dirs: dict[str, str],
                   finetune: Callable | None = None, first_task: int = 0) -> None:
  """Fine-tunes every (task, lr) of the suite over its seeds, from the row's pre-training workdir.

  One `finetune` call per (task, lr) runs the seeds in turn (compiling once); it skips the seeds whose
  result it already holds, so a kill between seeds loses only the seed in progress. A state file per seed
  records the score. The tasks run in the suite's order starting at `first_task` (wrapping around): rows run
  side by side start at different tasks, so each task's steps are compiled by one row and read from the
  persistent compilation cache by the others.
  """
  if finetune is None:
    from bert_jax.tasks.finetune import finetune
  errors = []
  model_dir = pretrained_dir(table, row, row_dir.parent.parent) / "pretrain"
  tasks = table.suite.tasks
  start = first_task % len(tasks)
  for task_name in tasks[start:] + tasks[:start]:
    task = suite_lib.TASKS[task_name]
    try:
      for lr in table.suite.lrs:
        if all(_finetune_state(row_dir, task_name, lr, seed).exists() for seed in table.suite.seeds):
          continue
        config = finetune_config(table, row, task, lr, model_dir, data_dirs)
        started = time.perf_counter()
        results = finetune(config, row_dir / "finetune" / task_name / f"lr{lr:g}")
        for seed_result in results["seeds"]:
          paths.write_json(_finetune_state(row_dir, task_name, lr, seed_result["seed"]),
                           {"task": task_name, "lr": lr, "seed": seed_result["seed"], "metric": task.metric,
                            "split": task.split, "score": seed_result["selected"]["metrics"][task.split][task.metric],
                            "call_wall_seconds": time.perf_counter() - started})
    except InterruptedError:  # A stop request: the task saved its state; the row stops and a rerun resumes it.
      raise
    except Exception as error:  # One task's failure leaves the row's other tasks to run.
      traceback.print_exc()
      errors.append(f"{task_name}: {type(error).__name__}: {error}")
  if errors:
    raise RuntimeError("; ".join(errors))


def _finetune_row(config, row_dir: epath.Path, finetune: Callable | None) -> None:
  """A fine-tuning row: one `finetune` over the config's seeds; its summary is the row's state."""
  if (row_dir / "state" / "finetune.json").exists():
    return
  if finetune is None:
    from bert_jax.tasks.finetune import finetune
  results = finetune(config, row_dir / "finetune")
  paths.write_json(row_dir / "state" / "finetune.json", {"task": results.get("task"), "summary": results["summary"]})


def _check_finetune_keys(overrides: Sequence[str], where: str) -> None:
  """Fails before pre-training when fine-tuning overrides (`key=value`) name keys no fine-tuning config has."""
  from bert_jax.tasks.finetune_config import finetune_defaults

  probe = finetune_defaults()
  probe.lock()
  try:
    config_lib.apply_overrides(probe, list(overrides))
  except config_lib.ConfigError as error:
    raise config_lib.ConfigError(f"{where}: {error}") from None


def _check_finetune_overrides(row: Row) -> None:
  _check_finetune_keys([f"{key}={value}" for key, value in row.finetune.items()], f"row {row.name!r} finetune")


def run_row(table: Table, index: int, workdir: epath.Path, data_dirs: dict[str, str],
            finetune: Callable | None = None) -> dict[str, Any]:
  """Runs (or resumes) one row; an error is recorded in row.json and returned, not raised."""
  row = table.rows[index]
  row_dir = workdir / "rows" / row.slug
  row_dir.mkdir(parents=True, exist_ok=True)
  (row_dir / "row.json").unlink(missing_ok=True)  # Until this run ends the row is in progress, not failed.
  phase = "config"
  try:
    config = row_config(table, row)
    _check_finetune_overrides(row)
    if "task" in config:  # A fine-tuning config's sweep (its learning-rate grid, say): each row is one `finetune`.
      phase = "finetune"
      _finetune_row(config, row_dir, finetune)
      status = {"name": row.name, "status": "done"}
      paths.write_json(row_dir / "row.json", status)
      return status
    phase = "pretrain"
    if row.pretrained is not None:
      wait_for_pretraining(table, row.pretrained, workdir)
    else:
      if row.continues is not None:
        wait_for_pretraining(table, row.continues, workdir)
        config.train.init_from = str(folder_of(table, row.continues, workdir) / "pretrain")
      cross = [pair for column, pair in suite_lib.SENTENCE_COLUMNS.items()
               if column in table.published.get("columns", {}) and pair[0] != config.objective]
      pretrain_phase(config, row_dir, cross)
    phase = "finetune"
    finetune_phase(table, row, row_dir, data_dirs, finetune, first_task=index)
    status = {"name": row.name, "status": "done"}
  except InterruptedError as error:  # SIGTERM or Ctrl-C: the row saved a checkpoint; a rerun resumes it.
    return {"name": row.name, "status": "stopped", "phase": phase, "error": str(error)}
  except Exception as error:  # A failing row is recorded; the sweep goes on with the others.
    traceback.print_exc()
    status = {"name": row.name, "status": "failed", "phase": phase,
              "error": f"{type(error).__name__}: {error}".strip()}
  paths.write_json(row_dir / "row.json", status)
  return status


# The sweep ------------------------------------------------------------------------------------------------------

def dev_sets(suite: suite_lib.Suite, data_dirs: dict[str, str]) -> dict[str, str]:
  """GLUE task -> the fingerprint of the dev file it is scored on (`glue.dev_set_fingerprint`), for the suite's
  GLUE tasks whose dev file exists: which data, a carved dev set's carve included, a run's scores came from."""
  from bert_jax.tasks import glue

  out = {}
  for task in suite.tasks:
    spec = glue.SPECS.get(suite_lib.TASKS[task].config.partition("task=")[2])
    if suite_lib.TASKS[task].data != "glue" or spec is None or "glue" not in data_dirs:
      continue
    path = paths.as_path(data_dirs["glue"]) / spec.directory / f"{suite_lib.TASKS[task].split}.tsv"
    if path.exists():
      out[task] = glue.bytes_fingerprint(path.read_bytes())
  return out


def table_record(table: Table) -> dict[str, Any]:
  """What `collect` needs of a table, as data: its rows (their overrides resolved), published numbers and the
  config's own suite, so that collecting and rendering a sweep never import its config file."""
  default = load_table(table.spec).suite  # The config's own, before the command line's --tasks, --seeds, ...
  return {"rows": [{"name": row.name, "overrides": {k: v for k, v in resolved_overrides(table, row).items()},
                    "finetune": row.finetune, "pretrained": row.pretrained, "continues": row.continues}
                   for row in table.rows],
          "published": table.published, "default_suite": dataclasses.asdict(default)}


def _recorded_table(sweep: dict[str, Any], workdir: epath.Path, config: str | None) -> tuple[Table, suite_lib.Suite]:
  """The table a sweep ran and its config's own suite: from sweep.json's record (data, no code run), or from
  `config` where the user names one (a sweep recorded before tables were). Never from the file sweep.json names:
  rendering a results folder must not run code that came with it."""
  if config is not None:
    table = load_table(config, sweep["overrides"])
    return table, table.suite
  record = sweep.get("table")
  if record is None:
    raise ValueError(f"{workdir / 'sweep.json'} records no table (a sweep from before tables were recorded); give "
                     f"its config, which is run to read it, only one you trust: --config {sweep['config']}")
  rows = tuple(Row(row["name"], dict(row["overrides"]), dict(row["finetune"]), row["pretrained"],
                   row.get("continues")) for row in record["rows"])
  suite = lambda data: suite_lib.Suite(**{k: tuple(v) if isinstance(v, list) else v  # noqa: E731
                                          for k, v in data.items()})
  return (Table(sweep["config"], tuple(sweep["overrides"]), rows, suite(sweep["suite"]), record["published"]),
          suite(record["default_suite"]))


def _write_sweep_file(table: Table, workdir: epath.Path, data_dirs: dict[str, str]) -> None:
  before = _read_json(workdir / "sweep.json") or {}
  if before.get("suite", {}).get("overrides") not in (None, list(table.suite.overrides)):
    # A finished task's scores are kept and not run again: they would stand beside scores fine-tuned otherwise.
    raise config_lib.ConfigError(
        f"{workdir / 'sweep.json'}: this sweep fine-tuned with the overrides {before['suite']['overrides']}, the "
        f"command gives {list(table.suite.overrides)}; run it with the same --finetune, or give a new --workdir")
  now = dev_sets(table.suite, data_dirs)
  changed = sorted(task for task, fingerprint in before.get("dev_sets", {}).items() if now.get(task) != fingerprint)
  if changed:
    raise config_lib.ConfigError(
        f"{workdir / 'sweep.json'}: the dev sets of {changed} differ from those this sweep scored on (another "
        "carve or data); give the same --data-dir, or a new --workdir")
  record = {"config": table.spec, "overrides": list(table.base_overrides), "data_dirs": data_dirs,
            "rows": [row.name for row in table.rows], "suite": dataclasses.asdict(table.suite),
            "table": table_record(table)}
  if before and "dev_sets" not in before:  # A sweep begun before dev sets were recorded: its scores' stay unknown.
    now = None
  paths.write_json(workdir / "sweep.json", {**record, **({"dev_sets": now} if now is not None else {})})


def _tasks_by_data(suite: suite_lib.Suite) -> dict[str, list[str]]:
  """The suite's tasks by the `--data-dir` kind each reads."""
  kinds: dict[str, list[str]] = {}
  for task in suite.tasks:
    kinds.setdefault(suite_lib.TASKS[task].data, []).append(task)
  return kinds


def _check_data_dirs(suite: suite_lib.Suite, data_dirs: dict[str, str]) -> None:
  """Before any row pre-trains: every task of the suite has its data folder, so no sweep stops hours in."""
  needed = _tasks_by_data(suite)
  missing = [f"--data-dir {kind}=PATH (for {', '.join(tasks)})" for kind, tasks in needed.items()
             if kind not in data_dirs]
  if missing:
    raise ValueError(f"the suite's tasks need {'; '.join(missing)}; nothing was run")
  absent = [f"--data-dir {kind}={data_dirs[kind]}" for kind in needed if not paths.as_path(data_dirs[kind]).exists()]
  if absent:
    raise FileNotFoundError(f"{', '.join(absent)}: no such folder; nothing was run")


def run_sweep(table: Table, workdir: str | epath.Path, data_dirs: dict[str, str] | None = None,
              indices: Sequence[int] | None = None, parallel: int = 1, finetune: Callable | None = None,
              child_args: Sequence[str] = (), devices: int | None = None, pipeline: bool = False) -> dict[str, Any]:
  """Runs the rows `indices` (default all), in this process or as `parallel` subprocesses on `devices` local
  accelerators (default: one each), with `pipeline` one pre-training at a time; returns the collection."""
  workdir = paths.as_path(workdir)
  data_dirs = dict(data_dirs or {})
  indices = list(range(len(table.rows))) if indices is None else list(indices)
  bad = [i for i in indices if not 0 <= i < len(table.rows)]
  if bad:
    raise ValueError(f"row indices {bad} out of range: the sweep has {len(table.rows)} rows (0..{len(table.rows) - 1})")
  _check_data_dirs(table.suite, data_dirs)
  # A row that waits for another's pre-training runs after it: one that fine-tunes that model after every row
  # that pre-trains, one that continues it after the rows of its chain; the others in the order given.
  indices.sort(key=lambda i: (table.rows[i].pretrained is not None, _chain_length(table, table.rows[i])))
  _write_sweep_file(table, workdir, data_dirs)
  # Rows take minutes to hours and each shows its own bar: the sweep reports in lines, one per finished row.
  progress = progress_lib.Progress(len(indices), "sweep", unit="row", every_seconds=0, plain=True,
                                   clock_after_first=False)
  if parallel <= 1:
    # Rows of other sweeps on this accelerator ($BERT_JAX_ROWS_PER_DEVICE) leave this process its share of the
    # memory too: without it, XLA's default preallocation starves theirs.
    _share_memory(os.environ, int(os.environ.get(SHARING_ENV) or 1))
    for index in indices:
      status = run_row(table, index, workdir, data_dirs, finetune)
      print(f"row {index} ({table.rows[index].name}): {status['status']}"
            + (f" in {status['phase']}: {status['error']}" if status["status"] != "done" else ""), flush=True)
      if status["status"] == "stopped":
        print("sweep stopped on request; run the same command to resume it", flush=True)
        break
      progress.update()
  else:
    _run_subprocesses(table, workdir, indices, parallel, child_args, progress, devices, pipeline)
  return collect(workdir)


def _chain_length(table: Table, row: Row) -> int:
  """How many rows' pre-training `row`'s continues, one after another (0: it starts from scratch)."""
  rows = {other.name: other for other in table.rows}
  length = 0
  while row.continues is not None:
    row, length = rows[row.continues], length + 1
  return length


def _share_memory(env: MutableMapping[str, str], sharing: int) -> None:
  """`sharing` rows on one accelerator: each process gets its share of the memory (unless the user set one)."""
  if sharing > 1 and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.9 / sharing:.3f}"


def _slot_environment(slot: int, parallel: int, devices: int) -> tuple[dict[str, str], list[int] | None]:
  """A row slot's accelerator (slots share the `devices` round-robin) and its share of this host's cores.

  Accelerators are numbered within this process's CUDA_VISIBLE_DEVICES where it is set (a sweep given one GPU of
  several keeps to it). Rows sharing an accelerator split its memory (XLA_PYTHON_CLIENT_MEM_FRACTION, unless
  set), counting the rows of other sweeps that $BERT_JAX_ROWS_PER_DEVICE announces; every slot gets its own share
  of this process's cores, so that each row's batch-building workers (`pipeline.default_workers`) size to its share.
  """
  visible = [device for device in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if device.strip()]
  if visible and devices > len(visible):
    raise SystemExit(f"--devices {devices} but CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} names "
                     f"{len(visible)}: give at most --devices {len(visible)}")
  env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible[slot % devices] if visible else str(slot % devices))
  sharing = max(-(-parallel // devices), int(os.environ.get(SHARING_ENV) or 1))
  env[SHARING_ENV] = str(sharing)
  _share_memory(env, sharing)
  if not hasattr(os, "sched_getaffinity"):
    return env, None
  cores = sorted(os.sched_getaffinity(0))
  share = len(cores) // parallel
  return env, (cores[slot * share:(slot + 1) * share] if share else None)


# A row process killed by one of these crashed (a fault in native code, or the kernel's out-of-memory killer)
# rather than failed in Python (recorded in row.json) or was stopped (SIGTERM, SIGINT): it is started again.
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT, signal.SIGKILL})
ROW_RESTARTS = 1


def _pretraining(table: Table, workdir: epath.Path, index: int) -> bool:
  """Whether row `index`, running or about to, pre-trains: it trains its own model and has not recorded it yet."""
  row = table.rows[index]
  return row.pretrained is None and not pretraining_recorded(table, row.name, workdir)


def _run_subprocesses(table: Table, workdir: epath.Path, indices: list[int], parallel: int,
                      child_args: Sequence[str], progress: progress_lib.Progress, devices: int | None = None,
                      pipeline: bool = False) -> None:
  """One subprocess per row, at most `parallel` at once, on `devices` local accelerators (default: one each). A
  row's output goes to rows/ROW/log.txt (in a remote workdir: to a local file, uploaded there when the row exits).
  With `pipeline`, one row pre-trains at a time: a row that has to starts only while no running row does, so that
  pre-training (bound by the accelerator) runs beside the fine-tuning suites of the rows before it (mostly
  compilation, on the host), not beside another pre-training."""
  devices = devices or parallel
  logs = pathlib.Path(tempfile.mkdtemp(prefix="bert_jax-sweep-")) if paths.is_remote(workdir) else None
  pending, running, free = list(indices), {}, list(range(parallel))
  restarts = dict.fromkeys(indices, 0)
  while pending or running:
    while pending and free and not (pipeline and _pretraining(table, workdir, pending[0]) and any(
        _pretraining(table, workdir, index) for index, _ in running.values())):
      index, slot = pending.pop(0), free.pop(0)
      row_log = workdir / "rows" / table.rows[index].slug / "log.txt"
      log = logs / f"{table.rows[index].slug}.txt" if logs else pathlib.Path(row_log)
      log.parent.mkdir(parents=True, exist_ok=True)
      env, cores = _slot_environment(slot, parallel, devices)
      # Through the CLI, as a cluster job runs a row: its logging, and the persistent compilation cache by which
      # rows of one architecture share their compiled steps.
      command = [sys.executable, "-m", "bert_jax.cli", "sweep", "--config", table.spec, "--workdir",
                 str(workdir), "--row-index", str(index), *child_args,
                 *("--config." + o.removeprefix("--").removeprefix("config.") for o in table.base_overrides)]
      pin = (lambda cores=cores: os.sched_setaffinity(0, cores)) if cores else None
      with open(log, "a") as out:
        running[subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=pin)] = (
            index, slot)
      print(f"row {index} ({table.rows[index].name}) started on accelerator {slot % devices}"
            + (f", cores {cores[0]}-{cores[-1]}" if cores else "") + f"; log: {log}", flush=True)
    time.sleep(1.0)
    for process in [p for p in running if p.poll() is not None]:
      index, slot = running.pop(process)
      free.append(slot)
      if logs:
        paths.upload(logs / f"{table.rows[index].slug}.txt", workdir / "rows" / table.rows[index].slug / "log.txt")
      print(f"row {index} ({table.rows[index].name}) exited with status {process.returncode}", flush=True)
      if -process.returncode in CRASH_SIGNALS and restarts[index] < ROW_RESTARTS:
        restarts[index] += 1  # Its checkpoints and recorded phases let it go on where it stopped.
        pending.insert(0, index)
        print(f"row {index} ({table.rows[index].name}) crashed ({signal.Signals(-process.returncode).name}): "
              f"starting it again from its last checkpoint ({restarts[index]} of {ROW_RESTARTS})", flush=True)
        continue
      progress.update()


def collect(workdir: str | epath.Path, config: str | None = None) -> dict[str, Any]:
  """Builds WORKDIR/results.json from whatever rows have recorded state; returns it. The table comes from
  sweep.json's record, or from `config` where one is given (`_recorded_table`)."""
  workdir = paths.as_path(workdir)
  sweep = _read_json(workdir / "sweep.json")
  if sweep is None:
    raise FileNotFoundError(f"{workdir} has no sweep.json: run `bert-jax sweep --config ... --workdir {workdir}` "
                            "first")
  table, default_suite = _recorded_table(sweep, workdir, config)
  if "suite" in sweep:  # The suite the sweep ran, command-line changes included.
    table = dataclasses.replace(table, suite=suite_lib.Suite(
        **{key: tuple(value) if isinstance(value, list) else value for key, value in sweep["suite"].items()}))
  higher = table.published.get("higher_is_better", {})
  rows = []
  for row in table.rows:
    row_dir = workdir / "rows" / row.slug
    status = _read_json(row_dir / "row.json") or {"status": "not run" if not row_dir.exists() else "incomplete"}
    tasks = {}
    for task_name in table.suite.tasks:
      scores = {}
      for lr in table.suite.lrs:
        values = [state["score"] for seed in table.suite.seeds
                  if (state := _read_json(_finetune_state(row_dir, task_name, lr, seed))) is not None]
        if values:
          scores[lr] = values
      if scores:
        tasks[task_name] = {"metric": suite_lib.TASKS[task_name].metric,
                            "seeds_done": sum(len(v) for v in scores.values()),
                            **suite_lib.summarize(scores, higher.get(task_name, True))}
    own = _read_json(row_dir / "state" / "finetune.json")
    for split, metrics in (own or {}).get("summary", {}).items():
      for metric, stats in metrics.items():
        tasks[f"{split}/{metric}"] = {"metric": metric, "seeds_done": len(stats["values"]), **stats}
    pretrain = _read_json(_pretrain_state(pretrained_dir(table, row, workdir)))
    if pretrain is not None and row.pretrained is not None:
      pretrain = {**pretrain, "wall_seconds": 0.0, "pretrained_by": row.pretrained}
    rows.append({"name": row.name, "slug": row.slug, "overrides": resolved_overrides(table, row),
                 "finetune": row.finetune,
                 "pretrained": row.pretrained, **({"continues": row.continues} if row.continues else {}),
                 "status": status.get("status"), "phase": status.get("phase"),
                 "error": status.get("error"), "pretrain": pretrain, "tasks": tasks,
                 **({"from": status["from"]} if status.get("from") else {})})
  results = {"config": table.spec, "overrides": list(table.base_overrides),
             "suite": dataclasses.asdict(table.suite), "published": table.published, "rows": rows,
             "rerun": rerun_command(table, default_suite),
             **({"dev_sets": sweep["dev_sets"]} if "dev_sets" in sweep else {})}
  paths.write_json(workdir / "results.json", results)
  return results


def _parse_rows(text: str) -> list[int]:
  try:
    return [int(part) for part in text.split(",") if part.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"--rows expects comma-separated row indices like 0,2, got {text!r}") from None


def _suite_from_args(suite: suite_lib.Suite, args: argparse.Namespace) -> suite_lib.Suite:
  """The config's suite with the command line's --tasks, --seeds and --lrs in place of its own, and its
  --finetune overrides after the suite's."""
  changes = {}
  if args.finetune:
    _check_finetune_keys(args.finetune, "--finetune")
    changes["overrides"] = (*suite.overrides, *args.finetune)
  try:
    if args.tasks:
      changes["tasks"] = tuple(task for task in args.tasks.split(",") if task)
    if args.seeds:
      changes["seeds"] = tuple(int(seed) for seed in args.seeds.split(",") if seed)
    if args.lrs:
      changes["lrs"] = tuple(float(lr) for lr in args.lrs.split(",") if lr)
  except ValueError:
    raise ValueError(f"--seeds takes integers and --lrs numbers, comma-separated; got --seeds={args.seeds} "
                     f"--lrs={args.lrs}") from None
  return dataclasses.replace(suite, **changes)


def _suite_args(suite: suite_lib.Suite, default: suite_lib.Suite) -> list[str] | None:
  """The --tasks, --seeds, --lrs and --finetune flags that turn the config's suite `default` into `suite` (the
  inverse of `_suite_from_args`); None when no flags do (the config's own suite changed since)."""
  args = [f"--{name} {','.join(map(str, getattr(suite, name)))}" for name in ("tasks", "seeds", "lrs")
          if tuple(getattr(suite, name)) != tuple(getattr(default, name))]
  own = tuple(default.overrides)
  if tuple(suite.overrides[:len(own)]) != own or any(
      getattr(suite, name) != getattr(default, name) for name in ("epochs", "max_len", "batch_size", "train_examples")):
    return None
  return args + [f"--finetune {item}" for item in suite.overrides[len(own):]]


def rerun_command(table: Table, default_suite: suite_lib.Suite, data: str = "data") -> str | None:
  """The `bert-jax sweep` command that runs `table` (config, command-line overrides and suite) again, its data
  under `data/` (README's layout: data/wiki, data/glue, ...); `--rows I` added runs one row. None when the
  config's suite is no longer the one the table ran with."""
  suite_args = _suite_args(table.suite, default_suite)
  if suite_args is None:
    return None
  name = pathlib.Path(table.spec.partition(":")[0]).stem
  overrides = [re.sub(r"(data\.prepared=).*", rf"\g<1>{data}/wiki", item) for item in table.base_overrides]
  return " ".join(["bert-jax sweep", f"--config {table.spec}", f"--workdir runs/{name}",
                   *(f"--data-dir {kind}={data}/{kind}" for kind in sorted(_tasks_by_data(table.suite))),
                   *overrides, *suite_args])


def _parse_data_dirs(items: Sequence[str]) -> dict[str, str]:
  out = {}
  for item in items:
    kind, sep, path = item.partition("=")
    if not sep or not kind or not path:
      raise ValueError(f"--data-dir {item!r}: expected KIND=PATH, e.g. glue=data/glue")
    out[kind] = path
  return out


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="bert-jax sweep", description=__doc__, allow_abbrev=False,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", help="table config configs/ablations/NAME.py[:arg] (get_config, get_sweep, "
                                       "get_suite, PUBLISHED); with --collect the table recorded in "
                                       "WORKDIR/sweep.json is used, or this config where one is given")
  parser.add_argument("--workdir", required=True, help="the sweep's directory (shared by every row's job)")
  parser.add_argument("--data-dir", action="append", default=[], metavar="KIND=PATH",
                      help="root of a downstream task's data: glue=DIR (GLUE folders), squad=DIR, conll2003=DIR; "
                           "repeatable")
  subset = parser.add_mutually_exclusive_group()
  subset.add_argument("--rows", type=_parse_rows, help="comma-separated row indices to run, e.g. 0,2")
  subset.add_argument("--row-index", type=int, help="run this one row (for a SLURM array task or one TPU slice)")
  parser.add_argument("--parallel", type=int, default=1,
                      help="run rows as N subprocesses side by side, one per local accelerator")
  parser.add_argument("--devices", type=int,
                      help="local accelerators the --parallel rows share round-robin (default: N, one each); "
                           "rows on one accelerator split its memory")
  parser.add_argument("--pipeline", action="store_true",
                      help="with --parallel: one row pre-trains at a time, the next starting once it has pre-trained, "
                           "beside its fine-tuning (e.g. --parallel 2 --devices 1 on one GPU)")
  parser.add_argument("--collect", action="store_true", help="only build WORKDIR/results.json from finished rows")
  parser.add_argument("--tasks", help="comma-separated downstream tasks replacing the suite's, e.g. mnli_m,sst2 "
                                      f"(known: {','.join(suite_lib.TASKS)})")
  parser.add_argument("--seeds", help="comma-separated fine-tuning seeds replacing the suite's, e.g. 1,2,3")
  parser.add_argument("--lrs", help="comma-separated fine-tuning learning rates replacing the suite's grid")
  parser.add_argument("--finetune", action="append", default=[], metavar="KEY=VALUE",
                      help="a fine-tuning config override for every task of every row, after the suite's own "
                           "(e.g. optim.layerwise_lr_decay=0.8); repeatable")
  return parser


def main(argv: list[str]) -> int:
  parser = _parser()
  args, rest = parser.parse_known_args(argv)
  unknown = [a for a in rest if not a.startswith("--config.")]
  if unknown:
    parser.error(f"unrecognised arguments {unknown}")
  try:
    workdir = paths.as_path(args.workdir)
    if args.collect:
      results = collect(workdir, args.config)
    else:
      if not args.config:
        parser.error("--config is required (unless --collect)")
      table = load_table(args.config, rest)
      table = dataclasses.replace(table, suite=_suite_from_args(table.suite, args))
      data_dirs = _parse_data_dirs(args.data_dir)
      indices = [args.row_index] if args.row_index is not None else args.rows
      child_args = [f"--data-dir={item}" for item in args.data_dir] + [
          f"--{name}={value}" for name in ("tasks", "seeds", "lrs") if (value := getattr(args, name))] + [
          f"--finetune={item}" for item in args.finetune]
      if args.devices is not None and args.devices < 1:
        parser.error(f"--devices must be at least 1, got {args.devices}")
      if args.pipeline and args.parallel < 2:
        parser.error("--pipeline overlaps a row's fine-tuning with the next row's pre-training: give --parallel 2")
      results = run_sweep(table, workdir, data_dirs, indices, args.parallel, child_args=child_args,
                          devices=args.devices, pipeline=args.pipeline)
  except (config_lib.ConfigError, ValueError, FileNotFoundError) as error:
    print(f"bert-jax sweep: error: {error}", file=sys.stderr)
    return 1
  done = sum(row["status"] == "done" for row in results["rows"])
  failed = [row["name"] for row in results["rows"] if row["status"] == "failed"]
  print(f"{done}/{len(results['rows'])} rows done" + (f"; failed: {failed}" if failed else "")
        + f"\nResults: {workdir / 'results.json'}; render with `bert-jax table {workdir}`")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
