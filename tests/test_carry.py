"""The carried MiniLM: float16 for the trip, a cut to its first layers where a call's files are tight, float32 back."""

import jax
import numpy as np
import pytest

from bert_jax.convert.pretrained import load_pretrained
from bert_jax.experiments import carry


def test_a_carried_minilm_cut_to_two_layers_loads_as_the_first_two_layers_of_the_original(minilm_dir, tmp_path):
  carry.write_float16_model(minilm_dir, tmp_path / "out", layers=2)
  back = carry.float32_model(tmp_path / "out", tmp_path / "back")
  original, cut = load_pretrained(minilm_dir), load_pretrained(back)
  assert (original.config.num_layers, cut.config.num_layers) == (6, 2)
  assert cut.config.replace(num_layers=6) == original.config
  flat = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(original.params)[0]}
  for path, leaf in jax.tree_util.tree_flatten_with_path(cut.params)[0]:
    expected = np.asarray(flat[jax.tree_util.keystr(path)], np.float32)
    # Float16's rounding, relative to each tensor's largest value.
    np.testing.assert_allclose(np.asarray(leaf), expected, rtol=1e-3, atol=1e-3 * float(np.abs(expected).max()))
  with pytest.raises(ValueError, match="layers=7: the model has 6"):
    carry.write_float16_model(minilm_dir, tmp_path / "too_many", layers=7)
