"""Quantisation-aware int8 fine-tuning (`--config.quant.qat=True`, `quantization.qat_model`) on CPU.

A dense layer and an embedding table against numpy: the forward pass rounds as `bert-jax quantize` does, and the
gradients are Q8BERT's straight-through ones. A whole model's QAT forward pass equals its post-training int8 forward
pass on the same weights, and gradients reach every parameter. A tiny QAT fine-tune quantises with
`bert-jax quantize` and scores as it did in training.
"""

import json
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax import cli
from bert_jax.models import quantization
from bert_jax.tasks import evaluate as evaluate_lib
from test_finetune import _finetune, _glue_sst2
from test_quantize import SMALL, SMALL_DENSE_LAYERS, SMALL_TABLES, small_model  # noqa: F401 - the fixture


class _DenseAndTable(nn.Module):
  """One dense layer and one embedding table, named as the encoder's are (the rules match on names)."""

  @nn.compact
  def __call__(self, ids, x_bi):
    return nn.Dense(5, name="dense")(x_bi), nn.Embed(11, 6, dtype=jnp.float32, name="word_embeddings")(ids)


def _positive_absmax(a: np.ndarray, axis: int) -> np.ndarray:
  """`a` with each slice's largest |value| made positive. That value over its scale is 127.5 by construction, which
  rounds to 128 and saturates at 127; a negative one rounds to -128 or -127 depending on the last bit of the
  division, which XLA may compute as a multiplication by the reciprocal."""
  largest = np.take_along_axis(a, np.argmax(np.abs(a), axis=axis, keepdims=True), axis)
  return a * np.sign(largest)


def _int8_numpy(a: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
  """(int8 values, float32 scale): symmetric, one scale per slice along `axis` (absmax / 127.5), round half to even,
  saturated to int8."""
  scale = np.max(np.abs(a), axis=axis, keepdims=True) / np.float32(127.5)
  return np.clip(np.round(a / scale), -128, 127), scale


def test_dense_layer_and_table_are_int8_forward_with_straight_through_gradients():
  rng = np.random.default_rng(0)
  x_bi = _positive_absmax(rng.normal(size=(4, 7)).astype(np.float32), axis=1)
  ids = np.array([[1, 3, 3], [10, 0, 1]], np.int32)
  layer = _DenseAndTable()
  params = jax.tree.map(np.asarray, nn.unbox(layer.init(jax.random.key(0), ids, x_bi)["params"]))
  params["dense"]["kernel"] = _positive_absmax(params["dense"]["kernel"], axis=0)
  params["dense"]["bias"] = rng.normal(size=5).astype(np.float32)
  params["word_embeddings"]["embedding"] = _positive_absmax(params["word_embeddings"]["embedding"], axis=1)
  qat = quantization.qwix.quantize_model(layer, quantization._QatProvider(quantization.qat_rules()))
  y_cotangent, rows_cotangent = rng.normal(size=(4, 5)).astype(np.float32), rng.normal(size=(2, 3, 6)).astype(
      np.float32)

  def loss(p, x):
    y, rows = qat.apply({"params": p}, ids, x)
    return jnp.sum(y * y_cotangent) + jnp.sum(rows * rows_cotangent), (y, rows)

  (_, (y, rows)), (grads, x_grad) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x_bi)

  # Forward: int8 input per row times int8 kernel per output column, accumulated exactly, scaled back; int8 rows.
  q_x, s_x = _int8_numpy(x_bi, axis=1)
  q_w, s_w = _int8_numpy(params["dense"]["kernel"], axis=0)
  q_t, s_t = _int8_numpy(params["word_embeddings"]["embedding"], axis=1)
  # (The scales to an ulp or two: XLA may divide by 127.5 as a multiplication by its reciprocal.)
  np.testing.assert_allclose(y, (q_x @ q_w) * s_x * s_w + params["dense"]["bias"], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(rows, (q_t * s_t)[ids], rtol=3e-7)
  # The post-training int8 layer computes the same (the same Qwix operations on the same int8 values).
  ptq = quantization.qwix.quantize_model(layer, quantization._Provider(quantization.rules()))
  abstract = jax.eval_shape(lambda: ptq.init(jax.random.key(0), ids, x_bi))["params"]
  int8_y, int8_rows = jax.jit(ptq.apply)({"params": quantization.quantize_params(params, abstract)}, ids, x_bi)
  np.testing.assert_array_equal(y, int8_y)
  np.testing.assert_array_equal(rows, int8_rows)

  # Backward, Q8BERT's straight-through estimator: the rounding passes gradients unchanged, so the matmul's
  # gradients are those of its int8 operands as dequantised, and a table's are those of a plain lookup.
  np.testing.assert_allclose(grads["dense"]["kernel"], (q_x * s_x).T @ y_cotangent, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(x_grad, y_cotangent @ (q_w * s_w).T, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grads["dense"]["bias"], y_cotangent.sum(0), rtol=1e-5)
  table_grad = np.zeros_like(params["word_embeddings"]["embedding"])
  np.add.at(table_grad, ids, rows_cotangent)
  np.testing.assert_allclose(grads["word_embeddings"]["embedding"], table_grad, rtol=1e-6)


def _int8_model(model, params, ids, pack_ids):
  qmodel = quantization.quantized_model(model)
  abstract = jax.eval_shape(lambda: qmodel.init(jax.random.key(0), ids, pack_ids=pack_ids))["params"]
  return qmodel, quantization.quantize_params(params, abstract)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.slow
def test_qat_forward_equals_the_int8_forward_of_the_same_weights(small_model, dtype):
  """Both programs compute the same Qwix operations on the same int8 values and scales (the QAT model keeps its
  kernels and tables float32 in a bfloat16 model, as the int8 model's scales are), so their logits agree to the bit
  (here, and op by op always). Compiled whole, XLA may fuse the float operations between the int8 matmuls (LayerNorm,
  GELU, softmax) differently in the two programs, a few ulps apart; that moves only an activation sitting on a
  rounding boundary, as each row's largest does (over its scale it is 127.5), by one int8 step, against int8's
  rounding of every element: the bound, 2% of the logits' distance from the float model, leaves room for that."""
  model, params, ids, pack_ids = small_model
  model = model.clone(config=SMALL.replace(dtype=dtype))
  int8_model, int8_params = _int8_model(model, params, ids, pack_ids)
  qat_logits = jax.jit(quantization.qat_model(model).apply)({"params": params}, ids, pack_ids=pack_ids)
  int8_logits = jax.jit(int8_model.apply)({"params": int8_params}, ids, pack_ids=pack_ids)
  float_logits = jax.jit(model.apply)({"params": params}, ids, pack_ids=pack_ids)
  assert qat_logits.dtype == int8_logits.dtype == jnp.dtype(dtype)
  qat_logits, int8_logits, float_logits = (np.asarray(x, np.float32) for x in (qat_logits, int8_logits,
                                                                              float_logits))
  int8_error = np.max(np.abs(int8_logits - float_logits))
  assert int8_error > 0
  assert np.max(np.abs(qat_logits - int8_logits)) <= 0.02 * int8_error


@pytest.mark.slow
def test_qat_gradients_reach_every_parameter(small_model):
  model, params, ids, pack_ids = small_model
  qat = quantization.qat_model(model.clone(config=SMALL.replace(dtype="bfloat16")))
  labels = np.array([0, 2])

  def loss(p):
    logits = qat.apply({"params": p}, ids, pack_ids=pack_ids, deterministic=False, rngs={"dropout": jax.random.key(1)})
    return -jnp.sum(jax.nn.log_softmax(logits.astype(jnp.float32))[np.arange(2), labels])

  grads = jax.jit(jax.grad(loss))(params)
  leaves = {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(grads)}
  assert sum(name.endswith("['kernel']") for name in leaves) == SMALL_DENSE_LAYERS
  assert sum(name.endswith("['embedding']") for name in leaves) == SMALL_TABLES
  for name, grad in leaves.items():
    assert grad.dtype == np.float32 and np.all(np.isfinite(grad)), name
    assert np.any(grad != 0), name


@pytest.mark.slow  # a fine-tune, `bert-jax quantize` and `bert-jax evaluate`: about 20 s
def test_qat_finetune_quantizes_and_scores_as_in_training(tiny_model, tmp_path, capsys):
  data = _glue_sst2(tmp_path / "glue", np.random.default_rng(0))
  workdir, out = tmp_path / "qat", tmp_path / "int8"
  results = _finetune("configs/finetune/glue.py:task=sst2", tiny_model, data, workdir, "--config.train.epochs=4",
                      "--config.train.save_checkpoint=True", "--config.quant.qat=True")
  assert json.loads((workdir / "config.json").read_text())["quant"] == {"qat": True}
  # The rule ('good' or 'bad' in the sentence) is learnt through the int8 forward pass.
  qat_accuracy = results["seeds"][0]["selected"]["metrics"]["dev"]["accuracy"]
  assert qat_accuracy > 80.0
  # The run's float parameters quantise as any fine-tuning run's, and the int8 model scores what the QAT model
  # scored in training (the same forward pass: one of the 64 dev predictions may flip on a tie, 1.6 points).
  assert cli.main(["quantize", "--workdir", str(workdir), "--out", str(out)]) == 0
  assert "14 dense layers in int8 and 3 embedding tables in int8" in capsys.readouterr().out
  assert evaluate_lib.main(["--workdir", str(out)]) == 0
  int8_accuracy = json.loads((out / "evaluate_dev.json").read_text())["1"]["dev"]["accuracy"]
  assert abs(int8_accuracy - qat_accuracy) <= 100 / 64


def test_qat_without_qwix_is_one_line_naming_the_key(tmp_path, monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "qwix", None)  # as if the quant extra were not installed
  assert cli.main(["finetune", "--config", "configs/finetune/glue.py:task=sst2", "--workdir", str(tmp_path / "run"),
                   "--config.init.model=unused", "--config.data_dir=unused", "--config.quant.qat=True"]) == 1
  error = capsys.readouterr().err
  assert error.count("\n") == 1 and "config.quant.qat=True needs Qwix" in error and "pip install" in error
