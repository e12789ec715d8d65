#!/usr/bin/env bash
# Cloud TPU VM (single host or pod slice): create, set up, run, follow, stop, delete.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

# Google's runtime (software version) for JAX on each TPU generation, https://cloud.google.com/tpu/docs/runtimes:
# the one table `create` reads its default --version from (tests/test_launch.py checks it against Google's).
RUNTIMES="v2 tpu-ubuntu2204-base
v3 tpu-ubuntu2204-base
v4 tpu-ubuntu2204-base
v5p v2-alpha-tpuv5
v5litepod v2-alpha-tpuv5-lite
v5e v2-alpha-tpuv5-lite
v6e v2-alpha-tpuv6e"

USAGE="Usage: launch/tpu/tpu.sh COMMAND [options] [--dry-run]

Commands:
  create  --name N --zone Z --project P --accelerator-type T [--version RUNTIME]
          [--spot | --preemptible] [--queued [--spot | --best-effort]]
          Create the TPU VM (a pod slice when T has several hosts, e.g. v4-32).
          RUNTIME defaults from T's generation (Google's table):
            ${RUNTIMES//$'\n'/$'\n'            }
          --queued asks through a queued resource of the same name, which waits
          for capacity (gcloud compute tpus queued-resources create); with
          --spot or --best-effort (the alpha command) for preemptible capacity.
  setup   --name N --zone Z --project P [--repo URL [--ref REF]] [--python VERSION]
          Install the project on every worker into ~/bert_jax (venv
          ~/bert_jax_venv, pip install -e '.[tpu]' through uv). Without --repo,
          copies this checkout's HEAD (git archive; uncommitted changes are
          not included); with --repo, git clones URL at REF on every worker.
  run     --name N --zone Z --project P [--worker W] [--accelerator-type T] -- COMMAND ARGS...
          Start 'bert-jax COMMAND ARGS...' (pretrain, finetune, sweep, table, ...)
          on all workers at once (table and sweep --collect: worker 0), in the
          background (nohup), appending to ~/bert_jax_run.log on each worker.
          --workdir must be gs://; in a multi-host slice (T with more than 8,
          e.g. v4-32; asked of gcloud when not given) so must
          --config.data.prepared, --config.data_dir and --data-dir.
          A config is relative to the repository root. Re-running with the
          same workdir resumes (also after preemption).
          sweep: --slices A,B,... runs one row on each of those TPU VMs
          (row --first-row + i on the i-th; default 0), else the whole sweep.
  run     --name N --zone Z --project P CONFIG gs://BUCKET/WORKDIR [--config.KEY=VALUE ...]
          Short for: run -- pretrain --config CONFIG --workdir gs://BUCKET/WORKDIR ...
  logs    --name N --zone Z --project P [--worker W] [--lines L]
          Follow worker W's log (default worker 0, last 100 lines).
  stop    --name N --zone Z --project P
          Stop the run on every worker (SIGTERM to the recorded pid).
  delete  --name N --zone Z --project P [--queued]
          Delete the TPU VM (--queued: its queued resource, and the VM with it).

--name, --zone and --project default to \$BERT_JAX_TPU_NAME, \$BERT_JAX_TPU_ZONE
and \$BERT_JAX_TPU_PROJECT. --dry-run prints the exact commands without running them."
USAGE_HINT="Run 'launch/tpu/tpu.sh --help' for usage."

REMOTE_DIR='~/bert_jax'
REMOTE_VENV='~/bert_jax_venv'
REMOTE_LOG='~/bert_jax_run.log'
REMOTE_PID='~/bert_jax_run.pid'

if (( $# == 0 )); then
  echo "$USAGE" >&2
  exit 2
fi
command="$1"
shift
# Everything after `--` is the bert-jax command line, untouched by the option loop.
script_args=()
bert_jax_args=()
while (( $# )); do
  if [[ "$1" == -- ]]; then
    shift
    bert_jax_args=("$@")
    has_command_line=1
    break
  fi
  script_args+=("$1")
  shift
done
case "$command" in
  -h|--help) echo "$USAGE"; exit 0 ;;
  create|setup|run|logs|stop|delete) ;;
  *) die "unknown command '$command' (expected create, setup, run, logs, stop or delete)" ;;
esac

name="${BERT_JAX_TPU_NAME:-}"
zone="${BERT_JAX_TPU_ZONE:-}"
project="${BERT_JAX_TPU_PROJECT:-}"
accelerator_type=""
version=""
provisioning=""
repo=""
ref=""
python_version="3.11"
worker=""
lines="100"
queued=""
slices=""
first_row="0"
accelerator_type="${BERT_JAX_TPU_ACCELERATOR_TYPE:-}"
parse_options "--name= --zone= --project= --accelerator-type= --version= --repo= --ref= --python=python_version=
               --worker= --lines= --spot=provisioning --preemptible=provisioning --best-effort=provisioning
               --queued --slices= --first-row=" "${script_args[@]}"

name="${name:-${slices%%,*}}"  # --slices names the TPU VMs itself
require "$name" "--name (or \$BERT_JAX_TPU_NAME)"
require "$zone" "--zone (or \$BERT_JAX_TPU_ZONE)"
require "$project" "--project (or \$BERT_JAX_TPU_PROJECT)"
if [[ "$command" != run ]] && (( ${#positional[@]} )); then
  die "unexpected argument '${positional[0]}' for '$command'"
fi
if [[ "$command" != run && -n "${has_command_line:-}" ]]; then
  die "'--' and a bert-jax command line belong to 'run'"
fi
require_command gcloud
location=(--zone="$zone" --project="$project")

# ssh_workers WORKERS REMOTE_COMMAND: run a shell command on TPU workers.
ssh_workers() {
  run gcloud compute tpus tpu-vm ssh "$name" "${location[@]}" --worker="$1" --command="$2"
}

# default_runtime TYPE: RUNTIMES' runtime of TYPE's generation (v5p-32 -> v5p), or nothing.
default_runtime() {
  local generation runtime
  while read -r generation runtime; do
    if [[ "${1%-*}" == "$generation" ]]; then
      echo "$runtime"
      return
    fi
  done <<< "$RUNTIMES"
}

# multi_host TYPE: whether a slice of TYPE has several hosts (every generation's hosts hold 8 cores or chips at
# most, the number in the type: v4-8 and v6e-8 are one host, v4-32 four).
multi_host() {
  (( ${1##*-} > 8 ))
}

# option_value NAME ARGS...: the value of --NAME VALUE or --NAME=VALUE in ARGS (every occurrence, one a line).
option_value() {
  local name="$1"
  shift
  while (( $# )); do
    case "$1" in
      "$name") (( $# > 1 )) && printf '%s\n' "$2"; shift ;;
      "$name"=*) printf '%s\n' "${1#*=}" ;;
    esac
    shift
  done
}

# require_shared_data ARGS...: in a multi-host run every worker reads the data, so each data path is on GCS.
require_shared_data() {
  local flag path
  for flag in --config.data.prepared --config.data_dir --data-dir; do
    while IFS= read -r path; do
      path="${path#*=}"  # sweep's --data-dir KIND=PATH
      if [[ -n "$path" && ! "$path" =~ ^gs:// ]]; then
        die "$flag $path is local: every worker of a multi-host slice reads it, so give a gs:// path"
      fi
    done < <(option_value "$flag" "$@")
  done
}

# start_on SLICE WORKERS ARGS...: start `bert-jax ARGS...` in the background on WORKERS of the TPU VM SLICE.
start_on() {
  local slice="$1" workers="$2"
  shift 2
  local program="$REMOTE_VENV/bin/python -m bert_jax.cli $(quote_all "$@")"
  # \$! must be the program's pid (nohup execs it), so the background job is the nohup command alone, not an && list.
  run gcloud compute tpus tpu-vm ssh "$slice" "${location[@]}" --worker="$workers" --command="if [ -f $REMOTE_PID ] && kill -0 \$(cat $REMOTE_PID) 2>/dev/null; then echo \"a run is already going on this worker; stop it first\" >&2; exit 1; fi; cd $REMOTE_DIR || exit 1; nohup $program >> $REMOTE_LOG 2>&1 < /dev/null & echo \$! > $REMOTE_PID"
}

case "$command" in
  create)
    require "$accelerator_type" "--accelerator-type (e.g. v4-32, v5litepod-16, v6e-8)"
    if [[ ! "$accelerator_type" =~ ^v[0-9][a-z0-9]*-[0-9]+$ ]]; then
      die "--accelerator-type '$accelerator_type' is not of the form v4-32, v5litepod-16, v6e-8"
    fi
    version="${version:-$(default_runtime "$accelerator_type")}"
    require "$version" "--version (no default runtime known for $accelerator_type)"
    if [[ -n "$queued" ]]; then
      if [[ "$provisioning" == --preemptible ]]; then
        die "--queued takes --spot or --best-effort, not --preemptible"
      fi
      say "queueing TPU VM $name ($accelerator_type, runtime $version${provisioning:+, ${provisioning#--}}) in $zone, project $project; it exists once the queued resource is ACTIVE"
      gcloud=(gcloud)
      if [[ "$provisioning" == --best-effort ]]; then
        gcloud+=(alpha)  # best-effort capacity is the alpha command's
      fi
      run "${gcloud[@]}" compute tpus queued-resources create "$name" --node-id="$name" "${location[@]}" \
        --accelerator-type="$accelerator_type" --runtime-version="$version" ${provisioning:+"$provisioning"}
    else
      if [[ "$provisioning" == --best-effort ]]; then
        die "--best-effort applies to a queued resource: add --queued"
      fi
      say "creating TPU VM $name ($accelerator_type, runtime $version${provisioning:+, ${provisioning#--}}) in $zone, project $project"
      run gcloud compute tpus tpu-vm create "$name" "${location[@]}" \
        --accelerator-type="$accelerator_type" --version="$version" ${provisioning:+"$provisioning"}
    fi
    ;;
  setup)
    if [[ -n "$ref" && -z "$repo" ]]; then
      die "--ref needs --repo"
    fi
    install="curl -LsSf https://astral.sh/uv/install.sh | sh"
    install+=" && rm -rf $REMOTE_VENV && ~/.local/bin/uv venv --python $python_version $REMOTE_VENV"
    install+=" && cd $REMOTE_DIR && ~/.local/bin/uv pip install --python $REMOTE_VENV/bin/python -e \".[tpu]\""
    if [[ -n "$repo" ]]; then
      say "installing $repo${ref:+ at $ref} on every worker of $name"
      fetch="rm -rf $REMOTE_DIR && git clone $(quote "$repo") $REMOTE_DIR"
      if [[ -n "$ref" ]]; then
        fetch+=" && git -C $REMOTE_DIR checkout $(quote "$ref")"
      fi
    else
      archive="${TMPDIR:-/tmp}/bert_jax-$name.tar.gz"
      say "copying this checkout's HEAD ($REPO_ROOT) to every worker of $name and installing it"
      if [[ -n "$(git -C "$REPO_ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
        echo "warning: uncommitted changes in $REPO_ROOT are not copied (git archive HEAD)" >&2
      fi
      run git -C "$REPO_ROOT" archive --format=tar.gz --output="$archive" HEAD
      run gcloud compute tpus tpu-vm scp "$archive" "$name:bert_jax.tar.gz" "${location[@]}" --worker=all
      fetch="rm -rf $REMOTE_DIR && mkdir -p $REMOTE_DIR && tar -xzf ~/bert_jax.tar.gz -C $REMOTE_DIR"
    fi
    ssh_workers all "set -e; $fetch && $install"
    ;;
  run)
    if [[ -z "${has_command_line:-}" ]]; then  # the pre-training shorthand: CONFIG WORKDIR [OVERRIDES...]
      config="${positional[0]:-}"
      require "$config" "CONFIG, or -- COMMAND ARGS... (a bert-jax command line)"
      require "${positional[1]:-}" "WORKDIR (gs://BUCKET/PATH)"
      check_overrides "${positional[@]:2}"
      bert_jax_args=(pretrain --config "$config" --workdir "${positional[1]}" "${positional[@]:2}")
    elif (( ${#positional[@]} )); then
      die "unexpected argument '${positional[0]}' before '--'"
    fi
    subcommand="${bert_jax_args[0]:-}"
    require "$subcommand" "the bert-jax COMMAND after '--'"
    if ! grep -q "^    \"$subcommand\": (" "$REPO_ROOT/bert_jax/cli.py"; then
      die "'$subcommand' is not a bert-jax command (see bert-jax --help)"
    fi
    args=("${bert_jax_args[@]:1}")
    while IFS= read -r config; do
      (cd "$REPO_ROOT" && check_config "$config" warn)  # relative to the repository, as on the workers
    done < <(option_value --config "${args[@]}")
    workdir="$(option_value --workdir "${args[@]}" | tail -n 1)"
    if [[ "$subcommand" == table ]]; then  # its workdir is its first word that is not an option
      workdir="$(printf '%s\n' "${args[@]}" | grep -v -m 1 '^-' || true)"
    fi
    require "$workdir" "--workdir (gs://BUCKET/PATH) in the bert-jax command line"
    require_gcs_workdir "$workdir" "for a TPU VM: all workers share it and it survives preemption"
    if [[ -z "$worker" ]]; then
      worker=all
      if [[ "$subcommand" == table ]] || [[ "$subcommand" == sweep && " ${args[*]} " == *" --collect "* ]]; then
        worker=0  # one process reads the workdir and writes the results
      fi
    fi
    if [[ "$worker" != all && ! "$worker" =~ ^[0-9]+$ ]]; then
      die "--worker must be a worker number or 'all'; got '$worker'"
    fi
    if [[ -z "$accelerator_type" && "$DRY_RUN" != 1 ]]; then
      accelerator_type="$(gcloud compute tpus tpu-vm describe "$name" "${location[@]}" --format='value(acceleratorType)')"
    fi
    if [[ "$worker" == all ]] && { [[ -z "$accelerator_type" ]] || multi_host "$accelerator_type"; }; then
      require_shared_data "${args[@]}"
    fi
    if [[ -n "$slices" ]]; then
      if [[ "$subcommand" != sweep ]]; then
        die "--slices runs one sweep row on each TPU VM: it applies to 'sweep' only"
      fi
      if [[ ! "$first_row" =~ ^[0-9]+$ ]]; then
        die "--first-row must be a row index; got '$first_row'"
      fi
      if [[ " ${args[*]} " == *" --row"* ]]; then
        die "--slices chooses each slice's row: leave --rows and --row-index out"
      fi
      IFS=, read -r -a slice_names <<< "$slices"
      for i in "${!slice_names[@]}"; do
        say "starting sweep row $((first_row + i)) on all workers of ${slice_names[$i]}, workdir $workdir"
        start_on "${slice_names[$i]}" all "${bert_jax_args[@]}" --row-index "$((first_row + i))"
      done
    else
      say "starting bert-jax $subcommand on worker $worker of $name, workdir $workdir, log $REMOTE_LOG on each worker"
      start_on "$name" "$worker" "${bert_jax_args[@]}"
    fi
    ;;
  logs)
    worker="${worker:-0}"
    if [[ ! "$worker" =~ ^[0-9]+$ ]]; then
      die "--worker must be a worker number; got '$worker'"
    fi
    if [[ ! "$lines" =~ ^[0-9]+$ ]]; then
      die "--lines must be a number; got '$lines'"
    fi
    say "following the log of worker $worker of $name (Ctrl-C stops following, not the run)"
    ssh_workers "$worker" "tail -n $lines -F $REMOTE_LOG"
    ;;
  stop)
    say "stopping the run on every worker of $name"
    ssh_workers all "if [ -f $REMOTE_PID ]; then kill \$(cat $REMOTE_PID) 2>/dev/null || true; rm -f $REMOTE_PID; fi"
    ;;
  delete)
    if [[ -n "$queued" ]]; then
      say "deleting queued resource $name and its TPU VM in $zone, project $project"
      run gcloud compute tpus queued-resources delete "$name" "${location[@]}" --force --quiet
    else
      say "deleting TPU VM $name in $zone, project $project"
      run gcloud compute tpus tpu-vm delete "$name" "${location[@]}" --quiet
    fi
    ;;
esac
