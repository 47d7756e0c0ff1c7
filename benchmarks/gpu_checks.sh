#!/usr/bin/env bash
# Every GPU check in one call, on a machine with a GPU; each step has its own limit, 480 s in
# all (give the call 600; --dry-run's limits are 570 s, the interpreter being slower); a step
# stopped by its limit keeps what it wrote: each script saves after every stage, marked
# complete: false until its end:
# device_check.sh (each kernel against torch, with and without the decode sizing; the artifact
# end to end), gpu_graphs.py (decode step time at 1/16/64 sequences: eager, CUDA graphs,
# overlapped, graphs without the decode sizing; it fails where the graphed tokens differ or a
# step waits for the GPU), gpu_throughput.py --runs 2 --profile (Engine against HF) and
# gpu_kernel_times.py (each launch in a step, alone, JIT against the artifact's cubins), with
# `nvidia-smi dmon` (power, utilization, clocks, once a second) running beside them. Each line
# of the script's log (OUTDIR/*.log) carries the time, to line it up with dmon.txt. Seven files
# in OUTDIR.
#
#   benchmarks/gpu_*.sh OUTDIR [--dry-run]
#
# --dry-run: the four scripts' own dry runs, on the CPU in Triton's interpreter, no dmon.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-}
if [ -z "$out" ] || [ "${out#-}" != "$out" ]; then
  echo "usage: benchmarks/gpu_checks.sh OUTDIR [--dry-run]" >&2
  exit 2
fi
dry=()
case "${2:-}" in
  "") ;;
  --dry-run) dry=(--dry-run) ;;
  *) echo "unknown argument: $2" >&2; exit 2 ;;
esac
mkdir -p "$out"
PY=python3
if [ ${#dry[@]} -gt 0 ]; then
  [ -x .venv/bin/python ] && PY=.venv/bin/python
  export TRITON_INTERPRET=1
fi
export PYTHONUNBUFFERED=1
dmon=""
if [ ${#dry[@]} -eq 0 ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi dmon -s pucv -o T -d 1 > "$out/dmon.txt" 2>&1 &
  dmon=$!
fi
# each line with the time, less the progress bars
stamp() {
  while IFS= read -r line; do
    case "$line" in
      *"Writing model"* | *"loading safetensors"* | *"compiling for"*) ;;
      *) printf '%s %s\n' "$(date +%T)" "$line" ;;
    esac
  done
}
exec > >(tee "$out/checks.log") 2>&1
rc=0
run() {  # a title, then the command
  echo "== $1" | stamp
  shift
  "$@" 2>&1 | stamp || rc=1
}
limits=(170 140 100 70)
[ ${#dry[@]} -gt 0 ] && limits=(200 150 130 90)
run "device check" timeout "${limits[0]}" env PYTHON="$PY" benchmarks/device_check.sh --out "$out/device_check.json" "${dry[@]}"
run "cuda graphs" timeout "${limits[1]}" "$PY" benchmarks/gpu_graphs.py --out "$out/gpu_graphs.json" "${dry[@]}"
profile=(--profile)
[ ${#dry[@]} -gt 0 ] && profile=()
run "throughput" timeout "${limits[2]}" "$PY" benchmarks/gpu_throughput.py --runs 2 "${profile[@]}" \
  --out "$out/gpu_throughput.json" "${dry[@]}"
run "kernel times" timeout "${limits[3]}" "$PY" benchmarks/gpu_kernel_times.py --out "$out/gpu_kernel_times.json" "${dry[@]}"
[ -n "$dmon" ] && kill "$dmon"
echo "== done, exit $rc" | stamp
exit $rc
