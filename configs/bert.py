"""BERT pre-training (Devlin et al. 2019): MLM + NSP on segment pairs, post-LN, AdamW.

Phase 1 (90% of steps at 128 tokens), then phase 2 (10% at 512 tokens)
starting from phase 1's parameters and continuing its linear decay:

  bert-jax prepare --input wiki.txt books.txt --tokenizer vocab.txt --out data/wiki
  bert-jax pretrain --config configs/bert.py:size=base,phase=1 \
      --config.data.prepared=data/wiki --workdir runs/bert_base_p1
  bert-jax pretrain --config configs/bert.py:size=base,phase=2 \
      --config.data.prepared=data/wiki --config.train.init_from=runs/bert_base_p1 --workdir runs/bert_base_p2

Arguments: size (tiny|mini|small|medium|base|large|L<n>-H<n>), phase (1|2),
masking (static: one mask per example as the original; dynamic: new each
epoch), objective (mlm+nsp, or mlm / ltr for the Table 5 ablations), steps
(total of both phases).
"""

from bert_jax.train.config_lib import model_section, parse_arg, pretrain_defaults


def get_config(arg=None):
  args = parse_arg(arg, size="base", phase=1, masking="static", objective="mlm+nsp", steps=1_000_000)
  if args.phase not in (1, 2):
    raise ValueError(f"bert.py: phase must be 1 or 2, got {args.phase}")
  config = pretrain_defaults()
  config.objective = args.objective
  config.model = model_section("bert", args.size)
  config.data.format = "segment_pair" if args.objective == "mlm+nsp" else "full_sentences"
  config.masking.dynamic = args.masking == "dynamic"
  config.optim.name = "adamw"
  config.optim.weight_decay = 0.01
  config.optim.b2 = 0.999
  config.train.batch_size = 256
  phase1_steps = int(args.steps * 0.9)
  if args.phase == 1:
    config.data.seq_len = 128
    config.masking.max_predictions = 20
    config.optim.lr = 1e-4
    config.optim.warmup_steps = 10_000
    # Decay as if the schedule ran to the end of phase 2: 1e-4 -> 1e-5 at the switch.
    config.optim.end_lr = 1e-4 * (args.steps - phase1_steps) / (args.steps - 10_000)
    config.train.steps = phase1_steps
  else:
    config.data.seq_len = 512
    config.masking.max_predictions = 80
    config.optim.lr = 1e-4 * (args.steps - phase1_steps) / (args.steps - 10_000)
    config.optim.warmup_steps = 0
    config.train.steps = args.steps - phase1_steps
  return config


def get_sweep(arg=None):
  """BERT Table 6: model size (L/H) with everything else fixed."""
  del arg
  return [{"model.size": size} for size in ("L3-H768", "L6-H768", "L12-H768", "L24-H1024")]
