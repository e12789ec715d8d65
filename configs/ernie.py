"""ERNIE 1.0 (Sun et al. 2019): knowledge masking in three stages, each phase starting from the last one's parameters.

  phase 1  basic-level masking: whole words (the paper's basic unit of English text is the word)
  phase 2  phrase-level masking: noun phrases (`masking.granularity=noun_phrase`)
  phase 3  entity-level masking: named entities (`masking.granularity=named_entity`)

Phrase and entity masking read spans marked in the prepared corpus by taggers fine-tuned on CoNLL-2003 that share
its vocabulary (`bert-jax mark-spans`, bert_jax/tasks/spans.py); a masked unit is a whole marked span with
probability `masking.linguistic_prob` (1/2), otherwise a whole word, within the 15% budget. Phase 1's model is
the taggers' start, so the taggers need no other model:

  bert-jax pretrain --config configs/ernie.py:size=base,phase=1 --config.data.prepared=data/wiki \
      --workdir runs/ernie_p1
  bert-jax finetune --config configs/finetune/ner.py --workdir runs/ernie_ner \
      --config.init.model=runs/ernie_p1 --config.data_dir=data/conll2003
  bert-jax finetune --config configs/finetune/ner.py:column=chunk --workdir runs/ernie_np \
      --config.init.model=runs/ernie_p1 --config.data_dir=data/conll2003
  bert-jax mark-spans --prepared data/wiki --ner runs/ernie_ner --chunker runs/ernie_np
  bert-jax pretrain --config configs/ernie.py:size=base,phase=2,previous=runs/ernie_p1 \
      --config.data.prepared=data/wiki --workdir runs/ernie_p2
  bert-jax pretrain --config configs/ernie.py:size=base,phase=3,previous=runs/ernie_p2 \
      --config.data.prepared=data/wiki --workdir runs/ernie_p3

At scale=tiny (a 2-layer, width-64 float32 encoder, 60 steps a phase of 16 x 64 tokens) phase 1 builds the
built-in corpus in its workdir and the taggers train for one epoch: all of it runs in a few minutes on a 2-core
CPU. The built-in corpus is Python's documentation: its taggers find noun phrases everywhere but few named
entities, so phase 3 there masks mostly whole words.

  bert-jax pretrain --config configs/ernie.py:scale=tiny,phase=1 --workdir runs/ernie_p1
  bert-jax finetune --config configs/finetune/ner.py --workdir runs/ernie_ner --config.init.model=runs/ernie_p1 \
      --config.data_dir=../shared/data/conll2003 --config.train.epochs=1 --config.optim.lr=2e-3
  bert-jax finetune --config configs/finetune/ner.py:column=chunk --workdir runs/ernie_np \
      --config.init.model=runs/ernie_p1 --config.data_dir=../shared/data/conll2003 --config.train.epochs=1 \
      --config.optim.lr=2e-3
  bert-jax mark-spans --prepared runs/ernie_p1/builtin_corpus/prepared --ner runs/ernie_ner --chunker runs/ernie_np
  bert-jax pretrain --config configs/ernie.py:scale=tiny,phase=2,previous=runs/ernie_p1 \
      --config.data.prepared=runs/ernie_p1/builtin_corpus/prepared --workdir runs/ernie_p2
  bert-jax pretrain --config configs/ernie.py:scale=tiny,phase=3,previous=runs/ernie_p2 \
      --config.data.prepared=runs/ernie_p1/builtin_corpus/prepared --workdir runs/ernie_p3

A phase starts from the parameters of `previous`'s newest checkpoint (`train.init_from`, as BERT's phase 2 in
configs/bert.py) with a fresh optimizer and schedule. The paper gives no stage lengths: each phase here takes a
third of `steps`. Objective MLM + NSP on segment pairs as BERT's (the paper's dialogue language model needs
dialogue data, which no corpus here has). Arguments: phase (1|2|3), previous (the previous phase's workdir; phases
2 and 3), size (tiny|mini|small|medium|base|large|L<n>-H<n>), scale (paper|tiny), steps (all three phases).
"""

from bert_jax.train.config_lib import ConfigError, model_section, parse_arg, pretrain_defaults

# The masking of each phase: basic-level, phrase-level, entity-level.
PHASE_GRANULARITY = {1: "whole_word", 2: "noun_phrase", 3: "named_entity"}
SCALES = ("paper", "tiny")


def get_config(arg=None):
  args = parse_arg(arg, phase=1, previous="", size="base", scale="paper", steps=0)
  if args.phase not in PHASE_GRANULARITY:
    raise ConfigError(f"ernie.py: phase={args.phase}; expected one of {sorted(PHASE_GRANULARITY)}")
  if args.scale not in SCALES:
    raise ConfigError(f"ernie.py: scale={args.scale!r}; expected one of {SCALES}")
  if args.phase > 1 and not args.previous:
    raise ConfigError(f"ernie.py: phase={args.phase} starts from phase {args.phase - 1}'s parameters: give its "
                      f"workdir as previous=DIR (configs/ernie.py:phase={args.phase},previous=runs/ernie_p"
                      f"{args.phase - 1})")
  if args.phase == 1 and args.previous:
    raise ConfigError(f"ernie.py: previous={args.previous!r} with phase=1: phase 1 starts from scratch; leave "
                      "previous out")
  config = pretrain_defaults()
  config.objective = "mlm+nsp"
  config.data.format = "segment_pair"
  config.masking.granularity = PHASE_GRANULARITY[args.phase]
  config.masking.dynamic = True
  config.train.init_from = args.previous or None
  config.optim.name = "adamw"
  config.optim.weight_decay = 0.01
  if args.scale == "tiny":
    # 128 positions: the taggers fine-tune this model on CoNLL-2003 rows of up to 128 tokens (configs/finetune/ner.py).
    config.model = model_section("bert", "tiny", num_layers=2, hidden_size=64, num_heads=2, intermediate_size=128,
                                 max_position_embeddings=128, dtype="float32")
    # Phase 1 builds the built-in corpus in its workdir; the later phases read it, marked, from there.
    config.data.builtin, config.data.builtin_vocab_size = args.phase == 1, 2000
    config.data.seq_len, config.masking.max_predictions = 64, 10
    config.optim.lr, config.optim.warmup_steps = 2e-3, 6
    config.train.batch_size, config.train.steps = 16, (args.steps or 180) // 3
    config.train.log_every, config.train.eval_every, config.train.checkpoint_every = 10, config.train.steps, 30
    config.train.eval_batches = 4
    return config
  # BERT-Base's phase-1 recipe: the paper gives no other.
  config.model = model_section("bert", args.size)
  config.data.seq_len = 128
  config.masking.max_predictions = 20
  config.train.batch_size = 256
  config.train.steps = (args.steps or 1_000_000) // 3
  config.optim.lr = 1e-4
  config.optim.warmup_steps = min(10_000, config.train.steps // 10)
  return config
