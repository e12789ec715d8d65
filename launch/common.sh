# Shared helpers for the launch scripts; source it, don't run it.
#
# Every script prints what it will do (on stderr) and each command before it
# runs it. With DRY_RUN=1 (set by --dry-run) it prints each command on stdout,
# exactly and quoted so it can be pasted into a shell, and runs nothing.

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  echo "launch/common.sh is sourced by the launch scripts, not run." >&2
  exit 2
fi

LAUNCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$LAUNCH_DIR/.." && pwd)"
DRY_RUN="${DRY_RUN:-0}"
PYTHON="${PYTHON:-python3}"

# say MESSAGE...: tell the user what is about to happen.
say() {
  echo "==> $*" >&2
}

# die MESSAGE...: fail with a clear message (and the usage hint when set).
die() {
  echo "error: $*" >&2
  if [[ -n "${USAGE_HINT:-}" ]]; then
    echo "$USAGE_HINT" >&2
  fi
  exit 2
}

# quote ARG: ARG as one shell word, left bare when it needs no quoting; for
# --flag=VALUE only VALUE is quoted.
quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
    printf '%s' "$1"
  elif [[ "$1" =~ ^(--[A-Za-z0-9_.-]+=)(.*)$ ]]; then
    printf '%s' "${BASH_REMATCH[1]}"
    quote "${BASH_REMATCH[2]}"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# quote_all ARGS...: the words joined by spaces, each quoted as needed.
quote_all() {
  local out="" arg
  for arg in "$@"; do
    out+="${out:+ }$(quote "$arg")"
  done
  printf '%s' "$out"
}

# run CMD ARGS...: print the command, then run it unless this is a dry run.
run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    quote_all "$@"
    echo
  else
    echo "+ $(quote_all "$@")" >&2
    "$@"
  fi
}

# require VALUE FLAG: fail naming FLAG when VALUE is empty.
require() {
  if [[ -z "$1" ]]; then
    die "missing $2"
  fi
}

# require_value FLAG [NEXT_ARGS...]: a flag that takes a value has one (and
# not another --flag in its place). Call as: require_value "$@".
require_value() {
  if (( $# < 2 )) || [[ "$2" == --* ]]; then
    die "$1 needs a value"
  fi
}

# require_gcs_workdir WORKDIR WHY: the workdir must be on GCS (gs://bucket/path).
require_gcs_workdir() {
  if [[ ! "$1" =~ ^gs://[^/]+/.+ ]]; then
    die "workdir must be on GCS (gs://BUCKET/PATH) $2; got '$1'"
  fi
}

# require_command NAME: the tool must be installed (not needed for a dry run).
require_command() {
  if [[ "$DRY_RUN" != 1 ]] && ! command -v "$1" >/dev/null 2>&1; then
    die "'$1' is not installed or not on PATH"
  fi
}

# check_config CONFIG [warn]: CONFIG is FILE[:ARGS]; FILE must exist (relative
# to the current directory) and end in .py. With 'warn', a missing file only
# warns (the file is looked up on another machine).
check_config() {
  local file="${1%%:*}"
  require "$1" "CONFIG (a config file such as configs/bert.py[:args])"
  if [[ "$file" != *.py ]]; then
    die "CONFIG must be a Python config file (FILE.py[:ARGS]); got '$1'"
  fi
  if [[ ! -f "$file" ]]; then
    if [[ "${2:-}" == warn ]]; then
      echo "warning: config file '$file' is not in this checkout" >&2
    else
      die "config file '$file' does not exist"
    fi
  fi
}

# run_arguments CONFIG WORKDIR [OVERRIDES...]: sets config, workdir and overrides (an array) and
# checks them: the config file exists, a workdir is given, each override is --config.KEY=VALUE.
run_arguments() {
  config="${1:-}"
  workdir="${2:-}"
  check_config "$config"
  require "$workdir" "WORKDIR"
  overrides=("${@:3}")
  check_overrides "${overrides[@]}"
}

# check_overrides ARGS...: each trainer override is --config.KEY=VALUE.
check_overrides() {
  local arg
  for arg in "$@"; do
    if [[ ! "$arg" =~ ^--config\.[A-Za-z0-9_.]+=.* ]]; then
      die "override '$arg' is not of the form --config.KEY=VALUE"
    fi
  done
}

# parse_options SPEC ARGS...: the scripts' shared argument loop. SPEC is a space-separated list of
# options: FLAG= takes a value, FLAG alone is a switch set to the flag itself; each sets the variable
# named after the flag (--num-processes -> num_processes) or, written FLAG=VAR or FLAG=VAR= , VAR.
# -h/--help prints $USAGE, --dry-run sets DRY_RUN=1; --config.* overrides and other words are
# collected in order in the array `positional`.
parse_options() {
  local _spec=" $1 " _entry _var
  shift
  positional=()
  while (( $# )); do
    case "$1" in
      -h|--help) echo "$USAGE"; exit 0 ;;
      --dry-run) DRY_RUN=1; shift ;;
      --config.*) positional+=("$1"); shift ;;
      -*)
        _entry="$(option_entry "$_spec" "$1")" || die "unknown option '$1'"
        _var="${_entry#*=}"
        _var="${_var%=}"
        if [[ "$_entry" == *= ]]; then
          require_value "$@"
          printf -v "$_var" '%s' "$2"
          shift 2
        else
          printf -v "$_var" '%s' "$1"
          shift
        fi ;;
      *) positional+=("$1"); shift ;;
    esac
  done
}

# option_entry SPEC FLAG: FLAG's entry of SPEC as "FLAG=VAR" (a switch) or "FLAG=VAR=" (takes a value).
option_entry() {
  local word default="${2#--}"
  default="${default//-/_}"
  for word in $1; do
    case "$word" in
      "$2") echo "$2=$default" ; return 0 ;;
      "$2=") echo "$2=$default=" ; return 0 ;;
      "$2="*) echo "$word"; return 0 ;;
    esac
  done
  return 1
}
