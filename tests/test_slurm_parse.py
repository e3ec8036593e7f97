"""Parsers and the state table, on real output recorded from the local cluster."""

import json
import logging
from pathlib import Path

import pytest

from slurm_dlrm.slurm import parse
from slurm_dlrm.slurm.states import JobState, to_job_state

DATA = Path(__file__).parent / "data" / "slurm"


def read(name: str) -> str:
    return (DATA / name).read_text()


def test_sbatch_parsable_plain_and_with_cluster():
    assert parse.parse_sbatch_parsable("42\n") == 42
    assert parse.parse_sbatch_parsable("1234;cluster-a\n") == 1234
    # sbatch may print warnings on stdout before the id line
    assert parse.parse_sbatch_parsable("sbatch: warning: x\n77\n") == 77
    with pytest.raises(parse.ParseError):
        parse.parse_sbatch_parsable("Submitted batch job 5\n")
    with pytest.raises(parse.ParseError):
        parse.parse_sbatch_parsable("")


def test_squeue_json_states_exit_codes_and_resources():
    jobs = {j.job_id: j for j in parse.parse_squeue_json(read("squeue_mixed.json"))}
    assert sorted(jobs) == [1, 2, 3, 4, 5, 6]
    gpu = jobs[1]
    assert (gpu.name, gpu.state, gpu.user, gpu.nodes, gpu.num_nodes) == ("gpu job", JobState.RUNNING, "root", "node1", 1)
    assert gpu.end_time is None  # squeue puts the time-limit end here for running jobs
    assert gpu.start_time is not None and gpu.submit_time is not None
    failed = jobs[2]
    assert failed.state is JobState.FAILED
    assert (failed.exit_code, failed.signal, failed.reason) == (3, None, "NonZeroExitCode")  # wait status 768
    multi = jobs[3]
    assert (multi.nodes, multi.num_nodes) == ("node[1-2]", 2)
    pending = jobs[6]
    assert (pending.state, pending.nodes, pending.reason, pending.start_time) == (JobState.PENDING, "", "Resources", None)


def test_squeue_json_after_cancel_and_requeue():
    jobs = {j.job_id: j for j in parse.parse_squeue_json(read("squeue_after_cancel.json"))}
    assert jobs[1].state is JobState.CANCELLED and jobs[1].signal == 15 and jobs[1].exit_code is None
    assert jobs[6].state is JobState.CANCELLED
    requeued = jobs[3]
    assert (requeued.state, requeued.restart_count, requeued.reason) == (JobState.PENDING, 1, "BeginTime")
    assert all(jobs[i].state is JobState.RUNNING for i in (4, 5))


def test_squeue_json_rejects_garbage():
    with pytest.raises(parse.ParseError):
        parse.parse_squeue_json("squeue: error: Invalid user")
    with pytest.raises(parse.ParseError):
        parse.parse_squeue_json(json.dumps({"errors": []}))


@pytest.mark.parametrize(("name", "job_id", "state", "nodes", "exit_code"), [
    ("scontrol_show_job_running.txt", 1, JobState.RUNNING, "node1", 0),
    ("scontrol_show_job_pending.txt", 6, JobState.PENDING, "", 0),
    ("scontrol_show_job_multinode.txt", 3, JobState.RUNNING, "node[1-2]", 0),
    ("scontrol_show_job_failed.txt", 2, JobState.FAILED, "node1", 3),
    ("scontrol_show_job_cancelled.txt", 1, JobState.CANCELLED, "node1", None),
])
def test_scontrol_show_job(name, job_id, state, nodes, exit_code):
    recs = parse.parse_scontrol_oneliner(read(name))
    assert len(recs) == 1
    job = parse.job_from_scontrol(recs[0])
    assert (job.job_id, job.state, job.nodes, job.exit_code) == (job_id, state, nodes, exit_code)
    assert job.user == "root" and job.partition == "dlrm"


def test_scontrol_values_with_spaces_and_slashes_stay_whole():
    rec = parse.parse_scontrol_oneliner(read("scontrol_show_job_running.txt"))[0]
    assert rec["JobName"] == "gpu job"
    assert rec["CPUs/Task"] == "1"
    assert rec["ReqB:S:C:T"] == "0:0:*:*"
    assert rec["TRES"].startswith("cpu=1,mem=2000M")
    assert rec["TresPerNode"] == "gres:gpu:1"
    cancelled = parse.job_from_scontrol(parse.parse_scontrol_oneliner(read("scontrol_show_job_cancelled.txt"))[0])
    assert cancelled.signal == 15  # ExitCode=0:15


def test_parse_error_is_one_line_for_the_cli():
    from slurm_dlrm.errors import EXIT_RUNTIME, DlrmError

    assert issubclass(parse.ParseError, DlrmError) and parse.ParseError("x").exit_code == EXIT_RUNTIME


@pytest.mark.parametrize("value", [
    "x", {"set": True}, {"set": True, "infinite": False, "number": "7"}, [1], True])
def test_squeue_json_unknown_number_shapes_are_refused(value):
    job = {"job_id": 1, "job_state": "RUNNING", "node_count": value}
    with pytest.raises(parse.ParseError, match="node_count"):
        parse.job_from_json(job)


def test_squeue_json_number_objects_not_set_or_infinite_are_none():
    job = parse.job_from_json({"job_id": 1, "job_state": ["PENDING"],
                               "start_time": {"set": False, "infinite": False, "number": 0},
                               "end_time": {"set": True, "infinite": True, "number": 0},
                               "exit_code": {"status": ["PENDING"], "return_code": {"set": False, "infinite": False,
                                                                                     "number": 0}}})
    assert (job.start_time, job.end_time, job.exit_code, job.signal) == (None, None, None, None)
    with pytest.raises(parse.ParseError, match="exit_code"):
        parse.job_from_json({"job_id": 1, "job_state": "FAILED", "exit_code": {"status": ["NEWTHING"]}})
    with pytest.raises(parse.ParseError, match="job_state"):
        parse.job_from_json({"job_id": 1, "job_state": {"current": ["RUNNING"]}})


@pytest.mark.parametrize(("raw", "state", "flags"), [
    ("IDLE", "idle", ()), ("MIXED+DRAIN", "mixed", ("DRAIN",)), ("IDLE*", "idle", ("NOT_RESPONDING",)),
    ("DOWN+NOT_RESPONDING", "down", ("NOT_RESPONDING",)), ("IDLE+DRAIN+DYNAMIC_NORM", "idle", ("DRAIN", "DYNAMIC_NORM")),
])
def test_node_states(raw, state, flags):
    node = parse.node_from_scontrol({"NodeName": "n1", "State": raw})
    assert (node.state, node.flags) == (state, flags)


def test_unknown_node_state_is_refused():
    with pytest.raises(parse.ParseError, match="unknown State"):
        parse.node_from_scontrol({"NodeName": "n1", "State": "SLEEPY"})


def test_sinfo_rows():
    rows = parse.parse_sinfo(read("sinfo_format.txt"))
    assert [(r.partition, r.state, r.nodes, r.default) for r in rows] == [
        ("dlrm", "drained", "node2", True), ("dlrm", "mixed", "node1", True)]
    assert rows[0].gres == "gpu:h100:4,mps:h100:400,shard:h100:32"
    assert rows[0].memory_mib == 256000 and rows[0].cpus == 32
    with pytest.raises(parse.ParseError):
        parse.parse_sinfo("dlrm|up|idle\n")


SACCT_FIELDS = ["JobID", "JobName", "State", "ExitCode", "Start", "End", "Elapsed", "NodeList", "AllocTRES"]


def test_sacct_jobs_and_steps():
    rows = parse.parse_sacct_parsable2(read("sacct_parsable2.txt"), SACCT_FIELDS)
    by_id = {r.job_id: r for r in rows}
    assert [r.job_id for r in rows if r.base_job_id == 3] == ["3", "3.batch", "3.0", "3.1"]
    assert by_id["3"].step is None and by_id["3.0"].step == "0"
    assert by_id["3.0"]["JobName"] == "member-a" and by_id["3.0"].state is JobState.COMPLETED
    assert by_id["3.1"].state is JobState.FAILED
    assert parse.parse_sacct_exit_code(by_id["3.1"]["ExitCode"]) == (2, None)
    assert "gres/gpu=4" in by_id["3"]["AllocTRES"]
    assert by_id["5"].state is JobState.CANCELLED  # "CANCELLED by 0"
    assert parse.parse_sacct_exit_code(by_id["5.batch"]["ExitCode"]) == (None, 15)


def test_sacct_pipe_in_job_name_is_folded():
    line = "9|a|b|COMPLETED|0:0|x|y|00:00:01|node1|cpu=1\n"
    (row,) = parse.parse_sacct_parsable2(line, SACCT_FIELDS)
    assert row["JobName"] == "a|b" and row["State"] == "COMPLETED"
    with pytest.raises(parse.ParseError):
        parse.parse_sacct_parsable2("9|x\n", SACCT_FIELDS)


@pytest.mark.parametrize(("raw", "ours"), [
    ("RUNNING", JobState.RUNNING), ("R", JobState.RUNNING), ("PD", JobState.PENDING),
    ("CANCELLED by 1000", JobState.CANCELLED), ("OUT_OF_MEMORY", JobState.OUT_OF_MEMORY),
    ("OOM", JobState.OUT_OF_MEMORY), ("NODE_FAIL", JobState.NODE_FAIL), ("TO", JobState.TIMEOUT),
    ("PREEMPTED", JobState.PREEMPTED), ("CG", JobState.COMPLETING), ("REQUEUED", JobState.REQUEUED),
    (["RUNNING", "COMPLETING"], JobState.COMPLETING), (["PENDING"], JobState.PENDING),
    ("completed", JobState.COMPLETED),
])
def test_state_table(raw, ours):
    assert to_job_state(raw) is ours


def test_unknown_state_warns_and_is_unknown(caplog):
    with caplog.at_level(logging.WARNING):
        assert to_job_state("WEIRD_NEW_STATE") is JobState.UNKNOWN
    assert "WEIRD_NEW_STATE" in caplog.text
    assert to_job_state(None) is JobState.UNKNOWN and to_job_state([]) is JobState.UNKNOWN


def test_terminal_and_active_sets_are_disjoint():
    for s in JobState:
        assert not (s.is_terminal and s.is_active), s
    assert JobState.COMPLETED.is_terminal and JobState.PENDING.is_active


@pytest.mark.parametrize(("names", "hostlist"), [
    (["node1"], "node1"), (["node1", "node2"], "node[1-2]"), (["node2", "node1", "node4"], "node[1-2,4]"),
    (["gpu01", "gpu02", "gpu10"], "gpu[01-02,10]"), (["login", "node3"], "login,node3"),
    (["a1b", "a2b"], "a[1-2]b"),
])
def test_compress_hostlist_is_the_inverse_of_expand(names, hostlist):
    from slurm_dlrm.site import expand_hostlist

    assert parse.compress_hostlist(names) == hostlist
    assert sorted(expand_hostlist(hostlist)) == sorted(names)


@pytest.mark.parametrize("release", ["22.05.8", "24.11.5", "26.05.5"])
def test_squeue_json_gres_detail_gives_the_nodes_gpu_index(release):
    """The node's GPU index of a running job (queue's GPU for a --no-pack job): 22.05
    prints `mps:50(IDX:0)`, 24.11+ prints a shared GRES per GPU `mps:50(50/100,0/100,..)`."""
    jobs = sorted(parse.parse_squeue_json(read(f"{release}/squeue.json")), key=lambda j: j.job_id)
    by_kind = {j.gres_detail.split("(")[0].split(":")[0]: j for j in jobs if j.gres_detail}
    idx = {kind: (j.gpu_idx, j.num_nodes) for kind, j in by_kind.items()}
    assert idx["mps"] == ("0", 1) and idx["shard"] == ("3", 1)
    two_nodes = [j for j in jobs if j.num_nodes == 2 and j.gres_detail]
    assert [j.gpu_idx for j in two_nodes] == ["1-2"]  # its first node's GPUs
    assert all(j.gpu_idx == "" for j in jobs if not j.state.is_active)
