#!/usr/bin/env bash
# The learning demonstration, end to end (docs/demo.md): start the stack on configs/demo.yaml (the product's defaults;
# the hardware profile comes from `onlinerl up`), let simulated users drive it while the trainer learns for DURATION
# seconds, then evaluate the base, stable (what users are served) and latest (the trainer's newest) on the held-out
# split of the standard library AND on a second corpus never trained on (every file of a pure-Python PyPI package:
# PyYAML, installed with the venv).
# Usage: [CONFIG=configs/demo.yaml] [EVAL_LIMIT=200] [SECOND_CORPUS=dir] tools/run_demo.sh [DURATION_SECONDS=3000] [STATE_DIR=.onlinerl-demo]
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${1:-3000}
STATE=${2:-.onlinerl-demo}
CONFIG=${CONFIG:-configs/demo.yaml}
EVAL_LIMIT=${EVAL_LIMIT:-200}
BIN=.venv/bin
make setup
SECOND_CORPUS=${SECOND_CORPUS:-$($BIN/python -c 'import yaml, os; print(os.path.dirname(yaml.__file__))')}
mkdir -p "$STATE"
. tools/stack_up.sh
start_local_stack "$CONFIG" "$STATE"
echo "stack is up; simulating for ${DURATION}s"
$BIN/onlinerl simulate --state "$STATE" --duration "$DURATION" --requests 1000000 --concurrency 3 \
  --max-tokens 32 --max-prefix-chars 600 | tee "$STATE/simulate.txt"
$BIN/onlinerl status --state "$STATE" | tee "$STATE/status.txt"
# the base, what users are served at the end (stable) and the trainer's newest version (latest), each once
$BIN/onlinerl eval --state "$STATE" --versions 0,stable,latest --limit "$EVAL_LIMIT" --concurrency 4 \
  --max-tokens 32 --max-prefix-chars 600 | tee "$STATE/eval.txt"
EVALUATED=$($BIN/python -c 'import json, sys; print(",".join(k[1:] for k in json.load(open(sys.argv[1])) if k[0] == "v"))' \
  "$STATE/eval/summary.json")  # the same versions, e.g. 0,32,44
$BIN/onlinerl data build --corpus "$SECOND_CORPUS" --test-fraction 1 --out "$STATE/data-second"
$BIN/onlinerl eval --state "$STATE" --data "$STATE/data-second" --versions "$EVALUATED" --limit "$EVAL_LIMIT" \
  --concurrency 4 --max-tokens 32 --max-prefix-chars 600 --out "$STATE/eval-second" | tee "$STATE/eval-second.txt"
