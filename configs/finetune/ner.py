"""CoNLL-2003 NER or noun-phrase chunking: fine-tuning, or BERT's feature-based comparison (Table 7).

  bert-jax finetune --config configs/finetune/ner.py --workdir runs/ner \
      --config.init.model=MODEL_DIR --config.data_dir=DIR_WITH_eng.train_AND_eng.testa
  bert-jax finetune --config configs/finetune/ner.py:column=chunk --workdir runs/np_chunker \
      --config.init.model=MODEL_DIR --config.data_dir=DIR_WITH_eng.train_AND_eng.testa
  bert-jax finetune --config configs/finetune/ner.py:features=concat_last_four,document_context=True \
      --workdir runs/ner_features --config.init.model=MODEL_DIR --config.data_dir=...

The first word piece of each word is tagged (IOB1 tags as in the files) and
entities are scored with conlleval's rules on eng.testa. column=chunk tags the
noun phrases of the chunk column instead (task conll2003_chunk: B-NP / I-NP,
other chunks O), scored by the same rules. document_context=True
fills each row with the sentences around it in the same document, as for
BERT's reported result.

features= selects the feature-based mode: the encoder is frozen, the named
hidden states are concatenated and a two-layer BiLSTM (768 units per
direction) with a linear tagger is trained on them, as in BERT's Table 7:
  embeddings (layer 0), second_to_last (-2), last (-1), concat_last_four
  (-1, -2, -3, -4).
`get_sweep('features=...')` runs every row of that table; the fine-tuning sweep
is the learning-rate grid {5e-5, 3e-5, 2e-5}.
"""

from bert_jax.tasks.finetune_config import finetune_defaults
from bert_jax.train.config_lib import ConfigError, parse_arg

FEATURE_LAYERS = {"embeddings": (0,), "second_to_last": (-2,), "last": (-1,), "concat_last_four": (-1, -2, -3, -4)}
LEARNING_RATES = (5e-5, 3e-5, 2e-5)


TASKS = {"ner": "conll2003", "chunk": "conll2003_chunk"}


def get_config(arg=None):
  args = parse_arg(arg, document_context=False, features="", column="ner")
  if args.features and args.features not in FEATURE_LAYERS:
    raise ConfigError(f"ner.py: features={args.features!r}; expected one of {sorted(FEATURE_LAYERS)}")
  if args.column not in TASKS:
    raise ConfigError(f"ner.py: column={args.column!r}; expected one of {sorted(TASKS)}")
  config = finetune_defaults()
  config.task = TASKS[args.column]
  config.task_options.document_context = args.document_context
  config.max_len = 128
  config.seeds = (1,)
  config.optim.lr = 5e-5
  config.train.batch_size = 32
  config.train.epochs = 3
  if args.features:
    config.feature_based.layers = FEATURE_LAYERS[args.features]
    config.feature_based.head = "bilstm"
    config.feature_based.head_size = 768
    config.feature_based.head_layers = 2
    config.optim.lr = 1e-3
  return config


def get_sweep(arg=None):
  args = parse_arg(arg, document_context=False, features="", column="ner")
  if args.features:
    return [{"feature_based.layers": layers} for layers in FEATURE_LAYERS.values()]
  return [{"optim.lr": lr} for lr in LEARNING_RATES]
