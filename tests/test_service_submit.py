"""`slurm-dlrm submit`, `queue`, `show`, `cancel`, `serve` through the CLI (no cluster)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from service_harness import make_site, write_site_file

from slurm_dlrm.cli import cli
from slurm_dlrm.errors import BadInput
from slurm_dlrm.site import REPO_SITE_FILE

pytest.importorskip("slurm_dlrm.store.store")
pytest.importorskip("slurm_dlrm.estimate")
pytest.importorskip("slurm_dlrm.spec")

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "sweep"


@pytest.fixture
def env(tmp_path, monkeypatch):
    site = make_site(tmp_path)
    site_file = write_site_file(tmp_path)
    monkeypatch.setenv("SLURM_DLRM_SITE", str(site_file))
    monkeypatch.chdir(tmp_path)
    return site, site_file, tmp_path


def run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _spec(tmp_path, name, header=""):
    src = (EXAMPLES / "tiny-b.yaml").read_text().replace("name: tiny-b", f"name: {name}")
    p = tmp_path / f"{name}.yaml"
    p.write_text(header + src)
    return p


def test_submit_records_jobs_with_options_and_estimates(env):
    site, site_file, tmp = env
    spec = _spec(tmp, "hdr", "#!/bin/sh\n#SBATCH -p dlrm --time=10\n#SBATCH -o out-%j.txt\n")
    r = run("submit", "--no-service", "--json", str(spec), str(EXAMPLES / "tiny-c.yaml"), "-t", "20", "-A", "proj")
    assert r.exit_code == 0, r.output
    jobs = json.loads(r.output)
    assert [j["name"] for j in jobs] == ["hdr", "tiny-c"]
    assert jobs[0]["options"] == {"partition": "dlrm", "time_minutes": 20, "account": "proj",
                                  "output": f"{tmp}/out-%j.txt"}  # command line wins; -o made absolute
    assert jobs[1]["options"] == {"time_minutes": 20, "account": "proj"}
    assert jobs[0]["estimate"]["gpu_peak_bytes"] > 0
    r = run("queue", "--json", "--no-slurm")
    rows = json.loads(r.output)["jobs"]
    assert [(x["job_id"], x["state"]) for x in rows] == [(1, "PENDING"), (2, "PENDING")]
    assert "not running" in rows[0]["reason"]
    r = run("show", "1", "--json")
    d = json.loads(r.output)
    assert d["options"]["account"] == "proj" and d["spec"]["name"] == "hdr"
    assert run("submit", "--no-service", "--parsable", str(EXAMPLES / "tiny-a.yaml")).output == "3\n"


def test_one_bad_spec_records_nothing(env):
    site, site_file, tmp = env
    bad = tmp / "bad.yaml"
    bad.write_text("name: bad\ntables: []\n")
    r = CliRunner().invoke(cli, ["submit", "--no-service", str(EXAMPLES / "tiny-a.yaml"), str(bad)])
    assert r.exit_code == 2
    assert "tables" in r.output and r.output.count("\n") == 1
    r = run("queue", "--json", "--no-slurm", "--all")
    assert json.loads(r.output)["jobs"] == []


def test_a_full_store_disk_is_one_line_and_records_nothing(tmp_path, monkeypatch):
    """Issue 49 (chaos_live: the store's file system full for 30 s): `submit` printed
    sqlite3's traceback when its commit found no room. Every outcome is one line now:
    with no room at all the store does not open; with a little, the write is rolled back
    ("its file system is full", exit 1, nothing recorded); with enough, it works. The
    store lives on a 4 MiB tmpfs of its own, filled up and then freed step by step."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    fs = tmp_path / "fs"
    fs.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(fs)], check=True)  # noqa: S603, S607
    try:
        monkeypatch.setenv("SLURM_DLRM_SITE", str(write_site_file(tmp_path, store_dir=fs / "store-{user}")))
        monkeypatch.chdir(tmp_path)
        assert run("submit", "--no-service", str(EXAMPLES / "tiny-a.yaml")).exit_code == 0
        outputs = []
        for room in range(8192, 1 << 20, 8192):
            fd = os.open(fs / "filler", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * 4096)
            os.close(fd)
            os.truncate(fs / "filler", max(0, (fs / "filler").stat().st_size - room))
            r = CliRunner().invoke(cli, ["submit", "--no-service", str(EXAMPLES / "tiny-b.yaml")])
            (fs / "filler").unlink()
            assert r.output.startswith(("slurm-dlrm: error: ", "Submitted job")), r.output
            assert r.output.count("\n") == 1, r.output
            outputs.append(r.output)
            if r.exit_code == 0:
                break
            rows = json.loads(run("queue", "--json", "--no-slurm", "--all").output)["jobs"]
            assert [x["job_id"] for x in rows] == [1]  # nothing half-done
        assert any("its file system is full; nothing was written" in o for o in outputs), outputs
        assert outputs[-1].startswith("Submitted job 2")
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)  # noqa: S603, S607


@pytest.mark.parametrize("args, needle", [
    (["-t", "soon"], "--time"),
    (["--mail-type", "SOMETIMES"], "--mail-type"),
    (["-J", "a\nb"], "--job-name"),
])
def test_bad_options_exit_2_in_one_line(env, args, needle):
    r = CliRunner().invoke(cli, ["submit", "--no-service", str(EXAMPLES / "tiny-a.yaml"), *args])
    assert r.exit_code == 2 and needle in r.output and r.output.count("\n") == 1


def test_bad_sbatch_line_in_spec_names_file_and_line(env):
    site, site_file, tmp = env
    spec = _spec(tmp, "x", "#SBATCH --gres=gpu:2\n")
    r = CliRunner().invoke(cli, ["submit", "--no-service", str(spec)])
    assert r.exit_code == 2 and "x.yaml:1: --gres: sized by slurm-dlrm" in r.output


def test_cancel_pending_and_foreign_ids(env):
    run("submit", "--no-service", str(EXAMPLES / "tiny-a.yaml"))
    r = run("cancel", "1")
    assert "cancelled (was pending)" in r.output
    r = CliRunner().invoke(cli, ["cancel", "99"])  # as scancel (issue 42): an error line, exit 0
    assert r.exit_code == 0 and "slurm-dlrm: error: job 99: no such job" in r.output
    assert json.loads(run("show", "1", "--json").output)["state"] == "CANCELLED"


def test_submit_imports_no_torch(env):
    site, site_file, tmp = env
    code = textwrap.dedent(f"""
        import sys
        from slurm_dlrm.cli import cli
        try:
            cli.main(["submit", "--no-service", {str(EXAMPLES / 'tiny-a.yaml')!r}], prog_name="slurm-dlrm")
        except SystemExit as e:
            assert not e.code, e.code
        # sqlite_utils imports numpy and pluggy plugins (~0.1-0.4 s): the store opens
        # it only on demand (Store.db), never on this path.
        heavy = sorted(m for m in ("torch", "torchrec", "fbgemm_gpu", "matplotlib", "jinja2", "numpy",
                                   "sqlite_utils", "pluggy", "rich") if m in sys.modules)
        print("HEAVY", heavy)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,  # noqa: S603
                         env={**os.environ, "SLURM_DLRM_SITE": str(site_file)}, check=True)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr


@pytest.mark.slurm
def test_serve_daemon_status_stop_and_one_service_per_user(env, slurm_cluster):
    # The service asks Slurm its release before its first round (and stops if it cannot
    # tell), so it needs a reachable Slurm: the local cluster's SLURM_CONF.
    site, site_file, tmp = env
    r = run("serve", "--daemon", "--round-seconds", "0.5")
    assert r.exit_code == 0 and "running (pid" in r.output, r.output
    pid = int(r.output.split("pid ")[1].split(")")[0])
    try:
        assert "already running" in run("serve", "--daemon").output
        deadline = time.monotonic() + 20
        status: dict = {}
        while time.monotonic() < deadline and not status.get("rounds"):
            status = json.loads(run("serve", "status", "--json").output)
            time.sleep(0.2)
        assert status["running"] and status["pid"] == pid and status["rounds"] >= 1
        # A second service started by hand finds the lock taken and exits at once.
        out = subprocess.run([sys.executable, "-m", "slurm_dlrm", "serve"], capture_output=True, text=True,
                             timeout=60, cwd=REPO, env={**os.environ, "SLURM_DLRM_SITE": str(site_file)})
        assert out.returncode == 0
    finally:
        r = run("serve", "stop")
    assert f"(pid {pid}) stopped" in r.output
    assert CliRunner().invoke(cli, ["serve", "status"]).exit_code == 1


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_no_pack_script_is_sized_from_the_estimate(env):
    fake = pytest.importorskip("slurm_dlrm.slurm.fake")
    from slurm_dlrm.service import submit as svc
    from slurm_dlrm.service.sbatch_options import SbatchOptions

    site, site_file, tmp = env
    slurm = fake.FakeSlurm(user="root")
    (res,) = svc.submit_no_pack([str(EXAMPLES / "tiny-a.yaml")], SbatchOptions(partition="dlrm"),
                                site=site, user="root", cwd=str(tmp), slurm=slurm, python="/py", start_service=False)
    sid, sub, req = res.slurm_job_id, res.sub, res.req
    job = slurm.job(sid)
    assert job.partition == "dlrm" and job.name == "tiny-a"
    assert f"--mem={req.mem_mib}M" in job.script and f"--cpus-per-task={req.cpus}" in job.script
    from slurm_dlrm.admin.marker import parse_marker

    marker = parse_marker(job.comment)
    assert marker is not None and marker.mode == "no-pack" and marker.gpu_mem_mib >= 1
    assert marker.job_id == res.job_id  # our id rides along (docs/interfaces.md section 6)
    assert req.gres == "gpu:1" or req.gres.startswith("mps:")
    assert req.mem_mib * (1 << 20) >= sub.estimate.host_peak_bytes
    assert "exec /py -m slurm_dlrm train" in job.script


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_multi_gpu_job_is_packed_or_runs_on_whole_gpus_with_no_pack(env):
    fake = pytest.importorskip("slurm_dlrm.slurm.fake")
    from slurm_dlrm.service import submit as svc
    from slurm_dlrm.service.sbatch_options import SbatchOptions

    site, site_file, tmp = env
    two = _spec(tmp, "two-ranks")
    two.write_text(two.read_text() + "world_size: 2\n")
    # The packing path takes it (issue 18: its ranks become members on distinct GPUs).
    bad = _spec(tmp, "wide-ranks")
    bad.write_text(bad.read_text() + "world_size: 64\n")
    # More ranks than a node has GPUs: one line naming the limit, nothing recorded.
    r = CliRunner().invoke(cli, ["submit", "--no-service", str(EXAMPLES / "tiny-a.yaml"), str(bad)])
    assert r.exit_code == 2 and r.output.count("\n") == 1
    assert "world_size 64" in r.output and "needs 16 nodes with 4 h100 GPUs" in r.output
    assert json.loads(run("queue", "--json", "--no-slurm", "--all").output)["jobs"] == []
    r = CliRunner().invoke(cli, ["submit", "--no-service", str(two)])
    assert r.exit_code == 0, r.output
    jobs = json.loads(run("queue", "--json", "--no-slurm", "--all").output)["jobs"]
    assert len(jobs) == 1
    # --no-pack: one Slurm job, one node, two whole GPUs, two ranks' host memory and CPUs.
    slurm = fake.FakeSlurm(user="root")
    (res,) = svc.submit_no_pack([str(two)], SbatchOptions(partition="dlrm"),
                                site=site, user="root", cwd=str(tmp), slurm=slurm, python="/py", start_service=False)
    sid, sub, req = res.slurm_job_id, res.sub, res.req
    job = slurm.job(sid)
    assert req.gres == "gpu:2" and "--gres=gpu:2" in job.script and "--nodes=1" in job.script
    assert req.cpus == 2 * max(1, math.ceil(sub.estimate.profile.host_cpu_cores - 1e-9))
    assert req.mem_mib * (1 << 20) >= 2 * sub.estimate.host_peak_bytes
    # More ranks than any node has GPUs: refused before anything is submitted.
    many = _spec(tmp, "many-ranks")
    many.write_text(many.read_text() + "world_size: 64\n")
    with pytest.raises(BadInput, match="world_size 64"):
        svc.submit_no_pack([str(EXAMPLES / "tiny-a.yaml"), str(many)], SbatchOptions(partition="dlrm"),
                           site=site, user="root", cwd=str(tmp), slurm=slurm, python="/py", start_service=False)
    assert [j.job_id for j in slurm.squeue()] == [sid]
    # The partition's max_gpus_per_job (job_submit.lua enforces it) counts as well.
    import dataclasses

    narrow = dataclasses.replace(site, partitions=tuple(dataclasses.replace(p, max_gpus_per_job=1)
                                                        for p in site.partitions))
    with pytest.raises(BadInput, match="at most 1 GPUs per job"):
        svc.submit_no_pack([str(two)], SbatchOptions(partition="dlrm"), site=narrow, user="root", cwd=str(tmp),
                           slurm=slurm, python="/py", start_service=False)
    assert [j.job_id for j in slurm.squeue()] == [sid]


def test_a_rank_whose_fence_passes_a_gpu_is_refused_on_the_packing_path(env):
    import dataclasses

    from slurm_dlrm.service import submit as svc
    from slurm_dlrm.service.sbatch_options import SbatchOptions

    site, _site_file, tmp = env
    two = _spec(tmp, "two-ranks")
    two.write_text(two.read_text() + "world_size: 2\n")
    sub = svc.prepare([str(two)], SbatchOptions(partition="dlrm"), site, str(tmp))[0]
    assert len(sub.estimate.ranks) == 2
    svc.check_ranks_fit(sub, site, "two.yaml")  # fits
    # rank 1 estimated at the whole GPU: with its margin and context it cannot be fenced
    r1 = dataclasses.replace(sub.estimate.ranks[1], gpu_peak_bytes=sub.gpu.memory_bytes)
    est = dataclasses.replace(sub.estimate, ranks=(sub.estimate.ranks[0], r1))
    with pytest.raises(BadInput, match=r"two.yaml: world_size 2: rank 1 needs \d+ MiB of GPU memory with its fence"):
        svc.check_ranks_fit(dataclasses.replace(sub, estimate=est), site, "two.yaml")


@pytest.mark.parametrize("cross_user", ["time-slice", "one-user"])
def test_no_pack_on_mps_says_what_other_users_mean(tmp_path, cross_user):
    """`submit --no-pack` on an MPS share: the note on stderr; with "one-user" the job asks
    for --exclusive=user itself (job_submit.lua sets it too)."""
    site_file = tmp_path / "site.toml"
    site_file.write_text(REPO_SITE_FILE.read_text().replace('cross_user = "time-slice"',
                                                            f'cross_user = "{cross_user}"'))
    r = CliRunner().invoke(cli, ["submit", "--site", str(site_file), "--no-pack", "--test-only",
                                 str(EXAMPLES / "tiny-a.yaml")])
    assert r.exit_code == 0, r.output
    assert "--gres=mps:" in r.stdout
    assert ("--exclusive=user" in r.stdout) == (cross_user == "one-user")
    assert "slurm-dlrm: note: a --no-pack job on an MPS share" in r.stderr
    assert f'[mps] cross_user = "{cross_user}"' in r.stderr


@pytest.mark.parametrize(("eval_line", "sets", "needle"), [
    ("eval: {every_steps: -5}\n", [], "eval.every_steps"),
    ("eval: {batches: lots}\n", [], "eval.batches"),
    ("eval: {holdout: 0.7}\n", [], "eval.holdout"),
    ("", ["--set", "eval.every_steps=100,-1"], "eval.every_steps"),
])
def test_bad_eval_values_exit_2_in_one_line_and_record_nothing(env, eval_line, sets, needle):
    """Issue 39: a bad `eval:` section (or --set variant of it) refuses the whole submit."""
    site, site_file, tmp = env
    spec = _spec(tmp, "ev")
    spec.write_text(spec.read_text() + eval_line)
    r = CliRunner().invoke(cli, ["submit", "--no-service", str(spec), *sets])
    assert r.exit_code == 2 and needle in r.output and r.output.count("\n") == 1, r.output
    assert r.output.startswith("slurm-dlrm: error: ")
    assert json.loads(run("queue", "--json", "--no-slurm", "--all").output)["jobs"] == []
