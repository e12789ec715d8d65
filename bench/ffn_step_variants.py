"""`python -m bench.train_step` with the FFN kernels' module switches set (`kernels/ffn.py`), on a Hopper GPU.

  python -m bench.ffn_step_variants fwd+bwd --size base --seq 128 --batch 256 --steps 20 --json

VARIANT, then train_step's own arguments:
  fwd      cooperative forward kernel, XLA backward (the step before the backward kernel)
  fwd+bwd  cooperative forward, ping-pong backward (dh and the bias gradient): the earlier default
  pp       ping-pong forward (`PINGPONG_FORWARD_TILES`), XLA backward
  pp+bwd   ping-pong forward and backward: the default
For the plain model (no kernels) use train_step's `--config.model.kernels=off`. One variant per process:
the switches are read when the step is traced.
"""

import runpy
import sys

from bert_jax.kernels import ffn as ffn_kernel

VARIANTS = ("fwd", "fwd+bwd", "pp", "pp+bwd")

if len(sys.argv) < 2 or sys.argv[1] not in VARIANTS:
  sys.exit(f"usage: python -m bench.ffn_step_variants {{{','.join(VARIANTS)}}} [bench.train_step arguments]")
variant = sys.argv.pop(1)
ffn_kernel.FORWARD_SCHEDULE = "pingpong" if variant.startswith("pp") else "cooperative"
ffn_kernel.BACKWARD_KERNEL = variant.endswith("bwd")
print(f"variant {variant}: FORWARD_SCHEDULE={ffn_kernel.FORWARD_SCHEDULE} BACKWARD_KERNEL={ffn_kernel.BACKWARD_KERNEL}",
      flush=True)
runpy.run_module("bench.train_step", run_name="__main__", alter_sys=True)
