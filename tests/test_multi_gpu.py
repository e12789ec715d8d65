"""The pre-training step on two GPUs against one, with the default GPU path's kernels under the mesh.

On GPUs the step runs the FFN's Mosaic GPU kernels (`ffn_kernel`), the flash attention kernels and the
LayerNorm kernels (Pallas), each per shard of the rows under `jax.shard_map` when a mesh splits the batch. The
CPU suite checks that wiring with the kernels emulated or interpreted; here the compiled kernels run on two
GPUs, with dropout on (the masks hash global row indices, so the two layouts draw the same masks), data-parallel
and FSDP, against the same steps on one GPU. Skipped without two Hopper GPUs (`JAX_PLATFORMS=cuda pytest -s`
on a multi-GPU machine).

The two runs differ by bfloat16 rounding only (GEMMs of other shapes, gradients summed in another order), so
the losses and gradient norms agree closely (4e-5 and 1.4e-4 relative where measured), not bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train_step import build, synthetic_batch

from bert_jax.kernels import ffn as ffn_kernel
from bert_jax.parallel import sharding as sharding_lib

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu" or jax.device_count() < 2
    or not ffn_kernel.supported(256, 64, 256, jnp.bfloat16), reason="needs two Hopper GPUs")

# 16 rows of 128 tokens: 1024 rows per GPU for the FFN kernels, 64-wide heads for the flash kernels, a width of
# 256 for the LayerNorm kernels' 128-column chunks.
WIDE = dict(hidden_size=256, num_heads=4, intermediate_size=1024, max_position_embeddings=128, dtype="bfloat16")


def losses_and_grad_norms(mesh_sizes, batches):
  state, step, mesh, *_ = build(mesh_sizes=mesh_sizes, dropout=0.1, model_overrides=WIDE)
  hlo = step.lower(state, sharding_lib.global_batch(batches[0], mesh)).compile().as_text()
  norms, losses = [], []
  for batch in batches:
    state, metrics = step(state, sharding_lib.global_batch(batch, mesh))
    losses.append(float(metrics["loss"]))
    norms.append(float(metrics["grad_norm"]))
  return np.array(losses), np.array(norms), hlo


@pytest.mark.parametrize("mesh_sizes", [{"data": 2}, {"fsdp": 2}])
def test_steps_on_two_gpus_equal_one_gpu(mesh_sizes):
  batches = [synthetic_batch(seq=128, seed=s) for s in range(3)]
  single_losses, single_norms, _ = losses_and_grad_norms(None, batches)
  losses, norms, hlo = losses_and_grad_norms(mesh_sizes, batches)
  for kernel in ("mosaic", "add_layer_norm_forward", "flash_attention"):  # the kernels ran under the mesh
    assert kernel in hlo.lower(), kernel
  print(f"{mesh_sizes}: losses {losses} (one GPU {single_losses}), gradient norms {norms} ({single_norms})")
  assert np.all(np.isfinite(losses))
  np.testing.assert_allclose(losses, single_losses, rtol=1e-2)
  np.testing.assert_allclose(norms, single_norms, rtol=3e-2)

