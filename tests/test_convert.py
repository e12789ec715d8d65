"""Hugging Face conversion: parity with `transformers` for every family, export, round trips, errors."""

import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bert_jax.convert import (CheckpointError, build_model, detect_format, encoder_params, load_hf_checkpoint,
                              load_pretrained, save_hf_checkpoint, save_pretrained)
from bert_jax.convert.command import main as convert_main
from bert_jax.models import Encoder
from bert_jax.models.model import Pooler, ReplacedTokenHead

import goldens

try:  # the live tests run transformers on PyTorch (the hf extra); the golden tests below need neither
  import torch
  import transformers
except ImportError:
  torch = transformers = None
live = pytest.mark.skipif(torch is None, reason="runs transformers on PyTorch: the torch tier, pip install -e "
                          "'.[test,hf]' (tests/goldens hold its outputs for the default tier)")

VOCAB = 99
TOLERANCE = 1e-5
GRADIENT_TOLERANCE = 2e-6  # the tiny models' gradients are of order 0.1; float32 reorderings differ by about 1e-7
LENGTHS = (10, 7, 4)  # right padding in rows 1 and 2

TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=40, attn_implementation="eager")
HF_MODELS = {  # family -> (config class, pretraining class, base class, config overrides)
    "bert": ("BertConfig", "BertForPreTraining", "BertModel", {}),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", "RobertaModel",
                dict(pad_token_id=1, type_vocab_size=1, max_position_embeddings=42)),
    # ALBERT: E != H, 4 layers sharing 2 parameter groups, tanh GELU.
    "albert": ("AlbertConfig", "AlbertForPreTraining", "AlbertModel",
               dict(embedding_size=16, num_hidden_layers=4, num_hidden_groups=2, hidden_act="gelu_new")),
    "electra": ("ElectraConfig", "ElectraForPreTraining", "ElectraModel", dict(embedding_size=16)),
}
GENERATOR = dict(hidden_size=16, num_attention_heads=2, intermediate_size=24)
MINILM_SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Feature extraction with a frozen encoder.",
                    "BERT is pre-trained on unlabeled text."]


def hf_model(family, which="pretraining", seed=0, **overrides):
  config_class, pretraining_class, base_class, family_overrides = HF_MODELS[family]
  config = getattr(transformers, config_class)(**{**TINY, **family_overrides, **overrides})
  torch.manual_seed(seed)
  model_class = {"pretraining": pretraining_class, "base": base_class, "generator": "ElectraForMaskedLM"}[which]
  return getattr(transformers, model_class)(config).eval()


def electra_pair(seed=0):
  discriminator = hf_model("electra", seed=seed)
  generator = hf_model("electra", "generator", seed=seed + 1, **GENERATOR)
  # ELECTRA trains with one embedding table; released checkpoints hold equal copies.
  generator.electra.embeddings.load_state_dict(discriminator.electra.embeddings.state_dict())
  return discriminator, generator


def batch(config):
  rng = np.random.RandomState(0)
  ids = rng.randint(5, VOCAB, (len(LENGTHS), max(LENGTHS))).astype(np.int32)
  mask = (np.arange(ids.shape[1]) < np.array(LENGTHS)[:, None]).astype(np.int32)
  ids = np.where(mask == 1, ids, config.pad_token_id).astype(np.int32)
  segments = ((np.arange(ids.shape[1]) >= 5) & (mask == 1)).astype(np.int32) * (config.type_vocab_size > 1)
  return ids, segments, mask


def run_hf(model, ids, segments, mask):
  with torch.no_grad():
    return model(input_ids=torch.tensor(ids, dtype=torch.long), token_type_ids=torch.tensor(segments, dtype=torch.long),
                 attention_mask=torch.tensor(mask, dtype=torch.long), output_hidden_states=True)


def max_diff(ours, theirs, mask=None):
  diff = np.abs(np.asarray(ours, np.float32) - np.asarray(theirs))
  return float((diff[mask == 1] if mask is not None else diff).max())


def save_hf(model, directory):
  model.save_pretrained(directory)
  return directory


def assert_params_equal(tree_a, tree_b):
  assert jax.tree.structure(tree_a) == jax.tree.structure(tree_b)
  for a, b in zip(jax.tree.leaves(tree_a), jax.tree.leaves(tree_b)):
    np.testing.assert_array_equal(a, b)


def ours_pretraining(family, config, params, ids, segments, mask):
  positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  return build_model(config, params).apply({"params": params}, ids, positions, segment_ids=segments, pack_ids=mask)


@live
@pytest.mark.parametrize("family", ["bert", "roberta", "albert"])
def test_pretraining_heads_match_transformers(family, tmp_path):
  model = hf_model(family)
  got_family, config, params, _ = load_hf_checkpoint(save_hf(model, tmp_path))
  assert got_family == family
  ids, segments, mask = batch(config)
  ours = ours_pretraining(family, config, params, ids, segments, mask)
  theirs = run_hf(model, ids, segments, mask)
  diffs = {"hidden": max_diff(ours["hidden"], theirs.hidden_states[-1], mask)}
  diffs["mlm"] = max_diff(ours["mlm_logits"], theirs.logits if family == "roberta" else theirs.prediction_logits, mask)
  if family != "roberta":
    diffs["sentence"] = max_diff(ours["sentence_logits"][:, 0],
                                 theirs.seq_relationship_logits if family == "bert" else theirs.sop_logits)
  assert max(diffs.values()) < TOLERANCE, diffs


@live
@pytest.mark.parametrize("family", list(HF_MODELS))
def test_base_models_match_transformers(family, tmp_path):
  model = hf_model(family, "base")
  _, config, params, extras = load_hf_checkpoint(save_hf(model, tmp_path))
  assert ("pooler" in extras) == (family != "electra")
  ids, segments, mask = batch(config)
  ours = Encoder(config).apply({"params": params}, ids, segments, pack_ids=mask, output_hidden_states=True)
  theirs = run_hf(model, ids, segments, mask)
  for layer in range(config.num_layers + 1):
    assert max_diff(ours["hidden_states"][layer], theirs.hidden_states[layer], mask) < TOLERANCE


@live
def test_electra_discriminator_and_generator_match_transformers(tmp_path):
  discriminator, generator = electra_pair()
  family, config, params, extras = load_hf_checkpoint(save_hf(discriminator, tmp_path / "disc"),
                                                      save_hf(generator, tmp_path / "gen"))
  assert family == "electra" and extras["generator_config"].hidden_size == GENERATOR["hidden_size"]
  ids, segments, mask = batch(config)
  positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  model = build_model(config, params, extras["generator_config"])
  ours = model.apply({"params": params}, jnp.asarray(ids), positions, jnp.asarray(ids), segment_ids=segments,
                     pack_ids=mask, sample=False)
  corrupted = np.asarray(ours["corrupted_ids"])
  assert max_diff(ours["mlm_logits"], run_hf(generator, ids, segments, mask).logits, mask) < TOLERANCE
  theirs = run_hf(discriminator, corrupted, segments, mask)
  assert max_diff(ours["rtd_logits"], theirs.logits, mask) < TOLERANCE
  hidden = Encoder(config).apply({"params": encoder_params(params)}, corrupted, segments, pack_ids=mask)["hidden"]
  assert max_diff(hidden, theirs.hidden_states[-1], mask) < TOLERANCE


@live
def test_electra_discriminator_alone_keeps_its_head(tmp_path):
  discriminator = hf_model("electra")
  _, config, params, extras = load_hf_checkpoint(save_hf(discriminator, tmp_path / "hf"))
  assert "embeddings" in params and "rtd" in extras
  out = save_hf_checkpoint("electra", config, params, tmp_path / "out", extras=extras)
  reloaded = transformers.ElectraForPreTraining.from_pretrained(out[0])
  ids, segments, mask = batch(config)
  np.testing.assert_allclose(run_hf(reloaded, ids, segments, mask).logits.numpy(),
                             run_hf(discriminator, ids, segments, mask).logits.numpy(), atol=1e-6)


def _minilm_batch(minilm_dir):
  """The MiniLM checkpoint (config, params) and MINILM_SENTENCES through its own tokenizer: ids and mask, padded."""
  tokenizers = pytest.importorskip("tokenizers")
  family, config, params, extras = load_hf_checkpoint(minilm_dir)
  assert family == "bert" and (config.num_layers, config.hidden_size) == (6, 384) and "pooler" in extras
  tokenizer = tokenizers.Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
  tokenizer.no_truncation()
  tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
  encodings = tokenizer.encode_batch(MINILM_SENTENCES)
  return (config, params, np.array([e.ids for e in encodings], np.int32),
          np.array([e.attention_mask for e in encodings], np.int32))


def _export_and_reload(family, config, params, extras, out_dir, model_class):
  written = save_hf_checkpoint(family, config, params, out_dir, extras=extras)
  reloaded, info = getattr(transformers, model_class).from_pretrained(written[0], output_loading_info=True,
                                                                      attn_implementation="eager")
  assert not any(info.values()), info
  return written, reloaded.eval()


@live
@pytest.mark.parametrize("family", ["bert", "roberta", "albert"])
def test_export_loads_in_transformers_and_round_trips(family, tmp_path):
  model = hf_model(family, seed=1)
  _, config, params, extras = load_hf_checkpoint(save_hf(model, tmp_path / "hf"))
  written, reloaded = _export_and_reload(family, config, params, extras, tmp_path / "out", type(model).__name__)
  ids, segments, mask = batch(config)
  expected, got = run_hf(model, ids, segments, mask), run_hf(reloaded, ids, segments, mask)
  logits = "logits" if family == "roberta" else "prediction_logits"
  np.testing.assert_allclose(getattr(got, logits).numpy(), getattr(expected, logits).numpy(), atol=1e-6)
  _, config_again, params_again, _ = load_hf_checkpoint(written[0])
  assert config_again == config
  assert_params_equal(params, params_again)


@live
def test_electra_export_round_trips(tmp_path):
  discriminator, generator = electra_pair(seed=2)
  _, config, params, extras = load_hf_checkpoint(save_hf(discriminator, tmp_path / "disc"),
                                                 save_hf(generator, tmp_path / "gen"))
  written, reloaded = _export_and_reload("electra", config, params, extras, tmp_path / "out", "ElectraForPreTraining")
  assert written == [tmp_path / "out", tmp_path / "out" / "generator"]
  reloaded_generator = transformers.ElectraForMaskedLM.from_pretrained(written[1], attn_implementation="eager")
  ids, segments, mask = batch(config)
  np.testing.assert_allclose(run_hf(reloaded, ids, segments, mask).logits.numpy(),
                             run_hf(discriminator, ids, segments, mask).logits.numpy(), atol=1e-6)
  np.testing.assert_allclose(run_hf(reloaded_generator, ids, segments, mask).logits.numpy(),
                             run_hf(generator, ids, segments, mask).logits.numpy(), atol=1e-6)
  # load_pretrained picks up out/generator by itself.
  (family, _, params_again, _), extras_again = load_pretrained(written[0], return_extras=True)
  assert family == "electra" and extras_again["generator_config"] == extras["generator_config"]
  assert_params_equal(params, params_again)


@pytest.mark.parametrize("head", ["mlm", "all_tokens"])
@pytest.mark.slow
def test_electra_trees_of_the_table_5_objectives_save_in_our_format_and_refuse_hugging_face(tmp_path, head):
  """Replace MLM / All-Tokens MLM runs: the discriminator has an MLM head (and a copy gate), no RTD head."""
  from bert_jax.models import ElectraModel, electra_generator_config, model_config
  config = model_config("electra", "small", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                        intermediate_size=37, embedding_size=16, max_position_embeddings=40)
  generator_config = electra_generator_config(config, 0.5)
  ids = jnp.zeros((1, 4), jnp.int32)
  variables = ElectraModel(config, generator_config, head).init(
      {"params": jax.random.key(0), "sample": jax.random.key(1)}, ids, jnp.zeros((1, 2), jnp.int32), ids)
  params = jax.tree.map(np.asarray, nn.unbox(variables["params"]))
  assert build_model(config, params, generator_config).head == head
  save_pretrained(tmp_path / "ours", "electra", config, params, extras={"generator_config": generator_config})
  (_, _, params_again, _), _ = load_pretrained(tmp_path / "ours", return_extras=True)
  assert_params_equal(params, params_again)
  assert set(encoder_params(params)) == {"embeddings", "embedding_projection", "block_0", "block_1"}
  with pytest.raises(CheckpointError, match="replace_mlm or all_tokens_mlm: its discriminator has an MLM head"):
    save_hf_checkpoint("electra", config, params, tmp_path / "hf", extras={"generator_config": generator_config})


def test_our_format_round_trips_through_the_cli(tmp_path):
  hf_dir = goldens.checkpoint("bert", tmp_path / "hf")
  (hf_dir / "vocab.txt").write_text("".join(f"[unused{i}]\n" for i in range(VOCAB)))
  assert convert_main(["--from-hf", str(hf_dir), "--out", str(tmp_path / "ours")]) == 0
  assert detect_format(tmp_path / "ours") == "bert_jax"
  description = json.loads((tmp_path / "ours" / "bert_jax_config.json").read_text())
  assert description["model"] == "pretraining" and description["heads"] == ["mlm", "sentence"]
  family, config, params, tokenizer_path = load_pretrained(tmp_path / "ours")
  loaded_hf = load_pretrained(hf_dir)
  config_hf, params_hf, tokenizer_path_hf = loaded_hf.config, loaded_hf.params, loaded_hf.tokenizer_path
  assert family == "bert" and config == config_hf and tokenizer_path == tmp_path / "ours"
  assert (tokenizer_path / "vocab.txt").read_text() == (tokenizer_path_hf / "vocab.txt").read_text()
  assert_params_equal(params, params_hf)

  assert convert_main(["--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "back")]) == 0
  assert (tmp_path / "back" / "vocab.txt").exists()
  _, _, params_back, _ = load_hf_checkpoint(tmp_path / "back")
  assert_params_equal(params, params_back)


def test_save_pretrained_keeps_extras_and_checks_shapes(tmp_path):
  _, config, params, extras = load_hf_checkpoint(goldens.checkpoint("albert_base", tmp_path / "hf"))
  save_pretrained(tmp_path / "ours", "albert", config, params, extras=extras)
  (_, _, params_again, _), extras_again = load_pretrained(tmp_path / "ours", return_extras=True)
  assert_params_equal(params, params_again)
  assert_params_equal(extras["pooler"], extras_again["pooler"])
  with pytest.raises(CheckpointError, match="mis-shaped block_0/ffn/wi/kernel"):
    save_pretrained(tmp_path / "bad", "albert", config.replace(intermediate_size=8), params)


@live
def test_pretrained_tokenizer_matches_transformers_bert_model_on_minilm(minilm_dir):
  config, params, ids, mask = _minilm_batch(minilm_dir)
  segments = np.zeros_like(ids)
  model = transformers.BertModel.from_pretrained(minilm_dir, attn_implementation="eager").eval()
  theirs = run_hf(model, ids, segments, mask)
  ours = Encoder(config).apply({"params": params}, ids, segments, pack_ids=mask)
  assert max_diff(ours["hidden"], theirs.last_hidden_state, mask) < 1e-4


# ----------------------------------------------------------------------------- goldens
# transformers' outputs for the same models and inputs, written by tests/goldens/make_goldens.py: the parity above,
# checked without PyTorch. The weights are regenerated from their names into the files transformers loaded.


def exported_tensors(family, config, tree, directory, extras=None):
  """`tree` (params or their gradients) as the Hugging Face tensors our export writes, by name."""
  import safetensors.numpy
  written = save_hf_checkpoint(family, config, jax.tree.map(np.asarray, tree), directory, extras=extras)
  return {name: array for path in written for name, array in safetensors.numpy.load_file(
      path / "model.safetensors").items()}


def assert_gradients_match(golden, grads, atol):
  names = [key for key in golden if key.startswith("grad/")]
  assert names and all(key[5:] in grads for key in names), sorted(set(key[5:] for key in names) - set(grads))
  diffs = {key[5:]: float(np.abs(grads[key[5:]] - golden[key]).max()) for key in names}
  assert max(diffs.values()) < atol, {key: diff for key, diff in diffs.items() if diff >= atol}


@pytest.mark.parametrize("family", ["bert", "roberta", "albert"])
@pytest.mark.slow
def test_pretraining_heads_and_gradients_match_goldens(family, tmp_path):
  golden = goldens.outputs(family)
  got_family, config, params, _ = load_hf_checkpoint(goldens.checkpoint(family, tmp_path / "hf"))
  assert got_family == family
  ids, segments, mask = golden["ids"], golden["segments"], golden["mask"]

  def loss_and_outputs(params):
    ours = ours_pretraining(family, config, params, ids, segments, mask)
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(ours["mlm_logits"], golden["labels"])
    loss = (cross_entropy * mask).sum() / mask.sum()
    if "sentence_labels" in golden:
      loss += optax.softmax_cross_entropy_with_integer_labels(ours["sentence_logits"][:, 0],
                                                              golden["sentence_labels"]).mean()
    return loss, ours

  (loss, ours), grads = jax.value_and_grad(loss_and_outputs, has_aux=True)(params)
  hidden = Encoder(config).apply({"params": encoder_params(params)}, ids, segments, pack_ids=mask,
                                 output_hidden_states=True)["hidden_states"]
  diffs = {f"hidden_{layer}": max_diff(hidden[layer], golden["hidden_states"][layer], mask)
           for layer in range(config.num_layers + 1)}
  diffs["mlm"] = max_diff(ours["mlm_logits"], golden["mlm_logits"], mask)
  if family != "roberta":
    diffs["sentence"] = max_diff(ours["sentence_logits"][:, 0], golden["sentence_logits"])
  diffs["loss"] = abs(float(loss) - float(golden["loss"]))
  assert max(diffs.values()) < TOLERANCE, diffs
  assert_gradients_match(golden, exported_tensors(family, config, grads, tmp_path / "grads"), GRADIENT_TOLERANCE)


@pytest.mark.parametrize("family", list(HF_MODELS))
def test_base_models_match_goldens(family, tmp_path):
  golden = goldens.outputs(f"{family}_base")
  _, config, params, extras = load_hf_checkpoint(goldens.checkpoint(f"{family}_base", tmp_path))
  assert ("pooler" in extras) == (family != "electra")
  ids, segments, mask = golden["ids"], golden["segments"], golden["mask"]
  ours = Encoder(config).apply({"params": params}, ids, segments, pack_ids=mask, output_hidden_states=True)
  for layer in range(config.num_layers + 1):
    assert max_diff(ours["hidden_states"][layer], golden["hidden_states"][layer], mask) < TOLERANCE
  if "pooler" in extras:
    pooled = Pooler(config).apply({"params": extras["pooler"]}, ours["hidden"])[:, 0]
    assert max_diff(pooled, golden["pooler_output"]) < TOLERANCE


def test_electra_discriminator_and_generator_match_goldens(tmp_path):
  golden = goldens.outputs("electra_generator")
  family, config, params, extras = load_hf_checkpoint(goldens.checkpoint("electra", tmp_path / "disc"),
                                                      goldens.checkpoint("electra_generator", tmp_path / "gen"))
  assert family == "electra" and extras["generator_config"].hidden_size == GENERATOR["hidden_size"]
  ids, segments, mask = golden["ids"], golden["segments"], golden["mask"]
  positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  model = build_model(config, params, extras["generator_config"])
  ours = model.apply({"params": params}, jnp.asarray(ids), positions, jnp.asarray(ids), segment_ids=segments,
                     pack_ids=mask, sample=False)
  corrupted = np.asarray(ours["corrupted_ids"])
  np.testing.assert_array_equal(corrupted[mask == 1], golden["pair/corrupted_ids"][mask == 1])
  assert max_diff(ours["mlm_logits"], golden["pair/mlm_logits"], mask) < TOLERANCE
  assert max_diff(ours["rtd_logits"], golden["pair/rtd_logits"], mask) < TOLERANCE
  hidden = Encoder(config).apply({"params": encoder_params(params)}, corrupted, segments, pack_ids=mask)["hidden"]
  assert max_diff(hidden, golden["pair/hidden"], mask) < TOLERANCE


def test_electra_discriminator_alone_and_its_gradients_match_goldens(tmp_path):
  golden = goldens.outputs("electra")
  _, config, params, extras = load_hf_checkpoint(goldens.checkpoint("electra", tmp_path / "hf"))
  assert "embeddings" in params and "rtd" in extras
  ids, segments, mask = golden["ids"], golden["segments"], golden["mask"]

  def loss_and_logits(trees):
    hidden = Encoder(config).apply({"params": trees["encoder"]}, ids, segments, pack_ids=mask)["hidden"]
    logits = ReplacedTokenHead(config).apply({"params": trees["rtd"]}, hidden)
    loss = (optax.sigmoid_binary_cross_entropy(logits, golden["labels"]) * mask).sum() / mask.sum()
    return loss, logits

  (loss, logits), grads = jax.value_and_grad(loss_and_logits, has_aux=True)({"encoder": params, "rtd": extras["rtd"]})
  assert max_diff(logits, golden["rtd_logits"], mask) < TOLERANCE and abs(float(loss) - golden["loss"]) < TOLERANCE
  tensors = exported_tensors("electra", config, grads["encoder"], tmp_path / "grads", extras={"rtd": grads["rtd"]})
  assert_gradients_match(golden, tensors, GRADIENT_TOLERANCE)


@pytest.mark.parametrize("name", ["bert", "roberta", "albert", "bert_base", "roberta_base", "albert_base",
                                  "electra_base", "electra", "electra_pair"])
def test_export_writes_the_checkpoint_transformers_saved(name, tmp_path):
  """What transformers loads without missing or unexpected tensors (the live export tests), without PyTorch: our
  export of a loaded checkpoint holds the tensors transformers saved, by name and value, and its config agrees."""
  import safetensors.numpy
  names = ["electra", "electra_generator"] if name == "electra_pair" else [name]
  sources = [goldens.checkpoint(source, tmp_path / "hf" / source) for source in names]
  family, config, params, extras = load_hf_checkpoint(*sources)
  written = save_hf_checkpoint(family, config, params, tmp_path / "out", extras=extras)
  assert len(written) == len(sources)
  for source, out in zip(sources, written):
    theirs, ours = (safetensors.numpy.load_file(path / "model.safetensors") for path in (source, out))
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
      np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    their_config, our_config = (json.loads((path / "config.json").read_text()) for path in (source, out))
    # ALBERT's classifier_dropout_prob is exported as the hidden dropout: a setting for a head no checkpoint holds.
    differing = {key: value for key, value in our_config.items() if their_config.get(key, value) != value}
    assert differing.keys() <= {"classifier_dropout_prob"}, differing
  _, config_again, params_again, _ = load_hf_checkpoint(*written)
  assert config_again == config
  assert_params_equal(params, params_again)


@pytest.mark.slow
def test_minilm_hidden_states_and_gradients_match_goldens(minilm_dir, tmp_path):
  golden = goldens.outputs("minilm")
  config, params, ids, mask = _minilm_batch(minilm_dir)
  np.testing.assert_array_equal(ids, golden["ids"])
  segments = np.zeros_like(ids)

  def loss_and_hidden(params):
    hidden = Encoder(config).apply({"params": params}, ids, segments, pack_ids=mask)["hidden"]
    return ((hidden @ golden["direction"]) * mask).sum() / mask.sum(), hidden

  (loss, hidden), grads = jax.value_and_grad(loss_and_hidden, has_aux=True)(params)
  assert max_diff(hidden, golden["last_hidden"], mask) < 1e-4 and abs(float(loss) - golden["loss"]) < 1e-4
  assert_gradients_match(golden, exported_tensors("bert", config, grads, tmp_path / "grads"), 1e-4)


# ----------------------------------------------------------------------------- errors


def test_unknown_architecture_lists_supported_ones(tmp_path, capsys):
  goldens.checkpoint("bert_base", tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
  with pytest.raises(CheckpointError, match=r"unknown architecture \['GPT2LMHeadModel'\].*BertForPreTraining"):
    load_hf_checkpoint(tmp_path)
  assert convert_main(["--from-hf", str(tmp_path), "--out", str(tmp_path / "out")]) == 1
  assert "unknown architecture" in capsys.readouterr().err


def test_missing_and_mis_shaped_tensors_are_all_named(tmp_path):
  import safetensors.numpy
  goldens.checkpoint("bert", tmp_path)
  tensors = safetensors.numpy.load_file(tmp_path / "model.safetensors")
  del tensors["bert.encoder.layer.1.attention.self.key.weight"]
  tensors["cls.predictions.transform.dense.weight"] = np.zeros((32, 31), np.float32)
  tensors["cls.extra.weight"] = np.zeros(3, np.float32)
  safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(CheckpointError) as error:
    load_hf_checkpoint(tmp_path)
  message = str(error.value)
  assert "missing tensor encoder.layer.1.attention.self.key.weight" in message
  assert "tensor cls.predictions.transform.dense.weight has shape (32, 31), expected (32, 32)" in message
  assert "unexpected tensor cls.extra.weight" in message


def test_vocab_size_must_match_the_tokenizer(tmp_path):
  goldens.checkpoint("bert_base", tmp_path)
  (tmp_path / "vocab.txt").write_text("".join(f"w{i}\n" for i in range(50)))
  with pytest.raises(CheckpointError, match="vocab_size=99 but vocab.txt has 50 tokens"):
    load_hf_checkpoint(tmp_path)


@live
def test_pytorch_bin_loads_and_refuses_non_tensor_pickles(tmp_path):
  model = hf_model("bert", "base")
  model.config.architectures = ["BertModel"]
  model.config.to_json_file(tmp_path / "config.json")
  torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
  _, config, params, _ = load_hf_checkpoint(tmp_path)
  ids, segments, mask = batch(config)
  ours = Encoder(config).apply({"params": params}, ids, segments, pack_ids=mask)
  assert max_diff(ours["hidden"], run_hf(model, ids, segments, mask).last_hidden_state, mask) < TOLERANCE

  torch.save({**model.state_dict(), "payload": pathlib.Path("/etc/passwd")}, tmp_path / "pytorch_model.bin")
  with pytest.raises(CheckpointError, match="weights_only"):
    load_hf_checkpoint(tmp_path)


def test_export_refuses_options_transformers_lacks(tmp_path):
  _, config, params, _ = load_hf_checkpoint(goldens.checkpoint("bert_base", tmp_path / "hf"))
  with pytest.raises(CheckpointError, match="norm='pre'"):
    save_hf_checkpoint("bert", config.replace(norm="pre"), params, tmp_path / "out")
  _, albert, _, _ = load_hf_checkpoint(goldens.checkpoint("albert_base", tmp_path / "albert"))
  shared_attention = albert.replace(shared_sublayers="attention")
  encoder = Encoder(shared_attention).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
  with pytest.raises(CheckpointError, match="shared_sublayers='attention' .Hugging Face shares whole layers only"):
    save_hf_checkpoint("albert", shared_attention, jax.tree.map(np.asarray, nn.unbox(encoder)), tmp_path / "out2")


def test_electra_warns_when_generator_embeddings_differ(tmp_path):
  import safetensors.numpy
  generator = goldens.checkpoint("electra_generator", tmp_path / "gen")
  tensors = safetensors.numpy.load_file(generator / "model.safetensors")
  tensors["electra.embeddings.word_embeddings.weight"] += 1
  safetensors.numpy.save_file(tensors, generator / "model.safetensors", metadata={"format": "pt"})
  with pytest.warns(UserWarning, match="generator embeddings"):
    load_hf_checkpoint(goldens.checkpoint("electra", tmp_path / "disc"), generator)


def test_truncated_safetensors_is_one_line_naming_the_file(tmp_path, minilm_dir, capsys):
  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  for name in ("config.json", "vocab.txt"):
    (hf_dir / name).write_bytes((minilm_dir / name).read_bytes())
  with open(minilm_dir / "model.safetensors", "rb") as f:
    (hf_dir / "model.safetensors").write_bytes(f.read(1 << 20))
  assert convert_main(["--from-hf", str(hf_dir), "--out", str(tmp_path / "ours")]) == 1
  error = capsys.readouterr().err.strip()
  assert "\n" not in error and error.startswith(f"bert-jax convert: error: {hf_dir / 'model.safetensors'} is truncated")
  assert not (tmp_path / "ours").exists()

  # Our own format, as fine-tuning's init loads it.
  assert convert_main(["--from-hf", str(minilm_dir), "--out", str(tmp_path / "ours")]) == 0
  params_file = tmp_path / "ours" / "params.safetensors"
  params_file.write_bytes(params_file.read_bytes()[:4096])
  with pytest.raises(CheckpointError, match=rf"{params_file} is truncated or not a safetensors file"):
    load_pretrained(tmp_path / "ours")
