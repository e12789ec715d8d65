"""Input pipeline: exact resume, host sharding, determinism, epochs, eval pass."""

import json

import numpy as np
import pytest

from bert_jax.data import batch as batch_lib
from bert_jax.data import pipeline
from bert_jax.data import prepare
from bert_jax.data import tokenizers

WORDS = "the cat dog sat ran on a mat big red blue green house tree car road sun moon star sky".split()


def random_corpus(rng, documents: int, max_sentences: int, max_words: int) -> str:
  """Corpus text: `documents` documents of 1 to max_sentences - 1 sentences of 2 to max_words - 1 of WORDS."""
  return "\n\n".join("\n".join(" ".join(rng.choice(WORDS, size=rng.integers(2, max_words))) + " ."
                                for _ in range(rng.integers(1, max_sentences)))
                      for _ in range(documents)) + "\n"


@pytest.fixture(scope="module")
def prepared_dir(tmp_path_factory, minilm_dir):
  """60 documents of 1-15 short sentences, 6 held out for eval."""
  directory = tmp_path_factory.mktemp("pipeline")
  (directory / "corpus.txt").write_text(random_corpus(np.random.default_rng(11), 60, 16, 16))
  prepare.prepare_corpus([str(directory / "corpus.txt")], tokenizers.load_tokenizer(minilm_dir / "vocab.txt"),
                         directory / "prepared", num_workers=0, eval_documents=6, log=lambda *_: None)
  return directory / "prepared"


def make(prepared_dir, **overrides):
  settings = dict(example_format="segment_pair", seq_len=48, batch_size=8, seed=1, block_documents=16)
  settings.update(overrides)
  return pipeline.pretraining_iterator(prepared_dir, **settings)


def take(iterator, steps):
  return [next(iterator) for _ in range(steps)]


def assert_same_batches(first, second):
  assert len(first) == len(second)
  for a, b in zip(first, second):
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], b[key], err_msg=key)
      assert (a[key].dtype, a[key].shape) == (b[key].dtype, b[key].shape), key


@pytest.mark.parametrize("example_format,packing", [("segment_pair", False), ("sop", True),
                                                    ("full_sentences", False), ("sentence_pair", True)])
def test_resume_continues_exactly(prepared_dir, example_format, packing):
  settings = dict(example_format=example_format, packing=packing, max_packs=3)
  with make(prepared_dir, **settings) as uninterrupted:
    reference = take(uninterrupted, 30)  # crosses several blocks and an epoch boundary
  assert reference[-1]["epoch"].max() >= 1
  with make(prepared_dir, **settings) as interrupted:
    take(interrupted, 13)
    state = json.loads(json.dumps(interrupted.get_state()))
  with make(prepared_dir, **settings) as resumed:
    resumed.set_state(state)
    assert_same_batches(take(resumed, 17), reference[13:])


@pytest.mark.slow
def test_worker_processes_give_the_same_batches_and_resume_with_any_count(prepared_dir):
  """For every format, 2 worker processes yield the batches of none, and a state saved with either resumes with
  the other (train, and the padded last batch of eval)."""
  for example_format, packing in [("segment_pair", False), ("sop", False), ("full_sentences", False),
                                  ("doc_sentences", False), ("single", True)]:
    settings = dict(example_format=example_format, packing=packing, max_packs=3)
    with make(prepared_dir, workers=0, **settings) as in_thread:
      reference = take(in_thread, 24)  # crosses blocks and an epoch boundary
    with make(prepared_dir, workers=2, **settings) as in_workers:
      assert_same_batches(take(in_workers, 10), reference[:10])
      state = in_workers.get_state()
    with make(prepared_dir, workers=0, **settings) as resumed:
      resumed.set_state(state)
      assert_same_batches(take(resumed, 14), reference[10:])
  with make(prepared_dir, split="eval", batch_size=10, workers=0) as whole, \
       make(prepared_dir, split="eval", batch_size=5, workers=2, process_index=1, process_count=2) as second_half:
    reference = list(whole)
    assert reference[-1]["sentence_weights"][5:, 0].min() == 0  # The padded rows reach the second process.
    assert_same_batches(list(second_half), [{k: v[5:] for k, v in batch.items()} for batch in reference])


def test_processes_split_the_global_batch(prepared_dir):
  with make(prepared_dir, batch_size=8) as single:
    global_batches = take(single, 12)
  with make(prepared_dir, batch_size=4, process_index=0, process_count=2) as first, \
       make(prepared_dir, batch_size=4, process_index=1, process_count=2) as second:
    for global_batch, part_0, part_1 in zip(global_batches, take(first, 12), take(second, 12)):
      assert not set(part_0["example_ids"]) & set(part_1["example_ids"])
      for key in global_batch:
        np.testing.assert_array_equal(np.concatenate([part_0[key], part_1[key]]), global_batch[key], err_msg=key)


def test_batches_follow_the_contract_and_ids_are_unique_per_epoch(prepared_dir):
  with make(prepared_dir, packing=True, max_packs=4) as iterator:
    batches = take(iterator, 40)
  seen = {}
  for batch in batches:
    batch_lib.validate_batch(batch)
    assert batch["input_ids"].shape == (8, 48) and batch["cls_positions"].shape == (8, 4)
    for example_id, epoch in zip(batch["example_ids"], batch["epoch"]):
      assert (epoch, example_id) not in seen
      seen[epoch, example_id] = True
  epochs = sorted({epoch for epoch, _ in seen})
  assert epochs[:2] == [0, 1]


def test_seeded_and_reshuffled_each_epoch(prepared_dir):
  with make(prepared_dir) as a, make(prepared_dir) as b, make(prepared_dir, seed=2) as c:
    first, second, other = take(a, 10), take(b, 10), take(c, 10)
  assert_same_batches(first, second)
  assert not np.array_equal(first[0]["input_ids"], other[0]["input_ids"])
  with make(prepared_dir, example_format="doc_sentences", batch_size=4) as iterator:
    rows_by_epoch = {0: [], 1: []}
    while len(rows_by_epoch[1]) < 12:
      batch = next(iterator)
      for row, epoch in zip(batch["input_ids"], batch["epoch"]):
        if epoch in rows_by_epoch:
          rows_by_epoch[epoch].append(row.tobytes())
  # doc_sentences draws nothing per example, so epochs differ only by the reshuffle.
  assert rows_by_epoch[0][:12] != rows_by_epoch[1][:12]
  assert set(rows_by_epoch[1][:12]) <= set(rows_by_epoch[0])


def test_eval_is_one_finite_pass_over_held_out_documents(prepared_dir):
  corpus = prepare.open_prepared(prepared_dir)
  held_out = corpus.split_documents("eval")
  held_out_tokens = sum(int(corpus.sentence_starts[corpus.document_starts[d + 1]] -
                            corpus.sentence_starts[corpus.document_starts[d]]) for d in held_out)
  with make(prepared_dir, split="eval", example_format="doc_sentences", batch_size=4) as iterator:
    batches = list(iterator)
  assert batches
  weights = np.concatenate([b["sentence_weights"][:, 0] for b in batches])
  real_tokens = sum(int(((b["special_mask"] == 0) * b["sentence_weights"][:, :1]).sum()) for b in batches)
  assert real_tokens == held_out_tokens  # every held-out token exactly once
  assert weights[:-4].all()  # only the last batch may hold padding rows
  ids = np.concatenate([b["example_ids"] for b in batches])
  assert len(set(ids.tolist())) == len(ids)
  with make(prepared_dir, split="eval", example_format="doc_sentences", batch_size=4) as again:
    assert_same_batches(list(again), batches)


def test_state_from_another_pipeline_is_refused(prepared_dir):
  with make(prepared_dir) as iterator:
    state = iterator.get_state()
  with make(prepared_dir, seq_len=64) as other, pytest.raises(ValueError, match="another pipeline"):
    other.set_state(state)


def _epoch_plans(prepared_dir, epochs, duplicates=None, block_documents=8):
  """[epoch] -> the row plans (examples, example id, epoch field) of that pass over the train split, in order."""
  corpus = prepare.open_prepared(prepared_dir)
  config = pipeline.formats.FormatConfig("segment_pair", 48)
  blocks = pipeline._EpochBlocks(corpus, corpus.split_documents("train"), block_documents, seed=1, shuffle=True)
  to_rows = pipeline._BlockRows(corpus, blocks, config, seed=1, shuffle=True, duplicates=duplicates)
  per_epoch = blocks.blocks_per_epoch
  return [[plan for block in range(epoch * per_epoch, (epoch + 1) * per_epoch) for plan in to_rows.plan(block)]
          for epoch in range(epochs)]


def test_static_copies_keep_their_examples_and_identity(prepared_dir):
  # BERT's static masking with dupe factor 2: epochs 0 and 2 train on copy 0, epochs 1 and 3 on copy 1. The
  # masking key is (seed, example id, epoch field), so an equal plan means an equal row and an equal mask.
  epochs = _epoch_plans(prepared_dir, 4, duplicates=2)
  for copy in (0, 1):
    assert sorted(epochs[copy], key=repr) == sorted(epochs[copy + 2], key=repr)
    assert epochs[copy] != epochs[copy + 2]  # Only the order of the blocks changes between passes over a copy.
    assert {plan.epoch for plan in epochs[copy]} == {copy}
  # The two copies are built independently (other pairs, other segment lengths).
  first, second = ({plan.examples for plan in epochs[copy]} for copy in (0, 1))
  assert len(first & second) < len(first) / 2


def test_dynamic_epochs_give_recurring_rows_a_new_identity(prepared_dir):
  epochs = _epoch_plans(prepared_dir, 2)
  identity = [{plan.examples: (plan.example_id, plan.epoch) for plan in plans} for plans in epochs]
  recurring = set(identity[0]) & set(identity[1])
  assert recurring  # Short documents make the same row in both epochs ...
  assert all(identity[0][row] != identity[1][row] for row in recurring)  # ... masked with another key.


def test_duplicates_must_be_a_positive_int(prepared_dir):
  with pytest.raises(ValueError, match="masking.dupe_factor"):
    make(prepared_dir, duplicates=0)
