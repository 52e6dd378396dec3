#!/usr/bin/env bash
# The models of the decoding frontier (docs/results/decoding-frontier.md), per training seed s: the AR parent and the
# block MDM warm start of block-scaleup (benchmarks/plans/block-scaleup.yaml, the same commands, so the two share
# them), and an AR with as many updates as the block model (its parent + 600 AR updates, the block warm start's
# schedule: lr 3e-4, 50 warm-up updates, cosine). Each command resumes a stopped run and skips a finished one.
#   bash benchmarks/frontier_models.sh SEED [ar-parent|block-warm|ar-equal ...]   (default: all three, in order)
set -euo pipefail
cd "$(dirname "$0")/.."
s=$1; shift
parts=("${@:-ar-parent block-warm ar-equal}")
DLM=${DLM:-.venv/bin/dlm}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
data=runs/starts/tinymath-medium
train() {  # out_dir, then the dlm train arguments
  local out=$1; shift
  [ -f "$out/model/dlm.json" ] && { echo "== $out: built"; return; }
  local resume=(); [ -f "$out/checkpoints/latest" ] && resume=(--resume)
  echo "== $out: $(date +%H:%M)"
  "$DLM" train "$@" --out-dir "$out" "${resume[@]}" --no-progress
}
for part in ${parts[@]}; do
  case $part in
    ar-parent) train runs/starts/seed$s/ar-parent recipes/tinymath/ar.yaml --set data.level=medium \
                 --set train.steps=1500 --set model.max_length=192 --set data.dir=$data --set train.seed=$s ;;
    block-warm) train runs/starts/seed$s/block-warm recipes/tinymath/block.yaml \
                 --set model.init_from=runs/starts/seed$s/ar-parent --set data.dir=$data --set train.seed=$s ;;
    ar-equal) train runs/frontier/seed$s/ar-equal recipes/tinymath/ar.yaml --set data.level=medium \
                 --set model.init_from=runs/starts/seed$s/ar-parent --set model.max_length=192 --set data.dir=$data \
                 --set train.seed=$s --set train.steps=600 --set optim.lr=3.0e-4 --set optim.warmup_steps=50 \
                 --set train.eval_every=null ;;
    *) echo "unknown part $part (ar-parent, block-warm, ar-equal)" >&2; exit 2 ;;
  esac
done
