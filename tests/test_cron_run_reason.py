"""`appserver cron run NAME` in-process when the kernel refuses the run (its conversation does not
exist): the user reads why, in one line with a non-zero exit, never "None (turn None)"; --json
carries the same reason."""

from __future__ import annotations

from tests.support.cli import CLIResult


def test_a_run_the_kernel_refuses_prints_the_reason(cli) -> None:  # type: ignore[no-untyped-def]
    add: CLIResult = cli("cron", "add", "--name", "lost", "--agent", "assistant", "--every", "1h",
                         "--conversation", "conv_does_not_exist", "--prompt", "p")  # fmt: skip
    assert add.code == 0, add.err
    r: CLIResult = cli("cron", "run", "lost")
    assert r.code == 1, (r.out, r.err)
    assert "None" not in r.out + r.err, (r.out, r.err)
    line = [x for x in r.err.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "run #1 of lost could not be submitted" in line[0], r.err
    assert "conv_does_not_exist" in line[0] or "not found" in line[0].lower(), line

    j: CLIResult = cli("cron", "run", "lost", "--json")
    assert j.code == 1
    out = j.json()
    assert out["turn_id"] is None and out["outcome"] is None and out["error"], out
