#!/usr/bin/env bash
# fablize's CI audit: what action.yml runs, and what any other CI can run the same way.
#
# The engine is a copy kept outside the tree under audit, started with `python3 -I` (no
# PYTHONPATH, no user site, no script directory on sys.path), so nothing the pull request commits
# can change the auditor. The pin comes from the base branch; the frozen checks are re-run by CI
# itself, on the base's tree with only the pull request's files inside the work's scope taken
# over (its tests, conftest.py, tool configuration and build files come from the base). The
# verdict and the job summary are written by that one engine process, and nothing runs after it.
#
# Settings (environment):
#   FABLIZE_BASE             git ref of the base branch (e.g. origin/main): the pin and the tree
#   FABLIZE_SCOPE            the paths the work may change, one a line (wins over the plan's)
#   FABLIZE_REQUIRE_SCOPE    true (default): fail a plan with no scope known
#   FABLIZE_REQUIRED_CHECKS  frozen checks the final story must carry, one command a line
#   FABLIZE_FAIL_TO_PASS     true: fail a final check that already passes on the base alone
#   FABLIZE_FORBID_OUT_OF_SCOPE  true: fail a branch that changed files outside the scope
#   FABLIZE_FORBID_TRIPWIRES     true (default): fail in-scope code that reaches into the test
#                                run or looks for CI or the audit (unless a signed accept)
#   FABLIZE_REQUIRE_WITNESSED    true (default): every completed story rests on engine runs
#   FABLIZE_ALLOWED_SIGNERS  path of an ssh allowed-signers file (read from the base ref)
#   FABLIZE_ALLOW_NEW_PLAN   true: accept a plan created after the pin
#   FABLIZE_SKIP_IF_NO_PLAN  true: succeed when the tree has no plan (and the base had none)
#   FABLIZE_AGENT_TESTS      prove: test files the branch adds run red (base) → green (branch) and
#                            may carry fail-to-pass; forbid: they fail the audit (the policy wins)
#   FABLIZE_CHECK_USER       run each re-run check as this user (the audit then runs as root)
#   FABLIZE_REMOTE, FABLIZE_PLAN  audit a shared plan: the remote and the plan id CI names
#   FABLIZE_STATE            the state directory (default .fablize); the policy is always read
#                            at .fablize/policy.json on the base, wherever this points
#   FABLIZE_REPORT           the job summary file (default $GITHUB_STEP_SUMMARY)
#
# The verdict is the engine's exit code AND the verdict file it writes last, holding a nonce
# handed to it on a descriptor no check inherits (fablize_gate/verdict.py, which this script
# becomes): a check that traced the auditor into exiting 0, or wrote a verdict of its own,
# passes nothing.
#
# The whole script is one brace group, read by bash before any of it runs: a check that rewrites
# this file while the audit runs changes nothing of what follows.
{
set -euo pipefail

is_true() { [ "${1:-}" = "true" ]; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"  # the action's checkout: action.yml beside
work="$(mktemp -d "${RUNNER_TEMP:-${TMPDIR:-/tmp}}/fablize-engine.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cp -R "$here/scripts/goals.py" "$here/scripts/fablize_gate" "$work/"
rm -rf "$work/fablize_gate/__pycache__"
state="${FABLIZE_STATE:-.fablize}"
report="${FABLIZE_REPORT:-${GITHUB_STEP_SUMMARY:-}}"

if [ -z "${FABLIZE_REMOTE:-}" ] && [ ! -s "$state/ledger.jsonl" ] && is_true "${FABLIZE_SKIP_IF_NO_PLAN:-false}"; then
  # skipping is for trees that never had a plan: deleting the base's plan is not finishing it,
  # and a base with CI's policy (.fablize/policy.json, wherever FABLIZE_STATE points) is audited
  if [ -n "${FABLIZE_BASE:-}" ]; then
    for held in "./$state/ledger.jsonl" ./.fablize/ledger.jsonl ./.fablize/policy.json; do
      if git cat-file -e "$FABLIZE_BASE:$held" 2>/dev/null; then
        echo "fablize: $FABLIZE_BASE holds ${held#./} but this tree has no plan in $state — it was removed or moved, not finished." >&2
        exit 1
      fi
    done
  fi
  echo "fablize: no plan in $state — nothing to audit (skip-if-no-plan)."
  exit 0
fi

args=(--dir "$state" audit --require-complete --rerun all)
if is_true "${FABLIZE_REQUIRE_WITNESSED:-true}"; then args+=(--require-witnessed); fi
if [ -n "${FABLIZE_BASE:-}" ]; then args+=(--base "$FABLIZE_BASE"); fi
while IFS= read -r path; do
  if [ -n "$path" ]; then args+=(--scope "$path"); fi
done <<< "${FABLIZE_SCOPE:-}"
if is_true "${FABLIZE_REQUIRE_SCOPE:-true}"; then args+=(--require-scope); fi
while IFS= read -r check; do
  if [ -n "$check" ]; then args+=(--require-check "$check"); fi
done <<< "${FABLIZE_REQUIRED_CHECKS:-}"
if is_true "${FABLIZE_FAIL_TO_PASS:-false}"; then args+=(--require-fail-to-pass); fi
if is_true "${FABLIZE_FORBID_OUT_OF_SCOPE:-false}"; then args+=(--forbid-out-of-scope); fi
if [ -n "${FABLIZE_BASE:-}" ] && is_true "${FABLIZE_FORBID_TRIPWIRES:-true}"; then args+=(--forbid-tripwires); fi
if [ -n "${FABLIZE_ALLOWED_SIGNERS:-}" ]; then args+=(--allowed-signers "$FABLIZE_ALLOWED_SIGNERS"); fi
if is_true "${FABLIZE_ALLOW_NEW_PLAN:-false}"; then args+=(--allow-new-plan); fi
if [ -n "${FABLIZE_AGENT_TESTS:-}" ]; then args+=(--agent-tests "$FABLIZE_AGENT_TESTS"); fi
if [ -n "${FABLIZE_CHECK_USER:-}" ]; then args+=(--check-user "$FABLIZE_CHECK_USER"); fi
if [ -n "${FABLIZE_REMOTE:-}" ]; then
  if [ -z "${FABLIZE_PLAN:-}" ]; then
    echo "fablize: FABLIZE_REMOTE needs FABLIZE_PLAN: CI names the shared plan it audits, never the tree." >&2
    exit 1
  fi
  args+=(--remote "$FABLIZE_REMOTE" --plan "$FABLIZE_PLAN")
fi
if [ -n "$report" ]; then args+=(--summary "$report"); fi

# the verdict: the job's last process is the engine's own verdict.py (exec: no shell of this
# script is left for a check to trace): it is untraceable, hands the audit a nonce, and passes
# only on the exit code and the verdict file holding that nonce, together; it removes $work
trap - EXIT
exec python3 -I "$work/fablize_gate/verdict.py" --remove "$work" -- "$work/goals.py" "${args[@]}"
}
