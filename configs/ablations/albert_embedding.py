"""ALBERT Table 3 (Lan et al. 2020): the vocabulary embedding size E, not-shared and all-shared ALBERT-base.

  bert-jax sweep --config configs/ablations/albert_embedding.py:scale=gpu --workdir runs/albert_embedding \
      --config.data.prepared=data/wiki --data-dir glue=data/glue --data-dir squad=data/squad \
      --data-dir conll2003=data/conll2003
  bert-jax table runs/albert_embedding

At scale=tiny (width 64) E=64/128/256/768 become 8/16/32/64. Arguments: scale.
"""

from bert_jax.experiments import ablation, findings, suite
from bert_jax.train.config_lib import parse_arg

SUITE = suite.Suite(tasks=("squad1.1_f1", "squad2.0_f1", "mnli_m", "sst2", "race"), seeds=(1, 2, 3, 4, 5),
                    lrs=(5e-5, 3e-5, 2e-5))

EMBEDDING_SIZES = (64, 128, 256, 768)
_TINY_E = {64: 8, 128: 16, 256: 32, 768: 64}
SHARING = (("not-shared", 0), ("all-shared", 1))
_COLUMNS = ("squad1.1_f1", "squad2.0_f1", "mnli_m", "sst2", "race")


def row_name(sharing: str, embedding: int) -> str:
  return f"{sharing} E={embedding}"


# SQuAD cells are the paper's F1 (it prints F1/EM); its EM and Avg columns have no column of ours.
_SOURCE = ("arXiv:1909.11942v6 (ICLR 2020) Table 3, dev set; read from two public copies of the paper's text, "
           "paper at https://arxiv.org/abs/1909.11942v6")
_NUMBERS = {
    ("not-shared", 64): (89.9, 80.1, 82.9, 91.5, 66.7),
    ("not-shared", 128): (89.9, 80.3, 83.7, 91.5, 67.9),
    ("not-shared", 256): (90.2, 80.3, 84.1, 91.9, 67.3),
    ("not-shared", 768): (90.4, 80.4, 84.5, 92.8, 68.2),
    ("all-shared", 64): (88.7, 77.5, 80.8, 89.4, 63.5),
    ("all-shared", 128): (89.3, 80.0, 81.6, 90.3, 64.0),
    ("all-shared", 256): (88.8, 79.1, 81.5, 90.3, 63.4),
    ("all-shared", 768): (88.6, 79.2, 82.0, 90.6, 63.3),
}

PUBLISHED = {
    "paper": "Lan et al. 2020, ALBERT: A Lite BERT for Self-supervised Learning of Language Representations",
    "table": "Table 3",
    "source": _SOURCE,
    "columns": {"squad1.1_f1": "SQuAD1.1 (F1)", "squad2.0_f1": "SQuAD2.0 (F1)", "mnli_m": "MNLI", "sst2": "SST-2",
                "race": "RACE"},
    "higher_is_better": {column: True for column in _COLUMNS},
    "rows": {row_name(s, e): dict(zip(_COLUMNS, _NUMBERS[s, e])) for s, _ in SHARING for e in EMBEDDING_SIZES},
}

# The findings this table tests, fixed before the runs that judge them (`bert_jax/experiments/findings.py`).
FINDINGS = (
    findings.Finding("not shared: a larger embedding is better", row_name("not-shared", 768),
                     row_name("not-shared", 64)),
    findings.Finding("all shared: E=128 is best (above E=768)", row_name("all-shared", 128),
                     row_name("all-shared", 768)),
)


def get_config(arg=None):
  return ablation.base_config("albert.py:size=base", parse_arg(arg, scale="tiny").scale)


def get_sweep(arg=None):
  tiny = parse_arg(arg, scale="tiny").scale == "tiny"
  return [{"name": row_name(s, e),
           "overrides": {"model.embedding_size": _TINY_E[e] if tiny else e, "model.num_shared_groups": groups}}
          for s, groups in SHARING for e in EMBEDDING_SIZES]


def get_suite(arg=None):
  return suite.scaled(SUITE, parse_arg(arg, scale="tiny").scale)
