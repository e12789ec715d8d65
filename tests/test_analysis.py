"""`bert-jax analyze`: attention patterns against `transformers` on the real MiniLM; head gates, importance and
pruning on tiny models."""

import numpy as np
import pytest

from bert_jax.analysis import attention

LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "Who wrote it?\tThe paper was written by researchers at Google, in 2018.",
    "Attention heads in the middle layers look at [SEP]; early ones look broadly.",
    "Short one.",
    "A pair again\tand its second sentence, a little longer than the first!",
]


@pytest.fixture(scope="module")
def minilm(minilm_dir):
  from bert_jax.convert.params import encoder_params
  from bert_jax.convert.pretrained import load_pretrained
  from bert_jax.data.tokenizers import load_tokenizer
  family, config, params, tokenizer_path = load_pretrained(minilm_dir)
  return family, config, encoder_params(params), load_tokenizer(tokenizer_path)


def reference_patterns(probs_khqq, tokens):
  """A per-token loop over one line's attention maps [layers, heads, T, T]."""
  punct = attention.punctuation_ids(tokens)
  is_cls = np.array([t == "[CLS]" for t in tokens])
  is_sep = np.array([t == "[SEP]" for t in tokens])
  length = len(tokens)
  sums = {name: np.zeros(probs_khqq.shape[:2]) for name in attention.PATTERNS}
  counts = dict.fromkeys(attention.PATTERNS, 0)
  for q in range(length):
    row = probs_khqq[:, :, q, :]
    sums["cls"] += row[..., is_cls].sum(-1)
    sums["sep"] += row[..., is_sep].sum(-1)
    sums["punct"] += row[..., punct].sum(-1)
    sums["self"] += row[..., q]
    sums["entropy"] += -(row * np.log(np.maximum(row, 1e-30))).sum(-1)
    for name in ("cls", "sep", "punct", "self", "entropy"):
      counts[name] += 1
    if q > 0:
      sums["prev"] += row[..., q - 1]
      counts["prev"] += 1
    if q < length - 1:
      sums["next"] += row[..., q + 1]
      counts["next"] += 1
  return sums, counts


def test_attention_patterns_match_transformers_attentions(minilm, minilm_dir):
  pytest.importorskip("torch", reason="runs transformers on PyTorch: the torch tier, pip install -e '.[test,hf]' "
                      "(tests/goldens hold its outputs for the default tier)")
  transformers = pytest.importorskip("transformers")
  tokenizers = pytest.importorskip("tokenizers")
  import torch

  from bert_jax.analysis.features import encode_line

  family, config, params, tokenizer = minilm
  hf_tokenizer = tokenizers.Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
  hf_tokenizer.no_truncation()
  hf_tokenizer.no_padding()
  model = transformers.BertModel.from_pretrained(minilm_dir, attn_implementation="eager").eval()
  vocab_tokens = tokenizer.convert_ids_to_tokens(list(range(config.vocab_size)))
  encoded = [encode_line(tokenizer, family, line, 64) for line in LINES]
  got = attention.attention_patterns(config, params, encoded, tokenizer.cls_id, tokenizer.sep_id,
                                     attention.punctuation_ids(vocab_tokens), max_len=64, batch_size=2)
  totals = {name: np.zeros((config.num_layers, config.num_heads)) for name in attention.PATTERNS}
  counts = dict.fromkeys(attention.PATTERNS, 0)
  for line, (ids, _) in zip(LINES, encoded):
    encoding = hf_tokenizer.encode(*line.split("\t"))
    assert encoding.ids == ids
    with torch.no_grad():
      outputs = model(input_ids=torch.tensor([encoding.ids]), token_type_ids=torch.tensor([encoding.type_ids]),
                      output_attentions=True)
    probs = np.stack([a[0].numpy() for a in outputs.attentions])
    sums, line_counts = reference_patterns(probs, encoding.tokens)
    for name in attention.PATTERNS:
      totals[name] += sums[name]
      counts[name] += line_counts[name]
  assert int(got["tokens"]) == counts["cls"] == sum(len(ids) for ids, _ in encoded)
  for name in attention.PATTERNS:
    np.testing.assert_allclose(got[name], totals[name] / counts[name], atol=2e-5, err_msg=name)
  # Clark et al. 2019: in the middle layers [SEP] and [CLS] draw much of the attention; the first layer looks
  # broadly (higher entropy).
  layer_means = {name: got[name].mean(axis=1) for name in attention.PATTERNS}
  special = layer_means["cls"] + layer_means["sep"]
  middle = slice(1, config.num_layers - 1)
  assert special[middle].max() > 0.4 and special[middle].mean() > special[0]
  assert layer_means["entropy"][0] > layer_means["entropy"][middle].mean()


@pytest.mark.slow
def test_attention_patterns_match_goldens(minilm):
  """The test above without PyTorch: transformers' pattern means over the same lines, written by
  tests/goldens/make_goldens.py with `reference_patterns`."""
  import goldens

  from bert_jax.analysis.features import encode_line

  golden = goldens.outputs("minilm")
  family, config, params, tokenizer = minilm
  vocab_tokens = tokenizer.convert_ids_to_tokens(list(range(config.vocab_size)))
  encoded = [encode_line(tokenizer, family, line, 64) for line in LINES]
  np.testing.assert_array_equal(np.concatenate([ids for ids, _ in encoded]), golden["attention/ids"])
  assert [len(ids) for ids, _ in encoded] == list(golden["attention/lengths"])
  got = attention.attention_patterns(config, params, encoded, tokenizer.cls_id, tokenizer.sep_id,
                                     attention.punctuation_ids(vocab_tokens), max_len=64, batch_size=2)
  assert int(got["tokens"]) == int(golden["attention/tokens"])
  for name in attention.PATTERNS:
    np.testing.assert_allclose(got[name], golden[f"attention/{name}"], atol=2e-5, err_msg=name)


def test_punctuation_ids():
  assert list(attention.punctuation_ids(["[CLS]", ".", ",", "##.", "Ġ!", "a", "a.", "[SEP]", "..."])) == [
      False, True, True, True, True, False, False, False, True]


# --- head gates, importance and pruning on a tiny model -------------------------------------------------------


def tiny_classifier(kernels="off", **overrides):
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  from bert_jax.models import model_config
  from bert_jax.tasks.finetune_model import FinetuneModel
  config = model_config("bert", "L3-H64", num_heads=4, vocab_size=97, max_position_embeddings=32,
                        intermediate_size=96, hidden_dropout=0.0, attention_dropout=0.0, kernels=kernels, **overrides)
  model = FinetuneModel(config, "classification", num_labels=3)
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(5, 97, (6, 12)), jnp.int32)
  lengths = np.array([12, 9, 7, 12, 4, 10])
  pack_ids = jnp.asarray(np.arange(12)[None, :] < lengths[:, None], jnp.int32)
  params = nn.unbox(model.init(jax.random.key(1), ids, pack_ids=pack_ids)["params"])
  return config, model, params, ids, pack_ids, lengths


@pytest.mark.parametrize("kernels", ["off", "auto"])
@pytest.mark.slow
def test_all_ones_head_mask_is_exact_and_the_tree_unchanged(kernels):
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  config, model, params, ids, pack_ids, _ = tiny_classifier(kernels)
  ones = jnp.ones((config.num_layers, config.num_heads))
  plain = model.apply({"params": params}, ids, pack_ids=pack_ids)
  gated = model.apply({"params": params}, ids, pack_ids=pack_ids, head_mask=ones)
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(gated))
  with_mask = nn.unbox(model.init(jax.random.key(1), ids, pack_ids=pack_ids, head_mask=ones)["params"])
  shapes = lambda tree: jax.tree.map(np.shape, tree)  # noqa: E731
  assert shapes(with_mask) == shapes(params)
  np.testing.assert_array_equal(np.asarray(with_mask["encoder"]["block_0"]["attention"]["query"]["kernel"]),
                                np.asarray(params["encoder"]["block_0"]["attention"]["query"]["kernel"]))


@pytest.mark.parametrize("kernels", ["off", "auto"])
def test_masking_a_head_equals_zeroing_its_slice_of_the_output_projection(kernels):
  import jax
  import jax.numpy as jnp
  config, model, params, ids, pack_ids, _ = tiny_classifier(kernels)
  mask = np.ones((config.num_layers, config.num_heads), np.float32)
  mask[1, 2] = mask[0, 0] = 0
  zeroed = jax.tree.map(np.array, params)
  zeroed["encoder"]["block_1"]["attention"]["output"]["kernel"][2] = 0
  zeroed["encoder"]["block_0"]["attention"]["output"]["kernel"][0] = 0
  masked = model.apply({"params": params}, ids, pack_ids=pack_ids, head_mask=jnp.asarray(mask))
  np.testing.assert_allclose(np.asarray(masked), np.asarray(model.apply({"params": zeroed}, ids, pack_ids=pack_ids)),
                             atol=1e-6)
  assert not np.allclose(np.asarray(masked), np.asarray(model.apply({"params": params}, ids, pack_ids=pack_ids)))


def tiny_task_data(**overrides):
  from bert_jax.analysis import heads
  from bert_jax.tasks.finetune_model import FinetuneObjective
  config, model, params, ids, _, lengths = tiny_classifier(**overrides)
  features = {"input_ids": np.asarray(ids), "segment_ids": np.zeros_like(np.asarray(ids)), "lengths": lengths,
              "labels": np.array([0, 1, 2, 1, 0, 2])}
  return heads.TaskData(config, FinetuneObjective(model, "classification"), params, None, [], features, batch_size=4)


def test_head_importance_matches_finite_differences():
  import jax

  from bert_jax.analysis import heads
  # A wide initialisation makes every head matter, so the gradients stand well above float32 rounding.
  data = tiny_task_data(initializer_range=0.3)
  mask = data.ones()
  mask[0, 1] = 0.5
  importance = heads.head_importance(data, mask)

  @jax.jit
  def loss(one, gates):
    inputs = {**data.objective.prepare(one), "head_mask": gates}
    return data.objective.forward(data.params, inputs, None, False)["task_loss"]

  def row_loss(row, gates):
    one = {k: v[row:row + 1] for k, v in data.features.items()}
    one.update(weights=np.ones(1, np.float32), seed=np.zeros(1, np.int32))
    return float(loss(one, gates))

  epsilon = 1e-2
  for layer, head in [(0, 1), (1, 3), (2, 0)]:
    differences = []
    for row in range(data.num_rows):
      up, down = mask.copy(), mask.copy()
      up[layer, head] += epsilon
      down[layer, head] -= epsilon
      differences.append(abs(row_loss(row, up) - row_loss(row, down)) / (2 * epsilon))
    assert np.mean(differences) > 1e-3
    np.testing.assert_allclose(importance[layer, head], np.mean(differences), rtol=2e-2)


@pytest.mark.parametrize("kernels", ["off", "auto"])
def test_pruned_model_equals_the_masked_model(kernels):
  import jax.numpy as jnp

  from bert_jax.analysis import heads
  from bert_jax.tasks.finetune_model import FinetuneModel
  config, model, params, ids, pack_ids, _ = tiny_classifier(kernels)
  keep = np.ones((config.num_layers, config.num_heads), bool)
  keep[0, [0, 2]] = keep[1, 3] = keep[2, [0, 1, 2]] = False
  pruned_config, pruned_encoder = heads.prune_heads(config, params["encoder"], keep)
  assert pruned_config.heads_per_layer == (2, 3, 1)
  pruned = {"encoder": pruned_encoder, "head": params["head"]}
  assert pruned_encoder["block_1"]["attention"]["query"]["kernel"].shape == (64, 3, 16)
  assert pruned_encoder["block_2"]["attention"]["output"]["kernel"].shape == (1, 16, 64)
  masked = model.apply({"params": params}, ids, pack_ids=pack_ids, head_mask=jnp.asarray(keep, jnp.float32))
  got = FinetuneModel(pruned_config, "classification", num_labels=3).apply({"params": pruned}, ids, pack_ids=pack_ids)
  np.testing.assert_allclose(np.asarray(got), np.asarray(masked), atol=1e-5)
  # Each of the 6 pruned heads takes its query, key and value kernels and biases and its output kernel rows.
  assert heads.count_params(params) - heads.count_params(pruned) == 6 * (3 * (64 * 16 + 16) + 16 * 64)
  assert pruned_config.num_params() == config.num_params() - 6 * (3 * (64 * 16 + 16) + 16 * 64)
  with pytest.raises(ValueError, match="every head of layer"):
    keep[1] = False
    heads.prune_heads(config, params["encoder"], keep)


def test_heads_per_layer_round_trips_through_json_and_checks_its_counts():
  import dataclasses
  import json

  from bert_jax.models import ModelConfig, model_config
  config = model_config("bert", "L3-H64", num_heads=4, heads_per_layer=[2, 4, 1])
  assert config.heads_per_layer == (2, 4, 1) and config.layer_heads(2) == 1
  assert ModelConfig(**json.loads(json.dumps(dataclasses.asdict(config)))) == config
  with pytest.raises(ValueError, match="heads_per_layer"):
    model_config("bert", "L3-H64", num_heads=4, heads_per_layer=[2, 5, 1])


# --- `bert-jax analyze` end to end on a tiny fine-tuned run -----------------------------------------------------

WORDS = [f"w{i}" for i in range(30)]


@pytest.fixture(scope="module")
def tiny_sst2_run(tmp_path_factory):
  """A 2-layer, 4-head BERT fine-tuned on generated SST-2 ('good' -> 1, 'bad' -> 0), its data folder."""
  import pathlib

  import flax.linen as nn
  import jax

  from bert_jax.convert import save_pretrained
  from bert_jax.models import Encoder, ModelConfig
  from bert_jax.tasks import finetune as finetune_lib
  from bert_jax.train import config_lib

  root = tmp_path_factory.mktemp("analyze")
  (root / "vocab").mkdir()
  (root / "vocab" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",",
                                                        "good", "bad", *WORDS]) + "\n")
  config = ModelConfig(vocab_size=39, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                       max_position_embeddings=64)
  params = nn.unbox(jax.jit(Encoder(config).init)(jax.random.key(0), np.zeros((1, 8), np.int32))["params"])
  model = save_pretrained(root / "model", "bert", config, jax.tree.map(np.asarray, params), root / "vocab")
  rng = np.random.default_rng(0)
  (root / "glue" / "SST-2").mkdir(parents=True)
  for split, count in (("train", 192), ("dev", 48)):
    rows = ["sentence\tlabel"]
    for _ in range(count):
      label = int(rng.integers(2))
      words = [str(w) for w in rng.choice(WORDS, 5)]
      words.insert(int(rng.integers(6)), "good" if label else "bad")
      rows.append(f"{' '.join(words)} .\t{label}")
    (root / "glue" / "SST-2" / f"{split}.tsv").write_text("\n".join(rows) + "\n")
  repo = pathlib.Path(__file__).resolve().parents[1]
  run_config = config_lib.load_config(str(repo / "configs/finetune/glue.py:task=sst2"), [
      f"--config.init.model={model}", f"--config.data_dir={root / 'glue'}", "--config.train.batch_size=16",
      "--config.train.eval_batch_size=16", "--config.max_len=16", "--config.optim.lr=3e-3", "--config.seeds=(1,)",
      "--config.train.epochs=4", "--config.train.eval_every=end", "--config.train.log_every=100"])
  finetune_lib.finetune(run_config, root / "run")
  return root / "run", root / "glue"


@pytest.mark.slow
def test_analyze_writes_the_report_and_a_pruned_model_that_evaluate_reads(tiny_sst2_run, tmp_path, capsys):
  import json

  from bert_jax import cli
  from bert_jax.tasks import evaluate as evaluate_lib
  run, _ = tiny_sst2_run
  out = tmp_path / "analysis"
  assert cli.main(["analyze", "--model", str(run), "--out", str(out), "--step", "0.25", "--prune-fraction", "0.25",
                   "--batch-size", "16"]) == 0
  printed = capsys.readouterr().out
  assert "heads: accuracy" in printed and "prune: 2 heads removed" in printed
  report = (out / "report.md").read_text()
  for section in ("## Attention patterns", "## Effective attention", "## Head importance and pruning",
                  "## Pruned model"):
    assert section in report
  for figure in ("attention_patterns.png", "sentence_attention.png", "effective_attention.png", "head_importance.png",
                 "disable_one_head.png", "pruning_curve.png"):
    assert (out / figure).stat().st_size > 1000 and f"]({figure})" in report
  results = json.loads((out / "results.json").read_text())
  heads = results["heads"]
  assert heads["base_score"] > 80  # the run learned the task
  assert [f for f, _ in heads["pruning_by_importance"]] == [0.0, 0.25, 0.5, 0.75]
  assert heads["pruning_by_importance"][0][1] == heads["base_score"] == heads["pruning_random"][0][1]
  assert np.shape(heads["importance"]) == np.shape(heads["disable_each"]) == (2, 4)
  assert np.all(np.asarray(heads["importance"]) > 0)
  prune = results["prune"]
  assert prune["heads_removed"] == 2 and sum(prune["heads_per_layer"]) == 6
  assert prune["params"][1] < prune["params"][0] and prune["max_output_difference"] < 1e-4
  assert prune["pruned_score"] == prune["masked_score"]
  rescored = evaluate_lib.evaluate_run(out / "pruned_model")
  assert rescored[1]["dev"]["accuracy"] == pytest.approx(prune["pruned_score"])


@pytest.mark.slow
def test_analyze_attention_only_on_a_model_directory_and_bad_requests(tiny_sst2_run, tmp_path, capsys):
  from bert_jax import cli
  run, _ = tiny_sst2_run
  model = run.parent / "model"
  text = tmp_path / "lines.txt"
  text.write_text("w1 w2 good w3 .\nw4 , w5\tbad w6 .\n")
  assert cli.main(["analyze", "--model", str(model), "--input", str(text), "--out", str(tmp_path / "a")]) == 0
  assert "## Head importance" not in (tmp_path / "a" / "report.md").read_text()
  assert cli.main(["analyze", "--model", str(model), "--out", str(tmp_path / "b")]) == 1
  assert "pass --input FILE" in capsys.readouterr().err
  conll = tmp_path / "conll"
  conll.mkdir()
  for name in ("eng.train", "eng.testa"):
    rows = ["-DOCSTART- -X- O O", ""]
    for index in range(12):
      rows += [f"w{index % 5} NN I-NP O", f"good JJ I-NP I-PER", ". . O O", ""]
    (conll / name).write_text("\n".join(rows) + "\n")
  assert cli.main(["analyze", "--model", str(model), "--out", str(tmp_path / "p"), "--only", "probe",
                   "--conll-dir", str(conll), "--probe-steps", "20"]) == 0
  assert "probes: best layer pos" in capsys.readouterr().out and (tmp_path / "p" / "probes.png").exists()
  assert cli.main(["analyze", "--model", str(model), "--input", str(text), "--out", str(tmp_path / "c"),
                   "--only", "heads"]) == 1
  assert "must be a fine-tuning workdir" in capsys.readouterr().err
  assert cli.main(["analyze", "--model", str(run), "--out", str(tmp_path / "d"), "--only", "heads",
                   "--metric", "f1"]) == 1
  assert "--metric 'f1': glue/sst2 reports accuracy" in capsys.readouterr().err


@pytest.mark.slow
def test_attention_patterns_of_a_pruned_model_leave_its_missing_heads_blank(tiny_sst2_run, tmp_path):
  from bert_jax.analysis import analyze
  run, _ = tiny_sst2_run
  pruned = tmp_path / "out" / "pruned_model"
  analyze.main(["--model", str(run), "--out", str(tmp_path / "out"), "--only", "prune", "--prune-fraction", "0.25"])
  results = analyze.analyze(analyze._parser().parse_args(["--model", str(pruned), "--out", str(tmp_path / "again"),
                                                         "--only", "attention"]))
  cls = np.array(results["attention"]["cls"], dtype=float)
  assert np.isnan(cls).sum() == 2 and np.all(np.isfinite(cls[~np.isnan(cls)]))


# --- effective attention -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_effective_attention_leaves_the_layer_output_unchanged(norm):
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  from bert_jax.analysis import effective
  from bert_jax.models import Encoder, ModelConfig
  from bert_jax.models.model import SelfAttention
  config = ModelConfig(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                       max_position_embeddings=64, kernels="off", norm=norm, initializer_range=0.3)
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 50, (1, 24)), jnp.int32)
  params = nn.unbox(Encoder(config).init(jax.random.key(0), ids)["params"])
  outputs = Encoder(config).apply({"params": params}, ids, output_attentions=True, output_hidden_states=True)
  positions = jnp.arange(24)[None]
  for layer in range(config.num_layers):
    block = params[f"block_{layer}"]
    x = outputs["hidden_states"][layer]
    if norm == "pre":
      x = nn.LayerNorm(config.layer_norm_eps, use_fast_variance=False).apply({"params": block["attention_norm"]}, x)
    expected, _ = SelfAttention(config).apply({"params": block["attention"]}, x, None, positions, False, True, False)
    probs = np.asarray(outputs["attentions"][layer][0], np.float64)
    transforms = effective.value_output_transforms(config, params, np.asarray(outputs["hidden_states"][layer][0]),
                                                   layer)
    effective_hqk = effective.effective_attention(probs, transforms)
    # 24 keys, head size 8: a 16-dimensional null space per head that effective attention removes.
    assert np.abs(effective_hqk - probs).max() > 1e-2
    bias = np.asarray(block["attention"]["output"]["bias"])
    np.testing.assert_allclose(np.einsum("hqk,hke->qe", effective_hqk, transforms) + bias, np.asarray(expected[0]),
                               atol=1e-4)
    np.testing.assert_allclose(np.einsum("hqk,hke->qe", probs, transforms) + bias, np.asarray(expected[0]), atol=1e-4)


def test_effective_attention_of_a_short_line_is_the_raw_attention():
  from bert_jax.analysis import effective
  rng = np.random.default_rng(0)
  probs = rng.dirichlet(np.ones(5), size=(2, 5))
  transforms = rng.normal(size=(2, 5, 12))  # full row rank: no null space
  np.testing.assert_allclose(effective.effective_attention(probs, transforms), probs, atol=1e-10)


# --- layer-wise probing --------------------------------------------------------------------------------------------


def test_probes_on_random_features_stay_near_chance_and_learn_informative_ones():
  from bert_jax.analysis import probe
  rng = np.random.default_rng(0)
  labels = [str(label) for label in rng.integers(0, 4, 1200)]
  noise = rng.normal(size=(1200, 2, 32)).astype(np.float32)
  informative = noise.copy()
  informative[:, 1, :4] += 3 * np.eye(4)[[int(label) for label in labels]]  # layer 1 carries the tag
  results = probe.probe_layers(informative[:800], labels[:800], informative[800:], labels[800:], steps=200)
  assert results["classes"] == 4 and 20 <= results["majority"] <= 32
  assert abs(results["accuracy"][0] - 25) < 8  # random features: chance is 25%
  assert results["accuracy"][1] > 90


@pytest.mark.slow
def test_probes_read_the_conll_columns(minilm, shared_data, tmp_path):
  from bert_jax.analysis import probe
  family, config, params, tokenizer = minilm
  del family
  results = probe.run_probes(config, params, tokenizer, shared_data / "conll2003", 40, 20, max_len=64, steps=100)
  assert results["train_words"] > 300 and len(results["pos"]["accuracy"]) == config.num_layers + 1
  for task in ("pos", "chunk"):  # NER's majority tag (O) is hard to beat from a few dozen sentences
    assert max(results[task]["accuracy"]) > results[task]["majority"] + 20
  assert max(results["ner"]["accuracy"]) >= results["ner"]["majority"] - 5
  markdown, summary = probe.probe_markdown(results)
  assert "| pos |" in markdown and summary.startswith("probes: best layer pos")
  assert probe.write_figure(results, tmp_path).stat().st_size > 1000
