"""Pre-training objectives behind one small interface.

The trainer knows an objective only through:
  model                   the Flax module (its params are the train state's);
  prepare(batch)          device-side input preparation that needs no params
                          (masking), run once on the whole global batch;
  denominators(inputs)    token / example counts of the whole batch per loss
                          term (float32), so gradient accumulation divides
                          once;
  forward(params, inputs, rng, train) -> per-term loss and correct-prediction
                          sums (numerators);
  weights                 the weight of each term in the total loss.

The total loss is sum_k weight_k * loss_sum_k / count_k, which makes an
accumulated step equal to the unaccumulated one.

Objectives: mlm+nsp (BERT), mlm+sop (ALBERT), mlm (RoBERTa), mlm+sbo
(SpanBERT), ltr (left-to-right LM, BERT's "LTR & No NSP" ablation),
rtd (ELECTRA: generator MLM + 50 x replaced-token detection).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from bert_jax.data.masking import MaskingConfig, mask_batch
from bert_jax.kernels.cross_entropy import cross_entropy_sums
from bert_jax.models import ElectraModel, ModelConfig, PretrainingModel, electra_generator_config

OBJECTIVES = ("mlm+nsp", "mlm+sop", "mlm", "mlm+sbo", "ltr", "rtd")
# The example format each objective's sentence head needs.
SENTENCE_FORMATS = {"mlm+nsp": "segment_pair", "mlm+sop": "sop"}

Array = jax.Array


def binary_cross_entropy_sums(logits: Array, labels: Array, weights: Array) -> tuple[Array, Array]:
  logits = logits.astype(jnp.float32)
  labels = labels.astype(jnp.float32)
  loss = jnp.sum(optax.sigmoid_binary_cross_entropy(logits, labels) * weights)
  correct = jnp.sum(((logits > 0) == (labels > 0.5)) * weights)
  return loss, correct


def dropout_key(key: Array) -> Array:
  """An "rbg" key drawn from `key`, for the "dropout" RNG stream.

  The masks themselves are hashed (`bert_jax.kernels.dropout`); each dropout
  site draws only two seeds from this stream, so the key's implementation no
  longer matters for speed. It stays "rbg" so that the seeds, and with them
  the masks of a given step key, are those of runs already made.
  """
  return jax.random.wrap_key_data(jax.random.bits(key, (4,), jnp.uint32), impl="rbg")


@dataclasses.dataclass(frozen=True)
class Objective:
  """One pre-training objective bound to a model config (see the module docstring)."""

  name: str
  model_config: ModelConfig
  masking: MaskingConfig
  mask_id: int
  weights: dict[str, float]
  packed: bool = False
  seed: int = 0
  generator_config: ModelConfig | None = None

  @property
  def model(self) -> nn.Module:
    if self.name == "rtd":
      return ElectraModel(self.model_config, self.generator_config)
    return PretrainingModel(self.model_config, sentence_head=self.name in SENTENCE_FORMATS,
                            span_boundary_head=self.name == "mlm+sbo")

  @property
  def terms(self) -> tuple[str, ...]:
    return tuple(self.weights)

  def prepare(self, batch: dict[str, Array]) -> dict[str, Array]:
    """Masks (or, for LTR, shifts) the batch on device. Keyed by (seed, example id, epoch) only."""
    inputs = dict(batch)
    inputs["original_ids"] = batch["input_ids"]
    if self.name == "ltr":
      # Predict token t+1 from positions <= t, inside the same packed example.
      length = batch["input_ids"].shape[1]
      rows = batch["input_ids"].shape[0]
      inputs["mlm_positions"] = jnp.broadcast_to(jnp.arange(length - 1, dtype=jnp.int32), (rows, length - 1))
      inputs["mlm_ids"] = batch["input_ids"][:, 1:]
      same_example = (batch["pack_ids"][:, 1:] == batch["pack_ids"][:, :-1]) & (batch["pack_ids"][:, 1:] > 0)
      inputs["mlm_weights"] = same_example.astype(jnp.float32)
      return inputs
    masked = mask_batch(jax.random.key(self.seed), batch, self.masking, mask_id=self.mask_id,
                        vocab_size=self.model_config.vocab_size)
    inputs.update(masked)
    return inputs

  def denominators(self, inputs: dict[str, Array]) -> dict[str, Array]:
    counts = {}
    for term in self.terms:
      if term in ("mlm", "sbo"):
        counts[term] = jnp.sum(inputs["mlm_weights"])
      elif term == "sentence":
        counts[term] = jnp.sum(inputs["sentence_weights"])
      elif term == "rtd":
        counts[term] = jnp.sum(inputs["pack_ids"] > 0).astype(jnp.float32)
    return counts

  def forward(self, params: Any, inputs: dict[str, Array], rng: Array | None, train: bool) -> dict[str, Array]:
    """Returns {term}_loss and {term}_correct sums for every term of the objective."""
    rngs = {}
    if rng is not None:
      dropout_rng, sample_rng = jax.random.split(rng)
      rngs = {"dropout": dropout_key(dropout_rng), "sample": sample_rng}
    if not train:
      rngs = {"sample": jax.random.key(self.seed)} if self.name == "rtd" else {}
    common = dict(segment_ids=inputs["segment_ids"], position_ids=inputs["position_ids"],
                  pack_ids=inputs["pack_ids"], packed=self.packed, deterministic=not train)
    out: dict[str, Array] = {}
    if self.name == "rtd":
      model_out = self.model.apply({"params": params}, inputs["input_ids"], inputs["mlm_positions"],
                                   inputs["original_ids"], rngs=rngs, **common)
      out["mlm_loss"], out["mlm_correct"] = cross_entropy_sums(model_out["mlm_logits"], inputs["mlm_ids"],
                                                               inputs["mlm_weights"])
      real = (inputs["pack_ids"] > 0).astype(jnp.float32)
      out["rtd_loss"], out["rtd_correct"] = binary_cross_entropy_sums(model_out["rtd_logits"],
                                                                      model_out["replaced"], real)
      return out
    extra = {}
    if self.name in SENTENCE_FORMATS:
      extra["cls_positions"] = inputs["cls_positions"]
    if self.name == "mlm+sbo":
      extra.update(sbo_left=inputs["sbo_left"], sbo_right=inputs["sbo_right"], sbo_offsets=inputs["sbo_offsets"])
    model_out = self.model.apply({"params": params}, inputs["input_ids"], inputs["mlm_positions"], rngs=rngs,
                                 **common, **extra)
    out["mlm_loss"], out["mlm_correct"] = cross_entropy_sums(model_out["mlm_logits"], inputs["mlm_ids"],
                                                             inputs["mlm_weights"])
    if "sentence" in self.weights:
      out["sentence_loss"], out["sentence_correct"] = cross_entropy_sums(
          model_out["sentence_logits"], inputs["sentence_labels"], inputs["sentence_weights"])
    if "sbo" in self.weights:
      out["sbo_loss"], out["sbo_correct"] = cross_entropy_sums(model_out["sbo_logits"], inputs["mlm_ids"],
                                                               inputs["mlm_weights"])
    return out

  def init_variables(self, rng: Array, batch: dict[str, Array]) -> Any:
    """Initialises the model on a (prepared) batch; returns boxed params with logical axes."""
    inputs = self.prepare(batch)
    rngs = {"params": rng, "dropout": rng, "sample": rng}
    common = dict(segment_ids=inputs["segment_ids"], position_ids=inputs["position_ids"],
                  pack_ids=inputs["pack_ids"], packed=self.packed)
    if self.name == "rtd":
      return self.model.init(rngs, inputs["input_ids"], inputs["mlm_positions"], inputs["original_ids"], **common)
    extra = {}
    if self.name in SENTENCE_FORMATS:
      extra["cls_positions"] = inputs["cls_positions"]
    if self.name == "mlm+sbo":
      extra.update(sbo_left=inputs["sbo_left"], sbo_right=inputs["sbo_right"], sbo_offsets=inputs["sbo_offsets"])
    return self.model.init(rngs, inputs["input_ids"], inputs["mlm_positions"], **common, **extra)


def make_objective(config: ml_collections.ConfigDict, model_config: ModelConfig, mask_id: int) -> Objective:
  """Builds the objective of `config.objective` from the experiment config."""
  name = config.objective
  if name not in OBJECTIVES:
    raise ValueError(f"config.objective={name!r}: expected one of {OBJECTIVES}")
  weights = {"mlm": 1.0}
  if name in SENTENCE_FORMATS:
    weights["sentence"] = config.loss.sentence_weight
  if name == "mlm+sbo":
    weights["sbo"] = config.loss.sbo_weight
  generator_config = None
  if name == "rtd":
    weights = {"mlm": config.loss.generator_weight, "rtd": config.loss.rtd_weight}
    generator_config = electra_generator_config(model_config, config.model.generator_fraction)
  if name == "ltr":
    model_config = model_config.replace(causal=True)
  masking = MaskingConfig(**config.masking.to_dict())
  return Objective(name=name, model_config=model_config, masking=masking, mask_id=mask_id, weights=weights,
                   packed=bool(config.data.packing), seed=int(config.seed), generator_config=generator_config)
