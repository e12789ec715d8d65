"""Distillation as terms of the one train step: soft targets, BERT-PKD, DistilBERT's cosine loss and layer init."""

import json
import pathlib
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.models import ModelConfig
from bert_jax.tasks.finetune_model import FinetuneModel
from bert_jax.parallel import sharding as sharding_lib
from bert_jax.tasks import evaluate as evaluate_lib
from bert_jax.tasks.finetune_model import FinetuneObjective
from bert_jax.train import checkpoint as checkpoint_lib
from bert_jax.train import config_lib, distill, optim, trainer
from bert_jax.train.losses import soft_target_sums
from bert_jax.train.step import Partitioning, make_state_init, make_train_step
from test_finetune import _finetune, _glue_sst2
from test_trainer import prepared, tiny_config  # noqa: F401 (a fixture)

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                   max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0, kernels="off")
ROWS, LENGTH = 16, 16


CHOICES = 2


def _batch(kind="classification", seed=0):
  rng = np.random.default_rng(seed)
  shape = (ROWS, CHOICES) if kind == "multiple_choice" else (ROWS,)
  lengths = rng.integers(4, LENGTH + 1, shape).astype(np.int32)
  batch = {"input_ids": rng.integers(5, TINY.vocab_size, shape + (LENGTH,)).astype(np.int32),
           "segment_ids": np.zeros(shape + (LENGTH,), np.int32), "lengths": lengths,
           "weights": np.ones(ROWS, np.float32), "seed": np.zeros(ROWS, np.int32)}
  if kind == "regression":
    batch["labels"] = rng.normal(size=ROWS).astype(np.float32)
  elif kind == "span":
    batch["start_positions"] = batch["end_positions"] = rng.integers(0, 4, ROWS).astype(np.int32)
  elif kind == "tagging":
    batch["labels"] = rng.integers(-1, 3, (ROWS, LENGTH)).astype(np.int32)
  else:
    batch["labels"] = rng.integers(0, CHOICES if kind == "multiple_choice" else 3, ROWS).astype(np.int32)
  return batch


def _task(config=TINY, kind="classification"):
  return FinetuneObjective(FinetuneModel(config, kind, 3), kind,
                           num_choices=CHOICES if kind == "multiple_choice" else 0)


def _params(task, seed=0):
  return nn.unbox(task.init_variables(jax.random.key(seed), _batch(task.kind)))["params"]


def _optim_config(lr):
  config = config_lib.pretrain_defaults().optim
  config.lr, config.warmup_steps = lr, 2
  return config


def _setup(objective, tx, frozen=None, teacher=None, mesh_sizes=None, initial=None):
  """(state, shardings, partitioning, mesh); `initial`, a host copy of a state, is placed in the state's shards
  instead of drawing the state again."""
  mesh_sizes = mesh_sizes or {"data": 1}
  mesh = sharding_lib.create_mesh(mesh_sizes, devices=jax.devices()[:int(np.prod(list(mesh_sizes.values())))])
  partitioning = Partitioning(mesh, sharding_lib.DEFAULT_RULES)
  dummy = {k: jnp.asarray(v) for k, v in _batch().items()}
  init, shardings = make_state_init(lambda key: objective.init_variables(key, dummy), tx, partitioning,
                                    jax.random.key(0))
  state = init(jax.random.key(0)) if initial is None else jax.device_put(initial, shardings)
  if teacher is not None:
    placed, frozen_shardings = distill.place_frozen(teacher, frozen, dummy, partitioning)
    state, shardings = state.replace(frozen=placed), shardings.replace(frozen=frozen_shardings)
  return state, shardings, partitioning, mesh


@pytest.mark.parametrize("kind", ["classification", "regression", "span", "multiple_choice", "tagging"])
@pytest.mark.slow
def test_a_student_equal_to_its_teacher_has_zero_distillation_losses(kind):
  """Temperature 1, the teacher's own parameters: KL (or the squared error) 0, PKD 0, cosine 0."""
  task = _task(kind=kind)
  params = _params(task)
  objective = distill.Distillation(task, task, TINY, TINY, temperature=1.0, alpha=0.5, pkd_weight=1.0,
                                   cos_weight=1.0)
  inputs = objective.with_frozen(params, task.prepare(_batch(kind)))
  terms, counts = objective.forward(params, inputs, None, False), objective.denominators(inputs)
  for name in ("soft", "pkd", "cos"):
    assert abs(float(terms[f"{name}_loss"] / counts[name])) < 1e-6, (name, terms)
  assert float(terms["task_loss"]) > 0


def test_soft_targets_are_hintons_kl_with_the_temperature_squared():
  rng = np.random.default_rng(0)
  student, teacher = rng.normal(size=(4, 5)), rng.normal(size=(4, 5))
  t = 3.0
  p = jax.nn.softmax(teacher / t)
  expected = t ** 2 * np.sum(p * (np.log(p) - jax.nn.log_softmax(student / t)))
  np.testing.assert_allclose(float(soft_target_sums(student, teacher, np.ones(4), t)), expected, rtol=1e-5)
  masked = jnp.where(np.arange(5) < 3, teacher, np.finfo(np.float32).min)  # classes the teacher masks add nothing
  assert np.isfinite(float(soft_target_sums(student, masked, np.ones(4), 0.5)))


@pytest.mark.slow
def test_zero_teacher_weights_give_the_plain_step_and_the_teacher_stays_frozen():
  """alpha=0 and pkd 0: the same parameters as the plain step after two steps; the teacher's are untouched."""
  task = _task()
  teacher_params = _params(task, seed=7)
  tx, schedule = optim.make_optimizer(_optim_config(1e-3), total_steps=10)
  plain_state, shardings, partitioning, mesh = _setup(task, tx)
  plain_step = make_train_step(task, tx, schedule, accum_steps=1, rng=jax.random.key(1), partitioning=partitioning,
                               state_shardings=shardings)
  objective = distill.Distillation(task, task, TINY, TINY, temperature=2.0, alpha=0.0)
  state, shardings, partitioning, _ = _setup(objective, tx, teacher_params, task)
  step = make_train_step(objective, tx, schedule, accum_steps=2, rng=jax.random.key(1), partitioning=partitioning,
                         state_shardings=shardings)
  for seed in range(2):
    batch = sharding_lib.global_batch(_batch(seed=seed), mesh)
    plain_state, plain_metrics = plain_step(plain_state, batch)
    state, metrics = step(state, batch)
  assert float(metrics["soft_loss"]) > 0 and "soft_loss" not in plain_metrics
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6),
               state.params, plain_state.params)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.frozen), teacher_params)


@pytest.mark.slow
def test_a_call_of_two_steps_with_the_teacher_equals_two_single_steps():
  """`steps_per_call=2`: the teacher rides in the state through the call (unchanged), and the student's parameters
  and per-step metrics are the single steps'."""
  task = _task()
  teacher_params = _params(task, seed=7)
  tx, schedule = optim.make_optimizer(_optim_config(1e-3), total_steps=10)
  objective = distill.Distillation(task, task, TINY, TINY, temperature=2.0, alpha=0.5, cos_weight=1.0)
  results, initial = [], None
  for steps_per_call in (1, 2):
    state, shardings, partitioning, mesh = _setup(objective, tx, teacher_params, task, initial=initial)
    if initial is None:  # drawn once; before the steps donate it
      initial = jax.device_get(state.replace(frozen=None))
    step = make_train_step(objective, tx, schedule, accum_steps=1, rng=jax.random.key(1), partitioning=partitioning,
                           state_shardings=shardings, steps_per_call=steps_per_call)
    batches = [sharding_lib.global_batch(_batch(seed=seed), mesh) for seed in range(2)]
    if steps_per_call == 1:
      losses = []
      for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["soft_loss"]))
    else:
      state, metrics = step(state, batches)
      losses = [float(x) for x in metrics["soft_loss"]]
    results.append((jax.device_get(state), losses))
  np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6),
               results[0][0].params, results[1][0].params)
  jax.tree.map(np.testing.assert_array_equal, results[1][0].frozen, teacher_params)


@pytest.mark.slow
def test_a_narrower_student_learns_a_projection_and_its_pkd_loss_falls():
  teacher_config = TINY.replace(hidden_size=48, intermediate_size=96)  # wider, as deep (width is what is tested)
  student, teacher = _task(), _task(teacher_config)
  objective = distill.Distillation(student, teacher, TINY, teacher_config, alpha=0.5, pkd_weight=10.0,
                                   cos_weight=1.0, hidden_projection=True)
  assert objective.pkd_layers() == ((1,), (1,))
  tx, schedule = optim.make_optimizer(_optim_config(1e-2), total_steps=20)
  state, shardings, partitioning, mesh = _setup(objective, tx, _params(teacher, seed=3), teacher)
  assert state.params[distill.PROJECTION]["dense"]["kernel"].shape == (32, 48)
  step = make_train_step(objective, tx, schedule, accum_steps=1, rng=jax.random.key(1), partitioning=partitioning,
                         state_shardings=shardings)
  batch = sharding_lib.global_batch(_batch(), mesh)
  losses = []
  for _ in range(15):
    state, metrics = step(state, batch)
    losses.append(float(metrics["pkd_loss"]))
  assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.slow
def test_a_teacher_sharded_by_fsdp_gives_the_single_device_step():
  """The teacher's weights are sharded like the student's and gathered where its modules read them (a teacher as
  deep as the student: sharding, not depth, is what this compares). Both runs start from one initial state, drawn
  once and placed in each mesh's shards (that a sharded init draws the same state: tests/test_train_step.py)."""
  task = _task()
  teacher = _task()
  teacher_params = _params(teacher, seed=5)
  objective = distill.Distillation(task, teacher, TINY, TINY, pkd_weight=1.0, cos_weight=1.0)
  assert objective.pkd_layers() == ((1,), (1,))
  tx, schedule = optim.make_optimizer(_optim_config(1e-2), total_steps=10)
  results, initial = [], None
  for mesh_sizes in ({"data": 1}, {"data": 2, "fsdp": 4}):
    state, shardings, partitioning, mesh = _setup(objective, tx, teacher_params, teacher, mesh_sizes, initial)
    if initial is None:  # before the steps donate it
      initial = jax.device_get(state.replace(frozen=None))
    step = make_train_step(objective, tx, schedule, accum_steps=1, rng=jax.random.key(1), partitioning=partitioning,
                           state_shardings=shardings)
    for seed in range(2):
      state, metrics = step(state, sharding_lib.global_batch(_batch(seed=seed), mesh))
    results.append((jax.device_get(state.params), float(metrics["loss"])))
  np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), results[0][0], results[1][0])


def test_bad_distillation_settings_name_the_key():
  task = _task()
  with pytest.raises(ValueError, match="hidden_projection"):
    distill.Distillation(task, task, TINY, TINY.replace(hidden_size=48), cos_weight=1.0)
  with pytest.raises(ValueError, match="pkd_weight.*multiple"):
    distill.Distillation(task, task, TINY, TINY.replace(num_layers=3), pkd_weight=1.0)
  with pytest.raises(ValueError, match="vocabulary"):
    distill.Distillation(task, task, TINY, TINY.replace(vocab_size=65))
  with pytest.raises(ValueError, match="distill.alpha"):
    distill.Distillation(task, task, TINY, TINY, alpha=1.5)


@pytest.mark.slow
def test_student_starts_from_every_other_teacher_layer():
  from bert_jax.models import PretrainingModel
  teacher_config = TINY.replace(num_layers=4)
  ids = np.zeros((1, 8), np.int32)

  def init(config, seed):
    model = PretrainingModel(config, sentence_head=False)
    variables = model.init(jax.random.key(seed), ids, np.zeros((1, 2), np.int32))
    return jax.tree.map(np.asarray, nn.unbox(variables["params"]))

  teacher, student = init(teacher_config, 1), init(TINY, 2)
  merged = distill.init_from_teacher(student, teacher, TINY, teacher_config)
  for i, j in ((0, 0), (1, 2)):
    jax.tree.map(np.testing.assert_array_equal, merged["encoder"][f"block_{i}"], teacher["encoder"][f"block_{j}"])
  jax.tree.map(np.testing.assert_array_equal, merged["encoder"]["embeddings"], teacher["encoder"]["embeddings"])
  jax.tree.map(np.testing.assert_array_equal, merged["mlm"], teacher["mlm"])
  with pytest.raises(ValueError, match="init_from_teacher"):
    distill.init_from_teacher(student, teacher, TINY, TINY.replace(num_layers=3))
  encoder, config = distill.every_kth_layer(teacher["encoder"], teacher_config, 2, "config.init.layers")
  assert config == TINY and sorted(encoder) == sorted(student["encoder"])
  jax.tree.map(np.testing.assert_array_equal, encoder, merged["encoder"])
  with pytest.raises(ValueError, match="config.init.layers"):
    distill.every_kth_layer(teacher["encoder"], teacher_config, 3, "config.init.layers")
  with pytest.raises(ValueError, match="init_from_teacher.*same width"):
    wide = TINY.replace(hidden_size=48, num_layers=4)
    distill.init_from_teacher(student, init(wide, 3), TINY, wide)


def _train_losses(seed_dir):
  rows = [json.loads(line) for line in (pathlib.Path(seed_dir) / "metrics.jsonl").read_text().splitlines()]
  return [row for row in rows if "train/loss" in row]


@pytest.mark.slow
def test_a_tiny_distilled_finetune_learns_from_its_teacher(tiny_model, sst2_run, tmp_path):
  """A fine-tuned teacher (conftest.py's SST-2 run), then a student distilled from it (soft targets + PKD): the loss
  falls, the student beats chance, its checkpoint is the plain model's (`bert-jax evaluate` reads it), the teacher
  is untouched, and an interrupted multi-seed run trains its unfinished seed again as before, the teacher read
  again."""
  teacher, data = sst2_run
  _, teacher_params = checkpoint_lib.restore_params(teacher / "seed_1")
  student = tmp_path / "student"
  distill_args = [f"--config.distill.teacher={teacher}", "--config.distill.temperature=1.0",
                  "--config.distill.pkd_weight=0.1", "--config.train.epochs=4", "--config.train.save_checkpoint=True",
                  "--config.seeds=(1,2)"]
  results = _finetune("configs/finetune/glue.py:task=sst2", tiny_model, data, student, *distill_args)
  rows = _train_losses(student / "seed_1")
  assert {"train/soft_loss", "train/pkd_loss", "train/task_loss"} <= set(rows[0])
  assert rows[-1]["train/loss"] < 0.7 * rows[0]["train/loss"], rows
  assert f"distilled from: {teacher} (" in (student / "results.md").read_text()
  assert min(seed["selected"]["metrics"]["dev"]["accuracy"] for seed in results["seeds"]) > 75.0
  _, student_params = checkpoint_lib.restore_params(student / "seed_1")
  assert sorted(student_params) == ["encoder", "head"]
  assert evaluate_lib.evaluate_run(student, seeds=[1])[1]["dev"] == results["seeds"][0]["selected"]["metrics"]["dev"]
  _, after = checkpoint_lib.restore_params(teacher / "seed_1")
  jax.tree.map(np.testing.assert_array_equal, after, teacher_params)
  (student / "seed_2" / "result.json").unlink()  # seed 2 did not finish
  resumed = _finetune("configs/finetune/glue.py:task=sst2", tiny_model, data, student, *distill_args)
  assert resumed["seeds"][0] == results["seeds"][0]
  assert resumed["seeds"][1]["history"] == results["seeds"][1]["history"]


def test_fine_tuning_distillation_config_errors_name_the_key(tiny_model, tmp_path):
  data = _glue_sst2(tmp_path / "glue", np.random.default_rng(0))
  with pytest.raises(ValueError, match="config.distill.teacher.*does not exist"):
    _finetune("configs/finetune/glue.py:task=sst2", tiny_model, data, tmp_path / "run",
              f"--config.distill.teacher={tmp_path / 'nowhere'}")
  with pytest.raises(ValueError, match=r"config.distill.teacher does not fit .*fine-tuning workdir(.|\n)*classifier"):
    _finetune("configs/finetune/glue.py:task=sst2", tiny_model, data, tmp_path / "run2",
              f"--config.distill.teacher={tiny_model}")


def _pretrain_losses(workdir):
  rows = [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]
  return {row["step"]: row for row in rows if "train/loss" in row}


@pytest.mark.slow
def test_general_distillation_from_a_pretraining_run_learns_and_resumes_exactly(prepared, mlm_run, tmp_path):
  """A 2-layer teacher pre-trained briefly (conftest.py's MLM run); a 1-layer student from its layer 0 (every other
  layer) learns from its soft MLM targets and hidden states, and a run stopped after a checkpoint resumes to the
  straight run's losses (the teacher read again from its workdir)."""
  teacher = mlm_run

  def student_config(steps):
    config = tiny_config(prepared, objective="mlm", steps=steps, eval_every=steps, log_every=1, checkpoint_every=3)
    config.model.num_layers = 1
    config.distill.teacher = str(teacher)
    config.distill.cos_weight = 1.0
    config.distill.init_from_teacher = True
    return config

  straight = trainer.train_and_evaluate(student_config(8), tmp_path / "straight")
  losses = _pretrain_losses(tmp_path / "straight")
  assert {"train/soft_loss", "train/cos_loss", "train/mlm_loss"} <= set(losses[1])
  assert losses[8]["train/loss"] < losses[1]["train/loss"]
  assert "mlm_loss" in straight["eval"]
  _, teacher_params = checkpoint_lib.restore_params(teacher)
  _, student_params = checkpoint_lib.restore_params(tmp_path / "straight")
  assert sorted(student_params) == sorted(teacher_params)  # the teacher is in no checkpoint of the student
  assert len(student_params["encoder"]) == len(teacher_params["encoder"]) - 1

  shutil.copytree(tmp_path / "straight", tmp_path / "resumed")  # as if stopped after the checkpoint at step 3
  for step in (6, 8):
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / str(step))
  trainer.train_and_evaluate(student_config(8), tmp_path / "resumed")
  resumed = _pretrain_losses(tmp_path / "resumed")
  np.testing.assert_allclose([resumed[s]["train/loss"] for s in range(1, 9)],
                             [losses[s]["train/loss"] for s in range(1, 9)], rtol=1e-6)


def test_pretraining_distillation_config_errors_name_the_key(prepared, tmp_path):
  config = tiny_config(prepared, objective="mlm", steps=2)
  config.distill.teacher = str(tmp_path / "nowhere")
  with pytest.raises(ValueError, match="config.distill.teacher.*does not exist"):
    trainer.train_and_evaluate(config, tmp_path / "run")
  config = tiny_config(prepared, objective="rtd", steps=2)
  config.distill.teacher = str(tmp_path)
  with pytest.raises(ValueError, match="config.objective='rtd'"):
    trainer.train_and_evaluate(config, tmp_path / "run2")


@pytest.mark.slow
def test_a_teacher_without_an_mlm_head_gives_hidden_states_only(tmp_path):
  """A base model (an encoder without heads, as sentence-transformers' MiniLM) teaches through the cosine loss;
  soft targets from it are refused, naming the key."""
  from bert_jax.convert import save_pretrained
  from bert_jax.models import Encoder
  from bert_jax.train import objectives
  from test_train_step import make_config, synthetic_batch, tiny_model as step_model

  config = step_model(num_layers=4, kernels="off")
  params = nn.unbox(jax.jit(Encoder(config).init)(jax.random.key(0), np.zeros((1, 8), np.int32))["params"])
  directory = save_pretrained(tmp_path / "base", "bert", config, jax.tree.map(np.asarray, params))
  student = objectives.make_objective(make_config("mlm"), step_model(kernels="off", sparse_last_layer=False),
                                      mask_id=4)
  teacher, teacher_params = distill.load_pretraining_teacher(str(directory), student)
  assert not teacher.mlm_head and sorted(teacher_params) == ["encoder"]
  with pytest.raises(ValueError, match="config.distill.alpha=0.5"):
    distill.Distillation(student, teacher, student.model_config, teacher.model_config, soft_targets=False)
  objective = distill.Distillation(student, teacher, student.model_config, teacher.model_config, alpha=0.0,
                                   cos_weight=1.0, soft_targets=False)
  assert objective.weights == {"mlm": 1.0, "cos": 1.0}
  # Compiled whole, as in the train step (op by op, every primitive would be compiled on its own).
  inputs = jax.jit(objective.prepare)({k: jnp.asarray(v) for k, v in synthetic_batch().items()})
  student_params = nn.unbox(jax.jit(student.init_variables)(jax.random.key(1), synthetic_batch()))["params"]
  terms = jax.jit(lambda p, frozen, x: objective.forward(p, objective.with_frozen(frozen, x), None, False))(
      student_params, teacher_params, inputs)
  assert sorted(terms) == ["cos_loss", "mlm_correct", "mlm_loss"] and float(terms["cos_loss"]) > 0


def test_checkpoints_keep_the_layout_of_states_without_a_frozen_field(tmp_path):
  """A pre-training checkpoint written before `TrainState.frozen` existed resumes, and one written now is the same
  tree: the teacher never enters it."""
  import flax
  from typing import Any
  from bert_jax.train.step import TrainState, checkpointed

  @flax.struct.dataclass
  class EarlierState:
    step: Any
    params: Any
    opt_state: Any

  earlier = EarlierState(step=jnp.array(3), params={"w": jnp.ones((4,))}, opt_state={"m": jnp.zeros((4,))})
  saver = checkpoint_lib.Checkpointer(tmp_path / "earlier", async_save=False)
  saver.save(3, earlier, {}, {}, force=True)
  now = TrainState(step=jnp.array(0), params={"w": jnp.zeros((4,))}, opt_state={"m": jnp.ones((4,))},
                   frozen={"teacher": jnp.ones((2,))})
  step, restored, _, _ = saver.restore_latest(checkpointed(now))
  assert step == 3 and np.array_equal(TrainState(**restored).params["w"], np.ones(4))
  saver.save(4, checkpointed(now), {}, {}, force=True)
  step, restored, _, _ = saver.restore_latest(earlier)
  assert step == 4 and isinstance(restored, EarlierState) and np.array_equal(restored.params["w"], np.zeros(4))
  saver.close()


@pytest.mark.slow
def test_init_layers_starts_a_shallower_student(tiny_model, sst2_run, tmp_path):
  """`config.init.layers`: the student keeps every k-th layer of its initial model and is recorded so (fewer
  parameters than conftest.py's SST-2 run of the whole model)."""
  data = _glue_sst2(tmp_path / "glue", np.random.default_rng(0))
  results = _finetune("configs/finetune/glue.py:task=sst2", tiny_model, data, tmp_path / "run",
                      "--config.init.layers=1", "--config.train.epochs=1")
  run = json.loads((tmp_path / "run" / "finetune_run.json").read_text())
  assert run["model_config"]["num_layers"] == 1
  full = sst2_run[0]
  assert json.loads((full / "finetune_run.json").read_text())["model_config"]["num_layers"] == 2
  assert results["num_params"] < json.loads((full / "results.json").read_text())["num_params"]
  with pytest.raises(ValueError, match="config.init.layers=3"):
    _finetune("configs/finetune/glue.py:task=sst2", tiny_model, data, tmp_path / "bad", "--config.init.layers=3")
