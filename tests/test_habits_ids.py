"""Issue 42: job ids as Slurm reads them (`2_0` is task 0 of array 2, never job 20), arrays
submitted as one id, `--no-pack --parsable` as sbatch prints it, `cancel && requeue`."""

from __future__ import annotations

import json

import pytest
from test_cli_habits import Path_examples, env, run  # noqa: F401 - env is a fixture

from slurm_dlrm.errors import BadInput
from slurm_dlrm.store.jobids import JobRef, parse_job_ref, parse_job_refs


def test_the_parser_reads_slurms_forms_and_refuses_the_rest():
    assert parse_job_ref("20") == JobRef(20, None, "20")
    assert parse_job_ref("2_0") == JobRef(2, (0,), "2_0")
    assert parse_job_ref("2_[1-3,7]").tasks == (1, 2, 3, 7)
    assert [str(r) for r in parse_job_refs(["1,2_[0,1]", "3", "1"])] == ["1", "2_[0,1]", "3"]
    for bad in ("2__0", "2_", "_2", "abc", "2.0", "-1", "2_x", "1e3", "٣"):
        with pytest.raises(BadInput, match="expected N, N_M"):
            parse_job_ref(bad)


def _state(job_id: int) -> str:
    return str(json.loads(run("show", str(job_id), "--json").output)["state"])


def test_array_task_ids_name_the_task_in_every_command(env):  # noqa: F811
    ex = Path_examples()
    r = run("submit", "--no-service", "--parsable", "--array", "0-1", str(ex / "tiny-a.yaml"))
    assert (r.exit_code, r.output) == (0, "1\n")  # sbatch --parsable: the array's id, once
    r = run("submit", "--no-service", "--parsable", "--array", "0-9", str(ex / "tiny-b.yaml"))
    assert r.output == "3\n"  # jobs 3..12: array 3, tasks 0..9
    # before: Python's int("1_1") is 11, so `cancel 1_1` cancelled job 11 (task 8 of array 3)
    r = run("cancel", "1_1")
    assert (r.exit_code, r.output) == (0, "job 2 cancelled (was pending)\n")
    assert _state(11) == "PENDING" and _state(2) == "CANCELLED"
    assert json.loads(run("show", "3_5", "--json").output)["job_id"] == 8
    r = run("queue", "-j", "1_0,3_[2-3]", "-o", "JOBID", "--noheader", "--no-slurm")
    assert r.stdout.split() == ["1", "5", "6"]
    r = run("acct", "-j", "3_0,1_8", "-o", "JobID", "-P", "-n")  # 1_8: no such task, as sacct: nothing
    assert (r.exit_code, r.stdout.split()) == (0, ["3"])
    r = run("show", "1_8")
    assert (r.exit_code, r.output) == (2, "slurm-dlrm: error: job 1_8: no such job in your store\n")
    r = run("cancel", "2__0")
    assert r.exit_code == 2 and r.output.startswith("slurm-dlrm: error: job id '2__0': expected N, N_M")
    r = run("log", "3_9")
    assert r.exit_code == 0 and "job 12 (PENDING) has no output yet" in r.output
    # the array's id names all its tasks, as scancel N does
    r = run("cancel", "3")
    assert r.exit_code == 0 and r.output.count("cancelled (was pending)") == 10
    r = run("requeue", "3_[0-1]", "--no-service")
    assert r.exit_code == 0 and r.output.splitlines()[0].startswith("job 3 requeued")
    assert (_state(3), _state(4), _state(5)) == ("PENDING", "PENDING", "CANCELLED")


def test_an_array_is_one_dependency_and_minus_j_names_each_variant(env):  # noqa: F811
    from slurm_dlrm.service.depend import array_state

    ex = Path_examples()
    r = run("submit", "--no-service", "--parsable", "--array", "0-2", "-J", "sweep", str(ex / "tiny-a.yaml"))
    jid = r.output.strip()
    r = run("submit", "--no-service", "--parsable", "-d", f"afterok:{jid}", str(ex / "tiny-b.yaml"))
    assert (r.exit_code, r.output) == (0, "4\n")
    names = [row["name"] for row in json.loads(run("queue", "--json", "--no-slurm").output)["jobs"]]
    assert names[:3] == ["sweep-0", "sweep-1", "sweep-2"]  # before: three jobs named `sweep`
    assert array_state(["COMPLETED", "RUNNING"]) == "RUNNING"
    assert array_state(["COMPLETED", "TIMEOUT", "FAILED"]) == "TIMEOUT"
    assert array_state(["COMPLETED", "COMPLETED"]) == "COMPLETED"


def test_a_pack_slurm_id_given_to_cancel_points_to_pack(env):  # noqa: F811
    from slurm_dlrm.site import load_site
    from slurm_dlrm.store.store import Store, current_user

    ex = Path_examples()
    run("submit", "--no-service", str(ex / "tiny-a.yaml"))
    site, user = load_site(None), current_user()
    with Store.for_user(site, user) as s:
        pid = s.add_pack(name="dlrm-abc", user=user, policy="exclusive", n_gpus=1)
        s.conn.execute("UPDATE packs SET slurm_job_id = '91' WHERE id = ?", (pid,))
        s.conn.commit()
    r = run("cancel", "91")  # scancel's exit status for an id it does not know: 0, with the error line
    assert r.exit_code == 0 and "91 is the Slurm job of your pack dlrm-abc: slurm-dlrm cancel --pack dlrm-abc" \
        in r.stderr, r.output


def test_requeue_waits_for_a_cancel_still_landing(env, monkeypatch):  # noqa: F811
    # issue 42 item 3: the help's own `cancel 39 && requeue 39` failed ("is RUNNING"): the
    # member checkpoints for seconds before its agent reports it CANCELLED
    import threading
    import time

    from slurm_dlrm.service.cancel import cancel_job
    from slurm_dlrm.site import load_site
    from slurm_dlrm.store.states import JobState
    from slurm_dlrm.store.store import Store, current_user

    monkeypatch.setattr("slurm_dlrm.service.daemon.wake", lambda paths: None)
    (jid,) = [int(x) for x in run("submit", "--no-service", "--parsable", str(Path_examples() / "tiny-a.yaml"))
              .stdout.split()]
    site, user = load_site(None), current_user()
    with Store.for_user(site, user) as s:
        from slurm_dlrm.store import NewPlacement

        s.add_pack(name="dlrm-w", user=user, policy="exclusive", n_gpus=1, pack_dir=str(env / "pack"),
                   placements=[NewPlacement(jid, 0, 0)])
        s.transition_job(jid, JobState.RUNNING, "started")
        assert "cancel sent" in cancel_job(s, None, jid, user=user)

    def agent_reports_later() -> None:
        time.sleep(1.0)
        with Store.for_user(site, user) as s2:
            s2.transition_job(jid, JobState.CANCELLED, "cancelled; stopped with a checkpoint")

    t = threading.Thread(target=agent_reports_later)
    t.start()
    r = run("requeue", str(jid), "--no-service")
    t.join()
    assert r.exit_code == 0 and f"job {jid} requeued" in r.stdout, r.output
    assert "waiting for the cancel of job(s)" in r.stderr
    assert _state(jid) == "PENDING"
    out = run("show", str(jid)).stdout  # its pack never got a Slurm id: "-", not "Slurm None" (item 10)
    assert "Slurm None" not in out and "Slurm -)" in out, out
