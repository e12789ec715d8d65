"""The reproduction protocol's rule on synthetic runs whose answer is known, and the real tables' findings."""

import json
import math
import pathlib
import statistics

import pytest

from bert_jax.experiments import findings, report

REPO = pathlib.Path(__file__).resolve().parents[1]

PUBLISHED = {
    "paper": "A paper", "table": "Table T",
    "columns": {"mnli_m": "MNLI", "mrpc": "MRPC", "race": "RACE", "mlm_ppl": "ppl"},
    "higher_is_better": {"mnli_m": True, "mrpc": True, "race": True, "mlm_ppl": False},
    "rows": {"A": {"mnli_m": 84.0, "mrpc": 86.0, "race": 60.0, "mlm_ppl": 4.0},
             "B": {"mnli_m": 83.0, "mrpc": 84.0, "race": 50.0, "mlm_ppl": 5.0}},
}


def _run(row, seed, score, key=None, table="t", folder="f", differences=(), column="mrpc"):
  return findings.Run(table=table, folder=folder, row=row, seed=seed, key=key or f"key-{row}",
                      differences=tuple(differences), scores={column: score}, steps=3000, card="cpu")


def _judge(runs, finding=None, tables=None):
  finding = finding or findings.Finding("A beats B", "A", "B", columns=("mrpc",))
  tables = tables or [findings.TableFindings("t", PUBLISHED, (finding,))]
  return findings.judge(tables, runs, key_of=lambda table, row: f"key-{row}")


def test_columns_default_to_the_papers_with_stand_ins_and_no_pretraining_columns():
  ours, paper = findings.resolve_columns(findings.Finding("x", "A", "B"), PUBLISHED)
  assert ours == ["rte", "mrpc"]  # MNLI -> RTE; RACE has no stand-in; perplexity is a finding of its own.
  assert paper == ["mnli_m", "mrpc"]
  assert findings.published_delta(findings.Finding("x", "A", "B"), PUBLISHED) == pytest.approx(1.5)
  # Lower perplexity is better: A's 4.0 against B's 5.0 is +1 in the paper's direction.
  assert findings.published_delta(findings.Finding("x", "A", "B", columns=("mlm_ppl",)), PUBLISHED) == 1.0


def test_check_names_the_finding_that_is_wrong():
  with pytest.raises(ValueError, match="names row 'C'"):
    findings.check([findings.Finding("x", "A", "C")], PUBLISHED, ["A", "B"], "t.py")
  with pytest.raises(ValueError, match="puts 'A' at or above 'B'"):
    findings.check([findings.Finding("x", "B", "A")], PUBLISHED, ["A", "B"], "t.py")
  with pytest.raises(ValueError, match="no column we score"):
    findings.check([findings.Finding("x", "A", "B", columns=("race",))], PUBLISHED, ["A", "B"], "t.py")


def test_difference_is_welch_over_runs():
  better, worse = [80.0, 82.0, 81.0], [78.0, 79.0, 77.0]
  out = findings.difference(better, worse)
  se = math.sqrt(statistics.variance(better) / 3 + statistics.variance(worse) / 3)
  assert out["delta"] == pytest.approx(3.0) and out["se"] == pytest.approx(se)
  assert out["p"] == pytest.approx(math.erfc(3.0 / se / math.sqrt(2)))
  assert findings.difference([80.0], [78.0])["se"] is None


def test_holm_steps_down_and_stops():
  # Sorted: 0.005 <= a/4, 0.01 <= a/3, 0.03 > a/2 (a = 0.05): the first two rejected, the rest not.
  assert findings.holm([0.01, 0.04, 0.03, 0.005], alpha=0.05) == [True, False, False, True]
  # An untested finding counts in the family (it tightens the others) and is never rejected.
  assert findings.holm([0.03, None], alpha=0.05) == [False, False]
  assert findings.holm([0.03], alpha=0.05) == [True]
  # A lone finding at the protocol's level is "beyond 2 standard errors".
  assert findings.holm([math.erfc(2.01 / math.sqrt(2))]) == [True]
  assert findings.holm([math.erfc(1.99 / math.sqrt(2))]) == [False]


@pytest.mark.parametrize("better, worse, expected", [
    ([80.0, 81.0, 82.0], [70.0, 71.0, 72.0], "reproduces"),
    ([70.0, 71.0, 72.0], [80.0, 81.0, 82.0], "contradicts"),
    ([80.0, 75.0, 70.0], [76.0, 71.0, 79.0], "not resolved"),
    ([80.0, 81.0], [70.0, 71.0], "not resolved"),  # Fewer than 3 runs a row, whatever the gap.
])
def test_each_verdict(better, worse, expected):
  runs = [_run("A", seed, score) for seed, score in enumerate(better)] + [
      _run("B", seed, score) for seed, score in enumerate(worse)]
  (result,) = _judge(runs)
  assert result["verdict"] == expected
  assert (result["n_better"], result["n_worse"]) == (len(better), len(worse))


def test_holm_over_one_papers_findings():
  # Two findings of one paper, each beyond 2 SE alone (z = 2.4 / sqrt(4/3) = 2.08), neither below Holm's first
  # threshold (2.28 SE for a family of two): the family rejects neither.
  first = findings.Finding("A beats B", "A", "B", columns=("mrpc",))
  second = findings.Finding("A beats B on MNLI", "A", "B", columns=("rte",))
  runs = []
  for seed, a in enumerate([80.4, 82.4, 84.4]):
    runs.append(findings.Run("t", "f", "A", seed, "key-A", (), {"mrpc": a, "rte": a}, 3000, "cpu"))
    runs.append(findings.Run("t", "f", "B", seed, "key-B", (), {"mrpc": 80.0, "rte": 80.0}, 3000, "cpu"))
  alone = _judge(runs, first)[0]
  assert alone["z"] == pytest.approx(2.4 / math.sqrt(4 / 3)) and alone["verdict"] == "reproduces"
  both = _judge(runs, tables=[findings.TableFindings("t", PUBLISHED, (first, second))])
  assert [result["holm_family"] for result in both] == [2, 2]
  assert [result["verdict"] for result in both] == ["not resolved", "not resolved"]


def test_pooling_across_tables_and_repeats_of_one_seed():
  runs = [_run("A", 1, 80.0, table="t"), _run("A", 2, 81.0, table="other", folder="g"),
          # The same seed again (a GPU's non-determinism): one run, averaged.
          _run("A", 1, 82.0, table="t", folder="h"),
          _run("B", 1, 70.0), _run("B", 2, 71.0),
          # Another config (a try at another budget) is not pooled into the main budget.
          _run("B", 3, 99.0, key="other-budget", differences=("train.steps=30000",))]
  (result,) = _judge(runs)
  assert result["seeds_better"] == [1, 2] and result["seeds_worse"] == [1, 2]
  assert result["delta"] == pytest.approx(statistics.fmean([81.0, 81.0]) - 70.5)
  assert result["pooled_from"] == ["f (A)", "f (B)", "g (A)", "h (A)"]


def test_tries_are_counted_by_setting():
  runs = [_run("A", 1, 80.0), _run("B", 1, 70.0),
          _run("A", 1, 60.0, key="long", folder="long", differences=("train.steps=30000",)),
          _run("B", 1, 65.0, key="long-b", folder="long", differences=("train.steps=30000", "optim.lr=1e-4"))]
  (result,) = _judge(runs)
  assert [t["setting"] for t in result["tries"]] == ["main budget", "train.steps=30000; B: optim.lr=1e-4"]
  assert result["tries"][1]["delta"] == -5.0 and result["delta"] == 10.0


def test_carved_dev_counts_only_from_the_leak_free_carve():
  suite = {"tasks": ["sst2", "mrpc", "cola", "stsb", "rte"], "seeds": [1, 2, 3]}
  scores = {"sst2": 90.0, "mrpc": 80.0, "cola": 20.0, "stsb": 70.0, "rte": 60.0}
  row = {"tasks": {task: {"median": value, "values": [value - 1, value, value + 1]} for task, value in scores.items()},
         "pretrain": None}
  old = findings.scores(row, {"suite": suite})
  assert "sst2" not in old and "glue" not in old
  assert old["sst2@old_carve"] == 90.0 and old["glue@old_carve"] == 64.0  # Shown apart, never a finding's.
  leak_free = findings.scores(row, {"suite": suite, "dev_sets": {"sst2": "abc", "mrpc": "def"}})
  assert leak_free["sst2"] == 90.0 and leak_free["glue"] == 64.0
  # A task short of a seed is not scored, nor the GLUE score without it.
  row["tasks"]["mrpc"]["values"] = [79.0, 80.0]
  short = findings.scores(row, {"suite": suite, "dev_sets": {"sst2": "abc"}})
  assert "mrpc" not in short and "glue" not in short


def test_the_tables_findings_are_valid_and_have_their_headlines():
  tables = {table.table: table for table in findings.load_tables()}
  assert len(tables) == 14
  headlines = {name for name, table in tables.items() if any(f.headline for f in table.findings)}
  assert headlines == {"bert_table5", "bert_table6", "roberta_table1", "roberta_table2", "albert_sentence",
                       "electra_compute", "spanbert_masking", "spanbert_sbo", "structbert_objectives",
                       "ernie_masking"}


def test_rows_of_one_config_in_two_tables_share_a_key():
  # RoBERTa Table 1's dynamic row is Table 2's SEGMENT-PAIR row; BERT Table 5's two rows differ.
  assert findings.main_key("roberta_table1", "dynamic") == findings.main_key("roberta_table2", "SEGMENT-PAIR")
  assert findings.main_key("bert_table5", "BERT-Base") != findings.main_key("bert_table5", "No NSP")
  # A row that continues another's pre-training computes something else than the same overrides from scratch.
  stage_1 = findings.main_setting("ernie_masking", "stage 1: basic-level")[0]
  stage_2 = findings.main_setting("ernie_masking", "stage 2: phrase-level")[0]
  assert "continues" not in stage_1 and json.loads(stage_2["continues"]) == stage_1


def test_the_published_pages_are_what_the_published_runs_say():
  # docs/reproductions.md's generated part and each table's README.md, rendered again from the committed runs: a
  # page edited by hand, or runs published without rendering it again, fail here.
  root = REPO / "docs" / "reproductions"
  tables = findings.load_tables()
  runs = findings.load_runs(root)
  results = findings.judge(tables, runs)
  page = (REPO / "docs" / "reproductions.md").read_text()
  assert report.page_block(results, runs) in page, "run: bert-jax table --findings docs/reproductions --page " \
                                                   "docs/reproductions.md"
  for table in tables:
    assert (root / table.table / "README.md").read_text() == report.table_readme(table, results, runs, root)
  readme = (REPO / "README.md").read_text()
  assert report.counts_markdown(results) in readme, "the README's first screen gives the strict count"
