"""Step time with and without the hand-written gradients of `kernels/ops.py` and the MLM cross-entropy, one process.

  python -m bench.ops_ablation                                   # BERT-Base seq 128 batch 256
  python -m bench.ops_ablation --size tiny --seq 64 --batch 8 --steps 2      # CPU smoke run

Builds the trainer's step four times (`train_step.measure`), each time putting
back one more of the current forms in place of the earlier ones (flax
LayerNorm, jax.nn.gelu, autodiff of the log-softmax pick): before, + LayerNorm,
+ GELU, + cross-entropy. The earlier forms are written out below as they were.
"""

from __future__ import annotations

import argparse
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bench import train_step
from bert_jax.kernels import layers, ops
from bert_jax.models import model as model_lib
from bert_jax.train import objectives

CURRENT = {"layer_norm": layers.layer_norm, "activation": layers.activation, "ce": objectives.cross_entropy_sums}


class FlaxLayerNorm(nn.Module):
  """flax.linen.LayerNorm behind `layers.LayerNorm`'s call: the post-LN residual x + dropout(branch + bias)
  computed apart, by XLA and autodiff, before it."""

  config: Any
  axis_name: str = "embed"

  @nn.compact
  def __call__(self, x, branch=None, dropout=None, deterministic=True, branch_bias=None):
    if branch is not None:
      if branch_bias is not None:
        branch = ops.bias_add(branch, branch_bias)
      x = x + (branch if dropout is None else dropout(branch, deterministic)).astype(x.dtype)
    cfg = self.config
    return nn.LayerNorm(epsilon=cfg.layer_norm_eps, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype,
                        scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), (self.axis_name,)),
                        bias_init=model_lib.bias_init((self.axis_name,)), use_fast_variance=False, name="LayerNorm")(x)


def flax_layer_norm(config, name, axis_name="embed"):
  return FlaxLayerNorm(config, axis_name, name=name)


def jax_activation(name):
  return {"gelu": lambda x: nn.gelu(x, approximate=False), "gelu_tanh": lambda x: nn.gelu(x, approximate=True),
          "relu": nn.relu}[name]


def autodiff_cross_entropy(logits, targets, weights, kernels=None):
  """The textbook form: XLA's reductions, autodiff's gradient (`kernels` ignored)."""
  del kernels
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return jnp.sum((log_z - target_logit) * weights), jnp.sum((jnp.argmax(logits, axis=-1) == targets) * weights)


def use(layer_norm: bool, gelu: bool, cross_entropy: bool) -> None:
  # The model's seams look these up in `layers` at every call (ModelConfig.kernels="auto").
  layers.layer_norm = CURRENT["layer_norm"] if layer_norm else flax_layer_norm
  layers.activation = CURRENT["activation"] if gelu else jax_activation
  objectives.cross_entropy_sums = CURRENT["ce"] if cross_entropy else autodiff_cross_entropy


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--size", default="base")
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--steps", type=int, default=20)
  args = parser.parse_args()
  rows = ["| variant | step ms | seq/s | MFU | peak GiB | loss |", "|---|---|---|---|---|---|"]
  for label, flags in (("before (flax LayerNorm, jax.nn.gelu, autodiff CE)", (0, 0, 0)), ("+ LayerNorm", (1, 0, 0)),
                       ("+ GELU", (1, 1, 0)), ("+ cross-entropy", (1, 1, 1))):
    use(*flags)
    config = train_step.build_config(argparse.Namespace(config=None, family="bert", size=args.size, seq=args.seq,
                                                        batch=args.batch, objective="mlm+nsp"), [])
    r = train_step.measure(config, steps=args.steps)
    peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.1f}"
    rows.append(f"| {label} | {r['step_s'] * 1e3:.2f} | {r['seq_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {peak} | "
                f"{r['loss']:.4f} |")
    print(rows[-1], flush=True)
  use(1, 1, 1)
  print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}\n" + "\n".join(rows))


if __name__ == "__main__":
  main()
