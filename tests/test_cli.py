"""The `bert-jax` entry point: help with examples, --version, unknown commands, one-line user errors."""

from __future__ import annotations

import pytest

from bert_jax import cli


def test_help_lists_every_command_with_examples(capsys):
  assert cli.main(["--help"]) == 0
  out = capsys.readouterr().out
  for command in cli.SUBCOMMANDS:
    assert f"  {command} " in out
  assert "examples:" in out and "bert-jax COMMAND --help" in out


def test_version(capsys):
  assert cli.main(["--version"]) == 0
  assert capsys.readouterr().out.startswith("bert-jax ")


def test_unknown_command_suggests_the_nearest_in_one_line_and_points_to_help(capsys):
  assert cli.main(["pretrian"]) == 2
  assert capsys.readouterr().err.splitlines() == [
      "bert-jax: error: unknown command 'pretrian'; did you mean `bert-jax pretrain`?",
      "Run `bert-jax --help` for the commands."]


@pytest.mark.parametrize("command,config", [("pretrain", "configs/demo.py"),
                                            ("finetune", "configs/finetune/glue.py:task=rte")])
def test_a_config_error_is_one_line_with_one_exit_code_in_every_command(command, config, tmp_path, capsys):
  args = [command, "--config", config, "--workdir", str(tmp_path / "run"), "--config.optim.lrr=1e-3"]
  assert cli.main(args) == 1
  err = capsys.readouterr().err
  assert err.startswith(f"bert-jax {command}: error: unknown config key 'optim.lrr'") and len(err.splitlines()) == 1
  assert cli.main([command, "--config", "configs/nowhere.py", "--workdir", str(tmp_path / "run")]) == 1
  assert capsys.readouterr().err == f"bert-jax {command}: error: config file configs/nowhere.py does not exist\n"


@pytest.mark.parametrize("command,config", [("pretrain", "configs/demo.py"),
                                            ("finetune", "configs/finetune/glue.py:task=rte")])
def test_help_points_to_the_config_keys_and_help_config_prints_them(command, config, capsys):
  with pytest.raises(SystemExit):
    cli.main([command, "--help"])
  assert "--config.KEY=VALUE" in capsys.readouterr().out
  assert cli.main([command, "--config", config, "--help-config", "--config.optim.lr=0.25"]) == 0
  out = capsys.readouterr().out
  assert f"bert-jax {command} --config" in out  # the docstring's launch command
  assert "keys (--config.KEY=VALUE):" in out and "lr: 0.25" in out


def test_ctrl_c_while_a_command_loads_is_one_line(monkeypatch, capsys):
  def interrupted(name):
    raise KeyboardInterrupt

  monkeypatch.setattr(cli.importlib, "import_module", interrupted)
  assert cli.main(["pretrain", "--config", "configs/demo.py"]) == 1
  assert capsys.readouterr().err == "bert-jax pretrain: error: stopped by Ctrl-C\n"


def test_fill_mask_without_a_mask_says_so(capsys, tmp_path):
  assert cli.main(["fill-mask", "--model", str(tmp_path), "A sentence without a mask."]) == 1
  assert "no [MASK] in 'A sentence without a mask.'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["pretrain", "finetune", "predict", "prepare", "sweep", "table", "plot",
                                     "quantize"])
def test_every_command_has_help(command, capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main([command, "--help"])
  assert exit_info.value.code == 0
  assert "usage: bert-jax" in capsys.readouterr().out


@pytest.mark.parametrize("override,message", [
    ("--config.train.batch_size=-8", "config.train.batch_size=-8 must be a positive integer"),
    ("--config.train.accum_steps=0", "config.train.accum_steps=0 must be a positive integer"),
])
def test_a_non_positive_batch_setting_is_named_before_anything_runs(override, message, tmp_path, capsys):
  assert cli.main(["pretrain", "--config", "configs/demo.py", "--workdir", str(tmp_path / "run"), override]) == 1
  err = capsys.readouterr().err
  assert message in err and "Traceback" not in err
  assert not (tmp_path / "run" / "checkpoints").exists()
