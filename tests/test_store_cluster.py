"""Cluster-wide accounting: `acct --all-users` totals and `report --all-users`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_dlrm.cli import cli
from slurm_dlrm.store import JobState, NewPlacement, PackState, Store

REPO = Path(__file__).resolve().parent.parent
T0 = 1_700_000_000.0


def pack_run(s: Store, user: str, name: str, partition: str, jobs: list[int], start: float, end: float) -> None:
    """One 1-GPU pack of `partition` holding `jobs`, allocated and running start..end."""
    p = s.add_pack(name=name, user=user, policy="complementary", n_gpus=1, partition=partition, gpu_model="h100",
                   t=T0 + start - 5, placements=[NewPlacement(j, 0, 0, predicted_speed=0.5) for j in jobs])
    s.transition_pack(p, PackState.QUEUED, "sub", slurm_job_id=name, t=T0 + start - 1)
    s.transition_pack(p, PackState.RUNNING, "run", nodes="node1", t=T0 + start)
    for j in jobs:
        s.transition_job(j, JobState.RUNNING, "started", t=T0 + start)
        s.transition_job(j, JobState.COMPLETED, "done", exit_code=0, t=T0 + end)
    s.transition_pack(p, PackState.COMPLETED, "end", t=T0 + end)


@pytest.fixture
def cluster(tmp_path):
    """alice: 2 jobs sharing a GPU for 1 h in `dlrm`, 1 job alone for 2 h in `big`, 1 pending.
    bob: 1 job alone for 1 h in `dlrm`. carol: not a database."""
    text = (REPO / "site-config" / "site.toml").read_text().replace(
        'store_dir = "~/.local/share/slurm-dlrm"', f'store_dir = "{tmp_path}/{{user}}"')
    site = tmp_path / "site.toml"
    site.write_text(text)
    with Store(tmp_path / "alice" / "store.sqlite", clock=lambda: T0 + 9000) as s:
        a = [s.add_job(user="alice", name=f"a{i}", spec={}, spec_fingerprint="f", submit_time=T0) for i in range(4)]
        pack_run(s, "alice", "pa1", "dlrm", a[:2], 0, 3600)
        pack_run(s, "alice", "pa2", "big", a[2:3], 0, 7200)
    with Store(tmp_path / "bob" / "store.sqlite", clock=lambda: T0 + 9000) as s:
        b = s.add_job(user="bob", name="b0", spec={}, spec_fingerprint="g", submit_time=T0)
        pack_run(s, "bob", "pb1", "dlrm", [b], 0, 3600)
    (tmp_path / "carol").mkdir()
    (tmp_path / "carol" / "store.sqlite").write_bytes(b"this is not a database" * 100)
    return tmp_path, site


def test_acct_all_users_totals_per_user_and_partition(cluster):
    tmp_path, site = cluster
    res = CliRunner().invoke(cli, ["acct", "--all-users", "--totals", "--json", "--site", str(site), "-S", "@0"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    users = {r["User"]: r for r in d["users"]}
    parts = {r["Partition"]: r for r in d["partitions"]}
    assert (users["alice"]["Jobs"], users["alice"]["Completed"], users["alice"]["Pending"]) == (4, 3, 1)
    assert users["alice"]["GPUHours"] == pytest.approx(3.0)  # 1 GPU for 1 h + 1 GPU for 2 h
    # the shared GPU: each member would have needed 0.5 h alone (predicted speed 0.5)
    assert users["alice"]["ExclGPUHours"] == pytest.approx(1.0 + 2.0)
    assert users["bob"]["GPUHours"] == pytest.approx(1.0)
    assert parts["dlrm"]["Jobs"] == 4 - 1 - 1 + 1 + 1  # a0, a1, a3 (pending: default partition), b0
    assert parts["dlrm"]["GPUHours"] == pytest.approx(2.0)
    assert parts["big"]["GPUHours"] == pytest.approx(2.0)
    assert len(d["skipped"]) == 1 and d["skipped"][0].startswith("carol:")
    assert "carol" in res.stderr


def test_acct_all_users_table_ends_with_totals_and_names_unread_stores(cluster):
    _, site = cluster
    res = CliRunner().invoke(cli, ["acct", "--all-users", "--site", str(site), "-S", "@0"])
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert out.index("Per user:") < out.index("Per partition:") < out.index("Stores not read:")
    per_user = out[out.index("Per user:"):out.index("Per partition:")]
    alice = next(line for line in per_user.splitlines() if line.strip().startswith("alice"))
    assert alice.split()[1] == "4" and alice.split()[-3] == "3.000"
    assert "carol" in out[out.index("Stores not read:"):]
    # machine-readable job rows are unchanged by the totals
    res = CliRunner().invoke(cli, ["acct", "--all-users", "--site", str(site), "-S", "@0", "--json"])
    assert isinstance(json.loads(res.stdout), list)
    res = CliRunner().invoke(cli, ["acct", "--all-users", "--totals", "-P", "--site", str(site), "-S", "@0"])
    assert res.stdout.splitlines()[0].startswith("Group|Name|Jobs|")
    assert "user|bob|1|" in res.stdout and "partition|big|1|" in res.stdout


def test_report_all_users(cluster):
    tmp_path, site = cluster
    out = tmp_path / "out" / "cluster.html"
    out.parent.mkdir()  # report -o writes into a folder that exists (issue 42: it made missing ones)
    res = CliRunner().invoke(cli, ["report", "--all-users", "--site", str(site), "-S", "@0",
                                   "-E", f"@{T0 + 10000}", "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["stores_read"] == 2 and len(d["skipped"]) == 1 and "carol" in d["skipped"][0]
    html = out.read_text()
    assert "Stores not read (1)" in html and "carol" in html
    assert "Per user" in html and "Per partition" in html and ">big<" in html
    assert all(Path(p).stat().st_size > 1000 for p in d["png"])
    assert html.count("<tr>") > 8  # summary, two totals tables, jobs of both users
    res = CliRunner().invoke(cli, ["report", "--all-users", "--db", "x.sqlite", "--site", str(site)])
    assert res.exit_code == 2 and res.stderr.startswith("slurm-dlrm: error: --all-users")
