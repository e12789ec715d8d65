"""The MLM loss's row-statistics kernel compiled for the GPU (Triton) vs XLA, at the benchmark rows' shapes.

Skipped without a GPU (on CPU, tests/test_ops.py runs the same kernel in Pallas' interpreter). The logits are
those of BERT's padded vocabulary (30592 columns, the last 70 at the padding logit) and of an unpadded one (30522:
the last chunk overlaps its predecessor); row 1 holds its maximum twice. `pytest -s` prints the errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.kernels import cross_entropy as cross_entropy_kernel
from bert_jax.models.model import PAD_LOGIT
from test_ops import logits_with_ties

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Triton)")


def _mlm_logits(rows: int, columns: int, vocab: int):
  logits, targets = logits_with_ties((rows, columns), jax.random.key(rows))
  targets = jnp.minimum(targets, vocab - 1).at[::2].set(jnp.argmax(logits[::2, :vocab], axis=-1))
  return logits.at[:, vocab:].set(PAD_LOGIT), targets


@pytest.mark.parametrize("rows, columns, vocab", [(4864, 30592, 30522), (2432, 30592, 30522), (64, 30522, 30522)])
def test_statistics_on_gpu_equal_xla(rows, columns, vocab):
  logits, targets = _mlm_logits(rows, columns, vocab)
  hlo = jax.jit(cross_entropy_kernel.row_statistics).lower(logits, targets).compile().as_text()
  assert "triton" in hlo.lower()  # the kernel, not the XLA fallback
  log_z, target_logit, argmax = jax.jit(cross_entropy_kernel.row_statistics)(logits, targets)
  logits32 = logits.astype(jnp.float32)
  expected = jax.nn.logsumexp(logits32, axis=-1)
  error = float(jnp.max(jnp.abs(log_z - expected) / jnp.abs(expected)))
  print(f"{rows} x {columns}: log-sum-exp relative error {error:.2e}")
  assert error < 2e-6
  np.testing.assert_array_equal(target_logit, jnp.take_along_axis(logits32, targets[:, None], axis=-1)[:, 0])
  np.testing.assert_array_equal(argmax, jnp.argmax(logits, axis=-1))
  assert int(argmax[1]) == 7


def test_loss_and_gradient_on_gpu_equal_xla():
  logits, targets = _mlm_logits(4864, 30592, 30522)
  weights = (jax.random.uniform(jax.random.key(1), (4864,)) > 0.05).astype(jnp.float32)

  def run(logits, targets, weights, implementation):
    kernel = implementation == "pallas"
    fn = lambda l: cross_entropy_kernel.weighted_cross_entropy(l, targets, weights, kernel)  # noqa: E731
    sums, vjp = jax.vjp(fn, logits)
    return sums, vjp((jnp.float32(1.0), jnp.float32(0.0)))[0]

  run = jax.jit(run, static_argnums=3)
  (loss, correct), grad = run(logits, targets, weights, "pallas")
  (ref_loss, ref_correct), ref_grad = run(logits, targets, weights, "xla")
  print(f"loss {float(loss):.6f} vs {float(ref_loss):.6f}, correct {float(correct)} vs {float(ref_correct)}")
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  assert float(correct) == float(ref_correct) > 0
  difference = jnp.abs(grad.astype(jnp.float32) - ref_grad.astype(jnp.float32))
  # The gradients differ only where exp(x - log_z) rounds differently to bfloat16 (log_z within rounding).
  assert float(jnp.max(difference)) <= 1e-2 * float(jnp.max(jnp.abs(ref_grad.astype(jnp.float32))))
