"""`submit --no-pack` on the local Slurm cluster (issue 23, one job identity): the job is
ours (`Submitted job N (Slurm M; ...)`), `queue`, `show` and `acct` find it under our id
with its Slurm id, the node's GPU index and how it ended, and `cancel` scancels it."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from service_harness import cli, show_job, wait_until

pytest.importorskip("slurm_dlrm.estimate")

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "sweep"
# The jobs really train (slurm-dlrm train in the batch script): torch.
pytestmark = [pytest.mark.slurm, pytest.mark.torch]


def _slurm_gpu_idx(slurm_job_id: str) -> set[int]:
    detail = subprocess.run(["scontrol", "show", "job", "-d", slurm_job_id], capture_output=True,  # noqa: S603, S607
                            text=True, timeout=30, check=True).stdout
    idx: set[int] = set()
    for spec in re.findall(r"IDX:([\d,-]+)", detail):
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            idx.update(range(int(lo), int(hi or lo) + 1))
    return idx


def test_a_no_pack_job_is_one_of_ours_from_submit_to_acct_and_cancel(live_service, tmp_path):
    long_spec = tmp_path / "long.yaml"
    long_spec.write_text((EXAMPLES / "tiny-a.yaml").read_text().replace("name: tiny-a", "name: long-one")
                         .replace("steps: 60", "steps: 100000"))
    r = cli("submit", "--no-pack", str(EXAMPLES / "tiny-a.yaml"))
    assert r.exit_code == 0, r.output
    m = re.fullmatch(r"Submitted job (\d+) \(Slurm (\d+); tiny-a: --mem=\d+M --cpus-per-task=\d+ "
                     r"--gres=(?:gpu:1|mps:\d+)\)\n", r.stdout)  # stderr: the site's MPS note
    assert m, r.output
    short_id, short_sid = int(m.group(1)), m.group(2)
    r = cli("submit", "--no-pack", "--parsable", str(long_spec))
    assert r.exit_code == 0, r.output
    long_id = int(r.stdout.strip())  # sbatch --parsable's form: the id alone (issue 42)
    long_sid = int(json.loads(cli("show", str(long_id), "--json").output)["slurm_job_id"])
    assert long_id == short_id + 1 and long_sid != int(short_sid)

    # Slurm's own view agrees: the marker carries our id
    comment = subprocess.run(["squeue", "-h", "-j", str(long_sid), "-o", "%k"], capture_output=True,  # noqa: S603, S607
                             text=True, timeout=30, check=True).stdout.strip()
    assert f"job_id={long_id}" in comment and "mode=no-pack" in comment

    # The long one runs: queue shows it under our id, with the GPU Slurm gave it on its node.
    def running_row():
        rows = {r["job_id"]: r for r in json.loads(cli("queue", "--json").output)["jobs"]}
        row = rows.get(long_id)
        return row if row and row["state"] == "RUNNING" and row["gpu"] is not None else None

    row = wait_until(running_row)
    assert (row["pack"], row["slurm_job_id"]) == ("no-pack", str(long_sid)) and row["node"]
    assert row["gpu"] in _slurm_gpu_idx(str(long_sid)), row

    # The short one ends: show and acct have it COMPLETED with exit code 0 and its Slurm id.
    short = wait_until(lambda: (j := show_job(short_id))["state"] in ("COMPLETED", "FAILED", "CANCELLED", "OOM") and j)
    assert (short["state"], short["exit_code"], short["slurm_job_id"]) == ("COMPLETED", 0, short_sid), short
    assert short["mode"] == "no-pack" and short["logs"], short  # its output where `log` reads it
    r = cli("acct", "-j", str(short_id), "-o", "JobID,State,SlurmJobID,Pack,Elapsed,GPUHours", "--json")
    assert r.exit_code == 0, r.output
    (a,) = json.loads(r.output)
    assert (a["JobID"], a["State"], a["SlurmJobID"], a["Pack"]) == (short_id, "COMPLETED", short_sid, "no-pack"), a
    assert a["Elapsed"] > 0 and a["GPUHours"] > 0, a
    r = cli("acct", "-j", str(short_id), "-o", "JobID,State,ExitCode,SlurmJobID", "-P", "-n")
    assert r.output.strip() == f"{short_id}|COMPLETED|0:0|{short_sid}", r.output

    # cancel takes our id and scancels the Slurm job; the service records the end.
    r = cli("cancel", str(long_id))
    assert r.exit_code == 0 and f"Slurm job {long_sid}" in r.output, r.output
    long = wait_until(lambda: (j := show_job(long_id))["state"] not in ("PLANNED", "RUNNING") and j)
    assert long["state"] == "CANCELLED", long
    state = subprocess.run(["sacct", "-X", "-n", "-P", "-j", str(long_sid), "-o", "State"],  # noqa: S603, S607
                           capture_output=True, text=True, timeout=30, check=True).stdout
    assert state.startswith("CANCELLED"), state
