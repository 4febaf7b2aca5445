"""fablize's engine: "done" is refused until it is shown.

A task is split into stories (`create`). `next` activates one and prints the handoff a fresh
session needs; `checkpoint` completes it only with evidence; the final story is a verification
gate that needs the command that was run and its result, and the engine can run that command
itself (`--run`, frozen checks), so a claimed pass cannot be faked. Stories that fail come back
as a new round with what was missing; stories that cannot be done halt the plan until a human
decides.

Invariants, enforced in code (model) and re-checked by `audit` on every event:
  1. a story is checkpointed only after `next` activated it;
  2. `complete` needs non-blank evidence;
  3. the final story completes only with verification: --verify-cmd and --verify-evidence, a
     witnessed run (--run), or all its frozen checks passing in a run made after its latest
     activation;
  4. the state persists under .fablize/, so `status` resumes a dead session.

Files (the state directory, normally .fablize/ at the repository root):
  goals.json    snapshot of the plan; rewritten atomically; derivable from the ledger
  ledger.jsonl  the source of truth: append-only, one event a line, hash-chained
  lock          the lock file, never renamed
  runs/         full output of verification runs the engine executed itself
  archive/      plans replaced by `create --force`, kept whole

Layers, each imported only by those after it (a room is imported by the command that needs it,
when it needs it, so a start loads only what it runs):
  base       constants, FablizeError (the one exception type), small helpers
  masking    secrets and this machine's places, kept out of what is recorded
  model      stories, events, transitions with their log lines, the gates, Replay (pure)
  storage    discovery (the state directory, the repository's root), files, lock, ledger,
             snapshot, transactions, streaming replay
  history    the whole ledger replayed and judged, event by event (audit_ledger)
  runs       the one place processes start: git, tools, checks, provenance
  render     handoff, status, session start, plan map, report, and each command's text drawn
             from its result (text_*): text only
  hooks      what an agent's harness runs, each a command: guard, observe, status --resume
             (and the sharing room's door, which they share with the commands)
  commands   one function a command: it states one result, `ctx.show(text_x, fields, **view)`
             — its --json fields, the text_ renderer that draws its text from them, and the
             state they describe (the plan); a room's commands render in the room
  cli        the parser, Output (the one result), Context (what opening the state directory
             does) and `main`, the one exit point, where the result is rendered once, as text
             or as the --json envelope, and an error is said once; a hook's line is read without the
             parser, and a hook's start loads neither commands nor runs (a hook runs at every
             tool call: tools/bench.py --hooks holds each to 1.3 times a floor script doing its
             file work)
Rooms use the layers below commands through the names they import from them, and are loaded
by the command line only for their own commands: audit (the audit command: its gates, the
trust room's and the re-run's assembled into one verdict; its options one table), setup
(setup, doctor, install-block, completion), sharing (share, sync, release, create --remote,
audit --remote; its git runner in sharing_git), merge (merge-driver, install-merge), trust
(audit's --base/--since/--rerun and --require-* gates, decide --sign; CI's re-run of the checks
in rerun, a test runner's own report in reports, CI's last process in verdict) and setup_ci
(setup github, doctor github).

scripts/goals.py, beside this folder, is the one way in: it loads this package by its path.
scripts/ holds what a user copies (goals.py, this folder, and fablize.py for hooks written by
3.0); the developer's tools are in the checkout's tools/ (demo.sh, bench.py, dist.py), and CI's
script fablize-ci.sh beside action.yml.
Exit codes: 0 done, 1 refused, 2 usage, 3 damaged; 128 + N when signal N stopped a run.
Stdlib only, Python 3.9+.
"""

__version__ = "3.0.0"
