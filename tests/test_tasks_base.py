"""The task interface helpers: the HF tokenizer adapter, pair truncation, output shape checks."""

import numpy as np
import pytest
import tokenizers

from bert_jax.tasks import TASK_NAMES, get_task
from bert_jax.tasks.base import HFTokenizerAdapter, check_outputs, truncate_pair


def test_adapter_turns_off_truncation_and_padding(minilm_dir):
  wrapped = tokenizers.Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
  assert wrapped.truncation is not None and wrapped.padding is not None  # MiniLM pads/cuts to 128
  adapter = HFTokenizerAdapter(wrapped)
  text = " ".join(["antidisestablishmentarianism"] * 60)
  (ids,), (offsets,) = adapter.tokenize_with_offsets([text])
  assert len(ids) > 128 and adapter.pad_id not in ids and adapter.cls_id not in ids
  assert text[offsets[0][0]:offsets[-1][1]] == text
  assert wrapped.truncation is not None  # the caller's tokenizer is left alone
  assert (adapter.cls_id, adapter.sep_id, adapter.pad_id) == (101, 102, 0)
  with pytest.raises(ValueError, match="'<s>' is not in the tokenizer's vocabulary"):
    HFTokenizerAdapter(wrapped, cls_token="<s>")


def test_adapter_from_vocab_matches_tokenizer_json(minilm_dir):
  from_json = HFTokenizerAdapter(tokenizers.Tokenizer.from_file(str(minilm_dir / "tokenizer.json")))
  from_vocab = HFTokenizerAdapter.from_vocab_file(minilm_dir / "vocab.txt")
  texts = ["Denver's 1996-08-22 naïve Broncos!", "Peter Blackburn"]
  assert from_vocab.tokenize_with_offsets(texts) == from_json.tokenize_with_offsets(texts)


def test_truncate_pair_trims_the_longer_side():
  assert truncate_pair([1, 2, 3, 4, 5], [6, 7], 5) == ([1, 2, 3], [6, 7])
  assert truncate_pair([1, 2], [3, 4, 5, 6], 4) == ([1, 2], [3, 4])
  assert truncate_pair([1, 2, 3], [4, 5, 6], 4) == ([1, 2], [4, 5])


def test_check_outputs_catches_padded_batches():
  features = {"input_ids": np.zeros((3, 8), np.int32)}
  assert check_outputs(np.zeros((3, 8, 2)), features, (8, 2)).dtype == np.float32
  assert check_outputs(np.zeros((3, 5)), features, (-1,)).shape == (3, 5)
  with pytest.raises(ValueError, match=r"outputs have shape \(4, 8, 2\), expected \(3, 8, 2\)"):
    check_outputs(np.zeros((4, 8, 2)), features, (8, 2))


def test_every_task_describes_itself():
  expected_kinds = {"glue/stsb": "regression", "squad/v1.1": "span", "squad/v2.0": "span",
                    "swag": "multiple_choice", "conll2003": "tagging", "conll2003_chunk": "tagging"}
  for name in TASK_NAMES:
    task = get_task(name)
    assert task.name == name and task.kind == expected_kinds.get(name, "classification")
    assert task.selection_metric in task.metric_names and task.eval_splits
    assert task.num_labels == {"classification": len(task.labels), "tagging": len(task.labels),
                               "span": 2}.get(task.kind, 1)
  assert get_task("conll2003").num_labels == 9 and get_task("conll2003_chunk").labels == ("O", "B-NP", "I-NP")
  assert get_task("swag").num_choices == 4 and get_task("glue/mnli").num_labels == 3
