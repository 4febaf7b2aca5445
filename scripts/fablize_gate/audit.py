"""The audit command: the whole ledger replayed and judged (history.audit_ledger), then what CI
can believe of it — the engine's own gates here, the trust room's (the pin, the policy, the
scope, signatures) and its re-run on the base's tree (rerun) — said once as one verdict, the
job summary and the verdict file CI's last process reads.

Interface: COMMANDS (audit), TRUST_OPTIONS.
"""

import os

from .base import (
    ARCHIVE, count_noun, create_args, defused_line, DONE, EXIT_REFUSED, FablizeError, last_chars,
    one_line, quote_arg, RUNS, SNAPSHOT, STATE_DIRNAME, Step, TIMEOUT_OPTION, TRIPWIRE, usage)
from .history import audit_ledger
from .model import accepted_ids, claimed_final, not_an_event, stories_in, unaddressed_failure
from .render import (
    capped_line, grades_line, next_action, plan_summary, render_report, rerun_command)
from .runs import committed_copy
from .storage import (
    last_line_alone_damaged, loose_snapshot, read_state_file, symlink_refusal, write_atomic)


def cmd_audit(ctx, a):
    """audit: replay the whole ledger (chain, every field, every transition, the snapshot, the
    run logs), then, with the trust room, what CI can believe of it (the pin, the scope, a
    re-run on the base's tree). Every gate that says no is named at once, the verdict first;
    `--summary` writes the same for a CI job summary, also when the ledger is damaged."""
    try:
        audit_and_judge(ctx, a)
    except FablizeError as e:
        if a.summary and not e.detail.get("summarised"):
            write_summary(a.summary, f"❌ audit failed: {e.message}", "")
        raise


def audit_and_judge(ctx, a):
    """The audit itself: replay the whole ledger (locally, or a shared plan as its remote holds
    it) with the trust room's scan alongside; then the gates — independence, logs,
    completeness, secrets, and the trust room's (pin, scope, required checks, witnesses,
    signatures) — and the re-run on the base's tree; then one verdict, every failed gate with
    its reason and fix, the grades, and the job summary. Exit 1 names the first gate."""
    from . import trust, rerun
    opts = {name: getattr(a, name) for name in TRUST_OPTIONS}
    opts["held_out_checks"] = None
    nonce = verdict_nonce() if a.verdict else None
    shared = {"plan": a.plan} if a.remote else None
    opts["isolation"] = rerun.Isolation.choose(a.check_user)  # a name that is none: at once
    wanted = trust.pr_base(ctx.store, a.base) if a.base else None
    if wanted:
        raise trust.not_the_pr_base(a.base, rerun_command(
            ctx.prog, swapped_option(ctx.argv, "--base", wanted)))
    pin, base = trust.pin_of(ctx.store, a.base, a.since, shared)
    policy = trust.base_policy(ctx.store, a.base) if a.base else None
    if policy:  # CI's policy, as the base holds it: the workflow's inputs cannot loosen it
        opts = trust.apply_policy(opts, policy)
    scan = trust.Scan(ctx.store.root, pin)
    report = audited(ctx, a, scan, base)
    plan, recent = report.pop("plan"), report.pop("recent_runs")
    bad_logs = report.pop("bad_logs")
    if bad_logs:
        raise bad_logs[0]
    review = trust.review(ctx.store, plan, scan, pin, base, opts)
    report.update(plan_summary(plan), brief=plan["brief"], accepted=accepted_ids(plan))
    failures = audit_failures(ctx, report, plan, a)
    for warning in review["warnings"]:
        ctx.out.warn(warning)
    failures += trust.gates(ctx.store, plan, review, opts)
    results = rerun.rerun(ctx.store, plan, review, opts, ctx.timeout) if a.rerun or (
        opts["fail_to_pass"] or opts["require_fail_to_pass"]) else None
    if results is not None:
        failures += rerun.failures(results, opts)
    grades = trust.grades(plan, results)
    report["trust"] = {k: v for k, v in review.items()
                       if k not in ("decisions", "warnings", "tree")}
    report["trust"]["tree"] = review["tree"] and {
        k: review["tree"][k] for k in ("scope", "from", "left", "agent_tests")}
    if results is not None:  # `rerun`: a check a row, as before; the rest beside it
        report["rerun"] = results["checks"]
        report["rerun_context"] = {k: v for k, v in results.items() if k != "checks"}
    report.update(grades=grades, failures=failures)
    if claimed_final(plan):  # a warning, not a failure: --require-witnessed fails it
        report["claimed_final"] = plan["goals"][-1]["id"]
    ctx.show(text_audit, report, plan=plan, review=review, results=results)
    verdict = audit_verdict(report)
    if a.summary:
        write_summary(a.summary, None, trust.summary(verdict, failures,
                                                     render_report(plan, recent), review,
                                                     results, grades))
    if a.verdict:
        write_verdict(a.verdict, verdict, failures, results, nonce)
    if failures:  # each gate's fix is said above (and under --json, in `failures`)
        raise FablizeError("audit: " + (f"{failures[0]['message']} — {failures[0]['fix']}"
                                        if len(failures) == 1 else
                                        "; ".join(f["message"] for f in failures) +
                                        " (the fix of each is said above)"),
                           failures[0]["code"], EXIT_REFUSED,
                           failures[0].get("commands") or (),  # the first gate's, whole
                           detail={"summarised": True})


def swapped_option(argv, option, value):
    """`argv` with `option`'s value (`--base X` or `--base=X`) replaced by `value`."""
    out, skip = [], False
    for i, word in enumerate(argv):
        if skip:
            skip = False
            continue
        if word == option and i + 1 < len(argv):
            out += [option, value]
            skip = True
        elif word.startswith(option + "="):
            out.append(f"{option}={value}")
        else:
            out.append(word)
    return out


def audited(ctx, a, scan, base):
    """audit_ledger's report of the plan: a shared plan as its remote holds it (no local state
    needed), else the local state directory's, read as readers read it."""
    if a.remote:
        # the plan CI names, else the one the base's pin names, else the remote's only plan
        plan_id = a.plan or (base or {}).get("plan_id")
        named_by = ("--plan" if a.plan else f"the pin on {base['ref']}" if plan_id else None)
        from . import sharing
        data, logs, which = sharing.audit_source(ctx.store, a.remote, plan_id, named_by)
        # pinned: CI named the plan, or the base's pin did; else the tree under audit chose it
        which["pinned"] = base is not None and base.get("plan_id") == which["plan_id"]
        report = audit_ledger(data, None, a.require_independent_judge, logs=logs, scan=scan)
        report["snapshot"] = "none on a remote (its ledger is the whole of it)"
        report["remote_plan"] = which
        return report
    with ctx.store.plan_session(exclusive=False) as s:
        s.refuse_original()
        for name in (RUNS, ARCHIVE):  # a planted link would have audit read another tree
            if os.path.islink(s.store.path(name)):
                raise symlink_refusal(s.store.path(name))
        snapshot = read_state_file(s.store.path(SNAPSHOT))  # before the ledger, as readers do
        s.ledger.open()
        s.see_lost_newline(loose_snapshot(s.store))
        try:
            return audit_ledger(s.ledger, snapshot, a.require_independent_judge,
                                runs_dir=s.store.path(RUNS), scan=scan)
        except FablizeError as e:
            lineno = e.detail.get("lineno")
            if e.code == "bad_line" and lineno and last_line_alone_damaged(s.ledger):
                raise not_an_event(lineno, last=True) from None  # rebuild sets it aside
            raise


def audit_failures(ctx, report, plan, a):
    """The engine's own gates (the trust room's come after): a verdict not independent, run
    logs missing (--require-logs), a secret recorded, a plan not complete (--require-complete).
    Each with its fix and the step it names, whole (`commands`); what the ledger holds stays
    in it, so a gate the history fails for good is a human's call: a new plan."""
    failures = []
    missing_logs = report["missing_logs"]
    anew = [Step.engine(create_args(force=True))]  # the plan kept whole in archive/
    if report["independence"]:
        failures.append({"code": "judge_not_independent", "message": "a verdict was not given by "
                         "an independent judge — " + "; ".join(report["independence"]),
                         "fix": "the verdict stays in the plan's history, so this plan fails the "
                         "gate for good: a human decides whether to start a new one, whose "
                         "executors checkpoint with --agent and whose judge is another agent",
                         "commands": anew})
    if a.require_logs and missing_logs:
        runs = (os.path.relpath(ctx.store.path(RUNS), ctx.store.root).replace(os.sep, "/")
                if not a.remote else f"{STATE_DIRNAME}/{RUNS}")  # from the clone's top
        failures.append({"code": "missing_logs", "message":
                         f"{count_noun(missing_logs, 'verification run log')} "
                         f"{'is' if missing_logs == 1 else 'are'} missing, so "
                         f"{'that run' if missing_logs == 1 else 'those runs'} cannot be shown to "
                         "have happened", "fix": "commit .fablize/runs/",
                         "commands": (not a.remote and committed_copy(ctx.store, [RUNS])) or [
                             f"git -C \"<the clone that ran them>\" add {quote_arg(runs)}/"]})
    if report["secret_lines"]:
        lines = report["secret_lines"]
        failures.append({"code": "secret_in_ledger", "message":
                         f"{count_noun(len(lines), 'event')} "
                         "recorded what looks like a secret (line " + ", ".join(map(str, lines)) +
                         ") — everyone who can read the plan can read it",
                         "fix": "rotate that secret now: what was committed or shared stays in the "
                         "repository's history (and in this plan's, which fails the gate for "
                         "good: a new plan passes it)", "commands": anew})
    if a.require_complete and not report["complete"]:
        left = [f"{x['id']} [{x['status']}]" for x in plan["goals"] if x["status"] not in DONE]
        action = next_action(ctx.prog, plan)
        failures.append({"code": "incomplete", "message": "trusted but incomplete — "
                         + ", ".join(left), "fix": "finish the plan: `next`, then `checkpoint`",
                         "commands": action.get("commands") or (
                             [action["cmd"]] if action["cmd"] else [f"{ctx.prog} status"])})
    return failures


def audit_verdict(report):
    """The audit's verdict in a line (its text's first, the job summary's heading)."""
    failures, checks = report["failures"], report.get("rerun") or []
    if failures:
        return (f"❌ audit failed: {count_noun(len(failures), 'gate')} said no — " +
                ", ".join(f["code"] for f in failures))
    return ("✅ re-witnessed: every frozen check passed again; " if rerun_passed(checks) else
            "✅ ") + f"audit ok — {report['done']}/{report['total']} done"


def rerun_passed(checks):
    return bool(checks) and all(r["ok"] for r in checks)


def text_audit(data, plan, review, results):
    """What audit says, from its report (`data`): its verdict, every failed gate with its fix,
    the ledger, the head to keep, the plan, the trust room's findings (`review`, and the
    re-run's `results`), the grades, and completed stories whose last observed run failed."""
    from . import trust
    report = data
    ledger_line = (f"{count_noun(report['event_count'], 'event')}, hash chain intact, every event "
                   f"one fablize writes and legal when replayed; snapshot {report['snapshot']}.")
    failures, checks = report["failures"], report.get("rerun") or []
    if failures:
        lines = [f"fablize: {audit_verdict(report)}"] + trust.gate_lines(failures)
        lines.append(f"  ledger: {ledger_line}")
    else:
        lines = ([f"fablize: ✅ re-witnessed — {count_noun(len(checks), 'frozen check')} passed "
                  "again, run by this audit"] if rerun_passed(checks) else [])
        lines.append(f"fablize: audit ok — {ledger_line}")
    lines.append(f"  head: {report['head']}   (keep it; `audit --since` proves later history "
                 "only grew)")
    accepted = report["accepted"]
    lines.append(f"  plan: {report['done']}/{report['total']} done — "
                 f"{defused_line(report['brief'])}"
                 + (f" ({', '.join(accepted)} accepted by a human decision)" if accepted else ""))
    which = report.get("remote_plan")
    if which is not None:
        lines.append(f"  shared plan: {which['plan_id']} as {one_line(which['remote'])} holds it, "
                     f"named by {one_line(which['named_by'])}" + ("" if which["pinned"] else
                     " — unpinned: nothing the pull request cannot write chose it (give --base, "
                     "whose pin names the plan)"))
    if report["torn_tail_bytes"]:
        lines.append(f"  torn tail: {report['torn_tail_bytes']} bytes after the last event — a "
                     "write that never completed; the next writing command moves it aside.")
    missing_logs = report["missing_logs"]
    if missing_logs:
        lines.append(f"  {count_noun(missing_logs, 'run log')} not present here (not "
                     "committed?); their digests are in the ledger.")
    lines += trust.lines(review, results)
    if report["grades"]:
        lines.append("  " + grades_line(report["grades"]))
    if capped_line(plan):  # a warning, not a failure: --require-complete fails the plan
        lines.append("  " + capped_line(plan))
    if "claimed_final" in report:
        lines.append("  " + claimed_final(plan))
    for s in stories_in(plan, "complete"):
        o = unaddressed_failure(s)
        if o is not None:
            lines.append(f"  {s['id']}: the harness last saw "
                         f"`{one_line(last_chars(o['cmd'], 120))}` fail (event {o.get('seq')}) "
                         "before it was checkpointed")
    return lines


def verdict_nonce():
    """The nonce CI's script hands the audit on a descriptor of its own
    (FABLIZE_VERDICT_NONCE_FD), read before any check runs: no check inherits the descriptor,
    none may read the auditor's memory (rerun.Isolation), so a verdict file a check forged lacks
    it. None when no descriptor is named."""
    fd = os.environ.get("FABLIZE_VERDICT_NONCE_FD", "")
    if not fd.isdigit():
        return None
    try:
        with os.fdopen(int(fd), "rb", closefd=True) as f:
            return f.read(256).decode("ascii", "replace").strip() or None
    except (OSError, ValueError):
        raise usage(f"FABLIZE_VERDICT_NONCE_FD={one_line(fd)} names no open descriptor: CI's "
                    "script opens it (`3<<<\"$nonce\"`) for the audit it starts.", "usage")


def write_verdict(path, verdict, failures, results, nonce):
    """The verdict as a file CI's script reads beside the exit code: written last and whole (an
    atomic rename) by the one process that judged. A check that traced the auditor into exiting
    0 leaves no verdict file; one a check wrote itself lacks the nonce."""
    import json
    record = {"schema_version": 1, "ok": not failures, "verdict": verdict,
              "failures": [f["code"] for f in failures], "nonce": nonce,
              "isolation": results["isolation"] if results else None}
    write_atomic(path, (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"), 0o600)


def write_summary(path, verdict, markdown):
    """Append a job summary (Markdown) to `path`: `verdict` alone when the audit could not go
    further (a damaged ledger), else what the audit wrote."""
    text = markdown if verdict is None else f"## {verdict}\n"
    with open(path, "ab") as f:
        if f.tell() > 0:
            f.write(b"\n")
        f.write(text.encode("utf-8") + b"\n")


TRUST_MODEL = """\
Trust model — three grades of evidence:
  claimed       text the agent typed (--evidence, --verify-cmd + --verify-evidence).
  witnessed     the engine ran the command (--run, frozen checks) and recorded its exit
                code, digest and log. It proves the command ran and what it printed, in
                the agent's environment; not that the environment was honest.
  re-witnessed  CI, with its own copy of the engine (python3 -I) and its own environment,
                re-ran the plan's frozen checks on the committed tree (--rerun).
The hash chain proves only that history after a pin grew, not who wrote it. Trust comes
from what the agent cannot write: the base branch's committed ledger and archives (--base),
CI's own re-run (--rerun), checks CI requires (--require-check) and a human's key
(decide --sign, verified with --allowed-signers read from the base branch)."""


def option(*flags, trust=False, **kwargs):
    """A row of OPTIONS: the flags, argparse's options, and whether the trust room answers it."""
    return flags, kwargs, trust


# audit's options in --help's order, the one table the parser and the trust room read: a row
# with trust=True is answered by the trust room (TRUST_OPTIONS); --allow-* only relax its gates
OPTIONS = (
    option("--require-complete", action="store_true",
           help="exit 1 unless every story is complete or accepted"),
    option("--since", trust=True, metavar="[SEQ:]HASH",
           help="exit 3 unless the ledger still holds this earlier head "
                "(history only grew)"),
    option("--require-independent-judge", action="store_true",
           help="exit 1 unless every verdict came from an agent other than the executor"),
    option("--require-logs", action="store_true",
           help="exit 1 unless every verification run has its log present (and matching)"),
    option("--base", trust=True, metavar="REF",
           help="take the pin from the ledger committed at this git ref (e.g. "
                "origin/main); "
                "files named by --allowed-signers are read from it too"),
    option("--allow-new-plan", trust=True, action="store_true",
           help="accept a plan created after the pin (its frozen checks are printed)"),
    option("--allow-imported", trust=True, action="store_true",
           help="accept a plan imported from the original goals.py format after the pin"),
    option("--rerun", trust=True, nargs="?", const="all", choices=["final", "all"],
           help="re-run the frozen checks (of all stories, or of the final one), recording "
                "nothing: with --base and a scope, on the base's tree with the branch's "
                "in-scope files; exit 1 if any fails"),
    option("--scope", trust=True, action="append", default=[], metavar="PATH",
           help="the paths the work may change, as CI gives them (repeatable; wins over "
                "the plan's): the re-run takes only these from the branch"),
    option("--require-scope", trust=True, action="store_true",
           help="exit 1 unless a scope is known (CI's, or the plan's as the base holds it)"),
    option("--forbid-out-of-scope", trust=True, action="store_true",
           help="with --base: exit 1 if the branch changed files outside the scope"),
    option("--fail-to-pass", trust=True, action="store_true",
           help="with --base: also run the final story's frozen checks on the base's tree "
                "alone and say which of their tests failed there and pass now"),
    option("--require-fail-to-pass", trust=True, action="store_true",
           help="with --base: exit 1 unless a test of the final story's checks fails on "
                "the base's tree and passes with the branch (or, with --agent-tests "
                "prove, an agent-written test is proven red → green)"),
    option("--agent-tests", trust=True, choices=["prove", "forbid"],
           help="with --base and a scope: test files the branch adds run apart, red on the "
                "base's code and green on the branch's, and may carry fail-to-pass "
                "(prove); or fail the audit (forbid). Default: listed as changes outside "
                "the scope. The base's policy wins"),
    option("--check-user", trust=True, metavar="NAME",
           help="run each re-run check as this user (the audit runs as root): checks "
                "can then neither trace, signal nor write what the auditor writes"),
    option("--verdict", metavar="FILE",
           help="also write the verdict as JSON to FILE, last and whole (CI's script "
                "reads it beside the exit code)"),
    option("--summary", metavar="FILE",
           help="append the verdict, every failed gate and the report to FILE as Markdown "
                "(a CI job summary), even when the ledger is damaged"),
    option("--require-check", trust=True, action="append", default=[], metavar="CMD",
           help="exit 1 unless the final story carries exactly this frozen check "
                "(repeatable; with --rerun it must pass)"),
    option("--require-witnessed", trust=True, action="store_true",
           help="exit 1 unless every completed story rests on its frozen checks run by "
                "the engine (not a claim, not an ad-hoc --run)"),
    option("--require-clean-runs", trust=True, action="store_true",
           help="exit 1 if a run was made outside the repository root, on a dirty tree, "
                "or under an environment different from the plan's first run"),
    option("--allowed-signers", trust=True, metavar="PATH",
           help="exit 1 unless every decision is signed (decide --sign) by a key in this "
                "ssh allowed-signers file"),
    option("--forbid-tripwires", trust=True, action="store_true",
           help=f"with --base and a scope: exit 1 if the branch's code inside the scope "
                f"{TRIPWIRE}, unless the final story was accepted by a decision signed by an "
                "--allowed-signers key"),
    option("--forbid-accepted", trust=True, action="store_true",
           help="exit 1 if any story was accepted by a decision instead of completed"),
    option("--require-unchanged-checks", trust=True, action="store_true",
           help="with --base: exit 1 if a file a frozen check runs differs from the base "
                "branch (a frozen `python3 check.py` is only as good as check.py)"),
    option(*TIMEOUT_OPTION[0], **TIMEOUT_OPTION[1]),
    option("--remote", metavar="NAME",
           help="audit the shared plan as this git remote holds it (fetched; no local "
                "state needed)"),
    option("--plan", metavar="ID",
           help="with --remote: which shared plan (default: the only one)"),
)
TRUST_OPTIONS = tuple(flags[0][2:].replace("-", "_") for flags, _, trust in OPTIONS if trust)


def add_audit(command):
    c = command("audit", cmd_audit, "check that the whole ledger can be trusted",
                "replay every line: hash chain, every field, every transition, the snapshot and "
                "the run logs")
    c.epilog, c.raw_epilog = TRUST_MODEL, True
    for flags, kwargs, _ in OPTIONS:
        c.add_argument(*flags, **kwargs)


COMMANDS = {"audit": add_audit}
