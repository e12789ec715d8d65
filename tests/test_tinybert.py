"""TinyBERT through the distillation section: attention scores from the model, the layer map, the attention,
hidden-state and embedding losses against numpy, the stages' weights, and a general-then-task-specific run."""

import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.models import Encoder
from bert_jax.models import model as model_lib
from bert_jax.train import config_lib, distill, trainer
from test_distill import ROWS, TINY, _batch, _params, _pretrain_losses, _task
from test_finetune import _finetune, _glue_sst2
from test_trainer import prepared  # noqa: F401 (a fixture)

REPO = pathlib.Path(__file__).resolve().parents[1]
# Deeper and wider than TINY (2 layers, width 32), as many heads: layers 2 and 4 teach the student's 1 and 2.
TEACHER = TINY.replace(num_layers=4, hidden_size=48, intermediate_size=96)


def _stage(stage: str, **overrides):
  config = config_lib.load_config(str(REPO / f"configs/tinybert.py:stage={stage},task=sst2,scale=tiny"))
  config.distill.unlock()
  for key, value in overrides.items():
    config.distill[key] = value
  return config.distill


def _run(objective, params, teacher_params, batch):
  """(loss terms, their denominators, the student's and the teacher's distill outputs), compiled whole."""
  def run(params, teacher_params, batch):
    inputs = objective.with_frozen(teacher_params, objective.prepare(batch))
    outputs = [task.distill_outputs(p, inputs, None, False, attention_scores=bool(objective.attention_weight))
               for task, p in ((objective.student, distill.student_params(params)),
                               (objective.teacher, teacher_params))]
    return objective.forward(params, inputs, None, False), objective.denominators(inputs), outputs

  return jax.device_get(jax.jit(run)(params, teacher_params, {k: jnp.asarray(v) for k, v in batch.items()}))


def _with_projections(objective, params, seed=0):
  """The student's parameters and the objective's learned maps, drawn at random."""
  variables = nn.unbox(jax.jit(objective.init_variables)(jax.random.key(seed), _batch()))["params"]
  return {**variables, **params}


def test_attention_scores_are_the_unnormalised_q_dot_k_and_change_nothing_else():
  """The sown scores are (x W_q + b_q) . (x W_k + b_k) / sqrt(d) of each layer's input, every pair (padding
  included: the loss masks, not the model); the outputs are those of the model without them; init sows nothing;
  the kernels' path refuses to run without them."""
  model = Encoder(TINY)
  rng = np.random.default_rng(0)
  ids = rng.integers(5, TINY.vocab_size, (3, 8)).astype(np.int32)
  pack_ids = (np.arange(8)[None] < np.array([[8], [5], [3]])).astype(np.int32)
  variables = jax.jit(model.init)(jax.random.key(0), ids, pack_ids=pack_ids)
  assert list(variables) == ["params"]
  apply = jax.jit(model.apply, static_argnames=("output_hidden_states", "mutable"))
  plain = apply(variables, ids, pack_ids=pack_ids, output_hidden_states=True)
  outputs, sown = apply(variables, ids, pack_ids=pack_ids, output_hidden_states=True,
                        mutable=(model_lib.SCORES,))
  np.testing.assert_array_equal(outputs["hidden"], plain["hidden"])
  scores = model_lib.attention_scores(sown[model_lib.SCORES], TINY)
  assert len(scores) == TINY.num_layers
  params = jax.device_get(nn.unbox(variables["params"]))
  for layer, layer_scores in enumerate(scores):
    x = np.asarray(plain["hidden_states"][layer], np.float64)
    attention = params[f"block_{layer}"]["attention"]
    q, k = (np.einsum("ble,ehd->blhd", x, attention[name]["kernel"]) + attention[name]["bias"]
            for name in ("query", "key"))
    expected = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(TINY.head_dim)
    np.testing.assert_allclose(layer_scores, expected, rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="kernels='off'"):
    Encoder(TINY.replace(kernels="auto")).apply(variables, ids, pack_ids=pack_ids, mutable=[model_lib.SCORES])


def test_the_uniform_layer_map_and_explicit_ones():
  assert distill.layer_map("uniform", 3, 6) == (2, 4, 6)
  assert distill.layer_map("uniform", 4, 12) == (3, 6, 9, 12)
  assert distill.layer_map("uniform", 2, 2) == (1, 2)
  assert distill.layer_map("1,3,6", 3, 6) == (1, 3, 6)
  with pytest.raises(ValueError, match=r"config.distill.layer_map='uniform'.*layer_map='2,3,4,6'"):
    distill.layer_map("uniform", 4, 6)
  for bad in ("1,2", "0,2,4", "2,4,7", "two,four,six"):
    with pytest.raises(ValueError, match="config.distill.layer_map"):
      distill.layer_map(bad, 3, 6)
  with pytest.raises(ValueError, match="config.distill.layer_map"):
    distill.Distillation(_task(), _task(), TINY, TINY.replace(num_layers=3), hidden_weight=1.0)
  with pytest.raises(ValueError, match="config.distill.attention_weight.*heads"):
    distill.Distillation(_task(), _task(), TINY, TINY.replace(num_heads=4), attention_weight=1.0)
  with pytest.raises(ValueError, match="config.distill.hidden_projection=True"):
    distill.Distillation(_task(), _task(), TINY, TEACHER, embedding_weight=1.0)
  with pytest.raises(ValueError, match="every loss has weight 0"):
    distill.Distillation(_task(), _task(), TINY, TINY, prediction_weight=0.0)


@pytest.mark.parametrize("projection", [False, True])
def test_a_student_equal_to_its_teacher_has_zero_tinybert_losses(projection):
  """The teacher's own weights, layer m on layer m, no maps or identity maps: every loss is 0."""
  task = _task()
  params = _params(task)
  objective = distill.Distillation(task, task, TINY, TINY, temperature=1.0, alpha=1.0, attention_weight=1.0,
                                   hidden_weight=1.0, embedding_weight=1.0, hidden_projection=projection)
  full = dict(params)
  if projection:
    identity = {"dense": {"kernel": np.eye(TINY.hidden_size, dtype=np.float32)}}
    full.update({distill.PROJECTION: identity, distill.EMBEDDING_PROJECTION: identity})
  terms, counts, _ = _run(objective, full, params, _batch())
  for name in ("soft", "attention", "hidden", "embedding"):
    assert abs(float(terms[f"{name}_loss"] / counts[name])) < 1e-6, (name, terms)


@pytest.mark.slow
def test_each_loss_is_its_numpy_mean_squared_error():
  """A 2-layer width-32 student of a 4-layer width-48 teacher (layers 2, 4), random maps, rows of several lengths
  and one row of weight 0: each term / its count against numpy, from the two models' outputs."""
  student, teacher = _task(), _task(TEACHER)
  objective = distill.Distillation(student, teacher, TINY, TEACHER, attention_weight=1.0, hidden_weight=1.0,
                                   embedding_weight=1.0, hidden_projection=True)
  assert objective.mapped_layers() == (2, 4)
  params = _with_projections(objective, _params(student), seed=3)
  batch = _batch(seed=1)
  batch["weights"][0] = 0.0
  terms, counts, (ours, theirs) = _run(objective, params, _params(teacher, seed=5), batch)
  lengths, row_weights = batch["lengths"], batch["weights"]
  real = np.arange(batch["input_ids"].shape[1])[None] < lengths[:, None]  # [B, L]
  token_w = row_weights[:, None] * real
  pair_w = row_weights[:, None, None] * real[:, :, None] * real[:, None, :]  # [B, Q, L]
  w_h = np.asarray(params[distill.PROJECTION]["dense"]["kernel"], np.float64)
  w_e = np.asarray(params[distill.EMBEDDING_PROJECTION]["dense"]["kernel"], np.float64)

  def mse(student, teacher, weights, per):
    return np.sum(np.square(student - teacher) * weights) / (per * np.sum(weights))

  hidden = sum(mse(np.asarray(ours["hidden_states"][m], np.float64) @ w_h, theirs["hidden_states"][g],
                   token_w[..., None], TEACHER.hidden_size) for m, g in ((1, 2), (2, 4)))
  embedding = mse(np.asarray(ours["hidden_states"][0], np.float64) @ w_e, theirs["hidden_states"][0],
                  token_w[..., None], TEACHER.hidden_size)
  attention = sum(mse(np.asarray(ours["attention_scores"][m - 1], np.float64), theirs["attention_scores"][g - 1],
                      pair_w[:, None], TINY.num_heads) for m, g in ((1, 2), (2, 4)))
  for name, expected in (("hidden", hidden), ("embedding", embedding), ("attention", attention)):
    np.testing.assert_allclose(terms[f"{name}_loss"] / counts[name], expected, rtol=1e-4, err_msg=name)
  assert counts["attention"] == TINY.num_heads * np.sum(pair_w)


def test_the_stages_weights_and_the_prediction_layers_soft_cross_entropy():
  """The config's stages: general and intermediate train the three intermediate losses alone, prediction the soft
  targets alone at T=1, whose loss is the cross-entropy to the teacher less the teacher's entropy (numpy); the
  attention loss puts both models on the plain path."""
  student, teacher = _task(TINY.replace(kernels="auto")), _task(TINY.replace(kernels="auto"))
  intermediate = distill.Distillation.from_config(_stage("intermediate", hidden_projection=False), student, teacher)
  assert intermediate.weights == {"task": 0.0, "soft": 0.0, "attention": 1.0, "hidden": 1.0, "embedding": 1.0}
  assert intermediate.student_config.kernels == intermediate.teacher.model.config.kernels == "off"
  prediction = distill.Distillation.from_config(_stage("prediction"), student, teacher)
  assert prediction.weights == {"task": 0.0, "soft": 1.0} and prediction.temperature == 1.0
  assert prediction.student_config.kernels == "auto"
  general = config_lib.load_config(str(REPO / "configs/tinybert.py:stage=general,scale=tiny")).distill
  assert (general.prediction_weight, general.alpha, general.attention_weight, general.hidden_weight,
          general.embedding_weight) == (0.0, 0.0, 1.0, 1.0, 1.0)

  student_params, teacher_params = _params(student), _params(teacher, seed=4)
  terms, counts, (ours, theirs) = _run(prediction, student_params, teacher_params, _batch())
  def log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))

  p, log_q = np.exp(log_softmax(theirs["soft_logits"])), log_softmax(ours["soft_logits"])
  cross_entropy, entropy = -np.sum(p * log_q, axis=-1), -np.sum(p * np.log(p), axis=-1)
  np.testing.assert_allclose(terms["soft_loss"] / counts["soft"], np.mean(cross_entropy - entropy), rtol=1e-4)
  assert counts["soft"] == ROWS


def test_gradients_reach_the_student_both_maps_and_the_head():
  """Every loss on: every parameter leaf of the student's encoder and head and of W_h and W_e gets a gradient."""
  student, teacher = _task(), _task(TEACHER)
  objective = distill.Distillation(student, teacher, TINY, TEACHER, alpha=0.5, attention_weight=1.0,
                                   hidden_weight=1.0, embedding_weight=1.0, hidden_projection=True)
  params = _with_projections(objective, _params(student))
  inputs = {k: jnp.asarray(v) for k, v in _batch().items()}

  def loss(params, teacher_params):
    frozen = objective.with_frozen(teacher_params, objective.prepare(inputs))
    terms, counts = objective.forward(params, frozen, None, False), objective.denominators(frozen)
    return sum(weight * terms[f"{name}_loss"] / counts[name] for name, weight in objective.weights.items())

  grads = jax.device_get(jax.jit(jax.grad(loss))(params, _params(teacher, seed=5)))
  assert sorted(grads) == sorted(["encoder", "head", distill.PROJECTION, distill.EMBEDDING_PROJECTION])
  for path, grad in jax.tree_util.tree_leaves_with_path(grads):
    assert np.any(grad != 0), jax.tree_util.keystr(path)


@pytest.mark.slow
def test_general_distillation_from_a_base_model_without_an_mlm_head():
  """The general stage's weights over an MLM student and a teacher encoder alone (sentence-transformers' MiniLM):
  the attention, hidden and embedding terms, no soft targets, the plain path for both."""
  from bert_jax.train import objectives
  from test_train_step import make_config, synthetic_batch, tiny_model as step_model

  student = objectives.make_objective(make_config("mlm"), step_model(sparse_last_layer=False), mask_id=4)
  teacher_config = step_model(num_layers=4, hidden_size=48, intermediate_size=96)
  teacher = distill.MaskedLMTeacher(model_config=teacher_config, masking=student.masking, mask_id=4,
                                    weights={"mlm": 1.0}, mlm_head=False)
  general = config_lib.load_config(str(REPO / "configs/tinybert.py:stage=general,scale=tiny")).distill
  objective = distill.Distillation.from_config(general, student, teacher, soft_targets=False)
  assert objective.weights == {"mlm": 0.0, "attention": 1.0, "hidden": 1.0, "embedding": 1.0}
  assert objective.student_config.kernels == objective.teacher.model_config.kernels == "off"
  batch = synthetic_batch()
  params = nn.unbox(jax.jit(objective.init_variables)(jax.random.key(1), batch))["params"]
  teacher_params = nn.unbox(jax.jit(teacher.init_variables)(jax.random.key(2), batch))["params"]
  terms = jax.jit(lambda p, frozen, x: objective.forward(p, objective.with_frozen(frozen, objective.prepare(x)),
                                                         None, False))(params, teacher_params, batch)
  assert {"attention_loss", "hidden_loss", "embedding_loss", "mlm_loss"} <= set(terms)
  assert all(float(terms[f"{name}_loss"]) > 0 for name in ("attention", "hidden", "embedding"))


@pytest.mark.slow
def test_general_then_task_specific_tinybert_at_tiny_scale(prepared, mlm_run, tmp_path):  # noqa: F811
  """configs/tinybert.py at scale=tiny: general distillation from a tiny pre-training run (its intermediate losses
  fall), a teacher fine-tuned from that run, then the intermediate stage from the general student and the
  prediction stage from it, each loss falling; the prediction stage starts from the intermediate one's encoder."""
  general = tmp_path / "general"
  config = config_lib.load_config(str(REPO / "configs/tinybert.py:stage=general,scale=tiny"),
                                  [f"--config.distill.teacher={mlm_run}", f"--config.data.prepared={prepared}"])
  trainer.train_and_evaluate(config, general)
  losses = _pretrain_losses(general)
  first, last = losses[min(losses)], losses[max(losses)]
  for name in ("train/attention_loss", "train/hidden_loss", "train/embedding_loss"):
    assert last[name] < first[name], (name, first, last)

  data = _glue_sst2(tmp_path / "glue", np.random.default_rng(0))
  teacher = tmp_path / "teacher"
  _finetune("configs/finetune/glue.py:task=sst2", mlm_run, data, teacher, "--config.train.epochs=2",
            "--config.train.save_checkpoint=True")
  for stage, start in (("intermediate", general), ("prediction", tmp_path / "intermediate")):
    _finetune(f"configs/tinybert.py:stage={stage},task=sst2,scale=tiny", start, data, tmp_path / stage,
              f"--config.distill.teacher={teacher}", "--config.train.save_checkpoint=True",
              "--config.train.log_every=4")
    rows = [json.loads(line) for line in (tmp_path / stage / "seed_1" / "metrics.jsonl").read_text().splitlines()]
    term = "train/attention_loss" if stage == "intermediate" else "train/soft_loss"
    losses = [row[term] for row in rows if term in row]
    assert losses[-1] < losses[0], (stage, losses)
  run = json.loads((tmp_path / "prediction" / "finetune_run.json").read_text())
  assert run["init"]["path"] == str(tmp_path / "intermediate") and run["init"]["source"] == "finetune_run"
