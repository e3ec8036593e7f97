"""Two writer processes and one acct reader at once (short run; the script runs longer).

Full run: /work/main/.venv/bin/python benchmarks/store_stress.py --seconds 60
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_two_writers_and_acct_lose_nothing_and_never_see_a_lock_error(tmp_path):
    db = tmp_path / "s" / "store.sqlite"
    res = subprocess.run(  # noqa: S603 - fixed argv
        [sys.executable, str(REPO / "benchmarks" / "store_stress.py"), "--seconds", "5", "--batch", "300",
         "--db", str(db)],
        capture_output=True, text=True, timeout=180, cwd=REPO,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    last = res.stdout.strip().splitlines()[-1]
    fields = dict(kv.split("=") for kv in last.split()[1:])
    assert fields["ok"] == "true" and fields["lock_errors"] == "0"
    assert int(fields["samples"]) > 0 and int(fields["acct_runs"]) > 0
    assert "locked" not in res.stderr
