#!/usr/bin/env python3
"""Record the real output of every Slurm command the seam runs, for the parser tests.

Run against a live local cluster with accounting (`slurm-dlrm cluster up --accounting`),
as root, once per Slurm release:

    .venv/bin/python scripts/slurm-capture.py            # -> tests/data/slurm/<version>/

It submits six jobs (one of each shape the parsers must read), waits for the states
listed below, and writes each command's stdout (and, for the error cases, stderr and
exit code) to a file named after the command. `jobs.json` maps each role to its job id
(ids depend on what the cluster ran before). Everything it submitted is cancelled at
the end. Roles:
  gpu    "gpu job" --gres=gpu:1, running (a name with a space)
  fail   exit 3 at once (FAILED, ExitCode 3:0)
  multi  -N 2 --gres=gpu:2, two srun steps member-a (ok) and member-b (exit 2), running
  mps    --gres=mps:50, running
  shard  --gres=shard:2, running
  big    -N 2 --gres=gpu:4, pending on Resources
then: gpu and big cancelled, multi requeued (squeue_after.json, scontrol_show_job_*_after.txt).
Best run right after `cluster up` on a fresh state folder: `squeue --states=all` also
lists every job that ended less than MinJobAge (300 s) ago, e.g. a whole test run's.

    .venv/bin/python scripts/slurm-capture.py --sharing   # any local cluster, no accounting needed

records only how `scontrol show job -o` shows node sharing (26.05 moved it from
OverSubscribe= to a new Exclusive= field): one job of each of SHARING_JOBS, each saved as
scontrol_show_job_<role>.txt, then cancelled.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slurm_dlrm.localcluster import LocalCluster  # noqa: E402
from slurm_dlrm.slurm import parse  # noqa: E402
from slurm_dlrm.slurm.client import DEFAULT_SACCT_FIELDS, NODES_ARGV, SQUEUE_ARGV, SlurmClient  # noqa: E402

JOBS = {
    "gpu": ("gpu job", ["--gres=gpu:1"], "sleep 300"),
    "fail": ("fail", [], "exit 3"),
    "multi": ("mn", ["-N", "2", "--gres=gpu:2"],
              "srun --overlap -N 2 -J member-a true\nsrun --overlap -N 1 -J member-b sh -c 'exit 2'\nsleep 300"),
    "mps": ("mps", ["--gres=mps:50"], "sleep 300"),
    "shard": ("shard", ["--gres=shard:2"], "sleep 300"),
    "big": ("big", ["-N", "2", "--gres=gpu:4"], "sleep 300"),
}

SHARING_JOBS = {
    "exclusive_user": ("excl user", ["--gres=mps:25", "--exclusive=user"]),
    "exclusive_node": ("excl node", ["--gres=gpu:1", "--exclusive"]),
}


def capture_sharing(client: SlurmClient, out: Path) -> int:
    ids = {}
    try:
        for role, (name, args) in SHARING_JOBS.items():
            proc = client.run(["sbatch", "--parsable", f"--job-name={name}", "--output=/dev/null", *args],
                              input_text="#!/bin/bash\nsleep 300\n")
            ids[role] = parse.parse_sbatch_parsable(proc.stdout)
        deadline = time.monotonic() + 60
        while any(client.show_job_raw(i).get("JobState") != "RUNNING" for i in ids.values()):
            if time.monotonic() > deadline:
                raise SystemExit("slurm-capture: error: the sharing jobs did not all start")
            time.sleep(0.5)
        for role, job_id in ids.items():
            (out / f"scontrol_show_job_{role}.txt").write_text(
                client.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout)
    finally:
        if ids:
            subprocess.run(["scancel", *map(str, ids.values())], env=client.child_env(), check=False)  # noqa: S603,S607
    print(f"slurm-capture: {out.name}: {len(ids)} sharing files in {out.relative_to(REPO)}")
    return 0


def main() -> int:
    sharing_only = sys.argv[1:] == ["--sharing"]
    cluster = LocalCluster.at()
    if cluster is None or not cluster.status(query_nodes=False).up:
        print("slurm-capture: error: no local cluster: run `slurm-dlrm cluster up --accounting`", file=sys.stderr)
        return 1
    if not cluster.config.accounting and not sharing_only:
        print("slurm-capture: error: the cluster runs without accounting (sacct): `cluster up --accounting`",
              file=sys.stderr)
        return 1
    client = SlurmClient(cluster.config.slurm_conf)
    version_text = client.run(["sinfo", "--version"]).stdout
    version = version_text.split()[-1]
    out = REPO / "tests" / "data" / "slurm" / version
    out.mkdir(parents=True, exist_ok=True)
    if sharing_only:
        return capture_sharing(client, out)

    def save(name: str, argv: list[str], *, check: bool = True) -> str:
        proc = client.run(argv, check=check)
        text = proc.stdout if check else json.dumps(
            {"argv": argv, "returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}, indent=1) + "\n"
        (out / name).write_text(text)
        return proc.stdout

    (out / "sinfo_version.txt").write_text(version_text)
    ids: dict[str, int] = {}
    try:
        for role, (name, args, body) in JOBS.items():
            script = f"#!/bin/bash\n{body}\n"
            proc = client.run(["sbatch", "--parsable", f"--job-name={name}", "--output=/dev/null", *args],
                              input_text=script)
            if role == "gpu":
                (out / "sbatch_parsable.txt").write_text(proc.stdout)
            ids[role] = parse.parse_sbatch_parsable(proc.stdout)
        (out / "jobs.json").write_text(json.dumps(ids, indent=1) + "\n")
        want = {"gpu": "RUNNING", "fail": "FAILED", "multi": "RUNNING", "mps": "RUNNING", "shard": "RUNNING",
                "big": "PENDING"}
        deadline = time.monotonic() + 60
        while True:
            states = {r: (client.show_job_raw(i).get("JobState"), client.show_job_raw(i).get("Reason"))
                      for r, i in ids.items()}
            steps = client.sacct([ids["multi"]], ["JobID", "JobName", "State"])
            if all(states[r][0] == s for r, s in want.items()) and states["big"][1] == "Resources" and \
                    sum(1 for s in steps if s.get("JobName") in ("member-a", "member-b")
                        and s.state.is_terminal) == 2:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"slurm-capture: error: jobs not in the wanted states: {states}")
            time.sleep(0.5)
        time.sleep(1)
        save("squeue.json", [*SQUEUE_ARGV])
        for role, job_id in ids.items():
            save(f"scontrol_show_job_{role}.txt", ["scontrol", "show", "job", "-o", str(job_id)])
        save("scontrol_show_job_unknown.txt", ["scontrol", "show", "job", "-o", "999999"], check=False)
        save("scontrol_show_node.txt", [*NODES_ARGV])
        save("sinfo_format.txt", ["sinfo", "--noheader", "--format", parse.SINFO_FORMAT])
        save("scontrol_show_config.txt", ["scontrol", "show", "config"])
        save("scontrol_ping.txt", ["scontrol", "ping"])
        node2 = cluster.config.node_names[-1]
        client.run(["scontrol", "update", f"NodeName={node2}", "State=DRAIN", "Reason=capture test"])
        try:
            save("scontrol_show_node_drain.txt", [*NODES_ARGV])
            save("sinfo_format_drain.txt", ["sinfo", "--noheader", "--format", parse.SINFO_FORMAT])
        finally:
            client.run(["scontrol", "update", f"NodeName={node2}", "State=RESUME"])
        save("scontrol_requeue_pending.txt", ["scontrol", "requeue", str(ids["big"])], check=False)
        client.scancel([ids["gpu"], ids["big"]])
        client.requeue(ids["multi"])
        deadline = time.monotonic() + 30
        while client.show_job_raw(ids["gpu"]).get("JobState") != "CANCELLED" or \
                client.show_job_raw(ids["multi"]).get("JobState") != "PENDING":
            if time.monotonic() > deadline:
                raise SystemExit("slurm-capture: error: cancel/requeue did not show")
            time.sleep(0.5)
        save("squeue_after.json", [*SQUEUE_ARGV])
        for role in ("gpu", "multi", "big"):
            save(f"scontrol_show_job_{role}_after.txt", ["scontrol", "show", "job", "-o", str(ids[role])])
        save("scancel_unknown.txt", ["scancel", "999999"], check=False)
        # slurmctld reports to slurmdbd asynchronously: wait until every job line names its job.
        deadline = time.monotonic() + 30
        while {r.job_id: r.get("JobName") for r in client.sacct(list(ids.values())) if r.step is None} != \
                {str(i): JOBS[role][0] for role, i in ids.items()} and time.monotonic() < deadline:
            time.sleep(1)
        fields = ",".join(DEFAULT_SACCT_FIELDS)
        save("sacct_parsable2.txt", ["sacct", "--parsable2", "--noheader", "--duplicates", "--jobs",
                                     ",".join(str(i) for i in ids.values()), "--format", fields])
        c = cluster.config
        for what, argv in (("cluster", ["sacctmgr", "-i", "add", "cluster", c.cluster_name]),
                           ("account", ["sacctmgr", "-i", "add", "account", "dlrm", f"Cluster={c.cluster_name}",
                                        "Description=slurm-dlrm", "Organization=local"]),
                           ("user", ["sacctmgr", "-i", "add", "user", "root", "Account=dlrm",
                                     f"Cluster={c.cluster_name}"])):
            save(f"sacctmgr_add_{what}_again.txt", argv, check=False)
    finally:
        if ids:
            subprocess.run(["scancel", *map(str, ids.values())], env=client.child_env(), check=False)  # noqa: S603,S607
    print(f"slurm-capture: {version}: {len(list(out.iterdir()))} files in {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
