"""Fill-mask: the top predictions of a model's MLM head at each [MASK].

  bert-jax fill-mask --model runs/demo "The capital of France is [MASK]."

`--model` is a pre-training run directory (its latest checkpoint) or a
converted/exported model directory.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bert_jax import paths
from bert_jax.data.tokenizers import Tokenizer, load_tokenizer
from bert_jax.models import ModelConfig, PretrainingModel


def mlm_params_from_run(params: dict[str, Any]) -> dict[str, Any]:
  """A run's params -> {"encoder", "mlm"} for PretrainingModel (ELECTRA: the generator)."""
  if "generator" in params:
    encoder = dict(params["generator"])
    encoder["embeddings"] = params["embeddings"]
    return {"encoder": encoder, "mlm": params["generator_mlm"]}
  if "mlm" not in params:
    raise ValueError("this model has no masked-LM head (a base-model checkpoint such as BertModel); fill-mask needs "
                     "one with MLM weights (ForMaskedLM / ForPreTraining, or a bert_jax pre-training run)")
  return {"encoder": params["encoder"], "mlm": params["mlm"]}


def load_run(workdir: str | pathlib.Path) -> tuple[ModelConfig, dict[str, Any], Tokenizer]:
  """Model config, MLM params and tokenizer of a pre-training run directory."""
  from bert_jax.models import electra_generator_config
  from bert_jax.train.checkpoint import read_run_config, restore_params

  workdir = paths.as_path(workdir)
  run_config = read_run_config(workdir)
  model_cfg = ModelConfig(**json.loads((workdir / "model_config.json").read_text()))
  _, params = restore_params(workdir)
  if "generator" in params:
    model_cfg = electra_generator_config(model_cfg, run_config["model"]["generator_fraction"])
  return model_cfg.replace(causal=False), mlm_params_from_run(params), load_tokenizer(workdir / "tokenizer")


def fill_mask(model_cfg: ModelConfig, params: dict[str, Any], tokenizer: Tokenizer, texts: Sequence[str],
              top_k: int = 5) -> list[list[list[tuple[str, float]]]]:
  """For each text, for each [MASK] in it: the top_k (token, probability) pairs."""
  ids_lists, _ = tokenizer.encode_batch(list(texts))
  results = []
  model = PretrainingModel(model_cfg.replace(hidden_dropout=0.0, attention_dropout=0.0), sentence_head=False)
  apply = jax.jit(lambda p, ids, positions: model.apply({"params": p}, ids, positions)["mlm_logits"])
  for ids in ids_lists:
    row = [tokenizer.cls_id] + list(ids)[: model_cfg.max_position_embeddings - 2] + [tokenizer.sep_id]
    positions = [i for i, t in enumerate(row) if t == tokenizer.mask_id]
    if not positions:
      results.append([])
      continue
    logits = apply(params, jnp.asarray([row], jnp.int32), jnp.asarray([positions], jnp.int32))[0]
    logits = logits[:, :model_cfg.vocab_size]  # without `vocab_pad_multiple`'s padding
    probs = np.asarray(jax.nn.softmax(logits.astype(jnp.float32), axis=-1))
    per_mask = []
    for p in probs:
      best = np.argsort(-p)[:top_k]
      per_mask.append(list(zip(tokenizer.convert_ids_to_tokens(best.tolist()), p[best].tolist())))
    results.append(per_mask)
  return results


def format_predictions(texts: Sequence[str], predictions) -> str:
  lines = []
  for text, per_mask in zip(texts, predictions):
    lines.append(text)
    for index, candidates in enumerate(per_mask):
      lines.append(f"  [MASK] #{index + 1}: " + ", ".join(f"{tok} ({p:.3f})" for tok, p in candidates))
  return "\n".join(lines)


def load_model(path: str | pathlib.Path) -> tuple[ModelConfig, dict[str, Any], Tokenizer]:
  """A run directory or a converted model directory -> (config, MLM params, tokenizer)."""
  path = paths.as_path(path)
  if (path / "checkpoints").is_dir():
    return load_run(path)
  from bert_jax.convert import pretrained  # noqa: PLC0415 - optional heavy import

  loaded = pretrained.load_pretrained(path)
  return loaded.config, mlm_params_from_run(loaded.params), load_tokenizer(loaded.tokenizer_path)


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="bert-jax fill-mask", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
  parser.add_argument("--model", required=True, help="run directory or converted model directory")
  parser.add_argument("--top-k", type=int, default=5)
  parser.add_argument("texts", nargs="+", help="sentences containing [MASK]")
  args = parser.parse_args(argv)
  missing = [text for text in args.texts if "[MASK]" not in text]
  if missing:
    raise ValueError(f"no [MASK] in {missing[0]!r}: write [MASK] where the model should fill in a word")
  model_cfg, params, tokenizer = load_model(args.model)
  mask_token = tokenizer.convert_ids_to_tokens([tokenizer.mask_id])[0]
  texts = [t.replace("[MASK]", mask_token) for t in args.texts]
  print(format_predictions(args.texts, fill_mask(model_cfg, params, tokenizer, texts, args.top_k)))
  return 0
