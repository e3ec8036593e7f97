"""`submit --nice` / `--begin` (issue 31): parsed as sbatch does, refused with one line
and nothing recorded when bad, stored (migration 7) and honoured by the service: a job
waits for its begin time, and the user's own order holds."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest
from service_harness import add_job, fake_service, old_store, write_site_file

from slurm_dlrm.service.begin_time import parse_begin
from slurm_dlrm.service.sbatch_options import (
    SbatchOptionError,
    parse_sbatch_args,
    parse_sbatch_script,
)
from slurm_dlrm.store.migrations import LATEST_VERSION
from slurm_dlrm.store.states import JobState
from slurm_dlrm.store.store import Store

NOW = datetime(2026, 11, 26, 15, 30, 0).timestamp()  # local time, as sbatch reads --begin


def at(*args: int) -> float:
    return datetime(*args).timestamp()  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "expected"), [
    ("now", NOW), ("now+90", NOW + 90), ("now+1hour", NOW + 3600), ("NOW+2days", NOW + 2 * 86400),
    ("now+1week", NOW + 7 * 86400), ("16:00", at(2026, 11, 26, 16, 0)), ("09:15:30", at(2026, 11, 27, 9, 15, 30)),
    ("2026-12-24", at(2026, 12, 24)), ("2026-12-24T08:05", at(2026, 12, 24, 8, 5)),
    ("2026-12-24T08:05:09", at(2026, 12, 24, 8, 5, 9)), ("12/24", at(2026, 12, 24)), ("12/24/27", at(2027, 12, 24)),
    ("today", at(2026, 11, 26)), ("tomorrow", at(2026, 11, 27)), ("noon", at(2026, 11, 27, 12, 0)),
    ("teatime", at(2026, 11, 26, 16, 0)), ("midnight", at(2026, 11, 27)),
    ("2026-01-01", at(2026, 1, 1)),  # in the past, but not by years: starts at once, as sbatch
])
def test_begin_forms(text: str, expected: float):
    assert parse_begin(text, NOW) == expected


@pytest.mark.parametrize("text", ["soon", "now+1fortnight", "25:00", "2026-13-01", "2026-02-30T10:00", "13/40", "",
                                  "2024-11-01", "1999-01-01T00:00"])
def test_bad_begin_is_refused_with_the_forms(text: str):
    with pytest.raises(ValueError) as e:
        parse_begin(text, NOW)
    assert "\n" not in str(e.value) and ("use now+N" in str(e.value) or "more than a year in the past" in str(e.value))


def test_nice_range_bare_flag_and_per_job_options():
    assert parse_sbatch_args(["--nice=5"]).nice == 5
    assert parse_sbatch_args(["--nice", "-p", "gpu"]).nice == 100  # bare --nice: 100, as sbatch
    assert parse_sbatch_args(["--nice", "7"]).nice == 7
    for bad in ("2147483646", "-2147483646", "x", "1.5"):
        with pytest.raises(SbatchOptionError, match="--nice"):
            parse_sbatch_args([f"--nice={bad}"])
    opts = parse_sbatch_script("#SBATCH --nice=10\n#SBATCH --begin=now+1hour\n#SBATCH -p gpu\nname: x\n", "s.yaml")
    assert opts.nice == 10 and opts.begin_time is not None
    # per job: never on a pack's sbatch line, and jobs of different nice share packs
    assert opts.sbatch_flags() == ["--partition=gpu"]
    assert opts.pack_key() == parse_sbatch_args(["-p", "gpu"]).pack_key()


def test_negative_nice_is_for_root_only(monkeypatch):
    import slurm_dlrm.service.sbatch_options as so

    monkeypatch.setattr(so.os, "geteuid", lambda: 1000)
    with pytest.raises(SbatchOptionError, match="only root may give a negative adjustment"):
        parse_sbatch_args(["--nice=-5"])
    monkeypatch.setattr(so.os, "geteuid", lambda: 0)
    assert parse_sbatch_args(["--nice=-5"]).nice == -5


def _cli_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    repo = Path(__file__).resolve().parent.parent
    site_file = write_site_file(tmp_path)
    monkeypatch.setenv("SLURM_DLRM_SITE", str(site_file))
    return repo / "examples" / "sweep" / "tiny-a.yaml"


def test_submit_bad_nice_or_begin_is_one_line_exit_2_nothing_recorded(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from slurm_dlrm.cli import cli

    spec = str(_cli_site(tmp_path, monkeypatch))
    run = CliRunner().invoke
    for args, says in ((["--nice=2147483646"], "--nice: 2147483646 is outside"),
                       (["--begin", "next tuesday"], "--begin: bad time 'next tuesday'"),
                       (["--begin=1999-12-31"], "more than a year in the past")):
        r = run(cli, ["submit", "--no-service", *args, spec])
        assert r.exit_code == 2, r.output
        assert says in r.output and r.output.count("\n") == 1, r.output
    assert not list(tmp_path.glob("store-*/*.sqlite")) or "PENDING" not in run(cli, ["queue"]).output
    r = run(cli, ["submit", "--no-service", "--json", "--nice", "5", "--begin", "now+1hour", spec])
    assert r.exit_code == 0, r.output
    from slurm_dlrm.site import load_site
    from slurm_dlrm.store.store import current_user

    site = load_site(None)
    with Store.for_user(site, current_user(), readonly=True) as store:
        (job,) = store.jobs(user=current_user())
        assert job.nice == 5 and job.begin_time is not None and job.begin_time > job.submit_time + 3500


def test_v6_store_gets_nice_and_begin_and_its_jobs_keep_nice_0(tmp_path):
    p = tmp_path / "s" / "store.sqlite"
    conn = old_store(p, 6)
    conn.executescript("""
        INSERT INTO jobs (user, name, state, spec_fingerprint, submit_time, updated_time)
            VALUES ('u', 'a', 'PENDING', 'fp', 1.0, 1.0);
        INSERT INTO job_specs VALUES (1, '{}', NULL, NULL);
        PRAGMA user_version = 6;
    """)
    conn.close()
    with Store(p) as s:
        assert s.schema_version == LATEST_VERSION >= 7
        old = s.get_job(1)
        assert (old.nice, old.begin_time) == (0, None)
        j = s.add_job(user="u", name="n", spec={}, spec_fingerprint="f", nice=7, begin_time=123.0)
        assert (s.get_job(j).nice, s.get_job(j).begin_time) == (7, 123.0)


USER = "root"


@pytest.fixture
def world(tmp_path):
    svc, store, _slurm, clock = fake_service(tmp_path, USER)
    yield svc, store, clock
    store.close()


def test_the_service_holds_a_job_until_its_begin_time(world):
    svc, store, clock = world
    later = store.add_job(user=USER, name="later", spec={"name": "later", "steps": 100, "batch_size": 64},
                          spec_fingerprint="fp", estimate=add_job.__globals__["estimate_dict"](), gpu_model="h100",
                          begin_time=clock() + 600)
    svc.run_round()
    assert store.get_job(later).state == JobState.PENDING
    clock.advance(601)
    svc.run_round()
    assert store.get_job(later).state == JobState.PLANNED


def test_the_users_nice_order_holds_in_the_service(world):
    svc, store, _clock = world
    est = add_job.__globals__["estimate_dict"]
    # Each needs most of a GPU's memory, so they cannot share: the lower nice goes first
    # although it was submitted last; the request has room for one GPU only.
    ids = [store.add_job(user=USER, name=f"j{n}", spec={"name": f"j{n}", "steps": 100, "batch_size": 64},
                         spec_fingerprint=f"fp{n}", estimate=est(gpu_gib=70.0), gpu_model="h100", nice=n)
           for n in (50, 10, 0)]
    svc.site = svc.site  # (the harness site offers several GPUs: limit the round to one)
    original = svc.node_shapes

    def one_gpu(partition):  # type: ignore[no-untyped-def]
        from dataclasses import replace
        return tuple(replace(s, gpus=1, count=1) for s in original(partition))[:1]

    svc.node_shapes = one_gpu  # type: ignore[method-assign]
    svc.run_round()
    states = {i: store.get_job(i).state for i in ids}
    assert states == {ids[0]: JobState.PENDING, ids[1]: JobState.PENDING, ids[2]: JobState.PLANNED}


# ---------------------------------------------------------------- queue: reason and --start

def test_queue_says_why_a_job_waits_and_when_it_should_start(world):
    from slurm_dlrm.service.queue import queue_rows
    from slurm_dlrm.service.start_times import expected_start_times

    svc, store, clock = world
    est = add_job.__globals__["estimate_dict"]
    spec = {"name": "j", "steps": 36_000, "batch_size": 5_000}  # 5000 x 36000 / 50000 per s = 1 h alone
    first = store.add_job(user=USER, name="first", spec=spec, spec_fingerprint="a", estimate=est(gpu_gib=70.0),
                          gpu_model="h100")
    second = store.add_job(user=USER, name="second", spec=spec, spec_fingerprint="b", estimate=est(gpu_gib=70.0),
                           gpu_model="h100")
    later = store.add_job(user=USER, name="later", spec=spec, spec_fingerprint="c", estimate=est(),
                          gpu_model="h100", begin_time=clock() + 7200)
    original = svc.node_shapes

    def one_gpu(partition):  # type: ignore[no-untyped-def]
        from dataclasses import replace
        return tuple(replace(s, gpus=1, count=1) for s in original(partition))[:1]

    svc.node_shapes = one_gpu  # type: ignore[method-assign]
    svc.run_round()
    status = {**svc.status(), "running": True}
    rows = {r["job_id"]: r for r in queue_rows(store, user=USER, service=status, now_s=clock())}
    assert rows[first]["state"] == "PLANNED"
    assert rows[second]["reason"] == "no room left this round"  # the policy's words
    assert rows[later]["reason"].startswith("BeginTime: not before ")
    # the forward run: `second` after `first` (1 h on the site's GPUs, which hold it),
    # `later` not before its begin time
    starts = expected_start_times(store, svc.site, USER, clock())
    assert starts[later] >= clock() + 7200
    assert set(starts) == {second, later}


def test_queue_start_prints_start_time_for_waiting_jobs(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from slurm_dlrm.cli import cli

    spec = str(_cli_site(tmp_path, monkeypatch))
    run = CliRunner().invoke
    assert run(cli, ["submit", "--no-service", spec]).exit_code == 0
    assert run(cli, ["submit", "--no-service", "--begin", "now+2hours", spec]).exit_code == 0
    r = run(cli, ["queue", "--start", "--no-slurm"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["JOBID", "NAME", "STATE", "START_TIME", "REASON"]
    assert len(lines) == 3 and "BeginTime: not before" in lines[2]
    r = run(cli, ["queue", "--start", "--no-slurm", "--json"])
    import json
    jobs = json.loads(r.stdout)["jobs"]
    assert jobs[1]["start_epoch_s"] >= jobs[0]["start_epoch_s"] + 7000


def test_queue_start_keeps_the_running_packs_where_they_are_with_their_reported_steps(world):
    import json

    from slurm_dlrm.service.start_times import expected_start_times
    from slurm_dlrm.store.states import PackState

    svc, store, clock = world
    est = add_job.__globals__["estimate_dict"]
    spec = {"name": "j", "steps": 36_000, "batch_size": 5_000}  # 1 h alone
    # the site's 8 GPUs each hold one 70 GiB job; a ninth waits for the first to end
    running = [store.add_job(user=USER, name=f"r{i}", spec=spec, spec_fingerprint=f"r{i}",
                             estimate=est(gpu_gib=70.0), gpu_model="h100") for i in range(8)]
    svc.run_round()
    waiting = store.add_job(user=USER, name="w", spec=spec, spec_fingerprint="w", estimate=est(gpu_gib=70.0),
                            gpu_model="h100")
    packs = {store.get_job(j).pack_id for j in running}
    for pid in packs:
        pack = store.get_pack(pid)  # type: ignore[arg-type]
        hosts = "node[1-2]" if pack.n_nodes == 2 else f"node{1 + sorted(packs).index(pid) % 2}"
        store.transition_pack(pid, PackState.RUNNING, "started", nodes=hosts)  # type: ignore[arg-type]
    for j in running:
        store.transition_job(j, JobState.RUNNING, "started")
    clock.advance(600)
    # the runners report 3/4 of their steps done: 900 s left (the estimate less the
    # 600 s run would say 3000 s)
    for j in running:
        path = svc.site.spool_dir_for(USER) / "jobs" / str(j) / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"step": 27_000}) + "\n")
    now = clock()
    start = expected_start_times(store, svc.site, USER, now)[waiting]
    assert now + 900 <= start <= now + 900 + svc.site.packing.round_seconds + 1


def test_queue_start_counts_no_gpus_for_a_pack_on_a_node_the_site_does_not_list(world):
    from slurm_dlrm.service.start_times import expected_start_times
    from slurm_dlrm.store.states import PackState

    svc, store, clock = world
    est = add_job.__globals__["estimate_dict"]
    spec = {"name": "j", "steps": 36_000, "batch_size": 5_000}
    running = store.add_job(user=USER, name="r", spec=spec, spec_fingerprint="r", estimate=est(gpu_gib=70.0),
                            gpu_model="h100")
    svc.run_round()
    waiting = store.add_job(user=USER, name="w", spec=spec, spec_fingerprint="w", estimate=est(gpu_gib=70.0),
                            gpu_model="h100")
    pid = store.get_job(running).pack_id
    store.transition_pack(pid, PackState.RUNNING, "started", nodes="elsewhere1")  # type: ignore[arg-type]
    store.transition_job(running, JobState.RUNNING, "started")
    now = clock()
    assert expected_start_times(store, svc.site, USER, now)[waiting] <= now + svc.site.packing.round_seconds
