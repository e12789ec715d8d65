"""BERT Table 5 (Devlin et al. 2019): ablation over the pre-training tasks, BERT-Base architecture.

  bert-jax sweep --config configs/ablations/bert_table5.py:scale=gpu --workdir runs/bert_table5 \
      --config.data.prepared=data/wiki --data-dir glue=data/glue --data-dir squad=data/squad \
      --data-dir conll2003=data/conll2003 --parallel 4
  bert-jax table runs/bert_table5

Arguments: scale (tiny: CPU minutes on the built-in corpus; gpu: four rows side by side on one GPU; paper: BERT-Base's recipe).
Rows: MLM+NSP on segment pairs; No NSP (MLM on the same segment pairs); LTR & No NSP (a left-to-right LM);
+ BiLSTM (the LTR row's pre-trained model, with a randomly initialised BiLSTM added on top at fine-tuning, for
every task).
"""

from bert_jax.experiments import ablation, findings, suite
from bert_jax.train.config_lib import parse_arg

SUITE = suite.Suite(tasks=("mnli_m", "qnli", "mrpc", "sst2", "squad1.1_f1"), seeds=(1, 2, 3, 4, 5),
                    lrs=(5e-5, 4e-5, 3e-5, 2e-5), tiny_task="mrpc")

_COLUMNS = ("mnli_m", "qnli", "mrpc", "sst2", "squad1.1_f1")
PUBLISHED = {
    "paper": "Devlin et al. 2019, BERT: Pre-training of Deep Bidirectional Transformers for Language Understanding",
    "table": "Table 5",
    "source": ("shared/seeds (lecture notes quoting the paper's Table 5); dev set; checked against public copies of "
               "the text of arXiv:1810.04805 (https://arxiv.org/abs/1810.04805)"),
    "columns": {"mnli_m": "MNLI-m (Acc)", "qnli": "QNLI (Acc)", "mrpc": "MRPC (Acc)", "sst2": "SST-2 (Acc)",
                "squad1.1_f1": "SQuAD (F1)"},
    "higher_is_better": {column: True for column in _COLUMNS},
    "rows": {
        "BERT-Base": dict(zip(_COLUMNS, (84.4, 88.4, 86.7, 92.7, 88.5))),
        "No NSP": dict(zip(_COLUMNS, (83.9, 84.9, 86.5, 92.6, 87.9))),
        "LTR & No NSP": dict(zip(_COLUMNS, (82.1, 84.3, 77.5, 92.1, 77.8))),
        "+ BiLSTM": dict(zip(_COLUMNS, (82.1, 84.1, 75.7, 91.6, 84.9))),
    },
}

# The findings this table tests, fixed before the runs that judge them (`bert_jax/experiments/findings.py`).
FINDINGS = (
    findings.Finding("NSP helps (QNLI, MNLI, SQuAD)", "BERT-Base", "No NSP", headline=True),
    findings.Finding("a bidirectional MLM beats a left-to-right LM", "No NSP", "LTR & No NSP"),
    findings.Finding("a BiLSTM on the LTR model recovers SQuAD", "+ BiLSTM", "LTR & No NSP",
                     columns=("squad1.1_f1",)),
)


def get_config(arg=None):
  return ablation.base_config("bert.py:size=base,phase=1", parse_arg(arg, scale="tiny").scale)


def get_sweep(arg=None):
  del arg
  ltr = {"objective": "ltr", "data.format": "segment_pair"}
  return [
      {"name": "BERT-Base", "overrides": {}},
      {"name": "No NSP", "overrides": {"objective": "mlm", "data.format": "segment_pair"}},
      {"name": "LTR & No NSP", "overrides": ltr},
      # The LTR row's own pre-trained model with a BiLSTM added at fine-tuning, as in the paper.
      {"name": "+ BiLSTM", "pretrained": "LTR & No NSP", "finetune": {"top_bilstm": True}},
  ]


def get_suite(arg=None):
  return suite.scaled(SUITE, parse_arg(arg, scale="tiny").scale)
