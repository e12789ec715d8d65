"""RoBERTa Table 2 (Liu et al. 2019): input format and the NSP loss, BERT-Base size, dynamic masking.

  bert-jax sweep --config configs/ablations/roberta_table2.py:scale=gpu --workdir runs/roberta_table2 \
      --config.data.prepared=data/wiki --data-dir glue=data/glue --data-dir squad=data/squad \
      --data-dir conll2003=data/conll2003
  bert-jax table runs/roberta_table2

SEGMENT-PAIR + NSP: pairs of segments of several sentences; SENTENCE-PAIR + NSP: pairs of single natural
sentences; FULL-SENTENCES: contiguous sentences crossing document boundaries, no NSP; DOC-SENTENCES: the
same within one document. Sentence pairs are far shorter than a row, so the paper raised their batch size to
keep the tokens a step about equal; here they are packed several to a row (each attends only to itself), which
does the same at the same row count. Arguments: scale.
"""

from bert_jax.experiments import ablation, findings, suite
from bert_jax.train.config_lib import parse_arg

SUITE = suite.Suite(tasks=("squad1.1_f1", "squad2.0_f1", "mnli_m", "sst2", "race"), seeds=(1, 2, 3, 4, 5),
                    lrs=(3e-5, 2e-5, 1e-5))

_COLUMNS = ("squad1.1_f1", "squad2.0_f1", "mnli_m", "sst2", "race")
PUBLISHED = {
    "paper": "Liu et al. 2019, RoBERTa: A Robustly Optimized BERT Pretraining Approach",
    "table": "Table 2",
    "source": ("shared/seeds (lecture notes quoting the paper's Table 2); dev set, SQuAD F1; checked against public "
               "copies of the text of arXiv:1907.11692 (https://ar5iv.labs.arxiv.org/html/1907.11692)"),
    "columns": {"squad1.1_f1": "SQuAD 1.1 (F1)", "squad2.0_f1": "SQuAD 2.0 (F1)", "mnli_m": "MNLI-m",
                "sst2": "SST-2", "race": "RACE"},
    "higher_is_better": {column: True for column in _COLUMNS},
    "rows": {
        "SEGMENT-PAIR": dict(zip(_COLUMNS, (90.4, 78.7, 84.0, 92.9, 64.2))),
        "SENTENCE-PAIR": dict(zip(_COLUMNS, (88.7, 76.2, 82.9, 92.1, 63.0))),
        "FULL-SENTENCES": dict(zip(_COLUMNS, (90.4, 79.1, 84.7, 92.5, 64.8))),
        "DOC-SENTENCES": dict(zip(_COLUMNS, (90.6, 79.7, 84.7, 92.7, 65.6))),
    },
}

# The findings this table tests, fixed before the runs that judge them (`bert_jax/experiments/findings.py`).
FINDINGS = (
    findings.Finding("removing NSP matches or improves downstream", "DOC-SENTENCES", "SEGMENT-PAIR", headline=True),
    findings.Finding("single sentences hurt", "SEGMENT-PAIR", "SENTENCE-PAIR"),
    findings.Finding("documents slightly better than full sentences", "DOC-SENTENCES", "FULL-SENTENCES"),
)


def get_config(arg=None):
  return ablation.base_config("roberta.py:size=base", parse_arg(arg, scale="tiny").scale)


def get_sweep(arg=None):
  del arg
  return [
      {"name": "SEGMENT-PAIR", "overrides": {"objective": "mlm+nsp", "data.format": "segment_pair"}},
      {"name": "SENTENCE-PAIR", "overrides": {"objective": "mlm+nsp", "data.format": "sentence_pair",
                                              "data.packing": True, "data.max_packs": 16}},
      {"name": "FULL-SENTENCES", "overrides": {"objective": "mlm", "data.format": "full_sentences"}},
      {"name": "DOC-SENTENCES", "overrides": {"objective": "mlm", "data.format": "doc_sentences"}},
  ]


def get_suite(arg=None):
  return suite.scaled(SUITE, parse_arg(arg, scale="tiny").scale)
