"""GLUE fine-tuning with BERT's recipe; any of the nine tasks.

  bert-jax finetune --config configs/finetune/glue.py:task=rte --workdir runs/glue/rte \
      --config.init.model=MODEL_DIR --config.data_dir=GLUE_DIR

GLUE_DIR is the folder GLUE's download writes (GLUE_DIR/RTE/train.tsv, dev.tsv,
test.tsv), `tfds` (TensorFlow Datasets, the .[tfds] extra), or for task=rte
the sample task, not GLUE, that `bert-jax sample-rte --out data/sample` writes.

task: cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli (or a GLUE folder name:
SST-2, STS-B...). MODEL_DIR is a Hugging Face or converted model directory, a
pre-training workdir, or a fine-tuning workdir: RTE, MRPC and STS-B from an
MNLI run (`--config.init.model=runs/glue/mnli`) keep its encoder and pooler
and re-initialise the classifier when the label counts differ.

Defaults follow BERT (Devlin et al. 2019, Sec. 4.1 and App. A.3): batch 32,
3 epochs, AdamW with 10% linear warmup then linear decay, weight decay 0.01,
max_len 128, dropout 0.1, several restarts (seeds) with the best on dev.
`get_sweep()` is BERT's learning-rate grid {5e-5, 3e-5, 2e-5}.

Task-specific distillation (`config.distill`, `bert_jax.train.distill`): a
student learns from a teacher fine-tuned on the same task, here a 3-layer
student started from every other layer of a 6-layer model, with BERT-PKD's
[CLS] loss (Sun et al. 2019):

  bert-jax finetune --config configs/finetune/glue.py:task=sst2 --workdir runs/glue/sst2_3l \
      --config.init.model=MODEL_DIR --config.init.layers=3 --config.distill.teacher=runs/glue/sst2 \
      --config.distill.temperature=10 --config.distill.alpha=0.7 --config.distill.pkd_weight=100

A student narrower than its teacher sets --config.distill.hidden_projection=True.
"""

from bert_jax.tasks import TASK_NAMES
from bert_jax.tasks.finetune_config import finetune_defaults
from bert_jax.train.config_lib import ConfigError, parse_arg

LEARNING_RATES = (5e-5, 3e-5, 2e-5)


def get_config(arg=None):
  args = parse_arg(arg, task="rte")
  config = finetune_defaults()
  name = f"glue/{args.task.lower()}"
  glue_names = [n for n in TASK_NAMES if n.startswith("glue/")]
  aliases = {"glue/sst-2": "glue/sst2", "glue/sts-b": "glue/stsb"}
  name = aliases.get(name, name)
  if name not in glue_names:
    raise ConfigError(f"glue.py: unknown task {args.task!r}; expected one of "
                      f"{[n.removeprefix('glue/') for n in glue_names]}")
  config.task = name
  config.max_len = 128
  config.seeds = (1, 2, 3)
  config.optim.lr = 2e-5
  config.optim.warmup_proportion = 0.1
  config.optim.weight_decay = 0.01
  config.train.batch_size = 32
  config.train.epochs = 3
  return config


def get_sweep(arg=None):
  del arg
  return [{"optim.lr": lr} for lr in LEARNING_RATES]
