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


def soft_target_sums(student_logits: Array, teacher_logits: Array, weights: Array, temperature: float) -> Array:
  """Weighted sum of temperature**2 * KL(softmax(teacher / T) || softmax(student / T)) over the last axis
  (Hinton et al. 2015; the T**2 keeps the gradients' scale as T changes). Zero where the two agree.

  Args:
    student_logits, teacher_logits: [..., C] in any float dtype (the arithmetic is float32); a class that one
      side masks with a very negative logit has teacher probability 0 and adds nothing.
    weights: [...] per-prediction weights.
    temperature: T > 0.
  """
  teacher_log_probs = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
  student_log_probs = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
  teacher_probs = jnp.exp(teacher_log_probs)
  # 0 * log 0 is 0: classes the teacher gives no mass (masked positions) add nothing, not NaN.
  kl = jnp.sum(jnp.where(teacher_probs > 0, teacher_probs * (teacher_log_probs - student_log_probs), 0.0), axis=-1)
  return temperature ** 2 * jnp.sum(kl * weights.astype(jnp.float32))


def squared_error_sums(predictions: Array, targets: Array, weights: Array) -> Array:
  """Weighted sum of (prediction - target)**2 (float32): regression's soft target is the teacher's value."""
  error = predictions.astype(jnp.float32) - targets.astype(jnp.float32)
  return jnp.sum(jnp.square(error) * weights.astype(jnp.float32))


def normalized_distance_sums(student: Array, teacher: Array, weights: Array) -> Array:
  """BERT-PKD's patient loss: sum over [..., H] rows of ||s / ||s|| - t / ||t|| ||**2, weighted per row."""
  def unit(x):
    x = x.astype(jnp.float32)
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)

  return jnp.sum(jnp.sum(jnp.square(unit(student) - unit(teacher)), axis=-1) * weights.astype(jnp.float32))


def cosine_distance_sums(student: Array, teacher: Array, weights: Array) -> Array:
  """DistilBERT's hidden-state loss: sum over [..., H] rows of 1 - cos(s, t), weighted per row."""
  s, t = student.astype(jnp.float32), teacher.astype(jnp.float32)
  cosine = jnp.sum(s * t, axis=-1) / jnp.maximum(jnp.linalg.norm(s, axis=-1) * jnp.linalg.norm(t, axis=-1), 1e-12)
  return jnp.sum((1.0 - cosine) * weights.astype(jnp.float32))
