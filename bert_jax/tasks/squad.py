"""SQuAD v1.1 and v2.0: reading, sliding-window features, n-best decoding, official metrics.

Rows are [CLS] question [SEP] context-window [SEP]. Long contexts are cut
into windows that start every `doc_stride` tokens; each context token is
scored in the window where it has the most context on both sides (BERT's
`_check_is_max_context`), and only such tokens may start an answer. Answers
are mapped back to the original context through the tokenizer's character
offsets, so the predicted text is an exact substring of the context.

The metrics follow the official `evaluate-v1.1.py` and `evaluate-v2.0.py`
rules: answers are lower-cased, stripped of punctuation and of the articles
a/an/the, and whitespace is collapsed; exact match and token F1 are the
maximum over the gold answers.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
import re
import string
from typing import Any, Sequence

import numpy as np

from bert_jax.tasks.base import Task, TaskTokenizer, check_outputs, data_error, describe_json, read_utf8

VERSIONS = ("1.1", "2.0")
_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


@dataclasses.dataclass(frozen=True)
class SquadExample:
  """One question about one paragraph.

  Attributes:
    qid: the question id used by the official evaluation.
    title: the article's title (articles are the unit of the dev split).
    question: question text.
    context: paragraph text.
    answers: (text, character start in context) of each gold answer; empty
      for unanswerable v2.0 questions.
    is_impossible: True for v2.0 questions with no answer in the paragraph.
  """

  qid: str
  title: str
  question: str
  context: str
  answers: tuple[tuple[str, int], ...]
  is_impossible: bool = False


@dataclasses.dataclass(frozen=True)
class SpanPrediction:
  """Decoded answers for one question.

  Attributes:
    nbest: up to n_best_size (text, start_logit + end_logit), best first,
      distinct texts.
    null_score_diff: null score minus the best non-null score (v2.0; +inf
      when no valid span exists); the answer is "" when it exceeds the
      threshold.
  """

  nbest: tuple[tuple[str, float], ...]
  null_score_diff: float

  @property
  def best_text(self) -> str:
    """The best non-null answer ("" when no valid span exists)."""
    return self.nbest[0][0] if self.nbest else ""


def read_squad(source: str | pathlib.Path | dict[str, Any], require_answers: bool = True) -> list[SquadExample]:
  """Reads SQuAD JSON (v1.1 or v2.0) from a file or an already-loaded dict.

  With `require_answers` False, a question without answers (a file to predict on) reads as one with no gold answer
  instead of failing.

  Raises:
    ValueError: naming the file and the JSON path (`data[3].paragraphs[0].context`) when the file is not JSON
      (e.g. truncated; then its line), a field is missing or of the wrong type (a null list, a number for a
      text, a text for an answer start), a question id repeats, an answerable question has no answers or an
      answer's start is outside its paragraph.
  """
  if isinstance(source, dict):
    data, where = source, "<squad dict>"
  else:
    where = str(source)
    try:
      data = json.loads(read_utf8(source))
    except json.JSONDecodeError as error:
      raise data_error(where, error.lineno, f"not valid JSON ({error.msg} at column {error.colno}); the file may be "
                       f"truncated: download it again") from None
  if not isinstance(data, dict) or not isinstance(data.get("data"), list):
    raise data_error(where, None, "not SQuAD JSON: no top-level 'data' list")
  examples, first_seen = [], {}
  for article_index, article in enumerate(data["data"]):
    at = f"data[{article_index}]"
    title = _field(article, "title", where, at, str, default="")
    for paragraph_index, paragraph in enumerate(_field(article, "paragraphs", where, at, list)):
      at_paragraph = f"{at}.paragraphs[{paragraph_index}]"
      context = _field(paragraph, "context", where, at_paragraph, str)
      for qa_index, qa in enumerate(_field(paragraph, "qas", where, at_paragraph, list)):
        at_qa = f"{at_paragraph}.qas[{qa_index}]"
        qid = _field(qa, "id", where, at_qa, str)
        if qid in first_seen:  # Predictions and scores are keyed by id: a repeat would take another's answer.
          raise data_error(where, None, f"question id {qid!r} at {at_qa} repeats the one at {first_seen[qid]}; "
                           "give every question its own id")
        first_seen[qid] = at_qa
        question = _field(qa, "question", where, at_qa, str, what=f"question {qid}")
        is_impossible = _field(qa, "is_impossible", where, at_qa, bool, default=False)
        unlabelled = not require_answers and not qa.get("answers")
        answers = []
        if not is_impossible and not unlabelled:
          for answer_index, answer in enumerate(_field(qa, "answers", where, at_qa, list, what=f"question {qid}")):
            at_answer, what = f"{at_qa}.answers[{answer_index}]", f"an answer of question {qid}"
            text = _field(answer, "text", where, at_answer, str, what=what)
            start = _field(answer, "answer_start", where, at_answer, int, what=what)
            if not 0 <= start <= len(context) - len(text):
              raise data_error(where, None, f"question {qid}: answer start {start} is outside the context "
                               f"({at_answer}: {len(text)} characters from {start}, context has {len(context)}); "
                               "fix the answer's start")
            answers.append((text, start))
          if not answers:
            raise data_error(where, None, f"question {qid} has no answers and is not marked impossible ({at_qa}); "
                             "give it an answer or \"is_impossible\": true (SQuAD v2.0)")
        examples.append(SquadExample(qid, title, question, context, tuple(answers), is_impossible))
  return examples


# What each typed field must hold, as the error words it.
_EXPECTED = {str: "a string", list: "a list", int: "an integer", bool: "true or false", dict: "an object"}
_MISSING = object()


def _field(record: Any, key: str, where: str, at: str, kind: type, what: str | None = None,
           default: Any = _MISSING) -> Any:
  """record[key] when it is a `kind`, else a ValueError naming the file and the JSON path (`at`: the record's).

  A missing key reads as `default` when one is given; `what` names the record in the message (default: `at`).
  """
  if not isinstance(record, dict):
    raise data_error(where, None, f"{at} is {describe_json(record)}, expected an object; is this SQuAD v1.1/v2.0 "
                     "JSON?")
  if key not in record:
    if default is not _MISSING:
      return default
    place = f" at {at}" if what else ""
    raise data_error(where, None, f"{what or at} has no {key!r} field{place}; is this SQuAD v1.1/v2.0 JSON?")
  value = record[key]
  if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):  # true is an int in Python.
    raise data_error(where, None, f"{at}.{key} is {describe_json(value)}, expected {_EXPECTED[kind]}; fix that "
                     "field of the file (SQuAD v1.1/v2.0 JSON)")
  return value


def split_squad_by_article(data: dict[str, Any], eval_fraction: float = 0.25,
                           seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
  """Splits SQuAD JSON into a train part and an eval part with disjoint articles.

  Splitting by article (not by question) keeps paragraphs seen in training
  out of evaluation. Articles keep their original order within each part.

  Args:
    data: loaded SQuAD JSON (e.g. dev-v1.1.json).
    eval_fraction: share of articles that go to the eval part.
    seed: seed of the article shuffle.

  Returns:
    (train_data, eval_data), both SQuAD JSON dicts with the input's version.
  """
  articles = data["data"]
  if len(articles) < 2 or not 0.0 < eval_fraction < 1.0:
    raise ValueError(f"need >= 2 articles and 0 < eval_fraction < 1, got {len(articles)} and {eval_fraction}")
  num_eval = min(len(articles) - 1, max(1, round(eval_fraction * len(articles))))
  eval_indices = set(np.random.default_rng(seed).permutation(len(articles))[:num_eval].tolist())
  version = data.get("version", "")
  return ({"version": version, "data": [a for i, a in enumerate(articles) if i not in eval_indices]},
          {"version": version, "data": [a for i, a in enumerate(articles) if i in eval_indices]})


def normalize_answer(text: str) -> str:
  """Lower-cases and removes punctuation, articles and extra whitespace (official rules)."""
  text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
  return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match_score(prediction: str, ground_truth: str) -> float:
  """1.0 when the normalised strings are equal."""
  return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def f1_score(prediction: str, ground_truth: str) -> float:
  """Token F1 of the normalised strings as in evaluate-v1.1.py (0 when nothing is shared)."""
  prediction_tokens = normalize_answer(prediction).split()
  ground_truth_tokens = normalize_answer(ground_truth).split()
  shared = sum((collections.Counter(prediction_tokens) & collections.Counter(ground_truth_tokens)).values())
  if shared == 0:
    return 0.0
  precision = shared / len(prediction_tokens)
  recall = shared / len(ground_truth_tokens)
  return 2 * precision * recall / (precision + recall)


def _v2_scores(prediction: str, example: SquadExample) -> tuple[float, float]:
  """(exact, f1) of one answer under evaluate-v2.0.py's rules."""
  # v2.0 drops gold answers that normalise to nothing; a question left without
  # any is scored as no-answer, where only an empty prediction is right.
  gold = [text for text, _ in example.answers if normalize_answer(text)]
  if not gold:
    empty = float(not normalize_answer(prediction))
    return empty, empty
  return (max(exact_match_score(prediction, g) for g in gold),
          max(f1_score(prediction, g) for g in gold))


def _best_threshold(null_score_diffs: np.ndarray, answer_scores: np.ndarray,
                    null_scores: np.ndarray) -> tuple[float, float]:
  """Best total score over thresholds "answer when null_score_diff <= t".

  Args:
    null_score_diffs: per question, null score minus best non-null score.
    answer_scores: per question, the score when it is answered.
    null_scores: per question, the score when "" is predicted.

  Returns:
    (best score in percent, threshold); the threshold is below every
    difference when predicting "" everywhere is best.
  """
  order = np.argsort(null_score_diffs, kind="stable")
  sorted_diffs = null_score_diffs[order]
  # Score at each threshold: everything up to i answered, the rest null.
  gains = np.cumsum(answer_scores[order] - null_scores[order])
  totals = null_scores.sum() + gains
  # Questions with equal differences are answered together: only the last of
  # each tie group is an attainable threshold; inf (no valid span) never is.
  attainable = np.append(sorted_diffs[1:] != sorted_diffs[:-1], True) & np.isfinite(sorted_diffs)
  finite_diffs = sorted_diffs[np.isfinite(sorted_diffs)]
  best_total = null_scores.sum()
  best_threshold = float(finite_diffs[0]) - 1.0 if finite_diffs.size else 0.0
  if attainable.any():
    candidates = np.flatnonzero(attainable)
    best = candidates[np.argmax(totals[candidates])]
    if totals[best] > best_total:
      best_total, best_threshold = totals[best], float(sorted_diffs[best])
  return 100.0 * float(best_total) / len(null_score_diffs), best_threshold


class SquadTask(Task):
  """SQuAD v1.1 or v2.0 span extraction."""

  kind = "span"

  def __init__(self, version: str = "1.1", doc_stride: int = 128, max_query_length: int = 64,
               n_best_size: int = 20, max_answer_length: int = 30, null_score_threshold: float = 0.0):
    """Configures windows and decoding (defaults are BERT's run_squad flags).

    Args:
      version: "1.1" or "2.0".
      doc_stride: tokens between the starts of consecutive context windows.
      max_query_length: questions are cut to this many tokens.
      n_best_size: start and end candidates per window, and answers kept.
      max_answer_length: longest answer in tokens.
      null_score_threshold: v2.0 predicts "" when null_score_diff exceeds it.
    """
    if version not in VERSIONS:
      raise ValueError(f"SQuAD version must be one of {VERSIONS}, got {version!r}")
    self.version = version
    self.doc_stride = doc_stride
    self.max_query_length = max_query_length
    self.n_best_size = n_best_size
    self.max_answer_length = max_answer_length
    self.null_score_threshold = null_score_threshold
    self.name = f"squad/v{version}"
    if version == "1.1":
      self.metric_names = ("exact_match", "f1")
      self.selection_metric = "f1"
    else:
      self.metric_names = ("exact", "f1", "best_exact", "best_f1", "HasAns_f1", "NoAns_f1")
      self.selection_metric = "best_f1"

  def load(self, data_dir: str | pathlib.Path, split: str) -> list[SquadExample]:
    """Reads `data_dir/{split}-v{version}.json` (split "train" or "dev")."""
    path = pathlib.Path(data_dir) / f"{split}-v{self.version}.json"
    examples = read_squad(path)
    if self.version == "1.1" and any(e.is_impossible for e in examples):
      raise data_error(path, None, "has unanswerable (v2.0) questions; use squad/v2.0")
    return examples

  def read_file(self, path: str | pathlib.Path) -> list[SquadExample]:
    """SQuAD JSON (`read_squad`); questions may come without answers."""
    return read_squad(path, require_answers=False)

  def _windows(self, num_context_tokens: int, max_context_tokens: int) -> list[tuple[int, int]]:
    """(start, length) of each window; the last one reaches the end of the context."""
    windows, start = [], 0
    while True:
      length = min(num_context_tokens - start, max_context_tokens)
      windows.append((start, length))
      if start + length >= num_context_tokens:
        return windows
      start += min(length, self.doc_stride)

  def featurize(self, examples: Sequence[SquadExample], tokenizer: TaskTokenizer,
                max_len: int) -> dict[str, np.ndarray]:
    """One feature per context window; see `bert_jax.tasks.base` for the fields.

    Training targets come from each example's first gold answer; they point
    at [CLS] (index 0) when the answer is not wholly inside the window or the
    question is unanswerable.
    """
    if not examples:
      raise ValueError(f"{self.name}: no examples to featurize")
    contexts = list(dict.fromkeys(e.context for e in examples))
    context_index = {context: i for i, context in enumerate(contexts)}
    context_ids, context_offsets = tokenizer.tokenize_with_offsets(contexts)
    question_ids, _ = tokenizer.tokenize_with_offsets([e.question for e in examples])
    rows = collections.defaultdict(list)
    for example_index, example in enumerate(examples):
      question = question_ids[example_index][:self.max_query_length]
      ids = context_ids[context_index[example.context]]
      offsets = np.asarray(context_offsets[context_index[example.context]], np.int32).reshape(-1, 2)
      context_begin = len(question) + 2
      max_context_tokens = max_len - len(question) - 3
      if max_context_tokens <= 0:
        raise ValueError(f"max_len {max_len} leaves no room for context after a "
                         f"{len(question)}-token question (max_query_length {self.max_query_length})")
      windows = self._windows(len(ids), max_context_tokens)
      best_window = self._best_window_per_token(windows, len(ids))
      answer_span = None
      if example.answers and not example.is_impossible:
        text, char_start = example.answers[0]
        answer_span = _char_span_to_tokens(offsets, char_start, char_start + len(text))
      for window_index, (start, length) in enumerate(windows):
        tokens = [tokenizer.cls_id, *question, tokenizer.sep_id, *ids[start:start + length], tokenizer.sep_id]
        input_ids = np.full((max_len,), tokenizer.pad_id, np.int32)
        input_ids[:len(tokens)] = tokens
        segment_ids = np.zeros((max_len,), np.int32)
        segment_ids[context_begin:len(tokens)] = 1
        token_offsets = np.full((max_len, 2), -1, np.int32)
        token_offsets[context_begin:context_begin + length] = offsets[start:start + length]
        max_context = np.zeros((max_len,), np.int32)
        max_context[context_begin:context_begin + length] = best_window[start:start + length] == window_index
        start_position = end_position = 0
        if answer_span is not None and start <= answer_span[0] and answer_span[1] < start + length:
          start_position = context_begin + answer_span[0] - start
          end_position = context_begin + answer_span[1] - start
        rows["input_ids"].append(input_ids)
        rows["segment_ids"].append(segment_ids)
        rows["lengths"].append(len(tokens))
        rows["example_index"].append(example_index)
        rows["start_positions"].append(start_position)
        rows["end_positions"].append(end_position)
        rows["token_offsets"].append(token_offsets)
        rows["max_context"].append(max_context)
    return {key: np.asarray(values, np.int32) for key, values in rows.items()}

  @staticmethod
  def _best_window_per_token(windows: list[tuple[int, int]], num_tokens: int) -> np.ndarray:
    """Index of the window where each context token has the most context.

    A token's score in a window is min(left context, right context) + 0.01 *
    window length (BERT's `_check_is_max_context`); the first best wins ties.
    """
    positions = np.arange(num_tokens)
    scores = np.full((len(windows), num_tokens), -np.inf)
    for window_index, (start, length) in enumerate(windows):
      inside = (positions >= start) & (positions < start + length)
      context = np.minimum(positions - start, start + length - 1 - positions)
      scores[window_index, inside] = context[inside] + 0.01 * length
    return np.argmax(scores, axis=0) if num_tokens else np.zeros((0,), np.int64)

  def decode(self, outputs: np.ndarray, features: dict[str, np.ndarray],
             examples: Sequence[SquadExample]) -> dict[str, SpanPrediction]:
    """n-best answers and the null-score difference for every question.

    Args:
      outputs: float [N, L, 2] start and end logits per feature.
      features: `featurize`'s output.
      examples: the examples the features came from.

    Returns:
      qid -> SpanPrediction.
    """
    max_len = features["input_ids"].shape[1]
    outputs = check_outputs(outputs, features, (max_len, 2))
    candidates: list[dict[str, float]] = [{} for _ in examples]
    null_scores = np.full((len(examples),), np.inf)
    for feature_index, example_index in enumerate(features["example_index"]):
      start_logits, end_logits = outputs[feature_index, :, 0], outputs[feature_index, :, 1]
      null_scores[example_index] = min(null_scores[example_index], start_logits[0] + end_logits[0])
      offsets = features["token_offsets"][feature_index]
      in_context = offsets[:, 0] >= 0
      starts = _top_positions(start_logits, in_context & (features["max_context"][feature_index] == 1),
                              self.n_best_size)
      ends = _top_positions(end_logits, in_context, self.n_best_size)
      span_lengths = ends[None, :] - starts[:, None] + 1
      valid = (span_lengths >= 1) & (span_lengths <= self.max_answer_length)
      pair_scores = np.where(valid, start_logits[starts][:, None] + end_logits[ends][None, :], -np.inf)
      # Distinct spans of one window are distinct texts, so its n_best best
      # pairs are all it can contribute to the question's n-best list.
      best_pairs = np.argsort(-pair_scores, axis=None, kind="stable")[:min(self.n_best_size, int(valid.sum()))]
      context = examples[example_index].context
      by_text = candidates[example_index]
      for start_rank, end_rank in zip(*np.unravel_index(best_pairs, pair_scores.shape)):
        start, end = starts[start_rank], ends[end_rank]
        text = context[offsets[start, 0]:offsets[end, 1]].strip()
        score = float(pair_scores[start_rank, end_rank])
        by_text[text] = max(score, by_text.get(text, -np.inf))
    predictions = {}
    for example_index, example in enumerate(examples):
      ranked = sorted(candidates[example_index].items(), key=lambda item: -item[1])[:self.n_best_size]
      best_score = ranked[0][1] if ranked else -np.inf
      predictions[example.qid] = SpanPrediction(tuple(ranked), float(null_scores[example_index] - best_score))
    return predictions

  def predict(self, outputs: np.ndarray, features: dict[str, np.ndarray],
              examples: Sequence[SquadExample]) -> dict[str, str]:
    """qid -> answer text, as in the official predictions.json ("" = no answer in v2.0)."""
    return {qid: self._answer(prediction, self.null_score_threshold)
            for qid, prediction in self.decode(outputs, features, examples).items()}

  def _answer(self, prediction: SpanPrediction, threshold: float) -> str:
    if self.version == "2.0" and prediction.null_score_diff > threshold:
      return ""
    return prediction.best_text

  def evaluate(self, outputs: np.ndarray, features: dict[str, np.ndarray],
               examples: Sequence[SquadExample]) -> dict[str, float]:
    """Official metrics; v2.0 adds the HasAns/NoAns breakdown and best thresholds.

    v1.1 returns exact_match and f1. v2.0 returns exact, f1 (at
    `null_score_threshold`), total, HasAns_exact/f1/total and
    NoAns_exact/f1/total (each only when such questions exist), and
    best_exact/best_f1 with the thresholds best_exact_thresh/best_f1_thresh
    that reach them on these examples.
    """
    decoded = self.decode(outputs, features, examples)
    if self.version == "1.1":
      return score_squad_v1({qid: p.best_text for qid, p in decoded.items()}, examples)
    return score_squad_v2(decoded, examples, self.null_score_threshold)


  @property
  def num_labels(self) -> int:
    """Start and end logits per token."""
    return 2

  def submission_text(self, examples: Sequence[SquadExample], predictions: dict[str, str]) -> str:
    """The official predictions.json: {question id: answer text} ("" is no answer)."""
    del examples
    return json.dumps(predictions, indent=1, ensure_ascii=False) + "\n"


def score_squad_v1(predictions: dict[str, str], examples: Sequence[SquadExample]) -> dict[str, float]:
  """evaluate-v1.1.py: exact match and F1 in percent; missing predictions score 0."""
  exact = f1 = 0.0
  for example in examples:
    if example.qid in predictions:
      prediction = predictions[example.qid]
      exact += max(exact_match_score(prediction, text) for text, _ in example.answers)
      f1 += max(f1_score(prediction, text) for text, _ in example.answers)
  return {"exact_match": 100.0 * exact / len(examples), "f1": 100.0 * f1 / len(examples)}


def score_squad_v2(decoded: dict[str, SpanPrediction], examples: Sequence[SquadExample],
                   threshold: float) -> dict[str, float]:
  """evaluate-v2.0.py metrics at `threshold`, plus the best thresholds (see `SquadTask.evaluate`)."""
  has_answer = np.array([not e.is_impossible for e in examples])
  null_score_diffs = np.array([decoded[e.qid].null_score_diff for e in examples])
  answer_scores = np.array([_v2_scores(decoded[e.qid].best_text, e) for e in examples]).reshape(-1, 2)
  null_scores = np.array([_v2_scores("", e) for e in examples]).reshape(-1, 2)
  answered = null_score_diffs <= threshold
  scores = np.where(answered[:, None], answer_scores, null_scores)
  results = {"exact": 100.0 * scores[:, 0].mean(), "f1": 100.0 * scores[:, 1].mean(), "total": len(examples)}
  for prefix, subset in (("HasAns", has_answer), ("NoAns", ~has_answer)):
    if subset.any():
      results[f"{prefix}_exact"] = 100.0 * scores[subset, 0].mean()
      results[f"{prefix}_f1"] = 100.0 * scores[subset, 1].mean()
      results[f"{prefix}_total"] = int(subset.sum())
  for column, name in ((0, "exact"), (1, "f1")):
    best, best_threshold = _best_threshold(null_score_diffs, answer_scores[:, column], null_scores[:, column])
    results[f"best_{name}"] = best
    results[f"best_{name}_thresh"] = best_threshold
  return {key: float(value) for key, value in results.items()}


def _char_span_to_tokens(offsets: np.ndarray, char_start: int, char_end: int) -> tuple[int, int] | None:
  """First and last token overlapping characters [char_start, char_end), or None."""
  first = int(np.searchsorted(offsets[:, 1], char_start, side="right"))
  last = int(np.searchsorted(offsets[:, 0], char_end, side="left")) - 1
  return (first, last) if first <= last else None


def _top_positions(logits: np.ndarray, allowed: np.ndarray, count: int) -> np.ndarray:
  """Positions of the `count` highest logits among the allowed ones, best first."""
  positions = np.flatnonzero(allowed)
  order = np.argsort(-logits[positions], kind="stable")[:count]
  return positions[order]

