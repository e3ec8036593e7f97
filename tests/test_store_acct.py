"""`slurm-dlrm acct`: GPU-hours, filters, formats, all users, bad input."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_dlrm.cli import cli
from slurm_dlrm.store import JobState, NewPlacement, PackState, Store
from slurm_dlrm.store.acct import AcctFilter, acct_rows, parse_time

T0 = 1_700_000_000.0


def run_job(store: Store, pack: int, job: int, start: float, end: float, state: JobState = JobState.COMPLETED) -> None:
    store.transition_job(job, JobState.RUNNING, "started", t=T0 + start)
    store.transition_job(job, state, "done", exit_code=0, t=T0 + end)


@pytest.fixture
def hist(tmp_path):
    """Two packs with exact times (seconds after T0):

    pack 1, 1 GPU, allocated 0..100: A on GPU0 0..100, B on GPU0 0..50
    pack 2, 2 GPUs, allocated 200..280: C on GPU0 and GPU1 200..260, D on GPU1 200..260
    E pending, never planned.
    Predicted speeds (the plan's): A 0.6, B 0.7, C 0.8 on GPU1 (1.0 alone on GPU0), D none.
    """
    s = Store(tmp_path / "alice" / "store.sqlite", clock=lambda: T0 + 1000)
    est = {"gpu_peak_bytes": 4 << 30, "host_peak_bytes": 8 << 30, "profile": {"solo_samples_per_s": 1000.0}}
    ids = {n: s.add_job(user="alice", name=n, spec={"name": n}, spec_fingerprint="fpX" if n in "AB" else "fpY",
                        estimate=est, submit_time=T0 - 10) for n in "ABCDE"}
    p1 = s.add_pack(name="pk-1", user="alice", policy="complementary", n_gpus=1, t=T0 - 5,
                    placements=[NewPlacement(ids["A"], 0, 0, 50, predicted_speed=0.6),
                                NewPlacement(ids["B"], 0, 0, 50, predicted_speed=0.7)])
    s.transition_pack(p1, PackState.QUEUED, "sub", slurm_job_id="101", t=T0 - 1)
    s.transition_pack(p1, PackState.RUNNING, "run", nodes="node1", t=T0)
    run_job(s, p1, ids["A"], 0, 100)
    run_job(s, p1, ids["B"], 0, 50, JobState.OOM)
    s.transition_pack(p1, PackState.COMPLETED, "end", t=T0 + 100)
    p2 = s.add_pack(name="pk-2", user="alice", policy="complementary", n_gpus=2, t=T0 + 150,
                    placements=[NewPlacement(ids["C"], 0, 0, predicted_speed=1.0),
                                NewPlacement(ids["C"], 0, 1, predicted_speed=0.8), NewPlacement(ids["D"], 0, 1)])
    s.transition_pack(p2, PackState.QUEUED, "sub", slurm_job_id="102", t=T0 + 160)
    s.transition_pack(p2, PackState.RUNNING, "run", nodes="node2", t=T0 + 200)
    run_job(s, p2, ids["C"], 200, 260)
    run_job(s, p2, ids["D"], 200, 260)
    s.transition_pack(p2, PackState.COMPLETED, "end", t=T0 + 280)
    # A measured half of its *estimated* solo speed; D twice it (no solo runs to compare with).
    s.add_samples([{"t": T0 + i, "pack_id": p1, "job_id": ids["A"], "node": "node1", "gpu_index": 0,
                    "sm_util_pct": 10.0 * i, "gpu_mem_bytes": (3 << 30) + i, "rss_bytes": 5 << 30,
                    "samples_per_s": 500.0} for i in range(1, 6)])
    s.add_samples([{"t": T0 + 210, "pack_id": p2, "job_id": ids["D"], "node": "node2", "gpu_index": 1,
                    "sm_util_pct": 90.0, "gpu_mem_bytes": 5 << 30, "samples_per_s": 2000.0}])
    yield s, ids, (p1, p2)
    s.close()


def by_name(rows):
    return {r["name"]: r for r in rows}


def test_gpu_hours_split_and_saved(hist):
    s, ids, _ = hist
    r = by_name(acct_rows(s, AcctFilter(), now=T0 + 1000))
    h = 1 / 3600
    # pack 1's GPU: 100 s split 100:50 between A and B
    assert r["A"]["gpu_hours"] == pytest.approx(100 * 100 / 150 * h)
    assert r["B"]["gpu_hours"] == pytest.approx(100 * 50 / 150 * h)
    # pack 2: GPU0 only C (60 s); GPU1 C and D 60:60 of 60 s. The pack held its GPUs 20 s
    # longer, after its last member ended (the agents' join grace): not a member's use, so
    # not charged (issue 42: short jobs were charged the tail)
    assert r["C"]["gpu_hours"] == pytest.approx((60 + 30) * h)
    assert r["D"]["gpu_hours"] == pytest.approx(30 * h)
    assert sum(x["gpu_hours"] for x in r.values()) == pytest.approx((100 + 2 * 60) * h)
    # exclusive: run time on each GPU, times the plan's predicted speed where shared (no
    # solo run of the same spec was measured; the analytic solo samples/s is not used)
    assert r["A"]["excl_gpu_hours"] == pytest.approx(100 * 0.6 * h)
    assert r["B"]["excl_gpu_hours"] == pytest.approx(50 * 0.7 * h)
    assert r["C"]["excl_gpu_hours"] == pytest.approx((60 + 60 * 0.8) * h)
    assert r["D"]["gpu_hours_saved"] == pytest.approx((60 - 30) * h)  # no prediction: no correction
    assert r["A"]["gpu_hours_saved"] == pytest.approx((60 - 100 * 100 / 150) * h)
    assert [r[n]["speed_basis"] for n in "ABCDE"] == ["predicted", "predicted", "predicted", "none", None]
    assert r["E"]["gpu_hours"] == 0 and r["E"]["wait_s"] == pytest.approx(1010)
    assert (r["A"]["run_s"], r["C"]["run_s"], r["C"]["n_gpus"], r["C"]["nodes"]) == (100, 60, 2, "node2")
    assert r["A"]["wait_s"] == pytest.approx(10)
    assert (r["A"]["gpu_mem_peak_bytes"], r["A"]["sm_util_mean"], r["A"]["sm_util_max"]) == ((3 << 30) + 5, 30.0, 50.0)
    assert r["A"]["slurm_job_id"] == "101"


def test_measured_slowdown_only_against_solo_runs_of_the_same_spec_and_gpu_model(tmp_path):
    """S1 (h100) and S2 (a100) ran alone with spec fpX; P and Q shared an h100 GPU.

    P (fpX) measured 300 samples/s against S1's mean 600 -> slowdown 0.5 (measured wins
    over its predicted 0.9; S2's a100 figure is not mixed in). Q (fpZ) has no solo run
    of its spec: the plan's 0.7.
    """
    s = Store(tmp_path / "alice" / "store.sqlite", clock=lambda: T0 + 1000)
    est = {"profile": {"solo_samples_per_s": 10_000.0}}  # the analytic figure: never used
    fps = {"S1": "fpX", "S2": "fpX", "P": "fpX", "Q": "fpZ"}
    ids = {n: s.add_job(user="alice", name=n, spec={"name": n}, spec_fingerprint=fp, estimate=est,
                        submit_time=T0 - 10) for n, fp in fps.items()}

    def run_pack(name: str, model: str, members: list[tuple[str, float | None]], sps: dict[str, list[float]],
                 start: float, end: float) -> None:
        pk = s.add_pack(name=name, user="alice", policy="complementary", n_gpus=1, gpu_model=model, t=T0 + start - 2,
                        placements=[NewPlacement(ids[n], 0, 0, predicted_speed=v) for n, v in members])
        s.transition_pack(pk, PackState.QUEUED, "sub", slurm_job_id=name, t=T0 + start - 1)
        s.transition_pack(pk, PackState.RUNNING, "run", nodes="node1", t=T0 + start)
        for n, _ in members:
            run_job(s, pk, ids[n], start, end)
            s.add_samples([{"t": T0 + start + i, "pack_id": pk, "job_id": ids[n], "node": "node1", "gpu_index": 0,
                            "samples_per_s": v} for i, v in enumerate(sps[n])])
        s.transition_pack(pk, PackState.COMPLETED, "end", t=T0 + end)

    run_pack("pk-s1", "h100", [("S1", 1.0)], {"S1": [500.0, 700.0]}, 0, 10)
    run_pack("pk-s2", "a100", [("S2", 1.0)], {"S2": [100.0]}, 20, 30)
    run_pack("pk-pq", "h100", [("P", 0.9), ("Q", 0.7)], {"P": [300.0], "Q": [50.0]}, 100, 200)
    r = by_name(acct_rows(s, AcctFilter(), now=T0 + 1000))
    h = 1 / 3600
    assert r["P"]["excl_gpu_hours"] == pytest.approx(100 * 0.5 * h) and r["P"]["speed_basis"] == "measured"
    assert r["Q"]["excl_gpu_hours"] == pytest.approx(100 * 0.7 * h) and r["Q"]["speed_basis"] == "predicted"
    assert r["P"]["gpu_hours"] == r["Q"]["gpu_hours"] == pytest.approx(50 * h)
    assert r["Q"]["gpu_hours_saved"] == pytest.approx(20 * h)
    # solo jobs: no correction, nothing saved
    assert r["S1"]["speed_basis"] == "solo" and r["S1"]["gpu_hours_saved"] == pytest.approx(0)
    s.close()


def invoke(store: Store, *args: str):
    return CliRunner().invoke(cli, ["acct", "--db", str(store.path), *args])


def test_filters(hist):
    s, ids, (p1, p2) = hist

    def names(*args: str) -> list[str]:
        res = invoke(s, "--json", *args)
        assert res.exit_code == 0, res.output
        return [x["Name"] for x in json.loads(res.output)]

    assert names() == list("ABCDE")
    assert names("-j", f"{ids['B']},{ids['D']}") == ["B", "D"]
    assert names("-s", "oom,pending") == ["B", "E"]
    assert names("--pack", str(p2)) == ["C", "D"]
    assert names("--pack", "pk-1") == ["A", "B"]
    assert names("--pack", "nope") == []
    assert names("-u", "bob") == []
    assert names("-S", f"@{T0 + 90}") == ["A", "C", "D", "E"]  # B ended at +50
    assert names("-E", f"@{T0 - 20}") == []


def test_formats(hist):
    s, ids, _ = hist
    res = invoke(s, "-o", "JobID,State,MaxGPUMem,GPUHours%9", "-j", str(ids["A"]))
    assert res.exit_code == 0
    header, dashes, row = res.output.splitlines()
    assert header.split() == ["JobID", "State", "MaxGPUMem", "GPUHours"]
    assert row.split() == [str(ids["A"]), "COMPLETED", "3.0G", "0.019"]
    res = invoke(s, "--csv", "-o", "jobid,maxgpumem,elapsed,submit")
    rows = list(csv.DictReader(io.StringIO(res.output)))
    assert rows[0]["MaxGPUMem"] == str((3 << 30) + 5) and float(rows[0]["Elapsed"]) == 100.0
    assert rows[0]["Submit"].startswith("2023-11-14T")
    res = invoke(s, "-P", "-n", "-o", "JobID,State,Reason", "-s", "OOM")
    assert res.output == f"{ids['B']}|OOM|done\n"
    res = invoke(s, "--json", "-o", "JobID,MaxGPUMem", "-s", "PENDING")
    assert json.loads(res.output) == [{"JobID": ids["E"], "MaxGPUMem": None}]
    res = invoke(s, "--helpformat")
    assert "GPUHoursSaved" in res.output and res.exit_code == 0


@pytest.mark.parametrize("args, what", [
    (["-s", "DONE"], "--state"), (["-o", "JobID,Colour"], "--format"), (["-S", "yesterday-ish"], "--since"),
    (["-j", "1,x"], "--jobs"), (["--json", "--csv"], "--json"),
])
def test_bad_input_is_one_line_and_exit_2(hist, args, what):
    res = invoke(hist[0], *args)
    assert res.exit_code == 2
    assert what in res.output and len(res.output.strip().splitlines()) == 1


def test_parse_time():
    assert parse_time("2h", "--since", now=10_000.0) == 10_000.0 - 7200
    assert parse_time("now-30m", "--since", now=10_000.0) == 10_000.0 - 1800
    assert parse_time("@123.5", "--since") == 123.5


def test_all_users_reads_every_readable_store(tmp_path, hist, monkeypatch):
    s, _, _ = hist
    site = Path(__file__).resolve().parent.parent / "site-config" / "site.toml"
    text = site.read_text().replace('store_dir = "~/.local/share/slurm-dlrm"', f'store_dir = "{tmp_path}/{{user}}"')
    my_site = tmp_path / "site.toml"
    my_site.write_text(text)
    with Store(tmp_path / "bob" / "store.sqlite") as bob:
        bob.add_job(user="bob", name="bobs", spec={}, spec_fingerprint="z", submit_time=T0 + 5)
    (tmp_path / "carol").mkdir()
    (tmp_path / "carol" / "store.sqlite").write_bytes(b"this is not a database" * 100)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/store.sqlite")}
    res = CliRunner().invoke(cli, ["acct", "--all-users", "--site", str(my_site), "--json", "-o", "User,Name"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert [(x["User"], x["Name"]) for x in out] == [("alice", n) for n in "ABCDE"] + [("bob", "bobs")]
    assert "carol" in res.stderr and "skipped" in res.stderr
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/store.sqlite")} == before  # read-only


@pytest.mark.parametrize("kind, value, shown", [
    ("bytes", 0, "0"), ("bytes", 1023, "1023"), ("bytes", 1536, "1.5K"), ("bytes", 5 << 20, "5.0M"),
    ("bytes", (3 << 30) + 5, "3.0G"), ("bytes", 2 << 40, "2.0T"),
    ("dur", 0.4, "00:00:00"), ("dur", 59.6, "00:01:00"), ("dur", 86399.4, "23:59:59"),
    ("dur", 90061, "1-01:01:01"), ("dur", -3.0, "00:00:00"),
    ("pct", 12.345, "12.3"), ("rate", 1234.6, "1235"), ("hours", 1 / 54, "0.019"),
    ("int", 7, "7"), ("str", "x y", "x y"),
])
def test_sql_cell_formats(kind, value, shown):
    import sqlite3

    from slurm_dlrm.store.acct import _SQL_HUMAN

    conn = sqlite3.connect(":memory:")
    assert conn.execute(f"SELECT {_SQL_HUMAN[kind]('v')} FROM (SELECT ? AS v)", (value,)).fetchone()[0] == shown


def test_sql_time_cells_are_local_time():
    import sqlite3
    from datetime import datetime

    from slurm_dlrm.store.acct import _SQL_HUMAN

    conn = sqlite3.connect(":memory:")
    got = conn.execute(f"SELECT {_SQL_HUMAN['time']('v')} FROM (SELECT ? AS v)", (T0 + 0.7,)).fetchone()[0]
    assert got == datetime.fromtimestamp(T0).strftime("%Y-%m-%dT%H:%M:%S")
