"""ALBERT Table 5 (Lan et al. 2020): the inter-sentence loss, none vs NSP vs SOP, ALBERT-base.

  bert-jax sweep --config configs/ablations/albert_sentence.py:scale=gpu --workdir runs/albert_sentence \
      --config.data.prepared=data/wiki --data-dir glue=data/glue --data-dir squad=data/squad --data-dir race=data/race
  bert-jax table runs/albert_sentence

Intrinsic columns come from the pre-training evaluation on held-out data: MLM accuracy, and NSP and SOP
accuracy. As in the paper every model is scored on both sentence tasks: after pre-training, the sweep scores
the final checkpoint on the other objective's held-out examples (`trainer.evaluate_run`); the None model has no
sentence head, so a fresh one scores it (chance). Arguments: scale.
"""

from bert_jax.experiments import ablation, suite
from bert_jax.train.config_lib import parse_arg

SUITE = suite.Suite(tasks=("squad1.1_f1", "squad2.0_f1", "mnli_m", "sst2", "race"), seeds=(1, 2, 3, 4, 5),
                    lrs=(5e-5, 3e-5, 2e-5))

_COLUMNS = ("mlm_acc", "nsp_acc", "sop_acc", "squad1.1_f1", "squad2.0_f1", "mnli_m", "sst2", "race")
PUBLISHED = {
    "paper": "Lan et al. 2020, ALBERT: A Lite BERT for Self-supervised Learning of Language Representations",
    "table": "Table 5",
    "source": "not in shared/seeds: copy the rows from the paper's Table 5 (dev set)",
    "columns": {"mlm_acc": "Intrinsic MLM", "nsp_acc": "Intrinsic NSP", "sop_acc": "Intrinsic SOP",
                "squad1.1_f1": "SQuAD1.1 (F1)", "squad2.0_f1": "SQuAD2.0 (F1)", "mnli_m": "MNLI", "sst2": "SST-2",
                "race": "RACE"},
    "higher_is_better": {column: True for column in _COLUMNS},
    "rows": {"None": {}, "NSP": {}, "SOP": {}},
}


def get_config(arg=None):
  return ablation.base_config("albert.py:size=base", parse_arg(arg, scale="tiny").scale)


def get_sweep(arg=None):
  del arg
  return [{"name": "None", "overrides": {"objective": "mlm", "data.format": "full_sentences"}},
          {"name": "NSP", "overrides": {"objective": "mlm+nsp", "data.format": "segment_pair"}},
          {"name": "SOP", "overrides": {"objective": "mlm+sop", "data.format": "sop"}}]


def get_suite(arg=None):
  return suite.scaled(SUITE, parse_arg(arg, scale="tiny").scale)
