"""A shared plan's remote is writable by anyone who can push: what it holds under
refs/fablize/plans/ — a ref whose name is not UTF-8, an event line that is no JSON — gives every
`sync` and `audit --remote` one line or one JSON object, never a traceback. Real git: a bare
repository is the remote, clones are real clones. Each failed before its fix."""

import json

from conftest import git, git_env, run_cli


def test_audit_remote_with_an_unparsable_run_line_is_one_line(tmp_path):
    """remote_ledger: {parse_event(line).get("log"): ...} for every commit carrying a `log`."""
    bare, work = tmp_path / "r.git", tmp_path / "w"
    git(tmp_path, "init", "-q", "--bare", str(bare))
    git(tmp_path, "init", "-q", str(work))
    (work / "event.jsonl").write_bytes(b'not json "event":"verify_run"\n')
    (work / "log").write_bytes(b"log\n")
    git(work, "add", "event.jsonl", "log")
    git(work, "commit", "-qm", "e")
    git(work, "push", "-q", str(bare), "HEAD:refs/fablize/plans/P1")
    clone = tmp_path / "c"
    git(tmp_path, "clone", "-q", str(bare), str(clone))
    r = run_cli("audit", "--remote", "origin", "--json", cwd=clone)
    assert "Traceback" not in r.err, r
    json.loads(r.out)


def test_a_non_utf8_plan_ref_on_the_remote_is_one_line(tmp_path):
    """Anyone who can push makes refs/fablize/plans/p\\xff: ls-remote's output was decoded
    strictly, and every `sync` and `audit --remote` of every agent gave a traceback."""
    bare, work, clone = tmp_path / "r.git", tmp_path / "w", tmp_path / "c"
    git(tmp_path, "init", "-q", "--bare", str(bare))
    git(tmp_path, "init", "-q", str(work))
    git(work, "commit", "-q", "--allow-empty", "-m", "x")
    git(work, "push", "-q", str(bare), "HEAD:refs/heads/main")
    git(work, "push", "-q", str(bare), b"HEAD:refs/fablize/plans/p\xff")
    git(tmp_path, "clone", "-q", str(bare), str(clone))
    for cmd in (["audit", "--remote", "origin", "--json"], ["sync", "--json"]):
        r = run_cli(*cmd, cwd=clone, env=git_env(tmp_path), inherit=False)
        assert "Traceback" not in r.err, (cmd, r.err)
        json.loads(r.out)
