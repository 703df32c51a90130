#!/usr/bin/env bash
# The GPU proof (bench/gpu_proof.py): the trainer's update path on one GPU, at production size, in a few minutes.
#
#   bench/gpu_proof.sh [--out FILE] [...]   on a lent GPU box (torch, transformers, peft; no DeepSpeed, no network)
#   bench/gpu_proof.sh --tiny               anywhere: a tiny model on the CPU (the test)
#   bench/gpu_proof.sh --list-wheels        the wheels the GPU box needs; --build-wheels builds bench/wheels/ here
#
# The wheels this Python lacks (or holds at another version) are installed from bench/wheels/ (--no-index, no
# network) into a folder of their own, put first on PYTHONPATH; the proof itself runs from this working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
for arg in "$@"; do
  case "$arg" in --list-wheels|--build-wheels|-h|--help) exec "$PY" -m bench.gpu_proof "$@" ;; esac
done
export PYTHONPATH="$PWD:$PWD/services/trainer${PYTHONPATH:+:$PYTHONPATH}"
mapfile -t wanted < <("$PY" -m bench.gpu_proof --missing-wheels)
if [ "${#wanted[@]}" -gt 0 ]; then
  [ -d bench/wheels ] || { echo "this Python lacks ${wanted[*]} and there is no bench/wheels/: run" \
    "bench/gpu_proof.sh --build-wheels (make gpu-proof-wheels) where a registry is reachable, and bring it along" >&2
    exit 2; }
  site="$(mktemp -d)/site"
  echo "==> installing ${#wanted[@]} wheels from bench/wheels/ into $site (no network)"
  "$PY" -m pip install -q --no-index --no-deps --find-links bench/wheels --target "$site" "${wanted[@]}"
  export PYTHONPATH="$site:$PYTHONPATH"
fi
exec "$PY" -m bench.gpu_proof "$@"
