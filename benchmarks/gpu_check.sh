#!/usr/bin/env bash
# The GPU acceptance test of dlm, at most 10 minutes on one H100/H200, no network: every command that runs a model
# (convert, generate, eval incl. humaneval, lm-eval, serve, train incl. LoRA and PU, export --merge) on the GPU,
# asserted against the CPU (greedy fp32 identical, bf16 within stated tolerances), then MFU, peak memory, flex vs
# dense block attention and sampling speed; last, where sglang is installed (usually not: no network there, and then
# "skipped: sglang not installed", which passes), sglang serving `dlm export --format llada` and answering one
# request (benchmarks/gpu_sglang.py). Each part has a hard time cap and writes its JSON under $OUT (default
# ./gpu_check_out) as it finishes; the exit status is 0 only when every part passed. See benchmarks/gpu_check.py and
# docs/guides/multi-gpu.md. Without CUDA it says so and exits 0. --smoke: every part at toy size on the CPU.
#   bash benchmarks/gpu_check.sh
#   OUT=/tmp/gpu_check bash benchmarks/gpu_check.sh --smoke
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-./gpu_check_out}"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY="python3"; fi
fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}"
# it sizes itself (--smoke); DLM_SMOKE (scripts/run_doc_commands.py) would cap the trainings its checks measure
unset DLM_SMOKE
exec "$PY" "$ROOT/benchmarks/gpu_check.py" --out "$OUT" "$@"
