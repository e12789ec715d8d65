"""Complete pre-training models: encoder + heads (the fine-tuning model is `bert_jax.tasks.finetune_model`'s).

  PretrainingModel  BERT / RoBERTa / ALBERT / SpanBERT / LTR: MLM at gathered
                    positions, optional NSP/SOP head, optional SBO head.
  ElectraModel      generator + discriminator sharing one embedding table; the
                    discriminator detects replaced tokens, or (ELECTRA's
                    Table 5) predicts the originals: Replace / All-Tokens MLM.

All take the batch fields of `bert_jax.data.batch` by name.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from bert_jax.models import heads
from bert_jax.models.config import ModelConfig
from bert_jax.models.encoder import Embeddings, Encoder

Array = jax.Array


def head_rows(config: ModelConfig, length: int, positions: dict[str, Array]) -> tuple[Array | None, dict[str, Array]]:
  """The rows the last block computes under `config.sparse_last_layer`, and each head's positions in them.

  positions: per head, [B, M_i] positions in the sequence. Returns (the encoder's `output_positions` [B, sum M_i],
  the heads' positions in its output: consecutive slices), or (None, `positions`) where every position is
  computed: the option is off, or the rows would be more than half the sequence.
  """
  widths = [p.shape[1] for p in positions.values()]
  if not config.sparse_last_layer or 2 * sum(widths) > length:
    return None, positions
  rows = jnp.concatenate([p.astype(jnp.int32) for p in positions.values()], axis=1)
  rows = jnp.where(rows < 0, rows + length, rows)  # as the heads' gathers read a negative position
  starts = [sum(widths[:i]) for i in range(len(widths))]
  in_rows = {name: jnp.broadcast_to(jnp.arange(start, start + width, dtype=jnp.int32), p.shape)
             for (name, p), start, width in zip(positions.items(), starts, widths)}
  return rows, in_rows


class PretrainingModel(nn.Module):
  """Encoder with the MLM head and, by flag, a sentence (NSP/SOP) head and an SBO head.

  The left-to-right LM ablation is this model with `config.causal=True` and
  the MLM head read at every position (the objective shifts the targets).
  """

  config: ModelConfig
  sentence_head: bool = True
  span_boundary_head: bool = False
  sentence_classes: int = 2  # 2 for NSP / SOP, 3 for StructBERT's sentence structural objective

  def setup(self):
    self.encoder = Encoder(self.config)
    self.mlm = heads.MLMHead(self.config)
    if self.sentence_head:
      self.sentence = heads.SentenceHead(self.config, self.sentence_classes)
    if self.span_boundary_head:
      self.sbo = heads.SpanBoundaryHead(self.config)

  def __call__(self, input_ids: Array, mlm_positions: Array, *, segment_ids: Array | None = None,
               position_ids: Array | None = None, pack_ids: Array | None = None,
               cls_positions: Array | None = None, sbo_left: Array | None = None, sbo_right: Array | None = None,
               sbo_offsets: Array | None = None, packed: bool = False, deterministic: bool = True,
               output_hidden_states: bool = False) -> dict[str, Array]:
    """Returns {"hidden" [B,L,H], "mlm_logits" [B,M,V], "sentence_logits" [B,P,C]?, "sbo_logits" [B,M,V]?}, V the
    config's `padded_vocab_size` (vocab_size unless `vocab_pad_multiple` pads it), C `sentence_classes`; no "hidden"
    where the last block computes only the heads' rows (`ModelConfig.sparse_last_layer`, `head_rows`). With
    `output_hidden_states`, also the encoder's "hidden_states" (`Encoder`'s)."""
    positions = {"mlm": mlm_positions}
    if self.sentence_head:
      positions["cls"] = cls_positions if cls_positions is not None else jnp.zeros_like(mlm_positions[:, :1])
    if self.span_boundary_head:
      positions.update(sbo_left=sbo_left, sbo_right=sbo_right)
    output_positions, positions = head_rows(self.config, input_ids.shape[1], positions)
    encoded = self.encoder(input_ids, segment_ids, position_ids, pack_ids, packed=packed,
                           deterministic=deterministic, output_positions=output_positions,
                           output_hidden_states=output_hidden_states)
    hidden = encoded["hidden"]
    outputs = {"mlm_logits": self.mlm(hidden, positions["mlm"], self.encoder.attend)}
    if output_hidden_states:
      outputs["hidden_states"] = encoded["hidden_states"]
    if output_positions is None:
      outputs["hidden"] = hidden
    if self.sentence_head:
      outputs["sentence_logits"] = self.sentence(hidden, positions["cls"], deterministic)
    if self.span_boundary_head:
      outputs["sbo_logits"] = self.sbo(hidden, positions["sbo_left"], positions["sbo_right"], sbo_offsets,
                                       self.encoder.attend)
    return outputs


ELECTRA_HEADS = ("rtd", "mlm", "all_tokens")


class ElectraModel(nn.Module):
  """ELECTRA: a small MLM generator and a discriminator sharing embeddings.

  The generator fills the masked positions with samples from its own
  distribution (no gradient flows through the sampling); the discriminator
  reads the corrupted tokens. What it predicts is `head` (ELECTRA's Table 5):
  "rtd", for every token whether it was replaced (ELECTRA); "mlm", the
  original token at the masked positions (Replace MLM); "all_tokens", the
  original token at every position, as a copy gate D (a sigmoid per token)
  mixed with the MLM softmax (All-Tokens MLM).
  """

  config: ModelConfig            # discriminator
  generator_config: ModelConfig
  head: str = "rtd"

  def setup(self):
    if self.generator_config.embed_dim != self.config.embed_dim:
      raise ValueError("ELECTRA generator and discriminator must share the embedding size "
                       f"({self.generator_config.embed_dim} != {self.config.embed_dim})")
    if self.head not in ELECTRA_HEADS:
      raise ValueError(f"ElectraModel head={self.head!r}: expected one of {ELECTRA_HEADS}")
    self.embeddings = Embeddings(self.config)
    self.generator = Encoder(self.generator_config, shared_embeddings=self.embeddings)
    self.generator_mlm = heads.MLMHead(self.generator_config)
    self.discriminator = Encoder(self.config, shared_embeddings=self.embeddings)
    if self.head == "rtd":
      self.rtd = heads.ReplacedTokenHead(self.config)
    else:
      self.mlm = heads.MLMHead(self.config)
    if self.head == "all_tokens":
      self.copy = heads.ReplacedTokenHead(self.config)  # the copy gate's logit: one per token, as RTD's

  def __call__(self, input_ids: Array, mlm_positions: Array, original_ids: Array, *,
               segment_ids: Array | None = None, position_ids: Array | None = None, pack_ids: Array | None = None,
               packed: bool = False, deterministic: bool = True, sample: bool = True) -> dict[str, Array]:
    """Runs generator, samples replacements, runs the discriminator.

    Args:
      input_ids: [B, L] masked inputs.
      mlm_positions: [B, M] masked positions.
      original_ids: [B, L] inputs before masking.
      sample: draw replacements from the generator (rng stream "sample");
        False takes the argmax (for deterministic evaluation).

    Returns:
      {"mlm_logits" [B,M,V] generator logits (V: `padded_vocab_size`), "corrupted_ids" [B,L], "replaced" [B,L]
       bool} and the head's: "rtd_logits" [B,L]; "token_logits" [B,M,V] at the masked positions ("mlm") or
       [B,L,V] at every position ("all_tokens", with "copy_logits" [B,L]).
    """
    kwargs = dict(segment_ids=segment_ids, position_ids=position_ids, pack_ids=pack_ids, packed=packed,
                  deterministic=deterministic)
    output_positions, positions = head_rows(self.generator_config, input_ids.shape[1], {"mlm": mlm_positions})
    gen_hidden = self.generator(input_ids, output_positions=output_positions, **kwargs)["hidden"]
    mlm_logits = self.generator_mlm(gen_hidden, positions["mlm"], self.embeddings.attend)
    # The vocabulary's own logits (`vocab_pad_multiple` pads them): the samples do not depend on the padding.
    logits = jax.lax.stop_gradient(mlm_logits[..., :self.generator_config.vocab_size].astype(jnp.float32))
    if sample:
      sampled_bm = jax.random.categorical(self.make_rng("sample"), logits, axis=-1)
    else:
      sampled_bm = jnp.argmax(logits, axis=-1)
    rows = jnp.arange(input_ids.shape[0])[:, None]
    corrupted = input_ids.at[rows, mlm_positions].set(sampled_bm.astype(input_ids.dtype))
    # Unused prediction slots point at position 0 ([CLS]); restore it.
    corrupted = corrupted.at[:, 0].set(original_ids[:, 0])
    outputs = {"mlm_logits": mlm_logits, "corrupted_ids": corrupted, "replaced": corrupted != original_ids}
    if self.head == "rtd":
      outputs["rtd_logits"] = self.rtd(self.discriminator(corrupted, **kwargs)["hidden"])
    elif self.head == "mlm":
      output_positions, positions = head_rows(self.config, input_ids.shape[1], {"mlm": mlm_positions})
      disc_hidden = self.discriminator(corrupted, output_positions=output_positions, **kwargs)["hidden"]
      outputs["token_logits"] = self.mlm(disc_hidden, positions["mlm"], self.embeddings.attend)
    else:
      disc_hidden = self.discriminator(corrupted, **kwargs)["hidden"]
      every_position = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
      outputs["token_logits"] = self.mlm(disc_hidden, every_position, self.embeddings.attend)
      outputs["copy_logits"] = self.copy(disc_hidden)
    return outputs
