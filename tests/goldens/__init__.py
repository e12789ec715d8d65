"""What `transformers` computes, stored for the parity tests that run without PyTorch.

`make_goldens.py` (it needs the hf extra) writes them. Each tiny random model of every family is a folder NAME/
with the `config.json` transformers saved, the names and shapes of the tensors it saved (`tensors.json`) and its
outputs (`outputs.npz`); the real MiniLM's outputs are `minilm.npz`. The tiny models' weights are not stored:
`checkpoint` regenerates them from their names with NumPy's legacy generator, whose stream NumPy keeps fixed, and
writes the model.safetensors that transformers loaded and ran.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import zlib

import numpy as np
import safetensors.numpy

DIR = pathlib.Path(__file__).resolve().parent


def tensor(family: str, name: str, shape: tuple[int, ...]) -> np.ndarray:
  """The weight NAME of a tiny `family` model: normal, seeded by (family, name, shape). LayerNorm scales (the only
  1-D weights) lie around 1 and biases are not zero, so a scale or bias mapped to the wrong place shows."""
  rng = np.random.RandomState(zlib.crc32(f"{family}:{name}:{tuple(shape)}".encode()))
  values = rng.standard_normal(tuple(shape))
  if len(shape) == 1:
    values = 1 + 0.1 * values if name.endswith(".weight") else 0.05 * values
  else:
    values = 0.1 * values
  return values.astype(np.float32)


def manifest(name: str) -> dict:
  """{"family": ..., "tensors": {hugging face name: shape}} of the tiny model NAME."""
  return json.loads((DIR / name / "tensors.json").read_text())


def checkpoint(name: str, directory: str | pathlib.Path) -> pathlib.Path:
  """Writes the tiny model NAME into `directory` as transformers saved it: its config.json and model.safetensors."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  shutil.copyfile(DIR / name / "config.json", directory / "config.json")
  described = manifest(name)
  tensors = {key: tensor(described["family"], key, shape) for key, shape in described["tensors"].items()}
  safetensors.numpy.save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
  return directory


def outputs(name: str) -> dict[str, np.ndarray]:
  """The arrays of NAME/outputs.npz (or NAME.npz): inputs, transformers' outputs and gradients ("grad/TENSOR")."""
  path = DIR / name / "outputs.npz" if (DIR / name).is_dir() else DIR / f"{name}.npz"
  with np.load(path) as stored:
    return dict(stored)
