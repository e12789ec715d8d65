"""Registers, spills and shared memory of the Pallas Triton kernels, compiled offline for an H100 (no GPU needed).

  python -m bench.triton_registers                             # B=256 L=128, 12 heads x 64, dropout 0.1
  python -m bench.triton_registers --shape 64x512 --layer-norm # also the LayerNorm kernels (rows B*L)
  python -m bench.triton_registers --dump /tmp/kernels         # keep each kernel's TTIR, PTX and ptxas log
  python -m bench.triton_registers --cross-entropy              # also the MLM loss's row statistics (4864 x 30592)

Needs pip's Triton 3.5 or later (`pip install triton`, not a project dependency). The kernels are lowered for CUDA
on this machine as tests/test_kernels_lower.py does; each pallas_call's custom call carries its Triton IR and launch
(num_warps, num_stages), which pip's Triton compiles for sm_90a, reading registers and spills from its ptxas log,
the dynamic shared memory from its metadata, and the warp shuffles and barriers (`shfl`, `bar`: what a reduction
across a tile's rows costs) from its PTX. The flash kernels get the fused bias, as
the encoder calls them. Needs jax <= 0.10.2's lowering (the IR in the custom call).

This is not the GPU's compiler: there jaxlib compiles the same IR with XLA's pinned Triton. At B=256 L=128
pip's Triton 3.4-3.9 gave the forward 125-128 registers and dQ 152-159, against 121 and 155 on the H100 (ncu,
jax 0.11.2); shared memory matched (dQ 66 KB). dK/dV is the most sensitive: 230-235
registers without spills in 3.4-3.8, 255 with 24 bytes spilled in 3.9. Compare counts from one pinned Triton
version (3.8.0: LLVM 23, as jaxlib 0.10.2's MLIR) with each other, not with ncu's to the register.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import pathlib
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir
from jax._src.lib import triton as jax_triton
from jax._src.lib.mlir import ir

from bert_jax.kernels import cross_entropy as cross_entropy_kernel
from bert_jax.kernels import flash_attention
from bert_jax.kernels import layer_norm as layer_norm_kernel

TRITON_CALL = "__gpu$xla.gpu.triton"


def triton_kernels(fn, *args) -> list[tuple[str, int, int, str]]:
  """(name, num_warps, num_stages, Triton IR text) of each Pallas Triton kernel in fn's CUDA lowering."""
  module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
  context = mlir.make_ir_context()
  jax_triton.dialect.register_dialect(context)
  kernels = []

  def visit(op):
    for region in op.regions:
      for block in region:
        for inner in block:
          if (inner.name == "stablehlo.custom_call"
              and ir.StringAttr(inner.attributes["call_target_name"]).value == TRITON_CALL):
            config = ir.DictAttr(inner.attributes["mhlo.backend_config"])
            with context:
              ttir = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes).operation.get_asm()
            kernels.append((ir.StringAttr(config["name"]).value, ir.IntegerAttr(config["num_warps"]).value,
                            ir.IntegerAttr(config["num_stages"]).value, ttir))
          visit(inner)

  visit(module.operation)
  if not kernels:
    sys.exit(f"no {TRITON_CALL} custom calls in the lowering: this jax ({jax.__version__}) may compile Triton "
             "kernels while lowering (jax > 0.10.2), which needs a GPU")
  return kernels


def compile_kernel(triton, name: str, ttir: str, num_warps: int, num_stages: int, arch: int,
                   dump: pathlib.Path | None) -> dict:
  """Compiles one kernel's Triton IR with pip's Triton; its registers, spills and shared memory."""
  from triton.backends.compiler import GPUTarget
  with tempfile.TemporaryDirectory() as tmp:
    path = pathlib.Path(tmp, f"{name}.ttir")  # triton.compile reads the IR's kind from the file's suffix
    path.write_text(ttir)
    log = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(log):  # Triton prints the ptxas log (knobs.nvidia.dump_ptxas_log)
      kernel = triton.compile(str(path), target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    seconds = time.perf_counter() - start
  log = log.getvalue()
  registers = re.search(r"Used (\d+) registers", log)
  spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
  if registers is None or spills is None:
    sys.exit(f"{name}: no ptxas log from Triton {triton.__version__} (needs Triton >= 3.5):\n{log}")
  if dump is not None:
    dump.mkdir(parents=True, exist_ok=True)
    for suffix, text in (("ttir", ttir), ("ttgir", kernel.asm["ttgir"]), ("ptx", kernel.asm["ptx"]),
                         ("ptxas.log", log)):
      (dump / f"{name}.{suffix}").write_text(text)
  ptx = kernel.asm["ptx"]
  return dict(registers=int(registers[1]), stack=int(spills[1]), spill_stores=int(spills[2]),
              spill_loads=int(spills[3]), shared=kernel.metadata.shared, seconds=seconds,
              shuffles=len(re.findall(r"\bshfl\.", ptx)), barriers=len(re.findall(r"\b(?:bar|barrier)\.sync\b", ptx)))


def kernel_calls(args) -> list[tuple[str | None, object, tuple]]:
  """(label, function, argument shapes) of each lowering: the flash forward and backward at the shape; with
  --layer-norm the LayerNorm kernels on [B*L, H*D] (the residual forward and backward with the branch bias, the
  plain backward); with --cross-entropy the MLM loss's statistics on --mlm-logits. Label None: the kernels' own
  names."""
  batch, length = map(int, args.shape.split("x"))
  shape = jax.ShapeDtypeStruct
  qkv = shape((batch, length, args.heads, 3, args.head_dim), jnp.bfloat16)
  bias = shape((args.heads, 3, args.head_dim), jnp.float32)  # as the encoder calls it: the kernels sum its gradient
  pack_ids = jnp.ones((batch, length), jnp.int32)

  def loss(qkv, bias):
    out = flash_attention.flash_attention(qkv, pack_ids=pack_ids, packed=args.packed, dropout_rate=args.dropout,
                                          dropout_rng=jax.random.key(0), bias_h3d=bias)
    return jnp.sum(out.astype(jnp.float32))

  calls = [(None, jax.grad(loss, argnums=(0, 1)), (qkv, bias))]
  if args.layer_norm:
    rows, features = batch * length, args.heads * args.head_dim
    x, stats = shape((rows, features), jnp.bfloat16), shape((rows,), jnp.float32)
    vector, meta = shape((features,), jnp.float32), shape((3,), jnp.int32)

    def forward(meta, x, branch, scale, bias, branch_bias):
      return layer_norm_kernel._forward_2d(  # noqa: SLF001
          meta, x, branch, scale, bias, branch_bias, rate=args.dropout, epsilon=1e-12, dtype=jnp.bfloat16,
          interpret=False, block_rows=layer_norm_kernel.FORWARD_BLOCK_ROWS,
          num_warps=layer_norm_kernel.FORWARD_NUM_WARPS)

    def backward(rate, branch_sums):
      step_rows, num_warps = layer_norm_kernel.backward_launch(features, branch_sums)
      return lambda *a: layer_norm_kernel._backward_2d(  # noqa: SLF001
          *a, rate=rate, branch_sums=branch_sums, interpret=False, block_rows=layer_norm_kernel.BLOCK_ROWS,
          step_rows=step_rows, num_warps=num_warps)

    calls += [("add_layer_norm_forward", forward, (meta, x, x, vector, vector, vector)),
              ("add_layer_norm_backward", backward(args.dropout, True), (meta, x, x, stats, stats, vector)),
              ("layer_norm_backward", backward(0.0, False), (meta, x, x, stats, stats, vector))]
  if args.cross_entropy:
    rows, columns = map(int, args.mlm_logits.split("x"))
    statistics = functools.partial(cross_entropy_kernel._statistics_2d, interpret=False)  # noqa: SLF001
    calls.append((None, statistics, (shape((rows, columns), jnp.bfloat16), shape((rows,), jnp.int32))))
  return calls


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shape", default="256x128", help="BATCHxLENGTH")
  parser.add_argument("--heads", type=int, default=12)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--dropout", type=float, default=0.1)
  parser.add_argument("--packed", action="store_true", help="flash kernels with the per-pair pack-id compare")
  parser.add_argument("--layer-norm", action="store_true", help="also the LayerNorm kernels")
  parser.add_argument("--cross-entropy", action="store_true", help="also the MLM loss's row statistics kernel")
  parser.add_argument("--mlm-logits", default="4864x30592", help="ROWSxVOCAB of --cross-entropy")
  parser.add_argument("--arch", type=int, default=90, help="compute capability (90: H100 / H200, sm_90a)")
  parser.add_argument("--dump", type=pathlib.Path, help="write each kernel's TTIR, TTGIR, PTX and ptxas log here")
  args = parser.parse_args()

  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is its default
  try:
    import triton
  except ImportError:
    sys.exit("needs pip's Triton, not a project dependency: pip install triton (3.5 or later; tested 3.5-3.9)")
  triton.knobs.compilation.always_compile = True  # a cached kernel would skip ptxas and its log
  triton.knobs.nvidia.dump_ptxas_log = True

  print(f"triton {triton.__version__}, jax {jax.__version__}, sm_{args.arch}; flash: {args.shape}, "
        f"{args.heads} heads x {args.head_dim}, dropout {args.dropout}, packed {args.packed}")
  print(f"{'kernel':26} {'warps':>5} {'stages':>6} {'regs':>5} {'spill st/ld':>11} {'stack':>5} "
        f"{'shared B':>8} {'shfl':>5} {'bar':>4} {'compile s':>9}")
  for label, fn, fn_args in kernel_calls(args):
    for name, num_warps, num_stages, ttir in triton_kernels(fn, *fn_args):
      name = label or name
      r = compile_kernel(triton, name, ttir, num_warps, num_stages, args.arch, args.dump)
      print(f"{name:26} {num_warps:5} {num_stages:6} {r['registers']:5} "
            f"{r['spill_stores']:>5}/{r['spill_loads']:<5} {r['stack']:5} {r['shared']:8} {r['shuffles']:5} "
            f"{r['barriers']:4} {r['seconds']:9.1f}")


if __name__ == "__main__":
  main()
