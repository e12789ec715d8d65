"""`bench/train_step.py` with the FFN kernels' module switches set (`kernels/ffn.py`), on a Hopper GPU.

  python bench/ffn_step_variants.py fwd+bwd --size base --seq 128 --batch 256 --steps 20 --json

VARIANT, then train_step's own arguments:
  fwd      cooperative forward kernel, XLA backward (the step before the backward kernel)
  fwd+bwd  cooperative forward, ping-pong backward (dh and the bias gradient): the earlier default
  pp       ping-pong forward (`PINGPONG_FORWARD_TILES`), XLA backward
  pp+bwd   ping-pong forward and backward: the default
For the plain model (no kernels) use train_step's `--config.model.kernels=off`. One variant per process:
the switches are read when the step is traced.
"""

import pathlib
import runpy
import sys

VARIANTS = ("fwd", "fwd+bwd", "pp", "pp+bwd")

if len(sys.argv) < 2 or sys.argv[1] not in VARIANTS:
  sys.exit(f"usage: {sys.argv[0]} {{{','.join(VARIANTS)}}} [bench/train_step.py arguments]")
variant = sys.argv.pop(1)
root = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(root))
from bert_jax.kernels import ffn as ffn_kernel  # noqa: E402

ffn_kernel.FORWARD_SCHEDULE = "pingpong" if variant.startswith("pp") else "cooperative"
ffn_kernel.BACKWARD_KERNEL = variant.endswith("bwd")
print(f"variant {variant}: FORWARD_SCHEDULE={ffn_kernel.FORWARD_SCHEDULE} BACKWARD_KERNEL={ffn_kernel.BACKWARD_KERNEL}",
      flush=True)
sys.argv[0] = str(root / "bench" / "train_step.py")
runpy.run_path(sys.argv[0], run_name="__main__")
