"""ALBERT Table 4 (Lan et al. 2020): cross-layer parameter sharing, ALBERT-base at E=768 and E=128.

  bert-jax sweep --config configs/ablations/albert_sharing.py:scale=gpu --workdir runs/albert_sharing \
      --config.data.prepared=data/wiki --data-dir glue=data/glue --data-dir squad=data/squad --data-dir race=data/race
  bert-jax table runs/albert_sharing

all-shared: one set of block parameters for every layer; shared-attention: only the attention sub-layers
shared; shared-FFN: only the feed-forward sub-layers shared (`model.shared_sublayers`; the LayerNorms stay per
layer); not-shared: every layer its own. E is the factorised embedding size (at scale=tiny, E=768 -> 64 and
E=128 -> 16). Arguments: scale.
"""

from bert_jax.experiments import ablation, suite
from bert_jax.train.config_lib import parse_arg

SUITE = suite.Suite(tasks=("squad1.1_f1", "squad2.0_f1", "mnli_m", "sst2", "race"), seeds=(1, 2, 3, 4, 5),
                    lrs=(5e-5, 3e-5, 2e-5))

EMBEDDING_SIZES = (768, 128)
STRATEGIES = ("all-shared", "shared-attention", "shared-FFN", "not-shared")
_TINY_E = {768: 64, 128: 16}
_COLUMNS = ("squad1.1_f1", "squad2.0_f1", "mnli_m", "sst2", "race")


def row_name(embedding: int, strategy: str) -> str:
  return f"E={embedding} {strategy}"


PUBLISHED = {
    "paper": "Lan et al. 2020, ALBERT: A Lite BERT for Self-supervised Learning of Language Representations",
    "table": "Table 4",
    "source": "not in shared/seeds: copy the rows from the paper's Table 4 (dev set)",
    "columns": {"squad1.1_f1": "SQuAD1.1 (F1)", "squad2.0_f1": "SQuAD2.0 (F1)", "mnli_m": "MNLI", "sst2": "SST-2",
                "race": "RACE"},
    "higher_is_better": {column: True for column in _COLUMNS},
    "rows": {row_name(e, s): {} for e in EMBEDDING_SIZES for s in STRATEGIES},
}


def get_config(arg=None):
  return ablation.base_config("albert.py:size=base", parse_arg(arg, scale="tiny").scale)


def _sharing(strategy: str) -> dict:
  if strategy == "not-shared":
    return {"model.num_shared_groups": 0, "model.shared_sublayers": "all"}
  sublayers = {"all-shared": "all", "shared-attention": "attention", "shared-FFN": "ffn"}[strategy]
  return {"model.num_shared_groups": 1, "model.shared_sublayers": sublayers}


def get_sweep(arg=None):
  tiny = parse_arg(arg, scale="tiny").scale == "tiny"
  return [{"name": row_name(e, s), "overrides": {"model.embedding_size": _TINY_E[e] if tiny else e, **_sharing(s)}}
          for e in EMBEDDING_SIZES for s in STRATEGIES]


def get_suite(arg=None):
  return suite.scaled(SUITE, parse_arg(arg, scale="tiny").scale)
