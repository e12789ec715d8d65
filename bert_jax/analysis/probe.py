"""Layer-wise probing (Tenney et al. 2019; Liu et al. 2019): what each layer's frozen features encode.

For part-of-speech, syntactic chunk and named-entity tags (the columns of CoNLL-2003), a linear probe
(multinomial logistic regression on standardised features, trained full-batch with Adam) is trained on each
layer's vector of every word's first word piece from eng.train and scored by word accuracy on eng.testa. Layer 0
is the embedding output. The majority tag's accuracy is the floor a probe must beat.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bert_jax.analysis.features import extract_features
from bert_jax.models import ModelConfig

PROBE_TASKS = ("pos", "chunk", "ner")


def word_pieces(tokenizer, words: Sequence[str], max_len: int) -> tuple[list[int], list[int]]:
  """([CLS] pieces [SEP] ids, the position of each kept word's first piece); words past max_len are cut."""
  ids, firsts = [tokenizer.cls_id], []
  for word in words:
    pieces = tokenizer.encode(word) or [tokenizer.unk_id]
    if len(ids) + len(pieces) > max_len - 1:
      break
    firsts.append(len(ids))
    ids += pieces
  return ids + [tokenizer.sep_id], firsts


def word_features(config: ModelConfig, params: Any, tokenizer, sentences: Sequence[Sequence[str]],
                  max_len: int, batch_size: int = 32) -> tuple[np.ndarray, np.ndarray]:
  """(float32 [words, layers + 1, H] every layer's vector at each word's first piece, int [sentences] the words
  kept per sentence)."""
  layers = list(range(config.num_layers + 1))
  vectors, kept = [], []
  chunk = 256  # sentences a pass: the per-token features of a pass stay small
  for start in range(0, len(sentences), chunk):
    encoded, firsts = [], []
    for words in sentences[start:start + chunk]:
      ids, first = word_pieces(tokenizer, words, max_len)
      encoded.append((ids, [0] * len(ids)))
      firsts.append(first)
    features = extract_features(config, params, encoded, layers, max_len, batch_size)
    for index, first in enumerate(firsts):
      vectors.append(features[index, first])
      kept.append(len(first))
  return np.concatenate(vectors), np.array(kept)


@functools.partial(jax.jit, static_argnames=("num_classes", "steps", "learning_rate", "weight_decay"))
def _fit(x_nd: jax.Array, y_n: jax.Array, num_classes: int, steps: int, learning_rate: float,
         weight_decay: float) -> dict[str, jax.Array]:
  """Full-batch AdamW on the softmax cross-entropy of a linear map; zeros to start (the problem is convex)."""
  tx = optax.adamw(learning_rate, weight_decay=weight_decay)
  params = {"w": jnp.zeros((x_nd.shape[1], num_classes)), "b": jnp.zeros((num_classes,))}

  def loss(params):
    return optax.softmax_cross_entropy_with_integer_labels(x_nd @ params["w"] + params["b"], y_n).mean()

  def step(carry, _):
    params, state = carry
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    return (optax.apply_updates(params, updates), state), None

  (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), None, length=steps)
  return params


def train_probe(train_x: np.ndarray, train_y: np.ndarray, num_classes: int, steps: int = 300,
                learning_rate: float = 0.05, weight_decay: float = 1e-4):
  """A linear softmax probe on [N, D] features (standardised with the training statistics); returns
  predict(x [M, D]) -> int [M]."""
  mean, std = train_x.mean(0), train_x.std(0) + 1e-6
  params = _fit(jnp.asarray((train_x - mean) / std, jnp.float32), jnp.asarray(train_y, jnp.int32), num_classes,
                steps, learning_rate, weight_decay)
  return lambda test_x: np.asarray(jnp.argmax(((test_x - mean) / std) @ params["w"] + params["b"], -1))


def probe_layers(train_x: np.ndarray, train_labels: Sequence[str], test_x: np.ndarray, test_labels: Sequence[str],
                 steps: int = 300) -> dict[str, Any]:
  """Per layer (axis 1 of the [words, layers, H] features), the probe's test accuracy (%); and the majority tag's
  accuracy ("majority"). Test tags unseen in training count as errors."""
  classes = sorted(set(train_labels))
  index = {label: i for i, label in enumerate(classes)}
  train_y = np.array([index[label] for label in train_labels])
  test_y = np.array([index.get(label, -1) for label in test_labels])
  majority = int(np.bincount(train_y).argmax())
  accuracies = []
  for layer in range(train_x.shape[1]):
    predict = train_probe(train_x[:, layer], train_y, len(classes), steps)
    accuracies.append(100.0 * float(np.mean(predict(test_x[:, layer]) == test_y)))
  return {"accuracy": accuracies, "majority": 100.0 * float(np.mean(test_y == majority)), "classes": len(classes)}


def tags_of(sentences, task: str, kept: np.ndarray) -> list[str]:
  """The `task` tag of every kept word, in order."""
  column = {"pos": "pos", "chunk": "chunks", "ner": "tags"}[task]
  return [tag for sentence, count in zip(sentences, kept) for tag in getattr(sentence, column)[:count]]


def run_probes(config: ModelConfig, params: Any, tokenizer, conll_dir: str | pathlib.Path,
               train_sentences: int, test_sentences: int, max_len: int, batch_size: int = 32,
               steps: int = 300) -> dict[str, Any]:
  """{task: probe_layers(...)} for PROBE_TASKS on the first sentences of eng.train and eng.testa, and the counts."""
  from bert_jax.tasks.ner import read_conll  # noqa: PLC0415

  conll_dir = pathlib.Path(conll_dir)
  splits = {}
  for name, count in (("eng.train", train_sentences), ("eng.testa", test_sentences)):
    path = conll_dir / name
    if not path.exists():
      raise FileNotFoundError(f"{path} not found: --conll-dir must hold CoNLL-2003's eng.train and eng.testa")
    sentences = read_conll(path)[:count]
    features, kept = word_features(config, params, tokenizer, [s.words for s in sentences], max_len, batch_size)
    splits[name] = (sentences, features, kept)
  (train, train_x, train_kept), (test, test_x, test_kept) = splits["eng.train"], splits["eng.testa"]
  results: dict[str, Any] = {"train_words": len(train_x), "test_words": len(test_x)}
  for task in PROBE_TASKS:
    results[task] = probe_layers(train_x, tags_of(train, task, train_kept), test_x, tags_of(test, task, test_kept),
                                 steps)
  return results


def probe_markdown(results: dict[str, Any]) -> tuple[str, str]:
  """(the report's section, a printed line)."""
  layers = len(results["pos"]["accuracy"])
  lines = ["## Layer-wise probing", "", "![probe accuracy by layer](probes.png)", "",
           f"Linear probes on each layer's frozen features (first word piece of each word): trained on "
           f"{results['train_words']} words of eng.train, word accuracy (%) on {results['test_words']} words of "
           "eng.testa; layer 0 is the embedding output.", "",
           "| task | majority tag | " + " | ".join(f"layer {layer}" for layer in range(layers)) + " | best |",
           "|---" * (layers + 3) + "|"]
  best = {}
  for task in PROBE_TASKS:
    accuracy = results[task]["accuracy"]
    best[task] = int(np.argmax(accuracy))
    lines.append(f"| {task} | {results[task]['majority']:.1f} | " + " | ".join(f"{a:.1f}" for a in accuracy)
                 + f" | layer {best[task]} |")
  summary = "probes: best layer " + ", ".join(
      f"{task} {best[task]} ({results[task]['accuracy'][best[task]]:.1f}%)" for task in PROBE_TASKS)
  return "\n".join(lines), summary


def write_figure(results: dict[str, Any], out_dir: pathlib.Path) -> pathlib.Path:
  """probes.png: probe accuracy by layer, one line per task, the majority tags dotted."""
  import matplotlib  # noqa: PLC0415 - only for the figure
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, axis = plt.subplots(figsize=(5.5, 3.5))
  for task in PROBE_TASKS:
    accuracy = results[task]["accuracy"]
    line, = axis.plot(range(len(accuracy)), accuracy, "o-", label=task)
    axis.axhline(results[task]["majority"], color=line.get_color(), linestyle=":", linewidth=1)
  axis.set_xlabel("layer (0 = embeddings)")
  axis.set_ylabel("probe accuracy on eng.testa (%)")
  axis.legend()
  axis.grid(alpha=0.3)
  fig.tight_layout()
  path = out_dir / "probes.png"
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
