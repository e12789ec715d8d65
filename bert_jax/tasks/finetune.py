"""`bert-jax finetune`: fine-tune on a task with several seeds (the config: `finetune_config`; re-scoring a finished
run, `bert-jax evaluate`, and the scoring both share: `evaluate`).

  bert-jax finetune --config configs/finetune/glue.py:task=rte --workdir runs/rte \\
      --config.init.model=MODEL_DIR --config.data_dir=../shared/data/glue --config.optim.lr=3e-5

`finetune(config, workdir)` featurises the task once, builds one model (a
`FinetuneModel`, or the feature-based tagger), and trains it once per seed
with the pre-training machinery: sharded state, the jitted accumulating step
(compiled once for all seeds: the seed reaches the dropout key through the
batch), the shared loop (`bert_jax.train.loop`), the AdamW schedule with warmup and layer-wise LR decay. Batches have
fixed shapes: rows are padded to the longest feature of the task (rounded up
to 8, at most max_len; to max_len with `pad_to_max_len`), and the last batch of an epoch is filled with rows of
weight 0, which predictions drop before `Task.evaluate`. The schedule's warmup and total steps are in the
optimizer state, so tasks of one kind, label count and padded length compile the same steps: with JAX's
persistent compilation cache (`bert-jax` turns it on) a sweep's second such task loads them.

The dev set is scored every epoch (or every N steps); the selected evaluation
is the best on the task's selection metric (ties keep the earlier one), or the
last one, and its parameters are the checkpoint kept. The rule is written into
the results.

Workdir:
  config.json, model_config.json, tokenizer/
  finetune_run.json           the task, the model, the seeds; "init": the starting point's path, kind and the
                              step of the run checkpoint it was read from (config.init.step, or its newest)
  seed_<s>/metrics.jsonl      train and eval scalars as JSON lines (scores as fractions; `tasks.metrics`)
  seed_<s>/tensorboard/       the same scalars as TensorBoard events
  seed_<s>/checkpoints/       the selected parameters (Orbax; `restore_params`)
  seed_<s>/state/             a stopped seed's training state (params, optimizer state, step, the selection so
                              far and the evaluation history), removed when the seed finishes
  seed_<s>/result.json        the seed's selected evaluation and its history
  results.json, results.md    every seed, and mean / median / std / min / max (scores in percent)
  evaluate_<split>.json, submission/seed_<s>/   written by `bert-jax evaluate`

SIGTERM or Ctrl-C saves the running seed's training state once the current
step ends, prints one line and exits 1 (a second Ctrl-C exits at once,
saying which state is complete). The same command then skips the seeds whose
result.json exists and continues a stopped seed from its state, exactly as
if it had not stopped; a seed killed without a chance to save (SIGKILL)
starts again from step 0.

With `config.distill.teacher` (a fine-tuning workdir of the same task) the
objective is `bert_jax.train.distill.Distillation`: the same step and loop, the
teacher's soft targets (and BERT-PKD's loss) added to the labels' loss, the
teacher frozen in `TrainState.frozen`; `config.init.layers` starts a shallower
student from every k-th layer of its initial model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from typing import Any

from etils import epath
import flax.linen as nn
import jax
import ml_collections
import numpy as np

from bert_jax import paths
from bert_jax import progress as progress_lib
from bert_jax.tasks import metrics as task_metrics
from bert_jax.tasks.base import Task
from bert_jax.tasks.batching import BatchMaker, epoch_batches, fitted_max_len
from bert_jax.tasks.evaluate import (EvalSet, Selection, evaluate_splits, read_task_data, results_markdown,
                                     summarize_seeds)
from bert_jax.tasks.finetune_config import (eval_interval, finetune_defaults, model_config_for, selection_rule,
                                           validate)
from bert_jax.tasks.finetune_model import (RUN_FILE, FinetuneObjective, device_fields, distillation,
                                           load_initial_model, merge_initial_params, optimizer, task_model,
                                           task_tokenizer)
from bert_jax.tasks.registry import get_task
from bert_jax.models import ModelConfig
from bert_jax.train import checkpoint as checkpoint_lib
from bert_jax.train import workdir as workdir_lib
from bert_jax.train import config_lib, distill as distill_lib, loop
from bert_jax.train import run as run_lib
from bert_jax.train.step import (Partitioning, TrainState, checkpointed, compile_ahead, make_predict_step,
                                 make_state_init)

log = logging.getLogger(__name__)

# A seed's resumable training state (params, optimizer state, step, selection so far), while it is unfinished.
STATE_FOLDER = "state"


@dataclasses.dataclass
class _Run:
  """What every seed of one `finetune` call shares."""

  config: ml_collections.ConfigDict
  task: Task
  workdir: epath.Path
  objective: FinetuneObjective
  model_config: ModelConfig
  partitioning: Partitioning
  tx: Any
  schedule: Any
  train_features: dict[str, np.ndarray]
  eval_sets: list[EvalSet]
  train_batches: BatchMaker
  eval_batches: BatchMaker
  dummy_batch: dict[str, jax.Array]
  initial_params: dict[str, Any]
  abstract_params: Any  # the model's params as shapes (`jax.ShapeDtypeStruct`s)
  steps_per_epoch: int
  teacher: tuple[Any, Any] | None = None  # (the teacher's task, its host params) when distilling
  frozen: Any = None  # the teacher's params on the mesh (`TrainState.frozen`)
  state_init: Any = None
  state_shardings: Any = None
  train_step: Any = None
  multi_step: Any = None  # train.steps_per_call steps a call, or None
  predict_step: Any = None
  given: Any = None  # the loaded params on the mesh, None where the init draws them
  compile_seconds: float = 0.0
  compile_cache: dict[str, int] = dataclasses.field(default_factory=dict)  # `persistent_cache_hits`' counts
  head_report: dict[str, list[str]] = dataclasses.field(default_factory=dict)


def _init_state(run: _Run, seed: int):
  """Sharded state for `seed`: random head, loaded encoder (and reusable head leaves), built on the mesh.

  The first call also builds the train and predict steps and compiles them
  (`_compile_steps`).
  """
  first = run.state_init is None
  if first:
    run.state_init, run.state_shardings = make_state_init(
        lambda key: run.objective.init_variables(key, run.dummy_batch), run.tx, run.partitioning, jax.random.key(0))
    if run.teacher is not None:
      run.frozen, frozen_shardings = distill_lib.place_frozen(
          *run.teacher, run.dummy_batch, run.partitioning,
          hint=f" (a teacher is a fine-tuning workdir of {run.task.name}, whose head it keeps)")
      run.state_shardings = run.state_shardings.replace(frozen=frozen_shardings)
    # The seed reaches the dropout key through the batch: one key for the compiled steps of every seed.
    run.train_step, run.multi_step = run_lib.make_steps(
        run.objective, run.tx, run.schedule, run.config.train, run.partitioning, run.state_shardings,
        jax.random.key(0, impl=run.config.train.rng_impl))
    run.predict_step = make_predict_step(run.objective, run.partitioning, run.state_shardings.params)
    # The loaded leaves, on the mesh once for every seed; the init draws only the others (`make_state_init`).
    merged, reused, fresh = merge_initial_params(run.abstract_params, run.initial_params)
    run.head_report = {"reused": reused, "reinitialised": fresh}
    run.given = jax.tree.map(lambda value, sharding: None if isinstance(value, jax.ShapeDtypeStruct)
                             else jax.device_put(value, sharding), merged, run.state_shardings.params)
  state = run.state_init(jax.random.key(seed), run.given).replace(frozen=run.frozen)
  if first:
    _compile_steps(run, state)
  return state


def _compile_steps(run: _Run, state) -> None:
  """Compiles the train and predict steps ahead (`compile_ahead`): every batch has the same shapes, so they serve
  all seeds, and compilation stays out of the measured training time (it is reported as `compile_seconds`)."""
  rows = np.arange(1)  # any rows: a batch's shapes are the batch size's and the padded length's
  train_batch = run.train_batches(run.train_features, rows, 0)
  lowered = [run.train_step.lower(state, train_batch),
             run.predict_step.lower(state.params, run.eval_batches(run.eval_sets[0].features, rows, 0))]
  if run.multi_step is not None:
    lowered.append(run.multi_step.lower(state, [train_batch] * run.config.train.steps_per_call))
  compiled, run.compile_seconds, run.compile_cache = compile_ahead(lowered)
  run.train_step, run.predict_step = compiled[:2]
  run.multi_step = compiled[2] if run.multi_step is not None else None


def _train_seed(run: _Run, seed: int, preemption: loop.Preemption, progress_desc: str, later_steps: int
                ) -> dict[str, Any]:
  """Trains and evaluates one seed, from its saved training state (seed_<s>/state/) when a stop left one; returns
  its result (also written to seed_<s>/result.json).

  A stop request (SIGTERM, Ctrl-C) saves the state, the step and the `Selection` so far there and raises
  `loop.Stopped`; the data position is the step (`epoch_batches`). `progress_desc` labels the bar; `later_steps`
  are the steps of the seeds after this one, for the time left over all of them.
  """
  config, task = run.config, run.task
  seed_dir = run.workdir / f"seed_{seed}"
  if (seed_dir / "result.json").exists():
    log.info("seed %d already finished in %s; reusing its result", seed, seed_dir)
    return json.loads((seed_dir / "result.json").read_text())
  primary = jax.process_index() == 0
  compiled_before = run.state_init is not None
  state = _init_state(run, seed)
  resumable = checkpoint_lib.Checkpointer(seed_dir, keep=1, folder=STATE_FOLDER)
  restored = resumable.restore_latest(checkpointed(state))
  start_step, selection = 0, Selection()
  if restored is not None:
    start_step, saved, _, meta = restored
    state = TrainState(**saved, frozen=run.frozen)
    selection = Selection(**meta["selection"])
    log.info("seed %d: resumed from its training state at step %d in %s", seed, start_step, resumable.directory)
  checkpointer = checkpoint_lib.Checkpointer(seed_dir, keep=1) if config.train.save_checkpoint else None
  if checkpointer is not None:  # A selection after the saved state is made again (or not) by the rerun.
    checkpointer.drop_after(start_step)
  interval = eval_interval(config.train.eval_every)
  total_steps = config.train.epochs * run.steps_per_epoch
  seq_len = run.train_features["input_ids"].shape[-1]
  teacher_flops = None if run.teacher is None else run.teacher[0].model.config.flops_per_token(seq_len, 0.0)
  throughput = run_lib.throughput(run.train_batches.batch_size * seq_len * max(task.num_choices, 1),
                                  run.model_config.flops_per_token(seq_len, 0.0), run.partitioning.mesh.size,
                                  teacher_flops)
  # The bar counts examples: a step is one global batch (the last batch of an epoch counts whole).
  progress = (progress_lib.Progress(total_steps, progress_desc, initial=start_step, unit="ex",
                                    unit_scale=run.train_batches.batch_size, after=later_steps)
              if primary else None)
  train_log = run_lib.TrainLog(seed_dir, start_step, primary, throughput, progress)
  writer = train_log.writer
  clock = [time.perf_counter()]  # the start of the training since the last evaluation

  def evaluate(step: int, state) -> bool:
    """Scores dev, updates the selection; returns True when early stopping says stop."""
    jax.block_until_ready(state.params)
    started = time.perf_counter()
    selection.train_seconds += started - clock[0]
    metrics = evaluate_splits(task, run.predict_step, state.params, run.eval_sets, run.eval_batches)
    record = {"step": step, "epoch": round(step / run.steps_per_epoch, 4), "metrics": metrics}
    for split, values in metrics.items():
      writer.write(step, task_metrics.as_fractions(values), prefix=f"eval/{split}/" if len(metrics) > 1 else "eval/")
    if selection.add(record, task, keep_last=config.train.selection == "last") and checkpointer is not None:
      # The save replaces the selection a resumed state names: that state goes first, never left pointing at
      # nothing (a seed killed before its next stop starts again from step 0).
      resumable.drop_after(-1)
      checkpointer.save(step, {"params": distill_lib.student_params(state.params)}, {},
                        {"step": step, "seed": seed}, force=True)
    if primary:
      progress_lib.print_line(progress, f"seed {seed} step {step} (epoch {record['epoch']:g}): " + "; ".join(
          f"{split} " + ", ".join(f"{k}={v:.2f}" for k, v in values.items()) for split, values in metrics.items()))
    selection.eval_seconds += time.perf_counter() - started
    clock[0] = time.perf_counter()
    patience = config.train.early_stopping_patience
    return bool(patience) and selection.evaluations_since_best >= patience

  def saved_on_stop(step: int, state) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    now = dataclasses.replace(selection, train_seconds=selection.train_seconds + time.perf_counter() - clock[0])
    return checkpointed(state), {"step": step}, {"step": step, "seed": seed, "selection": dataclasses.asdict(now)}

  def made_durable() -> None:  # the stop's state names a selection whose parameters and rows are on storage
    writer.flush()
    if checkpointer is not None:
      checkpointer.wait()

  # "epoch": after every epoch's last step; "end": after the last step only; N: every N steps and the last.
  evaluations = loop.Every(run.steps_per_epoch if interval == 0 else interval if interval > 0 else total_steps,
                           evaluate)
  # Only a stop saves the training state: a finished seed needs none, and its selected parameters are kept apart.
  stop_hook = loop.CheckpointHook(resumable, 0, preemption, saved_on_stop, on_save=made_durable, at_last=False)
  # A failed asynchronous save of the selected parameters stops the seed after the call it fails in.
  hooks = (evaluations,) + ((checkpoint_lib.SaveCheck(checkpointer),) if checkpointer is not None else ()) + (
      stop_hook,)
  def closers(abandon: bool) -> list:  # abandon: a second Ctrl-C, waiting for no write
    return [writer.close, resumable.abandon if abandon else resumable.close] + (
        [checkpointer.abandon if abandon else checkpointer.close] if checkpointer is not None else [])

  def nonfinite_message(bad_step: int, bad: dict[str, float]) -> str:
    del bad
    return f"seed {seed}: non-finite loss or gradients at step {bad_step}; try a lower config.optim.lr or more warmup"

  try:
    state, step, stopped = loop.run_and_close(
        run.train_step, state, epoch_batches(run.train_batches, run.train_features, seed, config.train.epochs,
                                             start_step),
        start_step=start_step, total_steps=total_steps, log_every=config.train.log_every, on_log=train_log,
        nonfinite_message=nonfinite_message, hooks=hooks, progress=progress, multi_step=run.multi_step,
        steps_per_call=config.train.steps_per_call, closers=closers)
    run.frozen = state.frozen  # The step donates the state, teacher included: the next seed takes this one.
  except KeyboardInterrupt:
    raise stop_hook.interrupted() from None
  if stop_hook.preempted:
    raise loop.Stopped(f"stop requested (SIGTERM or Ctrl-C): seed {seed}'s training state at step {step} is saved "
                       f"in {resumable.directory}; the same command resumes it")
  result = {"seed": seed, "steps": step, "stopped_early": stopped and step < total_steps,
            "selected": selection.selected, "history": selection.history, "train_seconds": selection.train_seconds,
            "eval_seconds": selection.eval_seconds,
            "compile_seconds": 0.0 if compiled_before else run.compile_seconds, "head": run.head_report}
  if primary:
    (seed_dir / "result.json").write_text(json.dumps(result, indent=2))
    if resumable.directory.exists():  # the seed is finished: its result replaces the state it resumed from
      resumable.directory.rmtree()
  return result


def finetune(config: ml_collections.ConfigDict, workdir: str | os.PathLike) -> dict[str, Any]:
  """Fine-tunes `config.init.model` on `config.task` once per seed and writes the results into `workdir` (a local
  folder or `gs://`).

  Returns:
    The content of results.json: task, init, selection_rule, seeds (one
    result per seed: selected evaluation, history, train/eval seconds),
    summary ({split: {metric: mean, median, std, min, max, values}}),
    best_seed, seq_len, num_params; with a teacher also distill (the config's
    `distill` section).
  """
  with run_lib.locked(workdir, lambda workdir: f"the seeds finished in {workdir} (seed_<s>/result.json) are kept, "
                      "and the same command trains the others") as (workdir, primary):
    return _finetune(config, workdir, primary)


def _finetune(config: ml_collections.ConfigDict, workdir: epath.Path, primary: bool) -> dict[str, Any]:
  mesh, partitioning = run_lib.mesh_and_partitioning(config, validate)
  task = get_task(config.task, **config.task_options.to_dict())
  started = time.perf_counter()
  initial = load_initial_model(config.init.model, step=config.init.get("step"), step_key="--config.init.step")
  if config.init.layers is not None:
    encoder, cut = distill_lib.every_kth_layer(initial.params["encoder"], initial.config, config.init.layers,
                                               "config.init.layers")
    initial = dataclasses.replace(initial, config=cut, params={**initial.params, "encoder": encoder})
  timings = {"load initial model": time.perf_counter() - started}
  model_config = model_config_for(initial.config, config.model)
  max_len = fitted_max_len(config.max_len, model_config)
  tokenizer = task_tokenizer(initial.tokenizer)

  started = time.perf_counter()
  train_features, eval_sets, seq_len = read_task_data(task, config.data_dir, tokenizer, max_len, config.train_examples,
                                                      config.pad_to_max_len)
  timings["read and featurise"] = time.perf_counter() - started

  model = task_model(config, model_config, task)
  objective = FinetuneObjective(model, task.kind, single_token_type=model_config.type_vocab_size == 1,
                                num_choices=task.num_choices)
  teacher = None
  if config.distill.teacher:
    started = time.perf_counter()
    objective, teacher = distillation(config, task, objective, max_len)
    timings["load teacher"] = time.perf_counter() - started
  batch_size = config.train.batch_size
  steps_per_epoch = math.ceil(len(train_features["input_ids"]) / batch_size)
  total_steps = config.train.epochs * steps_per_epoch
  dummy = objective.example_batch(batch_size, seq_len)
  abstract_params = nn.unbox(jax.eval_shape(lambda: objective.init_variables(jax.random.key(0), dummy))["params"])
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_params))
  tx, schedule = optimizer(config, total_steps, abstract_params, model_config, bool(config.feature_based.layers))
  fields = device_fields(task.kind)
  run = _Run(config=config, task=task, workdir=workdir, objective=objective, model_config=model_config,
             partitioning=partitioning, tx=tx,
             schedule=schedule, train_features=train_features, eval_sets=eval_sets,
             train_batches=BatchMaker(fields, batch_size, mesh),
             eval_batches=BatchMaker(fields, config.train.eval_batch_size, mesh), dummy_batch=dummy,
             initial_params=initial.params, abstract_params=abstract_params, steps_per_epoch=steps_per_epoch,
             teacher=teacher)

  if primary:
    # A workdir holds one experiment: every key must match, since any of them changes what the seeds compute.
    workdir_lib.check_resume_config(workdir, config.to_dict(), defaults=finetune_defaults().to_dict(), safe=())
    run_lib.write_run_files(workdir, config, model_config, initial.tokenizer)
    at_step = f", step {initial.step}" if initial.step is not None else ""
    run_lib.banner("finetune", f"task={task.name} ({task.kind}) init={config.init.model} ({initial.source}{at_step})",
                   num_params, f"train rows={len(train_features['input_ids'])} seq_len={seq_len} "
                   f"{run_lib.batch_sizes(batch_size)} tokens/step={batch_size * seq_len * max(task.num_choices, 1)} "
                   f"devices={mesh.size} steps={total_steps} seeds={tuple(config.seeds)}", workdir,
                   (config.distill.teacher, objective.weights) if teacher is not None else None)

  seeds = list(config.seeds)
  unfinished = [not (workdir / f"seed_{seed}" / "result.json").exists() for seed in seeds]
  seed_results = []
  with loop.Preemption() as preemption:
    for index, seed in enumerate(seeds):
      label = f"seed {seed} ({index + 1}/{len(seeds)})" if len(seeds) > 1 else f"seed {seed}"
      seed_results.append(_train_seed(run, seed, preemption, label, total_steps * sum(unfinished[index + 1:])))
  summary = summarize_seeds(task, seed_results)
  selection_split = task.eval_splits[0]
  best = max(seed_results, key=lambda r: r["selected"]["metrics"][selection_split][task.selection_metric])
  results = {"task": task.name, "kind": task.kind,
             "init": {"path": str(config.init.model), "source": initial.source, "step": initial.step,
                      "head": seed_results[0]["head"]},
             "selection_rule": selection_rule(task, config), "selection_metric": task.selection_metric,
             "seeds": seed_results, "summary": summary, "best_seed": best["seed"], "seq_len": seq_len,
             "num_params": num_params,
             "timings": {**timings, "compile train and predict steps (once)": run.compile_seconds},
             "compile_cache": run.compile_cache}
  if teacher is not None:
    results["distill"] = config.distill.to_dict()
  if primary:
    paths.write_json(workdir / "results.json", results)
    (workdir / "results.md").write_text(results_markdown(results))
    paths.write_json(workdir / RUN_FILE, {
        "task": task.name, "kind": task.kind, "num_labels": task.num_labels, "family": initial.family,
        "init": {"path": str(config.init.model), "source": initial.source, "step": initial.step},
        "model_config": dataclasses.asdict(model_config), "seq_len": seq_len, "seeds": list(config.seeds),
        "best_seed": best["seed"], "best_seed_dir": f"seed_{best['seed']}"})
  return results


def main(argv: list[str]) -> int:
  """bert-jax finetune --config FILE[:ARG] --workdir DIR [--config.KEY=VALUE ...]."""
  parser = config_lib.config_parser("bert-jax finetune", main.__doc__, "configs/finetune/NAME.py[:arg]",
                                    "--config.optim.lr=3e-5")
  parser.add_argument("--workdir", required=True,
                      help="run directory (finished seeds are not trained again; a stopped seed resumes)")
  args, config = config_lib.parse_with_config(parser, argv)
  if config is None:
    return 0
  try:
    results = finetune(config, args.workdir)
  except loop.Stopped as stopped:  # A requested stop: what was saved, in one line, and a nonzero exit.
    if jax.process_index() == 0:
      print(f"bert-jax finetune: {stopped}", flush=True)
    return 1
  if jax.process_index() == 0:
    print(results_markdown(results))
  return 0

