"""Issue 42 items 10-12 (+ issue 43 item 12): the squeue/sacct/scancel/sbatch options a
Slurm user reaches for, on our commands."""

from __future__ import annotations

import json
import os

from test_cli_habits import Path_examples, _me, env, run  # noqa: F401 - env is a fixture


def _submit(*args: str) -> str:
    r = run("submit", "--no-service", "--parsable", *args)
    assert r.exit_code == 0, r.output
    return r.stdout.strip()


def test_queue_takes_squeues_forms(env):  # noqa: F811
    ex = Path_examples()
    a = _submit(str(ex / "tiny-a.yaml"))
    arr = _submit("--array", "0-1", "-t", "5", str(ex / "tiny-b.yaml"))
    run("cancel", a)
    # -h is squeue's --noheader here (scripts: squeue -h -o %i); %i prints an array task as N_M
    r = run("queue", "-h", "-o", "%i", "--no-slurm")
    assert (r.exit_code, r.stdout) == (0, f"{arr}_0\n{arr}_1\n")
    r = run("queue", "-t", "all", "-h", "-o", "%i %t %T", "--no-slurm")  # issue 43 item 12: was refused
    assert r.stdout.splitlines() == [f"{a} CA CANCELLED", f"{arr}_0 PD PENDING", f"{arr}_1 PD PENDING"]
    assert run("queue", "--states=ALL", "-h", "-o", "%i", "--no-slurm").stdout.split() == [a, f"{arr}_0", f"{arr}_1"]
    r = run("queue", "-t", "CG,S", "--no-slurm")  # Slurm states no job here is ever in: nothing, as squeue
    assert r.exit_code == 0 and r.stdout == "JOBID  NAME  STATE  PACK  SLURMID  NODE  GPU  MPS%  GPU_MiB  TRY  AUC  REASON\n"
    assert run("queue", "-t", "nope").exit_code == 2
    # --sort=-i: by the array's id (squeue's i), so its tasks keep their order
    r = run("queue", "-o", "%.6i|%P|%.10l|%j", "--sort=-i", "-t", "all", "--no-slurm")
    assert r.stdout.splitlines() == [" JOBID|PARTITION|TIME_LIMIT|NAME", f"   {arr}_0|dlrm|      5:00|tiny-b-0",
                                     f"   {arr}_1|dlrm|      5:00|tiny-b-1", f"     {a}|dlrm|     30:00|tiny-a"]
    head = run("queue", "-l", "--no-slurm").stdout.splitlines()[0].split()
    assert head[:6] == ["JOBID", "PARTITION", "NAME", "STATE", "TIME", "TIME_LIMIT"]
    assert run("queue", "-p", "other", "-h", "--no-slurm").stdout == ""
    r = run("queue", "-o", "%Z")
    assert r.exit_code == 2 and r.output.startswith("slurm-dlrm: error: -o/--format: %Z: not a field")
    assert "queue [OPTIONS]" in run("queue", "--help").output


def test_acct_scancel_and_sbatch_options(env):  # noqa: F811
    ex = Path_examples()
    a = _submit("-A", "proj", "-J", "one", str(ex / "tiny-a.yaml"))
    b = _submit(str(ex / "tiny-b.yaml"))
    r = run("acct", "-o", "JobID,JobName,Partition,Account", "-P", "-n", "--name", "one")
    assert r.stdout == f"{a}|one|dlrm|proj\n"
    r = run("acct", "-b", "-P")
    assert r.stdout.splitlines() == ["JobID|State|ExitCode", f"{a}|PENDING|0:0", f"{b}|PENDING|0:0"]  # as sacct
    r = run("cancel", "--signal=USR1", a)
    assert r.exit_code == 2 and "scancel --signal=SIG the SLURMID" in r.output
    r = run("cancel", "-u", os.environ.get("USER") or _me())  # scancel -u me: all my active jobs
    assert r.exit_code == 0 and r.output.count("cancelled (was pending)") == 2
    assert run("acct", "-s", "CA", "-n", "-P", "-o", "JobID").stdout.split() == [a, b]
    r = run("submit", "--no-service", "--export=NONE", str(ex / "tiny-a.yaml"))
    assert r.exit_code == 2 and "--export=NONE: a member runs with its pack's environment" in r.output
    # a bare --nice before the spec (it was taken as --nice's value), and --nice=-5 (it was an option -5)
    c = _submit("--nice", str(ex / "tiny-a.yaml"))
    assert json.loads(run("show", c, "--json").output)["options"]["nice"] == 100
    r = run("submit", "--no-service", "--parsable", "--nice=-5", str(ex / "tiny-a.yaml"))
    assert (r.exit_code == 0) == (os.geteuid() == 0), r.output
    (env / "sub").mkdir()
    d = _submit("-D", str(env / "sub"), "-o", "out-%j.txt", str(ex / "tiny-a.yaml"))
    assert json.loads(run("show", d, "--json").output)["options"]["output"] == f"{env}/sub/out-%j.txt"


def test_singleton_waits_for_the_earlier_job_of_its_name(tmp_path):
    from slurm_dlrm.service.depend import ready_jobs
    from slurm_dlrm.store import Store
    from slurm_dlrm.store.states import JobState

    with Store(tmp_path / "s" / "store.sqlite") as s:
        first = s.add_job(user="u", name="n", spec={}, spec_fingerprint="f")
        second = s.add_job(user="u", name="n", spec={}, spec_fingerprint="f", sbatch={"dependency": "singleton"})
        other = s.add_job(user="u", name="m", spec={}, spec_fingerprint="f", sbatch={"dependency": "singleton"})
        ready, never = ready_jobs(s, s.jobs([JobState.PENDING]))
        assert [j.id for j in ready] == [first, other] and never == []
        s.transition_job(first, JobState.CANCELLED, "cancelled")
        assert [j.id for j in ready_jobs(s, s.jobs([JobState.PENDING]))[0]] == [second, other]


def test_completion_offers_active_jobs_to_cancel_ended_ones_to_requeue_states_and_columns(env):  # noqa: F811
    from types import SimpleNamespace

    from slurm_dlrm.commands.queue import (
        complete_active_ids,
        complete_requeuable_ids,
        complete_states,
    )
    from slurm_dlrm.commands.store import _complete_acct_columns

    ex = Path_examples()
    a, b = _submit(str(ex / "tiny-a.yaml")), _submit(str(ex / "tiny-b.yaml"))
    run("cancel", a)
    ctx = SimpleNamespace(params={})
    assert [c.value for c in complete_active_ids(ctx, None, "")] == [b]  # before: every job, ended ones too
    assert [c.value for c in complete_requeuable_ids(ctx, None, "")] == [a]
    assert complete_states(ctx, None, "PD,C") == ["PD,CD", "PD,CA"]
    assert complete_states(ctx, None, "a") == ["all"]
    assert _complete_acct_columns(ctx, None, "JobID,JobN") == ["JobID,JobName"]
