"""Experiment configs: `configs/<name>.py:<arg>` files with `get_config(arg)`.

  bert-jax pretrain --config configs/bert.py:size=base,objective=mlm+nsp \
      --config.optim.lr=1e-4 --workdir runs/bert

The file's `get_config(arg)` returns an `ml_collections.ConfigDict`; it is
locked before overrides are applied, so a misspelt key fails loudly (naming
it), and every override is parsed with the type of the field it replaces.
A file may also define `get_sweep(arg)` returning a list of override dicts.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import pathlib
import sys
from typing import Any, Iterable, Sequence

import ml_collections
from ml_collections import config_dict


class ConfigError(ValueError):
  """A config file, argument or override that cannot be used."""


def parse_arg(arg: str | None, **defaults: Any) -> ml_collections.ConfigDict:
  """Parses 'size=base,objective=mlm+nsp' against typed defaults (big_vision style).

  Unknown keys raise ConfigError; values take the type of their default.
  """
  out = ml_collections.ConfigDict(defaults)
  if not arg:
    return out
  for item in arg.split(","):
    if not item:
      continue
    key, sep, value = item.partition("=")
    if not sep:
      raise ConfigError(f"config argument {item!r} is not key=value (in {arg!r})")
    if key not in defaults:
      raise ConfigError(f"unknown config argument {key!r}; known: {sorted(defaults)}")
    out[key] = _coerce(value, defaults[key], f"config argument {key}")
  return out


def _coerce(text: str, like: Any, where: str) -> Any:
  if isinstance(like, bool):
    if text.lower() in ("true", "1", "yes"):
      return True
    if text.lower() in ("false", "0", "no"):
      return False
    raise ConfigError(f"{where}: expected a boolean, got {text!r}")
  if isinstance(like, int):
    try:
      return int(text)
    except ValueError:
      raise ConfigError(f"{where}: expected an integer, got {text!r}") from None
  if isinstance(like, float):
    try:
      return float(text)
    except ValueError:
      raise ConfigError(f"{where}: expected a number, got {text!r}") from None
  if isinstance(like, str):
    return text
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def _load_module(path: pathlib.Path):
  if not path.exists():
    raise ConfigError(f"config file {path} does not exist")
  spec = importlib.util.spec_from_file_location(f"bert_jax_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"config file {path} defines no get_config(arg)")
  return module


def resolve_config_path(spec: str) -> tuple[pathlib.Path, str | None]:
  """'configs/bert.py:size=base' -> (path, 'size=base'); bare names look in the repo's configs/."""
  path_text, _, arg = spec.partition(":")
  path = pathlib.Path(path_text)
  if not path.exists() and not path.is_absolute():
    bundled = pathlib.Path(__file__).resolve().parents[2] / "configs" / path_text
    if bundled.exists():
      path = bundled
    elif (bundled.with_suffix(".py")).exists():
      path = bundled.with_suffix(".py")
  return path, (arg or None)


def load_config(spec: str, overrides: Iterable[str] = ()) -> ml_collections.ConfigDict:
  """Loads `path.py[:arg]`, locks it and applies `key.sub=value` overrides."""
  path, arg = resolve_config_path(spec)
  module = _load_module(path)
  config = module.get_config(arg)
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f"{path}: get_config must return an ml_collections.ConfigDict")
  config.lock()
  apply_overrides(config, overrides)
  return config


CONFIG_KEYS_HELP = """config keys:
  The config file's docstring names its arguments (FILE.py:key=value,...) and gives the launch command.
  Any key of the config is set with --config.KEY=VALUE (e.g. {example}); unknown keys fail, naming them.
  --help-config prints the file's docstring and every key with its value, overrides applied."""


def config_parser(prog: str, description: str, config_help: str, example: str) -> argparse.ArgumentParser:
  """The parser of a command run from a config: --config FILE[:ARG], --help-config, and a --help that points to the
  config's keys (`example` is one override, as "--config.optim.lr=1e-4"); the command adds its own arguments."""
  parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False,
                                   epilog=CONFIG_KEYS_HELP.format(example=example),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True, help=config_help)
  parser.add_argument("--help-config", action="store_true",
                      help="print the config's docstring and its keys with their values, then exit")
  return parser


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str]
                      ) -> tuple[argparse.Namespace, ml_collections.ConfigDict | None]:
  """(the parsed arguments, the config with the --config.KEY=VALUE overrides applied), or (arguments, None) after
  --help-config printed the config. A bad config is a `ConfigError` (the CLI prints it in one line); an argument
  that is neither the parser's nor an override is a usage error."""
  argv = list(argv)
  if "--help-config" in argv:  # The command's other required arguments are not needed to show the config.
    shown = argparse.ArgumentParser(prog=parser.prog, add_help=False, allow_abbrev=False)
    shown.add_argument("--config")
    args, rest = shown.parse_known_args(argv)
    if not args.config:
      parser.error("--help-config needs --config FILE[:ARG]")
    config = load_config(args.config, [a for a in rest if a.startswith("--config.")])
    path, _ = resolve_config_path(args.config)
    print(f"{path}:\n{(_load_module(path).__doc__ or '(no docstring)').strip()}\n\nkeys (--config.KEY=VALUE):\n"
          f"{config}")
    return args, None
  args, rest = parser.parse_known_args(argv)
  unknown = [a for a in rest if not a.startswith("--config.")]
  if unknown:
    parser.error(f"unrecognised arguments {unknown}; config overrides look like --config.KEY=VALUE")
  return args, load_config(args.config, rest)


def apply_overrides(config: ml_collections.ConfigDict, overrides: Iterable[str]) -> None:
  for override in overrides:
    key, sep, value = override.partition("=")
    key = key.removeprefix("--").removeprefix("config.")
    if not sep:
      raise ConfigError(f"override {override!r} is not key=value")
    set_by_path(config, key, value)


def set_by_path(config: ml_collections.ConfigDict, dotted: str, text: str) -> None:
  """Sets config[a][b]... from text, with the existing field's type. Unknown keys raise."""
  *parents, leaf = dotted.split(".")
  node = config
  for i, part in enumerate(parents):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      raise ConfigError(f"unknown config key {'.'.join(parents[:i + 1])!r} (in override {dotted}={text})")
    node = node[part]
  if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
    known = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
    raise ConfigError(f"unknown config key {dotted!r}; keys here: {known}")
  field = node.get_ref(leaf) if isinstance(node._fields.get(leaf), config_dict.FieldReference) else None
  current = node[leaf]
  if field is not None and current is None:
    like = _placeholder_example(field.get_type())
  else:
    like = current
  value = None if text in ("None", "none") and (current is None or field is not None) else _coerce(text, like, dotted)
  try:
    node[leaf] = value
  except (TypeError, config_dict.MutabilityError) as error:
    raise ConfigError(f"config key {dotted!r}: {error}") from None


def _placeholder_example(field_type) -> Any:
  return {int: 0, float: 0.0, bool: False, str: ""}.get(field_type)


def to_json_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
  return config.to_dict()


def model_section(family: str, size: str, **fixed: Any) -> ml_collections.ConfigDict:
  """config.model: family, size and every ModelConfig field as a typed placeholder (None = preset value)."""
  import dataclasses
  import typing

  from bert_jax.models.config import ModelConfig

  hints = typing.get_type_hints(ModelConfig)
  section = ml_collections.ConfigDict({"family": family, "size": size})
  for field in dataclasses.fields(ModelConfig):
    hint = hints[field.name]
    # The field's type (int for `int | None`, tuple for `tuple[int, ...] | None`): a typed placeholder.
    base = next((typing.get_origin(t) or t for t in (hint, *typing.get_args(hint))
                 if (typing.get_origin(t) or t) in (bool, int, float, str, tuple)), None)
    if base is None:
      raise TypeError(f"ModelConfig.{field.name}: type {hint} has no config placeholder (bool, int, float, str, "
                      f"tuple or those | None)")
    section[field.name] = config_dict.placeholder(base)
  section.generator_fraction = 0.25  # ELECTRA: generator hidden size / discriminator hidden size.
  # MLM/SBO logits padded to a multiple of 128 (`ModelConfig.vocab_pad_multiple`; the parameters are unchanged):
  # GEMM-friendly widths make the output projection faster (docs/performance.md).
  section.vocab_pad_multiple = 128
  # bf16 compute, float32 parameters and optimizer state, as the pre-training recipes run on GPUs and TPUs
  # (`--config.model.dtype=float32` for float32 compute; the CPU demo sets it).
  section.dtype = "bfloat16"
  # Pre-training's last block at the heads' rows only (`ModelConfig.sparse_last_layer`; the same loss and
  # gradients to rounding).
  section.sparse_last_layer = True
  for key, value in fixed.items():
    if key not in section:
      raise ConfigError(f"unknown model field {key!r}")
    section[key] = value
  return section


def pretrain_defaults() -> ml_collections.ConfigDict:
  """Every key a pre-training config may set, with BERT-Base's recipe as defaults."""
  from bert_jax.data.masking import MaskingConfig
  from bert_jax.train import distill as distill_lib
  import dataclasses

  config = ml_collections.ConfigDict()
  config.seed = 0
  config.objective = "mlm+nsp"
  config.model = model_section("bert", "base")
  config.masking = ml_collections.ConfigDict(dataclasses.asdict(MaskingConfig()))
  config.data = ml_collections.ConfigDict(dict(
      prepared=config_dict.placeholder(str),  # directory written by `bert-jax prepare`
      builtin=False,                          # build the built-in stdlib-docs corpus in the workdir instead
      builtin_vocab_size=8000,
      eval_fraction=0.02,                     # held-out documents for the built-in corpus
      format="segment_pair",       # segment_pair | sentence_pair | sop | full_sentences | doc_sentences | single
      seq_len=128,
      short_seq_prob=0.1,
      random_next_prob=0.5,
      packing=False,
      max_packs=8,
      prefetch=4,                             # batches built ahead and put on the devices by a background thread
                                              # (at least 2 x train.steps_per_call)
      workers=config_dict.placeholder(int),   # batch-building processes; None: pipeline.default_workers() (cores)
  ))
  config.optim = ml_collections.ConfigDict(dict(
      name="adamw", lr=1e-4, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01, clip_norm=1.0,
      schedule="linear", warmup_steps=10_000, power=1.0, end_lr=0.0))
  config.train = ml_collections.ConfigDict(dict(
      batch_size=256, steps=1_000_000, accum_steps=1,
      steps_per_call=1,                       # steps in one jitted call: the host's cost of a call is paid once
                                              # per so many steps (small models); log_every, eval_every and
                                              # checkpoint_every must be multiples of it
      log_every=100, eval_every=10_000, eval_batches=20,
      eval_batch_size=config_dict.placeholder(int), checkpoint_every=10_000, keep_checkpoints=3,
      async_checkpoint=True, init_from=config_dict.placeholder(str), fill_mask=(),
      report_baseline=False,                  # at the end: held-out MLM accuracy beside a unigram baseline, loss PNG
      log_param_norms=False,                  # also param_norm and update_norm (they slow the update, see step.py)
      restart_if_unreadable=False))           # every checkpoint unreadable: start again from step 0 instead of stopping
  # Distillation from a teacher (off while distill.teacher is None; `bert_jax.train.distill`).
  config.distill = distill_lib.config_section(pretraining=True)
  config.loss = ml_collections.ConfigDict(dict(sentence_weight=1.0, sbo_weight=1.0, rtd_weight=50.0,
                                               generator_weight=1.0,
                                               rtd_positions="all"))  # all | masked (ELECTRA's "ELECTRA 15%")
  config.mesh = ml_collections.ConfigDict(dict(
      sizes=ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1)),
      rules=config_dict.placeholder(tuple)))
  return config


def finetune_defaults() -> ml_collections.ConfigDict:
  """Every key a fine-tuning config may set, with BERT's GLUE recipe as defaults.

  task            registry name ("glue/rte", "squad/v1.1", "swag", "conll2003").
  task_options    keyword options of the task (SQuAD doc_stride..., CoNLL
                  document_context); the config file fixes which exist.
  data_dir        where `Task.load` reads the splits (the GLUE root for GLUE), or
                  "tfds" / "tfds:TFDS_DATA_DIR" for TFDS `glue/*` (the `[tfds]` extra).
  init.model      Hugging Face or converted model directory, pre-training
                  workdir, or fine-tuning workdir (e.g. MNLI for RTE).
  init.layers     keep this many of its layers: its blocks 0, k, 2k, ... (k =
                  its layers / init.layers), a shallower student's start for
                  distillation; None: every layer.
  model.*         dtype, dropouts, kernels, remat (None: the model's own);
                  sparse_last_layer (the sentence-level heads' last block at
                  the pooled row alone, `ModelConfig.sparse_last_layer`);
                  fp8 (the blocks' dense layers in float8, `ModelConfig.fp8`;
                  False whatever the initial model trained with).
  max_len         longest row in tokens.
  pad_to_max_len  pad every row to max_len, not to the task's longest (rounded up to 8): the tasks of one kind
                  and label count then run the same compiled steps (a sweep's suite compiles them once).
  train_examples  train on this many examples of the train split, a fixed random subset (the same for every
                  seed, run and model); None: all of them.
  seeds           one training run per seed.
  optim.*         AdamW/LAMB, lr, weight decay, clipping, linear decay with
                  warmup_proportion of the steps, layerwise_lr_decay (1 = off).
  train.*         batch_size, epochs, accum_steps, eval_batch_size, eval_every
                  ("epoch", "end" or a step count), selection ("best" on the
                  task's selection metric, or "last"), early_stopping_patience
                  (evaluations without improvement; 0 = never stop early),
                  log_every, save_checkpoint, rng_impl (the PRNG of the step
                  key that the dropout key is drawn from, `losses.dropout_key`;
                  every choice is reproducible on one backend), steps_per_call
                  (k steps in one jitted call where no log or evaluation falls
                  inside it, as in pre-training: for small models whose steps
                  are shorter than the host's cost of a call).
  feature_based.* layers to concatenate from a frozen encoder (empty = full
                  fine-tuning), head ("bilstm" or "mlp"), head_size,
                  head_layers, dropout.
  top_bilstm      full fine-tuning with a randomly initialised BiLSTM between
                  the encoder and the task head (BERT Table 5's "+ BiLSTM").
  distill.*       task-specific distillation from a fine-tuned teacher (off
                  while distill.teacher is None): teacher, temperature, alpha
                  (the soft loss's weight; the labels' is 1 - alpha),
                  pkd_weight (BERT-PKD's [CLS] loss), cos_weight,
                  hidden_projection, TinyBERT's layer_map,
                  attention_weight, hidden_weight, embedding_weight and
                  prediction_weight (`bert_jax.train.distill`).
  quant.qat       Q8BERT's quantisation-aware training: every dense layer and embedding table fake-quantised
                  to int8 in the forward pass, as `bert-jax quantize` then runs them (straight-through
                  gradients; `bert_jax.models.quantization.qat_model`; the `quant` extra).
  mesh.*          mesh sizes and logical rules, as for pre-training.
  """
  from bert_jax.train import distill as distill_lib

  config = ml_collections.ConfigDict()
  config.task = "glue/rte"
  config.task_options = ml_collections.ConfigDict()
  config.data_dir = config_dict.placeholder(str)
  config.init = ml_collections.ConfigDict({"model": config_dict.placeholder(str),
                                           "layers": config_dict.placeholder(int)})
  config.model = ml_collections.ConfigDict({
      "dtype": config_dict.placeholder(str), "hidden_dropout": config_dict.placeholder(float),
      "attention_dropout": config_dict.placeholder(float), "kernels": config_dict.placeholder(str),
      "remat": config_dict.placeholder(str), "sparse_last_layer": True, "fp8": False})
  config.max_len = 128
  config.pad_to_max_len = False
  config.train_examples = config_dict.placeholder(int)
  config.seeds = (1, 2, 3)
  config.optim = ml_collections.ConfigDict(dict(
      name="adamw", lr=2e-5, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01, clip_norm=1.0, schedule="linear",
      power=1.0, end_lr=0.0, warmup_proportion=0.1, layerwise_lr_decay=1.0))
  config.train = ml_collections.ConfigDict(dict(
      batch_size=32, epochs=3, accum_steps=1, eval_batch_size=128, eval_every="epoch", selection="best",
      early_stopping_patience=0, log_every=50, save_checkpoint=True, rng_impl="rbg", log_param_norms=False,
      steps_per_call=1))
  config.feature_based = ml_collections.ConfigDict(dict(layers=(), head="bilstm", head_size=768, head_layers=2,
                                                        dropout=0.1))
  config.top_bilstm = False
  config.distill = distill_lib.config_section(pretraining=False)
  config.quant = ml_collections.ConfigDict(dict(qat=False))
  config.mesh = ml_collections.ConfigDict(dict(
      sizes=ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1)), rules=config_dict.placeholder(tuple)))
  return config


def check_qwix(key: str, off: str) -> None:
  """Raises the one-line error for a config whose `key` (set True) needs Qwix where it is not installed; `off` is
  how the key leaves it out ("False", "unset")."""
  if importlib.util.find_spec("qwix") is None:
    raise ValueError(f"{key}=True needs Qwix, which is not installed: pip install -e '.[quant]' (or leave {key} "
                     f"{off})")


def validate_batching(train: ml_collections.ConfigDict, data_parallel: int, process_count: int) -> None:
  """The batch sizes of `config.train` (pre-training and fine-tuning alike) against the mesh and the processes."""
  for key in ("batch_size", "eval_batch_size", "accum_steps", "steps_per_call"):
    value = train.get(key)
    if value is not None and (not isinstance(value, int) or value <= 0):
      raise ValueError(f"config.train.{key}={value!r} must be a positive integer")
  if train.batch_size % data_parallel or train.batch_size % process_count:
    raise ValueError(f"config.train.batch_size={train.batch_size} is not divisible by the data-parallel size "
                     f"{data_parallel} and the {process_count} processes; give a positive multiple of both")
  if train.eval_batch_size is not None and train.eval_batch_size % (data_parallel * process_count):
    raise ValueError(f"config.train.eval_batch_size={train.eval_batch_size} is not divisible by the data-parallel "
                     f"size {data_parallel} times the {process_count} processes")
  if train.batch_size % (train.accum_steps * data_parallel):
    raise ValueError(f"config.train.accum_steps={train.accum_steps}: batch_size {train.batch_size} must split "
                     f"into accum_steps micro-batches each divisible by the data-parallel size {data_parallel}")
