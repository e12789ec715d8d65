"""SQuAD: official metric rules, windows, gold recovery on real dev, n-best decoding, v2.0 thresholds."""

import json

import numpy as np
import pytest

from bert_jax.tasks import get_task
from bert_jax.tasks.base import HFTokenizerAdapter
from bert_jax.tasks.squad import (SpanPrediction, SquadExample, exact_match_score, f1_score, normalize_answer,
                                  read_squad, score_squad_v1, score_squad_v2, split_squad_by_article)


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
  return HFTokenizerAdapter.from_vocab_file(minilm_dir / "vocab.txt")


@pytest.fixture(scope="module")
def dev_examples(shared_data):
  return read_squad(shared_data / "squad" / "dev-v1.1.json")


def test_normalize_answer_follows_official_rules():
  assert normalize_answer("The  Denver Broncos!") == "denver broncos"
  assert normalize_answer("an apple, a pear & the plum.") == "apple pear plum"
  assert normalize_answer("Theater then anthem") == "theater then anthem"  # whole words only
  assert normalize_answer("  A\tB\n") == "b"
  assert normalize_answer("the") == ""


def test_exact_match_and_f1_by_hand():
  assert exact_match_score("the Denver Broncos", "Denver Broncos.") == 1.0
  assert exact_match_score("Broncos", "Denver Broncos") == 0.0
  # Prediction "denver broncos won" vs gold "broncos": P = 1/3, R = 1 -> F1 = 0.5.
  assert f1_score("Denver Broncos won", "the Broncos") == pytest.approx(0.5)
  # Repeated tokens count at most as often as in the other string: P = 1/3, R = 1/2 -> 0.4.
  assert f1_score("cat cat dog", "cat mouse") == pytest.approx(0.4)
  # evaluate-v1.1.py: nothing shared, even two empty strings, is F1 0 (EM is still 1).
  assert f1_score("the", "a") == 0.0 and exact_match_score("the", "a") == 1.0


def test_score_v1_takes_max_over_gold_answers():
  examples = [SquadExample("q1", "t", "?", "c", (("Denver Broncos", 0), ("Broncos", 7))),
              SquadExample("q2", "t", "?", "c", (("Santa Clara, California", 0),))]
  predictions = {"q1": "Broncos", "q2": "Santa Clara"}
  # q1: EM 1, F1 1 (second gold). q2: EM 0; P = 1, R = 2/3 -> F1 0.8.
  assert score_squad_v1(predictions, examples) == pytest.approx({"exact_match": 50.0, "f1": 90.0})
  assert score_squad_v1({"q1": "Broncos"}, examples)["exact_match"] == pytest.approx(50.0)  # missing = 0


def test_score_v2_threshold_breakdown_and_best_threshold():
  examples = [SquadExample("has1", "t", "?", "c", (("Denver", 0),)),
              SquadExample("none", "t", "?", "c", (), is_impossible=True),
              SquadExample("has2", "t", "?", "c", (("Super Bowl", 0),))]
  decoded = {"has1": SpanPrediction((("Denver", 5.0),), -2.0),
             "none": SpanPrediction((("foo", 1.0),), 1.0),
             "has2": SpanPrediction((("Super Bowl 50", 2.0),), 0.5)}
  results = score_squad_v2(decoded, examples, threshold=0.0)
  # At 0: has1 answered (right), none -> "" (right), has2 -> "" (wrong).
  assert results["exact"] == pytest.approx(200 / 3)
  assert results["HasAns_exact"] == pytest.approx(50.0) and results["NoAns_exact"] == pytest.approx(100.0)
  assert results["HasAns_total"] == 2 and results["NoAns_total"] == 1 and results["total"] == 3
  # has2's F1 when answered: P = 2/3, R = 1 -> 0.8. At 0 it is "", so F1 = (1 + 1 + 0) / 3.
  assert results["f1"] == pytest.approx(200 / 3)
  # Raising the threshold to 0.5 answers has2 too: exact stays 2/3, F1 becomes (1 + 1 + 0.8) / 3.
  assert results["best_f1"] == pytest.approx(280 / 3) and results["best_f1_thresh"] == 0.5
  assert results["best_exact"] == pytest.approx(200 / 3) and results["best_exact_thresh"] == -2.0
  # Predicting "" everywhere is best when every answer is wrong: threshold below all differences.
  wrong = {qid: SpanPrediction((("zzz", 0.0),), diff) for qid, diff in (("has1", 3), ("none", -1), ("has2", 2))}
  all_null = score_squad_v2(wrong, examples, threshold=0.0)
  assert all_null["best_exact"] == pytest.approx(100 / 3) and all_null["best_exact_thresh"] < -1


def _example(question, context, answer=None, qid="q"):
  answers = ((answer, context.index(answer)),) if answer else ()
  return SquadExample(qid, "t", question, context, answers, is_impossible=answer is None)


def test_windows_cover_context_and_max_context_is_unique(tokenizer):
  task = get_task("squad/v1.1", doc_stride=5, max_query_length=4)
  context = " ".join(f"w{i}" if i % 3 else "word" for i in range(60))
  example = _example("what is the longest question here", context, "w59")
  features = task.featurize([example], tokenizer, max_len=24)
  (context_ids,), (context_offsets,) = tokenizer.tokenize_with_offsets([context])
  assert len(features["input_ids"]) > 3
  seen = np.zeros(len(context_ids), np.int32)
  best = np.zeros(len(context_ids), np.int32)
  for row in range(len(features["input_ids"])):
    assert features["input_ids"][row, 0] == tokenizer.cls_id
    question_tokens = np.flatnonzero(features["input_ids"][row] == tokenizer.sep_id)[0] - 1
    assert question_tokens == 4  # max_query_length
    in_context = np.flatnonzero(features["token_offsets"][row, :, 0] >= 0)
    token_indices = [context_offsets.index(tuple(o)) for o in features["token_offsets"][row, in_context]]
    assert features["input_ids"][row, in_context].tolist() == [context_ids[i] for i in token_indices]
    assert (features["segment_ids"][row, in_context] == 1).all()
    assert features["lengths"][row] == in_context[-1] + 2
    seen[token_indices] += 1
    best[token_indices] += features["max_context"][row, in_context]
  assert (seen >= 1).all() and (best == 1).all()
  # The answer is the last token: only windows holding it point at it, others at [CLS].
  with_answer = np.flatnonzero(features["start_positions"] > 0)
  assert len(with_answer) >= 1 and features["start_positions"][-1] > 0
  for row in with_answer:
    offsets = features["token_offsets"][row]
    start, end = features["start_positions"][row], features["end_positions"][row]
    assert context[offsets[start, 0]:offsets[end, 1]] == "w59"
  assert (features["end_positions"][features["start_positions"] == 0] == 0).all()


@pytest.mark.shared_data
def test_real_dev_counts_and_gold_recovery(shared_data, dev_examples, tokenizer):
  with open(shared_data / "squad" / "dev-v1.1.json", encoding="utf-8") as f:
    data = json.load(f)
  assert len(dev_examples) == 10570 and len(data["data"]) == 48
  assert sum(len(a["paragraphs"]) for a in data["data"]) == 2067
  task = get_task("squad/v1.1", doc_stride=64)
  features = task.featurize(dev_examples, tokenizer, max_len=160)
  assert len(features["input_ids"]) > 1.5 * len(dev_examples)  # short rows force many windows
  recovered_exactly = answerable = 0
  covered = set()
  for row in np.flatnonzero(features["start_positions"] > 0):
    example = dev_examples[features["example_index"][row]]
    text, char_start = example.answers[0]
    offsets = features["token_offsets"][row]
    start, end = features["start_positions"][row], features["end_positions"][row]
    assert start <= end and offsets[start, 0] >= 0 and offsets[end, 0] >= 0
    # The token span is the smallest one covering the gold characters.
    assert offsets[start, 0] <= char_start < offsets[start, 1]
    assert offsets[end, 0] < char_start + len(text) <= offsets[end, 1]
    answerable += 1
    recovered_exactly += example.context[offsets[start, 0]:offsets[end, 1]] == text
    covered.add(int(features["example_index"][row]))
  assert len(covered) == len(dev_examples)  # every answer fits in some window
  assert recovered_exactly / answerable > 0.995  # the rest are answers that start or end inside a word
  # Every context token is in some window, and exactly one window is its max-context one.
  for example_index in (0, 5000, 10569):
    rows = np.flatnonzero(features["example_index"] == example_index)
    offsets = features["token_offsets"][rows]
    in_context = offsets[..., 0] >= 0
    starts = offsets[..., 0][in_context]
    (context_ids,), _ = tokenizer.tokenize_with_offsets([dev_examples[example_index].context])
    assert len(np.unique(starts)) == len(context_ids)
    assert features["max_context"][rows].sum() == len(context_ids)


@pytest.mark.shared_data
def test_oracle_logits_score_near_100_on_real_dev(dev_examples, tokenizer):
  examples = dev_examples[:1500]
  task = get_task("squad/v1.1")
  features = task.featurize(examples, tokenizer, max_len=256)
  rows = np.arange(len(features["input_ids"]))
  logits = np.full(features["input_ids"].shape + (2,), -10.0, np.float32)
  logits[rows, features["start_positions"], 0] = 10.0
  logits[rows, features["end_positions"], 1] = 10.0
  decoded = task.decode(logits, features, examples)
  assert all(len({text for text, _ in p.nbest}) == len(p.nbest) <= 20 for p in decoded.values())
  predictions = task.predict(logits, features, examples)
  for row in np.flatnonzero(features["start_positions"] > 0):
    example = examples[features["example_index"][row]]
    offsets = features["token_offsets"][row]
    gold_tokens_text = example.context[offsets[features["start_positions"][row], 0]:
                                       offsets[features["end_positions"][row], 1]]
    assert predictions[example.qid] == gold_tokens_text
  results = task.evaluate(logits, features, examples)
  # Not 100: a few gold answers start or end inside a word ("5" of "50").
  assert results["exact_match"] > 98.5 and results["f1"] >= results["exact_match"]


def test_decode_respects_span_rules_and_dedups(tokenizer):
  context = "alpha beta gamma delta epsilon zeta"
  example = _example("which one", context, "gamma")
  task = get_task("squad/v1.1", max_answer_length=2, n_best_size=5)
  features = task.featurize([example], tokenizer, max_len=32)
  positions = {context[o[0]:o[1]]: p for p, o in enumerate(features["token_offsets"][0]) if o[0] >= 0}
  logits = np.zeros((1, 32, 2), np.float32)
  logits[0, 1, :] = 50.0  # a question token: never part of an answer
  logits[0, positions["beta"], 0] = 9.0
  logits[0, positions["epsilon"], 1] = 9.0  # beta..epsilon is 4 tokens > max_answer_length
  logits[0, positions["gamma"], 0] = 5.0
  logits[0, positions["delta"], 1] = 5.0
  logits[0, positions["delta"], 0] = 7.0  # end before start is invalid
  logits[0, positions["alpha"], 1] = 8.0
  decoded = task.decode(logits, features, [example])["q"]
  # beta..epsilon (18) is too long and delta..alpha runs backwards; delta..epsilon = 7 + 9 wins.
  assert decoded.nbest[:3] == (("delta epsilon", 16.0), ("delta", 12.0), ("gamma delta", 10.0))
  assert len(decoded.nbest) == 5 and all(len(text.split()) <= 2 for text, _ in decoded.nbest)
  assert task.predict(logits, features, [example]) == {"q": decoded.best_text}


def test_v2_unanswerable_features_and_null_threshold(tokenizer):
  examples = [_example("q one", "the sky is blue", None, qid="none"),
              _example("q two", "the grass is green", "green", qid="has")]
  task = get_task("squad/v2.0", null_score_threshold=1.0)
  features = task.featurize(examples, tokenizer, max_len=16)
  assert features["start_positions"][0] == 0 and features["end_positions"][0] == 0
  assert features["start_positions"][1] > 0
  logits = np.zeros((2, 16, 2), np.float32)
  logits[0, 0, :] = 3.0  # null score 6 vs best non-null 0: diff 6 > 1 -> ""
  logits[1, features["start_positions"][1], 0] = 4.0
  logits[1, features["end_positions"][1], 1] = 4.0  # best 8 vs null 0: diff -8 -> "green"
  assert task.predict(logits, features, examples) == {"none": "", "has": "green"}
  results = task.evaluate(logits, features, examples)
  assert results["exact"] == 100.0 and results["best_f1"] == 100.0
  assert results["HasAns_f1"] == 100.0 and results["NoAns_f1"] == 100.0


def test_split_by_article_is_disjoint_and_deterministic(shared_data):
  with open(shared_data / "squad" / "dev-v1.1.json", encoding="utf-8") as f:
    data = json.load(f)
  train, evaluation = split_squad_by_article(data, eval_fraction=0.25, seed=0)
  train_titles = [a["title"] for a in train["data"]]
  eval_titles = [a["title"] for a in evaluation["data"]]
  assert len(eval_titles) == 12 and not set(train_titles) & set(eval_titles)
  assert sorted(train_titles + eval_titles) == sorted(a["title"] for a in data["data"])
  assert split_squad_by_article(data, 0.25, seed=0)[1] == evaluation
  assert split_squad_by_article(data, 0.25, seed=1)[1] != evaluation
  assert len(read_squad(train)) + len(read_squad(evaluation)) == 10570


def test_read_errors_name_file_and_question(tmp_path):
  bad = {"version": "1.1", "data": [{"title": "t", "paragraphs": [
      {"context": "short", "qas": [{"id": "abc", "question": "?", "answers": [{"text": "x", "answer_start": 9}]}]}]}]}
  path = tmp_path / "dev-v1.1.json"
  path.write_text(json.dumps(bad))
  with pytest.raises(ValueError, match=r"dev-v1\.1\.json: question abc: answer start 9"):
    read_squad(path)
  v2 = {"version": "v2.0", "data": [{"title": "t", "paragraphs": [
      {"context": "short", "qas": [{"id": "n", "question": "?", "answers": [], "is_impossible": True}]}]}]}
  (tmp_path / "dev-v1.1.json").write_text(json.dumps(v2))
  with pytest.raises(ValueError, match="use squad/v2.0"):
    get_task("squad/v1.1").load(tmp_path, "dev")
  assert read_squad(v2)[0].is_impossible


def test_truncated_json_and_missing_fields_name_the_file(tmp_path):
  good = {"version": "1.1", "data": [{"title": "t", "paragraphs": [
      {"context": "a short context", "qas": [{"id": "q1", "question": "?", "answers": [{"text": "short"}]}]}]}]}
  path = tmp_path / "dev-v1.1.json"
  path.write_text(json.dumps(good, indent=1)[:90])
  with pytest.raises(ValueError, match=rf"{path}:\d+: not valid JSON \(.* at column \d+\); the file may be truncated"):
    read_squad(path)
  path.write_text(json.dumps(good))
  with pytest.raises(ValueError, match=rf"{path}: an answer of question q1 has no 'answer_start' field"):
    read_squad(path)
  path.write_text(json.dumps({"data": [{"title": "t"}]}))
  with pytest.raises(ValueError, match=rf"{path}: data\[0\] has no 'paragraphs' field"):
    read_squad(path)
