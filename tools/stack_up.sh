# Sourced by the demo scripts (tools/run_demo.sh, tools/run_projects_demo.sh): start `onlinerl up` on CONFIG with
# state STATE in the background, stop it when the calling script exits, and return once the stack says it is up
# (or fail with the tail of its log). Sets UP_PID.
start_local_stack() {
  local config=$1 state=$2
  .venv/bin/onlinerl --config "$config" up --state "$state" > "$state/up.log" 2>&1 &
  UP_PID=$!
  trap 'kill -TERM $UP_PID 2>/dev/null; wait $UP_PID 2>/dev/null || true' EXIT
  until grep -q "onlinerl is up" "$state/up.log"; do
    kill -0 $UP_PID 2>/dev/null || { echo "stack failed to start:"; tail -30 "$state/up.log"; exit 1; }
    sleep 2
  done
}
