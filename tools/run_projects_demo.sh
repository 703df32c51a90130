#!/usr/bin/env bash
# Per-project adapters, end to end (issue 39): two simulated projects on different code drive one stack for DURATION
# seconds under the product's defaults with per-project adapters on (configs/projects-demo.yaml). Then, for each
# project, the base, the shared policy (trained on both projects' traffic) and the project's own adapter are
# evaluated on that project's held-out code (paired), and the canary isolation is measured on beta's code before
# and after (tools/project_canary.py).
# Each project's simulated users Tab by their own habit (onlinerl/loop/user_model.py), the same in training and in
# evaluation: alpha's team takes a line at a time (a multi-line block is dismissed), beta's team takes whole blocks
# (a single line is dismissed; a block whose first line is right is taken). The two habits reward one decision, to
# stop after the first line or to go on, in opposite directions: what a shared policy cannot serve both ways, and an
# adapter of their own is for. BETA_USERS="--min-prefix-chars 20" gives the run of 2026-12-05; ALPHA_USERS=
# BETA_USERS= (empty) gives both the default user, the run of 2026-11-28 (docs/demo.md "Two projects").
# Usage: [EVAL_LIMIT=150] [CONCURRENCY=2] [BETA_CORPUS=dir] [ALPHA_USERS=...] [BETA_USERS=...]
#        tools/run_projects_demo.sh [DURATION_SECONDS=3600] [STATE_DIR=.onlinerl-projects]
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${1:-3600}
STATE=${2:-.onlinerl-projects}
CONFIG=${CONFIG:-configs/projects-demo.yaml}
EVAL_LIMIT=${EVAL_LIMIT:-150}
CONCURRENCY=${CONCURRENCY:-2}
BIN=.venv/bin
ALPHA_USERS=${ALPHA_USERS---single-line}
BETA_USERS=${BETA_USERS---whole-blocks}
users_of() { if [ "$1" = alpha ]; then echo "$ALPHA_USERS"; else echo "$BETA_USERS"; fi; }
make setup
BETA_CORPUS=${BETA_CORPUS:-$($BIN/python -c 'import networkx, os; print(os.path.dirname(networkx.__file__))')}
mkdir -p "$STATE"
[ -f "$STATE/data-alpha/test.jsonl" ] || {
  $BIN/onlinerl data build --out "$STATE/data-alpha"
  $BIN/python tools/project_canary.py plant "$STATE/data-alpha" | tee "$STATE/canary-planted.json"
}
[ -f "$STATE/data-beta/test.jsonl" ] || $BIN/onlinerl data build --corpus "$BETA_CORPUS" --out "$STATE/data-beta"
. tools/stack_up.sh
start_local_stack "$CONFIG" "$STATE"
$BIN/python tools/project_canary.py measure --state "$STATE" --data "$STATE/data-beta" --own "$STATE/data-alpha" --lines alpha,beta \
  --out "$STATE/canary-before.json" > /dev/null
echo "stack is up; simulating alpha and beta for ${DURATION}s"
SIMS=()
for P in alpha beta; do
  $BIN/onlinerl simulate --state "$STATE" --tenant $P --data "$STATE/data-$P" --duration "$DURATION" \
    --requests 1000000 --concurrency "$CONCURRENCY" --max-tokens 32 --max-prefix-chars 600 --seed $([ $P = alpha ] && echo 1 || echo 2) \
    --timeline "$STATE/timeline-$P.jsonl" $(users_of $P) > "$STATE/simulate-$P.txt" 2>&1 &
  SIMS+=($!)
done
wait "${SIMS[@]}"
cat "$STATE/simulate-alpha.txt" "$STATE/simulate-beta.txt"
$BIN/onlinerl status --state "$STATE" | tee "$STATE/status.txt"
for P in alpha beta; do
  # the base, the shared policy's newest (trained on both projects) and the project's own newest, each once
  $BIN/onlinerl eval --state "$STATE" --tenant $P --data "$STATE/data-$P" --versions "0,latest,$P:latest" \
    --limit "$EVAL_LIMIT" --concurrency 4 --max-tokens 32 --max-prefix-chars 600 --out "$STATE/eval-$P" \
    --timeline "$STATE/timeline-$P.jsonl" $(users_of $P) | tee "$STATE/eval-$P.txt"
  # the bar: the project's adapter against the shared policy, paired on the same samples, judged by the same users
  SHARED=$(cd "$STATE/eval-$P" && ls v*.jsonl | grep -v '^v0\.jsonl$' | sed 's/\.jsonl$//' | head -1)
  OWN=$(cd "$STATE/eval-$P" && ls "$P"-v*.jsonl | sed 's/\.jsonl$//' | head -1)
  $BIN/onlinerl eval --from-results "$STATE/eval-$P" --runs "$SHARED,$OWN" --out "$STATE/eval-$P/own-vs-shared" \
    $(users_of $P) | tee "$STATE/eval-$P-own-vs-shared.txt"
done
$BIN/python tools/project_canary.py measure --state "$STATE" --data "$STATE/data-beta" --own "$STATE/data-alpha" --lines alpha,beta \
  --out "$STATE/canary-after.json"
