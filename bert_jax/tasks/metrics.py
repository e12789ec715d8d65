"""Sequence-level metrics of GLUE and SWAG, in numpy, on the 0-100 scale.

Degenerate inputs (a constant prediction, a single class) give 0 rather than
NaN, as scikit-learn does for Matthews correlation, so that model selection
never compares against NaN.

The unit rule: results for people (results.json and results.md, `bert-jax
evaluate`, the evaluation lines printed while training, paper tables) give
scores in percent, as the papers do; the logged metric streams
(metrics.jsonl, TensorBoard) that `bert-jax plot` draws give every score
(accuracy, F1, exact match, MCC, correlations) as a fraction, as pre-training
logs its accuracies, so that runs of every command share an axis.
`as_fractions` turns a task's scores into the logged unit.
"""

from __future__ import annotations

import numpy as np


def accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
  """Percentage of predictions equal to the labels."""
  predictions, labels = np.asarray(predictions), np.asarray(labels)
  return 100.0 * float(np.mean(predictions == labels))


def binary_f1(predictions: np.ndarray, labels: np.ndarray, positive: int = 1) -> float:
  """F1 of the positive class (MRPC, QQP); 0 when there are no true positives."""
  predicted = np.asarray(predictions) == positive
  gold = np.asarray(labels) == positive
  true_positives = float(np.sum(predicted & gold))
  if true_positives == 0:
    return 0.0
  precision = true_positives / np.sum(predicted)
  recall = true_positives / np.sum(gold)
  return 100.0 * float(2 * precision * recall / (precision + recall))


def matthews_corrcoef(predictions: np.ndarray, labels: np.ndarray) -> float:
  """Matthews correlation (CoLA), multi-class form; 0 when undefined.

  Uses the covariance form over the confusion matrix (Gorodkin 2004), which
  equals the binary (TP*TN - FP*FN) / sqrt(...) formula for two classes.
  """
  predictions, labels = np.asarray(predictions), np.asarray(labels)
  classes, encoded = np.unique(np.concatenate([labels, predictions]), return_inverse=True)
  gold_ids, predicted_ids = encoded[:len(labels)], encoded[len(labels):]
  confusion = np.zeros((len(classes), len(classes)), np.float64)
  np.add.at(confusion, (gold_ids, predicted_ids), 1)
  gold_totals, predicted_totals = confusion.sum(axis=1), confusion.sum(axis=0)
  samples, correct = confusion.sum(), np.trace(confusion)
  covariance = correct * samples - gold_totals @ predicted_totals
  gold_variance = samples**2 - gold_totals @ gold_totals
  predicted_variance = samples**2 - predicted_totals @ predicted_totals
  if gold_variance * predicted_variance == 0:
    return 0.0
  return 100.0 * float(covariance / np.sqrt(gold_variance * predicted_variance))


def pearson(predictions: np.ndarray, labels: np.ndarray) -> float:
  """Pearson correlation; 0 when either side is constant."""
  x = np.asarray(predictions, np.float64) - np.mean(predictions)
  y = np.asarray(labels, np.float64) - np.mean(labels)
  denominator = np.sqrt(np.sum(x * x) * np.sum(y * y))
  if denominator == 0:
    return 0.0
  return 100.0 * float(np.sum(x * y) / denominator)


def average_ranks(values: np.ndarray) -> np.ndarray:
  """1-based ranks with ties given the mean of the ranks they span."""
  _, inverse, counts = np.unique(np.asarray(values), return_inverse=True, return_counts=True)
  last_rank = np.cumsum(counts)
  return (last_rank - (counts - 1) / 2.0)[inverse]


def spearman(predictions: np.ndarray, labels: np.ndarray) -> float:
  """Spearman correlation: Pearson of average ranks (ties handled as scipy)."""
  return pearson(average_ranks(predictions), average_ranks(labels))


def as_fractions(metrics: dict[str, float]) -> dict[str, float]:
  """A task's metrics as logged: scores on the 0-100 scale divided by 100; counts (SQuAD v2's `total`,
  `*_total`) and no-answer thresholds (`*_thresh`) are not scores and stay as they are."""
  return {name: value if name == "total" or name.endswith(("_total", "_thresh")) else value / 100.0
          for name, value in metrics.items()}
