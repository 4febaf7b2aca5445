from conftest import complete, make_plan


def test_a_plan_runs_to_completion_in_process(fab):
    make_plan(fab, 2)
    complete(fab, "G001")
    r = complete(fab, "G002", final=True)
    assert "fablize: all stories complete ✓" in r.out
    assert fab("audit").code == 0
