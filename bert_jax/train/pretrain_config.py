"""A pre-training config's checks of values that must fit together, before anything is compiled, and the model it
builds (the fine-tuning side: `bert_jax.tasks.finetune_config`). Its defaults: `config_lib.pretrain_defaults`."""

from __future__ import annotations

import jax
import ml_collections

from bert_jax.models import ModelConfig, model_config
from bert_jax.train import config_lib, objectives


def build_model_config(model: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
  """The config's model section -> ModelConfig; vocab_size defaults to the tokenizer's and must match it."""
  fields = {k: v for k, v in model.items() if k not in ("family", "size", "generator_fraction") and v is not None}
  if fields.get("vocab_size", vocab_size) != vocab_size:
    raise ValueError(f"config.model.vocab_size={fields['vocab_size']} does not match the tokenizer's vocabulary "
                     f"of {vocab_size} tokens; leave it unset to take the tokenizer's")
  fields["vocab_size"] = vocab_size
  return model_config(model.family, model.size, **fields)


def model_config_for(config: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
  """`build_model_config` of the config's model section, checked against the examples' length."""
  model = build_model_config(config.model, vocab_size)
  if model.position_embedding == "learned" and \
      config.data.seq_len + model.position_offset > model.max_position_embeddings:
    raise ValueError(f"config.data.seq_len={config.data.seq_len} does not fit the model's "
                     f"max_position_embeddings={model.max_position_embeddings} "
                     f"(position offset {model.position_offset})")
  return model


def validate(config: ml_collections.ConfigDict, data_parallel: int) -> None:
  """Derived values that must fit, checked before anything is compiled."""
  config_lib.validate_batching(config.train, data_parallel, jax.process_count())
  per_call = config.train.steps_per_call
  for key in ("log_every", "eval_every", "checkpoint_every"):  # A call never runs past one of them (`loop.run`).
    if config.train[key] % per_call:
      raise ValueError(f"config.train.{key}={config.train[key]} is not a multiple of config.train.steps_per_call="
                       f"{per_call}: a call of {per_call} steps never runs past a log, evaluation or checkpoint, "
                       "so the steps around each would run one a call; make it a multiple or lower steps_per_call")
  formats = objectives.objective_class(config.objective).sentence_formats
  if formats and config.data.format not in formats:
    raise ValueError(f"config.objective={config.objective!r} needs config.data.format="
                     f"{' or '.join(repr(f) for f in formats)}, got {config.data.format!r}")
  if config.model.get("fp8"):
    config_lib.check_qwix("config.model.fp8", "unset")
  if config.masking.max_predictions > config.data.seq_len:
    raise ValueError(f"config.masking.max_predictions={config.masking.max_predictions} exceeds "
                     f"config.data.seq_len={config.data.seq_len}")
