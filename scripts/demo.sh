#!/usr/bin/env bash
# End-to-end demo of the fablize engine on a throwaway plan: every gate is shown
# refusing, then passing. Exits 0 only if the engine behaves as documented.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
STATE="$TMP/.fablize"
cd "$TMP"

goals() { "$PY" "$ROOT/scripts/goals.py" --dir "$STATE" "$@"; }

# A gate must say no with exit 1; anything else (0, usage 2, damage 3) is a failure.
refused() {
  local rc=0
  goals "$@" || rc=$?
  if [ "$rc" -ne 1 ]; then
    echo "demo: expected a refusal (exit 1), got exit $rc: goals.py $*" >&2
    exit 1
  fi
}

echo "### Create a 3-story plan; G002's acceptance check is frozen with the plan"
goals create --brief "Add a --version flag" \
  --goal "Parse flag::accept --version on the command line" \
  --goal "Print version::write the version to version.txt" \
  --goal "Verify::run the tests" \
  --check G002="test -s version.txt"

echo "### Start the first story"
goals next

echo "### Claim G001 done without evidence: refused"
refused checkpoint --id G001 --status complete

echo "### Complete G001 with evidence"
goals checkpoint --id G001 --status complete \
  --evidence "argparse accepts --version; python3 cli.py --version exits 0"

echo "### Next story"
goals next

echo "### Claim G002 done before the work exists: the engine runs the frozen check — refused"
refused checkpoint --id G002 --status complete --evidence "version printing done"

echo "### Do the work, then complete G002: the frozen check passes"
echo "1.0.0" > version.txt
goals checkpoint --id G002 --status complete --evidence "version.txt holds 1.0.0"

echo "### Final story"
goals next

echo "### Claim the final story done without verification: refused"
refused checkpoint --id G003 --status complete --evidence "all done"

echo "### Complete the final story: the engine runs the verification itself (--run)"
goals checkpoint --id G003 --status complete --evidence "the test suite passes" \
  --run --verify-cmd "python3 -c 'print(\"3 passed\")'"

echo "### Status"
goals status

echo "### Audit the ledger and the snapshot"
goals audit

echo "### The history, from the ledger"
goals log

echo "### The ledger itself: one event a line, each chained to the previous by hash (first 2)"
head -n 2 "$STATE/ledger.jsonl"

echo "### Demo finished: every gate behaved"
