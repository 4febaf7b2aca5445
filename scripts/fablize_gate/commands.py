"""The commands: each opens the plan, lets the transitions judge the events it builds, and
states the result once (ctx.say, ctx.data), rendered by cli.Output.
"""

import collections
import os
import time
from operator import itemgetter

from .base import (
    ARCHIVE, blank, clean, count_noun, count_stories, defuse, defused_line, DONE, EXIT_REFUSED,
    EXIT_SIGNAL_BASE, FablizeError, has_marker_word, indent, last_chars, LEDGER, limit_text,
    MARKS, new_plan_id, no_plan, now_iso, one_line, parse_ids, PLAN_EXISTS, quote_arg, refused,
    REPORT_RUNS, RUNS, scope_pattern, SNAPSHOT, split_assignment, STATE_DIRNAME, story_id, usage,
    ZERO_HASH)
from .masking import mask, masked_text
from .model import (
    accepted_ids, active_stories, apply_event, BASE_FIELDS, checkpoint_gate, claimed_final,
    current_packet, find_story, format_event, guard_capped, guard_paused, latest_run,
    not_an_event, observed_of, parse_event, pick_ready, plan_done, round_label, rounds_left,
    run_passed, run_summary, stories_in, unaddressed_failure, waits_for)
from .storage import (
    commit_start, free_name, from_here, loose_snapshot, open_plan, read_state_file, replay_all,
    require_state_dir, shown_path, symlink_refusal, user_file, within, write_atomic)
from .runs import (
    check_command, commit_runs, drop_temp_logs, execute_runs, file_not_there_yet, git,
    inflight_runs, plan_text, repo_root, tree_state, unverifiable_checks, unverifiable_label,
    verification_runs)
from .render import (
    capped_line, checkpoint_command, completion_command, count_line, create_command,
    decide_commands, DECISION_NOTES, done_line, grades_line, human_command, left_line,
    next_action, next_line, paused_line, plan_json, plan_summary, render_handoff,
    render_observed, render_report, render_resume, rerun_command, sequential, status_details,
    story_json, TAKE_TURNS, verdict_command)
from .audit import audit_ledger
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
        with open_plan(ctx) as s:
            s.require_plan()
            runs = commit_runs(s, records)
        ctx.data["runs"] = runs
        fate = (f"recorded as interrupted (event {runs[-1]['seq']}, log "
                f"{shown_path(ctx.store, runs[-1]['log'])})")
    except (FablizeError, OSError) as e:
        drop_temp_logs(records)
        fate = (f"not recorded ({e.message if isinstance(e, FablizeError) else e}; its temp log "
               "was removed)")
    error = FablizeError(f"interrupted by {name}: `{one_line(hit['cmd'])}` was stopped (its "
                         f"whole process group killed) and {fate}; {sid} is unchanged.",
                         exit_code=EXIT_SIGNAL_BASE + getattr(signal, name, 0))
    error.code = "interrupted"
    raise error


def record_judge_packet(ctx, sid):
    """Record the working tree as the judge sees it first; a verdict compares against it."""
    digest, count = tree_state(ctx.store.root, ctx.store.dir)
    with open_plan(ctx) as s:
        plan = s.require_plan()
        if find_story(plan, sid)["status"] != "review":
            return plan, None
        s.commit("judge_packet", id=sid, tree=digest, files=count)
        return s.plan, {"tree": digest, "files": count, "seq": s.last["seq"]}


def tree_changed_verdict(ctx, a):
    """The verdict event's fields when the tree changed since the judge packet: the judge's
    finding goes back as not-achieved (a judge that fixed the work judged nothing); else None."""
    with open_plan(ctx, exclusive=False) as s:
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


def say_unverifiable(ctx, found):
    """What create and add say of frozen checks that cannot run yet: a program that is missing
    here must be fixed now; a file not there yet is a test-first check, fine."""
    later = [u for u in found if file_not_there_yet(u)]
    now = [u for u in found if u not in later]
    if now:
        ctx.say(f"fablize: ⚠ {count_noun(len(now), 'frozen check')} cannot run here — fix the "
                "command or install what it needs now: found at the gate, it costs the whole run:")
    for u in now:
        ctx.say(f"  {one_line(u['id'])} check {u['check'] + 1}: `{one_line(u['cmd'])}` — "
                f"{one_line(u['reason'])}")
    if later:
        ctx.say(f"fablize: {count_noun(len(later), 'frozen check')} "
                f"{'starts' if len(later) == 1 else 'start'} a file that does not exist yet — "
                "fine for a test-first plan: a story writes it, and each check runs when its "
                "own story completes:")
    for u in later:
        ctx.say(f"  {one_line(u['id'])} check {u['check'] + 1}: `{one_line(u['cmd'])}` — "
                f"{one_line(u['reason'])} yet")


def plan_exists(ctx):
    """The original's refusal of a second plan, then its two ways, whole: the plan there, or
    this command again with --force (the plan there is archived whole): a human's choice."""
    error = refused(PLAN_EXISTS, "plan_exists")
    error.commands = [f"{ctx.prog} status", rerun_command(ctx.prog, ctx.argv) + " --force"]
    return error


def cmd_create(ctx, a):
    """create: a plan from the command line, its checks flagged when they cannot run here (a
    program missing now; a file a story will write, test-first), the previous plan archived
    whole under --force, published with --remote; ends with the next step."""
    store = ctx.store
    if not a.force and store.exists() and store.has_plan_files():
        raise plan_exists(ctx)
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
    # judge the new plan before anything moves: a bad one must not archive the old one
    apply_event(None, dict(fields, seq=1, ts=now_iso(), event="plan_created", prev=ZERO_HASH,
                           replaces=None))
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
    ctx.say(f"fablize: plan created — {count_stories(len(specs))}")
    for story in plan["goals"]:
        ctx.say(f"  {story['id']} {defused_line(story['title'])}: "
                f"{defused_line(story['objective'])}")
    if scope:
        ctx.say("  scope: " + ", ".join(map(one_line, scope)) + " — the paths the work may change "
                "(CI re-runs the checks with only these taken from the branch)")
    if replaces:
        ctx.say(f"fablize: the previous plan {replaces['plan_id']} is kept whole in "
                f"{replaces['path']}/ (head {replaces['head']}).")
    say_unverifiable(ctx, unverifiable)
    ctx.data.update(plan=plan_json(plan), replaces=replaces)
    if remote:  # the new plan's ledger published
        share, line = sharing.start(store, remote)
        ctx.say(line)
        ctx.data.update(share=share)
    action = next_action(ctx.prog, plan)
    ctx.say(next_line(action))  # the last line: what to do now
    ctx.data["next"] = action


def stuck_error(ctx, plan, agent):
    """Why `next` has nothing to hand out (the plan is not done): the plan's next action."""
    action = next_action(ctx.prog, plan, agent)
    if action["kind"] == "decide":
        error = refused(action["text"], "halted")
        error.commands = action["commands"]  # each whole on its own line, after the message
        return error
    if action["kind"] == "judge":
        error = refused(action["text"] + ".", "awaiting_review")
        error.commands = [action["cmd"]]
        return error
    # what the others hold: they finish it; an agent that is gone is a human's to release
    held = active_stories(plan)
    turns = f" ({TAKE_TURNS})" if agent is not None and held and sequential(plan) else ""
    error = refused(action["text"] + turns + (" — if an agent is gone, a human releases its "
                                              "story:" if held else "."), "nothing_ready")
    error.commands = [f"{human_command(ctx.prog)} release --id {s['id']} --note "
                      "\"<why its agent's claim ends>\"" for s in held[:3]]
    return error


def held_by_other(ctx, story):
    """`next` without a name while an agent holds `story`: an unnamed caller is handed no other
    agent's story (it would work on it unseen by its agent) — one of its own takes a name."""
    error = refused(f"{story['id']} is held by agent {one_line(story['agent'])}, not an unnamed "
                    "caller (give --agent): an unnamed `next` hands out no agent's story — take "
                    "one of your own by name:", "held_by_other")
    error.commands = [f'{ctx.prog} next --agent "<your name>"']
    return error


def cmd_next(ctx, a):
    """next: the story to work now, and its handoff. A story already in progress for this agent
    is shown again, changing nothing; else the first ready one is activated (for a shared
    plan, after pulling what other clones claimed); with nothing ready, why not and what
    would unblock it."""
    agent = a.agent
    if agent is not None and blank(agent):
        raise usage("--agent needs a name.")
    with open_plan(ctx) as s:
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
                    ctx.say(done_line(plan))
                    ctx.data.update(plan_summary(plan), story=None, plan=plan_json(plan))
                    return
                raise stuck_error(ctx, plan, agent)
            if sharing is not None:  # on the remote before it is handed out
                story = sharing.claim(s, story, agent)
            else:
                commit_start(s, story, agent)
                story = find_story(s.plan, story["id"])
            plan = s.plan
    lines = render_handoff(ctx.prog, plan, story, reshown)
    for line in lines:
        ctx.say(line)
    ctx.data.update(plan_summary(plan), activated=not reshown, story=story_json(plan, story),
                    handoff="\n".join(clean(x) for x in lines))


def say_after_checkpoint(ctx, plan, story, agent=None):
    """What a checkpoint or a verdict left; returns the next action it named (for `agent`,
    when one checkpointed: never a story another agent holds)."""
    sid, status = story["id"], story["status"]
    if status == "failed":
        left = count_noun(rounds_left(plan, story), "round")
        ctx.say(f"fablize: {sid} → failed ({round_label(plan, story)}; {left} left) — "
                f"`{ctx.prog} next` reopens it as round {story['round'] + 1} "
                "with what was missing.")
    elif status == "blocked":
        ctx.say(f"fablize: {sid} → blocked — a human must decide.")
    elif status == "review":
        ctx.say(f"fablize: {sid} → review — an independent judge decides.")
    else:
        ctx.say(f"fablize: {sid} → {status}")
    action = next_action(ctx.prog, plan, agent)
    ctx.say(left_line(plan, action))
    return action


def advise_not_active(ctx, plan, error, agent):
    """The whole command of the step a not-active refusal names, on its own line (the line
    itself is the original's, which scripts match): its checkpoint for the story in progress, a
    human's decisions for a blocked one, the judge's packet for one in review, `next` (for this
    agent) to activate it — in a clone of a shared plan, whose copy may be behind what another
    clone recorded, `sync` first — else `status`."""
    step = getattr(error, "step", ("status",))
    if step[0] == "finish":
        error.commands = [completion_command(ctx.prog, plan, find_story(plan, step[1]))]
    elif step[0] == "decide":
        error.commands = decide_commands(ctx.prog, step[1])
    elif step[0] == "judge":
        error.commands = [f"{ctx.prog} judge-packet --id {step[1]}"]
    elif step[0] != "next":
        error.commands = [f"{ctx.prog} status"]
    elif sharing_of(ctx.store) is not None:
        error.message += (" This clone's copy of the shared plan may be behind what another "
                          "clone recorded: sync it first.")
        error.commands = [f"{ctx.prog} sync"]
    else:  # an unnamed caller, while agents hold stories, takes one by name (cmd_next)
        name = (quote_arg(agent) if agent else
                '"<your name>"' if any(s["agent"] for s in active_stories(plan)) else None)
        error.commands = [f"{ctx.prog} next" + (f" --agent {name}" if name else "")]


# what a checkpoint's evidence says, by its status, where a step leaves it to the agent
EVIDENCE_NOTES = {"complete": "<what shows it>", "failed": "<what is missing>",
                  "blocked": "<why it cannot be done as specified>"}


def checkpoint_step(ctx, plan, story, error, a):
    """The whole command of the step a refused checkpoint names (error.commands): the
    checkpoint the gate accepts — with what the agent has to write as a placeholder, and for
    the final story the witnessed way — or, for a caller that does not hold the story, its own
    step (`status --agent`: a caller that gave no name gives its own)."""
    code, prog = error.code, ctx.prog
    if code == "not_active":
        advise_not_active(ctx, plan, error, a.agent)
    elif code == "held_by_other":  # never the holder's name offered: each agent its own
        error.commands = [f"{prog} status --agent "
                          + (quote_arg(a.agent) if a.agent is not None else '"<your name>"')]
    elif code == "no_evidence" and a.status != "complete":
        error.commands = [checkpoint_command(prog, story, a.status, EVIDENCE_NOTES[a.status])]
    elif code in ("no_evidence", "verification_gate", "run_required", "verification_missing",
                  "verification_failed"):
        error.commands = [completion_command(prog, plan, story)]


def reason_required(status):
    """failed and blocked carry a reason: the next round reads it, or the human who decides."""
    if status == "failed":
        return refused("a failed checkpoint requires --evidence: what is missing (the next round "
                       "is handed it).", "no_evidence")
    return refused("a blocked checkpoint requires --evidence: why it cannot be done as specified "
                   "(the human who decides is handed it).", "no_evidence")


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
    with open_plan(ctx) as s:
        plan = s.require_plan()
        story = find_story(plan, a.id)
        try:
            checkpoint_gate(plan, story, ev)
            # here, not in the transition: ledgers written before this rule must still replay
            if a.status != "complete" and blank(a.evidence):
                raise reason_required(a.status)
            if a.status == "complete":
                commands, note = verification_runs(story, a.verify_cmd, a.run)
                if note:
                    ctx.out.warn(note)
                if story["checks"]:
                    ev.pop("run", None)  # the frozen checks are the run
            if not commands:
                s.commit("checkpoint", **ev)
        except FablizeError as e:
            checkpoint_step(ctx, plan, story, e, a)
            raise
    runs = []
    if commands:
        records = execute_runs(ctx.store, a.id, commands, plan["ledger"]["seq"], ctx.timeout,
                               ctx.out)
        stop_if_interrupted(ctx, records)
        with open_plan(ctx) as s:
            s.require_plan()
            runs = commit_runs(s, records)
            ev["runs"] = [r["seq"] for r in runs]
            ctx.data["runs"] = runs
            try:
                s.commit("checkpoint", **ev)
            except FablizeError as e:
                failed = [r for r in runs if not run_passed(r)]
                if failed:
                    r = failed[0]
                    e.message += (f" The run is recorded (event {r['seq']}, log "
                                  f"{shown_path(ctx.store, r['log'])}); "
                                  f"{a.id} stays in progress: fix it and checkpoint again:")
                    e.code = "verification_failed"
                checkpoint_step(ctx, s.plan, find_story(s.plan, a.id), e, a)
                raise
    plan = s.plan  # as the session left it: a shared plan's publish may have pulled events
    story = find_story(plan, a.id)
    say_observed(ctx, story)
    # the next step is the last thing said, for the agent that checkpointed
    action = say_after_checkpoint(ctx, plan, story, a.agent)
    ctx.data.update(plan_summary(plan), story=story_json(plan, story), runs=runs, next=action)


def render_status(prog, plan, share=(), agent=None, step=None):
    """What `status` says, whole, for a human: the plan's count and brief, a line per story
    with its details, checks that cannot run here, a pause, the next step (`step`, when one
    comes before the plan's own: a shared copy behind its remote syncs first), the shared
    plan's state, and how to pick up each story in progress."""
    lines = [count_line(plan)]
    goals = plan["goals"]
    # titles that need no escaping and carry no marker word are shown as they are: checked in
    # one pass over them all (a status of 100,000 stories renders in 50 ms, not 120)
    titles = " ".join(map(str, map(itemgetter("title"), goals)))
    plain = titles.isascii() and titles.isprintable() and not has_marker_word(titles)
    say, marks, base = lines.append, MARKS, len(BASE_FIELDS)
    # the final story of a sequential plan waits for every other one: its order says so
    in_order = bool(waits_for(plan, goals[-1])) and sequential(plan)
    previous = None
    for story in goals:
        status = story["status"]
        title = story["title"] if plain else defused_line(story["title"])
        say(f"  {marks[status]} {story['id']} [{status}] {title}")
        if len(story) > base:  # a story with only the original's fields has no details
            lines += [f"      {detail}"
                      for detail in status_details(plan, story, previous, in_order)]
        previous = story["id"]
    for u in plan["unverifiable"]:
        lines.append(f"  {unverifiable_label(u)}: `{one_line(u['cmd'])}` — "
                     f"{one_line(u['reason'])}{' yet' if file_not_there_yet(u) else ''}")
    lines += paused_line(prog, plan)
    if capped_line(plan):
        lines.append("  " + capped_line(plan))
    claimed = claimed_final(plan)
    if claimed:
        lines.append("  " + claimed)
    # the step of the agent asking: never another's
    action = step or next_action(prog, plan, agent)
    lines.append(next_line(action))
    lines += share
    for story in active_stories(plan):
        lines.append("")
        lines += render_resume(prog, plan, story)
    return lines, action, guard_paused(plan)


def cmd_status(ctx, a):
    if a.resume:
        return session_start(ctx, a)
    require_state_dir(ctx.store)
    plan, share, sharing = read_plan_and_share(ctx.store, imports=True)
    if plan is None:
        raise no_plan()
    shared = sharing.status_lines(share, ctx.prog) if share else ()
    first, step = (sharing.behind_step(share, ctx.prog) if share else None) or (None, None)
    lines, action, paused = render_status(ctx.prog, plan, share=shared, agent=a.agent, step=step)
    inflight = inflight_runs(ctx.store)
    # a copy behind its remote says so first: the stories below are as this clone last saw them
    ctx.out.lines += ([first] if first else []) + lines + inflight_lines(ctx.prog, inflight)
    if share:
        ctx.data["share"] = share
    if ctx.json:
        ctx.data.update(plan_json(plan), next=action, paused=paused, capped=guard_capped(plan),
                        in_flight=[{"id": rec.get("id"), "check": rec.get("check"),
                                    "cmd": rec.get("cmd"), "started": rec.get("started"),
                                    "engine": rec["engine"], "running": alive}
                                   for rec, alive in inflight])


def inflight_lines(prog, inflight):
    """A line for each run noted in flight: running now, or never finished (its engine died)."""
    lines = []
    for rec, alive in inflight:
        what = f"`{one_line(str(rec.get('cmd')))}` for {one_line(str(rec.get('id')))}"
        started = one_line(str(rec.get("started", "")))[:19].replace("T", " ")
        if alive:
            lines.append(f"  ▷ a run is in flight: {what} (started {started} UTC, engine pid "
                         f"{rec['engine']})")
        else:
            again = f"{prog} verify --id {one_line(str(rec.get('id')))}" + (
                f" --verify-cmd {quote_arg(str(rec.get('cmd')))}" if rec.get("check") is None
                else "")
            lines.append(f"  ⚠ a run of {what} was in flight and never finished (started "
                         f"{started} UTC; its engine, pid {rec['engine']}, died): the next "
                         "writing command ends what is left of it; it recorded nothing — run it "
                         f"again: {again}")
    return lines


def cmd_verify(ctx, a):
    with open_plan(ctx) as s:
        plan = s.require_plan()
        commands, note = verification_runs(find_story(plan, a.id), a.verify_cmd, True)
        if note:
            ctx.out.warn(note)
        if not commands:
            error = refused(f"{a.id} has no frozen checks — give --verify-cmd to run a command.",
                            "no_checks")
            error.commands = [f"{ctx.prog} verify --id {a.id} --verify-cmd \"<command>\""]
            raise error
        after_seq = plan["ledger"]["seq"]
    records = execute_runs(ctx.store, a.id, commands, after_seq, ctx.timeout, ctx.out)
    stop_if_interrupted(ctx, records)
    with open_plan(ctx) as s:
        s.require_plan()
        runs = commit_runs(s, records)
    ctx.data["runs"] = runs
    failed = [r for r in runs if not run_passed(r)]
    if failed:  # recorded: once the cause is fixed, the same runs again
        error = refused(f"{a.id}: {len(failed)} of {count_noun(len(runs), 'check')} failed — "
                        f"first: {run_summary(failed[0])} (log "
                        f"{shown_path(ctx.store, failed[0]['log'])}); fix it and verify again:",
                        "verification_failed")
        error.commands = [rerun_command(ctx.prog, ctx.argv)]
        raise error
    ctx.say(f"fablize: {a.id}: {'all ' if len(runs) > 1 else ''}{count_noun(len(runs), 'check')} "
            "passed (status unchanged: "
            f"{find_story(s.plan, a.id)['status']}).")


def cmd_decide(ctx, a):
    signature = prev = None
    note = masked_text("--note", a.note, ctx.store.root)  # as the plan keeps it, and signed so
    if a.sign or a.signer:  # signed outside the lock, over the head the decision follows
        from . import trust
        trust.check_signer(a.sign, a.signer)
        with open_plan(ctx, exclusive=False) as s:
            plan = s.require_plan()
        signature, prev = trust.sign(plan, a.id, a.decision, note, a.sign, a.signer)
    with open_plan(ctx) as s:
        s.require_plan()
        signed = trust.signed_fields(s.plan, signature, prev) if signature else {}
        try:
            s.commit("decision", id=a.id, decision=a.decision, note=note, **signed)
        except FablizeError as e:
            if e.code == "no_note":  # the note is the human's to write
                e.commands = [f"{human_command(ctx.prog)} decide --id {a.id} {a.decision} "
                              f"--note \"{dict(DECISION_NOTES)[a.decision]}\""]
            raise
        plan = s.plan
    story = find_story(plan, a.id)
    what = {"accept": "counts as done", "retry": "back to work, rounds reset",
            "amend": "objective amended, back to work"}[a.decision]
    ctx.say(f"fablize: {a.id} → {story['status']} ({what}; decision recorded in the ledger).")
    ctx.say(next_line(next_action(ctx.prog, plan)))
    ctx.data.update(story=story_json(plan, story))


def cmd_add(ctx, a):
    with open_plan(ctx) as s:
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
        try:
            s.commit("story_added", story=spec, unverifiable=unverifiable)
        except FablizeError as e:
            if e.code == "final_started":
                e.commands = reopen_final(ctx.prog, plan)
            raise
        plan = s.plan
    story = find_story(plan, spec["id"])
    ctx.say(f"fablize: added {story['id']} {defused_line(story['title'])} — before the final story "
            f"{plan['goals'][-1]['id']}" + (f", after {', '.join(story['after'])}"
                                            if story["after"] else ""))
    say_unverifiable(ctx, unverifiable)
    ctx.data.update(story=story_json(plan, story))


def reopen_final(prog, plan):
    """Where `add` found verification started: the step that lets a story come before the
    final one again — the final story's checkpoint as failed (what is missing: the story to
    add), a human's retry of it in review, or, once the plan is done, a new plan."""
    final = find_story(plan, plan["goals"][-1]["id"])
    if final["status"] == "in_progress":
        return [checkpoint_command(prog, final, "failed", "<the story that must come first>")]
    if final["status"] == "review":
        return [f"{human_command(prog)} decide --id {final['id']} retry --note "
                "\"<the story that must come first>\""]
    return [create_command(prog, force=True)]


# audit's options that the trust room answers; --allow-* only relax its gates
TRUST_OPTIONS = ("base", "since", "rerun", "require_check", "require_witnessed",
                 "require_clean_runs", "allowed_signers", "forbid_accepted",
                 "require_unchanged_checks", "scope", "require_scope", "forbid_out_of_scope",
                 "fail_to_pass", "require_fail_to_pass", "allow_new_plan", "allow_imported",
                 "forbid_tripwires", "agent_tests", "check_user")


def cmd_audit(ctx, a):
    """audit: replay the whole ledger (chain, every field, every transition, the snapshot, the
    run logs), then, with the trust room, what CI can believe of it (the pin, the scope, a
    re-run on the base's tree). Every gate that says no is named at once, the verdict first;
    `--summary` writes the same for a CI job summary, also when the ledger is damaged."""
    try:
        audit_and_judge(ctx, a)
    except FablizeError as e:
        if a.summary and not getattr(e, "summarised", False):
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
    ctx.data.update(report)
    verdict = say_audit(ctx, report, plan, failures, results, review, grades)
    if a.summary:
        write_summary(a.summary, None, trust.summary(verdict, failures,
                                                     render_report(plan, recent), review,
                                                     results, grades))
    if a.verdict:
        write_verdict(a.verdict, verdict, failures, results, nonce)
    if failures:  # each gate's fix is said above (and under --json, in `failures`)
        error = FablizeError("audit: " + (f"{failures[0]['message']} — {failures[0]['fix']}"
                                          if len(failures) == 1 else
                                          "; ".join(f["message"] for f in failures) +
                                          " (the fix of each is said above)"),
                             failures[0]["code"], EXIT_REFUSED)
        error.summarised = True
        if failures[0].get("commands"):  # the first gate's step, whole
            error.commands = failures[0]["commands"]
        raise error


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
        data, logs, which = sharing_room().audit_source(ctx.store, a.remote, plan_id, named_by)
        # pinned: CI named the plan, or the base's pin did; else the tree under audit chose it
        which["pinned"] = base is not None and base.get("plan_id") == which["plan_id"]
        report = audit_ledger(data, None, a.require_independent_judge, logs=logs, scan=scan)
        report["snapshot"] = "none on a remote (its ledger is the whole of it)"
        report["remote_plan"] = which
        return report
    with open_plan(ctx, exclusive=False) as s:
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
            lineno = getattr(e, "lineno", None)
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
    anew = [create_command(ctx.prog, force=True)]  # the plan kept whole in archive/
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


def say_audit(ctx, report, plan, failures, results, review, grades):
    """What audit says: its verdict (returned, for the job summary), every failed gate with its
    fix, the ledger, the head to keep, the plan, the trust room's findings, the re-run, the
    grades, and completed stories whose last observed run failed."""
    from . import trust
    ledger_line = (f"{count_noun(report['event_count'], 'event')}, hash chain intact, every event "
                   f"one fablize writes and legal when replayed; snapshot {report['snapshot']}.")
    checks = results["checks"] if results else []
    rerun_passed = checks and all(r["ok"] for r in checks)
    if failures:
        verdict = (f"❌ audit failed: {count_noun(len(failures), 'gate')} said no — " +
            ", ".join(f["code"] for f in failures))
        ctx.say(f"fablize: {verdict}")
        for line in trust.gate_lines(failures):
            ctx.say(line)
        ctx.say(f"  ledger: {ledger_line}")
    else:
        verdict = ("✅ re-witnessed: every frozen check passed again; " if rerun_passed else
                   "✅ ") + f"audit ok — {report['done']}/{report['total']} done"
        if rerun_passed:
            ctx.say(f"fablize: ✅ re-witnessed — {count_noun(len(checks), 'frozen check')} "
                    "passed again, run by this audit")
        ctx.say(f"fablize: audit ok — {ledger_line}")
    ctx.say(f"  head: {report['head']}   (keep it; `audit --since` proves later history only grew)")
    accepted = report["accepted"]
    ctx.say(f"  plan: {report['done']}/{report['total']} done — {defused_line(plan['brief'])}"
            + (f" ({', '.join(accepted)} accepted by a human decision)" if accepted else ""))
    which = report.get("remote_plan")
    if which is not None:
        ctx.say(f"  shared plan: {which['plan_id']} as {one_line(which['remote'])} holds it, "
                f"named by {one_line(which['named_by'])}" + ("" if which["pinned"] else
                " — unpinned: nothing the pull request cannot write chose it (give --base, "
                "whose pin names the plan)"))
    if report["torn_tail_bytes"]:
        ctx.say(f"  torn tail: {report['torn_tail_bytes']} bytes after the last event — a write "
                "that never completed; the next writing command moves it aside.")
    missing_logs = report["missing_logs"]
    if missing_logs:
        ctx.say(f"  {count_noun(missing_logs, 'run log')} not present here (not committed?); their "
                "digests are in the ledger.")
    for line in trust.lines(review, results):
        ctx.say(line)
    if grades:
        ctx.say("  " + grades_line(grades))
    if capped_line(plan):  # a warning, not a failure: --require-complete fails the plan
        ctx.say("  " + capped_line(plan))
    claimed = claimed_final(plan)
    if claimed:  # a warning, not a failure: the strict recipe's --require-witnessed fails it
        ctx.say("  " + claimed)
        ctx.data["claimed_final"] = plan["goals"][-1]["id"]
    for s in stories_in(plan, "complete"):
        o = unaddressed_failure(s)
        if o is not None:
            ctx.say(f"  {s['id']}: the harness last saw `{one_line(last_chars(o['cmd'], 120))}` "
                    f"fail (event {o.get('seq')}) before it was checkpointed")
    return verdict


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


def cmd_rebuild(ctx, a):
    """rebuild: goals.json regenerated from the ledger, the old one kept. The way out of every
    snapshot that is not the ledger's, and of a last line that is no event (kept in
    ledger.jsonl.broken, said); a ledger with no event leaves no plan, said with the old
    snapshot's name, for a human to start again."""
    with open_plan(ctx) as s:
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
            if getattr(e, "run_next", None) != "rebuild":
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
            s.save_snapshot(plan)
        s.plan = plan
        taken = reconcile_shared(ctx, s)
        plan = s.plan
        if plan is None:
            if kept is None:
                raise no_plan()
            held = "is missing" if s.ledger.open() is None else "holds no event"
            ctx.say(f"fablize: {LEDGER} {held}: the plan's history is gone, so there is "
                    f"no plan to rebuild; the old {SNAPSHOT} is kept as {kept} (it lists the "
                    "stories). A human starts again:")
            ctx.say(f"  {create_command(ctx.prog)}")
            ctx.data.update(event_count=0, kept=kept, plan=None)
            return
    ctx.say(f"fablize: rebuilt {SNAPSHOT} from {count_noun(replay.seq, 'ledger event')}"
            + (f"; the old one is kept as {kept}." if kept else ".")
            + (f" Then {count_noun(taken, 'event')} came in from the shared plan's remote "
               "(the events it holds, damaged here)." if taken else ""))
    ctx.data.update(event_count=plan["ledger"]["seq"], kept=kept, plan=plan_json(plan))


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


def history_steps(ctx, error):
    """The way out of damage no command repairs — a ledger line that is no event or breaks the
    chain, an event fablize would not have written, a run log that is not the one recorded:
    a human's decision, said, between the copy git holds as last committed (where it differs
    from what is here) and a new plan (this one kept whole in archive/)."""
    log = getattr(error, "path", None)
    restore = committed_copy(ctx.store, [log] if log else [LEDGER], whole=log is None)
    if "a human decides" not in error.message:  # the message whole, then the way out
        error.message += ((" No" if error.message.endswith(".") else " — no") +
                          " command repairs a history: a human decides between "
                          + ("its copy as last committed and " if restore else "") +
                          "a new plan (this one is kept whole in archive/):")
    error.commands = restore + [create_command(ctx.prog, force=True)]


def committed_copy(store, names, whole=False):
    """[`git checkout HEAD -- …`] of the state files `names` (or, `whole`, of the state
    directory) when git holds them as last committed and what is here differs — the way back
    to them, as runnable from where the user stands — else [] (no repository, never committed,
    the same as committed, or no git)."""
    top = repo_root(store.root)
    if top is None or not os.path.lexists(os.path.join(top, ".git", "HEAD")) and os.path.isdir(
            os.path.join(top, ".git")):  # no repository there (an empty .git): no git started
        return []
    paths = [store.path(name) for name in names]
    try:  # outside a repository `git diff` compares files (--no-index): HEAD's first
        if git(store.root, "rev-parse", "--verify", "--quiet", "HEAD")[0] != 0:
            return []
        if git(store.root, "diff", "--quiet", "--no-ext-diff", "--no-textconv", "HEAD", "--",
               *paths)[0] != 1:
            return []
    except FablizeError:
        return []
    end = "/" if whole else ""
    targets = [store.dir] if whole else paths
    if within(os.path.realpath("."), os.path.realpath(store.root)):  # inside: as typed there
        return ["git checkout HEAD -- " + " ".join(quote_arg(from_here(p) + end)
                                                  for p in targets)]
    return [f"git -C {quote_arg(store.root)} checkout HEAD -- " + " ".join(
        quote_arg(os.path.relpath(p, store.root) + end) for p in targets)]


def last_line_alone_damaged(ledger):
    """Whether the ledger's last whole line, and only it, is no event."""
    end = ledger.end()[0]
    if not end:
        return False
    offset, line = next(ledger.backward(end))
    prev = ledger.last(offset) if offset else None
    return parse_event(line) is None and (prev is None or parse_event(prev) is not None)


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
    """log: every event, checked as audit checks it, a line each. The whole history is printed
    as it is replayed, in batches (memory flat in the ledger's length; damage stops it at the
    line it names); under --json, or for one story, it is gathered first."""
    events = []
    streaming = not ctx.json and a.id is None

    def pick(replay, line, ev):
        if (a.id is None or ev.get("id") == a.id or ev["event"] == "plan_created" or
                (ev["event"] == "story_added" and ev["story"]["id"] == a.id)):
            if ctx.json:
                events.append(ev)
            else:
                ctx.say(format_event(ev))

    def stream(replay, batch):  # the whole history as text: each batch said once it replayed,
        # written every 512 lines or so, which the CPU's cache still holds as they are joined
        # and encoded (log of 100,000 real runs, medians of 15: 1.29 → 1.25 s CPU against
        # every 4,096)
        said.extend(map(format_event, batch))
        if len(said) >= 512:
            ctx.out.flush(escaped=True)

    with open_plan(ctx, exclusive=False) as s:
        s.refuse_original()
        if s.ledger.open() is None:
            raise no_plan()
        s.see_lost_newline(loose_snapshot(s.store))
        try:
            said = ctx.out.lines
            replay = (replay_all(s.ledger, s.good_end(None), on_batch=stream) if streaming else
                      replay_all(s.ledger, s.good_end(None), pick))
        except FablizeError:
            ctx.out.lines.clear()  # what was not yet written stays unsaid: the damage is the news
            raise
    if replay.plan is None:
        raise no_plan()
    if a.id is not None:
        find_story(replay.plan, a.id)
    ctx.data["events"] = events


def cmd_report(ctx, a):
    with open_plan(ctx, exclusive=False) as s:
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
        try:
            target, st = user_file(ctx.store.root, a.out, a.outside)
        except FablizeError as e:  # the user's to choose: outside after all, or another file
            e.commands = ([rerun_command(ctx.prog, ctx.argv) + " --outside"]
                          if e.code == "outside_project" else
                          [f"{ctx.prog} report --out \"<another file>\""
                           + (" --outside" if a.outside else "")])
            raise
        write_atomic(target, text.encode("utf-8"), st.st_mode & 0o7777 if st else 0o644)
    elif target:  # CI's job summary, where CI keeps it: appended to
        with open(target, "ab+") as f:
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")  # a heading must start its own line
            f.write(text.encode("utf-8"))
    if target:
        ctx.say(f"fablize: report written to {target}")
    else:
        ctx.say(text)
    ctx.data.update(markdown=text, path=target)
    if wires is not None:
        ctx.data["tripwires"] = wires


def cmd_judge_packet(ctx, a):
    """judge-packet: what an independent judge needs — the objective, a checklist of every
    frozen check (with this round's witnessed run) and acceptance item, the executor's
    evidence and runs, and the three verdict commands. For a story in review it also records
    the working tree (record_judge_packet), so a verdict given after the judge changed it is
    void; for any other story it is for reading only and offers no verdict."""
    with open_plan(ctx, exclusive=False) as s:
        plan = s.require_plan()
    packet = None
    if find_story(plan, a.id)["status"] == "review":
        plan, packet = record_judge_packet(ctx, a.id)
    story = find_story(plan, a.id)
    items = [{"kind": "check", "text": cmd, "run": latest_run(story, check=i) or next(
        (r for r in reversed(story["runs"]) if r["check"] == i), None)}
        for i, cmd in enumerate(story["checks"])]
    items += [{"kind": "item", "text": text} for text in story["accept"]]
    lines = [f"=== fablize judge packet — {story['id']} {defused_line(story['title'])} "
             f"[{story['status']}, round {story['round']}]",
             "You are the judge. You did not do this work: judge the artifact itself, not anyone's "
             "account of it.",
             f"Objective: {defused_line(story['objective'])}"]
    lines += [f"Amended: {one_line(x['note'])}" for x in story["amendments"]]
    lines.append("Checklist — every item must be seen to pass:")
    for n, item in enumerate(items, 1):
        if item["kind"] == "check":
            run = item["run"]
            seen = f" — witnessed: {run_summary(run)}" if run else " — no run this round"
            lines.append(f"  [ ] {n}. run `{one_line(item['text'])}`{seen}")
        else:
            lines.append(f"  [ ] {n}. {one_line(item['text'])}")
    if not items:
        lines.append("  [ ] 1. the objective above, as stated")
    lines.append("Executor's evidence (this round):")
    lines.append(indent(defuse(story["evidence"])) if not blank(story["evidence"])
                 else "    (none)")
    if story["runs"]:
        lines.append("Witnessed runs (this round):")
        for r in story["runs"]:
            lines.append(f"  event {r['seq']}: {defuse(run_summary(r))} — output tail:")
            lines.append(indent(defuse(last_chars(r["tail"])), "      "))
    wires = None
    if a.base:  # what the work's code does to its judge, since the base
        from . import trust
        wires = trust.tripwires_since(ctx.store, plan, a.base)
        lines += trust.tripwire_lines(wires) or [
            f"Tripwires since {one_line(a.base)}: none (no line of the work reaches into the test "
            "run or looks for its judge)."]
    sid = story["id"]
    instructions = [
        "Go to the artifact (files, the running program, its output) and check every item.",
        "An item without evidence you saw yourself is not passed. Ambiguous means not achieved.",
        "Do not fix the work. Answer with exactly one verdict:"]
    verdicts = [
        f"{ctx.prog} verdict --id {sid} achieved --evidence \"<what you checked and saw>\" --agent "
        "<you>",
        f"{ctx.prog} verdict --id {sid} not-achieved --evidence \"<what is missing, not how to fix "
        "it>\" --agent <you>",
        f"{ctx.prog} verdict --id {sid} unachievable --evidence \"<why more rounds cannot help>\" "
        "--agent <you>",
    ]
    if story["status"] != "review":  # a verdict on it would be refused: offer none
        verdicts = []
        instructions = [f"{sid} is {story['status']}, not in review: there is nothing to judge "
                        "now, and a verdict would be refused. This packet is for reading only."]
    lines += ["How to judge:"] + [f"  - {x}" for x in instructions] + [f"    {x}" for x in verdicts]
    if packet:
        lines.append(f"Working tree recorded (event {packet['seq']}: {packet['files']} files, "
                     "sha256 "
                     f"{packet['tree'][:16]}…): a verdict given after any change to it is void and "
                     "goes back as not-achieved.")
    for line in lines:
        ctx.say(line)
    ctx.data["packet"] = packet
    ctx.data.update(id=sid, status=story["status"], round=story["round"],
                    objective=story["objective"], amendments=story["amendments"],
                    checklist=items, evidence=story["evidence"], runs=story["runs"],
                    instructions=instructions, verdicts=verdicts)
    if wires is not None:
        ctx.data["tripwires"] = wires


def cmd_verdict(ctx, a):
    void = tree_changed_verdict(ctx, a)
    with open_plan(ctx) as s:
        s.require_plan()
        fields = {"verdict": a.verdict,
                  "evidence": masked_text("--evidence", a.evidence, s.store.root)}
        try:
            s.commit("verdict", id=a.id, agent=a.agent, **dict(fields, **(void or {})))
        except FablizeError as e:
            verdict_step(ctx, a, e)
            raise
        plan = s.plan
    story = find_story(plan, a.id)
    ctx.data.update(story=story_json(plan, story))
    if void:
        error = refused(f"the working tree changed since the judge packet (event "
                        f"{void['packet_seq']}): the verdict is refused and recorded as "
                        f"not-achieved — {a.id} is {story['status']}; a judge must not change what "
                        "it judges.", "tree_changed")
        action = next_action(ctx.prog, plan)
        error.commands = [action["cmd"]] if action.get("cmd") else [f"{ctx.prog} status"]
        raise error
    say_after_checkpoint(ctx, plan, story)


def verdict_step(ctx, a, error):
    """The whole command of the step a refused verdict names: the verdict again with what the
    judge has to write as a placeholder, or, for the story's own executor, the packet an
    independent judge starts from."""
    if error.code in ("no_evidence", "no_agent"):
        error.commands = [verdict_command(
            ctx.prog, a.id, a.verdict, None if blank(a.evidence) else a.evidence,
            None if blank(a.agent) else a.agent)]
    elif error.code == "judge_not_independent":
        error.commands = [f"{ctx.prog} judge-packet --id {a.id}"]


def cmd_pause(ctx, a):
    with open_plan(ctx) as s:
        s.require_plan()
        s.commit("paused", note=masked_text("--note", a.note, s.store.root))
        plan = s.plan
    ctx.say(f"fablize: guard paused (event {plan['ledger']['seq']}) — the Stop hook lets the agent "
            f"stop until `{ctx.prog} unpause`.")
    ctx.data.update(paused=guard_paused(plan))


def cmd_unpause(ctx, a):
    with open_plan(ctx) as s:
        s.require_plan()
        s.commit("unpaused")
        plan = s.plan
    ctx.say(f"fablize: guard on again (event {plan['ledger']['seq']}) — the Stop hook keeps the "
            "agent at work while the plan has some.")
    ctx.data.update(paused=None)


def say_observed(ctx, story):
    """After a checkpoint: the observed runs of the round, and a failure left standing."""
    seen = observed_of(story)
    ctx.data["observed"] = seen
    for line in render_observed(story):
        ctx.say(line)
    bad = unaddressed_failure(story)
    if bad is not None and story["status"] in DONE + ("review",):
        ctx.out.warn(f"{story['id']} was checkpointed while the harness last saw "
                     f"`{one_line(bad['cmd'])}` "
                     f"fail (event {bad.get('seq')}): `status`, `report` and `audit` show it "
                     "to the reviewer.")
