"""The seam's parsers on real output of every supported Slurm release.

Each folder tests/data/slurm/<version>/ was recorded by `scripts/slurm-capture.py` on a
live local cluster of that release (22.05.8 on Debian 12, 24.11.5 on Debian 13, 26.05.5
on sid); jobs.json maps the roles (gpu, fail, multi, mps, shard, big) to job ids. The
same assertions run on every release: what differs between releases is the parsers' job.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from slurm_dlrm.admin.check import parse_scontrol_config
from slurm_dlrm.localcluster.accounting import sacctmgr_already_there
from slurm_dlrm.slurm import JobState, SlurmClient, parse
from slurm_dlrm.slurm.client import DEFAULT_SACCT_FIELDS, NODES_ARGV, SQUEUE_ARGV

DATA = Path(__file__).parent / "data" / "slurm"
RELEASES = sorted((d for d in DATA.iterdir() if (d / "jobs.json").is_file()),
                  key=lambda d: tuple(int(x) for x in d.name.split(".")))


def test_every_supported_release_is_recorded():
    assert {d.name.rsplit(".", 1)[0] for d in RELEASES} >= {"22.05"}
    # The other two come from the trixie (24.11) and sid (26.05) roots of scripts/slurm-matrix.sh.
    assert len(RELEASES) >= 1


@pytest.fixture(params=RELEASES, ids=[d.name for d in RELEASES])
def rec(request):
    return Recorded(request.param)


class Recorded:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.version = tuple(int(x) for x in folder.name.split("."))
        self.ids: dict[str, int] = json.loads((folder / "jobs.json").read_text())

    def text(self, name: str) -> str:
        return (self.folder / name).read_text()

    def call(self, name: str) -> dict:
        """A recorded command that may fail: argv, returncode, stdout, stderr."""
        return json.loads(self.text(name))

    def squeue(self, name: str = "squeue.json") -> dict[str, object]:
        jobs = {j.job_id: j for j in parse.parse_squeue_json(self.text(name))}
        return {role: jobs[i] for role, i in self.ids.items() if i in jobs}

    def scontrol_job(self, role: str, after: bool = False):
        recs = parse.parse_scontrol_oneliner(self.text(f"scontrol_show_job_{role}{'_after' if after else ''}.txt"))
        assert len(recs) == 1
        return recs[0], parse.job_from_scontrol(recs[0])


def test_version(rec):
    assert parse.parse_version(rec.text("sinfo_version.txt")) == rec.version
    assert rec.version[:2] >= parse.MIN_RELEASE


def test_sbatch_parsable(rec):
    assert parse.parse_sbatch_parsable(rec.text("sbatch_parsable.txt")) == rec.ids["gpu"]


def test_squeue_running_failed_and_pending(rec):
    jobs = rec.squeue()
    assert set(jobs) == set(rec.ids)
    gpu = jobs["gpu"]
    assert (gpu.name, gpu.state, gpu.user, gpu.partition, gpu.nodes, gpu.num_nodes) == \
        ("gpu job", JobState.RUNNING, "root", "dlrm", "node1", 1)
    assert gpu.submit_time and gpu.start_time and gpu.start_time >= gpu.submit_time
    assert gpu.end_time is None  # squeue puts the time-limit end here for running jobs
    assert "gres/gpu=1" in gpu.tres and (gpu.exit_code, gpu.signal) == (0, None)
    fail = jobs["fail"]
    assert (fail.state, fail.exit_code, fail.signal, fail.reason) == (JobState.FAILED, 3, None, "NonZeroExitCode")
    assert fail.end_time and fail.end_time >= fail.start_time
    multi = jobs["multi"]
    assert (multi.state, multi.nodes, multi.num_nodes, multi.restart_count) == (JobState.RUNNING, "node[1-2]", 2, 0)
    assert (jobs["mps"].state, jobs["shard"].state) == (JobState.RUNNING, JobState.RUNNING)
    big = jobs["big"]
    assert (big.state, big.nodes, big.reason, big.start_time, big.end_time) == \
        (JobState.PENDING, "", "Resources", None, None)
    assert all(j.array_job_id is None for j in jobs.values())


def test_squeue_after_cancel_and_requeue(rec):
    jobs = rec.squeue("squeue_after.json")
    # 23.02+ lists ended jobs only with --states=all (SQUEUE_ARGV asks for it).
    assert {"gpu", "big", "multi", "fail"} <= set(jobs)
    gpu = jobs["gpu"]
    assert gpu.state is JobState.CANCELLED and gpu.end_time
    assert (gpu.exit_code, gpu.signal) in ((None, 15), (0, None))  # 22.05: wait status 15
    assert jobs["big"].state is JobState.CANCELLED
    multi = jobs["multi"]
    assert (multi.state, multi.restart_count, multi.reason) == (JobState.PENDING, 1, "BeginTime")
    assert jobs["fail"].state is JobState.FAILED


@pytest.mark.parametrize(("role", "state", "nodes", "exit_code"), [
    ("gpu", JobState.RUNNING, "node1", 0), ("fail", JobState.FAILED, "node1", 3),
    ("multi", JobState.RUNNING, "node[1-2]", 0), ("mps", JobState.RUNNING, "node1", 0),
    ("shard", JobState.RUNNING, "node1", 0), ("big", JobState.PENDING, "", 0),
])
def test_scontrol_show_job(rec, role, state, nodes, exit_code):
    raw, job = rec.scontrol_job(role)
    assert (job.job_id, job.state, job.nodes, job.exit_code) == (rec.ids[role], state, nodes, exit_code)
    assert job.user == "root" and job.partition == "dlrm"
    assert job.submit_time is not None
    assert (job.start_time is None) == (state is JobState.PENDING)


def test_scontrol_values_with_spaces_stay_whole(rec):
    raw, job = rec.scontrol_job("gpu")
    assert raw["JobName"] == job.name == "gpu job"
    assert raw["CPUs/Task"] == "1"


def test_scontrol_tres_per_node_either_spelling(rec):
    # 22.05 prints TresPerNode=gres:mps:50, 24.11 and 26.05 gres/mps:50.
    assert parse.tres_items(rec.scontrol_job("mps")[0]["TresPerNode"]) == {"gres/mps": "50"}
    assert parse.tres_items(rec.scontrol_job("multi")[0]["TresPerNode"]) == {"gres/gpu": "2"}
    assert parse.tres_items(rec.scontrol_job("shard")[0]["TresPerNode"]) == {"gres/shard": "2"}
    # the GPUs acct charges a multi-node job: its TRES totals over its nodes (2 x gpu:2)
    assert parse.allocated_gpus(rec.scontrol_job("multi")[1].tres) == 4
    assert parse.allocated_gpus(rec.squeue()["gpu"].tres) == 1
    assert parse.allocated_gpus(rec.scontrol_job("mps")[1].tres) is None


def test_node_sharing_from_either_field(rec):
    # 22.05/24.11: OverSubscribe=NO|USER|OK; 26.05: Exclusive=NODE|USER|NO beside OverSubscribe=NO
    # (issue 28: a live test read OverSubscribe=NO on 26.05 for an --exclusive=user job).
    def sharing(name):
        return parse.job_node_sharing(parse.parse_scontrol_oneliner(rec.text(name))[0])

    assert sharing("scontrol_show_job_mps.txt") == "any"
    assert sharing("scontrol_show_job_exclusive_user.txt") == "user"
    assert sharing("scontrol_show_job_exclusive_node.txt") == "node"


def test_scontrol_show_job_after_cancel_and_requeue(rec):
    _, gpu = rec.scontrol_job("gpu", after=True)
    assert gpu.state is JobState.CANCELLED and gpu.end_time is not None
    _, multi = rec.scontrol_job("multi", after=True)
    assert (multi.state, multi.restart_count) == (JobState.PENDING, 1)


def test_nodes(rec):
    nodes = {n.name: n for n in parse.parse_scontrol_nodes(rec.text("scontrol_show_node.txt"))}
    assert sorted(nodes) == ["node1", "node2"]
    n1 = nodes["node1"]
    assert n1.state in ("mixed", "allocated") and n1.usable and not n1.flags
    assert (n1.cpus, n1.real_memory_mib, n1.address, n1.partitions) == (32, 256000, "127.0.0.1", ("dlrm",))
    assert n1.cpus_alloc > 0 and n1.port is not None
    assert n1.gres.startswith("gpu:h100:4") and "mps" in n1.gres and "shard" in n1.gres
    assert n1.gres_used.startswith("gpu:h100:")


def test_drained_node(rec):
    nodes = {n.name: n for n in parse.parse_scontrol_nodes(rec.text("scontrol_show_node_drain.txt"))}
    drained = nodes["node2"]
    assert "DRAIN" in drained.flags and not drained.usable
    assert drained.reason.startswith("capture test")
    assert nodes["node1"].usable


def test_sinfo_rows(rec):
    rows = parse.parse_sinfo(rec.text("sinfo_format.txt"))
    assert {r.partition for r in rows} == {"dlrm"} and all(r.default for r in rows)
    assert sum(r.num_nodes for r in rows) == 2
    assert all(r.cpus == 32 and r.memory_mib == 256000 and r.gres.startswith("gpu:h100:4") for r in rows)
    drain = parse.parse_sinfo(rec.text("sinfo_format_drain.txt"))
    assert any(r.state.startswith("drain") and r.nodes == "node2" for r in drain)


def test_sacct_jobs_and_steps(rec):
    rows = parse.parse_sacct_parsable2(rec.text("sacct_parsable2.txt"), DEFAULT_SACCT_FIELDS)
    jobs = {r.job_id: r for r in rows if r.step is None}
    ids = {role: str(i) for role, i in rec.ids.items()}
    assert set(jobs) == set(ids.values())
    assert jobs[ids["gpu"]]["JobName"] == "gpu job" and jobs[ids["gpu"]].state is JobState.CANCELLED
    assert jobs[ids["fail"]].state is JobState.FAILED
    assert parse.parse_sacct_exit_code(jobs[ids["fail"]]["ExitCode"]) == (3, None)
    steps = {r.get("JobName"): r for r in rows if r.base_job_id == rec.ids["multi"] and r.step}
    assert steps["member-a"].state is JobState.COMPLETED
    assert steps["member-b"].state is JobState.FAILED
    assert parse.parse_sacct_exit_code(steps["member-b"]["ExitCode"]) == (2, None)
    # --duplicates: the requeued job has a row for the run that ended (REQUEUED, with its
    # allocation) and, from 24.11, one for the pending rerun (listed last).
    runs = [r for r in rows if r.job_id == ids["multi"]]
    assert runs[0].state is JobState.REQUEUED and "gres/gpu=4" in runs[0]["AllocTRES"]
    assert all(r.state in (JobState.REQUEUED, JobState.PENDING) for r in runs)


def test_config_reads_the_keys_admin_check_compares(rec):
    config = parse_scontrol_config(rec.text("scontrol_show_config.txt"))
    assert config["SelectType"] == "select/cons_tres"
    assert set(config["GresTypes"].split(",")) == {"gpu", "mps", "shard"}
    assert config["SLURM_VERSION"] == rec.folder.name
    assert "gres/gpu" in config["AccountingStorageTRES"]


def test_sacctmgr_second_add_is_recognised(rec):
    for what in ("cluster", "account", "user"):
        call = rec.call(f"sacctmgr_add_{what}_again.txt")
        assert call["returncode"] != 0 or not call["stderr"]
        assert sacctmgr_already_there(call["stdout"] + call["stderr"]), call


# ---------------------------------------------------------------- SlurmClient on recorded output

def _replay(bin_dir: Path, name: str, stdout: str = "", stderr: str = "", rc: int = 0) -> None:
    """A stand-in command that prints recorded output and logs its argv."""
    (bin_dir / f"{name}.out").write_text(stdout)
    (bin_dir / f"{name}.err").write_text(stderr)
    path = bin_dir / name
    path.write_text(f'#!/bin/sh\nprintf "%s\\n" "$0 $*" >> "{bin_dir}/calls.log"\n'
                    f'cat "{bin_dir}/{name}.out"; cat "{bin_dir}/{name}.err" >&2; exit {rc}\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def client(rec, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _replay(bin_dir, "sinfo", rec.text("sinfo_version.txt"))
    return SlurmClient(bin_dir=bin_dir), bin_dir


def test_client_squeue_asks_all_states_and_filters(rec, client):
    cl, bin_dir = client
    _replay(bin_dir, "squeue", rec.text("squeue_after.json"))
    jobs = cl.squeue(job_ids=[rec.ids["gpu"], rec.ids["big"]])
    assert {j.job_id for j in jobs} == {rec.ids["gpu"], rec.ids["big"]}
    assert all(j.state is JobState.CANCELLED for j in jobs)
    call = (bin_dir / "calls.log").read_text().splitlines()
    assert call[0].endswith("sinfo --version")
    assert call[1].endswith(" ".join(SQUEUE_ARGV[1:]))
    assert cl.version() == rec.folder.name


def test_client_show_nodes_and_unknown_job(rec, client):
    cl, bin_dir = client
    _replay(bin_dir, "scontrol", rec.text("scontrol_show_node.txt"))
    assert [n.name for n in cl.show_nodes()] == ["node1", "node2"]
    assert (bin_dir / "calls.log").read_text().splitlines()[-1].endswith(" ".join(NODES_ARGV[1:]))
    unknown = rec.call("scontrol_show_job_unknown.txt")
    _replay(bin_dir, "scontrol", unknown["stdout"], unknown["stderr"], unknown["returncode"])
    assert cl.show_job(999999) is None


def test_client_scancel_of_unknown_job_is_quiet(rec, client):
    cl, bin_dir = client
    call = rec.call("scancel_unknown.txt")
    _replay(bin_dir, "scancel", call["stdout"], call["stderr"], call["returncode"])
    cl.scancel([999999])  # like FakeSlurm: no error for an id Slurm does not know


def test_client_requeue_of_pending_job_fails(rec, client):
    from slurm_dlrm.slurm import SlurmError

    cl, bin_dir = client
    call = rec.call("scontrol_requeue_pending.txt")
    _replay(bin_dir, "scontrol", call["stdout"], call["stderr"], call["returncode"])
    with pytest.raises(SlurmError, match="pending"):
        cl.requeue(rec.ids["big"])


def test_the_recorded_files_are_real_output():
    """Guard against hand edits: every release folder has the full set the capture writes."""
    names = {p.name for p in RELEASES[0].iterdir()}
    for folder in RELEASES:
        assert {p.name for p in folder.iterdir()} == names, folder.name
        assert os.path.getsize(folder / "squeue.json") > 1000


def test_fake_slurm_answers_like_every_release(rec):
    """FakeSlurm's refusals and no-ops are the ones each release really gives."""
    from slurm_dlrm.slurm import SlurmError
    from slurm_dlrm.slurm.fake import FakeSlurm

    fake = FakeSlurm()
    job_id = fake.sbatch("#!/bin/sh\n")
    with pytest.raises(SlurmError) as info:
        fake.requeue(job_id)
    real = rec.call("scontrol_requeue_pending.txt")
    assert real["returncode"] == info.value.returncode == 1
    assert info.value.stderr.strip().replace(str(job_id), "N") == \
        real["stderr"].strip().replace(str(rec.ids["big"]), "N")
    real = rec.call("scancel_unknown.txt")
    assert real["returncode"] == 0 and not real["stderr"]
    fake.scancel([999999])  # silent, like the real scancel


def test_client_ping(rec, client):
    cl, bin_dir = client
    _replay(bin_dir, "scontrol", rec.text("scontrol_ping.txt"))
    assert cl.ping() is True
