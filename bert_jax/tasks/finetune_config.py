"""A fine-tuning config: its defaults, the checks of values that must fit together (before any data is read), the
model fields it may change, and the model-selection rule in words.

The configs under configs/finetune/ start from `finetune_defaults()`; `bert_jax.tasks.finetune` runs them.
"""

from __future__ import annotations

import jax
import ml_collections
from ml_collections import config_dict

from bert_jax.models import ModelConfig
from bert_jax.tasks.base import Task
from bert_jax.train import config_lib

SELECTIONS = ("best", "last")
RNG_IMPLS = ("rbg", "unsafe_rbg", "threefry2x32")
# Model fields a fine-tuning config may change; the architecture comes from the initial model.
MODEL_OVERRIDES = ("dtype", "hidden_dropout", "attention_dropout", "kernels", "remat", "sparse_last_layer", "fp8")


def finetune_defaults() -> ml_collections.ConfigDict:
  """`config_lib.finetune_defaults` (the fine-tuning configs import it here) with init.step: the checkpoint of a
  pre-training or fine-tuning run `init.model` to start from (None: its newest, which must be readable)."""
  config = config_lib.finetune_defaults()
  config.init.step = config_dict.placeholder(int)
  return config


def eval_interval(eval_every: str) -> int:
  """0 for "epoch", -1 for "end", else the step count."""
  if eval_every in ("epoch", "end"):
    return 0 if eval_every == "epoch" else -1
  try:
    steps = int(eval_every)
  except ValueError:
    steps = 0
  if steps <= 0:
    raise ValueError(f"config.train.eval_every={eval_every!r}: expected 'epoch', 'end' or a positive step count")
  return steps


def validate(config: ml_collections.ConfigDict, data_parallel: int) -> None:
  """Checks values that must fit together, before any data is read."""
  train = config.train
  config_lib.validate_batching(train, data_parallel, jax.process_count())
  if train.epochs < 1:
    raise ValueError(f"config.train.epochs={train.epochs} must be at least 1")
  if train.selection not in SELECTIONS:
    raise ValueError(f"config.train.selection={train.selection!r}: expected one of {SELECTIONS}")
  if train.rng_impl not in RNG_IMPLS:
    raise ValueError(f"config.train.rng_impl={train.rng_impl!r}: expected one of {RNG_IMPLS}")
  if train.early_stopping_patience < 0:
    raise ValueError(f"config.train.early_stopping_patience={train.early_stopping_patience} must be >= 0")
  eval_interval(train.eval_every)
  if config.train_examples is not None and config.train_examples < 1:
    raise ValueError(f"config.train_examples={config.train_examples} must be a positive count (or None: all)")
  if not config.seeds or len(set(config.seeds)) != len(config.seeds):
    raise ValueError(f"config.seeds={config.seeds!r} must name at least one seed, each once")
  if not 0.0 <= config.optim.warmup_proportion < 1.0:
    raise ValueError(f"config.optim.warmup_proportion={config.optim.warmup_proportion} must be in [0, 1)")
  if not 0.0 < config.optim.layerwise_lr_decay <= 1.0:
    raise ValueError(f"config.optim.layerwise_lr_decay={config.optim.layerwise_lr_decay} must be in (0, 1]")
  if not config.init.model:
    raise ValueError("config.init.model is not set: add --config.init.model=DIR, a pre-training workdir (the "
                     "demo's runs/demo), a fine-tuning workdir, or a Hugging Face or converted model directory")
  if not config.data_dir:
    raise ValueError("config.data_dir is not set: add --config.data_dir=DIR, the folder with the task's files "
                     "(for GLUE the folder holding RTE/, SST-2/, ...), or --config.data_dir=tfds for TensorFlow "
                     "Datasets")
  if config.quant.qat:
    config_lib.check_qwix("config.quant.qat", "False")
  if config.model.fp8:
    config_lib.check_qwix("config.model.fp8", "False")
  if config.model.fp8 and config.quant.qat:
    raise ValueError("config.model.fp8=True with config.quant.qat=True: training in float8 and fake-quantised int8 "
                     "at once is not a recipe; leave one of them False")
  if config.distill.teacher and config.feature_based.layers:
    raise ValueError("config.distill.teacher is set with config.feature_based.layers: distillation trains the whole "
                     "student; leave one of them unset")


def model_config_for(initial: ModelConfig, overrides: ml_collections.ConfigDict) -> ModelConfig:
  """The initial model's config with the fine-tuning overrides (dtype, dropouts...) applied."""
  # .get: a run saved before an override existed keeps the model's own value.
  return initial.replace(**{name: overrides.get(name) for name in MODEL_OVERRIDES if overrides.get(name) is not None})


def selection_rule(task: Task, config: ml_collections.ConfigDict) -> str:
  """The model-selection rule in words, as written into the results."""
  when = {"epoch": "at the end of every epoch", "end": "once, after the last step"}.get(
      config.train.eval_every, f"every {config.train.eval_every} steps and after the last step")
  if config.train.selection == "last":
    chosen = "the last evaluation is reported and its parameters kept"
  else:
    chosen = (f"the evaluation with the highest {task.selection_metric} on {task.eval_splits[0]} is reported "
              "and its parameters kept (ties keep the earlier one)")
  stop = (f"; training stops after {config.train.early_stopping_patience} evaluations without improvement"
          if config.train.early_stopping_patience else "")
  return f"dev evaluated {when}; {chosen}{stop}"
