"""Knowledge distillation: a frozen teacher's outputs as extra loss terms of the one train step.

`Distillation` wraps a task (a pre-training objective or a fine-tuning
objective) and adds up to three terms to its own, each a sum that the step
divides by its count:

  soft  the teacher's soft targets at temperature T: T**2 * KL(teacher || student)
        per prediction (Hinton et al. 2015; DistilBERT's L_ce on masked tokens);
        for regression (STS-B) the squared error to the teacher's value;
  pkd   BERT-PKD's patient loss: the distance between the unit-normalised [CLS]
        states of student layer i and teacher layer k * i, i = 1 .. L_student - 1,
        k = L_teacher / L_student ("PKD-skip"), per example;
  cos   DistilBERT's 1 - cos(student, teacher) of the last hidden states, per token.

The weights: the task's own terms (1 - alpha), soft alpha, pkd pkd_weight,
cos cos_weight. A student narrower than its teacher compares hidden states
through a learned linear map (TinyBERT's W_h, `hidden_projection`), trained with
the student and kept beside its parameters under "distill_projection".

The teacher's parameters are `TrainState.frozen`: the step runs the teacher in
evaluation mode inside the same jitted step (`with_frozen`), with no gradient,
no optimizer state and no checkpoint; a resumed run reads them again from
`distill.teacher`. The wrapped task must offer `distill_outputs`,
`soft_weights`, `row_weights`, `token_weights` and `soft_regression`
(`PretrainingObjective`, `FinetuneObjective`).

The config's `distill` section (pre-training and fine-tuning alike):
  teacher            path of the teacher (None: no distillation): a fine-tuning workdir (its best seed) or a
                     converted / Hugging Face model with the task's head; for pre-training a pre-training workdir
                     or a converted / Hugging Face model with its MLM head (a base model without one gives no soft
                     targets: alpha 0, its hidden states through cos_weight only).
  temperature        T of the soft targets.
  alpha              weight of the soft loss; the task's own terms (hard labels, MLM) get 1 - alpha.
  pkd_weight         weight of the PKD loss (0: off).
  cos_weight         weight of the hidden-state cosine loss (0: off).
  hidden_projection  learn a linear map from the student's width to the teacher's for pkd / cos.
  init_from_teacher  (pre-training) the student starts from the teacher: embeddings, heads, and teacher layers
                     0, k, 2k, ... in its layers 0, 1, 2, ... (DistilBERT: every other layer).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from ml_collections import config_dict

from bert_jax.models import Encoder, ModelConfig, PretrainingModel
from bert_jax.parallel import sharding as sharding_lib
from bert_jax.train.objectives import PretrainingObjective
from bert_jax.train.losses import (cosine_distance_sums, normalized_distance_sums, soft_target_sums,
                                   squared_error_sums)

Array = jax.Array
PROJECTION = "distill_projection"
# Pre-training objectives whose MLM logits a teacher's soft targets apply to.
PRETRAINING_OBJECTIVES = ("mlm", "mlm+nsp", "mlm+sop", "mlm+sbo")


def config_section(pretraining: bool) -> ml_collections.ConfigDict:
  """The `distill` section of the defaults (see the module docstring); off while `teacher` is None."""
  section = ml_collections.ConfigDict(dict(
      teacher=config_dict.placeholder(str), temperature=2.0, alpha=0.5, pkd_weight=0.0, cos_weight=0.0,
      hidden_projection=False))
  if pretraining:
    section.init_from_teacher = False
  return section


def skip_layers(student_layers: int, teacher_layers: int, key: str = "config.distill.pkd_weight") -> int:
  """k of PKD-skip (student layer i <-> teacher layer k * i); the teacher's depth must be a multiple."""
  if teacher_layers % student_layers:
    raise ValueError(f"{key}: a student of {student_layers} layers cannot map onto a teacher of {teacher_layers} "
                     f"layers (layer i to layer k * i needs the teacher's depth to be a multiple of the student's)")
  return teacher_layers // student_layers


class EncoderOnly(nn.Module):
  """A teacher without an MLM head: its encoder's hidden states only (params {"encoder": ...})."""

  config: ModelConfig

  @nn.compact
  def __call__(self, input_ids: Array, mlm_positions: Array, *, segment_ids: Array | None = None,
               position_ids: Array | None = None, pack_ids: Array | None = None, packed: bool = False,
               deterministic: bool = True, output_hidden_states: bool = False) -> dict[str, Any]:
    del mlm_positions
    return Encoder(self.config, name="encoder")(input_ids, segment_ids, position_ids, pack_ids, packed=packed,
                                                deterministic=deterministic,
                                                output_hidden_states=output_hidden_states)


@dataclasses.dataclass(frozen=True)
class MaskedLMTeacher(PretrainingObjective):
  """A pre-training teacher: its encoder and MLM head (a sentence head it may have is not read), or with
  `mlm_head=False` its encoder alone, which gives hidden states and no soft targets."""

  mlm_head: bool = True

  @property
  def model(self) -> nn.Module:
    return PretrainingModel(self.model_config, sentence_head=False) if self.mlm_head else EncoderOnly(
        self.model_config)

  def distill_outputs(self, params, inputs, rng, train):
    if self.mlm_head:
      return super().distill_outputs(params, inputs, rng, train)
    outputs = self.apply({"params": params}, inputs, train, rngs=self.rngs(rng, train), output_hidden_states=True)
    return {"terms": {}, "soft_logits": None, "hidden_states": outputs["hidden_states"]}


class HiddenProjection(nn.Module):
  """TinyBERT's W_h: student hidden states [..., H_student] -> the teacher's width [..., H_teacher]."""

  features: int
  initializer_range: float = 0.02

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kernel_init = nn.with_logical_partitioning(nn.initializers.normal(self.initializer_range), ("embed", None))
    return nn.Dense(self.features, use_bias=False, kernel_init=kernel_init, name="dense")(x.astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class Distillation:
  """A task with the teacher's terms added (see the module docstring); the step's `Task` with `with_frozen`.

  Attributes:
    student: the task being trained.
    teacher: the same task on the teacher's model (its `distill_outputs` run on `TrainState.frozen`).
    student_config, teacher_config: the two encoders.
    temperature, alpha, pkd_weight, cos_weight: as the config's keys.
    hidden_projection: learn `HiddenProjection` (the widths differ).
    soft_targets: the teacher has a head to give them (False: an encoder alone, alpha must be 0).
  """

  student: Any
  teacher: Any
  student_config: ModelConfig
  teacher_config: ModelConfig
  temperature: float = 2.0
  alpha: float = 0.5
  pkd_weight: float = 0.0
  cos_weight: float = 0.0
  hidden_projection: bool = False
  soft_targets: bool = True

  def __post_init__(self):
    if self.temperature <= 0:
      raise ValueError(f"config.distill.temperature={self.temperature} must be positive")
    if not 0.0 <= self.alpha <= 1.0:
      raise ValueError(f"config.distill.alpha={self.alpha} must be in [0, 1]")
    if not self.soft_targets and self.alpha:
      raise ValueError(f"config.distill.alpha={self.alpha}: the teacher has no head to give soft targets; set "
                       "config.distill.alpha=0 to distil its hidden states only (cos_weight, pkd_weight)")
    for key in ("pkd_weight", "cos_weight"):
      if getattr(self, key) < 0:
        raise ValueError(f"config.distill.{key}={getattr(self, key)} must be >= 0")
    if self.student_config.vocab_size != self.teacher_config.vocab_size:
      raise ValueError(f"config.distill.teacher: its vocabulary of {self.teacher_config.vocab_size} tokens differs "
                       f"from the student's {self.student_config.vocab_size}; the two must share a tokenizer")
    if self.pkd_weight:
      if self.student_config.num_layers < 2:
        raise ValueError("config.distill.pkd_weight: a 1-layer student has no intermediate layer to match; "
                         "set it to 0")
      skip_layers(self.student_config.num_layers, self.teacher_config.num_layers)
    widths = self.student_config.hidden_size, self.teacher_config.hidden_size
    if (self.pkd_weight or self.cos_weight) and widths[0] != widths[1] and not self.hidden_projection:
      raise ValueError(f"config.distill: the student's width {widths[0]} differs from the teacher's {widths[1]}; "
                       "set config.distill.hidden_projection=True to learn a map between them (or pkd_weight and "
                       "cos_weight to 0)")

  @property
  def weights(self) -> dict[str, float]:
    weights = {name: (1.0 - self.alpha) * weight for name, weight in self.student.weights.items()}
    if self.soft_targets:
      weights["soft"] = self.alpha
    if self.pkd_weight:
      weights["pkd"] = self.pkd_weight
    if self.cos_weight:
      weights["cos"] = self.cos_weight
    return weights

  def pkd_layers(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(student, teacher) indices into `hidden_states` (0 is the embeddings): i and k * i, i = 1 .. L_s - 1."""
    k = skip_layers(self.student_config.num_layers, self.teacher_config.num_layers)
    student = tuple(range(1, self.student_config.num_layers))
    return student, tuple(k * i for i in student)

  # The step's Task interface.

  def __getattr__(self, name: str) -> Any:
    # example_batch, model_config, predictions_per_token, ...: the student task's.
    if name.startswith("__") or name == "student":
      raise AttributeError(name)
    return getattr(self.student, name)

  def prepare(self, batch: dict[str, Array]) -> dict[str, Array]:
    return self.student.prepare(batch)

  def denominators(self, inputs: dict[str, Array]) -> dict[str, Array]:
    counts = dict(self.student.denominators(inputs))
    if self.soft_targets:
      counts["soft"] = jnp.sum(self.student.soft_weights(inputs))
    if self.pkd_weight:
      counts["pkd"] = jnp.sum(self.student.row_weights(inputs))
    if self.cos_weight:
      counts["cos"] = jnp.sum(self.student.token_weights(inputs))
    return counts

  def with_frozen(self, frozen: Any, inputs: dict[str, Array]) -> dict[str, Array]:
    """Adds the teacher's outputs: teacher_logits, and the hidden states pkd / cos compare."""
    outputs = self.teacher.distill_outputs(frozen, inputs, None, False)
    added = {"teacher_logits": outputs["soft_logits"]} if self.soft_targets else {}
    if self.pkd_weight:
      added["teacher_cls"] = jnp.stack([outputs["hidden_states"][i][:, 0] for i in self.pkd_layers()[1]])
    if self.cos_weight:
      added["teacher_last"] = outputs["hidden_states"][-1]
    return {**inputs, **added}

  def forward(self, params: Any, inputs: dict[str, Array], rng: Array | None, train: bool) -> dict[str, Array]:
    outputs = self.student.distill_outputs(self.student_params(params), inputs, rng, train)
    terms = dict(outputs["terms"])
    if self.soft_targets:
      soft_weights = self.student.soft_weights(inputs)
      if self.student.soft_regression:
        terms["soft_loss"] = squared_error_sums(outputs["soft_logits"], inputs["teacher_logits"], soft_weights)
      else:
        terms["soft_loss"] = soft_target_sums(outputs["soft_logits"], inputs["teacher_logits"], soft_weights,
                                              self.temperature)
    project = self._projection(params)
    hidden_states = outputs["hidden_states"]
    if self.pkd_weight:
      student_cls = jnp.stack([hidden_states[i][:, 0] for i in self.pkd_layers()[0]])
      row_weights = jnp.broadcast_to(self.student.row_weights(inputs), student_cls.shape[:2])
      terms["pkd_loss"] = normalized_distance_sums(project(student_cls), inputs["teacher_cls"], row_weights)
    if self.cos_weight:
      terms["cos_loss"] = cosine_distance_sums(project(hidden_states[-1]), inputs["teacher_last"],
                                               self.student.token_weights(inputs))
    return terms

  def _projection(self, params: Any):
    if not self.hidden_projection:
      return lambda x: x
    module = HiddenProjection(self.teacher_config.hidden_size, self.student_config.initializer_range)
    return lambda x: module.apply({"params": params[PROJECTION]}, x)

  def student_params(self, params: Any) -> Any:
    return student_params(params)

  def predict(self, params: Any, inputs: dict[str, Array]) -> Array:
    return self.student.predict(self.student_params(params), inputs)

  def init_variables(self, rng: Array, batch: dict[str, Array]) -> Any:
    """The student's boxed variables, plus the projection's where there is one."""
    variables = self.student.init_variables(rng, batch)
    if not self.hidden_projection:
      return variables
    projection = HiddenProjection(self.teacher_config.hidden_size, self.student_config.initializer_range).init(
        jax.random.fold_in(rng, 1), jnp.zeros((1, self.student_config.hidden_size), jnp.float32))
    return {**variables, "params": {**variables["params"], PROJECTION: projection["params"]}}


def student_params(params: Any) -> Any:
  """The student model's own parameters: without the learned projection, as its checkpoints keep them."""
  return {name: value for name, value in params.items() if name != PROJECTION}


def place_frozen(task: Any, params: Any, batch: dict[str, Array], partitioning, hint: str = "") -> tuple[Any, Any]:
  """The teacher's host parameters on the mesh, sharded by their logical axes, and those shardings.

  Args:
    task: the teacher's task (its `init_variables` gives the logical axes).
    params: the teacher's parameters (host arrays of the shapes `task` builds).
    batch: an example batch.
    partitioning: the step's mesh and rules.
    hint: what a teacher should be, added to the error.

  Raises:
    ValueError: naming the parameters that are missing or mis-shaped.
  """
  with partitioning.context():
    abstract = jax.eval_shape(lambda: task.init_variables(jax.random.key(0), batch))["params"]
    shardings = sharding_lib.logical_shardings(abstract, partitioning.mesh, partitioning.rules)
  expected = dict(jax.tree_util.tree_leaves_with_path(nn.unbox(abstract)))
  given = dict(jax.tree_util.tree_leaves_with_path(params))
  problems = [f"missing {jax.tree_util.keystr(path)}" for path in expected if path not in given]
  problems += [f"{jax.tree_util.keystr(path)}: shape {np.shape(given[path])} != {value.shape}"
               for path, value in expected.items() if path in given and np.shape(given[path]) != value.shape]
  if problems:
    raise ValueError(f"config.distill.teacher does not fit its model{hint}:\n  " + "\n  ".join(problems))
  ordered = jax.tree_util.tree_unflatten(jax.tree.structure(nn.unbox(abstract)),
                                         [np.asarray(given[path], value.dtype) for path, value in expected.items()])
  return jax.device_put(ordered, shardings), shardings


def every_kth_layer(encoder: Any, config: ModelConfig, layers: int, key: str) -> tuple[Any, ModelConfig]:
  """An encoder's parameters and config cut to `layers` blocks: its blocks 0, k, 2k, ... (k = its layers /
  `layers`), embeddings kept (BERT-PKD's and DistilBERT's starting point for a shallower student).

  Raises:
    ValueError: naming `key` when the depths do not divide, or the model shares or prunes its layers.
  """
  if config.num_shared_groups or config.heads_per_layer is not None:
    raise ValueError(f"{key}: a model with shared layers (ALBERT) or pruned heads cannot be cut by layers")
  if not 1 <= layers <= config.num_layers:
    raise ValueError(f"{key}={layers}: expected 1 to {config.num_layers} (the model's layers)")
  k = skip_layers(layers, config.num_layers, key)
  kept = {name: value for name, value in encoder.items() if not name.startswith("block_")}
  kept.update({f"block_{i}": encoder[f"block_{k * i}"] for i in range(layers)})
  return kept, config.replace(num_layers=layers)


def init_from_teacher(student: Any, teacher: Any, student_config: ModelConfig, teacher_config: ModelConfig) -> Any:
  """DistilBERT's initialisation: the student's parameters with the teacher's embeddings and heads, and teacher
  block k * i in student block i (k = teacher layers / student layers: every other layer for half the depth).

  Args:
    student: the student's host parameters ({"encoder", "mlm", ...}).
    teacher: the teacher's ({"encoder", "mlm", ...}); trees the student lacks are ignored, trees the teacher lacks
      (a sentence head) keep the student's initialisation.

  Raises:
    ValueError: naming `config.distill.init_from_teacher` when the shapes or depths do not fit.
  """
  key = "config.distill.init_from_teacher"
  if student_config.num_shared_groups or teacher_config.num_shared_groups:
    raise ValueError(f"{key}: layer sharing (ALBERT) has no layers to pick; set it to False")
  k = skip_layers(student_config.num_layers, teacher_config.num_layers, key)
  mapped = {f"block_{i}": f"block_{k * i}" for i in range(student_config.num_layers)}
  problems = []

  def take(path, value):
    names = [str(getattr(entry, "key", entry)) for entry in path]
    if names[0] == PROJECTION:
      return value
    if names[0] == "encoder" and len(names) > 1 and names[1] in mapped:
      names[1] = mapped[names[1]]
    node = teacher
    for name in names:
      if not isinstance(node, dict) or name not in node:
        return value
      node = node[name]
    if np.shape(node) != np.shape(value):
      problems.append(f"{'/'.join(names)}: the teacher's {np.shape(node)} != the student's {np.shape(value)}")
      return value
    return np.asarray(node, np.asarray(value).dtype)

  merged = jax.tree_util.tree_map_with_path(take, student)
  if problems:
    raise ValueError(f"{key}: the teacher's parameters do not fit the student (same width needed):\n  "
                     + "\n  ".join(problems))
  return merged
