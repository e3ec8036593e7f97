"""Slurm's habits (issue 23): the options and forms a user of sbatch/squeue/sacct/scancel
types without thinking, on our commands."""

from __future__ import annotations

from datetime import datetime

import pytest
from test_store_acct import T0, hist, invoke  # noqa: F401 - hist is a fixture

from slurm_dlrm.store.acct import parse_time


def test_acct_takes_sacct_state_abbreviations_time_forms_and_x(hist):  # noqa: F811
    s, ids, _ = hist
    res = invoke(s, "-X", "-s", "CD", "-o", "JobID", "-P", "-n", "--starttime", f"@{T0 - 100}", "--endtime", "now")
    assert res.exit_code == 0, res.output
    assert res.output.split() == [str(ids["A"]), str(ids["C"]), str(ids["D"])]
    res = invoke(s, "-s", "PD,oom", "-o", "Name", "-P", "-n")
    assert res.output.split() == ["B", "E"]


def test_acct_parsable_is_formatted_like_sacct_and_raw_behind_raw(hist):  # noqa: F811
    s, ids, _ = hist
    res = invoke(s, "-P", "-j", str(ids["A"]), "-o", "JobID,MaxGPUMem,Elapsed,ExitCode")
    assert res.output == f"JobID|MaxGPUMem|Elapsed|ExitCode\n{ids['A']}|3.0G|00:01:40|0:0\n"
    res = invoke(s, "-P", "--raw", "-n", "-j", str(ids["A"]), "-o", "JobID,MaxGPUMem,Elapsed,ExitCode")
    assert res.output == f"{ids['A']}|{(3 << 30) + 5}|100.0|0\n"
    res = invoke(s, "--raw")
    assert res.exit_code == 2 and "--raw: goes with -P" in res.output


def test_acct_exit_code_is_code_colon_signal(hist):  # noqa: F811
    s, ids, _ = hist
    for code, shown in ((5, "5:0"), (143, "0:15"), (137, "0:9")):
        s.conn.execute("UPDATE jobs SET exit_code = ? WHERE id = ?", (code, ids["A"]))
        s.conn.commit()
        res = invoke(s, "-P", "-n", "-j", str(ids["A"]), "-o", "ExitCode")
        assert res.output.strip() == shown


@pytest.mark.parametrize("text, want", [
    ("now-1hours", T0 - 3600), ("now-90minutes", T0 - 5400), ("now-30", T0 - 30), ("now+2days", T0 + 2 * 86400),
    ("now-1weeks", T0 - 604800), ("1h", T0 - 3600),
])
def test_slurm_relative_times(text, want):
    assert parse_time(text, "-S", T0) == want


def test_slurm_clock_and_date_forms():
    day = datetime.fromtimestamp(T0).replace(hour=0, minute=0, second=0, microsecond=0)
    assert parse_time("today", "-S", T0) == parse_time("midnight", "-S", T0) == day.timestamp()
    assert parse_time("14:30", "-S", T0) == day.replace(hour=14, minute=30).timestamp()
    assert parse_time("1121", "-S", T0) == day.replace(month=11, day=21).timestamp()
    assert parse_time("11/21/25", "-S", T0) == day.replace(year=2025, month=11, day=21).timestamp()
