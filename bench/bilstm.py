"""The "+ BiLSTM" fine-tuning layer's speed: flax's two scans against both directions in one scan, on one device.

  python -m bench.bilstm                 # the table of BERT Table 5's fine-tuning shapes
  python -m bench.bilstm --smoke         # CPU, seconds

BERT Table 5's "+ BiLSTM" row puts a one-layer BiLSTM (hidden/2 units a direction) between the encoder and every
task head; the feature-based tagger's head is a two-layer one. Both use `bert_jax.models.recurrent.BiLSTM`: every
input projected before the loop (one GEMM for both directions), both directions stepped together (one batched
matmul a step), the loop unrolled; flax's `nn.Bidirectional(nn.RNN(OptimizedLSTMCell), ...)` runs two scans one
after the other with the input projection inside each step. The bench first checks that both give the same
outputs and gradients on padded rows (at full float32 precision), then times a jitted forward + backward of each
at batch 32 and the suite's lengths, and prints the table with the device."""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bert_jax.models.recurrent import BiLSTM, flax_bilstm, params_from_flax


def check(features: int, width: int, unroll: int) -> float:
  """Largest difference of outputs and gradients at real tokens, rows of lengths 9, 4 and 1, random biases."""
  x = jnp.asarray(np.random.default_rng(5).normal(size=(3, 9, width)), jnp.float32)
  lengths = jnp.array([9, 4, 1])
  reference = flax_bilstm(features)
  params = reference.init(jax.random.key(1), x, seq_lengths=lengths)["params"]
  params = jax.tree_util.tree_map_with_path(
      lambda path, leaf: jax.random.normal(jax.random.key(len(str(path))), leaf.shape) * 0.3
      if "bias" in str(path) else leaf, params)
  valid = (jnp.arange(9)[None, :] < lengths[:, None])[..., None]
  candidate = BiLSTM(features, unroll)
  outputs = {
      "flax": lambda p: reference.apply({"params": p}, x, seq_lengths=lengths),
      "one scan": lambda p: candidate.apply({"params": params_from_flax(p)}, x, lengths)}
  losses = {name: (lambda p, f=f: jnp.sum(jnp.where(valid, f(p), 0.0) ** 2)) for name, f in outputs.items()}
  worst = float(jnp.max(jnp.abs(jnp.where(valid, outputs["flax"](params) - outputs["one scan"](params), 0.0))))
  grads = [jax.grad(losses[name])(params) for name in ("flax", "one scan")]
  for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
    worst = max(worst, float(jnp.max(jnp.abs(a - b)) / (1.0 + jnp.max(jnp.abs(a)))))
  return worst


def time_layer(model: nn.Module, call, x, lengths, seconds: float) -> tuple[float, float]:
  """(compile seconds, milliseconds per jitted forward + backward)."""
  params = call(model, "init", x, lengths)
  step = jax.jit(jax.grad(lambda p, x: jnp.sum(call(model, p, x, lengths) ** 2), argnums=(0, 1)))
  started = time.perf_counter()
  jax.block_until_ready(step(params, x))
  compile_s = time.perf_counter() - started
  calls, started = 0, time.perf_counter()
  while time.perf_counter() - started < seconds or calls < 3:
    out = step(params, x)
    calls += 1
  jax.block_until_ready(out)
  return compile_s, 1e3 * (time.perf_counter() - started) / calls


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--hidden", type=int, default=512, help="the encoder's width (hidden/2 units a direction)")
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--lengths", default="64,128,384")
  parser.add_argument("--unrolls", default="1,8,32")
  parser.add_argument("--seconds", type=float, default=2.0)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, for a CPU")
  args = parser.parse_args()
  if args.smoke:
    args.hidden, args.batch, args.lengths, args.unrolls, args.seconds = 32, 4, "16", "1,4", 0.2
  features = args.hidden // 2
  unrolls = [int(u) for u in args.unrolls.split(",")]
  # Full float32 matmuls for the check: accelerators' default precision (TF32 on GPUs) differs by ~1e-4 alone.
  with jax.default_matmul_precision("highest"):
    worst = max(check(5, 7, unroll) for unroll in unrolls)
  print(f"one scan against flax: largest difference {worst:.2e} (outputs; gradients relative)", flush=True)
  if worst > 1e-4:
    raise SystemExit("the one-scan BiLSTM differs from flax's: not timed")

  def flax_call(model, params, x, lengths):
    if params == "init":
      return model.init(jax.random.key(0), x, seq_lengths=lengths)["params"]
    return model.apply({"params": params}, x, seq_lengths=lengths)

  def one_scan_call(model, params, x, lengths):
    if params == "init":
      return model.init(jax.random.key(0), x, lengths)["params"]
    return model.apply({"params": params}, x, lengths)

  rows = []
  for length in (int(v) for v in args.lengths.split(",")):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(args.batch, length, args.hidden)), jnp.float32)
    lengths = jnp.asarray(np.random.default_rng(1).integers(length // 2, length + 1, args.batch), jnp.int32)
    variants = [("flax", flax_bilstm(features), flax_call)]
    variants += [(f"one scan, unroll {u}", BiLSTM(features, u), one_scan_call) for u in unrolls]
    base = None
    for name, model, call in variants:
      compile_s, ms = time_layer(model, call, x, lengths, args.seconds)
      base = base or ms
      rows.append((length, name, compile_s, ms, base / ms))
      print(f"length {length} {name}: {ms:.2f} ms (compile {compile_s:.1f} s)", flush=True)
  device = jax.devices()[0].device_kind
  print(f"\nBiLSTM forward + backward, batch {args.batch}, {features} units a direction, float32, on {device}\n")
  print("| length | layer | ms | vs flax | compile s |\n|---|---|---|---|---|")
  for length, name, compile_s, ms, speedup in rows:
    print(f"| {length} | {name} | {ms:.2f} | {speedup:.2f}x | {compile_s:.1f} |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
