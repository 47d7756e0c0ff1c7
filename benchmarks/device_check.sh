#!/usr/bin/env bash
# The GPU check for the sm90 target, one script, well under 8 minutes on one H200:
#   benchmarks/device_check.sh [--dry-run] [--out FILE]
# On the GPU machine it uses the python3 that holds torch and triton (nothing can be fetched
# there) and deepfuse from this checkout (PYTHONPATH, no install). --dry-run runs the same
# script on this CPU in Triton's interpreter with tiny shapes (CI runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ "${1:-}" = "--dry-run" ]; then PY=.venv/bin/python; fi
out=benchmarks/results/device_check.json
dry=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=(--dry-run); export TRITON_INTERPRET=1 ;;
    --out) out="$2"; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
for mod in torch triton transformers safetensors tokenizers tqdm numpy; do
  "$PY" -c "import $mod" 2>/dev/null || { echo "device_check: python module '$mod' is missing for $PY" >&2; exit 2; }
done
if [ ${#dry[@]} -eq 0 ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout 480 "$PY" benchmarks/device_check.py --out "$out" "${dry[@]}"
