"""ALBERT Table 5 (Lan et al. 2020): the inter-sentence loss, none vs NSP vs SOP, ALBERT-base.

  bert-jax sweep --config configs/ablations/albert_sentence.py:scale=gpu --workdir runs/albert_sentence \
      --config.data.prepared=data/wiki --data-dir glue=data/glue --data-dir squad=data/squad \
      --data-dir conll2003=data/conll2003
  bert-jax table runs/albert_sentence

Intrinsic columns come from the pre-training evaluation on held-out data: MLM accuracy, and NSP and SOP
accuracy. As in the paper every model is scored on both sentence tasks: after pre-training, the sweep scores
the final checkpoint on the other objective's held-out examples (`trainer.evaluate_run`); the None model has no
sentence head, so a fresh one scores it (chance). Arguments: scale.
"""

from bert_jax.experiments import ablation, findings, suite
from bert_jax.train.config_lib import parse_arg

SUITE = suite.Suite(tasks=("squad1.1_f1", "squad2.0_f1", "mnli_m", "sst2", "race"), seeds=(1, 2, 3, 4, 5),
                    lrs=(5e-5, 3e-5, 2e-5))

_COLUMNS = ("mlm_acc", "nsp_acc", "sop_acc", "squad1.1_f1", "squad2.0_f1", "mnli_m", "sst2", "race")
# SQuAD cells are the paper's F1 (it prints F1/EM); its EM and Avg columns have no column of ours.
_SOURCE = ("arXiv:1909.11942v6 (ICLR 2020) Table 5, dev set; read from two public copies of the paper's text, "
           "paper at https://arxiv.org/abs/1909.11942v6")
_NUMBERS = {"None": (54.9, 52.4, 53.3, 88.6, 78.1, 81.5, 89.9, 61.7),
            "NSP": (54.5, 90.5, 52.0, 88.4, 77.2, 81.6, 91.1, 62.3),
            "SOP": (54.0, 78.9, 86.5, 89.3, 80.0, 82.0, 90.3, 64.0)}
PUBLISHED = {
    "paper": "Lan et al. 2020, ALBERT: A Lite BERT for Self-supervised Learning of Language Representations",
    "table": "Table 5",
    "source": _SOURCE,
    "columns": {"mlm_acc": "Intrinsic MLM", "nsp_acc": "Intrinsic NSP", "sop_acc": "Intrinsic SOP",
                "squad1.1_f1": "SQuAD1.1 (F1)", "squad2.0_f1": "SQuAD2.0 (F1)", "mnli_m": "MNLI", "sst2": "SST-2",
                "race": "RACE"},
    "higher_is_better": {column: True for column in _COLUMNS},
    "rows": {name: dict(zip(_COLUMNS, numbers)) for name, numbers in _NUMBERS.items()},
}

# The findings this table tests, fixed before the runs that judge them (`bert_jax/experiments/findings.py`): the
# downstream headline, then the cross-evaluation of the sentence objectives.
FINDINGS = (
    findings.Finding("SOP beats NSP downstream", "SOP", "NSP", headline=True),
    findings.Finding("a model trained on SOP solves NSP", "SOP", "None", columns=("nsp_acc",)),
    findings.Finding("a model trained on NSP does not solve SOP", "SOP", "NSP", columns=("sop_acc",)),
)


def get_config(arg=None):
  return ablation.base_config("albert.py:size=base", parse_arg(arg, scale="tiny").scale)


def get_sweep(arg=None):
  del arg
  return [{"name": "None", "overrides": {"objective": "mlm", "data.format": "full_sentences"}},
          {"name": "NSP", "overrides": {"objective": "mlm+nsp", "data.format": "segment_pair"}},
          {"name": "SOP", "overrides": {"objective": "mlm+sop", "data.format": "sop"}}]


def get_suite(arg=None):
  return suite.scaled(SUITE, parse_arg(arg, scale="tiny").scale)
