"""Multi-node jobs at submit (issue 48), against the stateful fake Slurm: the layout, the
sbatch lines and script, bad input (one line, exit 2, nothing recorded), and the rank
variables a runner takes from srun. The live side: tests/test_multinode_live.py."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner
from service_harness import make_site, write_site_file

from slurm_dlrm.cli import cli
from slurm_dlrm.errors import BadInput
from slurm_dlrm.service.sbatch_options import SbatchOptions

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "sweep"


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_DLRM_SITE", str(write_site_file(tmp_path)))
    monkeypatch.chdir(tmp_path)
    return make_site(tmp_path), tmp_path


def _spec(tmp: Path, name: str, extra: str) -> Path:
    p = tmp / f"{name}.yaml"
    p.write_text((EXAMPLES / "tiny-b.yaml").read_text().replace("name: tiny-b", f"name: {name}") + extra)
    return p


def _queue() -> list:
    return json.loads(CliRunner().invoke(cli, ["queue", "--json", "--no-slurm", "--all"]).output)["jobs"]


def test_a_job_past_a_node_is_one_slurm_job_over_whole_nodes_with_srun(env):
    fake = pytest.importorskip("slurm_dlrm.slurm.fake")
    from slurm_dlrm.service import submit as svc

    site, tmp = env
    spec = _spec(tmp, "mn-a", "nodes: 2\ngpus_per_node: 2\n")
    slurm = fake.FakeSlurm(user="root")
    (res,) = svc.submit_no_pack([str(spec)], SbatchOptions(job_name="it's; $(x)"), site=site, user="root",
                                cwd=str(tmp), slurm=slurm, python="/py", start_service=False)
    req = res.req
    assert (req.nodes, req.ranks_per_node, req.gres, req.exclusive) == (2, 2, "gpu:2", True)
    script = slurm.job(res.slurm_job_id).script
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --gres=gpu:2", "#SBATCH --exclusive",
                 "#SBATCH --no-requeue", f"#SBATCH --mem={req.mem_mib}M", f"#SBATCH --cpus-per-task={req.cpus}"):
        assert line in script.splitlines(), script
    assert "--ntasks=1" not in script
    assert "exec srun --kill-on-bad-exit=1 /py -m slurm_dlrm train " in script
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in script and "MASTER_PORT=$((" in script
    # the job name reaches the script quoted, in #SBATCH and comment lines only: never as shell text
    assert "#SBATCH --job-name=" + shlex.quote("it's; $(x)") in script.splitlines()
    assert not [ln for ln in script.splitlines() if "$(x)" in ln and not ln.startswith("#")]
    # each rank's host memory on its node: the per-node --mem holds 2 ranks' estimate
    assert req.mem_mib * (1 << 20) >= 2 * res.sub.estimate.host_peak_bytes
    (row,) = _queue()
    assert row["pack"] == "2-nodes" and row["state"] == "PLANNED", row
    # world_size above a node's 4 GPUs: 8 -> 2 nodes of 4 ranks
    wide = _spec(tmp, "mn-b", "world_size: 8\n")
    (res8,) = svc.submit_no_pack([str(wide)], SbatchOptions(), site=site, user="root", cwd=str(tmp), slurm=slurm,
                                 python="/py", start_service=False)
    assert (res8.req.nodes, res8.req.ranks_per_node, res8.req.gres) == (2, 4, "gpu:4")
    # W <= a node's GPUs: today's one-node request, untouched
    two = _spec(tmp, "two", "world_size: 2\n")
    (res2,) = svc.submit_no_pack([str(two)], SbatchOptions(), site=site, user="root", cwd=str(tmp), slurm=slurm,
                                 python="/py", start_service=False)
    assert (res2.req.nodes, res2.req.gres) == (1, "gpu:2") and "srun" not in slurm.job(res2.slurm_job_id).script


def test_test_only_shows_the_sbatch_lines_and_says_not_packed(env):
    site, tmp = env
    spec = _spec(tmp, "mn-c", "world_size: 8\n")
    r = CliRunner().invoke(cli, ["submit", "--test-only", str(spec)])
    assert r.exit_code == 0, r.output
    assert "--nodes=2" in r.output and "--ntasks-per-node=4" in r.output and "--gres=gpu:4" in r.output
    assert "not packed: 2 nodes x 4 ranks" in r.output
    assert _queue() == []


@pytest.mark.parametrize("extra,words", [
    ("world_size: 6\n", "not a multiple of the 4 GPUs per h100 node"),
    ("world_size: 16\n", "needs 4 nodes with 4 h100 GPUs each; partition dlrm has 2"),
    ("nodes: 2\ngpus_per_node: 8\n", "gpus_per_node 8: the largest h100 node"),
    ("nodes: 3\ngpus_per_node: 2\n", "needs 3 nodes"),
    ("nodes: 2\n", "give nodes and gpus_per_node together"),
    ("nodes: 2\ngpus_per_node: 2\nworld_size: 3\n", "nodes x gpus_per_node is 4"),
])
def test_bad_layouts_are_one_line_exit_2_nothing_recorded(env, extra, words):
    site, tmp = env
    spec = _spec(tmp, "mn-bad", extra)
    for args in (["submit", "--no-service", str(spec)], ["submit", "--no-pack", "--no-service", str(spec)],
                 ["submit", "--test-only", str(spec)]):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 2 and r.output.count("\n") == 1 and words in r.output, (args, r.output)
    assert _queue() == []


def test_whole_nodes_off_lets_a_world_size_split_evenly(env):
    from slurm_dlrm.service import submit as svc

    site, tmp = env
    site = dataclasses.replace(site, multinode=dataclasses.replace(site.multinode, whole_nodes=False))
    (sub,) = svc.prepare([str(_spec(tmp, "mn-d", "world_size: 6\n"))], SbatchOptions(), site, str(tmp))
    req = svc.native_request(sub, site)
    assert (req.nodes, req.ranks_per_node) == (2, 3)


def test_a_node_local_checkpoint_folder_is_refused_unless_the_site_lists_it(env):
    fake = pytest.importorskip("slurm_dlrm.slurm.fake")
    from slurm_dlrm.service import submit as svc
    from slurm_dlrm.store.fstype import filesystem_of

    site, tmp = env
    if filesystem_of(tmp).network:
        pytest.skip("the test folder is on a network file system")
    local = dataclasses.replace(site, multinode=dataclasses.replace(site.multinode, shared_paths=()))
    spec = _spec(tmp, "mn-e", "world_size: 8\n")
    slurm = fake.FakeSlurm(user="root")
    with pytest.raises(BadInput, match="node-local file system"):
        svc.submit_no_pack([str(spec)], SbatchOptions(), site=local, user="root", cwd=str(tmp), slurm=slurm,
                           python="/py", start_service=False)
    assert slurm.squeue() == [] and _queue() == []
    (sub,) = svc.prepare([str(spec)], SbatchOptions(), local, str(tmp))
    with pytest.raises(BadInput, match="node-local file system"):  # --test-only says it too
        svc.test_only_lines([sub], local, no_pack=False, user="root")
    # listed as shared (the local cluster's site file lists /tmp): accepted
    shared = dataclasses.replace(site, multinode=dataclasses.replace(site.multinode, shared_paths=(str(tmp),)))
    (res,) = svc.submit_no_pack([str(spec)], SbatchOptions(), site=shared, user="root", cwd=str(tmp), slurm=slurm,
                                python="/py", start_service=False)
    assert res.slurm_job_id is not None


def test_multi_node_and_packed_jobs_in_one_command_are_refused(env):
    site, tmp = env
    r = CliRunner().invoke(cli, ["submit", "--no-service", str(EXAMPLES / "tiny-a.yaml"),
                                 str(_spec(tmp, "mn-f", "world_size: 8\n"))])
    assert r.exit_code == 2 and "a multi-node job is not packed" in r.output, r.output
    assert _queue() == []


def test_submit_validates_and_estimates_each_spec_once(env, monkeypatch):
    # The multi-node check and the submit share one `prepare` (it ran twice: every variant
    # of a sweep validated and estimated twice).
    from slurm_dlrm.service import submit as svc

    calls = []
    real = svc.prepare
    monkeypatch.setattr(svc, "prepare", lambda *a, **k: calls.append(a) or real(*a, **k))
    r = CliRunner().invoke(cli, ["submit", "--no-service", "--set", "batch_size=64,128",
                                 str(EXAMPLES / "tiny-a.yaml")])
    assert r.exit_code == 0, r.output
    assert len(calls) == 1 and len(_queue()) == 2


def test_rank_variables_come_from_srun_tasks():
    from slurm_dlrm.train.slurm_ranks import dist_env_from_slurm, tasks_per_node

    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    env = {"SLURM_DLRM_RANKS_FROM_SLURM": "1", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
           "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "2(x2)", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "20042"}
    assert dist_env_from_slurm(env) == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                                        "GROUP_RANK": "1"}
    assert dist_env_from_slurm({k: v for k, v in env.items() if k != "SLURM_DLRM_RANKS_FROM_SLURM"}) == {}
    with pytest.raises(BadInput, match="MASTER_ADDR"):
        dist_env_from_slurm({k: v for k, v in env.items() if k != "MASTER_ADDR"})


def _recorded_multinode(svc, tmp: Path, user: str = "root"):
    """A 2-node job recorded and sbatch'ed into the service's own store and fake Slurm."""
    from slurm_dlrm.service import submit as svc_submit
    from slurm_dlrm.service.native import record_and_submit

    (sub,) = svc_submit.prepare([str(_spec(tmp, "mn-svc", "world_size: 8\n"))], SbatchOptions(), svc.site, str(tmp))
    req = svc_submit.native_request(sub, svc.site)
    (res,) = record_and_submit(svc.store, svc.slurm, [(sub, req)], user=user, site=svc.site,
                               spool_dir=svc.spool_dir, python="/py")
    return res


def test_the_plan_view_counts_the_whole_nodes_a_multi_node_job_holds(tmp_path):
    from service_harness import fake_service

    svc, store, slurm, _clock = fake_service(tmp_path)
    try:
        part = svc.site.default_partition
        assert svc.busy_gpus(part) == 0 and svc.waiting_packs(part.name)[0] == 0
        res = _recorded_multinode(svc, tmp_path)
        # --exclusive on 4-GPU nodes: both nodes' 8 GPUs, queued then running
        assert res.req.gpus == 8.0 and store.get_job(res.job_id).gpu_share == 8.0
        assert svc.busy_gpus(part) == 8 and svc.waiting_packs(part.name)[0] == 8
        slurm.start(res.slurm_job_id, nodes="node[1-2]")
        svc.run_round()
        assert store.get_job(res.job_id).state == "RUNNING"
        assert svc.busy_gpus(part) == 8 and svc.waiting_packs(part.name)[0] == 0
    finally:
        store.close()


def test_node_fail_is_requeued_by_the_service_and_bounded(tmp_path):
    from service_harness import fake_service

    svc, store, slurm, _clock = fake_service(tmp_path, max_attempts=2)
    try:
        res = _recorded_multinode(svc, tmp_path)
        first = res.slurm_job_id
        slurm.start(first, nodes="node[1-2]")
        svc.run_round()
        slurm.set_state(first, "NODE_FAIL", reason="NodeDown")
        svc.run_round()
        job = store.get_job(res.job_id)
        assert job.state == "PLANNED" and job.attempt == 1 and job.slurm_job_id != str(first), job
        again = slurm.job(int(job.slurm_job_id))
        assert "#SBATCH --nodes=2" in again.script and "srun" in again.script
        assert any("ended NODE_FAIL (a node was lost); requeued" in e["reason"] for e in store.events(job_id=job.id))
        # the second loss passes max_attempts: FAILED with Slurm's word, not requeued again
        slurm.start(int(job.slurm_job_id), nodes="node[1-2]")
        svc.run_round()
        slurm.set_state(int(job.slurm_job_id), "NODE_FAIL", reason="NodeDown")
        svc.run_round()
        job = store.get_job(res.job_id)
        assert job.state == "FAILED" and "NODE_FAIL" in (job.exit_reason or ""), job
    finally:
        store.close()


@pytest.mark.parametrize("seen_running", [True, False], ids=["squeue", "sacct"])
def test_a_rerun_after_a_lost_node_is_charged_its_runs_not_the_wait(tmp_path, seen_running):
    """Issue 49's fix for --no-pack jobs, for the multi-node rerun path (noticed there, not
    done): the job runs 1 h, loses a node, waits 2 h in the queue, runs 1 h again. acct
    charges 2 h of its GPUs (4 x 7,200 GPU-s), not the 4 h from its first start (was
    4 x 14,400). `seen_running` False: the rerun ran and ended between two polls."""
    from service_harness import fake_service

    from slurm_dlrm.store.acct import AcctFilter, acct_rows

    svc, store, slurm, clock = fake_service(tmp_path, max_attempts=3)
    try:
        res = _recorded_multinode(svc, tmp_path)
        slurm.start(res.slurm_job_id, nodes="node[1-2]")
        svc.run_round()
        clock.advance(3600.0)
        slurm.set_state(res.slurm_job_id, "NODE_FAIL", reason="NodeDown")
        svc.run_round()
        job = store.get_job(res.job_id)
        assert job.state == "PLANNED" and job.attempt == 1, job
        clock.advance(7200.0)  # in the queue again
        again = int(job.slurm_job_id)
        slurm.start(again, nodes="node[1-2]")
        if seen_running:
            svc.run_round()
        clock.advance(3600.0)
        slurm.finish(again)
        if not seen_running:
            slurm.purge(again)
        svc.run_round()
        job = store.get_job(res.job_id)
        assert job.state == "COMPLETED", job
        (row,) = acct_rows(store, AcctFilter(job_ids=(res.job_id,)))
        gpus = job.gpu_share
        assert row["charged_gpu_s"] == pytest.approx(gpus * 7200.0, rel=0.01), (row["charged_gpu_s"], gpus)
    finally:
        store.close()


@pytest.mark.parametrize("seen_running", [True, False], ids=["squeue", "sacct"])
def test_acct_charges_the_gpus_slurm_allocated_a_multi_node_job(tmp_path, seen_running):
    """2 nodes x 2 ranks with --exclusive on 4-GPU nodes: Slurm allocates it gres/gpu=4
    (the local cluster's `scontrol show job` TRES; the fake prints its TRES the same way),
    and acct charges those 4, not the nodes' 8; read from squeue while it runs, or from
    sacct's AllocTRES when it ran between two polls and squeue forgot it."""
    from service_harness import fake_service

    from slurm_dlrm.slurm.parse import allocated_gpus
    from slurm_dlrm.store.acct import AcctFilter, acct_rows

    svc, store, slurm, clock = fake_service(tmp_path)
    try:
        from slurm_dlrm.service import submit as svc_submit
        from slurm_dlrm.service.native import record_and_submit

        spec = _spec(tmp_path, "mn-acct", "nodes: 2\ngpus_per_node: 2\n")
        (sub,) = svc_submit.prepare([str(spec)], SbatchOptions(), svc.site, str(tmp_path))
        req = svc_submit.native_request(sub, svc.site)
        (res,) = record_and_submit(svc.store, svc.slurm, [(sub, req)], user="root", site=svc.site,
                                   spool_dir=svc.spool_dir, python="/py")
        assert (req.nodes, req.gres, req.exclusive) == (2, "gpu:2", True)
        assert store.get_job(res.job_id).gpu_share == 8.0  # asked for: both whole nodes
        slurm.start(res.slurm_job_id, nodes="node[1-2]")
        assert allocated_gpus(slurm.job(res.slurm_job_id).info().tres) == 4
        if seen_running:
            svc.run_round()
            assert store.get_job(res.job_id).gpu_share == 4.0
        clock.advance(3600.0)
        slurm.finish(res.slurm_job_id)
        if not seen_running:
            slurm.purge(res.slurm_job_id)
            assert "gres/gpu=4" in slurm.sacct([res.slurm_job_id], ["JobID", "AllocTRES"])[0].get("AllocTRES")
        svc.run_round()
        job = store.get_job(res.job_id)
        assert job.state == "COMPLETED" and job.gpu_share == 4.0, job
        (row,) = acct_rows(store, AcctFilter(job_ids=(res.job_id,)))
        assert row["charged_gpu_s"] == pytest.approx(4 * 3600.0, rel=0.01), row
    finally:
        store.close()


def test_allocated_gpus_reads_slurms_tres_spellings():
    from slurm_dlrm.slurm.parse import allocated_gpus

    assert allocated_gpus("cpu=4,mem=8000M,node=2,billing=4,gres/gpu=4") == 4
    assert allocated_gpus("cpu=2,node=2,gres/gpu=4,gres/gpu:h100=4") == 4
    assert allocated_gpus("cpu=2,node=1,gres/gpu:a100=1,gres/gpu:h100=2") == 3
    assert allocated_gpus("cpu=1,node=1,gres/mps=50") is None and allocated_gpus("") is None
