"""Local and gs:// paths through one type (bert_jax.paths): copies up and down, moves, the tokenizer and the
checkpoints' fallback on an emulated bucket."""

import numpy as np
import pytest

from bert_jax import paths


def test_local_paths_are_absolute_and_urls_whole(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert str(paths.as_path("runs/x")) == str(tmp_path / "runs" / "x")
  assert str(paths.as_path("gs://bucket/run")) == "gs://bucket/run"
  with pytest.raises(ValueError, match="gs:/bucket/run looks like a Cloud Storage URL that lost a slash"):
    paths.as_path("gs:/bucket/run")


def test_upload_copy_and_move_on_cloud_storage(tmp_path, gcs_bucket):
  local = tmp_path / "folder"
  (local / "sub").mkdir(parents=True)
  (local / "a.txt").write_text("a")
  (local / "sub" / "b.bin").write_bytes(b"\0\1")
  remote = paths.as_path(f"{gcs_bucket}/folder")
  paths.upload(local, remote)
  assert [str(p)[len(str(remote)):] for p in paths.files(remote)] == ["/a.txt", "/sub/b.bin"]
  with paths.local_copy(remote) as copy:
    assert (copy / "a.txt").read_text() == "a" and (copy / "sub" / "b.bin").read_bytes() == b"\0\1"
  moved = paths.as_path(f"{gcs_bucket}/elsewhere/folder")
  paths.move(remote, moved)
  assert not remote.exists() and (moved / "sub" / "b.bin").read_bytes() == b"\0\1"


def test_tokenizer_saves_to_and_loads_from_cloud_storage(gcs_bucket, minilm_dir):
  from bert_jax.data import tokenizers
  tokenizer = tokenizers.load_tokenizer(minilm_dir)
  saved = tokenizer.save(f"{gcs_bucket}/tokenizer")
  loaded = tokenizers.load_tokenizer(saved)
  assert loaded.fingerprint() == tokenizer.fingerprint()
  assert loaded.encode_batch(["Paris is in France."])[0] == tokenizer.encode_batch(["Paris is in France."])[0]


def test_unreadable_checkpoint_on_cloud_storage_is_set_aside(gcs_bucket):
  import jax
  import jax.numpy as jnp
  from bert_jax.train import checkpoint
  workdir = f"{gcs_bucket}/run"
  state = {"w": jnp.arange(8.0)}
  saver = checkpoint.Checkpointer(workdir, async_save=False)
  saver.save(1, state, {"position": 1})
  saver.save(2, jax.tree.map(lambda x: x + 1, state), {"position": 2})
  for path in paths.files(saver.directory / "2" / "state"):
    if "manifest" in path.name or path.name.endswith(".ocdbt") or "/d/" in str(path):
      path.write_bytes(b"\0" * 7)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  step, restored, data_state, _ = checkpoint.Checkpointer(workdir, async_save=False).restore_latest(abstract)
  assert step == 1 and data_state == {"position": 1} and np.array_equal(restored["w"], state["w"])
  set_aside = list((paths.as_path(workdir) / "corrupt_checkpoints").iterdir())
  assert [p.name.split("-")[0] for p in set_aside] == ["2"]
