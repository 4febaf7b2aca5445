"""The commands: each opens the plan, lets the transitions judge the events it builds, and
returns its result once (ctx.show: its --json fields, and the render.text_* function that draws its
text from them), rendered by cli.Output.
"""

import collections
import os
import time

from .base import (
    blank, clean, count_noun, create_args, DONE,
    EXIT_SIGNAL_BASE, FablizeError, LEDGER, limit_text, new_plan_id, no_plan,
    now_iso, one_line, parse_ids, PLAN_EXISTS, refused, REPORT_RUNS, scope_pattern, SNAPSHOT,
    split_assignment, Step, story_id, TRIPWIRE, usage, ZERO_HASH)
from .masking import check_command, mask, masked_text, plan_text
from .model import (
    active_stories, apply_event, checkpoint_args,
    checkpoint_gate, current_packet, EVIDENCE_NOTES, find_story,
    guard_capped, guard_paused, observed_of,
    parse_event, pick_ready, plan_done, run_passed, run_summary,
    unaddressed_failure)
from .storage import (
    commit_start, free_name, loose_snapshot,
    replay_all, shown_path, user_file, within, write_atomic)
from .runs import (
    committed_copy, commit_runs, drop_temp_logs, execute_runs,
    inflight_runs, tree_state, unverifiable_checks, verification_runs)
from .render import (
    human_command, inflight_json, judge_packet, next_action, plan_json, plan_summary,
    render_handoff, render_report, rerun_command, sequential, story_json, TAKE_TURNS, text_add,
    text_checkpoint, text_create, text_decide, text_judge_packet, text_log, text_next,
    text_pause, text_rebuild, text_report, text_status, text_unpause, text_verify)
from .hooks import read_plan_and_share, session_start, sharing_of, sharing_room


def stop_if_interrupted(ctx, records):
    """After a run a signal cut short: record the runs (the interrupted one says so) when the
    state can still be written, else remove their temp logs; then stop with exit 128 + N."""
    hit = next((r for r in records if r.get("interrupted")), None)
    if hit is None:
        return
    import signal
    name, sid = hit["interrupted"], hit["id"]
    try:
        with ctx.store.plan_session() as s:
            s.require_plan()
            runs = commit_runs(s, records)
        ctx.data["runs"] = runs
        fate = (f"recorded as interrupted (event {runs[-1]['seq']}, log "
                f"{shown_path(ctx.store, runs[-1]['log'])})")
    except (FablizeError, OSError) as e:
        drop_temp_logs(records)
        fate = (f"not recorded ({e.message if isinstance(e, FablizeError) else e}; its temp log "
               "was removed)")
    raise FablizeError(f"interrupted by {name}: `{one_line(hit['cmd'])}` was stopped (its "
                       f"whole process group killed) and {fate}; {sid} is unchanged.",
                       "interrupted", EXIT_SIGNAL_BASE + getattr(signal, name, 0))


def record_judge_packet(ctx, sid):
    """Record the working tree as the judge sees it first; a verdict compares against it."""
    digest, count = tree_state(ctx.store.root, ctx.store.dir)
    with ctx.store.plan_session() as s:
        plan = s.require_plan()
        if find_story(plan, sid)["status"] != "review":
            return plan, None
        s.commit("judge_packet", id=sid, tree=digest, files=count)
        return s.plan, {"tree": digest, "files": count, "seq": s.last["seq"]}


def tree_changed_verdict(ctx, a):
    """The verdict event's fields when the tree changed since the judge packet: the judge's
    finding goes back as not-achieved (a judge that fixed the work judged nothing); else None."""
    with ctx.store.plan_session(exclusive=False) as s:
        plan = s.require_plan()
    packet = current_packet(find_story(plan, a.id))
    if packet is None:
        return None
    digest, _ = tree_state(ctx.store.root, ctx.store.dir)
    if digest == packet["tree"]:
        return None
    return {"verdict": "not-achieved", "tree": digest, "packet_seq": packet["seq"],
            "evidence": f"the working tree changed after the judge packet (event {packet['seq']}) "
                        f"— a judge must not change what it judges; its verdict ({a.verdict}) "
                        "is void. The judge's finding: "
                        + masked_text("--evidence", a.evidence, ctx.store.root)}


def parse_goal(value, number):
    if "::" not in value:
        raise usage(f"--goal format is 'title::objective' — invalid: {one_line(value)}", "bad_goal")
    title, objective = value.split("::", 1)
    return {"id": story_id(number), "title": plan_text("a title", title.strip()),
            "objective": plan_text("an objective", objective.strip()),
            "after": [], "checks": [], "accept": [], "judge": False}


def build_stories(a):
    """The story list of `create` from its options; usage errors name the option."""
    specs = [parse_goal(g, i) for i, g in enumerate(a.goal, 1)]
    if not specs:
        raise usage("at least one --goal is required.", "no_goals")
    by_id = {s["id"]: s for s in specs}

    def target(option, sid):
        if sid not in by_id:
            raise usage(f"{option} names {one_line(sid)}, which is not in the plan "
                        f"({specs[0]['id']}–{specs[-1]['id']}).", "unknown_id")
        return by_id[sid]

    for i, spec in enumerate(specs[1:], 1):
        spec["after"] = [] if a.parallel else [specs[i - 1]["id"]]
    for value in a.after:
        sid, deps = split_assignment("--after", value)
        target("--after", sid)["after"] = parse_ids(deps, "--after")
        for dep in by_id[sid]["after"]:
            target("--after", dep)
    for value in a.check:
        sid, cmd = split_assignment("--check", value)
        if blank(cmd):
            raise usage(f"--check {sid}= needs a command.", "blank_check")
        target("--check", sid)["checks"].append(check_command("--check", cmd))
    for cmd in a.verify:
        if blank(cmd):
            raise usage("--verify needs a command.", "blank_check")
        specs[-1]["checks"].append(check_command("--verify", cmd))
    for value in a.accept:
        sid, text = split_assignment("--accept", value)
        if blank(text):
            raise usage(f"--accept {sid}= needs the item's text.", "blank_item")
        target("--accept", sid)["accept"].append(plan_text("an acceptance item", text))
    for value in a.judge or []:
        for sid in ([s["id"] for s in specs] if value == "ALL" else parse_ids(value, "--judge")):
            target("--judge", sid)["judge"] = True
    specs[-1]["after"] = [s["id"] for s in specs[:-1]]  # the gate waits for everything
    return specs


def plan_exists(ctx):
    """The original's refusal of a second plan, then its two ways, whole: the plan there, or
    this command again with --force (the plan there is archived whole): a human's choice."""
    return refused(PLAN_EXISTS, "plan_exists",
                   steps=[f"{ctx.prog} status", rerun_command(ctx.prog, ctx.argv) + " --force"])


def cmd_create(ctx, a):
    """create: a plan from the command line, its checks flagged when they cannot run here (a
    program missing now; a file a story will write, test-first), the previous plan archived
    whole under --force, published with --remote; ends with the next step."""
    store = ctx.store
    plan_text("--brief", a.brief)
    if blank(a.brief):
        raise usage("--brief must not be empty: it is the task every handoff starts from.",
                    "blank_brief")
    sharing = sharing_room() if a.remote else None
    remote = sharing.remote_arg(store, a.remote) if a.remote else None
    specs = build_stories(a)
    unverifiable = unverifiable_checks(specs, store.root)
    fields = {"brief": a.brief, "count": len(specs), "plan_id": new_plan_id(), "stories": specs,
              "options": {"rounds": a.rounds, "require_run": a.require_run},
              "unverifiable": unverifiable}
    scope = list(dict.fromkeys(scope_pattern(plan_text("--scope", p)) for p in a.scope))
    if scope:
        from . import trust
        trust.check_scope(scope, store.root, specs)
        fields["scope"] = scope
    # judge the new plan before anything moves: a bad one must not archive the old one — and
    # before saying a plan exists, whose step (`--force`) would only meet the same refusal
    apply_event(None, dict(fields, seq=1, ts=now_iso(), event="plan_created", prev=ZERO_HASH,
                           replaces=None))
    if not a.force and store.exists() and store.has_plan_files():
        raise plan_exists(ctx)
    store.create_dir()
    with store.session() as s:
        replaces = None
        if store.has_plan_files():
            if not a.force:
                raise plan_exists(ctx)
            replaces = s.replace_plan(fields)
        else:
            s.commit("plan_created", **fields, replaces=None)
        plan = s.plan
    ctx.data.update(plan=plan_json(plan), replaces=replaces)
    if remote:  # the new plan's ledger published
        ctx.data["share"] = sharing.start(store, remote)
    ctx.show(text_create, {"next": next_action(ctx.prog, plan)},
             shared=sharing and sharing.text_share)


def stuck_error(ctx, plan, agent):
    """Why `next` has nothing to hand out (the plan is not done): the plan's next action."""
    action = next_action(ctx.prog, plan, agent)
    if action["kind"] == "decide":
        return refused(action["text"], "halted", steps=action["commands"])
    if action["kind"] == "judge":
        return refused(action["text"] + ".", "awaiting_review", steps=action["cmd"])
    # what the others hold: they finish it; an agent that is gone is a human's to release
    held = active_stories(plan)
    turns = f" ({TAKE_TURNS})" if agent is not None and held and sequential(plan) else ""
    return refused(action["text"] + turns + (" — if an agent is gone, a human releases its "
                                             "story:" if held else "."), "nothing_ready",
                   steps=[f"{human_command(ctx.prog)} release --id {s['id']} --note "
                          "\"<why its agent's claim ends>\"" for s in held[:3]])


def held_by_other(ctx, story):
    """`next` without a name while an agent holds `story`: an unnamed caller is handed no other
    agent's story (it would work on it unseen by its agent) — one of its own takes a name."""
    return refused(f"{story['id']} is held by agent {one_line(story['agent'])}, not an unnamed "
                   "caller (give --agent): an unnamed `next` hands out no agent's story — take "
                   "one of your own by name:", "held_by_other",
                   steps=f'{ctx.prog} next --agent "<your name>"')


def cmd_next(ctx, a):
    """next: the story to work now, and its handoff. A story already in progress for this agent
    is shown again, changing nothing; else the first ready one is activated (for a shared
    plan, after pulling what other clones claimed); with nothing ready, why not and what
    would unblock it."""
    agent = a.agent
    if agent is not None and blank(agent):
        raise usage("--agent needs a name.")
    with ctx.store.plan_session() as s:
        plan = s.require_plan()
        sharing = sharing_of(s.store)
        if sharing is not None:
            plan = sharing.pull(s)  # the claims other clones made
        active = active_stories(plan)
        held = [x for x in active if x["agent"] == agent]
        reshown = bool(held)
        if held:
            story = held[0]  # the same caller gets its own story back; nothing is written
        elif agent is None and active:  # never another agent's story, nor a second one
            raise held_by_other(ctx, active[0])
        else:
            story = pick_ready(plan)
            if story is None:
                if plan_done(plan):
                    return ctx.show(text_next, dict(plan_summary(plan), story=None,
                                                    plan=plan_json(plan)), plan=plan)
                raise stuck_error(ctx, plan, agent)
            if sharing is not None:  # on the remote before it is handed out
                story = sharing.claim(s, story, agent)
            else:
                commit_start(s, story, agent)
                story = find_story(s.plan, story["id"])
            plan = s.plan
    handoff = "\n".join(clean(x) for x in render_handoff(ctx.prog, plan, story, reshown))
    ctx.show(text_next, dict(plan_summary(plan), activated=not reshown,
                             story=story_json(plan, story), handoff=handoff), plan=plan)


def reason_required(story, status):
    """failed and blocked carry a reason: the next round reads it, or the human who decides;
    the step is the checkpoint with what the agent has to write as a placeholder."""
    step = Step.engine(checkpoint_args(story, status, EVIDENCE_NOTES[status]))
    if status == "failed":
        return refused("a failed checkpoint requires --evidence: what is missing (the next round "
                       "is handed it).", "no_evidence", step)
    return refused("a blocked checkpoint requires --evidence: why it cannot be done as specified "
                   "(the human who decides is handed it).", "no_evidence", step)


def cmd_checkpoint(ctx, a):
    """checkpoint: record a story's result. In three steps, so that no lock is held while a
    user's command runs: check the gate and decide what verifying the story runs (its frozen
    checks, else --run's --verify-cmd); run those outside the lock, streaming their output;
    then, under the lock again, record each run and the checkpoint that cites them — a failed
    run stays recorded as evidence when the gate refuses the completion."""
    if a.run and not blank(a.verify_cmd):
        check_command("--verify-cmd", a.verify_cmd)
    root = ctx.store.root  # (a --verify-cmd is a command: kept as given, but for secrets)
    ev = {"id": a.id, "status": a.status,
          "evidence": masked_text("--evidence", a.evidence, root),
          "verify_cmd": mask(limit_text("--verify-cmd", a.verify_cmd), command=True),
          "verify_evidence": masked_text("--verify-evidence", a.verify_evidence, root)}
    if a.agent is not None:
        ev["agent"] = a.agent
    if a.run:
        if blank(a.verify_cmd):
            raise usage("--run needs --verify-cmd: the command the engine runs.")
        ev["run"] = True
    commands = []
    with ctx.store.plan_session() as s:
        plan = s.require_plan()
        story = find_story(plan, a.id)
        checkpoint_gate(plan, story, ev, shared=sharing_of(s.store) is not None)
        # here, not in the transition: ledgers written before this rule must still replay
        if a.status != "complete" and blank(a.evidence):
            raise reason_required(story, a.status)
        if a.status == "complete":
            commands, note = verification_runs(story, a.verify_cmd, a.run)
            if note:
                ctx.out.warn(note)
            if story["checks"]:
                ev.pop("run", None)  # the frozen checks are the run
        if not commands:
            s.commit("checkpoint", **ev)
    runs = []
    if commands:
        records = execute_runs(ctx.store, a.id, commands, plan["ledger"]["seq"], ctx.timeout,
                               ctx.out)
        stop_if_interrupted(ctx, records)
        with ctx.store.plan_session() as s:
            s.require_plan()
            runs = commit_runs(s, records)
            ev["runs"] = [r["seq"] for r in runs]
            ctx.data["runs"] = runs
            failed = [r for r in runs if not run_passed(r)]
            try:
                s.commit("checkpoint", **ev)
            except FablizeError as e:
                if not failed:
                    raise
                # the gate refused what the runs showed: the refusal is theirs, and they stand
                raise refused(f"{e.message} The run is recorded (event {failed[0]['seq']}, log "
                              f"{shown_path(ctx.store, failed[0]['log'])}); {a.id} stays in "
                              "progress: fix it and checkpoint again:", "verification_failed",
                              e.steps) from e
    plan = s.plan  # as the session left it: a shared plan's publish may have pulled events
    story = find_story(plan, a.id)
    warn_observed(ctx, story)
    # the next step is the last thing said, for the agent that checkpointed
    ctx.show(text_checkpoint, dict(plan_summary(plan), story=story_json(plan, story), runs=runs,
                                   observed=observed_of(story),
                                   next=next_action(ctx.prog, plan, a.agent)),
             plan=plan, prog=ctx.prog)


def cmd_status(ctx, a):
    if a.resume:
        return session_start(ctx, a)
    ctx.store.require()
    plan, share, sharing = read_plan_and_share(ctx.store, imports=True)
    if plan is None:
        raise no_plan()
    behind = sharing.behind_step(share, ctx.prog) if share else None
    if share:
        ctx.data["share"] = share
    # the step of the agent asking (never another's) — but a copy behind its remote syncs first
    ctx.show(text_status, dict(plan_json(plan), next=behind[1] if behind else next_action(
        ctx.prog, plan, a.agent), paused=guard_paused(plan), capped=guard_capped(plan),
        in_flight=inflight_json(inflight_runs(ctx.store))),
        plan=plan, prog=ctx.prog, sharing=sharing)


def cmd_verify(ctx, a):
    with ctx.store.plan_session() as s:
        plan = s.require_plan()
        commands, note = verification_runs(find_story(plan, a.id), a.verify_cmd, True)
        if note:
            ctx.out.warn(note)
        if not commands:
            raise refused(f"{a.id} has no frozen checks — give --verify-cmd to run a command.",
                          "no_checks",
                          steps=f"{ctx.prog} verify --id {a.id} --verify-cmd \"<command>\"")
        after_seq = plan["ledger"]["seq"]
    records = execute_runs(ctx.store, a.id, commands, after_seq, ctx.timeout, ctx.out)
    stop_if_interrupted(ctx, records)
    with ctx.store.plan_session() as s:
        s.require_plan()
        runs = commit_runs(s, records)
    ctx.data["runs"] = runs
    failed = [r for r in runs if not run_passed(r)]
    if failed:  # recorded: once the cause is fixed, the same runs again
        raise refused(f"{a.id}: {len(failed)} of {count_noun(len(runs), 'check')} failed — "
                      f"first: {run_summary(failed[0])} (log "
                      f"{shown_path(ctx.store, failed[0]['log'])}); fix it and verify again:",
                      "verification_failed", steps=rerun_command(ctx.prog, ctx.argv))
    ctx.show(text_verify, {"id": a.id}, status=find_story(s.plan, a.id)["status"])


def cmd_decide(ctx, a):
    signature = prev = None
    note = masked_text("--note", a.note, ctx.store.root)  # as the plan keeps it, and signed so
    if a.sign or a.signer:  # signed outside the lock, over the head the decision follows
        from . import trust
        trust.check_signer(a.sign, a.signer)
        with ctx.store.plan_session(exclusive=False) as s:
            plan = s.require_plan()
        signature, prev = trust.sign(plan, a.id, a.decision, note, a.sign, a.signer)
    with ctx.store.plan_session() as s:
        s.require_plan()
        signed = trust.signed_fields(s.plan, signature, prev) if signature else {}
        s.commit("decision", id=a.id, decision=a.decision, note=note, **signed)
        plan = s.plan
    ctx.show(text_decide, {"story": story_json(plan, find_story(plan, a.id)),
                           "next": next_action(ctx.prog, plan)}, decision=a.decision)


def cmd_add(ctx, a):
    with ctx.store.plan_session() as s:
        plan = s.require_plan()
        spec = parse_goal(a.goal, len(plan["goals"]) + 1)
        if a.after is None:
            spec["after"] = [plan["goals"][-2]["id"]] if len(plan["goals"]) > 1 else []
        else:
            spec["after"] = parse_ids(a.after, "--after")
            for dep in spec["after"]:
                find_story(plan, dep)
                if dep == plan["goals"][-1]["id"]:
                    raise usage(f"--after {dep}: a story cannot wait for the final story.",
                                "dependency_cycle")
        for cmd in a.check:
            if blank(cmd):
                raise usage("--check needs a command.", "blank_check")
            spec["checks"].append(check_command("--check", cmd))
        spec["accept"] = [plan_text("an acceptance item", t) for t in a.accept if not blank(t)]
        spec["judge"] = a.judge
        unverifiable = unverifiable_checks([spec], ctx.store.root)
        s.commit("story_added", story=spec, unverifiable=unverifiable)
        plan = s.plan
    ctx.show(text_add, {"story": story_json(plan, find_story(plan, spec["id"])),
                        "unverifiable": unverifiable}, final=plan["goals"][-1]["id"])


def cmd_rebuild(ctx, a):
    """rebuild: goals.json regenerated from the ledger, the old one kept. The way out of every
    snapshot that is not the ledger's, and of a last line that is no event (kept in
    ledger.jsonl.broken, said); a ledger with no event leaves no plan, said with the old
    snapshot's name, for a human to start again."""
    with ctx.store.plan_session() as s:
        s.refuse_original()
        target = s.store.path(SNAPSHOT)
        # no ledger under a snapshot: its history is gone (or, shared, on the remote) — rebuild
        # says so and keeps the snapshot, as for an empty ledger; `create` then works
        if s.ledger.open() is None and not os.path.lexists(target):
            raise no_plan()
        old = loose_snapshot(s.store)
        position = old.get("ledger") if old else None
        # a last line the old snapshot reflects was acknowledged: damage, not a torn write
        reflected = (position if isinstance(position, dict) and type(position.get("seq")) is int
            else {"seq": 0})
        try:
            end = s.cut_torn_tail({"ledger": reflected})
        except FablizeError as e:
            if Step.engine("rebuild") not in e.steps:
                raise
            # the step that message named: the damaged event is set aside, said, not dropped
            end = s.cut_torn_tail({"ledger": {"seq": 0}})
            ctx.out.warn(f"event {reflected['seq']}, which the old snapshot reflected, was "
                         f"damaged; its bytes are kept in {LEDGER}.broken.")
        end = set_aside_last_line(ctx, s, end, reflected["seq"])
        replay = replay_all(s.ledger, end)
        plan = replay.plan
        kept = None
        if plan is not None or old is not None:
            if os.path.lexists(target):
                kept = os.path.basename(free_name(
                    f"{target}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.bak"))
                os.replace(target, s.store.path(kept))
        if plan is not None:
            plan["ledger"] = replay.position()
        s.rebuilt(plan)
        taken = reconcile_shared(ctx, s)
        plan = s.plan
        if plan is None:
            if kept is None:
                raise no_plan()
            return ctx.show(text_rebuild, {"event_count": 0, "kept": kept, "plan": None},
                            prog=ctx.prog, history="is missing" if s.ledger.open() is None
                            else "holds no event")
    ctx.show(text_rebuild, {"event_count": plan["ledger"]["seq"], "kept": kept,
                            "plan": plan_json(plan)}, prog=ctx.prog, replayed=replay.seq,
             taken=taken)


def reconcile_shared(ctx, s):
    """After `rebuild` of a shared plan, under its lock: the remote's copy of the published
    events first — a damaged line rebuild set aside is taken back from it, and nothing new is
    published on a chain the remote does not hold. Returns how many events came in; a remote
    that cannot be reached now is said (the next writing command reconciles)."""
    sharing = sharing_of(s.store)
    if sharing is None:
        return 0
    before = s.plan["ledger"]["seq"] if s.plan else 0
    try:
        sharing.reconcile(s)
    except FablizeError as e:  # the snapshot is rebuilt; the rest is the remote's to say
        ctx.out.warn(f"{SNAPSHOT} is rebuilt, but the shared plan could not be reconciled with "
                     f"its remote now: {one_line(e.message)} — the next writing command (or "
                     "`sync`) does it.")
        return 0
    return max(0, s.plan["ledger"]["seq"] - before) if s.plan else 0


def history_way_out(store, error):
    """The way out of damage no command repairs — a ledger line that is no event or breaks the
    chain, an event fablize would not have written, a run log that is not the one recorded —
    as (what the message adds, the steps): a human's decision, said, between the copy git holds
    as last committed (where it differs from what is here) and a new plan (this one kept whole
    in archive/). The storage room that found the damage cannot ask git what it holds."""
    log = error.detail.get("path")
    restore = committed_copy(store, [log] if log else [LEDGER], whole=log is None)
    said = ""
    if "a human decides" not in error.message:  # the message whole, then the way out
        said = ((" No" if error.message.endswith(".") else " — no") +
                " command repairs a history: a human decides "
                + ("between its copy as last committed and a new plan" if restore else
                   "whether to start a new plan") + " (this one is kept whole in archive/):")
    return said, restore + [Step.engine(create_args(force=True))]


def set_aside_last_line(ctx, s, end, reflected):
    """rebuild's repair of a whole last line that is no event (a hand edit, a merge's conflict
    marker) when the line before it is one and no snapshot reflects it: moved to
    ledger.jsonl.broken, said. Returns the ledger's end after it."""
    if not end:
        return end
    offset, line = next(s.ledger.backward(end))
    if parse_event(line) is not None:
        return end
    prev = s.ledger.last(offset) if offset else None
    prev_ev = parse_event(prev) if prev is not None else None
    if (prev is not None and prev_ev is None) or (prev_ev["seq"] if prev_ev else 0) < reflected:
        return end  # more than the last line is damaged, or it was acknowledged: audit says it
    s.ledger.cut(offset, line)
    ctx.out.warn(f"{LEDGER}: its last line was no ledger event ({len(line)} bytes); it was moved "
                 f"to {LEDGER}.broken.")
    return offset


def cmd_log(ctx, a):
    """log: every event, checked as audit checks it, a line each (under --json, the events);
    damage stops it at the line it names, and only the damage is said."""
    events = []

    def pick(replay, line, ev):
        if (a.id is None or ev.get("id") == a.id or ev["event"] == "plan_created" or
                (ev["event"] == "story_added" and ev["story"]["id"] == a.id)):
            events.append(ev)

    with ctx.store.plan_session(exclusive=False) as s:
        s.refuse_original()
        if s.ledger.open() is None:
            raise no_plan()
        s.see_lost_newline(loose_snapshot(s.store))
        # damage raises: what was read before it stays unsaid, the damage is the news
        replay = replay_all(s.ledger, s.good_end(None), pick)
    if replay.plan is None:
        raise no_plan()
    if a.id is not None:
        find_story(replay.plan, a.id)
    ctx.show(text_log, {"events": events})


def cmd_report(ctx, a):
    with ctx.store.plan_session(exclusive=False) as s:
        plan = s.require_plan()
        runs = collections.deque(maxlen=REPORT_RUNS)
        # the whole history, checked as audit does; the latest runs kept
        replay = replay_all(s.ledger, s.good_end(None), lambda replay, line, ev: runs.append(ev),
                            kinds={"verify_run"})
    text = render_report(plan, list(runs), replay.counts["verify_run"])
    wires = None
    if a.base:  # what the work's code does to its judge, since the base
        from . import trust
        wires = trust.tripwires_since(ctx.store, plan, a.base)
        text += trust.tripwire_md(wires, a.base)
    target = a.out or os.environ.get("GITHUB_STEP_SUMMARY")
    if target and within(os.path.abspath(target), ctx.store.dir):
        raise usage(f"report --out {one_line(target)}: that is inside the state directory, whose "
                    "files only fablize writes.", "usage")
    if a.out:  # the user's file: in the project unless --outside, never through a symlink
        # the user's to choose: outside after all, or another file
        target, st = user_file(ctx.store.root, a.out, a.outside, (
            Step.again("--outside"),
            Step.engine("report --out \"<another file>\"" + (" --outside" if a.outside else ""))))
        write_atomic(target, text.encode("utf-8"), st.st_mode & 0o7777 if st else 0o644)
    elif target:  # CI's job summary, where CI keeps it: appended to
        with open(target, "ab+") as f:
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")  # a heading must start its own line
            f.write(text.encode("utf-8"))
    if wires is not None:
        ctx.data["tripwires"] = wires
    ctx.show(text_report, {"markdown": text, "path": target})


def cmd_judge_packet(ctx, a):
    """judge-packet: what an independent judge needs — the objective, a checklist of every
    frozen check (with this round's witnessed run) and acceptance item, the executor's
    evidence and runs, and the three verdict commands. For a story in review it also records
    the working tree (record_judge_packet), so a verdict given after the judge changed it is
    void; for any other story it is for reading only and offers no verdict."""
    with ctx.store.plan_session(exclusive=False) as s:
        plan = s.require_plan()
    packet = None
    if find_story(plan, a.id)["status"] == "review":
        plan, packet = record_judge_packet(ctx, a.id)
    story = find_story(plan, a.id)
    said = []
    if a.base:  # what the work's code does to its judge, since the base
        from . import trust
        wires = ctx.data["tripwires"] = trust.tripwires_since(ctx.store, plan, a.base)
        said = trust.tripwire_lines(wires) or [
            f"Tripwires since {one_line(a.base)}: none (no line of the work {TRIPWIRE})."]
    ctx.show(text_judge_packet, judge_packet(ctx.prog, story, packet), tripwires=said)


def cmd_verdict(ctx, a):
    void = tree_changed_verdict(ctx, a)
    with ctx.store.plan_session() as s:
        s.require_plan()
        fields = {"verdict": a.verdict,
                  "evidence": masked_text("--evidence", a.evidence, s.store.root)}
        s.commit("verdict", id=a.id, agent=a.agent, **dict(fields, **(void or {})))
        plan = s.plan
    story = find_story(plan, a.id)
    ctx.data["story"] = story_json(plan, story)
    if void:
        action = next_action(ctx.prog, plan)
        raise refused(f"the working tree changed since the judge packet (event "
                      f"{void['packet_seq']}): the verdict is refused and recorded as "
                      f"not-achieved — {a.id} is {story['status']}; a judge must not change what "
                      "it judges.", "tree_changed", action.get("cmd") or Step.engine("status"))
    ctx.show(text_checkpoint, {"next": next_action(ctx.prog, plan)}, plan=plan, prog=ctx.prog)


def cmd_pause(ctx, a):
    with ctx.store.plan_session() as s:
        s.require_plan()
        s.commit("paused", note=masked_text("--note", a.note, s.store.root))
        plan = s.plan
    ctx.show(text_pause, {"paused": guard_paused(plan)}, prog=ctx.prog,
             seq=plan["ledger"]["seq"])


def cmd_unpause(ctx, a):
    with ctx.store.plan_session() as s:
        s.require_plan()
        s.commit("unpaused")
        plan = s.plan
    ctx.show(text_unpause, {"paused": None}, seq=plan["ledger"]["seq"])


def warn_observed(ctx, story):
    """After a checkpoint: a failure the harness saw left standing."""
    bad = unaddressed_failure(story)
    if bad is not None and story["status"] in DONE + ("review",):
        ctx.out.warn(f"{story['id']} was checkpointed while the harness last saw "
                     f"`{one_line(bad['cmd'])}` "
                     f"fail (event {bad.get('seq')}): `status`, `report` and `audit` show it "
                     "to the reviewer.")
