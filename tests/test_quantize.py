"""int8 post-training quantisation (`bert_jax.models.quantization`, `bert-jax quantize`) on CPU.

The rounding of each weight is bounded in closed form; the quantised MiniLM stays close to the float one on a
real sentence; the dense layers' matmuls are int8 with int32 accumulation in the traced program; a quantised
fine-tuned model saves, loads through `bert-jax evaluate`, and keeps its accuracy.
"""

import functools
import json
import re

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax import cli
from bert_jax.models import Encoder, ModelConfig
from bert_jax.tasks.finetune_model import FinetuneModel
from bert_jax.models import quantization
from bert_jax.tasks import evaluate as evaluate_lib
from bert_jax.tasks import quantize as quantize_lib
from bert_jax.tasks.finetune_model import build_model, load_initial_model, merge_initial_params


SMALL = ModelConfig(vocab_size=64, hidden_size=48, num_layers=2, num_heads=3, intermediate_size=96,
                    max_position_embeddings=32, embedding_size=24, kernels="off")
# The dense layers of a FinetuneModel on SMALL: per block query, key, value, output, wi, wo; the embedding
# projection (E != H); the head's pooler and classifier. And its word, position and token-type tables.
SMALL_DENSE_LAYERS = 2 * 6 + 1 + 2
SMALL_TABLES = 3


def _quantized(model: nn.Module, params, *inputs, **kwargs):
  """(quantised model, its int8 params) of a float model and its params."""
  qmodel = quantization.quantized_model(model)
  abstract = jax.eval_shape(lambda: qmodel.init(jax.random.key(0), *inputs, **kwargs))["params"]
  return qmodel, quantization.quantize_params(params, abstract)


def _equations(jaxpr):
  """Every equation of a jaxpr, those of the jaxprs inside it (jit, custom rules...) included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for inner in param if isinstance(param, (list, tuple)) else [param]:
        inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's
        if hasattr(inner, "eqns"):
          yield from _equations(inner)


@pytest.fixture(scope="module")
def small_model():
  """A random classification model with widely varying output-channel magnitudes, its params and inputs."""
  ids = np.random.default_rng(0).integers(5, 64, (2, 12)).astype(np.int32)
  pack_ids = (np.arange(12) < np.array([[12], [7]])).astype(np.int32)
  model = FinetuneModel(SMALL, "classification", 3)
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), ids, pack_ids=pack_ids)["params"])
  # Each output channel of each kernel, and each row of each table, scaled by its own factor in [0.01, 10]: the
  # per-channel and per-row scales must follow it.
  def gain(path, x):
    if path[-1].key == "kernel":
      return x * np.geomspace(0.01, 10, x.shape[-1], dtype=np.float32)
    return x * np.geomspace(0.01, 10, x.shape[0], dtype=np.float32)[:, None] if path[-1].key == "embedding" else x

  params = jax.tree_util.tree_map_with_path(gain, jax.tree.map(np.asarray, params))
  return model, params, ids, pack_ids


@pytest.mark.slow
def test_rounding_error_is_at_most_half_a_scale_per_output_channel(small_model):
  model, params, ids, pack_ids = small_model
  _, quantized = _quantized(model, params, ids, pack_ids=pack_ids)
  assert quantization.quantized_counts(quantized) == {"dense_layers": SMALL_DENSE_LAYERS,
                                                     "embedding_tables": SMALL_TABLES}
  leaves = lambda tree: {jax.tree_util.keystr(path): leaf  # noqa: E731
                         for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
  flat_float, flat_quantized = leaves(params), leaves(quantized)
  flat_restored = leaves(quantization.dequantize(quantized))
  # A kernel's int8 values and scales sit under ".array" (Qwix's WithAux), a table's under its own name.
  quantized_names = {name.removesuffix(".qvalue"): name.removesuffix(".qvalue").removesuffix(".array")
                     for name in flat_quantized if name.endswith(".qvalue")}
  assert sum(name.endswith("['kernel']") for name in quantized_names.values()) == SMALL_DENSE_LAYERS
  assert sum(name.endswith("['embedding']") for name in quantized_names.values()) == SMALL_TABLES
  for stored_name, name in quantized_names.items():
    qvalue, scale = flat_quantized[stored_name + ".qvalue"], np.asarray(flat_quantized[stored_name + ".scale"])
    weight, dequantized = flat_float[name], np.asarray(flat_restored[name])
    assert qvalue.dtype == np.int8 and np.all(np.abs(np.asarray(qvalue)) <= 127)
    # The axes one scale spans: a Dense kernel [in, out] and attention's query/key/value [in, heads, head size]
    # its input, attention's output projection [heads, head size, out] its two, a table [rows, E] a row's E.
    in_axes = (0, 1) if "['output']" in name else (1,) if name.endswith("['embedding']") else (0,)
    # Closed form: one scale per output feature (per table row), its largest |weight| mapped to 127.5 (Qwix's
    # symmetric bound; round-to-nearest then saturates at 127), so every weight is off by at most scale / 2
    np.testing.assert_allclose(scale, np.max(np.abs(weight), axis=in_axes, keepdims=True) / 127.5, rtol=1e-6)
    # (plus float32 rounding of q * scale, a few ulps of the weight)
    assert np.all(np.abs(weight - dequantized) <= scale / 2 + 4 * np.finfo(np.float32).eps * np.abs(weight)), name
  # Everything else (LayerNorms, biases) is kept as it was.
  for name, leaf in flat_restored.items():
    if name not in quantized_names.values():
      np.testing.assert_array_equal(leaf, flat_float[name])


def test_dense_matmuls_are_int8_with_int32_accumulation(small_model):
  model, params, ids, pack_ids = small_model
  qmodel, quantized = _quantized(model, params, ids, pack_ids=pack_ids)
  apply = lambda p: qmodel.apply({"params": p}, ids, pack_ids=pack_ids)  # noqa: E731
  equations = list(_equations(jax.make_jaxpr(apply)(quantized).jaxpr))
  dots = [eqn for eqn in equations if eqn.primitive.name == "dot_general"]
  int8 = [eqn for eqn in dots if [v.aval.dtype for v in eqn.invars] == [np.int8, np.int8]]
  assert len(int8) == SMALL_DENSE_LAYERS
  assert all(eqn.params["preferred_element_type"] == np.int32 and eqn.outvars[0].aval.dtype == np.int32
             for eqn in int8)
  # Attention's scores and weighted values (two per block) stay float, as in Q8BERT.
  assert len(dots) - len(int8) == 2 * SMALL.num_layers
  # The tables are gathered in int8 (each lookup scales only its rows).
  gathers = [eqn for eqn in equations if eqn.primitive.name == "gather"]
  assert sum(eqn.invars[0].aval.dtype == np.int8 for eqn in gathers) == SMALL_TABLES
  # The lowered program XLA compiles holds the same: s8 x s8 -> s32 dots, one per dense layer.
  hlo = jax.jit(apply).lower(quantized).as_text()
  assert len(re.findall(r"stablehlo\.dot_general.*tensor<[^>]*xi8>, tensor<[^>]*xi8>\) -> tensor<[^>]*xi32>",
                        hlo)) == SMALL_DENSE_LAYERS
  # The storage round trip gives the same tree, and the same logits.
  stored = jax.tree.map(np.asarray, quantization.to_storage(quantized))
  abstract = jax.eval_shape(lambda: qmodel.init(jax.random.key(0), ids, pack_ids=pack_ids))["params"]
  compiled_apply = jax.jit(apply)  # op by op, each primitive would be compiled on its own
  np.testing.assert_array_equal(compiled_apply(quantization.from_storage(abstract, stored)), compiled_apply(quantized))
  # The float model with the dequantised weights is what the int8 kernels stand for: close, not equal (the
  # activations are rounded too).
  float_logits = jax.jit(model.apply)({"params": params}, ids, pack_ids=pack_ids)
  assert 0 < np.max(np.abs(compiled_apply(quantized) - float_logits)) < 0.1 * np.max(np.abs(float_logits))


def _dense_inputs_absmax(model, params, batches):
  """{module path: the largest |input| of that Dense layer over `batches`}, read by flax's method interception
  (no Qwix): the reference for the static scales."""
  found = {}

  def record(next_fun, args, kwargs, context):
    if context.method_name == "__call__" and isinstance(context.module, (nn.Dense, nn.DenseGeneral)):
      path = "/".join(context.module.path)
      found[path] = max(found.get(path, 0.0), float(np.max(np.abs(np.asarray(args[0], np.float32)))))
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    for ids, pack_ids in batches:
      model.apply({"params": params}, ids, pack_ids=pack_ids)
  return found


@pytest.mark.parametrize("name,bound", [("int8-static", 127.5), ("fp8-static", 448.0)])
def test_static_scales_are_the_largest_input_over_the_calibration_batches(small_model, name, bound):
  """Each layer input's scale is its largest |value| over every calibration batch over the format's largest value
  (int8: 127.5, as Qwix's symmetric int8 rounds; e4m3: 448), one number per input; the quantised model then
  computes no reduction of its own (the float model's softmax maxima are all it has) and stays close to float."""
  model, params, ids, pack_ids = small_model
  scheme = quantization.Scheme.parse(name)
  batches = [(ids[:1], pack_ids[:1]), (ids[1:] * 0 + 9, pack_ids[1:])]
  calibrating = quantization.calibrating_model(model, scheme)
  stats = jax.jit(lambda p, i, k: calibrating.apply({"params": p}, i, pack_ids=k, mutable=["quant_stats"])[1])
  calibration = quantization.merge_calibrations(*(stats(params, batch_ids, batch_pack)["quant_stats"]
                                                  for batch_ids, batch_pack in batches))
  reference = _dense_inputs_absmax(model, params, batches)
  assert len(reference) == SMALL_DENSE_LAYERS

  qmodel = quantization.quantized_model(model, scheme)
  abstract = jax.eval_shape(lambda: qmodel.init(jax.random.key(0), ids, pack_ids=pack_ids))["params"]
  quantized = quantization.quantize_params(params, abstract, calibration)
  flat = flax.traverse_util.flatten_dict(quantized)
  scales = {"/".join(path[:-1]): leaf.array for path, leaf in flat.items() if path[-1] == "dot_general0_lhs_scale"}
  assert scales.keys() == reference.keys()
  for path, absmax in reference.items():
    assert scales[path].size == 1
    np.testing.assert_allclose(float(scales[path].reshape(())), absmax / bound, rtol=1e-6, err_msg=path)

  apply = lambda model_, p: model_.apply({"params": p}, ids, pack_ids=pack_ids)  # noqa: E731
  def reductions(model_, p):
    equations = _equations(jax.make_jaxpr(functools.partial(apply, model_))(p).jaxpr)
    return sum(eqn.primitive.name in ("reduce_max", "argmax") for eqn in equations)
  assert reductions(qmodel, quantized) == reductions(model, params)
  dynamic, dynamic_params = _quantized(model, params, ids, pack_ids=pack_ids)
  assert reductions(dynamic, dynamic_params) > reductions(model, params)  # a per-token absmax before each matmul
  float_logits = jax.jit(model.apply)({"params": params}, ids, pack_ids=pack_ids)
  logits = jax.jit(functools.partial(apply, qmodel))(quantized)
  assert 0 < np.max(np.abs(logits - float_logits)) < 0.1 * np.max(np.abs(float_logits))
  # Without the calibration of every input, no tree: a static scale left at its initial value would be wrong.
  with pytest.raises(ValueError, match="missing 2 of 15"):
    quantization.quantize_params(params, abstract, {**calibration, "head": {}})


def test_fp8_scheme_multiplies_in_float8(small_model):
  model, params, ids, pack_ids = small_model
  qmodel = quantization.quantized_model(model, quantization.Scheme.parse("fp8"))
  abstract = jax.eval_shape(lambda: qmodel.init(jax.random.key(0), ids, pack_ids=pack_ids))["params"]
  quantized = quantization.quantize_params(params, abstract)
  equations = _equations(jax.make_jaxpr(lambda p: qmodel.apply({"params": p}, ids, pack_ids=pack_ids))(
      quantized).jaxpr)
  fp8 = [eqn for eqn in equations if eqn.primitive.name == "dot_general"
         and [v.aval.dtype for v in eqn.invars] == [jnp.float8_e4m3fn] * 2]
  assert len(fp8) == SMALL_DENSE_LAYERS
  assert quantization.quantized_counts(quantized) == {"dense_layers": SMALL_DENSE_LAYERS,
                                                     "embedding_tables": SMALL_TABLES}
  with pytest.raises(ValueError, match="FORMAT-static"):
    quantization.Scheme.parse("fp8-dynamic")
  with pytest.raises(ValueError, match="choose one of"):
    quantization.Scheme.parse("int4")


@pytest.mark.slow
def test_bfloat16_model_stays_bfloat16_after_its_dense_layers():
  config = SMALL.replace(dtype="bfloat16")
  ids, pack_ids = np.full((2, 8), 7, np.int32), np.ones((2, 8), np.int32)
  model = FinetuneModel(config, "span")
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), ids, pack_ids=pack_ids)["params"])
  qmodel, quantized = _quantized(model, params, ids, pack_ids=pack_ids)
  start, end = jax.jit(qmodel.apply)({"params": quantized}, ids, pack_ids=pack_ids)
  assert start.dtype == end.dtype == jax.numpy.bfloat16
  # Every float matmul (attention's) still takes bfloat16 operands, as in the float model.
  jaxpr = jax.make_jaxpr(lambda p: qmodel.apply({"params": p}, ids, pack_ids=pack_ids))(quantized).jaxpr
  dots = [[v.aval.dtype for v in eqn.invars] for eqn in _equations(jaxpr) if eqn.primitive.name == "dot_general"]
  assert dots and all(dtypes in ([np.int8, np.int8], [jax.numpy.bfloat16] * 2) for dtypes in dots)


@pytest.mark.parametrize("kind, shape, options, dense_layers", [
    ("tagging", (2, 8), dict(top_bilstm=True), 2 * 6 + 1),  # the BiLSTM's cells stay float
    ("multiple_choice", (2, 3, 8), {}, 2 * 6 + 2),
    ("tagging", (2, 8), dict(feature_layers=(-1, -2), feature_head="mlp", feature_head_layers=1), 2 * 6 + 2),
    ("regression", (2, 8), dict(albert=True), 6 + 1 + 2),  # one shared block, the embedding projection
])
@pytest.mark.slow
def test_every_task_kind_quantises_close_to_float(kind, shape, options, dense_layers):
  config = SMALL.replace(embedding_size=None, num_shared_groups=0)
  if options.pop("albert", False):
    config = SMALL.replace(num_shared_groups=1)
  model = build_model(config, kind, 4, **options)
  ids, pack_ids = np.random.default_rng(1).integers(5, 64, shape).astype(np.int32), np.ones(shape, np.int32)
  # Compiled whole: op by op, the BiLSTM's and the quantised matmuls' every primitive would be compiled on its own.
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), ids, pack_ids=pack_ids)["params"])
  qmodel, quantized = _quantized(model, params, ids, pack_ids=pack_ids)
  assert quantization.quantized_counts(quantized) == {"dense_layers": dense_layers, "embedding_tables": 3}
  outputs = np.asarray(jax.jit(model.apply)({"params": params}, ids, pack_ids=pack_ids))
  int8_outputs = np.asarray(jax.jit(qmodel.apply)({"params": quantized}, ids, pack_ids=pack_ids))
  assert int8_outputs.shape == outputs.shape
  assert np.max(np.abs(int8_outputs - outputs)) < 0.1 * np.max(np.abs(outputs))


def test_stored_tree_of_another_model_is_refused_naming_the_array(small_model):
  model, params, ids, pack_ids = small_model
  qmodel, quantized = _quantized(model, params, ids, pack_ids=pack_ids)
  stored = quantization.to_storage(quantized)
  del stored["head"]["classifier"]["kernel"]["array"]["scale"]
  abstract = jax.eval_shape(lambda: qmodel.init(jax.random.key(0), ids, pack_ids=pack_ids))["params"]
  with pytest.raises(ValueError, match="head/classifier/kernel/array/scale: expected"):
    quantization.from_storage(abstract, stored)


@pytest.mark.slow
def test_int8_minilm_stays_close_to_float_on_a_real_sentence(minilm_dir):
  """Tolerances: int8 rounding of every dense layer's weights (per output feature) and inputs (per token) and of
  the embedding rows perturbs each of MiniLM's 38 dense layers by about absmax / (127.5 * sqrt(12) * rms) of its
  operands, 1-3% for these heavy-tailed weights and activations, and the errors add up along the residual stream:
  the last hidden states come out about 8% off in L2 (cosine >= 0.993 per token). A freshly initialised classifier
  reads the pooled [CLS] vector along a random direction, which sees that error as much as the signal (about 12%);
  a fine-tuned one reads the signal's directions (the SST-2 test below checks its accuracy). The bounds (0.985 and
  15% on the hidden states, 25% on the logits) leave room for other summation orders, while weight scales only
  10% off already put the hidden states 46% away."""
  initial = load_initial_model(minilm_dir)
  config = initial.config.replace(kernels="off")
  tokenizer = initial.tokenizer
  text = "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill."
  ids = np.array([[tokenizer.cls_id, *tokenizer.encode(text), tokenizer.sep_id]], np.int32)
  pack_ids = np.ones_like(ids)
  model = FinetuneModel(config, "classification", 3)
  # Each program compiled whole (op by op, every primitive of the 6-layer model would be compiled on its own).
  init = jax.tree.map(np.asarray, nn.unbox(jax.jit(model.init)(jax.random.key(0), ids, pack_ids=pack_ids)["params"]))
  params, reused, _ = merge_initial_params(init, initial.params)
  assert reused  # MiniLM's pooler
  qmodel, quantized = _quantized(model, params, ids, pack_ids=pack_ids)
  assert quantization.quantized_counts(quantized) == {"dense_layers": 6 * config.num_layers + 2,
                                                     "embedding_tables": 3}

  encoder, qencoder = Encoder(config), quantization.quantized_model(Encoder(config))
  hidden = jax.jit(encoder.apply)({"params": params["encoder"]}, ids, pack_ids=pack_ids)["hidden"][0]
  qhidden = jax.jit(qencoder.apply)({"params": quantized["encoder"]}, ids, pack_ids=pack_ids)["hidden"][0]
  cosine = np.sum(hidden * qhidden, -1) / np.linalg.norm(hidden, axis=-1) / np.linalg.norm(qhidden, axis=-1)
  assert cosine.min() > 0.985
  assert 0 < np.linalg.norm(qhidden - hidden) / np.linalg.norm(hidden) < 0.15

  logits = jax.jit(model.apply)({"params": params}, ids, pack_ids=pack_ids)
  qlogits = jax.jit(qmodel.apply)({"params": quantized}, ids, pack_ids=pack_ids)
  assert 0 < np.linalg.norm(qlogits - logits) / np.linalg.norm(logits) < 0.25
  # Nearly 4x smaller: every kernel and table in int8 plus a float32 scale per output feature or row; LayerNorms
  # and biases stay float32.
  float_bytes, int8_bytes = quantization.param_bytes(params), quantization.param_bytes(quantized)
  assert 3.8 < float_bytes / int8_bytes < 4


@pytest.mark.slow
def test_quantized_run_saves_loads_and_evaluates_close_to_float(sst2_run, tmp_path, capsys):
  """On conftest.py's fine-tuned tiny SST-2 run."""
  workdir, _ = sst2_run
  results = json.loads((workdir / "results.json").read_text())
  float_accuracy = results["seeds"][0]["selected"]["metrics"]["dev"]["accuracy"]
  assert float_accuracy > 80.0
  out = tmp_path / "int8"
  assert cli.main(["quantize", "--workdir", str(workdir), "--out", str(out)]) == 0
  printed = capsys.readouterr().out
  assert "14 dense layers in int8 and 3 embedding tables in int8" in printed and "bert-jax evaluate --workdir" in printed
  report = json.loads((out / "quantization.json").read_text())
  assert report["seed"] == 1 and report["quantized"] == {"dense_layers": 2 * 6 + 2, "embedding_tables": 3}
  assert report["library"].startswith("qwix ")
  assert report["param_bytes"]["quantized"] < report["param_bytes"]["float"]
  assert report["disk_bytes"]["quantized"] < report["disk_bytes"]["float"]
  assert json.loads((out / "finetune_run.json").read_text())["model_config"]["kernels"] == "off"

  assert evaluate_lib.main(["--workdir", str(out)]) == 0
  int8_accuracy = json.loads((out / "evaluate_dev.json").read_text())["1"]["dev"]["accuracy"]
  assert "seed 1 dev: accuracy=" in capsys.readouterr().out
  # 64 dev rows: a 3-point drop is two predictions.
  assert int8_accuracy >= float_accuracy - 3.2
  # Sharded over FSDP and tensor parallelism (every scale placed by its own shape), the same predictions.
  config = json.loads((out / "config.json").read_text())
  config["mesh"]["sizes"] = {"data": 2, "fsdp": 2, "tensor": 2}
  (out / "config.json").write_text(json.dumps(config))
  assert evaluate_lib.evaluate_run(out)[1]["dev"]["accuracy"] == int8_accuracy

  objective, params = quantize_lib.load_quantized(out)
  assert quantization.quantized_counts(params) == report["quantized"]
  batch = objective.example_batch(4, 16)
  logits = objective.predict(params, objective.prepare(batch))
  assert logits.shape == (4, 2) and np.all(np.isfinite(logits))


@pytest.mark.slow
def test_static_fp8_run_calibrates_on_training_rows_and_evaluates_close_to_float(sst2_run, tmp_path, capsys):
  workdir, data = sst2_run
  float_accuracy = json.loads((workdir / "results.json").read_text())["seeds"][0]["selected"]["metrics"]["dev"][
      "accuracy"]
  out = tmp_path / "fp8"
  assert cli.main(["quantize", "--workdir", str(workdir), "--out", str(out), "--scheme", "fp8-static",
                   "--calibration-examples", "40"]) == 0
  assert "14 dense layers in fp8-static" in capsys.readouterr().out
  report = json.loads((out / "quantization.json").read_text())
  assert report["scheme"] == {"format": "fp8", "activations": "static"}
  assert report["calibration"]["examples"] == 40 and report["calibration"]["split"] == "train"
  assert evaluate_lib.main(["--workdir", str(out)]) == 0
  assert json.loads((out / "evaluate_dev.json").read_text())["1"]["dev"]["accuracy"] >= float_accuracy - 3.2
  objective, params = quantize_lib.load_quantized(out)
  assert objective.model.config.kernels == "off"
  hlo = jax.jit(lambda p: objective.predict(p, objective.prepare(objective.example_batch(4, 16)))).lower(
      params).as_text()
  assert len(re.findall(r"stablehlo\.dot_general.*tensor<[^>]*xf8E4M3FN>, tensor<[^>]*xf8E4M3FN>\)", hlo)) == 14
  # Calibration reads the training split: where it is not, one line says what to give.
  assert cli.main(["quantize", "--workdir", str(workdir), "--out", str(tmp_path / "x"), "--scheme", "int8-static",
                   "--data-dir", str(tmp_path / "nowhere")]) == 1
  err = capsys.readouterr().err
  assert "--data-dir" in err and len(err.strip().splitlines()) == 1
  assert not (tmp_path / "x").exists()


def test_quantize_refuses_a_quantized_folder_and_a_used_out(sst2_run, tmp_path, capsys):
  workdir, _ = sst2_run
  out = tmp_path / "int8"
  quantize_lib.quantize_run(workdir, out)
  assert cli.main(["quantize", "--workdir", str(out), "--out", str(tmp_path / "again")]) == 1
  assert "is already quantised" in capsys.readouterr().err
  assert cli.main(["quantize", "--workdir", str(workdir), "--out", str(out)]) == 1
  assert "is not empty" in capsys.readouterr().err
  assert cli.main(["quantize", "--workdir", str(workdir), "--out", str(tmp_path / "x"), "--seed", "7"]) == 1
  assert "--seed 7" in capsys.readouterr().err
