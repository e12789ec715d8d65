"""Name and layout tables between Hugging Face state dicts and our parameter trees.

Every converted tensor is one `Rule`: a Hugging Face tensor name (canonical:
the base-model prefix such as "bert." removed), the path of the matching leaf
in our tree, and a layout that says how the array is rearranged:

  layout        Hugging Face             ours
  ------------  -----------------------  --------------------------------------
  copy          same shape               same shape (embeddings, LayerNorm,
                                         dense biases, MLM output bias)
  linear        weight [out, in]         Dense kernel [in, out]
  heads_in      q/k/v weight [H, E]      DenseGeneral kernel [E, heads, head]
  heads_bias    q/k/v bias [H]           DenseGeneral bias [heads, head]
  heads_out     output weight [E, H]     DenseGeneral kernel [heads, head, E]

The tables, per family (i = layer, g = ALBERT parameter group; our paths are
relative to the `Encoder`):

  Hugging Face (canonical)                          ours
  embeddings.word_embeddings.weight                 embeddings/word_embeddings/embedding
  embeddings.position_embeddings.weight             embeddings/position_embeddings/embedding
  embeddings.token_type_embeddings.weight           embeddings/token_type_embeddings/embedding
  embeddings.LayerNorm                              embeddings/norm
  BERT, RoBERTa, ELECTRA block i:
    encoder.layer.i.attention.self.{query,key,value}  block_i/attention/{query,key,value}
    encoder.layer.i.attention.output.dense            block_i/attention/output
    encoder.layer.i.attention.output.LayerNorm        block_i/attention_norm
    encoder.layer.i.intermediate.dense                block_i/ffn/wi
    encoder.layer.i.output.dense                      block_i/ffn/wo
    encoder.layer.i.output.LayerNorm                  block_i/ffn_norm
  ALBERT group g (inner_group_num = 1), prefix encoder.albert_layer_groups.g.albert_layers.0:
    attention.{query,key,value}                       block_g/attention/{query,key,value}
    attention.dense / attention.LayerNorm             block_g/attention/output / attention_norm
    ffn / ffn_output / full_layer_layer_norm          block_g/ffn/wi / ffn/wo / ffn_norm
  E -> H projection: ALBERT encoder.embedding_hidden_mapping_in, ELECTRA
    embeddings_project                              embedding_projection

Heads (paths relative to `PretrainingModel` / `ElectraModel`):

  BERT     cls.predictions.transform.{dense,LayerNorm}, cls.predictions.bias
                                                    mlm/predictions/{transform,transform_norm,output_bias}
           pooler.dense, cls.seq_relationship        sentence/pooler/dense, sentence/classifier
  RoBERTa  lm_head.{dense,layer_norm,bias}           mlm/predictions/{transform,transform_norm,output_bias}
  ALBERT   predictions.{dense,LayerNorm,bias}        mlm/predictions/{transform,transform_norm,output_bias}
           pooler, sop_classifier.classifier         sentence/pooler/dense, sentence/classifier
  ELECTRA  discriminator_predictions.{dense,dense_prediction}
                                                    rtd/{dense,prediction}
           generator_predictions.{dense,LayerNorm}, generator_lm_head.bias
                                                    generator_mlm/predictions/{transform,transform_norm,output_bias}

A base model's pooler (BERT/RoBERTa pooler.dense, ALBERT pooler) has no place
in the `Encoder` tree; it is kept as the extra tree "pooler" ({"dense": ...},
the layout of `heads.Pooler`). Decoder weights tied to the word embeddings
(and decoder biases tied to the head bias) are `Tied`: not stored by us,
checked for equality on import, left out on export.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from bert_jax.models.config import ModelConfig

Path = tuple[str, ...]
LAYOUTS = ("copy", "linear", "heads_in", "heads_bias", "heads_out")
# The 2-way classifier of the families that have a sentence head (NSP / SOP).
SENTENCE_CLASSIFIERS = {"bert": "cls.seq_relationship", "albert": "sop_classifier.classifier"}


@dataclasses.dataclass(frozen=True)
class Rule:
  """One tensor: Hugging Face name <-> leaf path in our tree, and the layout between them."""

  hf_name: str
  path: Path
  layout: str = "copy"


@dataclasses.dataclass(frozen=True)
class Tied:
  """A Hugging Face tensor that duplicates another one (tied decoder weights)."""

  hf_name: str
  source: str


def to_ours(layout: str, array: np.ndarray, our_shape: tuple[int, ...]) -> np.ndarray:
  """Rearranges a Hugging Face array into our layout (`our_shape` fixes the head split)."""
  if layout == "copy":
    return array
  if layout == "linear":
    return array.T
  if layout in ("heads_in", "heads_out"):
    return array.T.reshape(our_shape)
  if layout == "heads_bias":
    return array.reshape(our_shape)
  raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def to_hf(layout: str, array: np.ndarray) -> np.ndarray:
  """Inverse of `to_ours`."""
  if layout == "copy":
    return array
  if layout == "linear":
    return array.T
  if layout == "heads_in":
    return array.reshape(array.shape[0], -1).T
  if layout == "heads_out":
    return array.reshape(-1, array.shape[-1]).T
  if layout == "heads_bias":
    return array.reshape(-1)
  raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def hf_shape(layout: str, our_shape: tuple[int, ...]) -> tuple[int, ...]:
  """The Hugging Face shape of a tensor whose leaf in our tree has `our_shape`."""
  if layout == "copy":
    return tuple(our_shape)
  if layout == "linear":
    return tuple(reversed(our_shape))
  if layout == "heads_in":
    return (math.prod(our_shape[1:]), our_shape[0])
  if layout == "heads_out":
    return (our_shape[-1], math.prod(our_shape[:-1]))
  if layout == "heads_bias":
    return (math.prod(our_shape),)
  raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def _linear(hf_name: str, path: Path, layout: str = "linear") -> list[Rule]:
  bias_layout = "heads_bias" if layout == "heads_in" else "copy"
  return [Rule(f"{hf_name}.weight", path + ("kernel",), layout), Rule(f"{hf_name}.bias", path + ("bias",), bias_layout)]


def _norm(hf_name: str, path: Path) -> list[Rule]:
  return [Rule(f"{hf_name}.weight", path + ("scale",)), Rule(f"{hf_name}.bias", path + ("bias",))]


def embedding_rules(path: Path) -> list[Rule]:
  """Word/position/token-type tables and their LayerNorm, under `path` (an `Embeddings`)."""
  tables = [Rule(f"embeddings.{table}.weight", path + (table, "embedding"))
            for table in ("word_embeddings", "position_embeddings", "token_type_embeddings")]
  return tables + _norm("embeddings.LayerNorm", path + ("norm",))


# Hugging Face's name of each part of one transformer block, relative to the block's prefix, per naming scheme
# (BERT, RoBERTa and ELECTRA share BERT's).
_BLOCK_NAMES = {
    "bert": {"qkv": "attention.self", "attention_output": "attention.output.dense",
             "attention_norm": "attention.output.LayerNorm", "wi": "intermediate.dense", "wo": "output.dense",
             "ffn_norm": "output.LayerNorm"},
    "albert": {"qkv": "attention", "attention_output": "attention.dense", "attention_norm": "attention.LayerNorm",
               "wi": "ffn", "wo": "ffn_output", "ffn_norm": "full_layer_layer_norm"},
}


def _block_rules(scheme: str, hf: str, path: Path) -> list[Rule]:
  """One transformer block: Hugging Face prefix `hf` (names from `_BLOCK_NAMES[scheme]`) <-> our `Block` at `path`."""
  names = _BLOCK_NAMES[scheme]
  rules = []
  for projection in ("query", "key", "value"):
    rules += _linear(f"{hf}.{names['qkv']}.{projection}", path + ("attention", projection), "heads_in")
  rules += _linear(f"{hf}.{names['attention_output']}", path + ("attention", "output"), "heads_out")
  rules += _norm(f"{hf}.{names['attention_norm']}", path + ("attention_norm",))
  rules += _linear(f"{hf}.{names['wi']}", path + ("ffn", "wi"))
  rules += _linear(f"{hf}.{names['wo']}", path + ("ffn", "wo"))
  return rules + _norm(f"{hf}.{names['ffn_norm']}", path + ("ffn_norm",))


def encoder_body_rules(family: str, config: ModelConfig, path: Path) -> list[Rule]:
  """The E -> H projection and the transformer blocks of an `Encoder` at `path` (no embeddings)."""
  rules = []
  if family == "albert":
    rules += _linear("encoder.embedding_hidden_mapping_in", path + ("embedding_projection",))
    for group in range(config.num_shared_groups or config.num_layers):
      hf = f"encoder.albert_layer_groups.{group}.albert_layers.0"
      rules += _block_rules("albert", hf, path + (f"block_{group}",))
    return rules
  if config.embed_dim != config.hidden_size:
    rules += _linear("embeddings_project", path + ("embedding_projection",))
  for layer in range(config.num_layers):
    rules += _block_rules("bert", f"encoder.layer.{layer}", path + (f"block_{layer}",))
  return rules


def encoder_rules(family: str, config: ModelConfig, path: Path) -> list[Rule]:
  """Every tensor of an `Encoder` (embeddings included) at `path`."""
  return embedding_rules(path + ("embeddings",)) + encoder_body_rules(family, config, path)


def mlm_rules(family: str, path: Path) -> tuple[list[Rule], list[Tied]]:
  """The MLM head (an `MLMHead` at `path`) and its tied decoder tensors."""
  word_embeddings = "embeddings.word_embeddings.weight"
  predictions = path + ("predictions",)
  if family == "electra":
    rules = (_linear("generator_predictions.dense", predictions + ("transform",))
             + _norm("generator_predictions.LayerNorm", predictions + ("transform_norm",))
             + [Rule("generator_lm_head.bias", predictions + ("output_bias",))])
    return rules, [Tied("generator_lm_head.weight", word_embeddings)]
  head, dense, norm = {"bert": ("cls.predictions", "cls.predictions.transform.dense",
                                "cls.predictions.transform.LayerNorm"),
                       "roberta": ("lm_head", "lm_head.dense", "lm_head.layer_norm"),
                       "albert": ("predictions", "predictions.dense", "predictions.LayerNorm")}[family]
  rules = (_linear(dense, predictions + ("transform",)) + _norm(norm, predictions + ("transform_norm",))
           + [Rule(f"{head}.bias", predictions + ("output_bias",))])
  return rules, [Tied(f"{head}.decoder.weight", word_embeddings), Tied(f"{head}.decoder.bias", f"{head}.bias")]


def pooler_rules(family: str, path: Path) -> list[Rule]:
  """BERT's pooler (a `heads.Pooler` at `path`); ELECTRA has none."""
  return _linear("pooler" if family == "albert" else "pooler.dense", path + ("dense",))


def sentence_rules(family: str, path: Path) -> list[Rule]:
  """NSP (BERT) or SOP (ALBERT): a `SentenceHead` at `path`."""
  return pooler_rules(family, path + ("pooler",)) + _linear(SENTENCE_CLASSIFIERS[family], path + ("classifier",))


def rtd_rules(path: Path) -> list[Rule]:
  """ELECTRA's replaced-token-detection head (a `ReplacedTokenHead` at `path`)."""
  return (_linear("discriminator_predictions.dense", path + ("dense",))
          + _linear("discriminator_predictions.dense_prediction", path + ("prediction",)))
