"""Fixed-shape batches of a task's feature rows, shared by fine-tuning (`finetune`) and inference (`inference`).

  fitted_max_len   config.max_len cut to the positions a model has;
  padded_length    the longest row of feature sets, rounded up to 8;
  trim_features    per-token arrays cut from max_len to that length (only padding goes);
  BatchMaker       global batches of given rows, padded with weight-0 rows to the batch size;
  epoch_batches    a seed's training batches, epoch after epoch, from any step on.
"""

from __future__ import annotations

import logging
from typing import Iterator, Sequence

import jax
import numpy as np

from bert_jax.models.config import ModelConfig
from bert_jax.parallel import sharding as sharding_lib
from bert_jax.tasks.kinds import task_kind

log = logging.getLogger(__name__)

_LENGTH_MULTIPLE = 8


def fitted_max_len(max_len: int, model_config: ModelConfig) -> int:
  """config.max_len, cut to the positions the model has (a small pre-trained model has fewer than 128)."""
  positions = model_config.max_position_embeddings - model_config.position_offset
  if max_len <= positions:
    return max_len
  log.warning("config.max_len=%d exceeds the model's %d positions: inputs are cut to %d tokens "
              "(set --config.max_len to choose a shorter length)", max_len, positions, positions)
  return positions


def trim_features(features: dict[str, np.ndarray], kind: str, max_len: int, seq_len: int) -> dict[str, np.ndarray]:
  """Cuts every per-token array of a task of kind `kind` from max_len to seq_len tokens (only padding is removed)."""
  axis = task_kind(kind).token_axis
  trimmed = {}
  for key, value in features.items():
    if value.ndim > axis and value.shape[axis] == max_len:
      value = np.take(value, np.arange(seq_len), axis=axis)
    trimmed[key] = value
  return trimmed


def padded_length(feature_sets: Sequence[dict[str, np.ndarray]], max_len: int) -> int:
  """The longest row of all feature sets, rounded up to a multiple of 8, at most max_len."""
  longest = max(int(features["lengths"].max()) for features in feature_sets)
  return min(max_len, -(-longest // _LENGTH_MULTIPLE) * _LENGTH_MULTIPLE)


class BatchMaker:
  """Fixed-shape host batches from feature arrays; rows past the data are weight-0 padding.

  Each process builds the whole global batch's row indices and keeps its own
  contiguous slice, which `global_batch` assembles into global arrays.
  """

  def __init__(self, fields: Sequence[str], batch_size: int, mesh):
    self.fields = tuple(fields)
    self.batch_size = batch_size
    self.mesh = mesh
    rows_per_process = batch_size // jax.process_count()
    self.local_rows = slice(jax.process_index() * rows_per_process, (jax.process_index() + 1) * rows_per_process)

  def __call__(self, features: dict[str, np.ndarray], rows: np.ndarray, seed: int) -> dict[str, jax.Array]:
    """Global batch of `rows` of `features` (fewer rows than batch_size are padded)."""
    real = len(rows)
    padded_rows = np.concatenate([rows, np.zeros(self.batch_size - real, rows.dtype)])[self.local_rows]
    weights = (np.arange(self.batch_size) < real).astype(np.float32)[self.local_rows]
    local = {field: features[field][padded_rows] for field in self.fields}
    local["weights"] = weights
    local["seed"] = np.full(len(padded_rows), seed, np.int32)
    return sharding_lib.global_batch(local, self.mesh)


def epoch_batches(make_batch: BatchMaker, features: dict[str, np.ndarray], seed: int, epochs: int, start_step: int
                  ) -> Iterator[dict[str, jax.Array]]:
  """The training batches of `epochs` epochs, from `start_step` on: each epoch's row order is drawn from (seed,
  epoch), so a resumed seed reads the batches it would have read; an epoch's last batch is padded
  (`BatchMaker`)."""
  num_rows, size = len(features["input_ids"]), make_batch.batch_size
  first_epoch, skipped = divmod(start_step, -(-num_rows // size))
  for epoch in range(first_epoch, epochs):
    order = np.random.default_rng([seed, epoch]).permutation(num_rows)
    for start in range(skipped * size if epoch == first_epoch else 0, num_rows, size):
      yield make_batch(features, order[start:start + size], seed)
