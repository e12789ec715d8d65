"""GLUE/SWAG metrics against hand-computed values and, when importable, scikit-learn/scipy."""

import numpy as np
import pytest

from bert_jax.tasks import metrics


def test_accuracy_and_binary_f1_by_hand():
  predictions = np.array([1, 1, 0, 0, 1])
  labels = np.array([1, 0, 0, 1, 1])
  assert metrics.accuracy(predictions, labels) == pytest.approx(60.0)
  # TP=2, FP=1, FN=1 -> precision = recall = 2/3.
  assert metrics.binary_f1(predictions, labels) == pytest.approx(200 / 3)
  assert metrics.binary_f1(np.zeros(4), np.array([0, 1, 0, 1])) == 0.0


def test_matthews_by_hand_and_degenerate():
  predictions = np.array([1, 1, 1, 0, 0, 1])
  labels = np.array([1, 1, 0, 0, 1, 1])
  # TP=3, TN=1, FP=1, FN=1: (3*1 - 1*1) / sqrt(4*4*2*2) = 2/8.
  assert metrics.matthews_corrcoef(predictions, labels) == pytest.approx(25.0)
  assert metrics.matthews_corrcoef(np.ones(6), labels) == 0.0
  assert metrics.matthews_corrcoef(np.zeros(6), labels) == 0.0
  assert metrics.matthews_corrcoef(labels, labels) == pytest.approx(100.0)
  assert metrics.matthews_corrcoef(1 - labels, labels) == pytest.approx(-100.0)


def test_matthews_matches_sklearn():
  sklearn_metrics = pytest.importorskip("sklearn.metrics")
  rng = np.random.default_rng(0)
  for num_classes in (2, 3):
    labels = rng.integers(0, num_classes, 200)
    predictions = np.where(rng.random(200) < 0.6, labels, rng.integers(0, num_classes, 200))
    assert metrics.matthews_corrcoef(predictions, labels) == pytest.approx(
        100 * sklearn_metrics.matthews_corrcoef(labels, predictions))


def test_average_ranks_ties_by_hand():
  np.testing.assert_allclose(metrics.average_ranks(np.array([10, 20, 20, 5, 20])), [2, 4, 4, 1, 4])


def test_spearman_and_pearson_with_ties_match_scipy():
  stats = pytest.importorskip("scipy.stats")
  rng = np.random.default_rng(1)
  labels = rng.integers(0, 6, 300) / 1.0  # STS-B-like scores with many ties
  predictions = np.round(labels + rng.normal(0, 1.5, 300), 1)
  assert metrics.spearman(predictions, labels) == pytest.approx(100 * stats.spearmanr(predictions, labels)[0])
  assert metrics.pearson(predictions, labels) == pytest.approx(100 * stats.pearsonr(predictions, labels)[0])


def test_correlations_by_hand_and_constant_inputs():
  # Deviations (-1, 0, 1) and (-13/6, -1/6, 14/6): covariance sum 4.5, squares 2 and 61/6.
  assert metrics.pearson(np.array([1.0, 2.0, 3.0]), np.array([2.0, 4.0, 6.5])) == pytest.approx(
      100 * 4.5 / np.sqrt(2 * 61 / 6))
  assert metrics.spearman(np.array([1.0, 2.0, 3.0]), np.array([1.0, 5.0, 9.0])) == pytest.approx(100.0)
  assert metrics.pearson(np.ones(4), np.arange(4.0)) == 0.0
  assert metrics.spearman(np.arange(4.0), np.ones(4)) == 0.0
