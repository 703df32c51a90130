#!/usr/bin/env bash
# One candidate of the offline algorithm screen (bench/replay_samples.py says why): start a stack on CONFIG, feed its
# trainer the archived samples, wait until every one is acknowledged, then evaluate the last version on the held-out
# split (Continue's temperature) and compare it with the base's results in BASE_RESULTS (a v0.jsonl of the same
# split and limit, e.g. from a run's `onlinerl eval`; EVAL_BASE=1 evaluates v0 in this run instead).
# RESCORE=1 recomputes every archived reward with CONFIG's feedback.reward (e.g. the cursor preset on a chars run).
# Usage: [REWARDS=1,0 | RESCORE=1] [EVAL_LIMIT=200] [DATA=.onlinerl-demo12/data] [BASE_RESULTS=.onlinerl-demo12/eval/v0.jsonl]
#        bench/replay_screen.sh CONFIG STATE ARCHIVE.jsonl [ARCHIVE.jsonl ...]
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=$1
STATE=$2
shift 2
EVAL_LIMIT=${EVAL_LIMIT:-200}
DATA=${DATA:-.onlinerl-demo12/data}
BASE_RESULTS=${BASE_RESULTS:-.onlinerl-demo12/eval/v0.jsonl}
BIN=.venv/bin
rm -rf "$STATE"
mkdir -p "$STATE"
$BIN/onlinerl --config "$CONFIG" up --state "$STATE" > "$STATE/up.log" 2>&1 &
UP_PID=$!
trap 'kill -TERM $UP_PID 2>/dev/null; wait $UP_PID 2>/dev/null || true' EXIT
trap 'exit 130' INT TERM  # a stopped screen stops its stack too (through the EXIT trap)
until grep -q "onlinerl is up" "$STATE/up.log"; do
  kill -0 $UP_PID 2>/dev/null || { echo "stack failed to start:"; tail -30 "$STATE/up.log"; exit 1; }
  sleep 2
done
START=$(date +%s)
$BIN/python bench/replay_samples.py inject --state "$STATE" --archive "$@" ${REWARDS:+--rewards "$REWARDS"} ${RESCORE:+--rescore}
VERSION=$($BIN/python bench/replay_samples.py wait --state "$STATE" | tail -1)
echo "trained into v$VERSION in $(( $(date +%s) - START )) s"
$BIN/python bench/replay_samples.py updates "$STATE/logs/trainer.log" | tee "$STATE/updates.json"
VERSIONS=$VERSION
[ "${EVAL_BASE:-0}" = 1 ] && VERSIONS="0,$VERSION"
$BIN/onlinerl eval --state "$STATE" --data "$DATA" --versions "$VERSIONS" --limit "$EVAL_LIMIT" --concurrency 4 \
  --max-tokens 32 --max-prefix-chars 600 --out "$STATE/eval" > "$STATE/eval-own.txt"
[ -f "$STATE/eval/v0.jsonl" ] || cp "$BASE_RESULTS" "$STATE/eval/v0.jsonl"
$BIN/onlinerl eval --state "$STATE" --from-results "$STATE/eval" --out "$STATE/eval" | tee "$STATE/eval.txt"
