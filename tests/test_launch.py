"""Launch scripts: --dry-run prints the exact commands; bad arguments fail clearly.

gcloud, sbatch and srun are not needed: dry runs only print.
"""

import os
import pathlib
import shlex
import shutil
import subprocess

import pytest

LAUNCH = pathlib.Path(__file__).resolve().parents[1] / "launch"
BASH = shutil.which("bash")
TPU = ("--name", "pod1", "--zone", "us-central2-b", "--project", "my-proj")


def _launch(script, *args, cwd=None, env=None, check=True):
  """Runs a launch script with bash; returns (printed commands as argv lists, stderr)."""
  result = subprocess.run(
      [BASH, str(LAUNCH / script), *args], cwd=cwd, capture_output=True,
      text=True, timeout=30, env={**os.environ, **(env or {})})
  if check:
    assert result.returncode == 0, result.stderr
  commands = [shlex.split(line) for line in result.stdout.splitlines() if line.strip()]
  return commands, result.stderr, result.returncode


def _fails(script, *args, match, cwd=None, env=None):
  _, stderr, returncode = _launch(script, *args, cwd=cwd, env=env, check=False)
  assert returncode != 0
  assert match in stderr, stderr
  return stderr


def _flag(argv, name):
  """Value of --name=VALUE in argv."""
  values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
  assert len(values) == 1, argv
  return values[0]


def _remote(argv):
  """The remote shell command of a gcloud ssh; checks that it parses."""
  command = _flag(argv, "command")
  syntax = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
  assert syntax.returncode == 0, (command, syntax.stderr)
  return command


@pytest.fixture
def config_dir(tmp_path):
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "tiny.py").write_text("def get_config(arg=None): ...\n")
  return tmp_path


# launch/local.sh

def test_local_prints_the_pretrain_command(config_dir):
  commands, stderr, _ = _launch(
      "local.sh", "--dry-run", "configs/tiny.py:size=tiny", "/runs/a",
      "--config.optim.lr=1e-4", "--config.name=two words", cwd=config_dir)
  assert commands == [["python3", "-m", "bert_jax.cli", "pretrain",
                       "--config", "configs/tiny.py:size=tiny", "--workdir", "/runs/a",
                       "--config.optim.lr=1e-4", "--config.name=two words"]]
  assert "==> pretraining configs/tiny.py:size=tiny" in stderr


def test_local_uses_python_from_the_environment(config_dir):
  commands, _, _ = _launch("local.sh", "--dry-run", "configs/tiny.py", "w",
                           cwd=config_dir, env={"PYTHON": "/venv/bin/python"})
  assert commands[0][0] == "/venv/bin/python"


@pytest.mark.parametrize("args, match", [
    ((), "missing CONFIG"),
    (("configs/tiny.py",), "missing WORKDIR"),
    (("configs/nope.py", "w"), "config file 'configs/nope.py' does not exist"),
    (("configs/tiny.txt", "w"), "must be a Python config file"),
    (("configs/tiny.py", "w", "optim.lr=1"), "--config.KEY=VALUE"),
    (("--frobnicate", "configs/tiny.py", "w"), "unknown option '--frobnicate'"),
])
def test_local_argument_errors(config_dir, args, match):
  _fails("local.sh", "--dry-run", *args, match=match, cwd=config_dir)


def test_common_cannot_be_run_directly():
  _fails("common.sh", match="sourced")


# launch/tpu/tpu.sh

def test_tpu_create_spot_pod_slice():
  commands, stderr, _ = _launch("tpu/tpu.sh", "create", *TPU, "--accelerator-type", "v4-32",
                                "--spot", "--dry-run")
  assert commands == [["gcloud", "compute", "tpus", "tpu-vm", "create", "pod1",
                       "--zone=us-central2-b", "--project=my-proj", "--accelerator-type=v4-32",
                       "--version=tpu-ubuntu2204-base", "--spot"]]
  assert "creating TPU VM pod1 (v4-32, runtime tpu-ubuntu2204-base, spot)" in stderr


# Google's runtime for JAX on each generation (https://cloud.google.com/tpu/docs/runtimes): v6e v2-alpha-tpuv6e,
# v5p v2-alpha-tpuv5, v5e v2-alpha-tpuv5-lite, v4 and older tpu-ubuntu2204-base.
@pytest.mark.parametrize("accelerator, runtime", [
    ("v2-8", "tpu-ubuntu2204-base"), ("v3-32", "tpu-ubuntu2204-base"), ("v4-32", "tpu-ubuntu2204-base"),
    ("v5p-64", "v2-alpha-tpuv5"), ("v5litepod-16", "v2-alpha-tpuv5-lite"), ("v5e-8", "v2-alpha-tpuv5-lite"),
    ("v6e-8", "v2-alpha-tpuv6e")])
def test_tpu_create_runtime_follows_the_accelerator(accelerator, runtime):
  commands, _, _ = _launch("tpu/tpu.sh", "create", *TPU, "--accelerator-type", accelerator,
                           "--preemptible", "--dry-run")
  assert _flag(commands[0], "version") == runtime
  assert commands[0][-1] == "--preemptible"


def test_tpu_create_explicit_runtime():
  commands, _, _ = _launch("tpu/tpu.sh", "create", *TPU, "--accelerator-type", "v4-8",
                           "--version", "tpu-vm-v4-base", "--dry-run")
  assert _flag(commands[0], "version") == "tpu-vm-v4-base"
  assert "--spot" not in commands[0]


def test_tpu_setup_copies_the_checkout_to_every_worker_and_installs():
  commands, _, _ = _launch("tpu/tpu.sh", "setup", *TPU, "--dry-run")
  archive, scp, ssh = commands
  assert archive[:4] == ["git", "-C", str(LAUNCH.parent), "archive"]
  assert archive[-1] == "HEAD"
  tarball = _flag(archive, "output")
  assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]
  assert scp[5:7] == [tarball, "pod1:bert_jax.tar.gz"]
  assert "--worker=all" in scp
  assert ssh[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod1"]
  assert "--worker=all" in ssh
  remote = _remote(ssh)
  assert "tar -xzf ~/bert_jax.tar.gz -C ~/bert_jax" in remote
  assert 'uv venv --python 3.11 ~/bert_jax_venv' in remote
  assert '-e ".[tpu]"' in remote


def test_tpu_setup_from_a_git_repository():
  commands, _, _ = _launch("tpu/tpu.sh", "setup", *TPU, "--repo",
                           "https://github.com/me/bert_jax.git", "--ref", "v1", "--dry-run")
  (ssh,) = commands
  remote = _remote(ssh)
  assert "git clone https://github.com/me/bert_jax.git ~/bert_jax" in remote
  assert "checkout v1" in remote
  assert "--worker=all" in ssh


def test_tpu_run_starts_every_worker_in_the_background():
  commands, stderr, _ = _launch(
      "tpu/tpu.sh", "run", *TPU, "configs/bert.py:size=base", "gs://bucket/runs/base",
      "--config.optim.lr=1e-4", "--dry-run")
  (ssh,) = commands
  assert ssh[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod1"]
  assert {"--zone=us-central2-b", "--project=my-proj", "--worker=all"} <= set(ssh)
  remote = _remote(ssh)
  assert ("nohup ~/bert_jax_venv/bin/python -m bert_jax.cli pretrain --config "
          "configs/bert.py:size=base --workdir gs://bucket/runs/base --config.optim.lr=1e-4 "
          ">> ~/bert_jax_run.log 2>&1 < /dev/null &") in remote
  assert "echo $! > ~/bert_jax_run.pid" in remote
  assert "gs://bucket/runs/base" in stderr
  # The shorthand is the general form's pre-training command line.
  general, _, _ = _launch("tpu/tpu.sh", "run", *TPU, "--dry-run", "--", "pretrain", "--config",
                          "configs/bert.py:size=base", "--workdir", "gs://bucket/runs/base", "--config.optim.lr=1e-4")
  assert general == commands


def _program(ssh):
  """The bert-jax command line a `run` starts (argv after `python -m bert_jax.cli`)."""
  remote = _remote(ssh)
  started = remote.split("nohup ", 1)[1].split(" >> ", 1)[0]
  argv = shlex.split(started)
  assert argv[:3] == ["~/bert_jax_venv/bin/python", "-m", "bert_jax.cli"], argv
  return argv[3:]


def test_tpu_run_finetune_on_every_worker():
  (ssh,), stderr, _ = _launch(
      "tpu/tpu.sh", "run", *TPU, "--dry-run", "--", "finetune", "--config", "configs/finetune/glue.py:task=rte",
      "--config.init.model=gs://b/runs/base", "--config.data_dir=gs://b/glue", "--workdir", "gs://b/runs/rte",
      "--config.optim.lr=2e-5")
  assert "--worker=all" in ssh and ssh[5] == "pod1"
  assert _program(ssh) == ["finetune", "--config", "configs/finetune/glue.py:task=rte",
                           "--config.init.model=gs://b/runs/base", "--config.data_dir=gs://b/glue",
                           "--workdir", "gs://b/runs/rte", "--config.optim.lr=2e-5"]
  assert "bert-jax finetune on worker all of pod1" in stderr


_SWEEP = ("sweep", "--config", "configs/ablations/bert_table5.py:scale=gpu", "--workdir", "gs://b/t5",
          "--data-dir", "glue=gs://b/glue", "--config.data.prepared=gs://b/wiki")


def test_tpu_run_whole_sweep_then_collect_and_table_on_worker_0():
  (ssh,), _, _ = _launch("tpu/tpu.sh", "run", *TPU, "--dry-run", "--", *_SWEEP)
  assert "--worker=all" in ssh and _program(ssh) == list(_SWEEP)
  (collect,), _, _ = _launch("tpu/tpu.sh", "run", *TPU, "--dry-run", "--", "sweep", "--workdir", "gs://b/t5",
                             "--collect")
  assert "--worker=0" in collect and _program(collect) == ["sweep", "--workdir", "gs://b/t5", "--collect"]
  (table,), _, _ = _launch("tpu/tpu.sh", "run", *TPU, "--dry-run", "--", "table", "gs://b/t5", "--out",
                           "gs://b/t5/table")
  assert "--worker=0" in table and _program(table) == ["table", "gs://b/t5", "--out", "gs://b/t5/table"]


def test_tpu_run_sweep_one_row_a_slice():
  commands, _, _ = _launch("tpu/tpu.sh", "run", "--zone", "us-central2-b", "--project", "my-proj", "--slices",
                           "t5-a,t5-b,t5-c", "--first-row", "1", "--dry-run", "--", *_SWEEP,
                           env={"BERT_JAX_TPU_NAME": ""})
  assert [ssh[5] for ssh in commands] == ["t5-a", "t5-b", "t5-c"]
  for row, ssh in enumerate(commands, start=1):
    assert "--worker=all" in ssh
    assert _program(ssh) == [*_SWEEP, "--row-index", str(row)]


@pytest.mark.parametrize("data", [("--config.data.prepared=data/wiki",), ("--config.data_dir", "/data/glue"),
                                  ("--data-dir", "glue=data/glue"), ("--data-dir=/data/glue",)])
def test_tpu_run_refuses_local_data_on_a_multi_host_slice(data):
  args = ("run", *TPU, "--dry-run", "--", "finetune", "--config", "configs/finetune/glue.py",
          "--workdir", "gs://b/w", *data)
  stderr = _fails("tpu/tpu.sh", *args, match="is local: every worker of a multi-host slice reads it, so give a "
                                             "gs:// path")
  assert len([line for line in stderr.splitlines() if line.startswith("error:")]) == 1
  _fails("tpu/tpu.sh", "run", *TPU, "--accelerator-type", "v5p-32", *args[len(TPU) + 1:], match="is local")
  # One host (v4-8) reads its own disk; so does one worker.
  _launch("tpu/tpu.sh", "run", *TPU, "--accelerator-type", "v4-8", *args[len(TPU) + 1:])
  _launch("tpu/tpu.sh", "run", *TPU, "--worker", "0", *args[len(TPU) + 1:])


def test_tpu_create_and_delete_a_queued_resource():
  (spot,), stderr, _ = _launch("tpu/tpu.sh", "create", *TPU, "--accelerator-type", "v5p-32", "--queued", "--spot",
                               "--dry-run")
  assert spot == ["gcloud", "compute", "tpus", "queued-resources", "create", "pod1", "--node-id=pod1",
                  "--zone=us-central2-b", "--project=my-proj", "--accelerator-type=v5p-32",
                  "--runtime-version=v2-alpha-tpuv5", "--spot"]
  assert "queued resource is ACTIVE" in stderr
  (best,), _, _ = _launch("tpu/tpu.sh", "create", *TPU, "--accelerator-type", "v4-32", "--queued", "--best-effort",
                          "--dry-run")
  assert best[:5] == ["gcloud", "alpha", "compute", "tpus", "queued-resources"] and best[-1] == "--best-effort"
  (delete,), _, _ = _launch("tpu/tpu.sh", "delete", *TPU, "--queued", "--dry-run")
  assert delete == ["gcloud", "compute", "tpus", "queued-resources", "delete", "pod1", "--zone=us-central2-b",
                    "--project=my-proj", "--force", "--quiet"]


@pytest.mark.parametrize("workdir", ["/tmp/run", "runs/a", "gs://bucket-only", "s3://b/run"])
def test_tpu_run_needs_a_gcs_workdir(workdir):
  _fails("tpu/tpu.sh", "run", *TPU, "configs/bert.py", workdir, "--dry-run",
         match="workdir must be on GCS (gs://BUCKET/PATH)")


def test_tpu_logs_follows_worker_0_and_stop_and_delete():
  (logs,), _, _ = _launch("tpu/tpu.sh", "logs", *TPU, "--dry-run")
  assert "--worker=0" in logs
  assert _remote(logs) == "tail -n 100 -F ~/bert_jax_run.log"
  (logs,), _, _ = _launch("tpu/tpu.sh", "logs", *TPU, "--worker", "3", "--dry-run")
  assert "--worker=3" in logs
  (stop,), _, _ = _launch("tpu/tpu.sh", "stop", *TPU, "--dry-run")
  assert "--worker=all" in stop
  assert "kill $(cat ~/bert_jax_run.pid)" in _remote(stop)
  (delete,), _, _ = _launch("tpu/tpu.sh", "delete", *TPU, "--dry-run")
  assert delete == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "pod1",
                    "--zone=us-central2-b", "--project=my-proj", "--quiet"]


def test_tpu_name_zone_project_from_the_environment():
  (delete,), _, _ = _launch("tpu/tpu.sh", "delete", "--dry-run", env=dict(
      BERT_JAX_TPU_NAME="envpod", BERT_JAX_TPU_ZONE="europe-west4-a",
      BERT_JAX_TPU_PROJECT="envproj"))
  assert delete[5:8] == ["envpod", "--zone=europe-west4-a", "--project=envproj"]


@pytest.mark.parametrize("drop, match", [
    ("--name", "missing --name"), ("--zone", "missing --zone"),
    ("--project", "missing --project")])
def test_tpu_missing_location_arguments(drop, match):
  i = TPU.index(drop)
  args = TPU[:i] + TPU[i + 2:]
  env = {k: "" for k in ("BERT_JAX_TPU_NAME", "BERT_JAX_TPU_ZONE", "BERT_JAX_TPU_PROJECT")}
  _fails("tpu/tpu.sh", "delete", *args, "--dry-run", match=match, env=env)


@pytest.mark.parametrize("args, match", [
    (("create", *TPU), "missing --accelerator-type"),
    (("create", *TPU, "--accelerator-type", "v4"), "not of the form v4-32"),
    (("create", *TPU, "--accelerator-type", "v9-8"), "missing --version"),
    (("run", *TPU), "missing CONFIG, or -- COMMAND ARGS"),
    (("run", *TPU, "--", "teleport", "--workdir", "gs://b/w"), "'teleport' is not a bert-jax command"),
    (("run", *TPU, "--", "finetune", "--config", "configs/finetune/glue.py"), "missing --workdir"),
    (("run", *TPU, "--", "finetune", "--workdir", "/tmp/w"), "workdir must be on GCS"),
    (("run", *TPU, "--", "table"), "missing --workdir"),
    (("run", *TPU, "--slices", "a,b", "--", "pretrain", "--workdir", "gs://b/w"), "applies to 'sweep' only"),
    (("run", *TPU, "--slices", "a,b", "--", *_SWEEP, "--rows", "0,1"), "leave --rows and --row-index out"),
    (("create", *TPU, "--accelerator-type", "v4-32", "--queued", "--preemptible"), "not --preemptible"),
    (("create", *TPU, "--accelerator-type", "v4-32", "--best-effort"), "add --queued"),
    (("delete", *TPU, "--", "pretrain"), "belong to 'run'"),
    (("run", *TPU, "configs/bert.py"), "missing WORKDIR"),
    (("run", *TPU, "configs/bert.py", "gs://b/w", "lr=1"), "--config.KEY=VALUE"),
    (("setup", *TPU, "--ref", "main"), "--ref needs --repo"),
    (("logs", *TPU, "--worker", "all"), "--worker must be a worker number"),
    (("delete", *TPU, "extra"), "unexpected argument 'extra'"),
    (("create", *TPU, "--zone"), "--zone needs a value"),
    (("teleport", *TPU), "unknown command 'teleport'"),
])
def test_tpu_argument_errors(args, match):
  split = args.index("--") if "--" in args else len(args)  # after `--` the words are bert-jax's
  _fails("tpu/tpu.sh", *args[:split], "--dry-run", *args[split:], match=match)


def test_tpu_real_run_without_gcloud_says_so(tmp_path):
  # A PATH with only what the script needs before it looks for gcloud.
  (tmp_path / "dirname").symlink_to(shutil.which("dirname"))
  _fails("tpu/tpu.sh", "delete", *TPU, match="'gcloud' is not installed",
         env={"PATH": str(tmp_path)})


# launch/gpu

def test_slurm_sbatch_runs_one_srun_step(config_dir):
  commands, _, _ = _launch("gpu/slurm.sbatch", "--dry-run", "configs/tiny.py",
                           "/shared/runs/a", "--config.optim.lr=1e-4", cwd=config_dir)
  assert commands == [["srun", "--kill-on-bad-exit=1", "--cpu-bind=none", "python3", "-m",
                       "bert_jax.cli", "pretrain", "--config", "configs/tiny.py",
                       "--workdir", "/shared/runs/a", "--config.optim.lr=1e-4"]]


def test_slurm_sbatch_nvls_off_and_header(config_dir):
  commands, _, _ = _launch("gpu/slurm.sbatch", "--dry-run", "--nvls-off", "configs/tiny.py",
                           "/shared/runs/a", cwd=config_dir)
  assert commands[0][:3] == ["env", "NCCL_NVLS_ENABLE=0", "srun"]
  header = (LAUNCH / "gpu" / "slurm.sbatch").read_text()
  assert "#SBATCH --ntasks-per-node=8" in header and "#SBATCH --gpus-per-node=8" in header


def test_slurm_sbatch_outside_slurm_needs_sbatch(config_dir):
  env = {"SLURM_JOB_ID": ""}
  _fails("gpu/slurm.sbatch", "configs/tiny.py", "/shared/w", match="submit this script with sbatch",
         cwd=config_dir, env=env)
  stderr = _fails("gpu/slurm.sbatch", "--dry-run", "configs/tiny.py", match="missing WORKDIR",
                  cwd=config_dir)
  assert "Usage" in stderr or "--help" in stderr


_MULTINODE = ("--coordinator", "10.0.0.1:1234", "--num-processes", "4", "--process-id", "3")


def test_multinode_sets_the_explicit_environment(config_dir):
  commands, stderr, _ = _launch("gpu/multinode.sh", *_MULTINODE, "--local-device-ids", "0,1",
                                "--nvls-off", "--dry-run", "configs/tiny.py", "gs://b/run",
                                cwd=config_dir)
  assert commands == [[
      "env", "BERT_JAX_COORDINATOR=10.0.0.1:1234", "BERT_JAX_NUM_PROCESSES=4",
      "BERT_JAX_PROCESS_ID=3", "BERT_JAX_LOCAL_DEVICE_IDS=0,1", "NCCL_NVLS_ENABLE=0",
      "python3", "-m", "bert_jax.cli", "pretrain", "--config", "configs/tiny.py",
      "--workdir", "gs://b/run"]]
  assert "process 3 of 4" in stderr


@pytest.mark.parametrize("args, match", [
    (_MULTINODE[2:], "missing --coordinator"),
    (_MULTINODE[:2] + _MULTINODE[4:], "missing --num-processes"),
    (_MULTINODE[:4], "missing --process-id"),
    (("--coordinator", "10.0.0.1") + _MULTINODE[2:], "HOST:PORT"),
    (_MULTINODE[:4] + ("--process-id", "4"), "in 0..3"),
    (_MULTINODE + ("--local-device-ids", "0;1"), "comma-separated"),
])
def test_multinode_argument_errors(config_dir, args, match):
  _fails("gpu/multinode.sh", *args, "--dry-run", "configs/tiny.py", "gs://b/run",
         match=match, cwd=config_dir)
