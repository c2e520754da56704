#!/usr/bin/env bash
# Run jaxcorr on a Cloud TPU VM or pod slice, from your own machine.
#
# JAX on a pod slice is multi-controller: every worker (host) runs the same
# `python -m jaxcorr.main`, and the processes find each other through
# jax.distributed (jaxcorr/distributed.py). This script does the three
# steps that takes with gcloud, each with --worker=all:
#
#   1. describe the TPU; create it if it does not exist (or was preempted);
#   2. copy a tarball of this checkout to every worker and install it there
#      (uv-managed Python 3.11 venv in ~/jaxcorr-venv, `jax[tpu]`, then
#      `pip install -e ~/jaxcorr`);
#   3. start the trainer on every worker with the same --config and the same
#      shared --workdir (a gs:// bucket path on a multi-worker slice).
#
# --dry-run prints the commands instead (no gcloud needed). docs/tpu.md has
# the walk-through; none of this has been run on a real TPU yet.

set -euo pipefail

PROG=${0##*/}
PYTHON_VERSION=3.11
# Paths on the workers: the ~ is expanded there, by the remote shell.
# shellcheck disable=SC2088
REMOTE_SRC='~/jaxcorr'
# shellcheck disable=SC2088
REMOTE_VENV='~/jaxcorr-venv'
REMOTE_TARBALL=jaxcorr.tar.gz
# shellcheck disable=SC2088
REMOTE_LOG='~/jaxcorr.log'

usage() {
  cat <<EOF
Usage: $PROG --project=P --zone=Z --accelerator-type=T --tpu-name=N \\
         --config=FILE[:PRESET] --workdir=gs://BUCKET/RUN [options]
       $PROG --delete --project=P --zone=Z --tpu-name=N [--dry-run]

Create (or reuse) a Cloud TPU VM / pod slice, install this checkout of
jaxcorr on every worker and run \`python -m jaxcorr.main\` on all of them.

Required:
  --project=P           Google Cloud project id
  --zone=Z              zone of the TPU (e.g. us-west4-a, us-east5-a)
  --accelerator-type=T  e.g. v5litepod-8 (v5e-8), v5p-64, v6e-8, v4-32
  --tpu-name=N          name of the TPU VM / slice (reused if it exists)
  --config=C            trainer config, relative to the repo root, e.g.
                        configs/gsm8k_qwen.py:decoupled_geo_rs
  --workdir=W           checkpoints and metrics; a gs:// path shared by all
                        workers (re-running with it resumes)

Options:
  --runtime-version=V   TPU software version for create (default from the
                        accelerator: v2-alpha-tpuv6e, v2-alpha-tpuv5,
                        v2-alpha-tpuv5-lite, else tpu-ubuntu2204-base)
  --extra-args=ARGS     appended to the trainer command line as they are
                        (the remote shell splits them), e.g.
                        '--config.train.num_steps=200'
  --jax-spec=SPEC       the JAX requirement to install (default 'jax[tpu]';
                        pin it, e.g. 'jax[tpu]==0.10.2')
  --spot                create the TPU as a Spot VM (preemptible)
  --no-install          skip the copy and install (code already there)
  --detach              start the trainer under nohup, logging to
                        $REMOTE_LOG on each worker, and return
  --delete              delete the TPU instead (needs --project, --zone,
                        --tpu-name)
  --dry-run             print every command (prefixed with '+ '), run none
  -h, --help            this help

Exit status 2: a usage error (missing or unknown option, bad value, no
gcloud); otherwise the status of the failing gcloud command.
EOF
}

die() {
  printf '%s: error: %s\n' "$PROG" "$*" >&2
  printf "Run '%s --help' for usage.\n" "$PROG" >&2
  exit 2
}

warn() {
  printf '%s: warning: %s\n' "$PROG" "$*" >&2
}

# A word the shell reads back as itself: bare if safe, else single-quoted.
shq() {
  if [[ $1 =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

words() {
  local line='' arg
  for arg in "$@"; do
    line+="${line:+ }$(shq "$arg")"
  done
  printf '%s' "$line"
}

show() {
  printf '+ %s\n' "$(words "$@")"
}

# Print the command; run it unless --dry-run (then stdout is the plan).
run() {
  if ((DRY_RUN)); then
    show "$@"
  else
    show "$@" >&2
    "$@"
  fi
}

default_runtime() {
  case $1 in
    v6e-*) echo v2-alpha-tpuv6e ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v5litepod-* | v5e-*) echo v2-alpha-tpuv5-lite ;;
    *) echo tpu-ubuntu2204-base ;;
  esac
}

# One host holds at most 8 of the units an accelerator type counts (chips
# on v5e/v6e, TensorCores on v2-v4/v5p), so more than 8 means several.
multi_worker() {
  local n=${1##*-}
  ((n > 8))
}

# ------------------------------------------------------------------ options

PROJECT='' ZONE='' ACCELERATOR_TYPE='' TPU_NAME='' CONFIG='' WORKDIR=''
RUNTIME_VERSION='' EXTRA_ARGS='' JAX_SPEC='jax[tpu]'
DRY_RUN=0 DELETE=0 SPOT=0 INSTALL=1 DETACH=0

while (($#)); do
  opt=$1
  val=''
  has_val=0
  if [[ $opt == --*=* ]]; then
    val=${opt#*=}
    opt=${opt%%=*}
    has_val=1
  fi
  case $opt in
    -h | --help)
      usage
      exit 0
      ;;
    --dry-run | --delete | --spot | --no-install | --detach)
      ((!has_val)) || die "option $opt takes no value"
      case $opt in
        --dry-run) DRY_RUN=1 ;;
        --delete) DELETE=1 ;;
        --spot) SPOT=1 ;;
        --no-install) INSTALL=0 ;;
        --detach) DETACH=1 ;;
      esac
      ;;
    --project | --zone | --accelerator-type | --tpu-name | --config | \
      --workdir | --runtime-version | --extra-args | --jax-spec)
      if ((!has_val)); then
        (($# >= 2)) || die "option $opt needs a value"
        val=$2
        shift
      fi
      case $opt in
        --project) PROJECT=$val ;;
        --zone) ZONE=$val ;;
        --accelerator-type) ACCELERATOR_TYPE=$val ;;
        --tpu-name) TPU_NAME=$val ;;
        --config) CONFIG=$val ;;
        --workdir) WORKDIR=$val ;;
        --runtime-version) RUNTIME_VERSION=$val ;;
        --extra-args) EXTRA_ARGS=$val ;;
        --jax-spec) JAX_SPEC=$val ;;
      esac
      ;;
    *) die "unknown option: $opt" ;;
  esac
  shift
done

required=(--project --zone --tpu-name)
((DELETE)) || required+=(--accelerator-type --config --workdir)
missing=()
for opt in "${required[@]}"; do
  name=${opt#--}
  name=${name//-/_}
  name=${name^^}
  [[ -n ${!name} ]] || missing+=("$opt")
done
((${#missing[@]} == 0)) || die "missing required option(s): ${missing[*]}"

src=${BASH_SOURCE[0]}
[[ $src == */* ]] || src=./$src
REPO=$(cd "${src%/*}" && pwd)

if ((!DELETE)); then
  [[ $ACCELERATOR_TYPE =~ ^v[0-9][a-z0-9]*-[0-9]+$ ]] ||
    die "--accelerator-type: invalid value '$ACCELERATOR_TYPE'; allowed:" \
      "a TPU type such as v5litepod-8, v5p-64, v6e-8, v4-32"
  [[ -f $REPO/${CONFIG%%:*} ]] ||
    die "--config: no such file '${CONFIG%%:*}' in $REPO (give the path" \
      "relative to the repo root, e.g. configs/arith_tiny.py)"
  RUNTIME_VERSION=${RUNTIME_VERSION:-$(default_runtime "$ACCELERATOR_TYPE")}
  if [[ $WORKDIR != gs://* ]] && multi_worker "$ACCELERATOR_TYPE"; then
    warn "--workdir '$WORKDIR' is not a gs:// path, but $ACCELERATOR_TYPE" \
      "has several workers: each would write its own local directory and" \
      "a restart could not resume; use a bucket, e.g. gs://BUCKET/run"
  fi
fi

if ((!DRY_RUN)) && ! command -v gcloud >/dev/null 2>&1; then
  die "gcloud not found on PATH; install the Google Cloud CLI" \
    "(https://cloud.google.com/sdk/docs/install) or use --dry-run"
fi

TPU=(gcloud compute tpus tpu-vm)
WHERE=(--project="$PROJECT" --zone="$ZONE")

# ------------------------------------------------------------------- delete

if ((DELETE)); then
  run "${TPU[@]}" delete "$TPU_NAME" "${WHERE[@]}" --quiet
  exit 0
fi

# ------------------------------------------------------- 1. create or reuse

create=("${TPU[@]}" create "$TPU_NAME" "${WHERE[@]}"
  --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION")
((!SPOT)) || create+=(--spot)
describe=("${TPU[@]}" describe "$TPU_NAME" "${WHERE[@]}"
  --format='value(state)')

if ((DRY_RUN)); then
  echo "$PROG: dry run: create runs only if describe finds no TPU" >&2
  show "${describe[@]}"
  show "${create[@]}"
else
  show "${describe[@]}" >&2
  if state=$("${describe[@]}" 2>/dev/null); then
    case $state in
      READY) echo "$PROG: reusing $TPU_NAME (READY)" >&2 ;;
      PREEMPTED | TERMINATED)
        warn "$TPU_NAME is $state: deleting and re-creating it"
        run "${TPU[@]}" delete "$TPU_NAME" "${WHERE[@]}" --quiet
        run "${create[@]}"
        ;;
      *) die "$TPU_NAME is in state '$state'; wait for READY or delete it" \
        "($PROG --delete ...)" ;;
    esac
  else
    run "${create[@]}"
  fi
fi

# ---------------------------------------------------- 2. copy and install

if ((INSTALL)); then
  if ((DRY_RUN)); then
    tarball=${TMPDIR:-/tmp}/jaxcorr-launch.XXXXXX/jaxcorr.tar.gz
  else
    tmpdir=$(mktemp -d "${TMPDIR:-/tmp}/jaxcorr-launch.XXXXXX")
    trap 'rm -rf "$tmpdir"' EXIT
    tarball=$tmpdir/jaxcorr.tar.gz
  fi
  # The working tree as git sees it (tracked and untracked, not ignored:
  # uncommitted edits go too, .venv and caches do not); a plain directory
  # is copied whole minus .git, .venv and __pycache__.
  if git -C "$REPO" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    list=(git -C "$REPO" ls-files -z --cached --others --exclude-standard)
    pack=(tar -C "$REPO" --null -T - -czf "$tarball")
    plan=$(printf '+ %s | %s' "$(words "${list[@]}")" "$(words "${pack[@]}")")
    if ((DRY_RUN)); then
      printf '%s\n' "$plan"
    else
      printf '%s\n' "$plan" >&2
      "${list[@]}" | while IFS= read -r -d '' f; do
        # Tracked files deleted in the working tree are skipped.
        [[ ! -e $REPO/$f ]] || printf '%s\0' "$f"
      done | "${pack[@]}"
    fi
  else
    run tar -C "$REPO" --exclude=./.git --exclude=./.venv \
      --exclude=__pycache__ -czf "$tarball" .
  fi
  run "${TPU[@]}" scp "$tarball" "$TPU_NAME:$REMOTE_TARBALL" "${WHERE[@]}" \
    --worker=all
  install="set -e; rm -rf $REMOTE_SRC; mkdir -p $REMOTE_SRC"
  install+="; tar -xzf ~/$REMOTE_TARBALL -C $REMOTE_SRC"
  install+="; python3 -m pip install --user -q -U uv"
  install+="; export PATH=\$HOME/.local/bin:\$PATH"
  install+="; test -x $REMOTE_VENV/bin/python"
  install+=" || uv venv -q --python $PYTHON_VERSION $REMOTE_VENV"
  install+="; uv pip install -q --python $REMOTE_VENV/bin/python -U"
  install+=" $(shq "$JAX_SPEC") -e $REMOTE_SRC"
  run "${TPU[@]}" ssh "$TPU_NAME" "${WHERE[@]}" --worker=all \
    --command="$install"
fi

# ------------------------------------------------------------- 3. train

main="$REMOTE_VENV/bin/python -m jaxcorr.main --config=$(shq "$CONFIG")"
main+=" --workdir=$(shq "$WORKDIR")${EXTRA_ARGS:+ $EXTRA_ARGS}"
# JAXCORR_DISTRIBUTED=auto: jax.distributed.initialize() on every worker,
# JAX reading the slice from the TPU metadata (jaxcorr/distributed.py).
if ((DETACH)); then
  start="cd $REMOTE_SRC && JAXCORR_DISTRIBUTED=auto nohup $main"
  start+=" > $REMOTE_LOG 2>&1 < /dev/null &"
else
  start="cd $REMOTE_SRC && JAXCORR_DISTRIBUTED=auto $main"
fi
run "${TPU[@]}" ssh "$TPU_NAME" "${WHERE[@]}" --worker=all --command="$start"

if ((DETACH)); then
  echo "$PROG: started; follow worker 0 with:" >&2
  show "${TPU[@]}" ssh "$TPU_NAME" "${WHERE[@]}" --worker=0 \
    --command="tail -f $REMOTE_LOG" >&2
fi
