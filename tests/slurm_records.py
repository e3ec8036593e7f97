"""Job records in each Slurm release's recorded formats (tests/data/slurm/<release>/), with
the fields a user writes (job name, work dir, comment, submit line) replaced, so the root
scripts can be fed hostile jobs as real Slurm would show them.

- ``scontrol_line``: the one-line ``scontrol show job -o`` text of the recorded gres/mps job,
  the user's fields spliced in where that release prints them (what the prolog grepped
  before issue 32, and what a forged field hides in).
- ``squeue_record``: the recorded ``squeue --json`` job of that release, the same fields set.
- ``squeue_field``: what ``squeue --noheader --format=%<letter>`` prints for a record: the
  field alone (b TresPerNode, k Comment, T state), ``(null)``/``N/A`` when unset.
- ``write_stub``: a fake ``squeue`` answering from those strings, and the hostile
  ``scontrol`` text next to it.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "slurm"
RELEASES = ("22.05.8", "24.11.5", "26.05.5")

# squeue stub: `squeue ... --jobs=ID --format=%X` prints $STUB_DIR/job_ID.X, else Slurm's error.
STUB_SQUEUE = r'''#!/bin/bash
id= fmt=
for a in "$@"; do
  case $a in
    --jobs=*) id=${a#--jobs=} ;;
    --format=%*) fmt=${a#--format=%} ;;
  esac
done
if [[ -n $id && -f $STUB_DIR/job_$id.$fmt ]]; then cat "$STUB_DIR/job_$id.$fmt"; exit 0; fi
echo "slurm_load_jobs error: Invalid job id specified" >&2
exit 1
'''


def _recorded_mps_job(release: str) -> tuple[str, dict[str, Any]]:
    folder = DATA / release
    roles = json.loads((folder / "jobs.json").read_text())
    line = (folder / "scontrol_show_job_mps.txt").read_text().strip()
    jobs = json.loads((folder / "squeue.json").read_text())["jobs"]
    record = next(j for j in jobs if j["job_id"] == roles["mps"])
    return line, record


def scontrol_line(release: str, job_id: int, *, name: str, work_dir: str, comment: str,
                  tres_per_node: str, submit_line: str = "sbatch x.sh", state: str = "RUNNING") -> str:
    """The release's ``scontrol show job -o`` line for job `job_id` with these fields."""
    line, record = _recorded_mps_job(release)
    # Placeholders first, the user's text last: no later edit may touch what the user wrote.
    line = re.sub(r"^JobId=\d+ JobName=\S+", f"JobId={job_id} JobName=\x00name\x00", line)
    line = line.replace("JobState=RUNNING", f"JobState={state}")
    line = line.replace(f"WorkDir={record['current_working_directory']}", "WorkDir=\x00work_dir\x00")
    line = re.sub(r"TresPerNode=\S+", "TresPerNode=\x00tres\x00", line)
    # Comment= sits before Command=; SubmitLine= before WorkDir= where the release prints it
    # (23.02+); 22.05 has none, so it is added there too: text the old grep also read.
    line = line.replace(" Command=", " Comment=\x00comment\x00 Command=", 1) if comment else line
    if " SubmitLine=" in line:
        line = re.sub(r"SubmitLine=.*? WorkDir=", "SubmitLine=\x00submit\x00 WorkDir=", line)
    else:
        line = line.replace(" WorkDir=", " SubmitLine=\x00submit\x00 WorkDir=", 1)
    values = {"name": name, "work_dir": work_dir, "tres": tres_per_node, "comment": comment, "submit": submit_line}
    return re.sub("\x00(\\w+)\x00", lambda m: values[m.group(1)], line) + "\n"


def squeue_record(release: str, job_id: int, *, name: str, work_dir: str, comment: str,
                  tres_per_node: str, submit_line: str = "sbatch x.sh", state: str = "RUNNING") -> dict[str, Any]:
    """The release's ``squeue --json`` job record with these fields."""
    _, recorded = _recorded_mps_job(release)
    record = copy.deepcopy(recorded)
    record.update(job_id=job_id, name=name, current_working_directory=work_dir, comment=comment,
                  tres_per_node=tres_per_node)
    if "submit_line" in record:
        record["submit_line"] = submit_line
    record["job_state"] = [state] if isinstance(recorded["job_state"], list) else state
    return record


def squeue_field(record: dict[str, Any], letter: str) -> str:
    """What ``squeue --noheader --format=%<letter>`` prints for the job (its line, newline included)."""
    if letter == "b":
        value = record.get("tres_per_node") or "N/A"
    elif letter == "k":
        value = record.get("comment") or "(null)"
    elif letter == "T":
        state = record["job_state"]
        value = state[0] if isinstance(state, list) else state
    else:
        raise ValueError(letter)
    return f"{value}\n"


def write_stub(bin_dir: Path, stub_dir: Path, release: str, job_id: int, **fields: str) -> None:
    """Install the squeue stub and make `job_id` known to it (and scontrol's text of it)."""
    squeue = bin_dir / "squeue"
    if not squeue.exists():
        squeue.write_text(STUB_SQUEUE)
        squeue.chmod(0o755)
    record = squeue_record(release, job_id, **fields)
    for letter in "bkT":
        (stub_dir / f"job_{job_id}.{letter}").write_text(squeue_field(record, letter))
    (stub_dir / f"job_{job_id}").write_text(scontrol_line(release, job_id, **fields))
