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


def test_unknown_command_suggests_the_nearest(capsys):
  assert cli.main(["pretrian"]) == 2
  assert "did you mean `bert-jax pretrain`?" in capsys.readouterr().err


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
