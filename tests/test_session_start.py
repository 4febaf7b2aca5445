"""What a session start injects (`status --resume`, the SessionStart hook): bounded however
large the plan — the count, the stories by status, the few a human or a judge must look at,
the next step, the story in progress whole; `status` stays complete for a human."""

import pytest

from conftest import engine
from conftest import make_plan


def half_done(fab, n, title="Story with a title of a realistic length"):
    goal_args = []
    for i in range(1, n + 1):
        goal_args += ["--goal", f"{title} {i}::objective {i}, a sentence or two of what to do"]
    assert fab("create", "--brief", f"a {n} story plan", *goal_args).code == 0
    for i in range(1, n // 2 + 1):
        sid = engine.story_id(i)
        assert fab("next").code == 0
        assert fab("checkpoint", "--id", sid, "--status", "complete",
                   "--evidence", f"did story {i}: the tests pass, the file changed").code == 0
    assert fab("next").code == 0


@pytest.mark.parametrize("n", [60, 400])
def test_a_session_start_stays_short_and_flat_as_the_plan_grows(fab, n):
    half_done(fab, n)
    out = fab("status", "--resume").out
    assert len(out) <= 2000, (len(out), out)
    assert out.startswith(f"fablize: {n // 2}/{n} complete — a {n} story plan\n")
    assert f"  {n // 2} complete · 1 in progress · {n // 2 - 1} pending\n" in out
    active = engine.story_id(n // 2 + 1)
    assert f"=== fablize handoff — {active} " in out and "← you are here" in out
    assert out.rstrip("\n").splitlines()[-1].startswith("On completion: ")
    assert "G001 [complete]" not in out  # done stories are counted, not listed
    full = fab("status").out  # a human's status stays complete
    assert full.count("[complete]") == n // 2 and f"{engine.story_id(n)} [pending]" in full


def test_a_session_start_names_what_a_human_or_a_judge_must_look_at(fab):
    make_plan(fab, 9, "--parallel", "--judge", "G003")
    for sid, status in (("G001", "blocked"), ("G002", "failed")):
        assert fab("next").code == 0
        assert fab("checkpoint", "--id", sid, "--status", status,
                   "--evidence", f"{status}: the API does not exist").code == 0
    out = fab("status", "--resume").out
    assert "  ■ G001 [blocked] S1: blocked: the API does not exist" in out, out
    assert "  ✗ G002 [failed] S2" in out
    assert "1 blocked" in out and "1 failed" in out


def test_other_stories_in_progress_get_a_line_each_with_their_handoff_command(fab):
    make_plan(fab, 5, "--parallel")
    for agent in ("a", "b", "c"):
        assert fab("next", "--agent", agent).code == 0
    out = fab("status", "--resume").out
    assert out.count("=== fablize handoff") == 1 and "=== fablize handoff — G001" in out
    assert "Also in progress: G002 S2 (agent b) — its handoff: goals.py next --agent b" in out
    assert "Also in progress: G003 S3 (agent c)" in out


def test_a_long_title_or_many_dependencies_do_not_grow_it(fab):
    long_title = "word " * 400
    args = []
    for i in range(1, 40):
        args += ["--goal", f"{long_title}{i}::objective {i}"]
    args += ["--goal", "Verify::the whole suite passes"]  # the story in progress: shown whole
    assert fab("create", "--brief", "b", "--parallel", *args).code == 0
    for i in range(1, 40):
        assert fab("next").code == 0
        assert fab("checkpoint", "--id", engine.story_id(i), "--status", "complete",
                   "--evidence", "e" * 400).code == 0
    assert fab("next").code == 0  # the final story: it waits for all 39
    out = fab("status", "--resume").out
    assert ("## From 37 earlier dependencies — not shown here; `next` prints the whole handoff"
            in out)
    # bounded by constants (titles, tails, the map window), whatever the plan holds
    assert out.count("## From G0") == 2 and len(out) <= 3000, len(out)
    assert out.count(long_title) == 0  # titles are cut in the map (the objective stays whole)
