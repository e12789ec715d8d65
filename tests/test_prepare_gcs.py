"""Prepared corpora on Cloud Storage: `prepare --out gs://...` and the pipeline reading it, against a local emulator."""

import pathlib

import numpy as np
import pytest
from etils import epath

from bert_jax.data import pipeline
from bert_jax.data import prepare
from bert_jax.data import tokenizers

WORDS = "the cat dog sat ran on a mat big red blue green house tree car road sun moon star sky".split()


def _write_corpus(path, documents=30, seed=5):
  rng = np.random.default_rng(seed)
  text = "\n\n".join("\n".join(" ".join(rng.choice(WORDS, size=rng.integers(2, 12))) + " ."
                               for _ in range(rng.integers(1, 8)))
                     for _ in range(documents))
  path.write_text(text + "\n")
  return path


def _batches(prepared_dir, steps=3):
  with pipeline.pretraining_iterator(prepared_dir, example_format="segment_pair", seq_len=32, batch_size=4, seed=3,
                                     block_documents=8, prefetch=0) as iterator:
    return [next(iterator) for _ in range(steps)]


def test_a_corpus_prepared_on_gcs_gives_the_batches_of_a_local_one(gcs_bucket, tmp_path, minilm_dir, capsys):
  corpus = _write_corpus(tmp_path / "corpus.txt")
  vocab = str(minilm_dir / "vocab.txt")
  remote = f"{gcs_bucket}/prepared"
  argv = ["--input", str(corpus), "--tokenizer", vocab, "--num-workers", "0", "--eval-documents", "3"]
  assert prepare.main(argv + ["--out", remote]) == 0
  assert prepare.main(argv + ["--out", str(tmp_path / "local")]) == 0
  assert prepare.main(argv + ["--out", remote]) == 0
  assert "nothing to do" in capsys.readouterr().out
  assert not (tmp_path / "gs:").exists()  # nothing written to a local folder named after the URL

  local, cloud = prepare.open_prepared(tmp_path / "local"), prepare.open_prepared(remote)
  assert cloud.manifest["shards"] == local.manifest["shards"]
  assert cloud.load_tokenizer().fingerprint() == tokenizers.load_tokenizer(vocab).fingerprint()
  np.testing.assert_array_equal(cloud.split_documents("eval"), local.split_documents("eval"))
  for key in prepare.SHARD_ARRAYS:
    with (epath.Path(remote) / f"shard-00000.{key}.npy").open("rb") as f:
      np.testing.assert_array_equal(np.load(f), np.load(tmp_path / "local" / f"shard-00000.{key}.npy"))

  for from_cloud, from_local in zip(_batches(remote), _batches(tmp_path / "local")):
    assert from_cloud.keys() == from_local.keys()
    for key in from_local:
      np.testing.assert_array_equal(from_cloud[key], from_local[key], err_msg=key)


@pytest.mark.slow
def test_preparing_again_on_gcs_replaces_only_the_corpus(gcs_bucket, tmp_path, minilm_dir):
  corpus = _write_corpus(tmp_path / "corpus.txt")
  tokenizer = tokenizers.load_tokenizer(minilm_dir / "vocab.txt")
  out = epath.Path(gcs_bucket) / "prepared"
  prepare.prepare_corpus([str(corpus)], tokenizer, out, num_workers=0, shard_tokens=200, chunk_documents=4,
                         log=lambda *_: None)
  shards_before = len(prepare.open_prepared(out).manifest["shards"])
  (out / "NOTES.md").write_text("mine")
  prepare.prepare_corpus([str(corpus)], tokenizer, out, num_workers=0, shard_tokens=10_000, eval_documents=2,
                         log=lambda *_: None)
  reread = prepare.open_prepared(out)
  assert len(reread.manifest["shards"]) == 1 < shards_before and len(reread.split_documents("eval")) == 2
  assert sorted(p.name for p in out.iterdir()) == ["NOTES.md", "eval_documents.npy", "manifest.json"] + [
      f"shard-00000.{key}.npy" for key in sorted(prepare.SHARD_ARRAYS)] + ["tokenizer"]
  assert (out / "NOTES.md").read_text() == "mine"


def test_a_url_collapsed_by_pathlib_is_refused():
  with pytest.raises(ValueError, match=r"gs:/bucket/prepared looks like a Cloud Storage URL .* gs://bucket/prepared"):
    prepare.open_prepared(pathlib.Path("gs://bucket/prepared"))
