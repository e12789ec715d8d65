"""ALBERT pre-training (Lan et al. 2020): factorised embeddings, cross-layer sharing, SOP, n-gram masking, LAMB.

  bert-jax prepare --input corpus.txt --train-tokenizer sentencepiece-unigram --vocab-size 30000 --out data/sp
  bert-jax pretrain --config configs/albert.py:size=base \
      --config.data.prepared=data/sp --workdir runs/albert_base

Arguments: size (base|large|xlarge|xxlarge), sharing (all|none|groups=N via
--config.model.num_shared_groups), objective (mlm+sop|mlm+nsp|mlm).
"""

from bert_jax.train.config_lib import model_section, parse_arg, pretrain_defaults


def get_config(arg=None):
  args = parse_arg(arg, size="base", objective="mlm+sop", sharing="all", steps=125_000)
  config = pretrain_defaults()
  config.objective = args.objective
  config.model = model_section("albert", args.size)
  if args.sharing == "none":
    config.model.num_shared_groups = 0
  elif args.sharing != "all":
    raise ValueError(f"albert.py: sharing must be 'all' or 'none', got {args.sharing!r}")
  config.data.format = {"mlm+sop": "sop", "mlm+nsp": "segment_pair"}.get(args.objective, "full_sentences")
  config.data.seq_len = 512
  config.masking.granularity = "ngram"
  config.masking.max_ngram = 3
  config.masking.max_predictions = 20
  config.optim.name = "lamb"
  config.optim.lr = 0.00176
  config.optim.weight_decay = 0.01
  config.optim.warmup_steps = 3_125
  config.train.batch_size = 4096
  config.train.steps = args.steps
  return config


def get_sweep(arg=None):
  """ALBERT Table 4 (sharing strategies) and Table 5 (NSP vs SOP vs none)."""
  del arg
  sharing = [{"model.num_shared_groups": groups} for groups in (0, 1)]
  objectives = [{"objective": "mlm", "data.format": "full_sentences"},
                {"objective": "mlm+nsp", "data.format": "segment_pair"},
                {"objective": "mlm+sop", "data.format": "sop"}]
  return sharing + objectives
