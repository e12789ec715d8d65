"""RoBERTa pre-training (Liu et al. 2019): MLM only, FULL-SENTENCES, dynamic masking, large batches.

  bert-jax pretrain --config configs/roberta.py:size=base \
      --config.data.prepared=data/corpus_bpe --workdir runs/roberta_base

The tokenizer is byte-level BPE (`bert-jax prepare --train-tokenizer byte-bpe
--vocab-size 50265`); the model takes its vocabulary size from it. Arguments:
size, format (full_sentences|doc_sentences|segment_pair|sentence_pair via the
sweep), masking (dynamic|static), batch (8k in the paper).
"""

from bert_jax.train.config_lib import model_section, parse_arg, pretrain_defaults


def get_config(arg=None):
  args = parse_arg(arg, size="base", format="full_sentences", masking="dynamic", batch=8192, steps=500_000)
  config = pretrain_defaults()
  config.objective = "mlm"
  config.model = model_section("roberta", args.size)
  config.data.format = args.format
  config.data.seq_len = 512
  config.masking.dynamic = args.masking == "dynamic"
  config.masking.max_predictions = 80
  config.optim.lr = 6e-4
  config.optim.b2 = 0.98
  config.optim.eps = 1e-6
  config.optim.weight_decay = 0.01
  config.optim.warmup_steps = 24_000
  config.train.batch_size = args.batch
  config.train.steps = args.steps
  return config


def get_sweep(arg=None):
  """RoBERTa Table 1 (static vs dynamic masking) and Table 2 (input format, with/without NSP)."""
  del arg
  masking = [{"masking.dynamic": dynamic} for dynamic in (False, True)]
  formats = [{"objective": "mlm+nsp", "data.format": "segment_pair"},
             {"objective": "mlm", "data.format": "full_sentences"},
             {"objective": "mlm", "data.format": "doc_sentences"}]
  return masking + formats
