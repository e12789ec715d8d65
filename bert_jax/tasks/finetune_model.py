"""Fine-tuning models, losses and starting points.

  FinetuneModel       the encoder and one task head, which its task kind
                      (`bert_jax.tasks.kinds.TASK_KINDS`) builds and shapes.
  FinetuneObjective   one task kind's loss (`bert_jax.tasks.kinds`) behind the
                      train step's interface (`bert_jax.train.step`): prepare /
                      denominators / forward, plus `predict` for the head's raw
                      outputs.
  FeatureBasedTagger  BERT's feature-based mode: a frozen encoder whose chosen
                      layers are concatenated and fed to a small trained head.
  load_initial_model  the encoder (and any reusable head) to start from: a
                      Hugging Face directory or our converted directory, a
                      pre-training run, or an earlier fine-tuning run.
  optimizer           fine-tuning's optimizer and schedule.
  distillation        the objective with a fine-tuned teacher's terms.

Batches hold the task's feature arrays (`bert_jax.tasks.base`) for the fields
in `device_fields(kind)`, plus `weights` float32 [B] (0 on rows that only pad
the last batch) and `seed` int32 [B] (the run's seed on every row, so one
compiled step serves every seed of a multi-seed run). The head analyses
(`bert_jax.analysis.heads`) add `head_mask` float [layers, heads], the heads' gates.

Losses are sums over the batch (the step divides once by `denominators`), each
kind's own (`bert_jax.tasks.kinds`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from bert_jax import paths
from bert_jax.convert.params import encoder_params
from bert_jax.convert.pretrained import load_pretrained
from bert_jax.data.tokenizers import HFTokenizer, SentencePieceTokenizer, Tokenizer, load_tokenizer
from bert_jax.models import Dropout, Encoder, ModelConfig
from bert_jax.models.functional import gather_positions
from bert_jax.models.model import apply_with_scores, head_rows
from bert_jax.models.recurrent import BiLSTM
from bert_jax.tasks.base import HFTokenizerAdapter, Offsets, Task, TaskTokenizer
from bert_jax.tasks.batching import fitted_max_len
from bert_jax.tasks.finetune_config import model_config_for
from bert_jax.tasks.kinds import TaskKind, task_kind
from bert_jax.train import checkpoint as checkpoint_lib
from bert_jax.train import distill as distill_lib, optim
from bert_jax.train.losses import dropout_key

Array = jax.Array
Params = dict[str, Any]

# Written into every fine-tuning workdir; its presence marks one.
RUN_FILE = "finetune_run.json"
# Written by `bert-jax quantize` beside RUN_FILE: the folder's checkpoints hold int8 dense layers
# (`bert_jax.models.quantization`).
QUANTIZATION_FILE = "quantization.json"
FEATURE_HEADS = ("bilstm", "mlp")


class FinetuneModel(nn.Module):
  """Encoder + one task head.

  Attributes:
    config: the encoder.
    kind: a name in `bert_jax.tasks.kinds.TASK_KINDS`; its class builds the head and shapes the logits.
    num_labels: classes (classification, tagging); ignored otherwise.
    top_bilstm: a randomly initialised one-layer BiLSTM between the encoder and the head (hidden/2 units a
      direction, so the head's input keeps its width): BERT Table 5's "+ BiLSTM" row, for every task kind.

  A left-to-right encoder (`config.causal`) pools its last real token for the kinds whose head reads one position
  per row (`TaskKind.pooled`), as GPT does: its [CLS] attends to itself alone. With `top_bilstm` the BiLSTM has
  read the whole row, so [CLS] is pooled. With `config.sparse_last_layer` those kinds' last block computes the
  pooled row alone (not with `top_bilstm` or `output_hidden_states`, which read every row).
  """

  config: ModelConfig
  kind: str
  num_labels: int = 2
  top_bilstm: bool = False

  def setup(self):
    kind = task_kind(self.kind)
    self.encoder = Encoder(self.config)
    if self.top_bilstm:
      if self.config.hidden_size % 2:
        raise ValueError("top_bilstm needs an even hidden size (half of it a direction), "
                         f"got {self.config.hidden_size}")
      self.bilstm = BiLSTM(self.config.hidden_size // 2)
    self.head = kind.head(self.config, self.num_labels)

  def __call__(self, input_ids: Array, *, segment_ids: Array | None = None, position_ids: Array | None = None,
               pack_ids: Array | None = None, deterministic: bool = True, head_mask: Array | None = None,
               output_hidden_states: bool = False) -> Any:
    """input_ids [B, L] ([N, C, L] for multiple choice) -> the head's logits; `head_mask`: `Encoder`'s.

    classification [B, labels]; regression [B]; span (start [B,L], end [B,L]);
    multiple_choice [N, C]; tagging [B, L, labels]. With `output_hidden_states`, (those logits, the encoder's
    hidden states: `Encoder`'s, [N * C, L, H] each for multiple choice).
    """
    kind = task_kind(self.kind)
    rows_shape = input_ids.shape[:-1]
    input_ids, segment_ids, position_ids, pack_ids = (None if x is None else kind.encoder_rows(x)
                                                      for x in (input_ids, segment_ids, position_ids, pack_ids))
    batch, length = input_ids.shape
    pooled_b1 = None  # the one position a pooled head reads
    if kind.pooled and not self.top_bilstm:
      pooled_b1 = jnp.zeros((batch, 1), jnp.int32)
      if self.config.causal:
        last_b = (length if pack_ids is None else jnp.sum(pack_ids > 0, axis=-1)) - 1
        pooled_b1 = jnp.broadcast_to(last_b, (batch,))[:, None].astype(jnp.int32)
    # The last block at the pooled row only (`ModelConfig.sparse_last_layer`): the head reads nothing else.
    output_positions = None
    if pooled_b1 is not None and not output_hidden_states:
      output_positions, _ = head_rows(self.config, length, {"pooled": pooled_b1})
    encoded = self.encoder(input_ids, segment_ids, position_ids, pack_ids, deterministic=deterministic,
                           head_mask=head_mask, output_hidden_states=output_hidden_states,
                           output_positions=output_positions)
    hidden = encoded["hidden"]
    if self.top_bilstm:
      lengths = None if pack_ids is None else jnp.sum(pack_ids > 0, axis=-1)
      hidden = self.bilstm(hidden.astype(jnp.float32), lengths).astype(hidden.dtype)
    elif output_positions is None and self.config.causal and pooled_b1 is not None:
      hidden = gather_positions(hidden, pooled_b1)  # [B, 1, E]
    out = kind.logits(self.head(hidden, deterministic=deterministic), rows_shape)
    return (out, encoded["hidden_states"]) if output_hidden_states else out


def device_fields(kind: str) -> tuple[str, ...]:
  """Feature arrays of the kind called `kind` that go to the device (the rest stay on the host for decoding)."""
  return ("input_ids", "segment_ids", "lengths") + task_kind(kind).label_fields


class FeatureHead(nn.Module):
  """The small trained head of feature-based tagging: BiLSTM layers or an MLP, then dense(num_labels).

  Attributes:
    num_labels: tags.
    kind: "bilstm" (BERT's two-layer BiLSTM) or "mlp" (dense + GELU layers).
    size: LSTM units per direction, or MLP width.
    num_layers: BiLSTM or MLP layers.
    dropout: dropout on the features and between layers.
    kernels: `ModelConfig.kernels` of the encoder, which also chooses the dropout's implementation.
  """

  num_labels: int
  kind: str
  size: int
  num_layers: int
  dropout: float
  kernels: str = "auto"

  @nn.compact
  def __call__(self, features_blf: Array, lengths_b: Array, deterministic: bool) -> Array:
    x_blf = Dropout(self.dropout, self.kernels)(features_blf, deterministic=deterministic)
    for layer in range(self.num_layers):
      if self.kind == "bilstm":
        x_blf = BiLSTM(self.size, name=f"bilstm_{layer}")(x_blf, lengths_b)
      else:
        x_blf = nn.gelu(nn.Dense(self.size, name=f"dense_{layer}")(x_blf))
      x_blf = Dropout(self.dropout, self.kernels)(x_blf, deterministic=deterministic)
    return nn.Dense(self.num_labels, name="classifier")(x_blf)


class FeatureBasedTagger(nn.Module):
  """Frozen encoder -> chosen hidden states concatenated -> `FeatureHead` -> [B, L, labels] logits.

  Layer 0 is the embedding output and -1 the last block's, as in Hugging
  Face's `hidden_states`. The encoder runs without dropout and no gradient
  reaches it; its parameters are also excluded from the optimizer
  (`frozen_encoder_optimizer`), so weight decay leaves them untouched.
  """

  config: ModelConfig
  num_labels: int
  layers: tuple[int, ...]
  head_kind: str = "bilstm"
  head_size: int = 768
  head_layers: int = 2
  head_dropout: float = 0.1

  @nn.compact
  def __call__(self, input_ids: Array, *, segment_ids: Array | None = None, position_ids: Array | None = None,
               pack_ids: Array | None = None, deterministic: bool = True) -> Array:
    states = Encoder(self.config, name="encoder")(input_ids, segment_ids, position_ids, pack_ids, deterministic=True,
                                                  output_hidden_states=True)["hidden_states"]
    features_blf = jnp.concatenate([states[layer] for layer in self.layers], axis=-1).astype(jnp.float32)
    features_blf = jax.lax.stop_gradient(features_blf)
    lengths_b = jnp.sum(pack_ids > 0, axis=-1) if pack_ids is not None else None
    return FeatureHead(self.num_labels, self.head_kind, self.head_size, self.head_layers, self.head_dropout,
                       self.config.kernels, name="head")(features_blf, lengths_b, deterministic)


def frozen_encoder_optimizer(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` with the updates of the "encoder" subtree set to zero (weight decay included).

  The encoder's optimizer state is still allocated, which keeps every state
  leaf an array that the sharding rules can place.
  """
  def update(updates, state, params=None):
    updates, state = tx.update(updates, state, params)
    return {**updates, "encoder": jax.tree.map(jnp.zeros_like, updates["encoder"])}, state

  return optax.GradientTransformation(tx.init, update)


@dataclasses.dataclass(frozen=True)
class FinetuneObjective:
  """A task kind's loss on a `FinetuneModel` or `FeatureBasedTagger` (see the module docstring).

  Attributes:
    model: the Flax module; its params tree is {"encoder", "head"}.
    kind: the task kind's name (`bert_jax.tasks.kinds.TASK_KINDS`).
    single_token_type: zero the segment ids (models with one token type, RoBERTa).
    num_choices: choices per example (multiple choice only).
  """

  model: nn.Module
  kind: str
  single_token_type: bool = False
  num_choices: int = 0
  weights: dict[str, float] = dataclasses.field(default_factory=lambda: {"task": 1.0})

  @property
  def task_kind(self) -> TaskKind:
    return task_kind(self.kind)

  def example_batch(self, rows: int, seq_len: int) -> dict[str, Array]:
    """A batch of the device fields' shapes (zeros), to initialise the model and trace the steps."""
    shape = self.task_kind.row_shape(rows, self.num_choices)
    tokens = jnp.zeros(shape + (seq_len,), jnp.int32)
    return {"input_ids": tokens, "segment_ids": tokens,
            "lengths": jnp.full(shape, seq_len, jnp.int32), "weights": jnp.ones((rows,), jnp.float32),
            "seed": jnp.zeros((rows,), jnp.int32)}

  def prepare(self, batch: dict[str, Array]) -> dict[str, Array]:
    """Adds pack_ids [..., L] (1 on real tokens, 0 on padding) from `lengths`."""
    inputs = dict(batch)
    length = batch["input_ids"].shape[-1]
    inputs["pack_ids"] = (jnp.arange(length, dtype=jnp.int32) < batch["lengths"][..., None]).astype(jnp.int32)
    if self.single_token_type:
      inputs["segment_ids"] = jnp.zeros_like(batch["segment_ids"])
    return inputs

  def denominators(self, inputs: dict[str, Array]) -> dict[str, Array]:
    return {"task": jnp.sum(self.task_kind.loss_weights(inputs))}

  def _apply(self, params: Params, inputs: dict[str, Array], rng: Array | None, train: bool, **kwargs) -> Any:
    rngs = {"dropout": dropout_key(jax.random.fold_in(rng, inputs["seed"][0]))} if train and rng is not None else {}
    # Head gates [layers, heads] (`Encoder`'s head_mask) come with the inputs only in the head analyses.
    gates = {"head_mask": inputs["head_mask"]} if "head_mask" in inputs else {}
    return self.model.apply({"params": params}, inputs["input_ids"], segment_ids=inputs["segment_ids"],
                            pack_ids=inputs["pack_ids"], deterministic=not train, rngs=rngs, **gates, **kwargs)

  def forward(self, params: Params, inputs: dict[str, Array], rng: Array | None, train: bool) -> dict[str, Array]:
    """task_loss (and task_correct, except for regression) summed over the batch."""
    return self.terms(self._apply(params, inputs, rng, train), inputs)

  def terms(self, outputs: Any, inputs: dict[str, Array]) -> dict[str, Array]:
    """The loss sums of the head's outputs."""
    return self.task_kind.terms(outputs, inputs)

  # What distillation (`bert_jax.train.distill.Distillation`) reads of a student or teacher.

  @property
  def soft_regression(self) -> bool:
    """Whether the soft target is a value to match (squared error) rather than a distribution."""
    return self.task_kind.soft_regression

  def distill_outputs(self, params: Params, inputs: dict[str, Array], rng: Array | None,
                      train: bool, attention_scores: bool = False) -> dict[str, Any]:
    """{"terms": `terms`, "soft_logits": [..., C] (regression: the values [B]), "hidden_states": the encoder's};
    with `attention_scores` also "attention_scores" (`encoder.attention_scores`; kernels "off")."""
    if not isinstance(self.model, FinetuneModel):
      raise ValueError("distillation needs full fine-tuning; config.feature_based.layers freezes the encoder")
    (outputs, hidden_states), scores = apply_with_scores(self._apply, self.model.config, attention_scores)(
        params, inputs, rng, train, output_hidden_states=True)
    return {"terms": self.terms(outputs, inputs), "soft_logits": self.task_kind.soft_logits(outputs, inputs),
            "hidden_states": hidden_states, **scores}

  def soft_weights(self, inputs: dict[str, Array]) -> Array:
    """The weight of each soft prediction: `soft_logits`' leading shape (span: start and end of each window)."""
    return self.task_kind.soft_weights(inputs)

  def row_weights(self, inputs: dict[str, Array]) -> Array:
    """[rows] the weight of each encoder row ([N * C] for multiple choice)."""
    return self.task_kind.row_weights(inputs, self.num_choices)

  def token_weights(self, inputs: dict[str, Array]) -> Array:
    """[rows, L] the weight of each encoder token: its row's on real tokens, 0 on padding."""
    pack_ids = inputs["pack_ids"].reshape((-1, inputs["pack_ids"].shape[-1]))
    return self.row_weights(inputs)[:, None] * (pack_ids > 0)

  def predict(self, params: Params, inputs: dict[str, Array]) -> Array:
    """The head's raw float32 outputs in `Task.evaluate`'s layout (span: [B, L, 2])."""
    return self.task_kind.predictions(self._apply(params, inputs, None, False), inputs)

  def init_variables(self, rng: Array, batch: dict[str, Array]) -> Any:
    """Boxed variables (params with logical axes) from a batch of the right shapes."""
    inputs = self.prepare(batch)
    return self.model.init({"params": rng, "dropout": rng}, inputs["input_ids"], segment_ids=inputs["segment_ids"],
                           pack_ids=inputs["pack_ids"])


class SentencePieceTaskAdapter:
  """`TaskTokenizer` over a SentencePiece model (ALBERT), offsets from its piece spans."""

  def __init__(self, tokenizer: SentencePieceTokenizer):
    self._processor = tokenizer.processor
    self.cls_id, self.sep_id, self.pad_id = tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id

  def tokenize_with_offsets(self, texts: Sequence[str]) -> tuple[list[list[int]], list[Offsets]]:
    protos = self._processor.encode(list(texts), out_type="immutable_proto")
    return ([[piece.id for piece in proto.pieces] for proto in protos],
            [[(piece.begin, piece.end) for piece in proto.pieces] for proto in protos])


def task_tokenizer(tokenizer: Tokenizer) -> TaskTokenizer:
  """The offsets-reporting view of a project tokenizer that the tasks featurise with."""
  if isinstance(tokenizer, HFTokenizer):
    token = tokenizer.tokenizer.id_to_token
    return HFTokenizerAdapter(tokenizer.tokenizer, cls_token=token(tokenizer.cls_id),
                              sep_token=token(tokenizer.sep_id), pad_token=token(tokenizer.pad_id))
  if isinstance(tokenizer, SentencePieceTokenizer):
    return SentencePieceTaskAdapter(tokenizer)
  raise TypeError(f"no task tokenizer for {type(tokenizer).__name__}")


@dataclasses.dataclass(frozen=True)
class InitialModel:
  """Where fine-tuning starts.

  Attributes:
    source: "pretrained" (a model directory), "pretraining_run" or "finetune_run".
    family: model family ("bert", "roberta", "albert", "electra").
    config: the encoder's config.
    params: {"encoder": tree, "head": tree} with any head parameters worth
      reusing (a pre-trained pooler, an earlier fine-tuning run's head).
    tokenizer: the model's tokenizer (None only when it has none and none was required).
    tokenizer_dir: the directory it was read from (likewise).
    head_kind: task kind of the reused head for "finetune_run", else None.
    step: the step of the run's checkpoint read (None for a model directory).
  """

  source: str
  family: str
  config: ModelConfig
  params: Params
  tokenizer: Tokenizer | None
  tokenizer_dir: pathlib.Path | None
  head_kind: str | None = None
  step: int | None = None


def _pretraining_pooler(params: Params) -> Params:
  """The NSP/SOP head's pooler of a PretrainingModel tree, as {"pooler": ...}, or {}."""
  sentence = params.get("sentence", {})
  return {"pooler": sentence["pooler"]} if "pooler" in sentence else {}


def load_initial_model(path: str | pathlib.Path, require_tokenizer: bool = True, step: int | None = None,
                       step_key: str | None = None) -> InitialModel:
  """Reads the starting point at `path`, whichever of the three kinds it is.

  An earlier fine-tuning run (it holds `finetune_run.json`) gives its best
  seed's encoder and head; a pre-training run (checkpoints/ and
  model_config.json) gives the encoder of its checkpoint `step` (None: its
  newest, which must be readable: an older one is never taken silently) and the
  NSP/SOP pooler; anything else is read by `load_pretrained` (Hugging Face or
  our converted directory) with the base model's pooler when it has one.
  `step_key` names the setting that gives `step`, for the messages.

  Raises:
    FileNotFoundError: when `path` is none of these, or has no tokenizer and
      `require_tokenizer` (a caller with a tokenizer of its own passes False).
    ValueError: the checkpoint cannot be read (or has no such step), or `step` is given for a model directory.
  """
  path = paths.as_path(path)
  if (path / RUN_FILE).exists():
    run = json.loads((path / RUN_FILE).read_text())
    read, params = checkpoint_lib.restore_params(path / run["best_seed_dir"], step, step_key)
    return InitialModel("finetune_run", run["family"], ModelConfig(**run["model_config"]),
                        {"encoder": params["encoder"], "head": params["head"]}, load_tokenizer(path / "tokenizer"),
                        path / "tokenizer", head_kind=run["kind"], step=read)
  if (path / "checkpoints").is_dir() and (path / "model_config.json").exists():
    run_config = checkpoint_lib.read_run_config(path)
    config = ModelConfig(**json.loads((path / "model_config.json").read_text()))
    if run_config.get("objective") == "ltr":
      config = config.replace(causal=True)
    read, params = checkpoint_lib.restore_params(path, step, step_key)
    return InitialModel("pretraining_run", run_config["model"]["family"], config,
                        {"encoder": encoder_params(params), "head": _pretraining_pooler(params)},
                        load_tokenizer(path / "tokenizer"), path / "tokenizer", step=read)
  if step is not None:
    raise ValueError(f"{step_key or 'step'}={step}: {path} is a model directory, which has no checkpoint steps "
                     "(a step picks one of a run's checkpoints)")
  loaded, extras = load_pretrained(path, return_extras=True)
  if loaded.tokenizer_path is None and require_tokenizer:
    raise FileNotFoundError(f"{path} has no tokenizer files (tokenizer.json, vocab.txt, *.model, ...)")
  head = {"pooler": extras["pooler"]} if "pooler" in extras else {}
  return InitialModel("pretrained", loaded.family, loaded.config, {"encoder": encoder_params(loaded.params),
                                                                     "head": head},
                      load_tokenizer(loaded.tokenizer_path) if loaded.tokenizer_path else None, loaded.tokenizer_path)


def merge_initial_params(initialised: Params, loaded: Params) -> tuple[Params, list[str], list[str]]:
  """Puts loaded parameters into a freshly initialised {"encoder", "head"} tree.

  Every encoder leaf must be loaded with its shape; head leaves are taken
  where the loaded tree has them with the same shape (a pooler, an earlier
  run's classifier with as many labels) and re-initialised otherwise.

  Args:
    initialised: host params of the new model, or their shapes (`jax.ShapeDtypeStruct`s, returned where drawn).
    loaded: `InitialModel.params`.

  Returns:
    (params, reused head leaves, re-initialised head leaves), leaves named as
    '/'-joined paths.

  Raises:
    ValueError: naming every missing or mis-shaped encoder leaf.
  """
  loaded_leaves = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(loaded)}
  problems, reused, fresh = [], [], []

  def pick(path, value):
    name = jax.tree_util.keystr(path)
    candidate = loaded_leaves.get(name)
    fits = candidate is not None and tuple(np.shape(candidate)) == tuple(value.shape)
    if name.startswith("['encoder']"):
      if not fits:
        problems.append(f"{name}: expected {tuple(value.shape)}, "
                        f"{'missing' if candidate is None else f'got {tuple(np.shape(candidate))}'}")
        return value
      return np.asarray(candidate, value.dtype)
    (reused if fits else fresh).append(name)
    return np.asarray(candidate, value.dtype) if fits else value

  merged = jax.tree_util.tree_map_with_path(pick, initialised)
  if problems:
    raise ValueError("the initial model does not fit this encoder:\n  " + "\n  ".join(problems))
  return merged, reused, fresh


def build_model(config: ModelConfig, kind: str, num_labels: int, feature_layers: Sequence[int] = (),
                feature_head: str = "bilstm", feature_head_size: int = 768, feature_head_layers: int = 2,
                feature_dropout: float = 0.1, top_bilstm: bool = False) -> nn.Module:
  """`FinetuneModel` (with a BiLSTM under its head when `top_bilstm`), or `FeatureBasedTagger` when
  `feature_layers` is non-empty.

  Raises:
    ValueError: feature-based mode for a kind other than tagging or with top_bilstm, an unknown head or a layer
      outside [-(L + 1), L].
  """
  if not feature_layers:
    return FinetuneModel(config, kind, num_labels, top_bilstm)
  if top_bilstm:
    raise ValueError("config.top_bilstm adds a BiLSTM in full fine-tuning; feature-based mode has its own head "
                     "(config.feature_based.head)")
  if not task_kind(kind).feature_based:
    raise ValueError(f"config.feature_based.layers is set, but feature-based mode serves tagging tasks "
                     f"(BERT's NER comparison), not {kind}")
  if feature_head not in FEATURE_HEADS:
    raise ValueError(f"config.feature_based.head={feature_head!r}: expected one of {FEATURE_HEADS}")
  bad = [layer for layer in feature_layers if not -(config.num_layers + 1) <= layer <= config.num_layers]
  if bad:
    raise ValueError(f"config.feature_based.layers {list(feature_layers)}: {bad} outside "
                     f"[{-(config.num_layers + 1)}, {config.num_layers}] for {config.num_layers} layers")
  return FeatureBasedTagger(config, num_labels, tuple(feature_layers), feature_head, feature_head_size,
                            feature_head_layers, feature_dropout)


def task_model(config: ml_collections.ConfigDict, model_config: ModelConfig, task: Task) -> nn.Module:
  """The model `config` fine-tunes on `task`, fake-quantised to int8 with `quant.qat` (a run written before
  `top_bilstm` or `quant` existed has neither)."""
  feature = config.feature_based
  model = build_model(model_config, task.kind, task.num_labels, tuple(feature.layers), feature.head,
                      feature.head_size, feature.head_layers, feature.dropout, bool(config.get("top_bilstm", False)))
  if config.get("quant", {}).get("qat", False):
    from bert_jax.models import quantization  # noqa: PLC0415 - Qwix (the `quant` extra) only where asked for

    model = quantization.qat_model(model)
  return model


def optimizer(config: ml_collections.ConfigDict, total_steps: int, abstract_params: Any, model_config: ModelConfig,
              feature_based: bool):
  """Fine-tuning's (optimizer, schedule): AdamW/LAMB with warmup_proportion of the steps, layer-wise LR decay,
  the encoder frozen in feature mode."""
  optim_config = ml_collections.ConfigDict({key: value for key, value in config.optim.items()
                                            if key not in ("warmup_proportion", "layerwise_lr_decay")})
  optim_config.warmup_steps = int(config.optim.warmup_proportion * total_steps)
  lr_factors = None
  if config.optim.layerwise_lr_decay < 1.0:
    lr_factors = optim.layerwise_lr_factors(abstract_params, model_config.num_layers, model_config.num_blocks,
                                            config.optim.layerwise_lr_decay, model_config.num_shared_groups)
  # The schedule's step counts in the optimizer state: tasks of other sizes share the compiled steps.
  tx, schedule = optim.make_optimizer(optim_config, total_steps, lr_factors=lr_factors, horizon_in_state=True)
  return (frozen_encoder_optimizer(tx) if feature_based else tx), schedule


def distillation(config: ml_collections.ConfigDict, task: Task, student: FinetuneObjective,
                 max_len: int) -> tuple[distill_lib.Distillation, tuple[Any, Any]]:
  """The student's objective with the teacher's terms (`bert_jax.train.distill`), and (the teacher's task, its
  host params): the teacher is a fine-tuning workdir of this task, or a model directory with its head."""
  path = config.distill.teacher
  if not paths.as_path(path).exists():
    raise ValueError(f"config.distill.teacher={path!r} does not exist: give a fine-tuning workdir of "
                     f"{task.name} (or a converted model with its task head)")
  loaded = load_initial_model(path)
  if loaded.head_kind is not None and loaded.head_kind != task.kind:
    raise ValueError(f"config.distill.teacher={path!r} was fine-tuned for a {loaded.head_kind} task, not "
                     f"{task.name} ({task.kind})")
  # The teacher computes as the student does; it never trains, so nothing of it is rematerialised.
  teacher_config = model_config_for(loaded.config, config.model).replace(remat="none")
  if fitted_max_len(max_len, teacher_config) < max_len:
    raise ValueError(f"config.distill.teacher={path!r} has {teacher_config.max_position_embeddings} positions, "
                     f"fewer than the student's inputs of {max_len} tokens; lower config.max_len")
  teacher = FinetuneObjective(build_model(teacher_config, task.kind, task.num_labels), task.kind,
                              single_token_type=teacher_config.type_vocab_size == 1, num_choices=task.num_choices)
  objective = distill_lib.Distillation.from_config(config.distill, student, teacher)
  return objective, (objective.teacher, loaded.params)
