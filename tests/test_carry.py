"""The carried MiniLM: float16 for the trip, a cut to its first layers where a call's files are tight, float32 back.
Stopping a call's sweep at its deadline ends its whole process group."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import safetensors.numpy

from bert_jax.convert.pretrained import load_pretrained
from bert_jax.experiments import carry


def test_a_carried_minilm_cut_to_two_layers_loads_as_the_first_two_layers_of_the_original(minilm_dir, tmp_path):
  carry.write_float16_model(minilm_dir, tmp_path / "out", layers=2)
  back = carry.float32_model(tmp_path / "out", tmp_path / "back")
  original = safetensors.numpy.load_file(minilm_dir / "model.safetensors")
  cut = safetensors.numpy.load_file(back / "model.safetensors")
  kept = {name for name in original if not name.startswith("encoder.layer.") or int(name.split(".")[2]) < 2}
  assert set(cut) == kept and any(name.startswith("encoder.layer.1.") for name in cut)
  for name, value in cut.items():
    expected = original[name]
    assert value.dtype == expected.dtype
    # Float16's rounding, relative to each tensor's largest value.
    np.testing.assert_allclose(value, expected, rtol=1e-3, atol=1e-3 * float(np.abs(expected).max()))
  loaded = load_pretrained(back)
  assert loaded.config.num_layers == 2 and loaded.config.hidden_size == 384
  with pytest.raises(ValueError, match="layers=7: the model has 6"):
    carry.write_float16_model(minilm_dir, tmp_path / "too_many", layers=7)


# A parent that starts a child as the term signal reaches it, then exits: the child never saw the signal.
_STARTS_A_CHILD_ON_TERM = """
import signal, subprocess, sys, time
def on_term(*_):
  subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  time.sleep(0.2)
  sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
time.sleep(60)
"""


def test_stop_ends_a_child_started_as_the_term_signal_went_out():
  process = subprocess.Popen([sys.executable, "-c", _STARTS_A_CHILD_ON_TERM], start_new_session=True,
                             stdout=subprocess.PIPE, text=True)
  assert process.stdout.readline().strip() == "ready"
  started = time.monotonic()
  carry.stop(process, grace=2.0)
  assert time.monotonic() - started < 10.0
  with pytest.raises(ProcessLookupError):
    os.killpg(process.pid, 0)
