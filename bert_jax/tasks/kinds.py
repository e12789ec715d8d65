"""Fine-tuning task kinds: a small table of classes behind one interface.

A task (`bert_jax.tasks.base.Task`) names its kind in `Task.kind`; the kind's class owns what varies by kind:

  head(config, num_labels)     the Flax head on the encoder (`FinetuneModel` builds it as its "head");
  pooled                       the head reads one position per row ([CLS], a causal encoder's last token);
  encoder_rows(x), logits(out, rows_shape)   the rows the encoder reads, and the head's output as the kind's logits;
  row_shape(rows, num_choices), token_axis   the shape of a batch's rows and the axis of its tokens;
  label_fields                 the batch fields of its labels (`finetune_model.device_fields`);
  loss_weights(inputs), terms(outputs, inputs)   its loss sums (`FinetuneObjective`; the step divides once);
  predictions(outputs, inputs) the head's float32 outputs in `Task.evaluate`'s layout;
  soft_logits, soft_weights, soft_regression, row_weights   what distillation reads;
  token_output_fill            the value per-token outputs are padded with past a row's length bucket (inference);
  records(labels, predictions, outputs, examples)   `bert-jax predict`'s JSON lines;
  feature_based                whether BERT's feature-based mode (`FeatureBasedTagger`) serves it.

`TASK_KINDS` maps the kind's name to its class; a new kind is one class added there.

  classification   [CLS] -> one logit per label; cross-entropy per example (GLUE but STS-B)
  regression       [CLS] -> one score; squared error per example (STS-B)
  multiple_choice  [CLS] of each (context, choice) row -> one score, softmax over the choices (SWAG)
  span             start and end logits per token; (start CE + end CE) / 2 per window (SQuAD)
  tagging          one logit per label per token; cross-entropy per labelled word piece (CoNLL-2003)
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bert_jax.models.config import ModelConfig
from bert_jax.models.model import (ClassificationHead, MultipleChoiceHead, SpanExtractionHead,
                                   TokenClassificationHead)
from bert_jax.train.losses import cross_entropy_sums

Array = jax.Array


class TaskKind:
  """Classification of each example: the pooled [CLS] -> one logit per label, cross-entropy; subclasses change
  the head, the loss, the label fields and the post-processing."""

  name: ClassVar[str] = "classification"
  pooled: ClassVar[bool] = True
  label_fields: ClassVar[tuple[str, ...]] = ("labels",)
  token_axis: ClassVar[int] = 1  # of the feature arrays; a row's tokens
  token_output_fill: ClassVar[float | None] = None  # None: the outputs have no token axis
  soft_regression: ClassVar[bool] = False  # the soft target is a value to match, not a distribution
  feature_based: ClassVar[bool] = False

  def head(self, config: ModelConfig, num_labels: int) -> nn.Module:
    return ClassificationHead(config, num_labels)

  def encoder_rows(self, x: Array) -> Array:
    """A batch field as the encoder's rows [rows, L]."""
    return x

  def logits(self, outputs: Any, rows_shape: tuple[int, ...]) -> Any:
    """The head's outputs as the kind's logits; rows_shape: the input ids' shape without the token axis."""
    del rows_shape
    return outputs

  def row_shape(self, rows: int, num_choices: int) -> tuple[int, ...]:
    """The leading shape of a batch's token fields."""
    del num_choices
    return (rows,)

  def loss_weights(self, inputs: dict[str, Array]) -> Array:
    """Float32 weight per loss item: the row's weight, 0 where the label is missing (-1)."""
    return inputs["weights"].astype(jnp.float32) * (inputs["labels"] >= 0)

  def terms(self, outputs: Any, inputs: dict[str, Array]) -> dict[str, Array]:
    """task_loss and task_correct summed over the batch."""
    # Rows of a few labels (or one window's positions): narrower than any fast path's rows.
    loss, correct = cross_entropy_sums(outputs, jnp.maximum(inputs["labels"], 0), self.loss_weights(inputs), "off")
    return {"task_loss": loss, "task_correct": correct}

  def predictions(self, outputs: Any, inputs: dict[str, Array]) -> Array:
    del inputs
    return outputs.astype(jnp.float32)

  def soft_logits(self, outputs: Any, inputs: dict[str, Array]) -> Array:
    """Distillation's soft predictions [..., C] (regression: the values [B])."""
    del inputs
    return outputs

  def soft_weights(self, inputs: dict[str, Array]) -> Array:
    """The weight of each soft prediction: `soft_logits`' leading shape."""
    return self.loss_weights(inputs)

  def row_weights(self, inputs: dict[str, Array], num_choices: int) -> Array:
    """[rows] the weight of each encoder row."""
    del num_choices
    return inputs["weights"].astype(jnp.float32)

  def records(self, labels: Sequence[str], predictions: Any, outputs: np.ndarray,
              examples: Sequence[Any]) -> list[dict]:
    """One JSON-ready record per example: {"id", "label", "probabilities"}."""
    logits = outputs - outputs.max(axis=-1, keepdims=True)
    probabilities = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    return [{"id": example.guid, "label": label,
             "probabilities": {name: round(float(p), 6) for name, p in zip(labels, row)}}
            for example, label, row in zip(examples, predictions, probabilities)]


class Regression(TaskKind):
  """A score per example: the pooled [CLS] -> one value, squared error; a NaN label is missing."""

  name = "regression"
  soft_regression = True

  def head(self, config, num_labels):
    del num_labels
    return ClassificationHead(config, 1)

  def logits(self, outputs, rows_shape):
    del rows_shape
    return outputs[..., 0]

  def loss_weights(self, inputs):
    return inputs["weights"].astype(jnp.float32) * jnp.isfinite(inputs["labels"])

  def terms(self, outputs, inputs):
    targets = jnp.where(jnp.isfinite(inputs["labels"]), inputs["labels"], 0.0)
    return {"task_loss": jnp.sum(jnp.square(outputs.astype(jnp.float32) - targets) * self.loss_weights(inputs))}

  def records(self, labels, predictions, outputs, examples):
    return [{"id": example.guid, "score": score} for example, score in zip(examples, predictions)]


class MultipleChoice(TaskKind):
  """One of C choices per example: rows [N, C, L] read as N * C encoder rows, one score each, softmax over C."""

  name = "multiple_choice"
  token_axis = 2

  def head(self, config, num_labels):
    del num_labels
    return MultipleChoiceHead(config)

  def encoder_rows(self, x):
    return x.reshape((-1,) + x.shape[2:])

  def logits(self, outputs, rows_shape):
    return outputs.reshape(rows_shape)

  def row_shape(self, rows, num_choices):
    return (rows, num_choices)

  def row_weights(self, inputs, num_choices):
    return jnp.repeat(super().row_weights(inputs, num_choices), num_choices)

  def records(self, labels, predictions, outputs, examples):
    return [{"id": example.guid, "choice": choice} for example, choice in zip(examples, predictions)]


def span_logits(outputs: tuple[Array, Array], inputs: dict[str, Array]) -> Array:
  """(start [B, L], end [B, L]) -> float32 [B, L, 2] with padding at the float32 minimum."""
  logits_bl2 = jnp.stack(outputs, axis=-1).astype(jnp.float32)
  return jnp.where(inputs["pack_ids"][..., None] > 0, logits_bl2, jnp.finfo(jnp.float32).min)


class SpanExtraction(TaskKind):
  """An answer span per window: start and end logits per token, (start CE + end CE) / 2 per window."""

  name = "span"
  pooled = False
  label_fields = ("start_positions", "end_positions")
  token_output_fill = float(np.finfo(np.float32).min)  # never an answer

  def head(self, config, num_labels):
    del num_labels
    return SpanExtractionHead(config)

  def loss_weights(self, inputs):
    return inputs["weights"].astype(jnp.float32)

  def terms(self, outputs, inputs):
    weights = self.loss_weights(inputs)
    logits_bl2 = span_logits(outputs, inputs)
    start_loss, _ = cross_entropy_sums(logits_bl2[..., 0], inputs["start_positions"], weights, "off")
    end_loss, _ = cross_entropy_sums(logits_bl2[..., 1], inputs["end_positions"], weights, "off")
    both_correct = ((jnp.argmax(logits_bl2[..., 0], -1) == inputs["start_positions"])
                    & (jnp.argmax(logits_bl2[..., 1], -1) == inputs["end_positions"]))
    return {"task_loss": (start_loss + end_loss) / 2, "task_correct": jnp.sum(both_correct * weights)}

  def predictions(self, outputs, inputs):
    return span_logits(outputs, inputs)

  def soft_logits(self, outputs, inputs):
    return jnp.swapaxes(span_logits(outputs, inputs), 1, 2)

  def soft_weights(self, inputs):
    weights = self.loss_weights(inputs)
    return jnp.stack([weights, weights], axis=-1)  # start and end of each window

  def records(self, labels, predictions, outputs, examples):
    return [{"id": example.qid, "answer": predictions[example.qid]} for example in examples]


class Tagging(TaskKind):
  """A tag per word: one logit per label per token, cross-entropy on labelled word pieces (-1 elsewhere)."""

  name = "tagging"
  pooled = False
  token_output_fill = 0.0  # never read: those positions hold no word
  feature_based = True

  def head(self, config, num_labels):
    return TokenClassificationHead(config, num_labels)

  def loss_weights(self, inputs):
    return inputs["weights"].astype(jnp.float32)[:, None] * (inputs["labels"] >= 0)

  def records(self, labels, predictions, outputs, examples):
    return [{"words": list(sentence.words), "tags": tags} for sentence, tags in zip(examples, predictions)]


# A task's `kind` -> its class; a new kind is one class added here.
TASK_KINDS: dict[str, type[TaskKind]] = {
    cls.name: cls for cls in (TaskKind, Regression, MultipleChoice, SpanExtraction, Tagging)}


def task_kind(name: str) -> TaskKind:
  """The kind called `name` (`Task.kind`)."""
  if name not in TASK_KINDS:
    raise ValueError(f"Task.kind={name!r}: expected one of {tuple(TASK_KINDS)}")
  return TASK_KINDS[name]()
