"""Pre-training: `train_and_evaluate(config, workdir)` and `bert-jax pretrain` (`main`).

Config -> data (prepared shards, or the built-in corpus) -> objective + model
-> sharded state -> jitted step -> metrics, evaluation, checkpoints. Starting
again with the same workdir resumes exactly, data iterator included. SIGTERM
saves a checkpoint and returns cleanly. A non-finite loss stops the run with a
clear error; the state it stops on never reaches a checkpoint.
"""

from __future__ import annotations

import logging
import os
import pathlib
from typing import Any, Sequence

from etils import epath
import jax
import ml_collections
import numpy as np

from bert_jax import paths
from bert_jax import progress as progress_lib
from bert_jax.data.prepare import open_prepared
from bert_jax.train import checkpoint as checkpoint_lib
from bert_jax.train import pretrain_data
from bert_jax.train import workdir as workdir_lib
from bert_jax.train import config_lib, distill as distill_lib, loop, objectives, optim
from bert_jax.train import pretrain_config
from bert_jax.train import run as run_lib
from bert_jax.train.step import TrainState, checkpointed, create_state, make_eval_step, make_train_step

log = logging.getLogger(__name__)


NonFiniteLossError = loop.NonFiniteLossError


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | os.PathLike, *,
                       instruments: loop.Instruments | None = None) -> dict[str, Any]:
  """Runs (or resumes) the pre-training experiment `config` in `workdir` (a local folder or `gs://`); a benchmark's
  `instruments` wrap the loop's step functions and batches.

  Returns:
    {"step": final step, "train": last logged train metrics, "eval": last eval
    metrics, "history": [train metrics per log step], "preempted": bool, ...};
    with config.train.report_baseline also "baseline": `unigram_baseline`'s
    (token, accuracy), and a finished run started again is evaluated once.
  """
  with run_lib.locked(workdir, _after_ctrl_c) as (workdir, primary):
    return _train_and_evaluate(config, workdir, primary, instruments or loop.Instruments())


def _after_ctrl_c(workdir: epath.Path) -> str:
  """What a Ctrl-C outside the steps leaves: the checkpoint the same command resumes from."""
  return (f"{checkpoint_lib.resume_point(checkpoint_lib.complete_steps(workdir))} in {workdir / 'checkpoints'}, "
          "where the same command resumes")


def _setup(config: ml_collections.ConfigDict, workdir: epath.Path):
  """What training and `evaluate_run` share: (mesh, partitioning, prepared corpus, tokenizer, model config,
  objective), every derived value checked."""
  mesh, partitioning = run_lib.mesh_and_partitioning(config, pretrain_config.validate)
  prepared_dir = pretrain_data.prepare_data(config, workdir)
  corpus = open_prepared(prepared_dir)
  pretrain_data.check_spans(corpus, config.masking.granularity)
  pretrain_data.warn_single_sentence_documents(corpus, config.data.format)
  tokenizer = corpus.load_tokenizer()
  model_cfg = pretrain_config.model_config_for(config, tokenizer.vocab_size)
  objective = objectives.make_objective(config, model_cfg, tokenizer.mask_id)
  return mesh, partitioning, prepared_dir, tokenizer, model_cfg, objective


def evaluate_run(workdir: str | os.PathLike, overrides: Sequence[str] = ()) -> dict[str, float]:
  """Scores a pre-training run's newest checkpoint on its held-out documents under its config changed by
  `overrides` (config_lib's "key=value"): another objective and example format score it on another sentence
  task (ALBERT's cross-evaluation of NSP and SOP models). Parameters the run lacks (a sentence head a model
  without one is scored with) start from their initialisation, so such a head scores at chance.

  Returns:
    `evaluate`'s results.
  """
  workdir = paths.as_path(workdir)
  config = run_lib.saved_config(workdir, config_lib.pretrain_defaults())
  config_lib.apply_overrides(config, list(overrides))
  mesh, partitioning, prepared_dir, _, _, objective = _setup(config, workdir)
  dummy = objective.example_batch(config.train.batch_size, config.data.seq_len)
  state, shardings = create_state(lambda key: objective.init_variables(key, dummy), optim.optax.identity(),
                                  jax.random.key(config.seed), partitioning)
  _, loaded = checkpoint_lib.restore_params(workdir)
  params = checkpoint_lib.match_params(loaded, state.params, f"the checkpoint in {workdir} does not fit this model",
                                      missing_ok=True)
  params = jax.device_put(params, shardings.params)
  eval_step = make_eval_step(objective, partitioning, shardings)
  return pretrain_data.evaluate(eval_step, params, config, prepared_dir, mesh, objective)


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: epath.Path, primary: bool,
                        instruments: loop.Instruments) -> dict[str, Any]:
  mesh, partitioning, prepared_dir, tokenizer, model_cfg, objective = _setup(config, workdir)
  teacher = None
  if config.distill.teacher:
    objective, teacher = distill_lib.for_pretraining(config, objective)
  elif config.distill.init_from_teacher:
    raise ValueError("config.distill.init_from_teacher is set without config.distill.teacher")
  total_steps = config.train.steps
  tx, schedule = optim.make_optimizer(config.optim, total_steps)

  rng = jax.random.key(config.seed)
  init_rng, step_rng = jax.random.split(rng)
  dummy = objective.example_batch(config.train.batch_size, config.data.seq_len)
  state, state_shardings = create_state(lambda key: objective.init_variables(key, dummy), tx, init_rng, partitioning)
  frozen = None
  if teacher is not None:
    frozen, frozen_shardings = distill_lib.place_frozen(*teacher, dummy, partitioning)
    state_shardings = state_shardings.replace(frozen=frozen_shardings)
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))

  checkpointer = checkpoint_lib.Checkpointer(workdir, keep=config.train.keep_checkpoints,
                                             async_save=config.train.async_checkpoint)
  train_iter = pretrain_data.iterator(config, prepared_dir, "train", config.train.batch_size, mesh,
                                      workers=config.data.workers, steps_per_call=config.train.steps_per_call)
  had_checkpoints = bool(checkpointer.steps())
  if had_checkpoints:  # Checkpoints of another experiment are not corrupt: refuse before touching them.
    workdir_lib.check_resume_config(workdir, config.to_dict(), defaults=config_lib.pretrain_defaults().to_dict())
  restored = checkpointer.restore_latest(checkpointed(state))
  state = state.replace(frozen=frozen)
  if restored is None and had_checkpoints and not config.train.restart_if_unreadable:
    raise ValueError(f"no checkpoint in {checkpointer.directory} can be read (each was moved to "
                     f"{workdir / 'corrupt_checkpoints'}, see the warnings above); rerun with "
                     f"--config.train.restart_if_unreadable=True to start again from step 0")
  if restored is not None:
    start_step, saved, data_state, _ = restored
    state = TrainState(**saved, frozen=frozen)
    train_iter.set_state(data_state)
    log.info("resumed from checkpoint at step %d in %s", start_step, checkpointer.directory)
  else:
    start_step = 0
    if config.train.init_from:
      _, params = checkpoint_lib.restore_params(config.train.init_from)
      params = checkpoint_lib.match_params(params, state.params, "config.train.init_from does not fit this model")
      state = state.replace(params=jax.device_put(params, state_shardings.params))
      log.info("initialised parameters from %s", config.train.init_from)
    elif config.distill.init_from_teacher:
      params = distill_lib.init_from_teacher(jax.device_get(state.params), teacher[1], objective.model_config,
                                             objective.teacher_config)
      state = state.replace(params=jax.device_put(params, state_shardings.params))
      log.info("initialised the student from the teacher %s", config.distill.teacher)

  train_iter.start()  # The workers start and the first batches are built while the step compiles.
  # Several steps a call; the single step (compiled only if used) takes those before the first multiple of
  # steps_per_call and after the last one that fits.
  train_step, multi_step = run_lib.make_steps(objective, tx, schedule, config.train, partitioning, state_shardings,
                                              step_rng, instruments.make_train_step or make_train_step)
  if instruments.step:
    train_step, multi_step = instruments.step(train_step), multi_step and instruments.step(multi_step)
  # Evaluation scores the student's own objective: the teacher's terms need the teacher's outputs.
  eval_objective = objective.student if teacher is not None else objective
  eval_step = make_eval_step(eval_objective, partitioning, state_shardings)

  tokens_per_step = config.train.batch_size * config.data.seq_len
  predictions = config.masking.max_predictions, config.data.seq_len
  teacher_flops = None if teacher is None else teacher[0].model_config.flops_per_token(
      config.data.seq_len, objective.predictions_per_token(*predictions))
  throughput = run_lib.throughput(tokens_per_step, objective.flops_per_token(*predictions), mesh.size, teacher_flops)
  if primary:
    # end="" keeps pre-training's run files byte for byte: they end at the closing brace.
    run_lib.write_run_files(workdir, config, model_cfg, tokenizer, {"environment.json": run_lib.environment()}, end="")
    run_lib.banner("pretrain", f"objective={config.objective} model={config.model.family}/{config.model.size}",
                   num_params, f"{run_lib.batch_sizes(config.train.batch_size)} seq_len={config.data.seq_len} "
                   f"tokens/step={tokens_per_step} devices={mesh.size} mesh={dict(mesh.shape)} "
                   f"steps={start_step}->{total_steps}", workdir,
                   (config.distill.teacher, objective.weights) if teacher is not None else None)

  eval_results = {}
  progress = progress_lib.Progress(total_steps, "pretrain", initial=start_step) if primary else None
  train_log = run_lib.TrainLog(workdir, start_step, primary, throughput, progress)
  writer = train_log.writer

  def nonfinite_message(bad_step: int, bad: dict[str, float]) -> str:
    good = checkpointer.steps()
    return (f"non-finite loss or gradients at step {bad_step} (loss={bad['loss']}); the update was not applied "
            f"and the run stops. Last good checkpoint: {good[-1] if good else 'none'} in {checkpointer.directory}. "
            f"Try a lower config.optim.lr, a longer warmup or config.optim.clip_norm.")

  def evaluate_now(step: int, state) -> None:
    nonlocal eval_results
    eval_results = pretrain_data.evaluate(eval_step, state.params, config, prepared_dir, mesh, eval_objective)
    writer.write(step, eval_results, prefix="eval/")
    if primary:
      progress_lib.print_line(progress, f"eval @ {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in eval_results.items()))

  with loop.Preemption() as preemption:
    # A distillation teacher (`TrainState.frozen`) is read again from its own path on resume, never saved here.
    checkpoints = loop.CheckpointHook(
        checkpointer, config.train.checkpoint_every, preemption,
        lambda step, state: (checkpointed(state), train_iter.get_state(), {"step": step}), on_save=writer.flush,
        progress=progress,
        stop_line=lambda step: f"stop requested (SIGTERM or Ctrl-C): saved checkpoint at step {step}; exiting")
    try:
      # abandon: Ctrl-C in the loop (on one process, the second), waiting for no write.
      batches = instruments.batches(train_iter) if instruments.batches else train_iter
      state, step, preempted = loop.run_and_close(
          train_step, state, batches, start_step=start_step, total_steps=total_steps,
          log_every=config.train.log_every, on_log=train_log, nonfinite_message=nonfinite_message,
          hooks=(loop.Every(config.train.eval_every, evaluate_now), checkpoints), progress=progress,
          multi_step=multi_step, steps_per_call=config.train.steps_per_call,
          closers=lambda abandon: [*filter(None, [instruments.on_loop_end]), train_iter.close, writer.close,
                                   checkpointer.abandon if abandon else checkpointer.close])
    except OSError as error:  # A full disk or lost storage: named once, with the checkpoint a rerun resumes from.
      raise checkpointer.storage_error(error, getattr(error, "filename", None) or str(workdir)) from None
    except KeyboardInterrupt:
      raise checkpoints.interrupted() from None
  result = {"step": step, "train": train_log.last, "eval": eval_results, "history": train_log.history,
            "preempted": preempted,
            "workdir": str(workdir), "model_config": model_cfg, "num_params": num_params,
            "prepared_dir": str(prepared_dir)}
  if config.train.report_baseline and not preempted:
    if not eval_results:  # A finished run started again: score it for the report.
      result["eval"] = eval_results = pretrain_data.evaluate(eval_step, state.params, config, prepared_dir, mesh,
                                                            eval_objective)
    if jax.process_count() == 1 and "mlm_accuracy" in eval_results:  # Reads the batches' answers on this host.
      result["baseline"] = pretrain_data.unigram_baseline(config, prepared_dir, mesh, eval_objective, tokenizer)
  return result


def main(argv: list[str]) -> int:
  """bert-jax pretrain --config FILE[:ARG] [--config.KEY=VALUE ...] --workdir DIR."""
  parser = config_lib.config_parser("bert-jax pretrain", main.__doc__, "configs/NAME.py[:arg]",
                                    "--config.optim.lr=1e-4")
  parser.add_argument("--workdir", required=True, help="run directory; an existing one is resumed")
  args, config = config_lib.parse_with_config(parser, argv)
  if config is None:
    return 0
  result = train_and_evaluate(config, args.workdir)
  _report(config, result)
  return 0


def _report(config, result) -> None:
  if jax.process_index() != 0:
    return
  if result["preempted"]:
    print(f"Preempted at step {result['step']}; run the same command again to resume.")
    return
  workdir = result["workdir"]
  history = result["history"]
  if history:
    first, last = history[0], history[-1]
    term = "lm" if "lm_loss" in last else "mlm"
    print(f"\n{term.upper()} loss {first.get(f'{term}_loss', float('nan')):.3f} (step {first['step']}) -> "
          f"{last.get(f'{term}_loss', float('nan')):.3f} (step {last['step']})")
  if result["eval"]:
    print("Eval: " + ", ".join(f"{k}={v:.4g}" for k, v in result["eval"].items()))
  if "baseline" in result:
    token, accuracy = result["baseline"]
    print(f"Held-out masked tokens: the model predicts {100 * result['eval']['mlm_accuracy']:.1f}% right; the best "
          f"frequency guess, always {token!r} (their most frequent answer), gets {100 * accuracy:.1f}%")
  if config.train.fill_mask:
    from bert_jax.train import fill_mask

    model_cfg, params, tokenizer = fill_mask.load_run(workdir)
    texts = list(config.train.fill_mask)
    print("\nFill-mask predictions:")
    print(fill_mask.format_predictions(texts, fill_mask.fill_mask(model_cfg, params, tokenizer, texts)))
  local = not paths.is_remote(workdir)
  if config.train.report_baseline and local and (pathlib.Path(workdir) / "metrics.jsonl").exists():
    from bert_jax.train import plot

    written = plot.plot([workdir], pathlib.Path(workdir) / "plots")
    print(f"\nLoss curve: {next(path for path in written if path.name == 'loss.png')} (the other plots beside it; "
          f"`bert-jax plot {workdir} OTHER_RUN --out DIR` draws runs together)")
  print(f"Checkpoints: {workdir}/checkpoints\nMetrics: {workdir}/metrics.jsonl (TensorBoard: {workdir}/tensorboard)")
