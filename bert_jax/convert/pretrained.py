"""Our directory format for converted models, and loading any model directory.

A directory written by `save_pretrained`:

  bert_jax_config.json   {"format_version": 1,
                          "family": "bert" | "roberta" | "albert" | "electra",
                          "model": "encoder" | "pretraining" | "electra",
                          "heads": e.g. ["mlm", "sentence"] (the model's heads),
                          "extra_params": e.g. ["pooler"] (trees kept beside the model),
                          "config": {every ModelConfig field},
                          "generator_config": {ModelConfig fields} or null,
                          "source": the Hugging Face architecture it came from, or null}
  params.safetensors     the params tree flattened with '/'-joined keys
                         ("encoder/block_0/attention/query/kernel"); extra
                         trees under "extras/<name>/..."
  tokenizer files        tokenizer.json, vocab.txt, spiece.model, ... as given

`load_pretrained` reads this format or a Hugging Face checkpoint directory;
`detect_format` is the one place that tells them apart (an Orbax training
workdir would be one more case there).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, NamedTuple

import safetensors.numpy

from bert_jax.convert.huggingface import (TOKENIZER_FILES, CheckpointError, copy_tokenizer_files, load_hf_checkpoint,
                                          read_hf_config, read_safetensors)
from bert_jax.convert.params import (EXTRA_MODULES, Params, build_model, flatten_params, model_kind, param_shapes,
                                     shape_problems, unflatten_params)
from bert_jax.models import ModelConfig
from bert_jax.models.config import FAMILIES

CONFIG_FILE = "bert_jax_config.json"
PARAMS_FILE = "params.safetensors"
FORMAT_VERSION = 1
FORMATS = ("bert_jax", "huggingface")
_EXTRAS_PREFIX = "extras/"
_HEADS = {"encoder": (), "pretraining": ("mlm", "sentence", "sbo"), "electra": ("generator_mlm", "rtd", "mlm", "copy")}


class Pretrained(NamedTuple):
  """A loaded model directory; unpacks as (family, config, params, tokenizer_path)."""

  family: str
  config: ModelConfig
  params: Params
  tokenizer_path: pathlib.Path | None


def detect_format(directory: str | pathlib.Path) -> str:
  """"bert_jax" (written by `save_pretrained`) or "huggingface" (config.json + weights)."""
  directory = pathlib.Path(directory)
  if (directory / CONFIG_FILE).exists():
    return "bert_jax"
  if (directory / "config.json").exists():
    return "huggingface"
  raise FileNotFoundError(f"{directory} is neither a bert_jax model directory ({CONFIG_FILE}) nor a Hugging Face "
                          "checkpoint (config.json)")


def find_tokenizer(directory: str | pathlib.Path) -> pathlib.Path | None:
  """`directory` when it holds tokenizer files, else None."""
  directory = pathlib.Path(directory)
  has_files = any((directory / name).exists() for name in TOKENIZER_FILES) or any(directory.glob("*.model"))
  return directory if has_files else None


def save_pretrained(out_dir: str | pathlib.Path, family: str, config: ModelConfig, params: Params,
                    tokenizer_dir: str | pathlib.Path | None = None, extras: dict[str, Any] | None = None
                    ) -> pathlib.Path:
  """Writes a model directory in our format (see the module docstring).

  Args:
    out_dir: destination (created).
    family: one of FAMILIES.
    config: our config (for ELECTRA trees the discriminator's).
    params: an "encoder", "pretraining" or "electra" tree.
    tokenizer_dir: a directory whose tokenizer files are copied along.
    extras: as returned by `load_hf_checkpoint`: "generator_config" (needed
      for ELECTRA trees), "pooler" / "rtd" trees, "architecture".

  Returns:
    `out_dir`.
  """
  if family not in FAMILIES:
    raise CheckpointError(f"unknown family {family!r}; expected one of {FAMILIES}")
  extras = extras or {}
  out_dir = pathlib.Path(out_dir)
  kind = model_kind(params)
  generator_config = extras.get("generator_config")
  problems = shape_problems(param_shapes(build_model(config, params, generator_config)), params)
  if problems:
    raise CheckpointError(f"params do not match the {kind} model of this config:\n  " + "\n  ".join(problems))
  extra_names = [name for name in EXTRA_MODULES if name in extras]
  flat = flatten_params(params)
  for name in extra_names:
    flat.update({f"{_EXTRAS_PREFIX}{name}/{key}": value for key, value in flatten_params(extras[name]).items()})
  description = {
      "format_version": FORMAT_VERSION, "family": family, "model": kind,
      "heads": [head for head in _HEADS[kind] if head in params], "extra_params": extra_names,
      "config": dataclasses.asdict(config),
      "generator_config": dataclasses.asdict(generator_config) if generator_config else None,
      "source": extras.get("architecture")}
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / CONFIG_FILE).write_text(json.dumps(description, indent=2) + "\n")
  safetensors.numpy.save_file(flat, out_dir / PARAMS_FILE)
  if tokenizer_dir is not None:
    copy_tokenizer_files(tokenizer_dir, out_dir)
  return out_dir


def _config_from_fields(fields: dict[str, Any], where: str) -> ModelConfig:
  known = {field.name for field in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise CheckpointError(f"{where}: unknown ModelConfig fields {unknown}")
  return ModelConfig(**fields)


def _load_ours(directory: pathlib.Path) -> tuple[str, ModelConfig, Params, dict[str, Any]]:
  description = json.loads((directory / CONFIG_FILE).read_text())
  where = str(directory / CONFIG_FILE)
  if description.get("format_version") != FORMAT_VERSION:
    raise CheckpointError(f"{where}: format_version {description.get('format_version')}, this code reads "
                     f"{FORMAT_VERSION}")
  family = description["family"]
  config = _config_from_fields(description["config"], where)
  extras: dict[str, Any] = {"architecture": description.get("source")}
  if description.get("generator_config"):
    extras["generator_config"] = _config_from_fields(description["generator_config"], where)
  flat = read_safetensors(directory / PARAMS_FILE)
  params = unflatten_params({key: value for key, value in flat.items() if not key.startswith(_EXTRAS_PREFIX)})
  extra_trees = unflatten_params({key[len(_EXTRAS_PREFIX):]: value for key, value in flat.items()
                                  if key.startswith(_EXTRAS_PREFIX)})
  problems = shape_problems(param_shapes(build_model(config, params, extras.get("generator_config"))), params)
  for name, tree in extra_trees.items():
    if name not in EXTRA_MODULES:
      problems.append(f"unexpected extra tree {name!r}")
      continue
    problems += [f"{name}: {problem}" for problem in shape_problems(param_shapes(EXTRA_MODULES[name](config)), tree)]
    extras[name] = tree
  if model_kind(params) != description["model"]:
    problems.append(f"params hold a {model_kind(params)} model, the config says {description['model']}")
  if problems:
    raise CheckpointError(f"{directory / PARAMS_FILE} does not match {where}:\n  " + "\n  ".join(problems))
  return family, config, params, extras


def load_pretrained(directory: str | pathlib.Path, *, return_extras: bool = False
                    ) -> Pretrained | tuple[Pretrained, dict[str, Any]]:
  """Loads a model directory of ours or a Hugging Face checkpoint directory.

  A Hugging Face ElectraForPreTraining directory with a `generator/`
  subdirectory (as `save_hf_checkpoint` writes) loads as an ELECTRA tree.

  Args:
    directory: the model directory.
    return_extras: also return the extras dict ("generator_config", needed to
      build an ElectraModel, "pooler", "rtd", "architecture").

  Returns:
    `Pretrained` (family, config, params, tokenizer_path), or
    (`Pretrained`, extras) when asked; tokenizer_path is None when the
    directory has no tokenizer files.
  """
  directory = pathlib.Path(directory)
  if detect_format(directory) == "bert_jax":
    family, config, params, extras = _load_ours(directory)
  else:
    generator_dir = directory / "generator"
    architecture = read_hf_config(directory)[0]
    use_generator = architecture == "ElectraForPreTraining" and (generator_dir / "config.json").exists()
    family, config, params, extras = load_hf_checkpoint(directory, generator_dir if use_generator else None)
  loaded = Pretrained(family, config, params, find_tokenizer(directory))
  return (loaded, extras) if return_extras else loaded
