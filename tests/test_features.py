"""`bert-jax features`: per-token layer features match `transformers` on the real MiniLM."""

import numpy as np
import pytest

from bert_jax.analysis import features
from test_trainer import prepared  # noqa: F401 - the session fixture that `mlm_run` reads

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Who wrote it?\tThe paper was written by researchers at Google.",
    "Feature-based BERT feeds frozen vectors to a task model.",
    "Short one.",
    "A pair again\tand its second sentence, a little longer than the first.",
]


@pytest.fixture(scope="module")
def hf_minilm(minilm_dir):
  pytest.importorskip("torch", reason="runs transformers on PyTorch: the torch tier, pip install -e '.[test,hf]' "
                      "(tests/goldens hold its outputs for the default tier)")
  transformers = pytest.importorskip("transformers")
  tokenizers = pytest.importorskip("tokenizers")
  tokenizer = tokenizers.Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
  tokenizer.no_truncation()
  tokenizer.no_padding()
  model = transformers.BertModel.from_pretrained(minilm_dir, attn_implementation="eager").eval()
  return tokenizer, model


def hf_hidden_states(hf_minilm, line):
  import torch
  tokenizer, model = hf_minilm
  encoding = tokenizer.encode(*line.split("\t"))
  with torch.no_grad():
    outputs = model(input_ids=torch.tensor([encoding.ids]), token_type_ids=torch.tensor([encoding.type_ids]),
                    output_hidden_states=True)
  return encoding.tokens, [state[0].numpy() for state in outputs.hidden_states]


WIDTH = 384  # The MiniLM's hidden size.


def _features_of_sentences(minilm_dir, tmp_path, layers, concat):
  """`bert-jax features` of SENTENCES at `layers` with the MiniLM: the npz it writes, its dtype, layers and shape
  checked."""
  (tmp_path / "input.txt").write_text("\n".join(SENTENCES) + "\n")
  out = tmp_path / "features.npz"
  argv = ["--model", str(minilm_dir), "--input", str(tmp_path / "input.txt"), "--layers", ",".join(map(str, layers)),
          "--max-len", "64", "--batch-size", "2", "--out", str(out)]
  assert features.main(argv + (["--concat"] if concat else [])) == 0
  result = np.load(out)
  assert result["features"].dtype == np.float32 and list(result["layers"]) == layers
  per_token = (len(layers) * WIDTH,) if concat else (len(layers), WIDTH)
  assert result["features"].shape == (len(SENTENCES), result["lengths"].max()) + per_token
  return result


@pytest.mark.parametrize("concat", [False, True])
def test_features_match_transformers_hidden_states(minilm_dir, hf_minilm, tmp_path, concat):
  layers = [-1, -2, 0]
  result = _features_of_sentences(minilm_dir, tmp_path, layers, concat)
  for index, line in enumerate(SENTENCES):
    tokens, hidden_states = hf_hidden_states(hf_minilm, line)
    length = result["lengths"][index]
    assert length == len(tokens) and list(result["tokens"][index, :length]) == tokens
    assert not result["tokens"][index, length:].any() and not result["features"][index, length:].any()
    got = result["features"][index, :length].reshape(length, len(layers), WIDTH)
    for slot, layer in enumerate(layers):
      np.testing.assert_allclose(got[:, slot], hidden_states[layer], atol=1e-4)


@pytest.mark.parametrize("concat", [False, True])
@pytest.mark.slow
def test_features_match_golden_hidden_states(minilm_dir, tmp_path, concat):
  """The test above without PyTorch: transformers' tokens of every line and hidden states of two (a pair and a
  single), written by tests/goldens/make_goldens.py."""
  import goldens
  golden = goldens.outputs("minilm")
  layers = [int(layer) for layer in golden["features/layers"]]
  result = _features_of_sentences(minilm_dir, tmp_path, layers, concat)
  compared = 0
  for index in range(len(SENTENCES)):
    tokens = [token for token in golden["features/tokens"][index] if token]
    length = result["lengths"][index]
    assert length == len(tokens) and list(result["tokens"][index, :length]) == tokens
    assert not result["tokens"][index, length:].any() and not result["features"][index, length:].any()
    if f"features/hidden_{index}" in golden:
      got = result["features"][index, :length].reshape(length, len(layers), WIDTH)
      for slot in range(len(layers)):
        np.testing.assert_allclose(got[:, slot], golden[f"features/hidden_{index}"][slot], atol=1e-4)
      compared += 1
  assert compared == 2


def test_long_pairs_are_truncated_longest_first(minilm_dir, tmp_path):
  from bert_jax.data.tokenizers import load_tokenizer
  tokenizer = load_tokenizer(minilm_dir)
  first, second = "short question", " ".join(["word"] * 40)
  ids, segments = features.encode_line(tokenizer, "bert", f"{first}\t{second}", max_len=16)
  assert len(ids) == 16 and ids[0] == tokenizer.cls_id and ids[-1] == tokenizer.sep_id
  assert ids[1:3] == tokenizer.encode(first) and segments.count(0) == 4 and segments.count(1) == 12


def test_bucket_lengths():
  assert [features.bucket_length(n, 128) for n in (1, 8, 9, 33, 100, 128)] == [8, 8, 16, 64, 128, 128]
  assert features.bucket_length(90, 100) == 100


def test_a_pretraining_workdir_gives_its_checkpoints_encoder(mlm_run, tmp_path):
  """--model takes a pre-training run as `bert-jax analyze` does: the features are those of its newest checkpoint's
  encoder, with the run's own tokenizer."""
  import json

  from bert_jax.convert.params import encoder_params
  from bert_jax.data.tokenizers import load_tokenizer
  from bert_jax.models import ModelConfig
  from bert_jax.train import checkpoint as checkpoint_lib

  lines = tmp_path / "lines.txt"
  lines.write_text("the cat sat on the mat\nthe dog\tsat too\n")
  out = tmp_path / "run.npz"
  assert features.main(["--model", str(mlm_run), "--input", str(lines), "--layers", "-1", "--max-len", "16",
                        "--out", str(out)]) == 0
  config = ModelConfig(**json.loads((mlm_run / "model_config.json").read_text()))
  family = checkpoint_lib.read_run_config(mlm_run)["model"]["family"]
  _, params = checkpoint_lib.restore_params(mlm_run)
  tokenizer = load_tokenizer(mlm_run / "tokenizer")
  encoded = [features.encode_line(tokenizer, family, line, 16) for line in lines.read_text().splitlines()]
  expected = features.extract_features(config, encoder_params(params), encoded, [-1], 16, 2)
  np.testing.assert_allclose(np.load(out)["features"], expected, rtol=1e-5, atol=1e-5)
