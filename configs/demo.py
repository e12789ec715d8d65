"""Demo: pre-train a tiny BERT (MLM + NSP) on the built-in corpus, on a laptop CPU in minutes.

  bert-jax pretrain --config configs/demo.py --workdir runs/demo

The built-in corpus is the text of the Python standard library's documentation
(pydoc topics and docstrings), present on every machine offline. The run
trains a 4k WordPiece vocabulary on it, prepares shards, pre-trains a
2-layer, 128-wide BERT (BERT-Tiny) for 800 steps of 64 x 64 tokens and ends
with what it learned: its held-out MLM accuracy beside a unigram baseline
(always the most frequent answer of the same masked positions), the loss
curve (WORKDIR/plots/loss.png) and fill-mask predictions. Run it again with
the same workdir and it resumes (or, when finished, just re-prints the
results).
"""

from bert_jax.train.config_lib import model_section, parse_arg, pretrain_defaults


def get_config(arg=None):
  args = parse_arg(arg, steps=800, size="tiny")
  config = pretrain_defaults()
  config.objective = "mlm+nsp"
  # float32 compute: a CPU has no bf16 arithmetic to gain from (the pre-training configs' default is bfloat16).
  config.model = model_section("bert", args.size, max_position_embeddings=64, dtype="float32")
  config.data.builtin = True
  config.data.builtin_vocab_size = 4000
  config.data.format = "segment_pair"
  config.data.seq_len = 64
  config.masking.max_predictions = 10
  config.optim.lr = 2e-3
  config.optim.warmup_steps = 80
  config.optim.weight_decay = 0.01
  config.train.batch_size = 64
  config.train.steps = args.steps
  config.train.log_every = 25
  config.train.eval_every = 400
  config.train.eval_batches = 8
  config.train.checkpoint_every = 400
  config.train.report_baseline = True
  # Answers that 800 steps can learn: a model this small learns the corpus's markup (closing quotes and
  # brackets, dunder names) before its words, which a unigram guess cannot know.
  config.train.fill_mask = (
      'See the "with[MASK] statement.',
      "Log 'msg % args[MASK] with the integer severity 'level' on the root logger.",
      "A __slots_[MASK] declaration saves memory.",
      "Return list(range(3[MASK]).",
  )
  return config


def get_sweep(arg=None):
  del arg
  return [{"model.size": size} for size in ("tiny", "mini")]
