#!/usr/bin/env bash
# fablize's CI audit: what action.yml runs, and what any other CI can run the same way.
# The engine is a copy kept outside the tree under audit, started with `python3 -I` (no
# PYTHONPATH, no user site, no script directory on sys.path), so nothing the pull request
# commits can change the auditor. The pin comes from the base branch; the frozen checks are
# re-run here, in CI's own environment.
#
# Settings (environment): FABLIZE_BASE (git ref, e.g. origin/main), FABLIZE_REQUIRED_CHECKS
# (one command a line), FABLIZE_ALLOWED_SIGNERS (path, read from the base ref),
# FABLIZE_ALLOW_NEW_PLAN, FABLIZE_SKIP_IF_NO_PLAN (true/false), FABLIZE_RERUN (all|final),
# FABLIZE_STATE (default .fablize), FABLIZE_REPORT (a file; default $GITHUB_STEP_SUMMARY).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="$(mktemp -d "${RUNNER_TEMP:-${TMPDIR:-/tmp}}/fablize-engine.XXXXXX")"
cp "$here/goals.py" "$here"/fablize_*.py "$work/"
engine=(python3 -I "$work/goals.py")
state="${FABLIZE_STATE:-.fablize}"

if [ ! -s "$state/ledger.jsonl" ] && [ "${FABLIZE_SKIP_IF_NO_PLAN:-false}" = "true" ]; then
  # skipping is for trees that never had a plan: deleting the base's plan is not finishing it
  if [ -n "${FABLIZE_BASE:-}" ] && git cat-file -e "$FABLIZE_BASE:./$state/ledger.jsonl" 2>/dev/null; then
    echo "fablize: $FABLIZE_BASE has a plan in $state but this tree has none — it was removed, not finished." >&2
    exit 1
  fi
  echo "fablize: no plan in $state — nothing to audit (skip-if-no-plan)."
  exit 0
fi

args=(--dir "$state" audit --require-complete --require-witnessed --rerun "${FABLIZE_RERUN:-all}")
if [ -n "${FABLIZE_BASE:-}" ]; then
  args+=(--base "$FABLIZE_BASE")
fi
while IFS= read -r check; do
  if [ -n "$check" ]; then
    args+=(--require-check "$check")
  fi
done <<< "${FABLIZE_REQUIRED_CHECKS:-}"
if [ -n "${FABLIZE_ALLOWED_SIGNERS:-}" ]; then
  args+=(--allowed-signers "$FABLIZE_ALLOWED_SIGNERS")
fi
if [ "${FABLIZE_ALLOW_NEW_PLAN:-false}" = "true" ]; then
  args+=(--allow-new-plan)
fi

status=0
"${engine[@]}" "${args[@]}" || status=$?
report="${FABLIZE_REPORT:-${GITHUB_STEP_SUMMARY:-}}"
if [ -n "$report" ] && [ -s "$state/ledger.jsonl" ]; then
  "${engine[@]}" --dir "$state" report --out "$report.fablize" || true
  if [ -f "$report.fablize" ]; then
    cat "$report.fablize" >> "$report"
    rm -f "$report.fablize"
  fi
fi
rm -rf "$work"
exit "$status"
