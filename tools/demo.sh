#!/usr/bin/env bash
# The ten-second pitch: a real bug, a real test under a frozen check, an agent that claims
# "fixed" too early, the round that comes back with what was missing, and an edited ledger
# that `audit` catches. Every command is shown as typed. Exits non-zero if any gate
# misbehaves (a refusal that does not come, or comes with the wrong exit code).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
cd "$TMP"
git init -q 2>/dev/null || mkdir .git  # a project root: the state goes to ./.fablize/

# Engine output is shown whole; lines longer than 120 characters wrap at a space.
goals() { "$PY" "$ROOT/scripts/goals.py" "$@" 2>&1 | fold -s -w 120; }
BOLD="" PLAIN=""
if [ -t 1 ]; then BOLD=$'\033[1m' PLAIN=$'\033[0m'; fi
# A command as it would be typed; a long one continues on the next line before each option.
typed() {
  local line="$*"
  if [ "${#line}" -gt 100 ]; then line="$(printf '%s' "$line" | sed 's/ --/ \\\n    --/g')"; fi
  printf '\n%s$ %b%s\n' "$BOLD" "$line" "$PLAIN"
}
quoted() {
  local a out=""
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./:=@%+-]+$ ]]; then out+="$a "; else out+="\"$a\" "; fi
  done
  printf '%s' "${out% }"
}

# `expect CODE goals.py ARGS…`: show the command, run it, and stop the demo unless it exits CODE.
expect() {
  local want="$1" rc=0
  shift 2
  typed "goals.py $(quoted "$@")"
  goals "$@" || rc=$?
  if [ "$rc" -ne "$want" ]; then
    echo "demo: expected exit $want, got exit $rc: goals.py $*" >&2
    exit 1
  fi
  case "$rc" in 1) echo "(exit 1: refused)" ;; 3) echo "(exit 3: damaged)" ;; esac
}

cat > calc.py <<'EOF'
def add(a, b):
    return a
EOF
cat > test_calc.py <<'EOF'
from calc import add
assert add(2, 3) == 5, f"add(2, 3) returned {add(2, 3)}, expected 5"
print("test_calc: 1 passed")
EOF

typed "cat test_calc.py"
cat test_calc.py

expect 0 goals.py create --brief "Fix add() in calc.py" \
  --goal "Fix add::add(2, 3) returns 5" --goal "Verify::the tests pass" \
  --check "G001=python3 test_calc.py" --verify "python3 test_calc.py"

typed "goals.py next | head -n 2"
goals next | head -n 2

# The agent says "fixed" without fixing: the engine runs the frozen check itself.
expect 1 goals.py checkpoint --id G001 --status complete --evidence "fixed add()"
expect 0 goals.py checkpoint --id G001 --status failed \
  --evidence "add() ignores b: the test says add(2, 3) returned 2"

typed "goals.py next | grep -A 4 'What was missing'"
goals next | grep -A 4 'What was missing'

# The fix makes calc.py longer, as a real one does. (Python trusts the bytecode it cached for
# calc.py while the file's size and its modification time, in whole seconds, are unchanged: an
# edit of the same size within the second of the last run would run the old code again.)
typed "sed -i.orig 's/return a$/return a + b/' calc.py"
sed -i.orig 's/return a$/return a + b/' calc.py && rm -f calc.py.orig

expect 0 goals.py checkpoint --id G001 --status complete --evidence "add() adds; test_calc passes"
typed "goals.py next | head -n 1"
goals next | head -n 1
expect 0 goals.py checkpoint --id G002 --status complete --evidence "the suite is green"
expect 0 goals.py status

# Someone rewrites history to hide the failed round: the hash chain gives it away.
typed "sed -i.orig 's/ignores b/was fine/' .fablize/ledger.jsonl"
sed -i.orig 's/ignores b/was fine/' .fablize/ledger.jsonl && rm -f .fablize/ledger.jsonl.orig
expect 3 goals.py audit

printf '\nDemo finished — every gate behaved: the claim was refused until the test passed,\n'
printf 'the failed round came back with what was missing, and the edited ledger was caught.\n'
