#!/usr/bin/env bash
# End-to-end check of the app as a person uses it: start `ninfer` in tmux on the default model, type a message,
# read the screen, and check the reply arrived and the session was saved. Usage: bash scripts/tui_smoke.sh
set -euo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then sed -n '2,3p' "$0" | sed 's/^# //'; exit 0; fi
command -v tmux >/dev/null || { echo "tmux is not installed (apt-get install tmux)"; exit 2; }
home=$(mktemp -d)
export NINFER_CONFIG_DIR=$home/config NINFER_DATA_DIR=$home/data NINFER_STATE_DIR=$home/state
mkdir -p "$NINFER_CONFIG_DIR/profiles"
printf 'extends = "cpu-default"\n[sampling]\ntemperature = 0.0\nmax_tokens = 16\n' > "$NINFER_CONFIG_DIR/profiles/smoke.toml"
s=ninfer-smoke-$$
tmux new-session -d -s "$s" -x 120 -y 36 "ninfer --profile smoke"
trap 'tmux kill-session -t "$s" 2>/dev/null || true; rm -rf "$home"' EXIT
for _ in $(seq 120); do tmux capture-pane -p -t "$s" | grep -q "GPU mem" && break; sleep 0.5; done
tmux send-keys -t "$s" "What is the capital of France?" Enter
for _ in $(seq 120); do tmux capture-pane -p -t "$s" | grep -q "tok/s" && break; sleep 0.5; done
screen=$(tmux capture-pane -p -t "$s")
echo "$screen"
echo "$screen" | grep -q "assistant" || { echo "FAIL: no reply on screen"; exit 1; }
tmux send-keys -t "$s" C-q
sleep 1
python3 - "$NINFER_DATA_DIR/sessions.db" <<'PY'
import sqlite3, sys
rows = sqlite3.connect(sys.argv[1]).execute("SELECT role, length(content) FROM messages ORDER BY id").fetchall()
assert [r[0] for r in rows] == ["user", "assistant"] and rows[1][1] > 0, rows
print("OK: reply shown and session saved:", rows)
PY
