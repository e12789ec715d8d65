"""Knowledge distillation: a frozen teacher's outputs as extra loss terms of the one train step.

`Distillation` wraps a task (a pre-training objective or a fine-tuning
objective) and adds terms to its own, each a sum that the step divides by
its count:

  soft  the teacher's soft targets at temperature T: T**2 * KL(teacher || student)
        per prediction (Hinton et al. 2015; DistilBERT's L_ce on masked tokens);
        for regression (STS-B) the squared error to the teacher's value;
  pkd   BERT-PKD's patient loss: the distance between the unit-normalised [CLS]
        states of student layer i and teacher layer k * i, i = 1 .. L_student - 1,
        k = L_teacher / L_student ("PKD-skip"), per example;
  cos   DistilBERT's 1 - cos(student, teacher) of the last hidden states, per token.

and TinyBERT's (Jiao et al. 2020) intermediate-layer losses, student layer m
(1 .. M) against teacher layer g(m) (`layer_map`; uniform g(m) = m N / M):

  attention  sum over m of the mean over heads and real (query, key) pairs of
             (A_student_m - A_teacher_g(m))**2, A the attention scores q . k /
             sqrt(d) before masking and softmax: the paper's choice, which it
             reports converging faster and scoring better than the softmax's
             probabilities; pairs a mask hides (padding, another packed
             example) are left out, not zeroed. The heads must match.
  hidden     sum over m of the mean over real tokens and teacher features of
             (H_student_m W_h - H_teacher_g(m))**2.
  embedding  the same for the embeddings' output: (E_student W_e - E_teacher)**2.

The weights: the task's own terms (1 - alpha) * prediction_weight, soft
alpha * prediction_weight, pkd pkd_weight, cos cos_weight, attention
attention_weight, hidden hidden_weight, embedding embedding_weight. TinyBERT's
prediction-layer loss is soft at alpha=1, temperature 1 (KL to the teacher:
its cross-entropy less the teacher's entropy, the same gradients), and its two
task-specific stages are two runs of one command: the intermediate layers
(prediction_weight 0), then the prediction layer from that run's parameters.
A student narrower than its teacher compares hidden states through a learned
linear map (TinyBERT's W_h, `hidden_projection`) and its embeddings through
another (W_e), trained with the student and kept beside its parameters under
"distill_projection" and "distill_projection_embedding".

Attention scores come out of the model through its `encoder.SCORES` collection,
which only the plain attention path fills: with attention_weight > 0 both
models run with kernels "off" (the fused kernels never hold the score matrix).

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
                     targets: alpha 0, its hidden states and attention scores through the other losses only).
  temperature        T of the soft targets.
  alpha              weight of the soft loss; the task's own terms (hard labels, MLM) get 1 - alpha.
  pkd_weight         weight of the PKD loss (0: off).
  cos_weight         weight of the hidden-state cosine loss (0: off).
  hidden_projection  learn linear maps from the student's width to the teacher's for pkd / cos / hidden (W_h)
                     and embedding (W_e).
  layer_map          "uniform" (student layer m <-> teacher layer m N / M) or the teacher's layer (1 .. N) for
                     each student layer, comma-separated ("3,6,9,12"), for attention and hidden.
  attention_weight   weight of TinyBERT's attention-score loss (0: off).
  hidden_weight      weight of TinyBERT's hidden-state loss (0: off).
  embedding_weight   weight of TinyBERT's embedding loss (0: off).
  prediction_weight  weight of the prediction layer: the task's own terms and the soft loss (0: intermediate
                     layers only, TinyBERT's general distillation and first task-specific stage).
  init_from_teacher  (pre-training) the student starts from the teacher: embeddings, heads, and teacher layers
                     0, k, 2k, ... in its layers 0, 1, 2, ... (DistilBERT: every other layer).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from ml_collections import config_dict

from bert_jax import paths
from bert_jax.models import Encoder, ModelConfig, PretrainingModel
from bert_jax.models.model import apply_with_scores
from bert_jax.parallel import sharding as sharding_lib
from bert_jax.train import checkpoint
from bert_jax.train.objectives import PretrainingObjective
from bert_jax.train.losses import (cosine_distance_sums, normalized_distance_sums, soft_target_sums,
                                   squared_error_sums)

Array = jax.Array
PROJECTION = "distill_projection"
# Not "..._embedding_projection": layer-wise LR decay reads that name as the embeddings (`optim.layer_index`).
EMBEDDING_PROJECTION = "distill_projection_embedding"
# Pre-training objectives whose MLM logits a teacher's soft targets apply to.
PRETRAINING_OBJECTIVES = ("mlm", "mlm+nsp", "mlm+sop", "mlm+sbo")


def config_section(pretraining: bool) -> ml_collections.ConfigDict:
  """The `distill` section of the defaults (see the module docstring); off while `teacher` is None."""
  section = ml_collections.ConfigDict(dict(
      teacher=config_dict.placeholder(str), temperature=2.0, alpha=0.5, pkd_weight=0.0, cos_weight=0.0,
      hidden_projection=False, layer_map="uniform", attention_weight=0.0, hidden_weight=0.0, embedding_weight=0.0,
      prediction_weight=1.0))
  if pretraining:
    section.init_from_teacher = False
  return section


def skip_layers(student_layers: int, teacher_layers: int, key: str = "config.distill.pkd_weight") -> int:
  """k of PKD-skip (student layer i <-> teacher layer k * i); the teacher's depth must be a multiple."""
  if teacher_layers % student_layers:
    raise ValueError(f"{key}: a student of {student_layers} layers cannot map onto a teacher of {teacher_layers} "
                     f"layers (layer i to layer k * i needs the teacher's depth to be a multiple of the student's)")
  return teacher_layers // student_layers


def layer_map(spec: str, student_layers: int, teacher_layers: int) -> tuple[int, ...]:
  """TinyBERT's g: the teacher layer (1 .. N) each student layer 1 .. M learns from.

  Args:
    spec: "uniform" (g(m) = m N / M) or the M teacher layers, comma-separated ("2,4,6").

  Raises:
    ValueError: naming config.distill.layer_map when the map does not fit the two depths.
  """
  key = f"config.distill.layer_map={spec!r}"
  if spec == "uniform":
    if teacher_layers % student_layers:
      example = ",".join(str(round(m * teacher_layers / student_layers)) for m in range(1, student_layers + 1))
      raise ValueError(f"{key}: a student of {student_layers} layers has no uniform map onto a teacher of "
                       f"{teacher_layers} (g(m) = m N / M needs N to be a multiple of M); give the teacher's layer "
                       f"for each student layer, e.g. config.distill.layer_map={example!r}")
    return tuple(m * teacher_layers // student_layers for m in range(1, student_layers + 1))
  try:
    mapped = tuple(int(layer) for layer in spec.split(","))
  except ValueError:
    raise ValueError(f"{key}: expected 'uniform' or comma-separated teacher layers such as '2,4,6'") from None
  if len(mapped) != student_layers or not all(1 <= layer <= teacher_layers for layer in mapped):
    raise ValueError(f"{key}: expected {student_layers} teacher layers (one per student layer), each 1 to "
                     f"{teacher_layers}")
  return mapped


def attention_pair_weights(pack_ids: Array, token_weights: Array, causal: bool) -> Array:
  """[rows, 1, L, L] weight of each (query, key) pair: the query's token weight where the query may attend to
  the key (the key is real and in the query's packed example; causal: not after it), else 0."""
  pack_ids = pack_ids.reshape((-1, pack_ids.shape[-1]))
  allowed = (pack_ids[:, :, None] == pack_ids[:, None, :]) & (pack_ids[:, None, :] > 0)
  if causal:
    allowed &= jnp.tril(jnp.ones(allowed.shape[1:], bool))
  return (token_weights[:, :, None] * allowed)[:, None]


def plain_attention(task: Any) -> Any:
  """`task` with its model on the plain path (kernels "off"), the one that gives attention scores."""
  if isinstance(task, PretrainingObjective):
    return dataclasses.replace(task, model_config=task.model_config.replace(kernels="off"))
  return dataclasses.replace(task, model=task.model.clone(config=task.model.config.replace(kernels="off")))


def model_config_of(task: Any) -> ModelConfig:
  """The encoder config of a pre-training or fine-tuning task."""
  return task.model_config if isinstance(task, PretrainingObjective) else task.model.config


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

  def distill_outputs(self, params, inputs, rng, train, attention_scores=False):
    if self.mlm_head:
      return super().distill_outputs(params, inputs, rng, train, attention_scores)
    outputs, scores = apply_with_scores(self.apply, self.model_config, attention_scores)(
        {"params": params}, inputs, train, rngs=self.rngs(rng, train), output_hidden_states=True)
    return {"terms": {}, "soft_logits": None, "hidden_states": outputs["hidden_states"], **scores}


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
    temperature, alpha, pkd_weight, cos_weight, layer_map, attention_weight, hidden_weight, embedding_weight,
      prediction_weight: as the config's keys.
    hidden_projection: learn `HiddenProjection`s (the widths differ).
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
  layer_map: str = "uniform"
  attention_weight: float = 0.0
  hidden_weight: float = 0.0
  embedding_weight: float = 0.0
  prediction_weight: float = 1.0

  @classmethod
  def from_config(cls, settings: ml_collections.ConfigDict, student: Any, teacher: Any,
                  soft_targets: bool = True) -> Distillation:
    """The config's `distill` section over a student task and its teacher's; with attention_weight both run the
    plain attention path, the one that gives the scores."""
    if settings.attention_weight:
      student, teacher = plain_attention(student), plain_attention(teacher)
    return cls(student, teacher, model_config_of(student), model_config_of(teacher),
               temperature=settings.temperature, alpha=settings.alpha, pkd_weight=settings.pkd_weight,
               cos_weight=settings.cos_weight, hidden_projection=settings.hidden_projection,
               soft_targets=soft_targets, layer_map=settings.layer_map, attention_weight=settings.attention_weight,
               hidden_weight=settings.hidden_weight, embedding_weight=settings.embedding_weight,
               prediction_weight=settings.prediction_weight)

  def __post_init__(self):
    if self.temperature <= 0:
      raise ValueError(f"config.distill.temperature={self.temperature} must be positive")
    if not 0.0 <= self.alpha <= 1.0:
      raise ValueError(f"config.distill.alpha={self.alpha} must be in [0, 1]")
    if not self.soft_targets and self.alpha and self.prediction_weight:
      raise ValueError(f"config.distill.alpha={self.alpha}: the teacher has no head to give soft targets; set "
                       "config.distill.alpha=0 to distil its hidden states only (cos_weight, pkd_weight)")
    intermediate = ("attention_weight", "hidden_weight", "embedding_weight")
    for key in ("pkd_weight", "cos_weight", *intermediate, "prediction_weight"):
      if getattr(self, key) < 0:
        raise ValueError(f"config.distill.{key}={getattr(self, key)} must be >= 0")
    if not any(weight for weight in self.weights.values()):
      raise ValueError("config.distill: every loss has weight 0; set config.distill.prediction_weight or one of "
                       "attention_weight, hidden_weight, embedding_weight, pkd_weight, cos_weight above 0")
    if self.student_config.vocab_size != self.teacher_config.vocab_size:
      raise ValueError(f"config.distill.teacher: its vocabulary of {self.teacher_config.vocab_size} tokens differs "
                       f"from the student's {self.student_config.vocab_size}; the two must share a tokenizer")
    if self.pkd_weight:
      if self.student_config.num_layers < 2:
        raise ValueError("config.distill.pkd_weight: a 1-layer student has no intermediate layer to match; "
                         "set it to 0")
      skip_layers(self.student_config.num_layers, self.teacher_config.num_layers)
    if self.attention_weight or self.hidden_weight:
      self.mapped_layers()  # fails naming config.distill.layer_map
    if self.attention_weight:
      heads = [(config.num_heads, config.heads_per_layer) for config in (self.student_config, self.teacher_config)]
      if heads[0] != heads[1] or heads[0][1] is not None:
        raise ValueError(f"config.distill.attention_weight: the student's {self.student_config.num_heads} heads a "
                         f"layer and the teacher's {self.teacher_config.num_heads} must be equal and unpruned (the "
                         "scores are matched head by head); set config.model.num_heads or attention_weight=0")
    widths = self.student_config.hidden_size, self.teacher_config.hidden_size
    compared = self.pkd_weight or self.cos_weight or self.hidden_weight or self.embedding_weight
    if compared and widths[0] != widths[1] and not self.hidden_projection:
      raise ValueError(f"config.distill: the student's width {widths[0]} differs from the teacher's {widths[1]}; "
                       "set config.distill.hidden_projection=True to learn a map between them (or pkd_weight, "
                       "cos_weight, hidden_weight and embedding_weight to 0)")

  @property
  def weights(self) -> dict[str, float]:
    weights = {name: (1.0 - self.alpha) * self.prediction_weight * weight
               for name, weight in self.student.weights.items()}
    if self.soft_targets:
      weights["soft"] = self.alpha * self.prediction_weight
    for name in ("pkd", "cos", "attention", "hidden", "embedding"):
      if getattr(self, f"{name}_weight"):
        weights[name] = getattr(self, f"{name}_weight")
    return weights

  def pkd_layers(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(student, teacher) indices into `hidden_states` (0 is the embeddings): i and k * i, i = 1 .. L_s - 1."""
    k = skip_layers(self.student_config.num_layers, self.teacher_config.num_layers)
    student = tuple(range(1, self.student_config.num_layers))
    return student, tuple(k * i for i in student)

  def mapped_layers(self) -> tuple[int, ...]:
    """g(1) .. g(M): the teacher layer (an index into `hidden_states`) of each student layer 1 .. M."""
    return layer_map(self.layer_map, self.student_config.num_layers, self.teacher_config.num_layers)

  # The step's Task interface.

  def __getattr__(self, name: str) -> Any:
    # example_batch, model_config, predictions_per_token, ...: the student task's.
    if name.startswith("__") or name == "student":
      raise AttributeError(name)
    return getattr(self.student, name)

  def prepare(self, batch: dict[str, Array]) -> dict[str, Array]:
    return self.student.prepare(batch)

  def _pair_weights(self, inputs: dict[str, Array]) -> Array:
    return attention_pair_weights(inputs["pack_ids"], self.student.token_weights(inputs), self.student_config.causal)

  def denominators(self, inputs: dict[str, Array]) -> dict[str, Array]:
    counts = dict(self.student.denominators(inputs))
    if self.soft_targets:
      counts["soft"] = jnp.sum(self.student.soft_weights(inputs))
    if self.pkd_weight:
      counts["pkd"] = jnp.sum(self.student.row_weights(inputs))
    if self.cos_weight:
      counts["cos"] = jnp.sum(self.student.token_weights(inputs))
    # Means over every element compared (per layer; the layers' losses add up, as the paper's).
    features = self.teacher_config.hidden_size * jnp.sum(self.student.token_weights(inputs))
    if self.hidden_weight:
      counts["hidden"] = features
    if self.embedding_weight:
      counts["embedding"] = features
    if self.attention_weight:
      counts["attention"] = self.student_config.num_heads * jnp.sum(self._pair_weights(inputs))
    return counts

  def with_frozen(self, frozen: Any, inputs: dict[str, Array]) -> dict[str, Array]:
    """Adds the teacher's outputs: teacher_logits, and the hidden states and attention scores the terms compare."""
    outputs = self.teacher.distill_outputs(frozen, inputs, None, False, attention_scores=bool(self.attention_weight))
    added = {"teacher_logits": outputs["soft_logits"]} if self.soft_targets else {}
    hidden_states = outputs["hidden_states"]
    if self.pkd_weight:
      added["teacher_cls"] = jnp.stack([hidden_states[i][:, 0] for i in self.pkd_layers()[1]])
    if self.cos_weight:
      added["teacher_last"] = hidden_states[-1]
    if self.hidden_weight:
      added["teacher_hidden"] = jnp.stack([hidden_states[g] for g in self.mapped_layers()])
    if self.embedding_weight:
      added["teacher_embedding"] = hidden_states[0]
    if self.attention_weight:
      added["teacher_attention"] = jnp.stack([outputs["attention_scores"][g - 1] for g in self.mapped_layers()])
    return {**inputs, **added}

  def forward(self, params: Any, inputs: dict[str, Array], rng: Array | None, train: bool) -> dict[str, Array]:
    outputs = self.student.distill_outputs(self.student_params(params), inputs, rng, train,
                                           attention_scores=bool(self.attention_weight))
    terms = dict(outputs["terms"])
    if self.soft_targets:
      soft_weights = self.student.soft_weights(inputs)
      if self.student.soft_regression:
        terms["soft_loss"] = squared_error_sums(outputs["soft_logits"], inputs["teacher_logits"], soft_weights)
      else:
        terms["soft_loss"] = soft_target_sums(outputs["soft_logits"], inputs["teacher_logits"], soft_weights,
                                              self.temperature)
    project = self._projection(params, PROJECTION)
    hidden_states = outputs["hidden_states"]
    if self.pkd_weight:
      student_cls = jnp.stack([hidden_states[i][:, 0] for i in self.pkd_layers()[0]])
      row_weights = jnp.broadcast_to(self.student.row_weights(inputs), student_cls.shape[:2])
      terms["pkd_loss"] = normalized_distance_sums(project(student_cls), inputs["teacher_cls"], row_weights)
    if self.cos_weight:
      terms["cos_loss"] = cosine_distance_sums(project(hidden_states[-1]), inputs["teacher_last"],
                                               self.student.token_weights(inputs))
    token_weights = self.student.token_weights(inputs)[..., None]  # over the features
    if self.hidden_weight:
      student_hidden = jnp.stack(hidden_states[1:])
      terms["hidden_loss"] = squared_error_sums(project(student_hidden), inputs["teacher_hidden"], token_weights)
    if self.embedding_weight:
      terms["embedding_loss"] = squared_error_sums(self._projection(params, EMBEDDING_PROJECTION)(hidden_states[0]),
                                                   inputs["teacher_embedding"], token_weights)
    if self.attention_weight:
      terms["attention_loss"] = squared_error_sums(jnp.stack(outputs["attention_scores"]),
                                                   inputs["teacher_attention"], self._pair_weights(inputs))
    return terms

  def _projections(self) -> tuple[str, ...]:
    """The learned maps' names in the parameters: W_h, and W_e for the embedding loss."""
    if not self.hidden_projection:
      return ()
    return (PROJECTION, EMBEDDING_PROJECTION) if self.embedding_weight else (PROJECTION,)

  def _projection(self, params: Any, name: str):
    if name not in self._projections():
      return lambda x: x
    module = HiddenProjection(self.teacher_config.hidden_size, self.student_config.initializer_range)
    return lambda x: module.apply({"params": params[name]}, x)

  def student_params(self, params: Any) -> Any:
    return student_params(params)

  def predict(self, params: Any, inputs: dict[str, Array]) -> Array:
    return self.student.predict(self.student_params(params), inputs)

  def init_variables(self, rng: Array, batch: dict[str, Array]) -> Any:
    """The student's boxed variables, plus the learned projections where there are some."""
    variables = self.student.init_variables(rng, batch)
    projections = {
        name: HiddenProjection(self.teacher_config.hidden_size, self.student_config.initializer_range).init(
            jax.random.fold_in(rng, i + 1), jnp.zeros((1, self.student_config.hidden_size), jnp.float32))["params"]
        for i, name in enumerate(self._projections())}
    return {**variables, "params": {**variables["params"], **projections}}


def student_params(params: Any) -> Any:
  """The student model's own parameters: without the learned projections, as its checkpoints keep them."""
  return {name: value for name, value in params.items() if name not in (PROJECTION, EMBEDDING_PROJECTION)}


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
  ordered = checkpoint.match_params(params, nn.unbox(abstract),
                                   f"config.distill.teacher does not fit its model{hint}")
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
    if names[0] in (PROJECTION, EMBEDDING_PROJECTION):
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


def load_pretraining_teacher(path: str, student: PretrainingObjective) -> tuple[MaskedLMTeacher, Any]:
  """General distillation's teacher: (its masked-LM task, its host params) from a pre-training workdir (its newest
  checkpoint) or a converted / Hugging Face model directory; one without an MLM head (a base model) gives hidden
  states only."""
  from bert_jax.convert.params import encoder_params
  from bert_jax.convert.pretrained import load_pretrained

  where = paths.as_path(path)
  if not where.exists():
    raise ValueError(f"config.distill.teacher={path!r} does not exist: give a pre-training workdir or a model "
                     "directory with its MLM head")
  if (where / "checkpoints").is_dir() and (where / "model_config.json").exists():
    config = ModelConfig(**json.loads((where / "model_config.json").read_text()))
    _, params = checkpoint.restore_params(where)
  else:
    _, config, params, _ = load_pretrained(where)
  mlm_head = "mlm" in params
  if not mlm_head:
    params = {"encoder": encoder_params(params)}
  # The teacher computes as the student does, every position of its last layer (for the cosine loss); it never
  # trains, so nothing of it is rematerialised.
  student_config = student.model_config
  config = config.replace(dtype=student_config.dtype, kernels=student_config.kernels, fp8=student_config.fp8,
                          remat="none", sparse_last_layer=False,
                          vocab_pad_multiple=student_config.vocab_pad_multiple)
  teacher = MaskedLMTeacher(model_config=config, masking=student.masking, mask_id=student.mask_id,
                            weights={"mlm": 1.0}, packed=student.packed, seed=student.seed,
                            max_packs=student.max_packs, mlm_head=mlm_head)
  return teacher, params


def for_pretraining(config: ml_collections.ConfigDict, objective: PretrainingObjective
                    ) -> tuple[Distillation, tuple[MaskedLMTeacher, Any]]:
  """Pre-training's distillation (`config.distill`): (the student's objective with the teacher's terms, (the
  teacher's task, its host params))."""
  if objective.name not in PRETRAINING_OBJECTIVES:
    raise ValueError(f"config.distill.teacher is set with config.objective={objective.name!r}: general "
                     f"distillation serves the MLM objectives {PRETRAINING_OBJECTIVES}")
  settings = config.distill
  if settings.pkd_weight:
    raise ValueError("config.distill.pkd_weight applies to fine-tuning; pre-training's hidden-state loss is "
                     "config.distill.cos_weight")
  # The cosine, hidden-state and attention losses compare every position of the last layer, which the sparse
  # last layer does not compute.
  every_position = settings.cos_weight or settings.hidden_weight or settings.attention_weight
  student = dataclasses.replace(objective, model_config=objective.model_config.replace(
      sparse_last_layer=objective.model_config.sparse_last_layer and not every_position))
  teacher, teacher_params = load_pretraining_teacher(settings.teacher, student)
  distillation = Distillation.from_config(settings, student, teacher, soft_targets=teacher.mlm_head)
  return distillation, (distillation.teacher, teacher_params)
