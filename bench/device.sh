#!/usr/bin/env bash
# The device checks of the speed and multi-turn issues, as one script for a
# lent GPU machine (docs/benchmarks.md, "GPU"). Run from the repo root:
#
#   bash bench/device.sh OUT_DIR [PART ...]    # default: the parts below
#   bash bench/device.sh OUT_DIR exact exact_tiles   # exact mode (~8 min)
#   bash bench/device.sh OUT_DIR mixed_precision     # fp32 vs bf16 (~3 min)
#   bash bench/device.sh OUT_DIR attention           # fused attention (~3 min)
#
# The machine has JAX with CUDA but none of jaxcorr's own requirements and no
# network, so the caller brings them as wheels in .whl/ (ml-collections,
# google-jetstream, qwix, jsonschema and its parts, gguf) plus .devcarry/:
#   .devcarry/site/seqio   import-only stand-in: JetStream's token_utils
#                          imports seqio (and through it TensorFlow, which is
#                          not there); jaxcorr's engine never calls it.
#   .devcarry/SmolLM2-like SmolLM2-135M-Instruct's config and tokenizer, no
#                          weights (538 MB do not travel): random weights of
#                          the same shape are written there first
#                          (bench/random_checkpoint.py).
# Each part has its own time limit so one slow part cannot starve the rest;
# every part's log lands in OUT_DIR.
#
# Preparing them here (both folders are git-excluded; docs/benchmarks.md,
# "GPU", has what the H200 run carried):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl \
#     google-jetstream==0.2.2 ml-collections qwix==0.1.8 jsonschema \
#     referencing rpds-py jsonschema-specifications gguf
#   mkdir -p .devcarry/site/seqio .devcarry/SmolLM2-like
#   (seqio/__init__.py empty; seqio/vocabularies.py defines Vocabulary,
#   whose __init__ raises ImportError, and SentencePieceVocabulary(Vocabulary))
#   cp ~/.cache/jaxcorr/SmolLM2-135M-Instruct/{config,tokenizer,\
#     tokenizer_config,special_tokens_map,generation_config}.json \
#     .devcarry/SmolLM2-like/
set -u
out=${1:?usage: bash bench/device.sh OUT_DIR [PART ...]}
shift
parts=${*:-update agents smollm2_update smollm2_step update_full train_split losses losses_big smollm2_remat}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.devcarry/site:.:bench
export JAXCORR_CACHE=/tmp/jaxcorr-cache TF_CPP_MIN_LOG_LEVEL=3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import jax, flax, optax; print("jax", jax.__version__, "flax",
flax.__version__, "optax", optax.__version__, jax.devices())'

part() {  # part NAME SECONDS CMD...: run one part, log to $out/NAME.log
  local name=$1 secs=$2
  shift 2
  echo "=== $name (limit ${secs}s) $(date +%T)"
  timeout "$secs" "$@" 2>&1 | tee "$out/$name.log" | grep -v '^W0000\|^I0000'
  echo "=== $name rc=${PIPESTATUS[0]} $(date +%T)"
}

smol=.devcarry/SmolLM2-like
python3 bench/random_checkpoint.py --like=$smol \
  --out="$JAXCORR_CACHE/SmolLM2-135M-Instruct" || exit 1

for p in $parts; do
  case $p in
  update) part update 90 python3 bench/update.py --reps=3 ;;
  agents) part agents 110 python3 bench/agents.py --repeats=3 ;;
  # SmolLM2's shape (random weights), 64 rows of 32 + up to 512 tokens.
  smollm2_update) part smollm2_update 170 python3 bench/update.py --reps=3 \
    --like=$smol --new-tokens=512 ;;
  # The whole RL step on SmolLM2's shape: 16 prompts x 8, 256 new tokens.
  smollm2_step) part smollm2_step 140 python3 bench/smollm2.py --parts=step \
    --steps=3 --prompts=16 --samples=8 --new_tokens=256 ;;
  smollm2_step_padded) part smollm2_step_padded 140 python3 \
    bench/smollm2.py --parts=step --steps=3 --prompts=16 --samples=8 \
    --new_tokens=256 --packing=off ;;
  update_full) part update_full 60 python3 bench/update.py --reps=3 \
    --full-length ;;
  train_split) part train_split 50 python3 bench/train.py --steps=3 ;;
  # The loss core against its memory floor, with and without diagnostics.
  losses) part losses 70 python3 bench/losses.py ;;
  # The same at 4096 x 16384 (1.3 GB of inputs): the default size is
  # launch-bound on a GPU (its floor reads 10 MB).
  losses_big) part losses_big 90 python3 bench/losses.py --batch=4096 \
    --tokens=16384 --no-numpy ;;
  # SmolLM2's shape, packed rows, remat 'none' against 'dots'.
  smollm2_remat) part smollm2_remat 150 python3 bench/update.py --reps=3 \
    --like=$smol --new-tokens=512 --remat=none,dots ;;
  # Mixed precision (issue 45 item 1): SmolLM2's shape, packed rows, the
  # update computing in float32 against bfloat16 over float32
  # master weights (model.dtype='auto' on a GPU).
  mixed_precision) part mixed_precision 200 python3 bench/update.py \
    --reps=3 --like=$smol --new-tokens=512 --dtype=float32,bfloat16 ;;
  # Fused attention (issue 45 item 2): SmolLM2's layer shape, packed rows
  # of 2048, bf16: the jnp reference against XLA's and cuDNN's
  # dot_product_attention (the op with its differences, and the trunk's
  # forward + backward).
  attention) part attention 180 python3 bench/attention.py \
    --impls=jnp,xla,cudnn --dtype=bfloat16 --rows=8 --length=2048 \
    --layers=4 --reps=5 ;;
  # Exact mode's cost (issue 39 item 2): rollout tokens/s and the update
  # with rollout.exact on and off, alternating reps; then the token tile.
  exact) part exact 240 python3 bench/exact.py --reps=5 ;;
  exact_tiles) part exact_tiles 240 python3 bench/exact.py --reps=3 \
    --parts=rollout --tiles=8,32,128 ;;
  *) echo "unknown part $p" ;;
  esac
done
