"""Rendering: how the engine names itself, the handoff, status, the plan map, report. Text
only: nothing here writes state.
"""

import collections
import os
import re
import sys

from .base import (
    blank, count_noun, count_stories, create_args, defuse, defused_line, DONE, indent, last_chars,
    LEDGER, MAP_LABELS, MAP_LOOKBACK, MAP_WINDOW, MARKS, NOT_THERE, one_line, PYTHON, quote_arg,
    RESUME_CARRIED, RESUME_LISTED, RESUME_MAP, RESUME_TAIL, RESUME_TITLE, short, SNAPSHOT,
    STATUS_TABLE, TAIL_CHARS, time_label)
from .model import (
    accepted_ids, active_stories, BASE_FIELDS, blocked_because, came_back, checkpoint_args,
    claimed_final, completion_args, decide_steps, DEFAULTS, describe_exit, done_count, find_story,
    format_event,
    grade_detail, guard_capped, guard_paused, ids_text, is_final, latest_run, observed_of,
    observed_result, pick_ready, plan_done, _PRISTINE, round_failures, round_label, rounds_left,
    run_evidence, run_outcome, run_summary, status_counts, stories_in, touch, unaddressed_failure,
    verdict_args, waits_for)
from .masking import mask
from .storage import repo_root

# the folder that holds goals.py and this package (scripts/ in a checkout or a copy)
ENTRY_FOLDER = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def invocation(cwd=None):
    """The command that runs this engine, as every handoff, hook reason and block prints it:
    `fablize` when started as the installed command or through the plugin's bin/fablize; else
    goals.py, the one way in (beside this package, however the process was started), by its
    place in the repository, found from wherever the shell stands (`git rev-parse`); else, for
    a copy outside the repository, by its absolute path."""
    name, ext = os.path.splitext(os.path.basename(sys.argv[0] or ""))
    if name == "fablize" and ext.lower() != ".py":
        return "fablize"
    script = os.path.join(ENTRY_FOLDER, "goals.py")
    root = repo_root(cwd or os.getcwd())
    if root is not None:
        try:
            rel = os.path.relpath(script, root).replace(os.sep, "/")
        except ValueError:  # another drive on Windows
            rel = ".."
        if not rel.startswith("..") and re.fullmatch(r"[\w./@+-]+", rel):
            return repository_command(rel)
    return f"{PYTHON} {quote_arg(script)}"


def repository_command(rel):
    """The command that runs the repository's goals.py `rel` from any directory of any clone,
    with no absolute path: what setup commits."""
    return f'{PYTHON} "$(git rev-parse --show-toplevel)/{rel}"'


def checkpoint_command(prog, story, status, evidence):
    """A whole checkpoint command line for `story` (its agent named, as the gate asks)."""
    return f"{prog} {checkpoint_args(story, status, evidence)}"


def completion_command(prog, plan, story):
    """The checkpoint that completes `story`, as its gate will accept it."""
    return f"{prog} {completion_args(plan, story)}"


def create_command(prog, force=False):
    """A new plan, as a human writes it (base.create_args)."""
    return f"{prog} {create_args(force)}"


def rerun_command(prog, argv, env=None):
    """The command as it was started, whole (`env`: a variable set for it): the step once what
    stopped it is fixed or over — a lock another command held, a tool, a signal. A secret typed
    into it is masked, as everything the engine says is: a CI log keeps what stderr shows."""
    return (f"{env} " if env else "") + mask(" ".join([prog, *map(quote_arg, argv)]),
                                             command=True)


def verdict_command(prog, sid, verdict, evidence=None, agent=None):
    """A judge's verdict on `sid`, whole (model.verdict_args)."""
    return f"{prog} {verdict_args(sid, verdict, evidence, agent)}"


def handoff_command(prog, story):
    """The command that prints `story`'s whole handoff again without changing anything."""
    if story["agent"]:
        return f"{prog} next --agent {quote_arg(story['agent'])}"
    return f"{prog} next"


def render_map(plan, story, lookback=MAP_LOOKBACK, window=MAP_WINDOW, title=None):
    goals = plan["goals"]
    n = len(goals)
    idx = goals.index(story)
    start = max(0, idx - lookback)
    end = min(n, start + window)
    start = max(0, end - window)
    width = len(str(n))
    lines = ["## Plan map — context only: work the NOW story; do not start later ones."]
    for i in range(start, end):
        s = goals[i]
        label = "NOW" if s is story else MAP_LABELS[s["status"]]
        name = s["title"] if title is None else short(s["title"], title)
        line = f" {i + 1:>{width}}. [{label:<8}] {s['id']} {defused_line(name)}"
        if s is story:
            line += "   ← you are here"
        elif s["status"] == "in_progress" and s.get("agent"):
            line += f"   (agent {one_line(s['agent'])})"
        lines.append(line)
    if start or end < n:
        lines.append(f"  … {start} earlier stories not shown above, "
                     f"{n - end} later not shown below")
    return lines


def render_carried(plan, story, latest=None, chars=TAIL_CHARS, title=None):
    """One block per direct dependency (the `latest` few, when given): its latest evidence and
    run, their last `chars` characters, defused."""
    lines = []
    after = story["after"]
    if latest is not None and len(after) > latest:
        lines.append(f"## From {count_noun(len(after) - latest, 'earlier dependency')} — not "
                     f"shown here; `next` prints the whole handoff")
        after = after[-latest:]
    for dep_id in after:
        dep = find_story(plan, dep_id)
        name = dep["title"] if title is None else short(dep["title"], title)
        lines.append(f"## From {dep['id']} — {defused_line(name)} (direct dependency, "
                     f"{MAP_LABELS[dep['status']]})")
        if dep["decision"] and dep["status"] == "accepted":
            lines.append("accepted by a human decision: "
                         + defuse(last_chars(dep["decision"]["note"])))
        if not blank(dep["evidence"]):
            lines.append(f"evidence (last {chars} characters):")
            lines.append(indent(defuse(last_chars(dep["evidence"], chars))))
        run = dep["last_run"]
        if run:
            lines.append("verification run: " + defuse(run_summary(run)) + " — output tail:")
            lines.append(indent(defuse(last_chars(run["tail"], chars)) or "(no output)"))
    return lines


def render_feedback(story):
    fb = story["feedback"]
    if not fb:
        return []
    what = "Why it came back" if fb["source"] == "release" else "What was missing"
    lines = [f"## {what} (round {fb['round']}, from {came_back(story)[1]})"]
    lines.append(indent(defuse(last_chars(fb["text"]))) if not blank(fb["text"])
                 else "    (no reason was given)")
    for run in fb.get("runs", []):
        lines.append(f"failed run `{defuse(one_line(run['cmd']))}` ({run['exit']}) — output tail:")
        lines.append(indent(defuse(last_chars(run["tail"])) or "(no output)"))
    return lines


def render_round_failures(story, prefix, prog="goals.py"):
    """This round's runs that did not pass: those a signal interrupted (nothing to fix: run it
    again), then those that failed (fix what they show)."""
    failed = round_failures(story)
    stopped = [r for r in failed if r.get("interrupted")]
    failed = [r for r in failed if not r.get("interrupted")]
    lines = []
    for run in stopped:
        label = f"frozen check {run['check'] + 1}" if run["check"] is not None else "run"
        again = f"{prog} verify --id {story['id']}" + (
            f" --verify-cmd {quote_arg(run['cmd'])}" if run["check"] is None else "")
        lines.append(f"⚠ {prefix}{label} `{defuse(one_line(run['cmd']))}` was interrupted "
                     f"({describe_exit(run)}, event {run['seq']}) — nothing to fix: run it "
                     f"again: {again}")
    if not failed:
        return lines
    lines.append(f"⚠ {prefix}{count_noun(len(failed), 'run')} already failed in this round — "
                 "fix what they show before the complete checkpoint:")
    for run in failed:
        label = f"frozen check {run['check'] + 1}" if run["check"] is not None else "run"
        lines.append(f"  {label} `{defuse(one_line(run['cmd']))}` ({describe_exit(run)}, event "
                     f"{run['seq']}) — output tail:")
        lines.append(indent(defuse(last_chars(run["tail"]).rstrip("\n")) or "(no output)",
                            "      "))
    return lines


def render_observed(seen):
    """The observed runs of a round (model.observed_of), the last five."""
    if not seen:
        return []
    lines = ["## Observed runs — what your harness reported about commands you ran (observed: "
             "more than claimed, less than witnessed):"]
    lines += [f"  event {o.get('seq')}: `{one_line(o['cmd'])}` → {observed_result(o)}"
              for o in seen[-5:]]
    return lines


def render_handoff(prog, plan, story, reshown, brief=False):
    """A story's handoff: what a fresh session needs to do it (`reshown`: it was already in
    progress). `brief` (what a session start injects): a smaller map window and the latest
    few direct dependencies, so that it stays short however large the plan."""
    lines = [f"=== fablize handoff — {story['id']} {defused_line(story['title'])}",
             f"Objective: {defused_line(story['objective'])}"]
    for a in story["amendments"]:
        lines.append(f"Amended ({a['ts'][:10]}): {one_line(a['note'])}")
    if reshown:
        lines.append(f"⚠ Resumed: this story was already in progress (round {story['round']}, "
                     "started "
                     f"{time_label(story['started_ts'])}). Continue it; do not restart it.")
    elif story["round"] > 1:
        released = (story["feedback"] or {}).get("source") == "release"
        lines.append(f"⚠ Reopened: {round_label(plan, story)} — {came_back(story)[0]}; "
                     f"{'why' if released else 'what was missing'} is below. Continue the work; "
                     "do not restart it.")
    if reshown:
        lines += render_round_failures(story, "Resumed: ", prog)
    if reshown or story["round"] > 1:
        lines.append("  Files from the earlier attempt exist only if that work was kept (committed "
                     "or "
                     "still in this working tree): check before relying on them.")
    lines.append("Rule: work this story only. Produce evidence as you go.")
    if is_final(plan, story):
        if story["checks"]:
            lines.append("★ Final story — its frozen checks must pass: the engine runs them at the "
                         "complete checkpoint (verification gate).")
        elif plan["options"]["require_run"]:
            lines.append("★ Final story — this plan requires a witnessed run: the complete "
                         "checkpoint needs --run --verify-cmd (the engine runs it; verification "
                         "gate).")
        else:
            lines.append("★ Final story — the complete checkpoint requires verification: prefer "
                         "--run --verify-cmd (witnessed: the engine runs it); --verify-cmd with "
                         "--verify-evidence is recorded as claimed (verification gate).")
    lines += (render_map(plan, story, *RESUME_MAP, title=RESUME_TITLE) if brief
              else render_map(plan, story))
    lines += (render_carried(plan, story, RESUME_CARRIED, RESUME_TAIL, RESUME_TITLE) if brief
              else render_carried(plan, story))
    lines += render_feedback(story)
    if story["checks"]:
        lines.append("## Frozen checks — the engine runs all of them at `complete`; no substitute "
                     "command counts:")
        flagged = {u["check"]: u["reason"] for u in plan["unverifiable"] if u["id"] == story["id"]}
        for i, cmd in enumerate(story["checks"]):
            note = ("" if i not in flagged else
                    f"   (not there yet: {one_line(flagged[i])}; write it first)"
                    if flagged[i].endswith(NOT_THERE) else
                    f"   ⚠ cannot run here: {one_line(flagged[i])}")
            lines.append(f"  {i + 1}. {one_line(cmd)}{note}")
    if story["accept"]:
        lines.append("## Acceptance items — a judge checks each one:")
        lines += [f"  - {one_line(item)}" for item in story["accept"]]
    if story["judge"]:
        lines.append("Judged story: `complete` moves it to review; an independent judge decides.")
    lines += render_observed(observed_of(story))
    lines.append("Not achieved yet: " + checkpoint_command(prog, story, "failed",
                                                            "<what is missing>"))
    lines.append("Impossible as specified: " + checkpoint_command(prog, story, "blocked", "<why>")
                 + "   (then stop and ask a human)")
    lines.append("On completion: " + completion_command(prog, plan, story))
    if is_final(plan, story) and not story["checks"] and not plan["options"]["require_run"]:
        lines.append("  (only if the engine cannot run it, a claimed completion: --verify-cmd "
                     "\"<command>\" --verify-evidence \"<result>\" without --run)")
    return lines


def render_resume(prog, plan, story):
    """What `status` shows of a story in progress: enough to pick it up after a crash."""
    lines = [f"## Resume {story['id']} — {defused_line(story['title'])} (round {story['round']}, "
             f"started {time_label(story['started_ts'])})",
             f"Objective: {defused_line(story['objective'])}"]
    lines += [f"Amended: {defused_line(a['note'])}" for a in story["amendments"]]
    fb = story["feedback"]
    if fb:
        lines.append(f"What was missing last round (round {fb['round']}):")
        lines.append(indent(defuse(last_chars(fb["text"], 300))) if not blank(fb["text"])
                     else "    (no reason was recorded)")
    lines += render_round_failures(story, "", prog)
    lines.append("Full handoff (plan map, dependencies' evidence, checks): "
                 + handoff_command(prog, story))
    lines.append(f"  or, for every story in progress: {prog} status --resume")
    lines.append("Then: " + completion_command(prog, plan, story))
    return lines


def render_session_start(prog, plan, share=(), step=None):
    """What a session start hands a new session, bounded however large the plan: the count,
    the stories by status, those a human or a judge must look at (a few), the next step, the
    first story in progress with its whole handoff (a short map window, its latest
    dependencies), a line for each other one; `status` for the rest."""
    lines = [count_line(plan)]
    counts = collections.Counter(s["status"] for s in plan["goals"])
    lines.append("  " + " · ".join(f"{counts[status]} {word}" for status, word in
                                   STATUS_WORDS.items() if counts[status]))
    stuck = [s for s in plan["goals"] if s["status"] in ("failed", "blocked", "review")]
    for story in stuck[:RESUME_LISTED]:
        story = touch(story)
        why = (f": {one_line(last_chars(blocked_because(story), 120))}"
               if story["status"] == "blocked" else "")
        lines.append(f"  {MARKS[story['status']]} {story['id']} [{story['status']}] "
                     f"{one_line(short(story['title'], RESUME_TITLE))}{why}")
    if len(stuck) > RESUME_LISTED:
        lines.append(f"  … and {len(stuck) - RESUME_LISTED} more: `{prog} status` lists them")
    if plan["unverifiable"]:
        lines.append(f"  ⚠ {count_noun(len(plan['unverifiable']), 'frozen check')} cannot run "
                     f"here yet: `{prog} status` lists them")
    lines += paused_line(prog, plan)
    if capped_line(plan):
        lines.append("  " + capped_line(plan))
    action = step or next_action(prog, plan)
    lines.append(next_line(action))
    lines += share
    active = active_stories(plan)
    if active:
        lines.append("")
        lines += render_handoff(prog, plan, active[0], True, brief=True)
    for story in active[1:RESUME_LISTED + 1]:
        lines.append(f"Also in progress: {story['id']} "
                     f"{one_line(short(story['title'], RESUME_TITLE))}"
                     + (f" (agent {one_line(story['agent'])})" if story["agent"] else "")
                     + f" — its handoff: {handoff_command(prog, story)}")
    if len(active) > RESUME_LISTED + 1:
        lines.append(f"… and {len(active) - RESUME_LISTED - 1} more in progress: "
                     f"`{prog} status` lists them")
    return lines


def text_session_start(data, prog, plan=None, sharing=None, in_flight=(), unreadable=None):
    """What a session start says (hooks.session_start): a copy behind its remote says so first,
    then render_session_start, the runs in flight; one line for a finished plan; a warning
    line for a plan that cannot be read (`unreadable`: where, why)."""
    lines = []
    if plan is not None and plan_done(plan):
        lines.append(f"fablize: plan finished ({done_count(plan)}/{len(plan['goals'])} done) — "
                     f"{defused_line(last_chars(plan['brief'], 200))}; nothing to resume.")
    elif plan is not None:
        share = data.get("share")
        first, step = (sharing.behind_step(share, prog) if share else None) or (None, None)
        lines = ([first] if first else []) + render_session_start(
            prog, plan, sharing.status_lines(share, prog) if share else (), step)
        lines += inflight_lines(prog, in_flight)
    if unreadable:
        lines.append(f"fablize: warning: the plan in {unreadable[0]} cannot be read — "
                     f"{one_line(unreadable[1])} (`{prog} audit` says more).")
    return lines


# each status as a session start counts it, in the order it counts them
STATUS_WORDS = {"complete": "complete", "accepted": "accepted", "in_progress": "in progress",
                "review": "in review", "failed": "failed", "blocked": "blocked",
                "pending": "pending"}


def count_line(plan):
    """The plan's first line: how much is done, and its brief."""
    counts = status_counts(plan)
    # a human's accept is not a completion: with one, the count says `done`, never `complete`
    counted = (f"done ({ids_text(accepted_ids(plan))} accepted by a human decision)"
               if counts["accepted"] else "complete")
    return (f"fablize: {sum(counts[s] for s in DONE)}/{len(plan['goals'])} {counted} — "
            f"{defused_line(plan['brief'])}")


def paused_line(prog, plan):
    paused = guard_paused(plan)
    if not paused:
        return []
    return [f"  ⏸ guard paused since event {paused['seq']}"
            f"{': ' + one_line(paused['note']) if paused['note'] else ''}"
            f" — `{human_command(prog)} unpause` turns it back on"]


def waits_line(plan, story, previous=None, in_order=False):
    """`waits for G002, G005` under a story in `status`, or None: not when the plan's order
    already says it — a story waiting only for the one before it (`previous`, its id), or the
    final story of a sequential plan (`in_order`: each story after the one before it), which
    waits for all of them one by one: a sequential plan is one line a story, not two."""
    waiting = waits_for(plan, story)
    if not waiting or waiting == [previous] or (in_order and story is plan["goals"][-1]):
        return None
    return "waits for " + ids_text(waiting)


# why a second agent gets nothing in a sequential plan, and what would let agents work at once
TAKE_TURNS = ("this plan's stories go one after another: its agents take turns; a plan made with "
              "`create --parallel`, or `--after`, has stories they can work at once")


def sequential(plan):
    """Whether every story but the final one waits for exactly the one before it (`create`'s
    default): one pass, asked once a status."""
    goals = plan["goals"]
    return all(s.get("after", []) == ([goals[i - 1]["id"]] if i else [])
               for i, s in enumerate(goals[:-1]))


def status_details(plan, story, previous=None, in_order=False):
    """The lines under a story in `status`: its round, holder, what it waits for (when the
    plan's order does not say it already: waits_line), why it is blocked, what its completion
    rests on, its amendments."""
    if _PRISTINE.issuperset(story):  # untouched since `create`: at most what it waits for
        line = waits_line(plan, story, previous, in_order)
        return [line] if line else []
    touch(story)
    details = []
    if story["status"] in DONE:
        if story["round"] > 1:
            details.append(f"done in round {story['round']}")
    elif story["round"] > 1 or story["status"] in ("failed", "in_progress"):
        details.append(f"{round_label(plan, story)}, "
                       f"{count_noun(max(rounds_left(plan, story), 0), 'round')} left")
    if story["status"] == "in_progress" and story["agent"]:
        details.append(f"held by agent {one_line(story['agent'])}")
    if story["status"] in ("pending", "failed"):
        line = waits_line(plan, story, previous, in_order)
        if line:
            details.append(line)
    if story["status"] == "blocked":
        details.append("blocked: " + one_line(last_chars(blocked_because(story), 200)))
    if story["status"] == "review":
        details.append("awaiting an independent judge")
    if story["status"] in ("accepted", "complete", "review") and grade_detail(story):
        details.append(grade_detail(story))
    for a in story["amendments"]:
        details.append("amended: " + one_line(last_chars(a["note"], 200)))
    bad = unaddressed_failure(story) if story["status"] in DONE + ("review",) else None
    if bad is not None:
        details.append(f"the harness last saw `{one_line(last_chars(bad['cmd'], 120))}` fail "
                       f"(event {bad.get('seq')}) before it was checkpointed")
    return details


def next_action(prog, plan, agent=None, anyone=False):
    """What to do now — the one answer `next`, `status`, `checkpoint`, `decide`, `verdict`, the
    guard and every refusal give, so no two commands disagree and no suggested command is one a
    gate then refuses. A dict: kind (done, finish, next, decide, judge, wait), id (the story),
    cmd (the command line, runnable as printed) and text (one line)."""
    if plan_done(plan):
        return {"kind": "done", "id": None, "cmd": None, "text": done_line(plan)}
    active = active_stories(plan)
    # never another agent's story: an unnamed caller is handed only stories no agent holds —
    # but for the Stop hook's guard (`anyone`), which cannot tell who is stopping and holds
    # back whoever works while any story is in progress
    mine = [s for s in active if anyone or s["agent"] == agent]
    if mine:
        s = mine[0]
        command = completion_command(prog, plan, s)
        return {"kind": "finish", "id": s["id"], "cmd": command,
                "text": f"finish {s['id']}, then `{command}`"}
    held = [s for s in active if s["agent"] is not None]
    ready = pick_ready(plan)
    if ready is not None:
        # `next` without --agent would hand an unnamed caller the story an agent holds
        name = quote_arg(agent) if agent is not None else "<your name>" if held else None
        command = f"{prog} next" + (f" --agent {name}" if name else "")
        others = "" if agent is not None or not held else f"; {others_line(held)}"
        return {"kind": "next", "id": ready["id"], "cmd": command,
                "text": f"`{command}` (activates {ready['id']}){others}"}
    blocked = stories_in(plan, "blocked")
    if blocked:
        s = blocked[0]
        commands = decide_commands(prog, s["id"])
        reason = one_line(last_chars(blocked_because(s), 200))
        return {"kind": "decide", "id": s["id"], "cmd": commands[0], "commands": commands,
                "text": f"{s['id']} is blocked ({reason}) — the plan halts here: nothing that "
                        "depends on it can start. A human must decide, with one of:"}
    review = stories_in(plan, "review")
    if review:
        s = review[0]
        command = f"{prog} judge-packet --id {s['id']}"
        return {"kind": "judge", "id": s["id"], "cmd": command,
                "text": f"{s['id']} awaits an independent judge: hand {s['id']} to the judge, who "
                        f"runs `{command}`"}
    held = ", ".join(f"{s['id']} ({one_line(s['agent'] or 'no agent')})" for s in active)
    return {"kind": "wait", "id": None, "cmd": None,
            "text": f"nothing is ready{' for agent ' + one_line(agent) if agent else ''}: in "
                    f"progress {held}; the rest waits for them"}


def others_line(held):
    """The stories agents hold, said as theirs: each agent finishes its own."""
    said = ", ".join(f"{s['id']} is agent {one_line(s['agent'])}'s" for s in held[:3])
    more = f" (and {len(held) - 3} more)" if len(held) > 3 else ""
    return (f"{said}{more}: only its agent finishes it (`status --agent NAME` gives an agent its "
            "own step)")


def hand_to_judge(prog, story):
    sid = story["id"]
    return (f"fablize: {sid} \"{defused_line(story['title'])}\" is in review — hand {sid} to the "
            f"judge: start the fablize-judge agent (or another independent reviewer) on {sid}; it "
            f"runs {prog} judge-packet --id {sid} and answers with a verdict. Do not judge "
            "your own work.")


def plan_summary(plan):
    """The counts every command's --json carries: `done` is always a count."""
    return {"done": done_count(plan), "total": len(plan["goals"]), "complete": plan_done(plan)}


def left_line(plan, action):
    """After a transition: what is left and what to do next (`action`): a line, and a line for
    each of its alternative commands."""
    if action["kind"] == "done":
        return action["text"]
    left = count_stories(len(plan["goals"]) - done_count(plan))
    return with_commands(f"fablize: {left} left — next: {action['text']}", action)


def next_line(action):
    if action["kind"] == "done":
        return action["text"]
    return with_commands(f"fablize: next — {action['text']}", action)


def with_commands(line, action):
    """`line`, then each alternative command of `action` whole on its own line."""
    return "\n".join([line] + [f"  {cmd}" for cmd in action.get("commands", ())])


def decide_commands(prog, sid):
    """What a human may run: in their own terminal, so the plugin's engine by its full path."""
    return [step_text(step, prog) for step in decide_steps(sid)]


def step_text(step, prog, argv=()):
    """A step an error or a result names (base.Step, or a whole command as a string), as a
    command line runnable as printed: the engine as it was started (`prog`, its arguments
    `argv`), a person's engine in their own terminal for a human's step."""
    if isinstance(step, str):
        return step
    if step.kind == "engine":
        return f"{prog} {step.args}"
    if step.kind == "human":
        return f"{human_command(prog)} {step.args}"
    return rerun_command(prog, argv, step.env) + (f" {step.args}" if step.args else "")


def human_command(prog):
    """The engine as a person runs it in their own terminal: `prog`, except when it was started
    through the plugin's bin/fablize, which is on the PATH of Claude Code's Bash tool only —
    then that file, by its full path."""
    if prog != "fablize":
        return prog
    top = os.path.dirname(ENTRY_FOLDER)
    launcher = os.path.join(top, "bin", "fablize")
    if os.path.isfile(os.path.join(top, ".claude-plugin", "plugin.json")) and os.path.isfile(
            launcher):
        return quote_arg(launcher)
    return prog


def capped_line(plan):
    """What `status`, a session start, `report` and `audit` say of a stop the guard let through
    at its cap while work was left (nothing has happened since), or None: never a line that
    reads as done."""
    capped = guard_capped(plan)
    if capped is None:
        return None
    return (f"⚠ the agent stopped with work left: the guard let it stop after {capped['blocks']} "
            f"blocks in a row (event {capped['seq']}, {time_label(capped['ts'])}) — the plan is "
            "not finished")


def done_line(plan):
    accepted = [s["id"] for s in plan["goals"] if s["status"] == "accepted"]
    if accepted:
        return f"fablize: all stories done ✓ ({', '.join(accepted)} accepted by a human decision)"
    return "fablize: all stories complete ✓"


def story_json(plan, story):
    """A story in --json: every field of STORY_FIELDS (defaults filled in), and what follows
    from the plan: whether it is the final story, its rounds left, what it waits for."""
    touch(story)  # checked, and a snapshot's story from before grades given its grade
    data = {key: story.get(key, default) for key, default in DEFAULTS.items()}
    data.update(final=is_final(plan, story), rounds_left=rounds_left(plan, data),
                waits_for=waits_for(plan, story))
    return data


def plan_json(plan):
    return {"plan_id": plan["plan_id"], "brief": plan["brief"], "created": plan["created"],
            "scope": plan.get("scope", []),
            **plan_summary(plan), "accepted": accepted_ids(plan), "options": plan["options"],
            "unverifiable": plan["unverifiable"], "ledger": plan["ledger"],
            "stories": [story_json(plan, s) for s in plan["goals"]]}


GRADES_EACH = 8  # up to this many stories, each story's grade is told; beyond, each grade's count


def grade_groups(grades):
    """[(grade, its stories' ids)] of {id: grade}, the most common grade first: how a plan of
    thousands of stories tells its grades without a line of thousands of ids."""
    groups = {}
    for sid, grade in grades.items():
        groups.setdefault(grade, []).append(sid)
    return sorted(groups.items(), key=lambda g: -len(g[1]))


def grades_line(grades):
    """`grades: G001 witnessed, G002 claimed`, or by grade for a long plan: `grades: 9,998
    witnessed, 2 claimed (G0042, G0077)` (the ids of a grade held by a few stories)."""
    if len(grades) <= GRADES_EACH:
        return "grades: " + ", ".join(f"{sid} {grade}" for sid, grade in grades.items())
    return "grades: " + ", ".join(f"{len(ids):,} {grade}{few_ids(ids)}"
                                  for grade, ids in grade_groups(grades))


def few_ids(ids):
    """` (G0042, G0077)` for a few stories, nothing for many."""
    return f" ({', '.join(ids)})" if len(ids) <= GRADES_EACH else ""


def md_cell(text, limit=120):
    text = one_line(last_chars(text or "", limit) if len(text or "") > limit else text or "")
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("`", "'")


# a run's result cell in `report`: an interrupted run says so (its exit words), never FAIL
REPORT_OUTCOME = {"passed": "pass: ", "failed": "FAIL: ", "interrupted": ""}


def render_report(plan, runs, total=None):
    """`report`: a Markdown summary (progress, a row a story, the latest runs, the dependency
    graph) for a pull request or a CI job summary."""
    goals = [touch(s) for s in plan["goals"]]
    done = done_count(plan)
    filled = round(20 * done / len(goals))
    lines = [f"# fablize report — {md_cell(plan['brief'], 200)}", "",
             f"`{'█' * filled}{'░' * (20 - filled)}` **{done}/{len(goals)} done** "
             f"({100 * done // len(goals)}%)" +
             (" — " + done_line(plan)[len("fablize: "):] if plan_done(plan) else ""),
             *(["", md_cell(capped_line(plan), 300)] if capped_line(plan) else []),
             "", "| Story | Title | Status | Rounds | Evidence | Grade |",
             "|---|---|---|---|---|---|"]
    for s in goals:
        evidence = md_cell(s["evidence"])
        if s["status"] == "accepted" and s["decision"]:
            evidence = "accepted by a human: " + md_cell(s["decision"]["note"], 100)
        lines.append(f"| {s['id']} | {md_cell(s['title'], 80)} | {MARKS[s['status']]} "
                     f"{s['status']} | {md_cell(str(s['round']))} | {evidence} | "
                     f"{s['grade'] or ''} |")
    if runs:
        lines += ["", "## Verification runs", "",
                  "| Event | Story | Command | Result | Duration | Output sha256 |",
                  "|---|---|---|---|---|---|"]
        if total and total > len(runs):
            lines[-3] += f" — the latest {len(runs)} of {total} (`log` lists them all)"
        for r in runs:
            lines.append(f"| {md_cell(str(r['seq']))} | {md_cell(r['id'])} | "
                         f"`{md_cell(r['cmd'], 80)}` | "
                         f"{REPORT_OUTCOME[run_outcome(r)]}{md_cell(describe_exit(r))}"
                         f"{md_cell(' (' + run_evidence(r) + ')') if run_evidence(r) else ''} | "
                         f"{md_cell(str(r.get('duration_s')))} s | "
                         f"`{md_cell(str(r.get('sha256'))[:16])}` |")
    standing = [(s, unaddressed_failure(s)) for s in goals if s["status"] in DONE + ("review",)]
    standing = [(s, o) for s, o in standing if o is not None]
    if standing:
        lines += ["", "## Failures the harness saw, left standing", ""]
        lines += [f"- {s['id']}: the harness last saw `{md_cell(o['cmd'], 120)}` fail (event "
                  f"{md_cell(str(o.get('seq')))}) before it was checkpointed" for s, o in standing]
    lines += ["", "## Stories and dependencies", "", "```mermaid", "graph TD"]
    for s in goals:
        label = md_cell(s["title"], 40).replace('"', "#quot;")
        lines.append(f"  {s['id']}[\"{s['id']} {label}\"]:::{s['status']}")
    for s in goals:
        for dep in s["after"]:
            lines.append(f"  {dep} --> {s['id']}")
    lines += [f"  classDef {k} fill:{row[2]}" for k, row in STATUS_TABLE.items()]
    lines += ["```", "", "Ledger head: "
                         f"`{plan['ledger']['seq']}:{md_cell(plan['ledger']['head'])}` "
              f"(plan `{md_cell(plan['plan_id'])}`)", ""]
    return "\n".join(lines)


def file_not_there_yet(u):
    """Whether an unverifiable check only waits for its file (a story may write it)."""
    return u["reason"].endswith(NOT_THERE)


def unverifiable_label(u):
    where = f"{one_line(u['id'])} check {u['check'] + 1}"
    return (f"· {where} waits for its file" if file_not_there_yet(u)
            else f"⚠ {where} cannot run here")


def render_status(prog, plan, action, share=()):
    """What `status` says, whole, for a human: the plan's count and brief, a line per story
    with its details, checks that cannot run here, a pause, the next step (`action`: the
    asker's, or a step that comes before the plan's own: a shared copy behind its remote syncs
    first), the shared plan's state, and how to pick up each story in progress."""
    lines = [count_line(plan)]
    goals = plan["goals"]
    say, marks, base = lines.append, MARKS, len(BASE_FIELDS)
    # the final story of a sequential plan waits for every other one: its order says so
    in_order = bool(waits_for(plan, goals[-1])) and sequential(plan)
    previous = None
    for story in goals:
        status = story["status"]
        say(f"  {marks[status]} {story['id']} [{status}] {defused_line(story['title'])}")
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
    lines.append(next_line(action))
    lines += share
    for story in active_stories(plan):
        lines.append("")
        lines += render_resume(prog, plan, story)
    return lines


def inflight_json(inflight):
    """The runs noted in flight (runs.inflight_runs: (note, alive) pairs) as --json has them."""
    return [{"id": rec.get("id"), "check": rec.get("check"), "cmd": rec.get("cmd"),
             "started": rec.get("started"), "engine": rec["engine"], "running": alive}
            for rec, alive in inflight]


def inflight_lines(prog, inflight):
    """A line for each run noted in flight (inflight_json): running now, or never finished (its
    engine died)."""
    lines = []
    for rec in inflight:
        alive = rec["running"]
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


def judge_packet(prog, story, packet):
    """What an independent judge needs of `story` (judge-packet), as --json carries it: the
    objective, a checklist of every frozen check (with this round's witnessed run) and
    acceptance item, the executor's evidence and runs, and the three verdict commands — none
    for a story not in review. `packet`: the working tree recorded for the verdict, or None."""
    items = [{"kind": "check", "text": cmd, "run": latest_run(story, check=i) or next(
        (r for r in reversed(story["runs"]) if r["check"] == i), None)}
        for i, cmd in enumerate(story["checks"])]
    items += [{"kind": "item", "text": text} for text in story["accept"]]
    sid = story["id"]
    instructions = [
        "Go to the artifact (files, the running program, its output) and check every item.",
        "An item without evidence you saw yourself is not passed. Ambiguous means not achieved.",
        "Do not fix the work. Answer with exactly one verdict:"]
    verdicts = [
        f"{prog} verdict --id {sid} achieved --evidence \"<what you checked and saw>\" --agent "
        "<you>",
        f"{prog} verdict --id {sid} not-achieved --evidence \"<what is missing, not how to fix "
        "it>\" --agent <you>",
        f"{prog} verdict --id {sid} unachievable --evidence \"<why more rounds cannot help>\" "
        "--agent <you>",
    ]
    if story["status"] != "review":  # a verdict on it would be refused: offer none
        verdicts = []
        instructions = [f"{sid} is {story['status']}, not in review: there is nothing to judge "
                        "now, and a verdict would be refused. This packet is for reading only."]
    return {"packet": packet, "id": sid, "title": story["title"], "status": story["status"],
            "round": story["round"], "objective": story["objective"],
            "amendments": story["amendments"], "checklist": items, "evidence": story["evidence"],
            "runs": story["runs"], "instructions": instructions, "verdicts": verdicts}


def text_judge_packet(data, tripwires=()):
    """judge-packet's text, from its result: the packet, the `tripwires` said of the work."""
    items, packet = data["checklist"], data["packet"]
    lines = [f"=== fablize judge packet — {data['id']} {defused_line(data['title'])} "
             f"[{data['status']}, round {data['round']}]",
             "You are the judge. You did not do this work: judge the artifact itself, not anyone's "
             "account of it.",
             f"Objective: {defused_line(data['objective'])}"]
    lines += [f"Amended: {one_line(x['note'])}" for x in data["amendments"]]
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
    lines.append(indent(defuse(data["evidence"])) if not blank(data["evidence"])
                 else "    (none)")
    if data["runs"]:
        lines.append("Witnessed runs (this round):")
        for r in data["runs"]:
            lines.append(f"  event {r['seq']}: {defuse(run_summary(r))} — output tail:")
            lines.append(indent(defuse(last_chars(r["tail"])), "      "))
    lines += tripwires
    lines += (["How to judge:"] + [f"  - {x}" for x in data["instructions"]]
              + [f"    {x}" for x in data["verdicts"]])
    if packet:
        lines.append(f"Working tree recorded (event {packet['seq']}: {packet['files']} files, "
                     "sha256 "
                     f"{packet['tree'][:16]}…): a verdict given after any change to it is void and "
                     "goes back as not-achieved.")
    return lines


# each command's text, drawn from its result (Context.show): the --json fields, and the state
# they describe — the plan the command left


def unverifiable_lines(found):
    """What create and add say of frozen checks that cannot run yet: a program that is missing
    here must be fixed now; a file not there yet is a test-first check, fine."""
    later = [u for u in found if file_not_there_yet(u)]
    now = [u for u in found if u not in later]
    lines = []
    if now:
        lines.append(f"fablize: ⚠ {count_noun(len(now), 'frozen check')} cannot run here — fix "
                     "the command or install what it needs now: found at the gate, it costs the "
                     "whole run:")
    lines += [f"  {one_line(u['id'])} check {u['check'] + 1}: `{one_line(u['cmd'])}` — "
              f"{one_line(u['reason'])}" for u in now]
    if later:
        lines.append(f"fablize: {count_noun(len(later), 'frozen check')} "
                     f"{'starts' if len(later) == 1 else 'start'} a file that does not exist yet "
                     "— fine for a test-first plan: a story writes it, and each check runs when "
                     "its own story completes:")
    lines += [f"  {one_line(u['id'])} check {u['check'] + 1}: `{one_line(u['cmd'])}` — "
              f"{one_line(u['reason'])} yet" for u in later]
    return lines


def text_create(data, shared=None):
    """create: the stories, the scope, the plan it replaced, its checks that cannot run yet,
    where it is shared (`shared`: the sharing room's renderer), and the next step, last."""
    plan, replaces = data["plan"], data["replaces"]
    lines = [f"fablize: plan created — {count_stories(len(plan['stories']))}"]
    lines += [f"  {story['id']} {defused_line(story['title'])}: "
              f"{defused_line(story['objective'])}" for story in plan["stories"]]
    if plan["scope"]:
        lines.append("  scope: " + ", ".join(map(one_line, plan["scope"])) + " — the paths the "
                     "work may change (CI re-runs the checks with only these taken from the "
                     "branch)")
    if replaces:
        lines.append(f"fablize: the previous plan {replaces['plan_id']} is kept whole in "
                     f"{replaces['path']}/ (head {replaces['head']}).")
    lines += unverifiable_lines(plan["unverifiable"])
    if "share" in data:
        lines += shared(data)
    return lines + [next_line(data["next"])]  # the last line: what to do now


def text_next(data, plan):
    """next: the handoff (or, with the plan done, the line that says so)."""
    return [done_line(plan)] if data["story"] is None else data["handoff"].split("\n")


def text_checkpoint(data, plan, prog):
    """checkpoint (and verdict): the round's observed runs (checkpoint's), where the story went,
    what is left and the next step, last."""
    story = find_story(plan, data["story"]["id"])
    lines = render_observed(data.get("observed"))
    sid, status = story["id"], story["status"]
    if status == "failed":
        left = count_noun(rounds_left(plan, story), "round")
        lines.append(f"fablize: {sid} → failed ({round_label(plan, story)}; {left} left) — "
                     f"`{prog} next` reopens it as round {story['round'] + 1} "
                     "with what was missing.")
    elif status == "blocked":
        lines.append(f"fablize: {sid} → blocked — a human must decide.")
    elif status == "review":
        lines.append(f"fablize: {sid} → review — an independent judge decides.")
    else:
        lines.append(f"fablize: {sid} → {status}")
    return lines + [left_line(plan, data["next"])]


def text_status(data, plan, prog, sharing=None):
    """status: a copy behind its remote says so first (the stories below are as this clone
    last saw them), then the plan (render_status), then the runs in flight."""
    share = data.get("share")
    first = sharing.behind_step(share, prog) if share else None
    shared = sharing.status_lines(share, prog) if share else ()
    return (([first[0]] if first else []) + render_status(prog, plan, data["next"], shared)
            + inflight_lines(prog, data["in_flight"]))


def text_verify(data, status):
    runs = data["runs"]
    return [f"fablize: {data['id']}: {'all ' if len(runs) > 1 else ''}"
            f"{count_noun(len(runs), 'check')} passed (status unchanged: {status})."]


DECIDED = {"accept": "counts as done", "retry": "back to work, rounds reset",
           "amend": "objective amended, back to work"}


def text_decide(data, decision):
    story = data["story"]
    return [f"fablize: {story['id']} → {story['status']} ({DECIDED[decision]}; decision recorded "
            "in the ledger).", next_line(data["next"])]


def text_add(data, final):
    story = data["story"]
    return [f"fablize: added {story['id']} {defused_line(story['title'])} — before the final "
            f"story {final}" + (f", after {', '.join(story['after'])}" if story["after"] else "")
            ] + unverifiable_lines(data["unverifiable"])


def text_rebuild(data, prog, replayed=0, taken=0, history=None):
    """rebuild: what the snapshot was rebuilt from — or, the history gone, that there is no plan
    to rebuild and how a human starts again."""
    kept = data["kept"]
    if data["plan"] is None:
        return [f"fablize: {LEDGER} {history}: the plan's history is gone, so there is "
                f"no plan to rebuild; the old {SNAPSHOT} is kept as {kept} (it lists the "
                "stories). A human starts again:", f"  {create_command(prog)}"]
    return [f"fablize: rebuilt {SNAPSHOT} from {count_noun(replayed, 'ledger event')}"
            + (f"; the old one is kept as {kept}." if kept else ".")
            + (f" Then {count_noun(taken, 'event')} came in from the shared plan's remote "
               "(the events it holds, damaged here)." if taken else "")]


def text_log(data):
    return [format_event(ev) for ev in data["events"]]


def text_report(data):
    return [f"fablize: report written to {data['path']}" if data["path"] else data["markdown"]]


def text_pause(data, prog, seq):
    return [f"fablize: guard paused (event {seq}) — the Stop hook lets the agent stop until "
            f"`{prog} unpause`."]


def text_unpause(data, seq):
    return [f"fablize: guard on again (event {seq}) — the Stop hook keeps the agent at work "
            "while the plan has some."]
