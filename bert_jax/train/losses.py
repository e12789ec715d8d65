"""Loss sums shared by the pre-training and fine-tuning objectives, and the dropout stream's key.

Every loss here is a sum over the batch (float32); the train step divides once
by the whole batch's counts, so an accumulated step equals the direct one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

Array = jax.Array
KERNELS = ("auto", "off")


def cross_entropy_sums(logits: Array, targets: Array, weights: Array, kernels: str = "auto") -> tuple[Array, Array]:
  """Weighted sums of token cross-entropy and of correct argmax predictions (float32).

  Args:
    logits: [..., V] in any float dtype (the arithmetic is float32).
    targets: [...] int class ids.
    weights: [...] per-token weights (0 for padding predictions).
    kernels: "auto" (`bert_jax.kernels.cross_entropy`, a fast path with the same values) or "off" (optax).

  Returns:
    (sum of weight * (logsumexp(logits) - logits[target]), sum of weight * [argmax == target]).
  """
  if kernels not in KERNELS:
    raise ValueError(f"kernels={kernels!r}: expected one of {KERNELS}")
  targets = targets.astype(jnp.int32)
  weights = weights.astype(jnp.float32)
  if kernels == "auto":
    from bert_jax.kernels import cross_entropy  # Lazy: only "auto" needs the kernels and their imports.
    return cross_entropy.cross_entropy_sums(logits, targets, weights)
  token_loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return jnp.sum(token_loss * weights), jnp.sum(correct * weights)


def binary_cross_entropy_sums(logits: Array, labels: Array, weights: Array) -> tuple[Array, Array]:
  """Weighted sums of sigmoid cross-entropy and of correct sign predictions (float32)."""
  logits = logits.astype(jnp.float32)
  labels = labels.astype(jnp.float32)
  loss = jnp.sum(optax.sigmoid_binary_cross_entropy(logits, labels) * weights)
  correct = jnp.sum(((logits > 0) == (labels > 0.5)) * weights)
  return loss, correct


def copy_mixture_sums(logits: Array, copy_logits: Array, input_ids: Array, targets: Array,
                      weights: Array) -> tuple[Array, Array]:
  """Weighted sums of -log p(target) and of [argmax p == target] under ELECTRA's All-Tokens MLM copy mechanism.

  p(t) = D [t == input] + (1 - D) softmax(logits)_t, with the copy probability D = sigmoid(copy_logits): the
  model may copy its input token, or predict from the MLM softmax. Log-space arithmetic in float32.

  Args:
    logits: [..., V] MLM logits at each position.
    copy_logits: [...] the copy gate's logits.
    input_ids: [...] the tokens the model read (a copy predicts these).
    targets: [...] the original tokens.
    weights: [...] per-position weights.
  """
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  pick = lambda ids: jnp.take_along_axis(log_probs, ids.astype(jnp.int32)[..., None], axis=-1)[..., 0]  # noqa: E731
  log_copy, log_predict = jax.nn.log_sigmoid(copy_logits.astype(jnp.float32)), jax.nn.log_sigmoid(-copy_logits)
  copied = input_ids == targets
  log_p = log_predict + pick(targets)
  log_p = jnp.where(copied, jnp.logaddexp(log_copy, log_p), log_p)
  # The mixture's argmax: the input token unless another token's (1 - D) p_t outweighs its D + (1 - D) p_input.
  input_score = jnp.logaddexp(log_copy, log_predict + pick(input_ids))
  prediction = jnp.where(input_score >= log_predict + jnp.max(log_probs, axis=-1), input_ids,
                         jnp.argmax(log_probs, axis=-1))
  weights = weights.astype(jnp.float32)
  return -jnp.sum(log_p * weights), jnp.sum((prediction == targets) * weights)


def dropout_key(key: Array) -> Array:
  """The key of the model's "dropout" RNG stream, drawn from a step's key: an "rbg" key.

  Used by pre-training and fine-tuning alike. The dropout masks are hashed
  from two seeds per site (`bert_jax.models.dropout`), so the key's
  implementation does not change speed; "rbg" keeps the masks of a given
  step key those of earlier runs.
  """
  return jax.random.wrap_key_data(jax.random.bits(key, (4,), jnp.uint32), impl="rbg")
