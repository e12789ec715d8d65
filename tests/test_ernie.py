"""ERNIE 1.0's staged recipe (configs/ernie.py): each phase's masking granularity, and three tiny phases in a row,
each starting from the previous phase's parameters, on the built-in corpus with stand-in span marks."""

import shutil

import jax
import numpy as np
import pytest
from test_trainer import prepared  # noqa: F401  (a fixture: the built-in corpus, prepared once a run)

from bert_jax.data import batch as batch_lib
from bert_jax.data import prepare
from bert_jax.train import config_lib, trainer
from bert_jax.train.checkpoint import restore_params

NE_START, NE_INSIDE = batch_lib.span_marks("named_entity")
NP_START, NP_INSIDE = batch_lib.span_marks("noun_phrase")


def mark_copy(source, directory, kinds):
  """A copy of the prepared corpus `source` with stand-in spans of `kinds` (what `bert-jax mark-spans` writes):
  tokens whose id is a multiple of 5 are one-token entities; a token whose id is a multiple of 4 starts a noun
  phrase of it and the next token."""
  shutil.copytree(source, directory)
  corpus = prepare.open_prepared(directory)
  starts = corpus.shard_token_starts
  marks = []
  for first, last in zip(starts[:-1], starts[1:]):
    tokens = corpus.tokens(first, last)
    shard = np.zeros(len(tokens), np.uint8)
    if "named_entity" in kinds:
      shard[tokens % 5 == 0] |= NE_START | NE_INSIDE
    if "noun_phrase" in kinds:
      phrase = tokens % 4 == 0
      shard[phrase] |= NP_START | NP_INSIDE
      shard[1:][phrase[:-1]] |= NP_INSIDE
    marks.append(shard)
  prepare.write_spans(directory, marks, kinds, {"by": "tests/test_ernie.py"})
  return directory


def phase_config(phase, corpus, previous="", lr=None):
  overrides = ["--config.data.builtin=False", f"--config.data.prepared={corpus}"]
  if lr is not None:
    overrides.append(f"--config.optim.lr={lr}")
  arg = f"scale=tiny,phase={phase},steps=12" + (f",previous={previous}" if previous else "")
  return config_lib.load_config(f"configs/ernie.py:{arg}", overrides)


def test_each_phase_masks_at_its_granularity_and_names_its_start():
  for phase, granularity in ((1, "whole_word"), (2, "noun_phrase"), (3, "named_entity")):
    config = config_lib.load_config(f"configs/ernie.py:phase={phase}" + (",previous=runs/p" if phase > 1 else ""))
    assert config.masking.granularity == granularity
    assert config.train.init_from == (None if phase == 1 else "runs/p")
    assert (config.objective, config.data.format) == ("mlm+nsp", "segment_pair")
  tiny = [config_lib.load_config(f"configs/ernie.py:scale=tiny,phase={phase}" + (",previous=p" if phase > 1 else ""))
          for phase in (1, 2, 3)]
  assert [config.data.builtin for config in tiny] == [True, False, False]  # phase 1 builds the corpus
  assert [config.train.steps for config in tiny] == [60, 60, 60]
  with pytest.raises(config_lib.ConfigError, match=r"phase=2 starts from phase 1's parameters: give its workdir as "
                                                   r"previous=DIR"):
    config_lib.load_config("configs/ernie.py:phase=2")
  with pytest.raises(config_lib.ConfigError, match="with phase=1: phase 1 starts from scratch"):
    config_lib.load_config("configs/ernie.py:phase=1,previous=runs/p")
  with pytest.raises(config_lib.ConfigError, match="phase=4"):
    config_lib.load_config("configs/ernie.py:phase=4,previous=runs/p")


def test_a_phase_needs_its_kind_of_spans_marked(prepared, tmp_path):  # noqa: F811
  """The trainer refuses a phase whose corpus lacks the spans its granularity masks, naming them, before anything
  is compiled: phrase masking on an unmarked corpus, entity masking on one with noun phrases only."""
  with pytest.raises(ValueError, match="granularity='noun_phrase' needs noun_phrase spans"):
    trainer.train_and_evaluate(phase_config(2, prepared, previous="unused"), tmp_path / "p2")
  phrases_only = mark_copy(prepared, tmp_path / "phrases", ["noun_phrase"])
  with pytest.raises(ValueError, match="granularity='named_entity' needs named_entity spans"):
    trainer.train_and_evaluate(phase_config(3, phrases_only, previous="unused"), tmp_path / "p3")


@pytest.mark.slow
def test_three_phases_each_start_from_the_last(prepared, tmp_path):  # noqa: F811
  """Phase 1 trains (4 steps); phases 2 and 3 run at a zero learning rate, so each ends on the parameters it
  started from: phase 2's are exactly phase 1's, phase 3's exactly phase 2's, and neither is a fresh model's."""
  marked = mark_copy(prepared, tmp_path / "marked", list(batch_lib.SPAN_KINDS))
  workdirs = [tmp_path / f"p{phase}" for phase in (1, 2, 3)]
  result = trainer.train_and_evaluate(phase_config(1, marked), workdirs[0])
  assert result["step"] == 4 and np.isfinite(result["train"]["loss"])
  for phase in (2, 3):
    config = phase_config(phase, marked, previous=str(workdirs[phase - 2]), lr=0.0)
    result = trainer.train_and_evaluate(config, workdirs[phase - 1])
    assert result["step"] == 4 and np.isfinite(result["train"]["loss"])
  params = [restore_params(workdir)[1] for workdir in workdirs]
  for earlier, later in zip(params, params[1:]):
    jax.tree.map(np.testing.assert_array_equal, earlier, later)
  # Phase 1 moved away from the initialisation that every phase would start from on its own.
  initial = trainer.train_and_evaluate(phase_config(1, marked, lr=0.0), tmp_path / "fresh")
  assert initial["step"] == 4
  fresh = restore_params(tmp_path / "fresh")[1]
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(params[0])))
