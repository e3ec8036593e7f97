"""Issue 42: the same invocations against Slurm's own sbatch/squeue/sacct/scancel and ours
on the local cluster (benchmarks/habits.py holds the table; the benchmark runs all of
it, this test its `ci` rows), so the next habit that drifts fails here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import habits  # noqa: E402 - the table lives with the benchmark

pytestmark = pytest.mark.slurm


def test_our_commands_answer_as_slurms_do(slurm_cluster):
    rows = [h for h in habits.TABLE if h.ci and (slurm_cluster.accounting or h.slurm[0] != "sacct")]
    assert len(rows) >= 15
    results = habits.run_table(str(slurm_cluster.slurm_conf), rows)
    bad = [f"{r.habit.what}: slurm rc={r.slurm_rc} {r.slurm_out} | ours rc={r.ours_rc} {r.ours_out} "
           f"{r.ours_err.strip()!r}" for r in results if r.verdict == "differs"]
    assert bad == [], "\n".join(bad)
    assert {r.verdict for r in results} == {"same", "refused"}
