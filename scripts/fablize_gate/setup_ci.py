"""The setup room's CI part: `setup github` wires an audit the pull request cannot edit, and
`doctor github` checks what a clone can check of it.

On `pull_request` GitHub runs the branch's own copy of a workflow, so the anchor is a workflow
the branch cannot edit — a ruleset's "Require workflows to pass before merging" runs it from the
default branch whatever the pull request says — and the engine that judges is the one the base
branch committed, read from the base commit with git (never from the checkout) and started with
`python3 -I`. `setup github` writes, in one run and idempotently (`--remove` undoes it):

  .github/workflows/fablize.yml   the audit, least privilege, nothing of the branch run before it
  .fablize/policy.json            CI's policy: the scope, the required checks, every gate on
  .github/CODEOWNERS              the lines that protect both (printed when the file is a human's)
  .github/fablize/                a copy of the engine, when the project commits none of its own

and names, last, the one thing no clone can do: the ruleset a repository admin applies.

Interface: setup(ctx, a), doctor_findings(ctx), workflow_text(engine), policy_of(...).
Imported by setup (cmd_setup, cmd_doctor) when the agent named is `github`.
"""

import json
import os
import re

from .base import FablizeError, one_line, refused, STATE_DIRNAME, Step, usage
from .runs import git, repo_root
from .reports import test_runners

WORKFLOW = ".github/workflows/fablize.yml"
POLICY = f"{STATE_DIRNAME}/policy.json"
CODEOWNERS = ".github/CODEOWNERS"
OTHER_CODEOWNERS = ("CODEOWNERS", "docs/CODEOWNERS")  # GitHub reads the first it finds
ENGINE_COPY = ".github/fablize"  # the engine CI reads from the base, when none is committed
MARK = "# Written by `fablize setup github`"
OWNERS_BEGIN = "# fablize:begin — the audit's workflow, its engine and CI's policy"
OWNERS_END = "# fablize:end"
# every gate the policy can turn on for any plan (a story resting on its claim is graded, not
# refused: the re-run of the final story's checks is what binds), and the agent's own tests run
# red → green
GATES = {"fail_to_pass": True, "forbid_out_of_scope": True, "forbid_tripwires": True,
         "agent_tests": "prove"}


def engine_path(root):
    """Where the base holds the engine CI runs: the project's own copy (scripts/goals.py beside
    scripts/fablize_gate/), else the copy setup writes under .github/fablize/."""
    if (os.path.isfile(os.path.join(root, "scripts", "goals.py"))
            and os.path.isdir(os.path.join(root, "scripts", "fablize_gate"))):
        return "scripts"
    return ENGINE_COPY


def workflow_text(engine):
    """The workflow, as text (no YAML library at run time): each `run:` a plain shell step."""
    return f"""{MARK}: fablize's audit of each pull request.
# It judges with the engine the base branch committed ({engine}/goals.py, read from the base
# commit with git, never from the checkout, started with python3 -I), reads CI's policy from
# the base (.fablize/policy.json), re-runs the plan's checks on the base's tree and on it with
# the pull request's files inside the scope, and passes only on the verdict file it wrote.
# GitHub runs the pull request's own copy of this file: make it a required workflow of the
# default branch (a ruleset's "Require workflows to pass before merging"), so that no branch
# can edit what judges it — `fablize setup github` prints the command.
name: fablize
on:
  pull_request:
permissions:
  contents: read
jobs:
  audit:
    runs-on: ubuntu-latest
    steps:
      - uses: actions/checkout@v4
        with:
          fetch-depth: 0
          persist-credentials: false
      - uses: actions/setup-python@v5
        with:
          python-version: "3.12"
      - name: The test tools, with nothing of the pull request on sys.path
        working-directory: ${{{{ runner.temp }}}}
        run: python3 -I -m pip install --disable-pip-version-check --quiet pytest
      - name: The engine, as the base branch committed it
        env:
          BASE_REF: ${{{{ github.base_ref }}}}
        run: |
          git fetch --no-tags --quiet origin "+refs/heads/$BASE_REF:refs/remotes/origin/$BASE_REF"
          mkdir -p "$RUNNER_TEMP/fablize-engine"
          git archive --format=tar "origin/$BASE_REF" -- {engine}/fablize_gate {engine}/goals.py \\
            | tar -x -C "$RUNNER_TEMP/fablize-engine"
      - name: The audit
        env:
          BASE_REF: ${{{{ github.base_ref }}}}
        # the job's last process is the engine's verdict.py (exec: no shell left to trace): it
        # passes only on the audit's exit code and the verdict file it wrote with verdict.py's
        # nonce, together
        run: |
          engine="$RUNNER_TEMP/fablize-engine/{engine}"
          exec python3 -I "$engine/fablize_gate/verdict.py" -- "$engine/goals.py" audit \\
            --base "origin/$BASE_REF" --require-complete --rerun all --require-scope \\
            --allow-new-plan --summary "$GITHUB_STEP_SUMMARY"
"""


def policy_parts(ctx, scope=(), checks=()):
    """The scope and the required checks CI's policy holds: given to setup, else the plan's (its
    scope and its final story's frozen checks); either is empty where neither has it."""
    scope, checks = list(scope or ()), list(checks or ())
    plan = None
    if not (scope and checks) and ctx.store.has_plan_files():
        with ctx.store.plan_session(exclusive=False) as s:
            plan = s.load()
    if plan is not None:
        scope = scope or [p for p in plan.get("scope") or () if isinstance(p, str)]
        checks = checks or list(plan["goals"][-1].get("checks") or ())
    return scope, checks


def policy_of(ctx, scope, checks):
    """CI's policy: the scope and the required checks (policy_parts), every gate on."""
    from .trust import check_scope
    check_scope(scope, ctx.store.root, [], "setup github --scope")
    return dict({"scope": scope, "required_checks": checks}, **GATES)


def owner_of(root, given):
    """The code owner CODEOWNERS names: --owner, else the owner of the GitHub repository
    `origin` points at (a user; an organisation's team is given with --owner @org/team); None
    when neither names one — who reviews changes to the audit is then a human's to say."""
    if given:
        if not re.fullmatch(r"@[\w.-]+(/[\w.-]+)?|[^@\s]+@[^@\s]+", given, re.A):
            raise usage(f"--owner {one_line(given)!r}: a GitHub user (@name), a team "
                        "(@org/team) or an e-mail address.", "bad_owner")
        return given
    code, out, _ = git(root, "remote", "get-url", "origin")
    url = out.decode("utf-8", "replace").strip() if code == 0 else ""
    m = re.search(r"github\.com[:/]([\w.-]+)/[\w.-]+?(?:\.git)?/?$", url)
    return "@" + m.group(1) if m else None


# what setup github may have to be told, each as the option a step adds with a placeholder for
# its value, and as the option's help names it
UNTOLD = {"--scope": ("what the work may change", "--scope <path>", "--scope PATH"),
          "--required-check": ("the check that proves it", '--required-check "<test command>"',
                               "--required-check CMD"),
          "--owner": ("who reviews changes to the audit", "--owner <@owner>", "--owner @you")}


def told(ctx, scope=(), checks=(), owner=None):
    """What setup github goes by — CI's policy's (scope, checks) when it writes the policy (none
    is there, or --scope/--required-check are given; else None), and the reviewer CODEOWNERS
    names — and `gaps`: the options (UNTOLD) whose values neither the command line nor the
    clone gives. Setup names every gap in one refusal, its step the user's own command with
    each added, and doctor adds them to the setup step it names: steps that named one gap at a
    time, dropping what the user had said, sent them in a circle between two refusals."""
    gaps, parts = [], None
    if scope or checks or not os.path.isfile(os.path.join(ctx.store.root, *POLICY.split("/"))):
        parts = policy_parts(ctx, scope, checks)
        gaps += [opt for opt, have in zip(("--scope", "--required-check"), parts) if not have]
    who = owner_of(ctx.store.root, owner)
    if who is None:
        gaps.append("--owner")
    return parts, who, gaps


def untold(gaps):
    """The refusal of a setup github that lacks `gaps` (told): each said, all in one, and the
    step the user's command line with each option added, a placeholder for its value."""
    said, give = [], []
    policy = [g for g in gaps if g != "--owner"]
    if policy:
        said.append("CI's policy needs " + " and ".join(UNTOLD[g][0] for g in policy))
        give.append(" and ".join(f"`{UNTOLD[g][2]}`" for g in policy) + " (each repeatable; or "
                    "make the plan with them first: `create --scope PATH … --verify CMD`)")
    if "--owner" in gaps:
        said.append(f"CODEOWNERS needs {UNTOLD['--owner'][0]}, a human's to say (origin is not a "
                    "GitHub repository here)")
        give.append(f"`{UNTOLD['--owner'][2]}` (or @org/team)")
    message = f"setup github: {'; '.join(said)} — give {', and '.join(give)}."
    step = Step.again(" ".join(UNTOLD[g][1] for g in gaps))
    if policy:
        return usage(message, "policy_unknown", steps=step)
    return usage(message, "bad_owner", steps=step)


def codeowners_lines(owner, engine):
    paths = ["/.github/", f"/{POLICY}"] + ([] if engine == ENGINE_COPY else
                                            [f"/{engine}/goals.py", f"/{engine}/fablize_gate/"])
    return [OWNERS_BEGIN] + [f"{p} {owner}" for p in paths] + [OWNERS_END]


def with_owners(text, lines):
    """`text` (a CODEOWNERS) with fablize's block put in, or replaced in place."""
    block = "\n".join(lines) + "\n"
    if OWNERS_BEGIN in text and OWNERS_END in text:
        start = text.index(OWNERS_BEGIN)
        end = text.index(OWNERS_END, start) + len(OWNERS_END)
        end += 1 if text[end:end + 1] == "\n" else 0
        return text[:start] + block + text[end:]
    return text + ("" if not text or text.endswith("\n") else "\n") + block


def without_owners(text):
    if OWNERS_BEGIN not in text or OWNERS_END not in text:
        return text
    start = text.index(OWNERS_BEGIN)
    end = text.index(OWNERS_END, start) + len(OWNERS_END)
    end += 1 if text[end:end + 1] == "\n" else 0
    return text[:start] + text[end:]


def engine_files():
    """{path under the engine folder: bytes} of the engine this process runs."""
    here = os.path.dirname(os.path.abspath(__file__))
    files = {}
    entry = os.path.join(os.path.dirname(here), "goals.py")
    if os.path.isfile(entry):
        with open(entry, "rb") as f:
            files["goals.py"] = f.read()
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as f:
                files[f"fablize_gate/{name}"] = f.read()
    return files


def plan_changes(ctx, a):
    """[(relative path, new bytes or None to delete, what)] setup github writes (leaving out what
    is as it should be), and what it says but does not write."""
    from .setup import project_file, read_project_file
    root = ctx.store.root
    engine = engine_path(root)
    changes, notes = [], []
    parts = owner = None
    if not a.remove:  # what it must be told, all of it at once, before anything else
        parts, owner, gaps = told(ctx, a.scope, a.required_check, a.owner)
        if gaps:
            raise untold(gaps)

    def current(rel):
        path, st = project_file(root, rel)
        return (read_project_file(path) if st is not None else None), path, st

    raw, _, _ = current(WORKFLOW)
    wanted = workflow_text(engine).encode("utf-8")
    if a.remove:
        if raw is not None and raw.startswith(MARK.encode()):
            changes.append((WORKFLOW, None, "removed"))
        elif raw is not None:
            notes.append(f"{WORKFLOW} is not fablize's (it lacks its first line): kept")
    elif raw is None or raw.startswith(MARK.encode()):
        if raw != wanted:
            changes.append((WORKFLOW, wanted, "the audit, run with the base's engine" if raw is None
                            else "updated"))
    else:
        raise refused(f"setup github: {WORKFLOW} is not fablize's (it lacks its first line, "
                      f"{MARK!r}) — refusing to overwrite it: a human renames or removes it, then "
                      "setup github again.", "not_ours")

    raw, _, _ = current(POLICY)
    if a.remove:
        if raw is not None:  # once written, the policy is the team's: --remove keeps it
            notes.append(f"{POLICY} kept: CI's policy is the team's once written (`git rm "
                         f"{POLICY}` takes it out)")
    elif raw is None:
        policy = policy_of(ctx, *parts)
        changes.append((POLICY, (json.dumps(policy, indent=2) + "\n").encode("utf-8"),
                        "CI's policy — scope " + ", ".join(policy["scope"]) + "; every gate on"))
    else:
        given = a.scope or a.required_check
        if given:
            policy = policy_of(ctx, *parts)
            new = (json.dumps(policy, indent=2) + "\n").encode("utf-8")
            if new != raw:
                changes.append((POLICY, new, "CI's policy, as --scope/--required-check give it"))
        else:
            notes.append(f"{POLICY}: kept as it is (give --scope/--required-check to write it "
                         "anew)")

    if engine == ENGINE_COPY:
        files = engine_files()
        for name, data in files.items():
            rel = f"{ENGINE_COPY}/{name}"
            have, _, _ = current(rel)
            if a.remove:
                if have is not None and have == data:
                    changes.append((rel, None, "removed"))
            elif have != data:
                changes.append((rel, data, "the engine CI reads from the base" if have is None
                                else "updated to this engine"))

    owners_done = None
    others = [p for p in OTHER_CODEOWNERS if os.path.isfile(os.path.join(root, p))]
    raw, _, _ = current(CODEOWNERS)
    text = raw.decode("utf-8", "replace") if raw is not None else None
    if a.remove:
        if text is not None and OWNERS_BEGIN in text:
            rest = without_owners(text)
            changes.append((CODEOWNERS, rest.encode("utf-8") if rest.strip() else None,
                            "fablize's lines removed"))
    else:
        lines = codeowners_lines(owner, engine)
        if text is None and not others:
            changes.append((CODEOWNERS, ("\n".join(lines) + "\n").encode("utf-8"),
                            "its reviewers for the workflow, the engine and the policy"))
        elif text is not None and (OWNERS_BEGIN in text or not text.strip()):
            new = with_owners(text, lines)
            if new != text:
                changes.append((CODEOWNERS, new.encode("utf-8"), "fablize's lines updated"))
        else:
            owners_done = (text is not None and CODEOWNERS) or others[0]
            notes.append(f"{owners_done} is a human's: add these lines to it (fablize does not "
                         "edit it):\n" + "\n".join("    " + x for x in lines[1:-1]))
    return changes, notes, engine


def setup(ctx, a):
    """setup github: the workflow, the policy, the CODEOWNERS lines (and the engine's copy when
    the project has none), then the ruleset a repository admin applies."""
    from .setup import not_a_repository, project_file, put_project_file
    root = ctx.store.root
    if repo_root(root) is None:
        raise not_a_repository(root, "setup github")
    changes, notes, engine = plan_changes(ctx, a)
    done = []
    for rel, data, what in changes:
        path, st = project_file(root, rel)
        put_project_file(path, st, data)
        if data is None:
            for folder in (".github/workflows", ENGINE_COPY + "/fablize_gate", ENGINE_COPY,
                           ".github"):
                try:
                    os.rmdir(os.path.join(root, *folder.split("/")))
                except OSError:
                    pass
        done.append(rel)
    said = {}  # the engine's files said once, as one folder
    for rel, data, what in changes:
        said.setdefault(ENGINE_COPY + "/" if rel.startswith(ENGINE_COPY + "/") else rel, what)
    ctx.show(text_setup, {"agent": "github", "files": done,
                          "changes": [{"file": k, "what": v} for k, v in said.items()],
                          "notes": notes, "engine": engine,
                          "ruleset": None if a.remove else ruleset_command()}, remove=a.remove)


def text_setup(data, remove):
    """What `setup github` says: each change, the notes; set up, where the audit reads what it
    judges with, and the ruleset step that is a repository admin's."""
    lines = [f"fablize: {c['file']}: {c['what']}" for c in data["changes"]]
    lines += [f"fablize: {note}" for note in data["notes"]]
    if not data["files"]:
        lines.append(f"fablize: github is already {'unwired' if remove else 'set up'} here; "
                     "nothing changed.")
    if not remove:
        lines += ["fablize: commit them on the default branch; the audit judges with the engine "
                  f"and the policy as that branch holds them ({data['engine']}/, {POLICY}).",
                  "fablize: one step is a repository admin's, and no clone can take or check it: "
                  "make the workflow required, so that a pull request cannot edit what judges "
                  "it —",
                  "  Settings → Rules → Rulesets → New branch ruleset: target the default branch, "
                  "\"Require workflows to pass before merging\", this repository, "
                  f"{WORKFLOW}, ref = the default branch. Or, with GitHub's CLI:"]
        lines += ["  " + line for line in data["ruleset"]]
    return lines


def ruleset_command():
    """GitHub's CLI call that makes the workflow required on the default branch (gh fills
    {owner} and {repo} from the clone it runs in)."""
    body = ('{"name":"fablize","target":"branch","enforcement":"active",'
            '"conditions":{"ref_name":{"include":["~DEFAULT_BRANCH"],"exclude":[]}},'
            '"rules":[{"type":"workflows","parameters":{"workflows":[{"path":"'
            + WORKFLOW + '","repository_id":\'"$(gh api repos/{owner}/{repo} --jq .id)"\','
            '"ref":"refs/heads/\'"$(gh repo view --json defaultBranchRef --jq '
            '.defaultBranchRef.name)"\'"}]}}]}')
    return [f"gh api --method POST repos/{{owner}}/{{repo}}/rulesets --input - <<< '{body}'"]


def doctor_findings(ctx):
    """What a clone can check of the CI wiring: [{item, ok, problem, fix, detail}]; the ruleset
    itself cannot be (it lives on GitHub), and the last finding says so."""
    from .setup import read_project_file
    root = ctx.store.root
    findings = []

    def finding(item, problem, fix, fine):
        findings.append({"item": item, "ok": problem is None, "problem": problem, "fix": fix,
                         "detail": fine if problem is None else None})

    step = f"`{setup_command(ctx)}`"
    path = os.path.join(root, *WORKFLOW.split("/"))
    try:
        raw = read_project_file(path) if os.path.isfile(path) else None
    except FablizeError:
        raw = None
    engine = engine_path(root)
    owners = [p for p in (CODEOWNERS,) + OTHER_CODEOWNERS if os.path.isfile(os.path.join(root, p))]
    # what CI and GitHub read from the base branch is what HEAD holds, as for the policy: a
    # file that is only in this checkout reads as healthy here and is absent there. One step
    # commits every one of them (each gap points at it)
    wired = [p for p in [WORKFLOW, f"{engine}/goals.py", f"{engine}/fablize_gate", POLICY]
             + owners[:1] if os.path.exists(os.path.join(root, *p.split("/")))]
    code, out, _ = git(root, "ls-tree", "-z", "--name-only", "HEAD", "--", *wired) if wired \
        else (0, b"", b"")
    held = set(out.decode("utf-8", "replace").split("\0")) if code == 0 else set()
    loose = [p for p in wired if p not in held]
    commit = (f"`git add {' '.join(loose)} && git commit -m \"fablize: CI's audit\"` on the "
              "default branch")
    if raw is None:
        finding("workflow", f"{WORKFLOW} does not exist", step, None)
    elif not raw.startswith(MARK.encode()):
        finding("workflow", f"{WORKFLOW} is not fablize's", f"a human renames it, then {step}",
                None)
    elif raw != workflow_text(engine).encode("utf-8"):
        finding("workflow", f"{WORKFLOW} is not the one this engine writes (an older setup, or "
                "edited)", step, None)
    elif WORKFLOW in loose:
        finding("workflow", f"{WORKFLOW} is not committed here (a pull request runs the workflow "
                "its branch holds)", commit, None)
    else:
        finding("workflow", None, None, f"{WORKFLOW} runs the engine the base commits "
                f"({engine}/goals.py, python3 -I) and passes only on its verdict file")
    unheld = [p for p in loose if p.startswith(engine + "/")]
    if engine == ENGINE_COPY and not os.path.isfile(os.path.join(root, ENGINE_COPY, "goals.py")):
        finding("engine", f"no engine at {ENGINE_COPY}/ for CI to read from the base", step, None)
    elif unheld:
        finding("engine", f"{' and '.join(unheld)} {'is' if len(unheld) == 1 else 'are'} not "
                "committed here (CI reads the engine from the base branch)", commit, None)
    else:
        finding("engine", None, None, f"{ENGINE_COPY}/ (this project commits no engine of its "
                "own)" if engine == ENGINE_COPY else f"{engine}/goals.py and "
                f"{engine}/fablize_gate/, as the project commits them")
    policy = None
    policy_path = os.path.join(root, *POLICY.split("/"))
    if not os.path.isfile(policy_path):
        finding("policy", f"{POLICY} does not exist", step, None)
    else:
        try:
            with open(policy_path, "rb") as f:
                policy = json.loads(f.read().decode("utf-8"))
            from .trust import POLICY_KEYS
            if not isinstance(policy, dict) or any(k not in POLICY_KEYS for k in policy):
                raise ValueError("not a policy")
        except (OSError, ValueError, UnicodeDecodeError):
            policy = None
            finding("policy", f"{POLICY} is not a policy (a JSON object of its keys)",
                    f"a human fixes it, or removes it and runs {step}", None)
        else:
            finding("policy", None if POLICY not in loose else f"{POLICY} is not committed here "
                    "(CI reads it from the base branch)", commit, "scope " + ", ".join(
                        map(str, policy.get("scope") or ["(none)"])))
    text = ""
    if owners:
        try:
            text = read_project_file(os.path.join(root, owners[0])).decode("utf-8", "replace")
        except FablizeError:
            text = ""
    covered = {p: owned(text, p) for p in ("/.github/", f"/{POLICY}")}
    missing = [p for p, ok in covered.items() if not ok]
    if owners and not missing and owners[0] in loose:
        finding("codeowners", f"{owners[0]} is not committed here (GitHub reads it from the base "
                "branch)", commit, None)
    else:
        finding("codeowners", None if not missing else
                (f"{owners[0]} does not name a reviewer for " + ", ".join(missing)) if owners
                else "no CODEOWNERS file names a reviewer for .github/ and the policy",
                step if not owners or owners[0] == CODEOWNERS else
                f"a human adds lines for {', '.join(missing)} to {owners[0]}",
                f"{owners[0] if owners else ''} covers .github/ and {POLICY}")
    for cmd in (policy or {}).get("required_checks") or ():
        runners = test_runners(cmd)
        finding("required check", None, None,
                f"`{one_line(cmd)}` — " + (f"{'+'.join(runners)}: read test by test" if runners
                                           else "exit code only (no runner the engine reads)"))
    finding("ruleset", None, None, "cannot be checked from a clone: a repository admin makes "
            f"{WORKFLOW} required on the default branch ({step} prints how)")
    return findings


def setup_command(ctx):
    """`setup github` as doctor names it: with each option it cannot go without here (told), a
    placeholder for the value, so that the step runs as printed."""
    try:
        gaps = told(ctx)[2]
    except FablizeError:  # a plan setup cannot read: the policy's options spare it the plan
        gaps = ["--scope", "--required-check"] + (
            ["--owner"] if owner_of(ctx.store.root, None) is None else [])
    return " ".join([f"{ctx.prog} setup github"] + [UNTOLD[g][1] for g in gaps])


def owned(text, path):
    """Whether a CODEOWNERS line with an owner covers `path` (its last matching line wins, and an
    empty owner list removes the cover)."""
    covered = False
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        pattern = words[0]
        prefix = pattern.rstrip("*").rstrip("/")
        if (pattern in ("*", "/**") or path.startswith(prefix + "/") or path == prefix
                or path.rstrip("/") == prefix or ("/" + path.lstrip("/")).startswith(
                    "/" + prefix.lstrip("/") + "/")):
            covered = len(words) > 1
    return covered
