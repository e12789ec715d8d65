"""Hugging Face checkpoints <-> our parameter trees, for BERT, RoBERTa, ALBERT and ELECTRA.

Import (`load_hf_checkpoint`) reads `config.json` and `model.safetensors`
(sharded or not) or `pytorch_model.bin` (with `torch.load(weights_only=True)`:
no arbitrary object is ever unpickled), maps the config to a `ModelConfig`
and each tensor through the tables of `bert_jax.convert.mapping`, and checks
everything at once: missing, unexpected and mis-shaped tensors, tied decoder
weights that are not actually tied, and a tokenizer in the same directory
whose size differs from the config's vocab_size, are all listed in one error.

Architectures and the trees they give (see `bert_jax.convert.params`):

  BertModel, RobertaModel, AlbertModel, ElectraModel     "encoder"
      (+ extras["pooler"] when the checkpoint has a pooler)
  BertForPreTraining, AlbertForPreTraining               "pretraining" with the NSP/SOP head
  BertForMaskedLM, RobertaForMaskedLM, AlbertForMaskedLM "pretraining"; the sentence head is
      kept when the checkpoint has its weights (bert-base-uncased does)
  ElectraForMaskedLM (alone)                             "pretraining", no sentence head
  ElectraForPreTraining + ElectraForMaskedLM generator   "electra" (embeddings: the discriminator's)
  ElectraForPreTraining alone                            "encoder" + extras["rtd"]

`extras` is a dict with any of: "architecture" (the Hugging Face class
imported), "generator_config" (a `ModelConfig`; ELECTRA trees), "pooler" and
"rtd" (param trees of `heads.Pooler` / `heads.ReplacedTokenHead`).

Export (`save_hf_checkpoint`) is the inverse and writes what `transformers`
loads with the matching class (an ELECTRA tree writes the discriminator to
`out_dir` and the generator to `out_dir/generator`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import warnings
from typing import Any

import numpy as np
import safetensors.numpy
import sentencepiece
import tokenizers

from bert_jax.convert import mapping
from bert_jax.convert.params import EXTRA_MODULES, Params, build_model, model_kind, param_shapes
from bert_jax.models import ModelConfig

# Architecture -> (family, role). Roles: "base" (no head), "masked_lm",
# "pretraining" (MLM + sentence head), "discriminator" (ELECTRA RTD).
ARCHITECTURES = {
    "BertModel": ("bert", "base"), "BertForPreTraining": ("bert", "pretraining"),
    "BertForMaskedLM": ("bert", "masked_lm"),
    "RobertaModel": ("roberta", "base"), "RobertaForMaskedLM": ("roberta", "masked_lm"),
    "AlbertModel": ("albert", "base"), "AlbertForPreTraining": ("albert", "pretraining"),
    "AlbertForMaskedLM": ("albert", "masked_lm"),
    "ElectraModel": ("electra", "base"), "ElectraForPreTraining": ("electra", "discriminator"),
    "ElectraForMaskedLM": ("electra", "masked_lm"),
}
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
OUR_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
# Tensor names of heads; every other name sits under the base model ("bert.", ...).
HEAD_PREFIXES = ("cls.", "lm_head.", "predictions.", "sop_classifier.", "discriminator_predictions.",
                 "generator_predictions.", "generator_lm_head.")
# Buffers that some checkpoints persist; they hold no parameters.
BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt", "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
                   "bert_jax_tokenizer.json")
# Hugging Face config defaults for keys a config.json may leave out.
_HF_DEFAULTS = {
    "bert": dict(hidden_act="gelu", max_position_embeddings=512, type_vocab_size=2, pad_token_id=0,
                 layer_norm_eps=1e-12, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                 initializer_range=0.02),
    "albert": dict(hidden_act="gelu_new", embedding_size=128, num_hidden_groups=1, inner_group_num=1,
                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "electra": dict(embedding_size=128),
    "roberta": dict(pad_token_id=1),
}


class CheckpointError(ValueError):
  """A checkpoint that cannot be converted; the message lists every problem found."""


# ----------------------------------------------------------------------------- config


def _hf_value(hf_config: dict[str, Any], family: str, key: str) -> Any:
  if key in hf_config:
    return hf_config[key]
  for defaults in (_HF_DEFAULTS.get(family, {}), _HF_DEFAULTS["bert"]):
    if key in defaults:
      return defaults[key]
  raise CheckpointError(f"config.json lacks {key!r}")


def config_from_hf(hf_config: dict[str, Any], family: str) -> ModelConfig:
  """Maps a Hugging Face config.json dict of `family` to our `ModelConfig`."""
  get = lambda key: _hf_value(hf_config, family, key)  # noqa: E731
  if get("hidden_act") not in HF_ACTIVATIONS:
    raise CheckpointError(f"hidden_act={get('hidden_act')!r} is not supported; expected one of "
                          f"{sorted(HF_ACTIVATIONS)}")
  position_type = hf_config.get("position_embedding_type") or "absolute"
  if position_type != "absolute":
    raise CheckpointError(f"position_embedding_type={position_type!r}: only 'absolute' is supported")
  fields = dict(vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), num_layers=get("num_hidden_layers"),
                num_heads=get("num_attention_heads"), intermediate_size=get("intermediate_size"),
                max_position_embeddings=get("max_position_embeddings"), type_vocab_size=get("type_vocab_size"),
                pad_token_id=get("pad_token_id"), hidden_act=HF_ACTIVATIONS[get("hidden_act")],
                layer_norm_eps=get("layer_norm_eps"), hidden_dropout=get("hidden_dropout_prob"),
                attention_dropout=get("attention_probs_dropout_prob"), initializer_range=get("initializer_range"))
  if family == "roberta":
    fields["position_offset"] = fields["pad_token_id"] + 1
  if family == "albert":
    if get("inner_group_num") != 1:
      raise CheckpointError(f"ALBERT inner_group_num={get('inner_group_num')}: only 1 layer per group is "
                            "supported")
    if get("num_hidden_layers") % get("num_hidden_groups"):
      raise CheckpointError(f"ALBERT num_hidden_groups={get('num_hidden_groups')} must divide "
                            f"num_hidden_layers={get('num_hidden_layers')}")
    if get("embedding_size") == get("hidden_size"):
      raise CheckpointError("ALBERT with embedding_size == hidden_size is not supported (its E -> H mapping "
                            "has no counterpart in our encoder)")
    fields.update(num_shared_groups=get("num_hidden_groups"), embedding_size=get("embedding_size"))
  if family == "electra" and get("embedding_size") != get("hidden_size"):
    fields["embedding_size"] = get("embedding_size")
  return ModelConfig(**fields)


def config_to_hf(family: str, config: ModelConfig, architecture: str) -> dict[str, Any]:
  """Our `ModelConfig` -> a Hugging Face config.json dict for `architecture`."""
  unsupported = {"norm": "post", "ffn": "dense", "position_embedding": "learned", "causal": False}
  bad = [f"{field}={getattr(config, field)!r}" for field, value in unsupported.items()
         if getattr(config, field) != value]
  expected_offset = config.pad_token_id + 1 if family == "roberta" else 0
  if config.position_offset != expected_offset:
    bad.append(f"position_offset={config.position_offset} (a {family} checkpoint implies {expected_offset})")
  if family == "albert" and config.embed_dim == config.hidden_size:
    bad.append("ALBERT with embedding_size == hidden_size")
  if config.shared_sublayers != "all":
    bad.append(f"shared_sublayers={config.shared_sublayers!r} (Hugging Face shares whole layers only)")
  if bad:
    raise CheckpointError(f"cannot export to Hugging Face {architecture}: {', '.join(bad)}")
  hf_config = dict(
      architectures=[architecture], model_type=family, vocab_size=config.vocab_size,
      hidden_size=config.hidden_size, num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
      intermediate_size=config.intermediate_size, hidden_act=OUR_ACTIVATIONS[config.hidden_act],
      hidden_dropout_prob=config.hidden_dropout, attention_probs_dropout_prob=config.attention_dropout,
      max_position_embeddings=config.max_position_embeddings, type_vocab_size=config.type_vocab_size,
      initializer_range=config.initializer_range, layer_norm_eps=config.layer_norm_eps,
      pad_token_id=config.pad_token_id, position_embedding_type="absolute", tie_word_embeddings=True)
  if family == "albert":
    hf_config.update(embedding_size=config.embed_dim, num_hidden_groups=config.num_shared_groups or config.num_layers,
                     inner_group_num=1, classifier_dropout_prob=config.hidden_dropout)
  if family == "electra":
    hf_config["embedding_size"] = config.embed_dim
  return hf_config


def _check_head_activation(family: str, config: ModelConfig, has_mlm: bool) -> None:
  # RoBERTa's LM head and ELECTRA's generator head apply GELU whatever
  # hidden_act says; our MLM head applies hidden_act.
  if has_mlm and family in ("roberta", "electra") and config.hidden_act != "gelu":
    raise CheckpointError(f"{family} MLM heads use GELU in Hugging Face, but hidden_act={config.hidden_act!r}")


# ----------------------------------------------------------------------------- files


def read_hf_config(directory: pathlib.Path) -> tuple[str, str, dict[str, Any]]:
  """Returns (architecture, family, config dict) of a Hugging Face checkpoint directory."""
  config_file = directory / "config.json"
  if not config_file.exists():
    raise CheckpointError(f"{directory} has no config.json")
  hf_config = json.loads(config_file.read_text())
  architectures = hf_config.get("architectures") or []
  known = [name for name in architectures if name in ARCHITECTURES]
  if not known:
    raise CheckpointError(f"{config_file}: unknown architecture {architectures or hf_config.get('model_type')}; "
                          f"supported: {', '.join(ARCHITECTURES)}")
  return known[0], ARCHITECTURES[known[0]][0], hf_config


def _as_float32(array: np.ndarray) -> np.ndarray:
  return array.astype(np.float32) if np.issubdtype(array.dtype, np.floating) or array.dtype.kind == "V" else array


def read_state_dict(directory: pathlib.Path) -> dict[str, np.ndarray]:
  """Tensors of a checkpoint directory as numpy (floats as float32), by their Hugging Face names.

  Reads model.safetensors, a sharded model.safetensors.index.json, or
  pytorch_model.bin through `torch.load(weights_only=True)`.
  """
  index_file = directory / "model.safetensors.index.json"
  if (directory / "model.safetensors").exists():
    files = [directory / "model.safetensors"]
  elif index_file.exists():
    files = [directory / name for name in sorted(set(json.loads(index_file.read_text())["weight_map"].values()))]
  elif (directory / "pytorch_model.bin").exists():
    return _read_torch_bin(directory / "pytorch_model.bin")
  else:
    raise CheckpointError(f"{directory} has none of model.safetensors, model.safetensors.index.json, "
                          "pytorch_model.bin")
  tensors = {}
  for file in files:
    tensors.update({name: _as_float32(array) for name, array in read_safetensors(file).items()})
  return tensors


def read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
  """The tensors of one safetensors file; a truncated or damaged file raises a CheckpointError naming it."""
  try:
    return safetensors.numpy.load_file(path)
  except safetensors.SafetensorError as error:
    raise CheckpointError(f"{path} is truncated or not a safetensors file ({error}); download or convert the "
                          f"checkpoint again") from None


def _read_torch_bin(path: pathlib.Path) -> dict[str, np.ndarray]:
  import pickle  # pylint: disable=g-import-not-at-top

  import torch  # pylint: disable=g-import-not-at-top  (torch is the optional [hf] extra)
  try:
    state = torch.load(path, map_location="cpu", weights_only=True)
  except pickle.UnpicklingError as error:
    raise CheckpointError(f"{path} holds objects other than tensors; refusing to unpickle them "
                          f"(torch.load weights_only=True): {error}") from error
  if not isinstance(state, dict) or not all(isinstance(value, torch.Tensor) for value in state.values()):
    raise CheckpointError(f"{path} is not a flat state dict of tensors")
  return {name: tensor.float().numpy() if tensor.is_floating_point() else tensor.numpy()
          for name, tensor in state.items()}


def tokenizer_vocab_sizes(directory: pathlib.Path) -> dict[str, int]:
  """Vocabulary size of each tokenizer file in `directory`, by file name."""
  sizes = {}
  if (directory / "tokenizer.json").exists():
    tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    sizes["tokenizer.json"] = tokenizer.get_vocab_size(with_added_tokens=True)
  if (directory / "vocab.txt").exists():
    sizes["vocab.txt"] = len((directory / "vocab.txt").read_text(encoding="utf-8").splitlines())
  if (directory / "vocab.json").exists():
    sizes["vocab.json"] = len(json.loads((directory / "vocab.json").read_text(encoding="utf-8")))
  for model_file in sorted(directory.glob("*.model")):
    sizes[model_file.name] = sentencepiece.SentencePieceProcessor(model_file=str(model_file)).get_piece_size()
  return sizes


def _check_vocab(directory: pathlib.Path, config: ModelConfig) -> None:
  wrong = {name: size for name, size in tokenizer_vocab_sizes(directory).items() if size != config.vocab_size}
  if wrong:
    described = ", ".join(f"{name} has {size}" for name, size in wrong.items())
    raise CheckpointError(f"{directory}: config.json vocab_size={config.vocab_size} but {described} tokens")


def copy_tokenizer_files(source: str | pathlib.Path, destination: pathlib.Path) -> list[str]:
  """Copies the tokenizer files found in `source` into `destination`; returns their names."""
  source = pathlib.Path(source)
  names = [name for name in TOKENIZER_FILES if (source / name).exists()]
  names += [path.name for path in sorted(source.glob("*.model")) if path.name not in names]
  if not names:
    raise CheckpointError(f"{source} holds no tokenizer file ({', '.join(TOKENIZER_FILES)})")
  destination.mkdir(parents=True, exist_ok=True)
  for name in names:
    shutil.copyfile(source / name, destination / name)
  return names


# ----------------------------------------------------------------------------- tables per checkpoint


@dataclasses.dataclass(frozen=True)
class _Layout:
  """What one Hugging Face checkpoint file holds and where it goes: rules and tied tensors.

  Rule paths start with the tree they fill: "model" (the main tree) or an
  EXTRA_MODULES name.
  """

  rules: list[mapping.Rule]
  tied: list[mapping.Tied]
  ignored: list[str] = dataclasses.field(default_factory=list)  # accepted, not used


def _file_layout(family: str, role: str, config: ModelConfig, *, sentence: bool = False, pooler: bool = False,
                 electra_part: str | None = None) -> _Layout:
  """The layout of one checkpoint file.

  Args:
    family, role: from ARCHITECTURES.
    config: the model of this file.
    sentence: the NSP/SOP head is present (pretraining roles).
    pooler: a pooler outside a sentence head is present.
    electra_part: "discriminator" or "generator" for the two files of one
      "electra" tree; None for a file that makes a tree by itself.
  """
  if electra_part == "discriminator":
    return _Layout(mapping.embedding_rules(("model", "embeddings"))
                   + mapping.encoder_body_rules(family, config, ("model", "discriminator"))
                   + mapping.rtd_rules(("model", "rtd")), [])
  if electra_part == "generator":
    mlm, tied = mapping.mlm_rules(family, ("model", "generator_mlm"))
    # The generator's own embeddings are read but not used: the tree shares the discriminator's.
    return _Layout(mapping.encoder_body_rules(family, config, ("model", "generator")) + mlm, tied,
                   [rule.hf_name for rule in mapping.embedding_rules(())])
  if role in ("base", "discriminator"):
    rules = mapping.encoder_rules(family, config, ("model",))
    if role == "discriminator":
      rules += mapping.rtd_rules(("rtd",))
    if pooler:
      rules += mapping.pooler_rules(family, ("pooler",))
    return _Layout(rules, [])
  rules = mapping.encoder_rules(family, config, ("model", "encoder"))
  mlm, tied = mapping.mlm_rules(family, ("model", "mlm"))
  rules += mlm
  if sentence:
    rules += mapping.sentence_rules(family, ("model", "sentence"))
  elif pooler:
    rules += mapping.pooler_rules(family, ("pooler",))
  return _Layout(rules, tied)


def _has_any(names: set[str], rules: list[mapping.Rule]) -> bool:
  return any(rule.hf_name in names for rule in rules)


def _canonical(name: str, family: str) -> str:
  name = name.removeprefix(f"{family}.")
  # Checkpoints converted from TensorFlow long ago name LayerNorm parameters gamma/beta.
  if name.endswith(".gamma"):
    name = name[:-len("gamma")] + "weight"
  elif name.endswith(".beta"):
    name = name[:-len("beta")] + "bias"
  return name


def _hf_name(name: str, family: str, role: str) -> str:
  """Canonical -> stored name; base models are saved without the "bert." prefix, as transformers does."""
  return name if role == "base" or name.startswith(HEAD_PREFIXES) else f"{family}.{name}"


def _get(tree: Params, path: tuple[str, ...]) -> Any:
  for key in path:
    tree = tree[key]
  return tree


def _set(tree: Params, path: tuple[str, ...], value: Any) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _apply_layout(tensors: dict[str, np.ndarray], layout: _Layout, shapes: Params, label: str,
                  out: Params) -> list[str]:
  """Converts `tensors` into `out` by `layout`; returns the problems found (none converted then)."""
  problems = []
  for rule in layout.rules:
    if rule.hf_name not in tensors:
      problems.append(f"{label}: missing tensor {rule.hf_name}")
      continue
    want = mapping.hf_shape(rule.layout, _get(shapes, rule.path))
    got = tensors[rule.hf_name].shape
    if tuple(got) != want:
      problems.append(f"{label}: tensor {rule.hf_name} has shape {tuple(got)}, expected {want}")
    elif not problems:
      _set(out, rule.path, np.ascontiguousarray(mapping.to_ours(rule.layout, tensors[rule.hf_name],
                                                                _get(shapes, rule.path))))
  for tied in layout.tied:
    if tied.hf_name in tensors and tied.source in tensors and not np.array_equal(tensors[tied.hf_name],
                                                                                 tensors[tied.source]):
      problems.append(f"{label}: {tied.hf_name} is not tied to {tied.source} (untied decoders are not supported)")
  known = {rule.hf_name for rule in layout.rules} | {tied.hf_name for tied in layout.tied}
  known |= set(layout.ignored) | set(BUFFERS)
  problems += [f"{label}: unexpected tensor {name}" for name in sorted(tensors.keys() - known)]
  return problems


# ----------------------------------------------------------------------------- import


def _read_checkpoint(directory: pathlib.Path) -> tuple[str, str, str, ModelConfig, dict[str, np.ndarray]]:
  architecture, family, hf_config = read_hf_config(directory)
  config = config_from_hf(hf_config, family)
  _check_vocab(directory, config)
  tensors = {_canonical(name, family): array for name, array in read_state_dict(directory).items()}
  return architecture, family, ARCHITECTURES[architecture][1], config, tensors


def load_hf_checkpoint(directory: str | pathlib.Path, generator_dir: str | pathlib.Path | None = None
                       ) -> tuple[str, ModelConfig, Params, dict[str, Any]]:
  """Imports a Hugging Face checkpoint directory.

  Args:
    directory: holds config.json and model.safetensors (or pytorch_model.bin).
    generator_dir: ELECTRA only: the ElectraForMaskedLM generator that goes
      with an ElectraForPreTraining discriminator in `directory`.

  Returns:
    (family, config, params, extras): the family name, our `ModelConfig`, the
    params tree (numpy float32; see `bert_jax.convert.params` for its kinds)
    and the extras described in the module docstring.

  Raises:
    CheckpointError: unknown architecture, unsupported config, vocabulary
      size mismatch, or tensors missing / unexpected / mis-shaped / wrongly
      tied (all of them listed).
  """
  directory = pathlib.Path(directory)
  architecture, family, role, config, tensors = _read_checkpoint(directory)
  names = set(tensors)
  extras: dict[str, Any] = {"architecture": architecture}
  sources = [(directory, tensors)]
  if generator_dir is not None:
    if role != "discriminator":
      raise CheckpointError(f"a generator directory goes with an ElectraForPreTraining discriminator, "
                            f"not with {architecture}")
    gen_architecture, _, _, gen_config, gen_tensors = _read_checkpoint(pathlib.Path(generator_dir))
    if gen_architecture != "ElectraForMaskedLM":
      raise CheckpointError(f"{generator_dir}: the generator must be an ElectraForMaskedLM, not {gen_architecture}")
    _check_head_activation(family, gen_config, has_mlm=True)
    layouts = [_file_layout(family, role, config, electra_part="discriminator"),
               _file_layout(family, "masked_lm", gen_config, electra_part="generator")]
    sources.append((pathlib.Path(generator_dir), gen_tensors))
    extras["generator_config"] = gen_config
  else:
    # A ForMaskedLM checkpoint keeps its NSP/SOP head when it has one (bert-base-uncased does).
    classifier = mapping.SENTENCE_CLASSIFIERS.get(family)
    sentence = role == "pretraining" or (classifier is not None and f"{classifier}.weight" in names)
    pooler = family != "electra" and not sentence and _has_any(names, mapping.pooler_rules(family, ()))
    _check_head_activation(family, config, has_mlm=role in ("pretraining", "masked_lm"))
    layouts = [_file_layout(family, role, config, sentence=sentence, pooler=pooler)]

  shapes = {"model": param_shapes(build_model(config, _skeleton(layouts), extras.get("generator_config")))}
  shapes.update({name: param_shapes(module(config)) for name, module in EXTRA_MODULES.items()})
  out: Params = {}
  problems = []
  for (source_dir, source_tensors), layout in zip(sources, layouts):
    problems += _apply_layout(source_tensors, layout, shapes, str(source_dir), out)
  if problems:
    raise CheckpointError(f"cannot convert {architecture} checkpoint:\n  " + "\n  ".join(problems))
  if len(sources) == 2:
    _warn_if_embeddings_differ(tensors, sources[1][1], sources[1][0])
  params = out.pop("model")
  extras.update(out)
  return family, config, params, extras


def _skeleton(layouts: list[_Layout]) -> Params:
  """The top-level keys of the main tree that `layouts` fill (enough for `build_model`)."""
  return {rule.path[1]: {} for layout in layouts for rule in layout.rules if rule.path[0] == "model"}


def _warn_if_embeddings_differ(discriminator: dict[str, np.ndarray], generator: dict[str, np.ndarray],
                               generator_dir: pathlib.Path) -> None:
  differing = [rule.hf_name for rule in mapping.embedding_rules(())
               if rule.hf_name in generator and not np.array_equal(generator[rule.hf_name],
                                                                   discriminator[rule.hf_name])]
  if differing:
    warnings.warn(f"{generator_dir}: generator embeddings {differing} differ from the discriminator's; "
                  "the ELECTRA tree shares the discriminator's", stacklevel=3)


# ----------------------------------------------------------------------------- export


def _architecture_for(family: str, kind: str, params: Params, extras: dict[str, Any]) -> tuple[str, str]:
  """(Hugging Face architecture, role) that represents a tree of `kind`."""
  title = {"bert": "Bert", "roberta": "Roberta", "albert": "Albert", "electra": "Electra"}[family]
  if kind == "encoder":
    if family == "electra" and "rtd" in extras:
      return "ElectraForPreTraining", "discriminator"
    return f"{title}Model", "base"
  if kind == "electra":
    if "rtd" not in params:
      raise CheckpointError("cannot export to Hugging Face an ELECTRA tree trained with replace_mlm or "
                            "all_tokens_mlm: its discriminator has an MLM head, which ElectraForPreTraining lacks")
    return "ElectraForPreTraining", "discriminator"
  if "sentence" in params:
    if family not in ("bert", "albert"):
      raise CheckpointError(f"{family} has no sentence head in Hugging Face")
    return f"{title}ForPreTraining", "pretraining"
  return f"{title}ForMaskedLM", "masked_lm"


def _export_tensors(layout: _Layout, trees: Params, family: str, role: str, label: str) -> dict[str, np.ndarray]:
  tensors, missing = {}, []
  for rule in layout.rules:
    try:
      leaf = _get(trees, rule.path)
    except KeyError:
      missing.append("/".join(rule.path))
      continue
    tensors[_hf_name(rule.hf_name, family, role)] = np.ascontiguousarray(
        mapping.to_hf(rule.layout, np.asarray(leaf, np.float32)))
  if missing:
    raise CheckpointError(f"{label}: params lack {missing}")
  return tensors


def _write(out_dir: pathlib.Path, hf_config: dict[str, Any], tensors: dict[str, np.ndarray],
           tokenizer_dir: str | pathlib.Path | None) -> None:
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
  safetensors.numpy.save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
  if tokenizer_dir is not None:
    copy_tokenizer_files(tokenizer_dir, out_dir)


def _leaf_paths(tree: Params, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
  paths = set()
  for key, value in tree.items():
    paths |= _leaf_paths(value, prefix + (key,)) if isinstance(value, dict) else {prefix + (key,)}
  return paths


def save_hf_checkpoint(family: str, config: ModelConfig, params: Params, out_dir: str | pathlib.Path, *,
                       extras: dict[str, Any] | None = None, tokenizer_dir: str | pathlib.Path | None = None
                       ) -> list[pathlib.Path]:
  """Writes config.json + model.safetensors that `transformers` loads with the same outputs.

  Args:
    family: "bert", "roberta", "albert" or "electra".
    config: our config of `params` (for ELECTRA trees: the discriminator's).
    params: an "encoder", "pretraining" or "electra" tree.
    out_dir: destination; an ELECTRA tree also writes `out_dir/generator`.
    extras: "pooler" and "rtd" trees to export beside an encoder tree;
      "generator_config" for an ELECTRA tree.
    tokenizer_dir: a directory whose tokenizer files are copied along.

  Returns:
    The directories written (discriminator first for ELECTRA).

  Raises:
    CheckpointError: the config has options Hugging Face models lack (pre-LN,
      GLU, rotary, causal), or the tree has parameters no tensor takes (e.g. a
      span-boundary head).
  """
  extras = extras or {}
  out_dir = pathlib.Path(out_dir)
  kind = model_kind(params)
  architecture, role = _architecture_for(family, kind, params, extras)
  trees = {"model": params, **{name: extras[name] for name in EXTRA_MODULES if name in extras}}
  _check_head_activation(family, config, has_mlm=kind == "pretraining")
  if kind == "electra":
    generator_config = extras.get("generator_config")
    if generator_config is None:
      raise CheckpointError("exporting an ELECTRA tree needs extras['generator_config']")
    _check_head_activation(family, generator_config, has_mlm=True)
    layouts = [_file_layout(family, role, config, electra_part="discriminator"),
               _file_layout(family, "masked_lm", generator_config, electra_part="generator")]
    generator_layout = dataclasses.replace(
        layouts[1], rules=layouts[1].rules + mapping.embedding_rules(("model", "embeddings")))
    written = [(out_dir, config_to_hf(family, config, architecture), layouts[0], role),
               (out_dir / "generator", config_to_hf(family, generator_config, "ElectraForMaskedLM"),
                generator_layout, "masked_lm")]
  else:
    layouts = [_file_layout(family, role, config, sentence="sentence" in params, pooler="pooler" in trees)]
    written = [(out_dir, config_to_hf(family, config, architecture), layouts[0], role)]
  covered = {rule.path for layout in layouts for rule in layout.rules}
  uncovered = sorted("/".join(path) for path in _leaf_paths(trees) - covered)
  if uncovered:
    raise CheckpointError(f"no Hugging Face {architecture} tensor takes these parameters: {uncovered}")
  for directory, hf_config, layout, file_role in written:
    _write(directory, hf_config, _export_tensors(layout, trees, family, file_role, str(directory)), tokenizer_dir)
  return [directory for directory, *_ in written]
