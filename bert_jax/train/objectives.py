"""Pre-training objectives: a small table of classes behind one interface.

The train step (`bert_jax.train.step`) knows an objective only through:
  weights                 the weight of each loss term in the total loss;
  prepare(batch)          device-side input preparation that needs no params
                          (masking), run once on the whole global batch;
  denominators(inputs)    token / example counts of the whole batch per term
                          (float32), so gradient accumulation divides once;
  forward(params, inputs, rng, train) -> {term}_loss and {term}_correct sums;
and the commands also call example_batch(rows, seq_len) (zeros of the batch's
fields and shapes) and init_variables(rng, batch); pre-training also
flops_per_token(max_predictions, seq_len). The fine-tuning objective
(`bert_jax.tasks.finetune_model.FinetuneObjective`) has the same interface.

A pre-training objective is one `PretrainingObjective` subclass: its name in
the config, its model, the model's extra inputs and its loss terms, composed
from the shared pieces below (MLM, sentence head, SBO, RTD). `OBJECTIVES`
maps the config's `objective` to the class.

  mlm+nsp  BERT          mlm+sop  ALBERT         mlm  RoBERTa
  mlm+sbo  SpanBERT      ltr      left-to-right LM (BERT's "LTR & No NSP")
  mlm+wso  StructBERT's word structural objective: MLM + the original tokens of shuffled trigrams, predicted by
           the MLM head (term "wso")
  mlm+sso  StructBERT's sentence structural objective: MLM + a three-way sentence head (B next / previous / random)
  mlm+wso+sso  StructBERT: both
  rtd      ELECTRA: generator MLM + 50 x replaced-token detection
  replace_mlm / all_tokens_mlm   ELECTRA's Table 5: generator MLM + the
           discriminator's MLM on the generator's samples, at the masked
           positions / at every token through a copy gate
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from bert_jax.data import formats
from bert_jax.data import masking as masking_lib
from bert_jax.data.masking import MaskingConfig, mask_batch
from bert_jax.models import ElectraModel, ModelConfig, PretrainingModel, electra_generator_config
from bert_jax.models.model import apply_with_scores
from bert_jax.train.losses import binary_cross_entropy_sums, copy_mixture_sums, cross_entropy_sums, dropout_key

Array = jax.Array


def mlm_terms(logits: Array, inputs: dict[str, Array], kernels: str, term: str = "mlm",
              targets: str = "mlm") -> dict[str, Array]:
  """Masked-token cross-entropy at the masked positions (also the SBO term, from the span-boundary logits), or at
  the positions whose `{targets}_ids` and `{targets}_weights` the inputs hold (word shuffling's "shuffled")."""
  loss, correct = cross_entropy_sums(logits, inputs[f"{targets}_ids"], inputs[f"{targets}_weights"], kernels)
  return {f"{term}_loss": loss, f"{term}_correct": correct}


def sentence_terms(logits: Array, inputs: dict[str, Array]) -> dict[str, Array]:
  """NSP / SOP / SSO cross-entropy of each example's [CLS] (two or three classes: no kernel applies)."""
  loss, correct = cross_entropy_sums(logits, inputs["sentence_labels"], inputs["sentence_weights"], "off")
  return {"sentence_loss": loss, "sentence_correct": correct}


RTD_POSITIONS = ("all", "masked")


def check_rtd_positions(positions: str) -> str:
  if positions not in RTD_POSITIONS:
    raise ValueError(f"config.loss.rtd_positions={positions!r}: expected one of {RTD_POSITIONS}")
  return positions


def rtd_weights(inputs: dict[str, Array], positions: str) -> Array:
  """[B, L] weights of the replaced-token detection loss: every real token ("all"), or only the positions the
  generator filled ("masked": ELECTRA's "ELECTRA 15%" ablation)."""
  if check_rtd_positions(positions) == "all":
    return (inputs["pack_ids"] > 0).astype(jnp.float32)
  rows = jnp.arange(inputs["mlm_positions"].shape[0])[:, None]
  return jnp.zeros(inputs["pack_ids"].shape, jnp.float32).at[rows, inputs["mlm_positions"]].max(inputs["mlm_weights"])


def rtd_terms(logits: Array, replaced: Array, weights: Array) -> dict[str, Array]:
  """Replaced-token detection over the tokens `weights` selects."""
  loss, correct = binary_cross_entropy_sums(logits, replaced, weights)
  return {"rtd_loss": loss, "rtd_correct": correct}


@dataclasses.dataclass(frozen=True)
class PretrainingObjective:
  """Masked LM on a `PretrainingModel` (RoBERTa's objective); subclasses add heads and terms."""

  name: ClassVar[str] = "mlm"
  sentence_formats: ClassVar[tuple[str, ...]] = ()  # the example formats a sentence head can train on
  shuffles_words: ClassVar[bool] = False  # masking also shuffles trigrams (`mask_batch`'s shuffle_words)

  model_config: ModelConfig
  masking: MaskingConfig
  mask_id: int
  weights: dict[str, float]
  packed: bool = False
  seed: int = 0
  max_packs: int = 1  # examples per row (packing), hence sentence-head slots per row

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, model_config: ModelConfig,
                  mask_id: int) -> PretrainingObjective:
    if not cls.shuffles_words:
      defaults = MaskingConfig()
      for key in ("shuffle_rate", "shuffle_len"):
        if config.masking.get(key, getattr(defaults, key)) != getattr(defaults, key):
          raise ValueError(f"config.masking.{key}={config.masking[key]!r} applies to the word structural objective "
                           f"only (objective 'mlm+wso' or 'mlm+wso+sso'; this one is {cls.name!r}): leave it at "
                           f"{getattr(defaults, key)!r}")
    return cls(model_config=model_config, masking=MaskingConfig(**config.masking.to_dict()), mask_id=mask_id,
               weights=cls.loss_weights(config.loss), packed=bool(config.data.packing), seed=int(config.seed),
               max_packs=int(config.data.max_packs) if config.data.packing else 1)

  @classmethod
  def loss_weights(cls, loss: ml_collections.ConfigDict) -> dict[str, float]:
    del loss
    return {"mlm": 1.0}

  @property
  def kernels(self) -> str:
    """The model config's kernel switch, which also chooses the vocabulary-wide losses' implementation."""
    return getattr(self.model_config, "kernels", "auto")

  @property
  def model(self) -> nn.Module:
    return PretrainingModel(self.model_config)

  @property
  def model_configs(self) -> tuple[ModelConfig, ...]:
    """Every network the step runs (for FLOPs)."""
    return (self.model_config,)

  def predictions_per_token(self, max_predictions: int, seq_len: int) -> float:
    shuffled = masking_lib.shuffle_slots(self.masking, seq_len) if self.shuffles_words else 0
    return (max_predictions + shuffled) / seq_len

  def flops_per_token(self, max_predictions: int, seq_len: int, dense_embedding_lookup: bool = False) -> float:
    """Training FLOPs per token of every network the step runs (`ModelConfig.flops_per_token`)."""
    predictions = self.predictions_per_token(max_predictions, seq_len)
    return sum(cfg.flops_per_token(seq_len, predictions, dense_embedding_lookup) for cfg in self.model_configs)

  def example_batch(self, rows: int, seq_len: int) -> dict[str, Array]:
    """A batch of the pipeline's fields and shapes (zeros), to initialise the model and trace the step."""
    zeros = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    ones = jnp.ones((rows, seq_len), jnp.int32)
    return {"input_ids": zeros(rows, seq_len), "segment_ids": zeros(rows, seq_len),
            "position_ids": jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (rows, seq_len)),
            "pack_ids": ones, "word_starts": ones, "special_mask": zeros(rows, seq_len),
            "cls_positions": zeros(rows, self.max_packs), "sentence_labels": zeros(rows, self.max_packs),
            "sentence_weights": jnp.ones((rows, self.max_packs), jnp.float32),
            "example_ids": jnp.arange(rows, dtype=jnp.int32), "epoch": zeros(rows)}

  def prepare(self, batch: dict[str, Array]) -> dict[str, Array]:
    """Masks the batch on device, keyed by (seed, example id, epoch) only."""
    inputs = dict(batch, original_ids=batch["input_ids"])
    inputs.update(mask_batch(jax.random.key(self.seed), batch, self.masking, mask_id=self.mask_id,
                             vocab_size=self.model_config.vocab_size, shuffle_words=self.shuffles_words))
    return inputs

  def denominators(self, inputs: dict[str, Array]) -> dict[str, Array]:
    return {"mlm": jnp.sum(inputs["mlm_weights"])}

  def head_inputs(self, inputs: dict[str, Array]) -> dict[str, Array]:
    """The model's keyword inputs beyond the encoder's."""
    del inputs
    return {}

  def predicted_positions(self, inputs: dict[str, Array]) -> Array:
    """[B, M'] the positions the MLM head predicts: the masked ones (and more for word shuffling)."""
    return inputs["mlm_positions"]

  def apply(self, variables: Any, inputs: dict[str, Array], train: bool, method: str = "apply", **kwargs) -> Any:
    common = dict(segment_ids=inputs["segment_ids"], position_ids=inputs["position_ids"],
                  pack_ids=inputs["pack_ids"], packed=self.packed, **self.head_inputs(inputs))
    if method == "apply":
      common["deterministic"] = not train
    return getattr(self.model, method)(variables, inputs["input_ids"], self.predicted_positions(inputs), **common,
                                       **kwargs)

  def rngs(self, rng: Array | None, train: bool) -> dict[str, Array]:
    if not train or rng is None:
      return {}
    dropout_rng, sample_rng = jax.random.split(rng)
    return {"dropout": dropout_key(dropout_rng), "sample": sample_rng}

  def terms(self, outputs: dict[str, Array], inputs: dict[str, Array]) -> dict[str, Array]:
    return mlm_terms(outputs["mlm_logits"], inputs, self.kernels)

  def forward(self, params: Any, inputs: dict[str, Array], rng: Array | None, train: bool) -> dict[str, Array]:
    """Returns {term}_loss and {term}_correct sums for every term of the objective."""
    outputs = self.apply({"params": params}, inputs, train, rngs=self.rngs(rng, train))
    return self.terms(outputs, inputs)

  # What distillation (`bert_jax.train.distill.Distillation`) reads of a student or teacher.

  soft_regression: ClassVar[bool] = False

  def distill_outputs(self, params: Any, inputs: dict[str, Array], rng: Array | None, train: bool,
                      attention_scores: bool = False) -> dict[str, Any]:
    """{"terms": `terms`, "soft_logits": [B, M, vocab] at the predicted positions, "hidden_states": the
    encoder's (the last at every position only without `ModelConfig.sparse_last_layer`)}; with
    `attention_scores` also "attention_scores" (`encoder.attention_scores`; kernels "off")."""
    outputs, scores = apply_with_scores(self.apply, self.model_config, attention_scores)(
        {"params": params}, inputs, train, rngs=self.rngs(rng, train), output_hidden_states=True)
    return {"terms": self.terms(outputs, inputs), "hidden_states": outputs["hidden_states"],
            "soft_logits": outputs["mlm_logits"][..., :self.model_config.vocab_size], **scores}

  def soft_weights(self, inputs: dict[str, Array]) -> Array:
    return inputs["mlm_weights"]

  def row_weights(self, inputs: dict[str, Array]) -> Array:
    return (inputs["pack_ids"][:, 0] > 0).astype(jnp.float32)

  def token_weights(self, inputs: dict[str, Array]) -> Array:
    return (inputs["pack_ids"] > 0).astype(jnp.float32)

  def init_variables(self, rng: Array, batch: dict[str, Array]) -> Any:
    """Initialises the model on a batch; returns boxed params with logical axes."""
    return self.apply({"params": rng, "dropout": rng, "sample": rng}, self.prepare(batch), False, method="init")


class NextSentencePrediction(PretrainingObjective):
  """BERT: MLM + next-sentence prediction on segment pairs."""

  name = "mlm+nsp"
  sentence_formats = ("segment_pair", "sentence_pair")

  @classmethod
  def loss_weights(cls, loss):
    return {"mlm": 1.0, "sentence": loss.sentence_weight}

  @property
  def model(self):
    return PretrainingModel(self.model_config, sentence_head=True,
                            sentence_classes=formats.SENTENCE_CLASSES[self.sentence_formats[0]])

  def denominators(self, inputs):
    return {**super().denominators(inputs), "sentence": jnp.sum(inputs["sentence_weights"])}

  def head_inputs(self, inputs):
    return {"cls_positions": inputs["cls_positions"]}

  def terms(self, outputs, inputs):
    return {**super().terms(outputs, inputs), **sentence_terms(outputs["sentence_logits"], inputs)}


class SentenceOrderPrediction(NextSentencePrediction):
  """ALBERT: MLM + sentence-order prediction (the same head, on swapped or kept segment pairs)."""

  name = "mlm+sop"
  sentence_formats = ("sop",)


class SentenceStructural(NextSentencePrediction):
  """StructBERT's sentence structural objective: MLM + a three-way head on segment pairs whose B is the next
  segment of A, the previous one, or one from another document (the format "sso", its labels 0, 1, 2)."""

  name = "mlm+sso"
  sentence_formats = ("sso",)


class WordStructural(PretrainingObjective):
  """StructBERT's word structural objective: MLM + the original tokens at the positions of shuffled trigrams of
  unmasked tokens (`masking` module docstring), predicted by the MLM head as the paper does, term "wso" with the
  paper's weight (equal to MLM's)."""

  name = "mlm+wso"
  shuffles_words = True

  @classmethod
  def loss_weights(cls, loss):
    return {**super().loss_weights(loss), "wso": 1.0}

  def denominators(self, inputs):
    return {**super().denominators(inputs), "wso": jnp.sum(inputs["shuffled_weights"])}

  def predicted_positions(self, inputs):
    return jnp.concatenate([super().predicted_positions(inputs), inputs["shuffled_positions"]], axis=1)

  def terms(self, outputs, inputs):
    # The MLM head's logits at the masked positions, then at the shuffled ones (`predicted_positions`).
    masked = inputs["mlm_positions"].shape[1]
    logits = outputs["mlm_logits"]
    return {**super().terms(dict(outputs, mlm_logits=logits[:, :masked]), inputs),
            **mlm_terms(logits[:, masked:], inputs, self.kernels, "wso", "shuffled")}


class StructBERT(WordStructural, SentenceStructural):
  """StructBERT (Wang et al. 2020): MLM + the word structural objective + the sentence structural objective."""

  name = "mlm+wso+sso"


class SpanBoundary(PretrainingObjective):
  """SpanBERT: MLM + the span boundary objective (each masked token predicted from its span's boundaries)."""

  name = "mlm+sbo"

  @classmethod
  def loss_weights(cls, loss):
    return {"mlm": 1.0, "sbo": loss.sbo_weight}

  @property
  def model(self):
    return PretrainingModel(self.model_config, span_boundary_head=True)

  def denominators(self, inputs):
    return {**super().denominators(inputs), "sbo": jnp.sum(inputs["mlm_weights"])}

  def head_inputs(self, inputs):
    return {key: inputs[key] for key in ("sbo_left", "sbo_right", "sbo_offsets")}

  def terms(self, outputs, inputs):
    return {**super().terms(outputs, inputs), **mlm_terms(outputs["sbo_logits"], inputs, self.kernels, "sbo")}


class LeftToRight(PretrainingObjective):
  """A causal LM: token t+1 predicted from positions <= t inside the same packed example.

  Its term is "lm" (lm_loss, lm_accuracy, lm_perplexity): next-token figures, not comparable with MLM's.
  """

  name = "ltr"

  @classmethod
  def from_config(cls, config, model_config, mask_id):
    return super().from_config(config, model_config.replace(causal=True), mask_id)

  @classmethod
  def loss_weights(cls, loss):
    del loss
    return {"lm": 1.0}

  def denominators(self, inputs):
    return {"lm": jnp.sum(inputs["mlm_weights"])}

  def terms(self, outputs, inputs):
    return mlm_terms(outputs["mlm_logits"], inputs, self.kernels, "lm")

  def predictions_per_token(self, max_predictions, seq_len):
    return 1.0

  def prepare(self, batch):
    rows, length = batch["input_ids"].shape
    same_example = (batch["pack_ids"][:, 1:] == batch["pack_ids"][:, :-1]) & (batch["pack_ids"][:, 1:] > 0)
    return dict(batch, original_ids=batch["input_ids"],
                mlm_positions=jnp.broadcast_to(jnp.arange(length - 1, dtype=jnp.int32), (rows, length - 1)),
                mlm_ids=batch["input_ids"][:, 1:], mlm_weights=same_example.astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class ReplacedTokenDetection(PretrainingObjective):
  """ELECTRA: a small generator's MLM + the discriminator's replaced-token detection on its samples."""

  name = "rtd"
  head: ClassVar[str] = "rtd"  # what the discriminator predicts (`ElectraModel.head`)

  generator_config: ModelConfig | None = None
  rtd_positions: str = "all"  # `rtd_weights`

  @classmethod
  def from_config(cls, config, model_config, mask_id):
    objective = super().from_config(config, model_config, mask_id)
    return dataclasses.replace(objective, rtd_positions=check_rtd_positions(config.loss.rtd_positions),
                               generator_config=electra_generator_config(model_config,
                                                                         config.model.generator_fraction))

  @classmethod
  def loss_weights(cls, loss):
    return {"mlm": loss.generator_weight, "rtd": loss.rtd_weight}

  @property
  def model(self):
    return ElectraModel(self.model_config, self.generator_config, self.head)

  @property
  def model_configs(self):
    return (self.model_config, self.generator_config)

  def discriminator_predictions(self, masked: float) -> float:
    """Vocabulary predictions per token of the discriminator's head, given the masked fraction: RTD has none."""
    del masked
    return 0.0

  def flops_per_token(self, max_predictions, seq_len, dense_embedding_lookup=False):
    masked = self.predictions_per_token(max_predictions, seq_len)
    return (self.generator_config.flops_per_token(seq_len, masked, dense_embedding_lookup)
            + self.model_config.flops_per_token(seq_len, self.discriminator_predictions(masked),
                                                dense_embedding_lookup))

  def denominators(self, inputs):
    return {**super().denominators(inputs), "rtd": jnp.sum(rtd_weights(inputs, self.rtd_positions))}

  def apply(self, variables, inputs, train, method="apply", **kwargs):
    common = dict(segment_ids=inputs["segment_ids"], position_ids=inputs["position_ids"],
                  pack_ids=inputs["pack_ids"], packed=self.packed)
    if method == "apply":
      common["deterministic"] = not train
    return getattr(self.model, method)(variables, inputs["input_ids"], inputs["mlm_positions"],
                                       inputs["original_ids"], **common, **kwargs)

  def rngs(self, rng, train):
    # Evaluation samples the generator too, from a fixed key, so every evaluation scores the same replacements.
    return super().rngs(rng, train) if train else {"sample": jax.random.key(self.seed)}

  def terms(self, outputs, inputs):
    return {**mlm_terms(outputs["mlm_logits"], inputs, self.kernels),
            **rtd_terms(outputs["rtd_logits"], outputs["replaced"], rtd_weights(inputs, self.rtd_positions))}


class ReplaceMLM(ReplacedTokenDetection):
  """ELECTRA's Replace MLM (its Table 5): the masked positions hold the generator's samples instead of [MASK], and
  the discriminator predicts the original tokens there (term "mlm"). No replaced-token detection; the generator
  trains jointly on its own MLM (term "generator")."""

  name = "replace_mlm"
  head = "mlm"

  @classmethod
  def from_config(cls, config, model_config, mask_id):
    if config.loss.rtd_positions != "all":
      raise ValueError(f"config.loss.rtd_positions={config.loss.rtd_positions!r} applies to objective 'rtd' only "
                       f"(objective {cls.name!r} has no replaced-token detection): leave it at 'all'")
    return super().from_config(config, model_config, mask_id)

  @classmethod
  def loss_weights(cls, loss):
    return {"generator": loss.generator_weight, "mlm": 1.0}

  def discriminator_predictions(self, masked):
    return masked

  def denominators(self, inputs):
    masked = jnp.sum(inputs["mlm_weights"])
    return {"generator": masked, "mlm": masked}

  def terms(self, outputs, inputs):
    return {**mlm_terms(outputs["mlm_logits"], inputs, self.kernels, "generator"),
            **mlm_terms(outputs["token_logits"], inputs, self.kernels)}


class AllTokensMLM(ReplaceMLM):
  """ELECTRA's All-Tokens MLM: Replace MLM, the discriminator predicting the original of every real token
  (term "mlm") through the paper's copy mechanism: p = D [input token] + (1 - D) p_MLM, D a sigmoid per token
  (`losses.copy_mixture_sums`)."""

  name = "all_tokens_mlm"
  head = "all_tokens"

  def discriminator_predictions(self, masked):
    del masked
    return 1.0

  def denominators(self, inputs):
    return {"generator": jnp.sum(inputs["mlm_weights"]), "mlm": jnp.sum(inputs["pack_ids"] > 0).astype(jnp.float32)}

  def terms(self, outputs, inputs):
    loss, correct = copy_mixture_sums(outputs["token_logits"], outputs["copy_logits"], outputs["corrupted_ids"],
                                      inputs["original_ids"], inputs["pack_ids"] > 0)
    return {**mlm_terms(outputs["mlm_logits"], inputs, self.kernels, "generator"), "mlm_loss": loss,
            "mlm_correct": correct}


# The config's `objective` -> its class; a new objective is one class added here.
OBJECTIVES: dict[str, type[PretrainingObjective]] = {
    cls.name: cls for cls in (NextSentencePrediction, SentenceOrderPrediction, PretrainingObjective, SpanBoundary,
                              LeftToRight, ReplacedTokenDetection, ReplaceMLM, AllTokensMLM, WordStructural,
                              SentenceStructural, StructBERT)}
# Each sentence objective's default example format (its first).
SENTENCE_FORMATS = {name: cls.sentence_formats[0] for name, cls in OBJECTIVES.items() if cls.sentence_formats}


def objective_class(name: str) -> type[PretrainingObjective]:
  if name not in OBJECTIVES:
    raise ValueError(f"config.objective={name!r}: expected one of {tuple(OBJECTIVES)}")
  return OBJECTIVES[name]


def make_objective(config: ml_collections.ConfigDict, model_config: ModelConfig, mask_id: int) -> PretrainingObjective:
  """Builds the objective of `config.objective` from the experiment config."""
  return objective_class(config.objective).from_config(config, model_config, mask_id)
