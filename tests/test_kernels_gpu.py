"""The whole pre-training model on a GPU with every fast path on (`kernels="auto"`) against none (`"off"`).

Skipped without a GPU (on CPU, tests/test_models.py compares the two in float32, where the kernels take their XLA
forms). Here, in bfloat16 and without dropout, "auto" runs the flash attention kernels, the LayerNorm kernels, the
Hopper FFN kernels (on a Hopper GPU) and the MLM loss's statistics kernel; the loss and every gradient of the train
step's forward and backward pass (MLM + NSP, sparse last layer, padded vocabulary) must agree with the plain model's
to bfloat16 rounding, against the plain model in float32. `pytest -s` prints the errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bert_jax.models import PretrainingModel, model_config

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

ROWS, SEQ, VOCAB, PREDICTIONS = 32, 128, 30522, 20


def _batch():
  rng = np.random.default_rng(0)
  lengths = rng.integers(SEQ // 2, SEQ + 1, ROWS)
  pack_ids = (np.arange(SEQ)[None] < lengths[:, None]).astype(np.int32)
  ids = rng.integers(5, VOCAB, (ROWS, SEQ)).astype(np.int32) * pack_ids
  segment_ids = (np.arange(SEQ)[None] >= (lengths // 2)[:, None]).astype(np.int32) * pack_ids
  positions = np.sort(rng.integers(1, SEQ // 2, (ROWS, PREDICTIONS)), axis=1).astype(np.int32)
  targets = rng.integers(5, VOCAB, (ROWS, PREDICTIONS)).astype(np.int32)
  labels = rng.integers(0, 2, (ROWS, 1)).astype(np.int32)
  return {k: jnp.asarray(v) for k, v in dict(input_ids=ids, segment_ids=segment_ids, pack_ids=pack_ids,
                                              mlm_positions=positions, mlm_ids=targets, labels=labels).items()}


def _loss_fn(model, name: str):
  """The pre-training loss (MLM + NSP means) of one batch: the fast cross-entropy with kernels, optax's without."""
  if name == "auto":
    from bert_jax.kernels.cross_entropy import cross_entropy_sums
  else:
    def cross_entropy_sums(logits, targets, weights):
      losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
      return jnp.sum(losses * weights), jnp.sum((jnp.argmax(logits, -1) == targets) * weights)

  def loss(params, batch):
    out = model.apply({"params": params}, batch["input_ids"], batch["mlm_positions"],
                      segment_ids=batch["segment_ids"], pack_ids=batch["pack_ids"],
                      cls_positions=jnp.zeros((ROWS, 1), jnp.int32), deterministic=True)
    weights = jnp.ones(batch["mlm_ids"].shape, jnp.float32)
    mlm, _ = cross_entropy_sums(out["mlm_logits"], batch["mlm_ids"], weights)
    nsp, _ = cross_entropy_sums(out["sentence_logits"], batch["labels"], jnp.ones((ROWS, 1), jnp.float32))
    return mlm / jnp.sum(weights) + nsp / ROWS

  return loss


def _relative(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_pretraining_step_with_every_fast_path_equals_the_plain_model():
  """Both bfloat16 forms against the plain model in float32: the fast one within bfloat16 rounding of it, and no
  further from it than the plain bfloat16 model (whose autodiff sums the bias and small-table gradients over the
  batch in bfloat16, a few percent off)."""
  cfg = model_config("bert", "L2-H256", dtype="bfloat16", vocab_pad_multiple=128, sparse_last_layer=True,
                     hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=SEQ)
  batch = _batch()
  models = {"auto": PretrainingModel(cfg), "off": PretrainingModel(cfg.replace(kernels="off")),
            "float32": PretrainingModel(cfg.replace(kernels="off", dtype="float32"))}
  params = models["off"].init(jax.random.key(0), batch["input_ids"], batch["mlm_positions"],
                              pack_ids=batch["pack_ids"])["params"]
  results = {}
  for name, model in models.items():
    step = jax.jit(jax.value_and_grad(_loss_fn(model, name)))
    lowered = step.lower(params, batch).as_text()
    assert ("xla.gpu.triton" in lowered) == (name == "auto"), name  # Pallas kernels only where asked for
    results[name] = step(params, batch)
  (loss, grads), (plain_loss, plain_grads), (ref_loss, ref_grads) = (results[k] for k in ("auto", "off", "float32"))
  print(f"loss {float(loss):.5f}, plain bf16 {float(plain_loss):.5f}, plain f32 {float(ref_loss):.5f}")
  assert abs(float(loss) - float(ref_loss)) < 1e-2 * abs(float(ref_loss))
  plain_leaves = dict(jax.tree_util.tree_leaves_with_path(plain_grads))
  ref_leaves = dict(jax.tree_util.tree_leaves_with_path(ref_grads))
  worst = (0.0, "")
  for path, a in jax.tree_util.tree_leaves_with_path(grads):
    name = jax.tree_util.keystr(path)
    if "['key']['bias']" in name:  # softmax ignores a per-query shift of the scores: the fast path does not train it
      continue
    error, plain_error = _relative(a, ref_leaves[path]), _relative(plain_leaves[path], ref_leaves[path])
    worst = max(worst, (error, name))
    assert error < max(3e-2, 1.5 * plain_error), (name, error, plain_error)
  print(f"worst gradient leaf against float32: {worst[1]} relative {worst[0]:.2e}")
