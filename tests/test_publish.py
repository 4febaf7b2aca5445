"""What a plan publishes (DESIGN §10): a committed ledger or a shared plan's refs are read by
everyone who can read the repository, so nothing a check printed, an agent wrote or the harness
observed carries a secret, and no run names the machine it ran on; and a run's record never
claims more of its log than the disk holds."""

import json
import os
import re
import resource
import signal
import subprocess

import pytest

from conftest import (ENGINE, ENGINE_PYTHON, SCRIPT, assert_refused, copy_engine, engine, ledger,
                      make_plan, rechain, state_files, write_lines)
from test_trust import forge_fab
from test_wiring import bash_failure, observe

TOKEN = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"  # the shape of a GitHub token
VALUE = "hunter2-not-a-shape-but-a-secret"  # a value only the environment says is secret


def state_bytes(fab):
    return b"".join(state_files(fab.dir).values())


def start(fab):
    r = fab("next")
    assert r.code == 0, r


def test_a_check_that_prints_a_token_leaves_no_trace_of_it_in_the_state(fab, monkeypatch):
    monkeypatch.setenv("DEPLOY_API_KEY", VALUE)
    (fab.root / "out.txt").write_text(f"token={TOKEN}\n")
    make_plan(fab, 1, "--verify", "cat out.txt; echo key=$DEPLOY_API_KEY; echo done")
    start(fab)
    r = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "ran it")
    assert r.code == 0, r
    state = state_bytes(fab)
    assert TOKEN.encode() not in state and VALUE.encode() not in state
    run = [e for e in ledger(fab.dir) if e["event"] == "verify_run"][-1]
    log = (fab.dir / run["log"]).read_bytes()
    assert log == b"token=***\nkey=***\ndone\n" and run["tail"] == log.decode()
    assert run["bytes"] == len(log) and run["sha256"] == goals_sha(log)
    assert TOKEN not in r.out and VALUE not in r.out  # the terminal saw it masked too
    assert fab("audit", "--require-logs").code == 0


def goals_sha(data):
    return engine.sha256_hex(data)


def test_a_private_key_a_check_prints_is_dropped_from_begin_to_end(fab):
    key = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAA\nAAAABG5vbmUAAAAEbm9uZQ\n" \
          "-----END OPENSSH PRIVATE KEY-----"
    (fab.root / "key.txt").write_text(f"before\n{key}\nafter\n")
    make_plan(fab, 1, "--verify", "cat key.txt")
    start(fab)
    assert fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e").code == 0
    run = [e for e in ledger(fab.dir) if e["event"] == "verify_run"][-1]
    assert (fab.dir / run["log"]).read_text() == "before\n***\n***\nafter\n"
    assert b"b3BlbnNzaC1rZXktdjEAAAA" not in state_bytes(fab)


def test_an_observed_command_carrying_a_token_is_recorded_masked(fab):
    make_plan(fab, 2)
    start(fab)
    observe(fab, bash_failure(fab.root, f"GITHUB_TOKEN={TOKEN} AWS_SECRET='x y z' pytest -q",
                              error=f"Exit code 1\nauth failed for {TOKEN}"))
    seen = [e for e in ledger(fab.dir) if e["event"] == "observed_run"]
    assert seen[0]["cmd"] == "GITHUB_TOKEN=*** AWS_SECRET=*** pytest -q"
    assert seen[0]["detail"] == "Exit code 1\nauth failed for ***"
    assert TOKEN.encode() not in state_bytes(fab)


def test_evidence_and_notes_are_recorded_masked(fab):
    make_plan(fab, 2)
    start(fab)
    r = fab("checkpoint", "--id", "G001", "--status", "complete",
            "--evidence", f"pushed with API_TOKEN={TOKEN}, it worked")
    assert r.code == 0, r
    assert [e["evidence"] for e in ledger(fab.dir) if e["event"] == "checkpoint"] == \
        ["pushed with API_TOKEN=***, it worked"]  # to the next space, comma or bracket
    assert fab("pause", "--note", f"waiting for {TOKEN}").code == 0
    assert TOKEN.encode() not in state_bytes(fab)


@pytest.mark.parametrize("args", [
    ["create", "--brief", "b", "--goal", "a::b", "--verify", f"GH_TOKEN={TOKEN} make test"],
    ["create", "--brief", "b", "--goal", "a::b", "--check", f"G001=curl -H 'x: {TOKEN}' x"],
    ["create", "--brief", "b", "--goal", "a::b", "--verify", "PASSWORD=hunter22 ./check.sh"],
])
def test_a_check_that_carries_a_secret_is_refused_and_nothing_is_written(fab, args):
    r = assert_refused(fab, args, 2, "holds what looks like a secret", "keep it in the environment")
    assert TOKEN not in r.err and "hunter22" not in r.err  # the refusal does not repeat it
    assert not (fab.dir / "ledger.jsonl").exists()


def test_add_and_a_witnessed_run_refuse_a_secret_in_the_command_too(fab):
    make_plan(fab, 2)
    assert_refused(fab, ["add", "--goal", "x::y", "--check", f"deploy --token {TOKEN}"], 2,
                   "--check `deploy --token ***` holds what looks like a secret")
    start(fab)
    assert_refused(fab, ["checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
                         "--run", "--verify-cmd", f"API_KEY={TOKEN} true"], 2,
                   "--verify-cmd `API_KEY=*** true` holds what looks like a secret")


def test_a_run_records_no_path_of_the_machine_and_no_environment_value(fab):
    make_plan(fab, 1, "--verify", "python3 -c pass")
    start(fab)
    assert fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e").code == 0
    text = (fab.dir / "ledger.jsonl").read_text() + (fab.dir / "goals.json").read_text()
    run = [e for e in ledger(fab.dir) if e["event"] == "verify_run"][-1]
    assert run["cwd"] == "." and run["provenance"]["dir"] == "."
    assert run["provenance"]["program"] == "python3"
    assert all(re.fullmatch(r"sha256:[0-9a-f]{16}", v) for v in run["provenance"]["env"].values())
    assert str(fab.root) not in text and os.path.expanduser("~") + "/" not in text
    assert os.environ["PATH"] not in text and "PATH" in run["provenance"]["env"]


def test_what_a_check_prints_of_the_machine_is_recorded_relative_to_the_root_and_home(
        fab, monkeypatch, tmp_path_factory):
    """A check's output names where it ran (pwd, a traceback's file, pytest's rootdir) and the
    user's home folder: the log and the tail show the root as `.` and the home as `~`, whole
    places only (a longer name that starts like one is another place); the terminal, which
    publishes nothing, shows where it ran."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    make_plan(fab, 1, "--verify", 'pwd; echo "$PWD/src/x.py:3 rootdir: $PWD"; '
              'echo "$HOME/.cache/tool $HOME"; echo "${HOME}x/y ${PWD}2 /srv$HOME"; '
              "python3 -c 'import os; raise SystemExit(os.getcwd())'; true")
    start(fab)
    r = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "ran it")
    assert r.code == 0, r
    run = [e for e in ledger(fab.dir) if e["event"] == "verify_run"][-1]
    log = (fab.dir / run["log"]).read_text()
    assert log == (f".\n./src/x.py:3 rootdir: .\n~/.cache/tool ~\n{home}x/y {fab.root}2 /srv{home}"
                   "\n.\n"), log
    assert run["tail"] == log and run["bytes"] == len(log.encode())
    assert f"│ {fab.root}\n" in r.out  # pwd, as it ran
    assert f"{fab.root}/".encode() not in state_bytes(fab)
    assert fab("audit", "--require-logs").code == 0


def test_an_agents_command_evidence_and_note_name_no_place_of_the_machine(fab):
    """What the harness saw the agent run (`cd /abs/path && pytest`) and what it reported, an
    agent's evidence and notes: recorded with the root as `.`; a --verify-cmd the engine runs
    is a command, kept as given, and its run matches it."""
    root = str(fab.root)
    make_plan(fab, 2)
    start(fab)
    observe(fab, bash_failure(fab.root, f"cd {root} && python3 -m pytest -q",
                              error=f"Exit code 1\n{root}/tests/test_x.py:4: AssertionError"))
    seen = [e for e in ledger(fab.dir) if e["event"] == "observed_run"]
    assert seen[0]["cmd"] == "cd . && python3 -m pytest -q"
    assert seen[0]["detail"] == "Exit code 1\n./tests/test_x.py:4: AssertionError"
    r = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence",
            f"fixed {root}/cli.py", "--run", "--verify-cmd", f"test -d {root}")
    assert r.code == 0, r
    done = [e for e in ledger(fab.dir) if e["event"] == "checkpoint"][-1]
    run = [e for e in ledger(fab.dir) if e["event"] == "verify_run"][-1]
    assert done["evidence"] == "fixed ./cli.py"
    assert done["verify_cmd"] == run["cmd"] == f"test -d {root}"
    assert fab("pause", "--note", f"look at {root}/notes.md").code == 0
    assert ledger(fab.dir)[-1]["note"] == "look at ./notes.md"


def test_the_guards_reason_is_recorded_without_the_engines_place(fab, tmp_path_factory):
    """The Stop hook tells the agent the command to run, with the engine's path when it lives
    outside the repository; the ledger keeps that reason with the home folder as `~`."""
    home = tmp_path_factory.mktemp("home")
    engine = copy_engine(home / "tools")
    make_plan(fab, 2)
    start(fab)
    p = subprocess.run([ENGINE_PYTHON, str(engine), "guard"], cwd=str(fab.root),
                       input=json.dumps({"session_id": "s", "cwd": str(fab.root),
                                         "hook_event_name": "Stop", "stop_hook_active": False}),
                       capture_output=True, text=True, timeout=60,
                       env=dict({k: v for k, v in os.environ.items()
                                 if not k.startswith("FABLIZE_")}, HOME=str(home)))
    assert p.returncode == 0 and str(engine) in json.loads(p.stdout)["reason"], p
    block = ledger(fab.dir)[-1]
    assert block["event"] == "guard_block" and "~/tools/goals.py checkpoint" in block["reason"]
    assert str(home) not in block["reason"]


def test_a_project_reached_through_a_symlink_is_recorded_as_dot_whichever_path_names_it(
        fab, monkeypatch, tmp_path_factory):
    """The engine works in the real path; a shell started from a symlinked one keeps that in
    $PWD, and `pwd` prints it (macOS's /tmp is /private/tmp): both are the root."""
    link = tmp_path_factory.mktemp("links") / "here"
    link.symlink_to(fab.root)
    (fab.root / "sub").mkdir()
    monkeypatch.setenv("PWD", str(link / "sub"))  # the agent stands in a folder of it
    assert engine.logical_root(str(fab.root), str(link / "sub")) == str(link)
    monkeypatch.setenv("PWD", str(link))  # at its top: the check's shell keeps that $PWD
    make_plan(fab, 1, "--verify", "pwd && cd sub && pwd && pwd -P")
    start(fab)
    assert fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e").code == 0
    run = [e for e in ledger(fab.dir) if e["event"] == "verify_run"][-1]
    assert (fab.dir / run["log"]).read_text() == ".\n./sub\n./sub\n"
    assert str(link).encode() not in state_bytes(fab)


def pytest_printed(fab, out):
    """Claude Code's PostToolUse payload for a Bash call of pytest that printed `out`."""
    return dict(bash_failure(fab.root, "python3 -m pytest -q"), hook_event_name="PostToolUse",
                tool_response={"stdout": out, "stderr": "", "interrupted": False})


def test_what_the_harness_reports_names_no_place_however_it_is_written(fab, monkeypatch,
                                                                      tmp_path_factory):
    """A passing call's output arrives as JSON (a line's path after a `\\n`), a flag holds a
    path (`-I/root/include`), a URL (`file:///root`), a sentence ends with one; and a long
    report is masked before it is cut, so a path is never kept cut in half."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    root = str(fab.root)
    make_plan(fab, 2)
    start(fab)
    out = (f"collected 1\n{root}/tests/test_x.py .\n\t{home}/.cache/x\n-I{root}/include "
           f"file://{root}/x see {root}.\n")
    observe(fab, pytest_printed(fab, out))
    observe(fab, bash_failure(fab.root, "python3 -m pytest -q",
                              error="Exit code 1\n" + f"{root}/x.py:1: E\n" * 200))
    first, second = [e for e in ledger(fab.dir) if e["event"] == "observed_run"]
    assert root not in first["detail"] and str(home) not in first["detail"], first
    assert "./tests/test_x.py" in first["detail"] and "~/.cache/x" in first["detail"]
    assert "-I./include file://./x see ./." in first["detail"], first["detail"]
    assert second["detail"].startswith("…") and root.split("/")[-1] not in second["detail"]
    assert second["detail"].endswith("./x.py:1: E\n"), second["detail"]


def test_a_line_too_long_to_hold_is_cut_where_no_path_or_token_goes_on(fab):
    """Output is masked a line at a time; a line longer than a read is cut at a space or a
    quote, not inside the path or the token that straddles the read."""
    (fab.root / "end.txt").write_text(f"{fab.root}/f.py {TOKEN}")
    make_plan(fab, 1, "--verify", "python3 -c \"print('x ' * 32760 + open('end.txt').read())\"")
    start(fab)
    assert fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e").code == 0
    run = [e for e in ledger(fab.dir) if e["event"] == "verify_run"][-1]
    log = (fab.dir / run["log"]).read_text()
    assert log.endswith(" ./f.py ***\n") and len(log) == 2 * 32760 + len("./f.py ***\n"), log[-80:]


def test_a_void_verdict_and_a_decision_note_are_recorded_masked(fab):
    """The finding of a judge whose verdict the changed tree voided, and a human's decision
    note (signed as recorded), carry no secret and no place of the machine."""
    from test_trust import judged_in_review
    judged_in_review(fab)
    (fab.root / "app.py").write_text("print('fixed by the judge')\n")
    r = fab("verdict", "--id", "G001", "achieved", "--agent", "judge", "--evidence",
            f"saw {fab.root}/app.py with {TOKEN}")
    assert r.code == 1 and "changed since the judge packet" in r.err, r
    verdict = [e for e in ledger(fab.dir) if e["event"] == "verdict"][-1]
    assert verdict["evidence"].endswith("The judge's finding: saw ./app.py with ***"), verdict
    for _ in range(2):  # its rounds used: blocked, for a human to decide
        assert fab("next").code == 0
        assert fab("checkpoint", "--id", "G001", "--status", "failed", "--evidence", "no").code == 0
    r = fab("decide", "--id", "G001", "retry", "--note", f"see {fab.root}/NOTES with {TOKEN}")
    assert r.code == 0, r
    assert ledger(fab.dir)[-1]["note"] == "see ./NOTES with ***"
    assert TOKEN.encode() not in state_bytes(fab) and fab("audit").code == 0


def test_a_verify_cmd_run_by_the_engine_may_name_the_home_folder(fab, monkeypatch,
                                                               tmp_path_factory):
    """A --run --verify-cmd is a command the engine runs: kept as given, so the checkpoint
    names the run it made (it named `~` and found no run of it)."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    (home / "check.py").write_text("print('ok')\n")
    make_plan(fab, 2)
    start(fab)
    r = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "ran it",
            "--run", "--verify-cmd", f"python3 {home}/check.py")
    assert r.code == 0, r
    assert ledger(fab.dir)[-1]["verify_cmd"] == f"python3 {home}/check.py"


@pytest.mark.parametrize("text, kept", [
    # words about tokens and passwords, not secrets: kept
    ("raised max_tokens=4096; password_min_length=8", None),
    ("n_tokens=len(x) and token_budget=2000", None),
    ("GITHUB_TOKEN=$GITHUB_TOKEN pytest", None),
    ("GH_TOKEN=${{ secrets.GH_TOKEN }} make", None),
    ("TOKENIZERS_PARALLELISM=false MAX_TOKENS=10 PASSWORD_HASHERS=fast pytest", None),
    ("def login(user, password=None) now compares token==expected", None),
    ("checked the task-scheduler-retries-backoff path", None),
    # code that reads a secret is no value (#35)
    ("PASSWORD=os.environ['X'] and TOKEN=os.getenv(\"T\") or API_KEY=getenv('K')", None),
    ("SECRET=process.env.SECRET; token = config.get('token')", None),
    # a token shape's prefix before a phrase of words is no token (#35)
    ("sk-learn-compat-layer-for-old-pipelines and glpat-rotation-runbook-docs", None),
    # assignments of secrets, and two tokens side by side: masked
    ("DB_PASSWORD=hunter22 ./run", "DB_PASSWORD=*** ./run"),
    ("SECRET_KEY_BASE=abcdef123 rails s", "SECRET_KEY_BASE=*** rails s"),
    (TOKEN + "ghp_" + "B" * 36, "******"),
    # a token that holds another's prefix is still one
    ("ghp_a1b2c3d4e5eyJQQQQQQQQQQQQQQQQQQQQQQQ AKIAAKIAABCDEFGHIJKL", "*** ***"),
    ("Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ1dTEyMyIsInJlYWxtIjp7ImV5SiI6MX19.sig_abcdefghij",
     "Bearer ***"),
    ("AWS_SECRET_ACCESS_KEY=xyz123, SECRET_KEY_BASE=abc123)", "AWS_SECRET_ACCESS_KEY=***, "
     "SECRET_KEY_BASE=***)"),
    # every shape of the table, with a body that looks random: masked
    ("xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx", "***"),
    ("github_pat_11ABCDEFG0abcdEFGHijkl_mnopQRSTuvwx0123456789", "***"),
    ("sk-proj-abc123def456ghi789jkl0 sk-ant-api03-abcdefghijklmnopqrstuvwx", "*** ***"),
    ("glpat-abcDEF123_ghiJKL45xy AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q", "*** ***"),
    ("npm_" + "a1B2" * 9 + " AKIAABCDEFGHIJKLMNOP", "*** ***"),
])
def test_what_is_masked_is_a_secret_not_a_word_about_one(fab, text, kept):
    make_plan(fab, 2)
    assert fab("pause", "--note", text).code == 0
    assert ledger(fab.dir)[-1]["note"] == (kept or text)


def test_a_home_of_one_folder_names_no_one_and_stays(fab, monkeypatch):
    """HOME=/root (CI's, a container's user): /root in output is as likely another machine's
    path as this one's, and names no one — kept; the root at a sentence's stop is `./.`."""
    monkeypatch.setenv("HOME", "/root")
    make_plan(fab, 2)
    note = f"scp x web:/root/deploy; docker run -v /root:/x; GET /root; paused in {fab.root}."
    assert fab("pause", "--note", note).code == 0
    assert ledger(fab.dir)[-1]["note"] == note.replace(str(fab.root), "./")


@pytest.mark.parametrize("title", ["Split the max_tokens=4096 limit", "token-based auth",
                                   "Fix the password reset flow", "Rotate API_KEY handling",
                                   "Add task-queue-worker-retries module",
                                   "Use npm_config_registry_for_private_packages_x",
                                   "Add xoxb-slack-bot-integration-tests",
                                   "Write github_pat_handling_for_fine_grained_tokens",
                                   "sk-learn-compat-layer-for-old-pipelines",
                                   "glpat-rotation-runbook-docs", "fix token refresh"])
def test_a_title_about_tokens_or_passwords_is_no_secret(fab, title):
    assert fab("create", "--brief", "b", "--goal", f"{title}::o", "--goal", "v::w").code == 0
    assert ledger(fab.dir)[0]["stories"][0]["title"] == title  # as typed


def test_evidence_that_reads_a_secret_in_code_is_kept_as_typed(fab):
    make_plan(fab, 2)
    start(fab)
    evidence = "PASSWORD=os.environ['X'] is read, never printed; if token == expected: passes"
    assert fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence",
               evidence).code == 0
    assert ledger(fab.dir)[-1]["evidence"] == evidence


def test_an_agent_a_tool_and_a_scope_that_carry_a_token_are_refused_or_masked(fab):
    assert_refused(fab, ["create", "--brief", "b", "--goal", "a::b", "--scope", f"src/{TOKEN}"],
                   2, "--scope `src/***`", error="secret_in_plan")
    make_plan(fab, 2, "--parallel")
    assert_refused(fab, ["next", "--agent", TOKEN], 2, "--agent `***`", error="secret_in_plan")
    assert fab("next").code == 0
    payload = bash_failure(fab.root, "python3 -m pytest -q")
    observe(fab, dict(payload, tool_name=f"Bash {TOKEN}"))
    assert ledger(fab.dir)[-1]["tool"] == "Bash ***"
    assert TOKEN.encode() not in state_bytes(fab)


def test_a_token_across_a_long_lines_read_is_masked_whole(fab, monkeypatch):
    """A line longer than a read with nowhere to cut (no space, no quote): cut before the
    secret or the place that goes on past the point, never inside it."""
    monkeypatch.setenv("DEPLOY_API_KEY", VALUE + "!x y")  # a value a space or `!` may cut
    (fab.root / "out.py").write_text(
        "import os, sys\n"
        f"sys.stdout.write(('x' * 57 + '-{TOKEN}-' + os.environ['DEPLOY_API_KEY']) * 3000 +"
        f" '\\\\n' + os.getcwd() + '/a.py')\n")
    make_plan(fab, 1, "--verify", "python3 out.py")
    start(fab)
    assert fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e").code == 0
    run = [e for e in ledger(fab.dir) if e["event"] == "verify_run"][-1]
    log = (fab.dir / run["log"]).read_text()
    assert TOKEN not in log and VALUE not in log and "ghp_" not in log and "Q7r8" not in log
    assert log.count("-***-***") == 3000 and log.endswith("\\n./a.py"), log[-60:]


def test_a_long_line_with_no_token_in_it_is_held_back_a_bounded_length(fab):
    """A line of megabytes that a token's pattern matches whole (base64 after `sk-`) is no
    token: it is cut through, and what is held back stays short (it grew with the line, and
    every read scanned it all again)."""
    masker = engine.Masker(str(fab.root))
    data = b"sk-" + b"a-b_c" * (1 << 20)
    held = 0
    for i in range(0, len(data), 1 << 16):
        masker.feed(data[i:i + (1 << 16)])
        held = max(held, len(masker.carry))
    assert held <= engine.HOLD + (1 << 16), held


def test_a_coloured_path_and_a_secret_as_json_writes_it_are_masked(fab, monkeypatch):
    """A terminal's colour before a path (pytest, gcc) and a secret with a quote or a backslash
    in what the harness reports as JSON."""
    monkeypatch.setenv("MY_API_TOKEN", 'Pa55\\word"X')
    root = str(fab.root)
    make_plan(fab, 2)
    start(fab)
    out = (f"\x1b[1m{root}/tests/a.py\x1b[0m F\n\x1b[01m\x1b[K{root}/x.c\x1b[m\n"
           f"pw={os.environ['MY_API_TOKEN']}\n")
    observe(fab, pytest_printed(fab, out))
    detail = ledger(fab.dir)[-1]["detail"]
    assert root not in detail and "Pa55" not in detail and "pw=***" in detail, detail
    assert "./tests/a.py" in detail and "./x.c" in detail


def test_an_original_plan_is_imported_with_its_secrets_and_places_masked(fab):
    """The original masked nothing: its texts come into the ledger masked (its own files stay
    whole in the archive)."""
    fab.dir.mkdir()
    (fab.dir / "goals.json").write_text(json.dumps({
        "brief": f"ship {TOKEN}", "created": "2026-01-01T00:00:00",
        "goals": [{"id": "G001", "title": f"Deploy with {TOKEN}", "objective":
                   f"edit {fab.root}/src/x.py", "status": "complete",
                   "evidence": "password=hunter22 from the vault"},
                  {"id": "G002", "title": "v", "objective": "w", "status": "pending",
                   "evidence": None}]}))
    assert fab("status").code == 0
    created = ledger(fab.dir)[0]
    assert created["brief"] == "ship ***" and created["stories"][0]["title"] == "Deploy with ***"
    assert created["stories"][0]["objective"] == "edit ./src/x.py"
    assert created["stories"][0]["evidence"] == "password=*** from the vault"
    ledger_text = (fab.dir / "ledger.jsonl").read_text() + (fab.dir / "goals.json").read_text()
    assert TOKEN not in ledger_text and "hunter22" not in ledger_text


def test_audit_finds_a_secret_hidden_in_a_storys_words_or_an_agent(fab):
    """A forger who re-chains the ledger puts a token in a story's title (plan_created), an
    added story's acceptance item, an agent's name: audit reads those too."""
    make_plan(fab, 2, "--parallel")
    events = ledger(fab.dir)
    events[0]["stories"][0]["title"] = f"S1 {TOKEN}"
    write_lines(fab.dir, rechain(events))
    (fab.dir / "goals.json").unlink()
    j = fab("--json", "audit").json
    assert j["error"]["code"] == "secret_in_ledger" and j["secret_lines"] == [1], j
    make_plan(fab, 2, "--force", "--parallel")
    assert fab("add", "--goal", "x::y", "--judge", "--accept", "it works").code == 0
    assert fab("next", "--agent", "ann").code == 0
    events = ledger(fab.dir)
    events[-2]["story"]["accept"] = [TOKEN]
    events[-1]["agent"] = TOKEN
    write_lines(fab.dir, rechain(events))
    (fab.dir / "goals.json").unlink()
    j = fab("--json", "audit").json
    assert j["error"]["code"] == "secret_in_ledger" and j["secret_lines"] == [2, 3], j


def test_runs_of_an_older_engine_that_kept_values_compare_with_digests(fab):
    fablize_trust = engine.room("trust", "test")
    old = {"PATH": os.environ["PATH"], "LONG": "sha256:" + "ab" * 32}
    new = {"PATH": "sha256:" + goals_sha(os.environ["PATH"].encode())[:16],
           "LONG": "sha256:" + "ab" * 8}
    assert fablize_trust.env_digests(old) == fablize_trust.env_digests(new) == new


def test_audit_fails_a_ledger_that_recorded_a_secret_by_hand_or_by_an_older_engine(fab):
    make_plan(fab, 2)
    start(fab)
    r = forge_fab(fab, event="checkpoint", id="G001", status="complete",
                  evidence=f"see {TOKEN}", verify_cmd="", verify_evidence="")
    assert r.code == 0, r
    r = fab("audit")
    assert r.code == 1 and "secret_in_ledger" in r.out and "line 3" in r.out, r
    assert "rotate that secret now" in r.out
    j = fab("--json", "audit").json
    assert j["error"]["code"] == "secret_in_ledger" and j["secret_lines"] == [3]


@pytest.mark.parametrize("kind, fields, line", [
    ("decision", {"id": "G001", "decision": "retry", "note": f"key {TOKEN}"}, 4),
    ("guard_block", {"reason": f"stop: {TOKEN}", "fresh": True}, 4),
])
def test_audit_flags_a_secret_in_a_note_or_a_reason_an_older_engine_kept(fab, kind, fields,
                                                                          line):
    make_plan(fab, 2)
    start(fab)
    assert fab("checkpoint", "--id", "G001", "--status", "failed", "--evidence", "no").code == 0
    assert forge_fab(fab, event=kind, **fields).code == 0
    j = fab("--json", "audit").json
    assert j["error"]["code"] == "secret_in_ledger" and j["secret_lines"] == [line], j


@pytest.mark.parametrize("args, name", [
    (["create", "--brief", f"ship with {TOKEN}", "--goal", "a::b"], "--brief"),
    (["create", "--brief", "b", "--goal", f"Deploy::push with {VALUE}"], "an objective"),
    (["create", "--brief", "b", "--goal", "a::b", "--judge", "--accept", f"G001=uses {TOKEN}"],
     "an acceptance item"),
])
def test_a_plan_whose_words_carry_a_secret_is_refused_and_nothing_is_written(fab, monkeypatch,
                                                                             args, name):
    monkeypatch.setenv("DEPLOY_API_KEY", VALUE)
    r = assert_refused(fab, args, 2, f"{name} `", "holds what looks like a secret",
                       error="secret_in_plan")
    assert TOKEN not in r.err and VALUE not in r.err
    assert not (fab.dir / "ledger.jsonl").exists()
    make_plan(fab, 2)
    before = state_bytes(fab)
    assert_refused(fab, ["add", "--goal", f"Rotate {TOKEN}::now"], 2, "a title `Rotate ***`",
                   error="secret_in_plan")
    assert state_bytes(fab) == before


# A run's log under faults ####################################################################


def limited(size):
    """A child whose files cannot grow past `size` bytes (the disk is full at that point for
    every file it writes; SIGXFSZ ignored, so a write fails with EFBIG the way it would with
    ENOSPC)."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    return apply


def engine_in(fab, *args, limit=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FABLIZE_")}
    p = subprocess.run([*ENGINE, *args], cwd=str(fab.root), capture_output=True, text=True,
                       env=env, timeout=120, preexec_fn=limit and limited(limit))
    return p


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs RLIMIT_FSIZE")
def test_a_full_disk_during_a_run_records_an_error_whose_log_matches_and_still_audits(fab):
    make_plan(fab, 1, "--verify", "python3 -c \"print('x' * 1000000)\"")
    start(fab)
    p = engine_in(fab, "checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
               limit=200_000)  # the ledger and snapshot fit; the 1 MB log does not
    assert p.returncode == 1, p
    assert "its log could not be written whole" in p.stderr + p.stdout, p
    run = [e for e in ledger(fab.dir) if e["event"] == "verify_run"][-1]
    log = (fab.dir / run["log"]).read_bytes()
    assert run["error"].startswith("its log could not be written whole") and run["exit_code"] == 0
    assert run["bytes"] == len(log) < 1_000_001 and run["sha256"] == goals_sha(log)
    assert fab("audit", "--require-logs").code == 0  # no edit nobody made
    assert "G001" in fab("status").out and fab("next").code == 0  # still in progress: run again
    assert fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e").code == 0


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs RLIMIT_FSIZE")
def test_a_disk_too_full_for_the_ledger_records_nothing_and_says_so_in_one_line(fab):
    make_plan(fab, 1, "--verify", "echo out")
    start(fab)
    before = (fab.dir / "ledger.jsonl").read_bytes()
    p = engine_in(fab, "checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
               limit=2)  # not a byte more for any file: the run's record cannot be appended
    assert p.returncode == 3 and "I/O error" in p.stderr and p.stderr.count("\n") == 2, p
    assert p.stderr.splitlines()[1].endswith(" checkpoint --id G001 --status complete --evidence e")
    assert (fab.dir / "ledger.jsonl").read_bytes() == before
    assert fab("audit", "--require-logs").code == 0
    assert fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e").code == 0
    assert fab("audit", "--require-logs").code == 0


# Ctrl-C at start-up ##########################################################################


def interrupted_at_start(*args, entry=SCRIPT, during=None):
    """goals.py (or `entry`) loaded as a process loads it, a Ctrl-C arriving before the engine
    has read its first argument (kept by the entry's handler, answered by main); with
    `during`, while that module of the engine is being imported instead."""
    code = ("import os, signal, sys, importlib.util as u\n"
            "spec = u.spec_from_file_location('entry', sys.argv.pop(1))\n"
            "m = u.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "during = sys.argv.pop(1)\n"
            "class Kill:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == during:\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "if during:\n"
            "    sys.meta_path.insert(0, Kill())\n"
            "else:\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "m.main()\n")
    return subprocess.run([ENGINE_PYTHON, "-c", code, str(entry), during or "", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("entry", ["goals.py", "fablize.py"])
def test_ctrl_c_while_the_engine_starts_is_one_line_and_exit_130(fab, entry):
    make_plan(fab, 1)
    p = interrupted_at_start("status", entry=SCRIPT.parent / entry)
    assert p.returncode == 130 and p.stdout == "", p
    assert p.stderr.startswith("fablize: interrupted by SIGINT") and p.stderr.count("\n") == 2, p
    assert p.stderr.splitlines()[1].endswith(" status"), p  # the step: run it again
    p = interrupted_at_start("--json", "status", entry=SCRIPT.parent / entry)
    assert p.returncode == 130 and p.stdout.count("\n") == 1, p
    assert json.loads(p.stdout)["error"]["code"] == "interrupted" and p.stderr == "", p


@pytest.mark.parametrize("module", ["fablize_gate", "fablize_gate.model", "fablize_gate.cli"])
def test_ctrl_c_while_the_engine_s_modules_load_is_answered_too(fab, module):
    make_plan(fab, 1)
    p = interrupted_at_start("status", during=module)
    assert p.returncode == 130 and "Traceback" not in p.stderr, p
    assert p.stderr.startswith("fablize: interrupted by SIGINT"), p


# Files written on the user's behalf ##########################################################


@pytest.mark.parametrize("command", [["install-block"], ["report", "--out"]])
def test_a_file_outside_the_project_is_refused_unless_asked_with_outside(fab, tmp_path_factory,
                                                                          command):
    make_plan(fab, 1)
    away = tmp_path_factory.mktemp("away")
    for path in (away / "x.md", f"../{away.name}/x.md"):
        r = assert_refused(fab, [*command, path], 1, "is outside the project",
                           "only when asked with --outside")
        assert not (away / "x.md").exists() and r.out == ""
    r = fab(*command, away / "x.md", "--outside")
    assert r.code == 0 and (away / "x.md").is_file(), r


@pytest.mark.parametrize("command", [["install-block"], ["report", "--out"]])
def test_a_symlink_out_of_the_project_is_never_followed(fab, tmp_path_factory, command):
    make_plan(fab, 1)
    away = tmp_path_factory.mktemp("away")
    (away / "mine.md").write_text("the user's own file\n")
    (fab.root / "docs").symlink_to(away, target_is_directory=True)
    (fab.root / "notes.md").symlink_to(away / "mine.md")
    assert_refused(fab, [*command, "docs/x.md"], 1, "a folder on the way is a symlink out of it")
    for extra in ([], ["--outside"]):
        assert_refused(fab, [*command, "notes.md", *extra], 1, "is a symlink — refusing")
    assert sorted(p.name for p in away.iterdir()) == ["mine.md"]
    assert (away / "mine.md").read_text() == "the user's own file\n"


def test_a_report_inside_the_project_is_written_whole(fab):
    make_plan(fab, 1)
    (fab.root / "out").mkdir()
    r = fab("report", "--out", "out/report.md")
    written = (fab.root / "out" / "report.md").read_text()
    assert r.code == 0 and written.startswith("# fablize report"), r
