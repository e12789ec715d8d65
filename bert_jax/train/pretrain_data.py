"""The corpus a pre-training run reads and what it is scored on: the prepared shards (or the built-in demo corpus,
built on first use), the checks a corpus must pass for the config, its batches on the mesh's devices, and the
held-out evaluation with its frequency baseline."""

from __future__ import annotations

import logging
import pathlib
import tempfile

from etils import epath
import jax
import ml_collections
import numpy as np

from bert_jax import paths
from bert_jax.data import batch as batch_lib
from bert_jax.data import pipeline
from bert_jax.data.masking import LINGUISTIC_GRANULARITIES
from bert_jax.parallel import distributed
from bert_jax.parallel import sharding as sharding_lib
from bert_jax.train import checkpoint as checkpoint_lib
from bert_jax.train import config_lib
from bert_jax.train import workdir as workdir_lib

log = logging.getLogger(__name__)


def prepare_data(config: ml_collections.ConfigDict, workdir: epath.Path) -> epath.Path:
  """Returns the prepared corpus directory; builds the built-in demo corpus on first use."""
  data = config.data
  if data.builtin:
    prepared = workdir / "builtin_corpus" / "prepared"
    if jax.process_index() == 0:
      if paths.is_remote(workdir):  # The text and vocabulary are built locally; the prepared corpus goes up.
        with tempfile.TemporaryDirectory(prefix="bert_jax-builtin-") as local:
          _build_builtin_corpus(config, pathlib.Path(local), prepared, workdir)
      else:
        _build_builtin_corpus(config, pathlib.Path(workdir) / "builtin_corpus", prepared, workdir)
    distributed.sync_global_devices("builtin_corpus")
    return prepared
  if not data.prepared:
    raise ValueError("config.data.prepared is not set: give a directory written by `bert-jax prepare` "
                     "(or set config.data.builtin=True for the built-in corpus)")
  return paths.as_path(data.prepared)


def _build_builtin_corpus(config: ml_collections.ConfigDict, root: pathlib.Path, prepared: epath.Path,
                          workdir: epath.Path) -> None:
  from bert_jax.data import builtin_corpus, prepare, tokenizers
  if paths.is_remote(prepared) and (prepared / prepare.MANIFEST).exists():
    return
  corpus, tokenizer_dir = root / "corpus.txt", root / "tokenizer"
  if not corpus.exists():
    builtin_corpus.build_builtin_corpus(corpus)
  if not (tokenizer_dir / "tokenizer.json").exists() and not (tokenizer_dir / "vocab.txt").exists():
    tokenizers.train_tokenizer("wordpiece", [str(corpus)], config.data.builtin_vocab_size, tokenizer_dir)
  # A changed split in a workdir with checkpoints is refused before the prepared corpus is touched.
  prepare.prepare_corpus([str(corpus)], tokenizer_dir, prepared, eval_fraction=config.data.eval_fraction,
                         seed=config.seed, log=log.info, before_write=lambda: _check_resume(config, workdir))


def _check_resume(config: ml_collections.ConfigDict, workdir: epath.Path) -> None:
  """Refuses a config other than the one the workdir's complete checkpoints were trained with."""
  if checkpoint_lib.complete_steps(workdir):
    workdir_lib.check_resume_config(workdir, config.to_dict(), defaults=config_lib.pretrain_defaults().to_dict())


def check_spans(corpus, granularity: str) -> None:
  """Linguistic masking needs its kind of spans marked in the prepared corpus."""
  if granularity in LINGUISTIC_GRANULARITIES and granularity not in corpus.span_kinds:
    tagger = f"--{batch_lib.TAGGER_OPTIONS[granularity]}"
    raise ValueError(f"config.masking.granularity={granularity!r} needs {granularity} spans marked in the prepared "
                     f"corpus {corpus.directory} (it has {list(corpus.span_kinds) or 'none'}); run `bert-jax "
                     f"mark-spans --prepared {corpus.directory} {tagger} TAGGER_WORKDIR` first")


def warn_single_sentence_documents(corpus, example_format: str) -> None:
  """Sentence-pair formats need multi-sentence documents; say so when most have one sentence."""
  if example_format not in ("segment_pair", "sop", "sso"):  # sentence_pair draws a random B for a lone sentence
    return
  sentences_per_document = np.diff(corpus.document_starts)
  single = float(np.mean(sentences_per_document == 1)) if len(sentences_per_document) else 0.0
  if single > 0.5:
    log.warning("%.0f%% of the documents in %s have a single sentence: %s examples from them cannot pair "
                "consecutive sentences (NSP always takes a random B, SOP and SSO split inside the sentence). Is the "
                "input one sentence per line with blank lines between documents?", 100 * single,
                corpus.directory, example_format)


def iterator(config, prepared_dir, split: str, batch_rows: int, mesh, num_epochs=None, workers=None,
              steps_per_call: int = 1):
  """The split's batches, already on the mesh's devices (put there by the prefetch thread)."""
  data = config.data
  # A call of several steps reads its batches at once: two calls' worth ahead, one ready and one being built.
  prefetch = max(data.prefetch, 2 * steps_per_call) if data.prefetch else 0
  return pipeline.pretraining_iterator(
      prepared_dir, split=split, example_format=data.format, seq_len=data.seq_len,
      batch_size=batch_rows // jax.process_count(), seed=config.seed, short_seq_prob=data.short_seq_prob,
      random_next_prob=data.random_next_prob, packing=data.packing, max_packs=data.max_packs,
      process_index=jax.process_index(), process_count=jax.process_count(), num_epochs=num_epochs,
      prefetch=prefetch, workers=workers,
      duplicates=None if config.masking.dynamic else config.masking.dupe_factor,
      place=lambda local: sharding_lib.global_batch(local, mesh))


def eval_batches(config, prepared_dir, mesh):
  """The held-out batches an evaluation reads (on the mesh's devices): one pass, at most config.train.eval_batches."""
  rows = config.train.eval_batch_size or config.train.batch_size
  # Without worker processes: a pass is short, and starting them would cost more than they save.
  with iterator(config, prepared_dir, "eval", rows, mesh, num_epochs=1, workers=0) as batches:
    for index, batch in enumerate(batches):
      if config.train.eval_batches and index >= config.train.eval_batches:
        return
      yield batch


def evaluate(eval_step, params, config, prepared_dir, mesh, objective) -> dict[str, float]:
  """One pass over (at most eval_batches of) the held-out documents."""
  sums: dict[str, float] = {}
  outputs = [eval_step(params, batch) for batch in eval_batches(config, prepared_dir, mesh)]
  for output in jax.device_get(outputs):  # One read of every batch's sums.
    for key, value in output.items():
      sums[key] = sums.get(key, 0.0) + float(value)
  results = {}
  for name in objective.weights:
    count = sums.get(f"{name}_count", 0.0)
    if count:
      results[f"{name}_loss"] = sums[f"{name}_loss"] / count
      results[f"{name}_accuracy"] = sums[f"{name}_correct"] / count
  for term in ("mlm", "lm"):
    if f"{term}_loss" in results:
      results[f"{term}_perplexity"] = float(np.exp(min(results[f"{term}_loss"], 50.0)))
  return results


def unigram_baseline(config, prepared_dir, mesh, objective, tokenizer) -> tuple[str, float]:
  """The best frequency guess at the held-out positions `evaluate` masks: always their most frequent answer.

  The guess is chosen with the answers in view, so it bounds every model that knows token frequencies only.

  Returns:
    (that token, its accuracy).
  """
  mask = jax.jit(objective.prepare)  # the same on-device masking, keyed by example, as the eval step
  counts = np.zeros(objective.model_config.vocab_size, np.float64)
  for batch in eval_batches(config, prepared_dir, mesh):
    inputs = mask(batch)
    counts += np.bincount(np.asarray(inputs["mlm_ids"]).ravel(), weights=np.asarray(inputs["mlm_weights"]).ravel(),
                          minlength=len(counts))[:len(counts)]
  most_frequent = int(np.argmax(counts))
  return tokenizer.convert_ids_to_tokens([most_frequent])[0], float(counts[most_frequent] / max(counts.sum(), 1.0))
