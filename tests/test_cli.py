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


@pytest.mark.parametrize("command", ["pretrain", "finetune", "prepare", "sweep", "table", "plot"])
def test_every_command_has_help(command, capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main([command, "--help"])
  assert exit_info.value.code == 0
  assert "usage: bert-jax" in capsys.readouterr().out
