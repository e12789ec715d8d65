"""Task kinds are a table of classes: a new kind, registered in `TASK_KINDS` from outside the package, fine-tunes
through the package's own model, objective, batches and steps with no edit anywhere else."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.models import ModelConfig
from bert_jax.parallel import sharding as sharding_lib
from bert_jax.tasks import kinds
from bert_jax.tasks.base import Task, encode_segments
from bert_jax.tasks.batching import BatchMaker, trim_features
from bert_jax.tasks.finetune_model import FinetuneObjective, build_model, device_fields
from bert_jax.train import config_lib, optim
from bert_jax.train.losses import binary_cross_entropy_sums
from bert_jax.train.step import Partitioning, make_predict_step, make_state_init, make_train_step

TINY = ModelConfig(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                   max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, kernels="off")
TOPICS = ("a", "b", "c")
FIRST_TOPIC_TOKEN = 10  # token 10 + k in an example marks topic k


class TokenMaxHead(nn.Module):
  """One logit per label per token, the row's maximum kept: a label is on where any token shows it."""

  num_labels: int

  @nn.compact
  def __call__(self, hidden_blh, deterministic: bool = True):
    return jnp.max(nn.Dense(self.num_labels, name="classifier")(hidden_blh.astype(jnp.float32)), axis=1)


class MultiLabel(kinds.TaskKind):
  """Any number of labels per example: every token -> one logit per label, max over the row, sigmoid
  cross-entropy per label."""

  name = "multi_label"
  pooled = False  # the head reads every row

  def head(self, config, num_labels):
    return TokenMaxHead(num_labels)

  def loss_weights(self, inputs):
    return inputs["weights"][:, None] * (inputs["labels"] >= 0)

  def terms(self, outputs, inputs):
    loss, correct = binary_cross_entropy_sums(outputs, inputs["labels"], self.loss_weights(inputs))
    return {"task_loss": loss, "task_correct": correct}

  def records(self, labels, predictions, outputs, examples):
    return [{"id": str(index), "labels": chosen} for index, chosen in enumerate(predictions)]


class TopicTask(Task):
  """Rows of token ids whose topics are the marker tokens they hold."""

  name = "toy/topics"
  kind = "multi_label"
  labels = TOPICS

  def load(self, data_dir, split):
    rng = np.random.default_rng(["train", "dev"].index(split))
    rows = 128 if split == "train" else 32
    return [[int(token) for token in rng.integers(3, FIRST_TOPIC_TOKEN, 6)]
            + [FIRST_TOPIC_TOKEN + k for k in range(3) if rng.random() < 0.5] for _ in range(rows)]

  def featurize(self, examples, tokenizer, max_len):
    features = encode_segments(examples, None, tokenizer, max_len)
    features["labels"] = np.array([[float(FIRST_TOPIC_TOKEN + k in example) for k in range(3)] for example in examples],
                                  np.float32)
    return features

  def predict(self, outputs, features, examples):
    return [[name for name, logit in zip(self.labels, row) if logit > 0] for row in outputs]

  def evaluate(self, outputs, features, examples):
    return {"accuracy": 100.0 * float(np.mean((outputs > 0) == (features["labels"] > 0.5)))}


class Specials:
  """The special ids `encode_segments` reads of a tokenizer."""

  cls_id, sep_id, pad_id = 1, 2, 0


@pytest.fixture
def multi_label(monkeypatch):
  monkeypatch.setitem(kinds.TASK_KINDS, MultiLabel.name, MultiLabel)


def test_an_unknown_kind_names_the_key_and_the_known_ones():
  with pytest.raises(ValueError, match=r"Task.kind='toy': expected one of \('classification', 'regression', "):
    kinds.task_kind("toy")


def test_a_kind_added_to_the_table_fine_tunes(multi_label):
  task = TopicTask()
  features = {split: trim_features(task.featurize(task.load(None, split), Specials, 16), task.kind, 16, 12)
              for split in ("train", "dev")}
  assert features["train"]["input_ids"].shape == (128, 12) and task.num_labels == 3
  objective = FinetuneObjective(build_model(TINY, task.kind, task.num_labels), task.kind)
  mesh = sharding_lib.create_mesh({"data": 1}, devices=jax.devices()[:1])
  partitioning = Partitioning(mesh, sharding_lib.DEFAULT_RULES)
  config = config_lib.pretrain_defaults().optim
  config.lr, config.warmup_steps = 1e-2, 2
  tx, schedule = optim.make_optimizer(config, total_steps=80)
  dummy = {key: jnp.asarray(value) for key, value in objective.example_batch(16, 12).items()}
  dummy["labels"] = jnp.zeros((16, 3), jnp.float32)
  init, shardings = make_state_init(lambda key: objective.init_variables(key, dummy), tx, partitioning,
                                    jax.random.key(0))
  state = init(jax.random.key(0))
  assert state.params["head"]["classifier"]["kernel"].shape == (32, 3)
  step = make_train_step(objective, tx, schedule, accum_steps=1, rng=jax.random.key(1), partitioning=partitioning,
                         state_shardings=shardings)
  batches = BatchMaker(device_fields(task.kind), 16, mesh)
  losses = []
  for index in range(80):
    rows = np.arange(16) + 16 * (index % 8)
    state, metrics = step(state, batches(features["train"], rows, 0))
    losses.append(float(metrics["loss"]))
  assert np.mean(losses[-4:]) < 0.1 * np.mean(losses[:4]), losses
  predict = make_predict_step(objective, partitioning, shardings.params)
  outputs = np.concatenate([np.asarray(predict(state.params, batches(features["dev"], np.arange(16) + start, 0)))
                            for start in (0, 16)])
  assert outputs.shape == (32, 3)
  assert task.evaluate(outputs, features["dev"], None)["accuracy"] > 95
  records = kinds.task_kind(task.kind).records(task.labels, task.predict(outputs, features["dev"], None), outputs,
                                               task.load(None, "dev"))
  assert len(records) == 32 and set(records[0]) == {"id", "labels"}
