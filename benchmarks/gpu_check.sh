#!/usr/bin/env bash
# One unattended GPU check, sized for <= 15 minutes on one H200: MFU (MDM, PU W=2), peak memory at PU W=1/2/4/8 with
# and without train.activation_checkpointing, flex vs dense block masks, block decoding vs AR tokens/s. Each part has a
# hard time cap and writes its JSON under $OUT (default ./gpu_check_out) as it finishes. See benchmarks/gpu_check.py.
# Without CUDA it says so and exits 0. --smoke: every part at toy size (CPU is fine), for the test suite.
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
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
exec "$PY" "$ROOT/benchmarks/gpu_check.py" --out "$OUT" "$@"
