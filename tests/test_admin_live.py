"""The rendered files on a real local Slurm 22.05 cluster of their own (own state folder and
ports, so the shared session cluster is left alone): `slurm-dlrm cluster up` with the
rendered slurm.conf fragment, gres.conf and job_submit.lua, the MPS scripts calling the
test's fake `nvidia-cuda-mps-control`. Jobs are submitted as `nobody` (root always passes).

The site differs from site-config/site.toml only in paths (device files, scripts, MPS
folders), the test cluster's addresses, and accounting (no slurmdbd here).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_dlrm.admin.marker import format_marker
from slurm_dlrm.admin.render import lua_str, render_site, write_rendered
from slurm_dlrm.cli import cli
from slurm_dlrm.localcluster import LocalCluster, config_from_site, which_missing
from slurm_dlrm.localcluster.config import PORT_FIRST_SLURMD
from slurm_dlrm.localcluster.ports import pick_base_port
from slurm_dlrm.site import REPO_SITE_FILE, load_site
from slurm_dlrm.slurm.client import SlurmClient
from slurm_dlrm.slurm.parse import job_node_sharing, tres_items
from slurm_dlrm.slurm.wait import wait_for_jobs
from tests.test_admin_scripts import write_fake_mps

USER = "nobody"
PARTITION = "dlrm"


def local_site_text(state: Path, base_port: int) -> str:
    """site-config/site.toml with the local cluster's paths and addresses."""
    text = REPO_SITE_FILE.read_text()
    swaps = {
        'gpu_device_files = "/dev/nvidia{i}"':
            f'gpu_device_files = "{state}/dev/{{node}}/nvidia{{i}}"\n'
            f'node_addr = "127.0.0.1"\nslurmd_port = {base_port + PORT_FIRST_SLURMD}',
        'config_dir = "/etc/slurm"': f'config_dir = "{state}/etc"',
        'script_dir = "/etc/slurm/slurm-dlrm"': f'script_dir = "{state}/admin/scripts"',
        'slurm_user = "slurm"': 'slurm_user = "root"',
        'mps_control_command = "nvidia-cuda-mps-control"':
            f'mps_control_command = "{state}/admin/bin/nvidia-cuda-mps-control"',
        'mps_pipe_root = "/run/slurm-dlrm/mps"': f'mps_pipe_root = "{state}/mps"',
        'mps_log_root = "/var/log/slurm-dlrm/mps"': f'mps_log_root = "{state}/mpslog"',
        'shm_dir = "/dev/shm"': f'shm_dir = "{state}/shm"',
        "accounting_tres = true": "accounting_tres = false",
        # One user per GPU at a time (docs/admin.md "MPS across users").
        'cross_user = "time-slice"': 'cross_user = "one-user"',
        # The site's own prolog, which ours runs (docs/admin.md "Installs that chain").
        'job_cgroup = "system.slice/slurmstepd.scope/job_{job_id}"\n':
            'job_cgroup = "system.slice/slurmstepd.scope/job_{job_id}"\n'
            f'site_prolog = "{state}/site/prolog.sh"\n',
    }
    for old, new in swaps.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


@dataclass
class AdminCluster:
    cluster: LocalCluster
    state: Path
    site_path: Path
    jobs: Path

    @property
    def conf(self) -> Path:
        return self.cluster.config.slurm_conf

    def client(self) -> SlurmClient:
        return SlurmClient(self.conf, timeout_s=30)

    def as_user(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["runuser", "-u", USER, "--", "env", f"SLURM_CONF={self.conf}", *argv],  # noqa: S603
                              capture_output=True, text=True, timeout=60, cwd=self.jobs)

    def sbatch(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.as_user("sbatch", *args)

    def wait(self, job_id: int) -> None:
        wait_for_jobs(self.client(), [job_id], timeout_s=90, poll_s=0.2, max_poll_s=1.0)

    def events(self) -> str:
        p = self.state / "mpslog" / "events.log"
        return p.read_text() if p.exists() else ""

    def daemon_pids(self) -> list[int]:
        pids = []
        for f in (self.state / "mps").glob("gpu*/pipe/nvidia-cuda-mps-control.pid"):
            try:
                pids.append(int(f.read_text()))
            except (OSError, ValueError):
                continue
        return pids


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"local Slurm cluster unavailable in CI: {reason}", pytrace=False)
    pytest.skip(f"local Slurm cluster unavailable: {reason}")


@pytest.fixture(scope="module")
def admin_cluster() -> Iterator[AdminCluster]:
    from slurm_dlrm.errors import DlrmError

    if os.geteuid() != 0:
        _unavailable("must run as root (slurmd, mknod, runuser)")
    missing = which_missing() + [b for b in ("runuser",) if shutil.which(b) is None]
    if missing:
        _unavailable(f"not installed: {', '.join(missing)}")
    # Short: munge's socket and MPS's pipe folders have length limits.
    state = Path(tempfile.mkdtemp(prefix="sda", dir="/tmp"))
    state.chmod(0o755)
    base_port = pick_base_port(state, 2)
    site_path = state / "site.toml"
    site_path.write_text(local_site_text(state, base_port))
    site = load_site(site_path)
    rendered = state / "admin" / "rendered"
    write_rendered(render_site(site), rendered)
    shutil.copytree(rendered / "scripts", state / "admin" / "scripts")
    (state / "site").mkdir()
    (state / "site" / "prolog.sh").write_text(SITE_PROLOG)
    (state / "site" / "prolog.sh").chmod(0o755)
    # The site keeps its job_submit.lua; ours is the module next to it.
    (state / "etc").mkdir()
    shutil.copy(rendered / "slurm_dlrm_submit.lua", state / "etc" / "slurm_dlrm_submit.lua")
    site_lua = state / "site" / "job_submit.lua"
    site_lua.write_text(SITE_JOB_SUBMIT.replace("MODULE", lua_str(state / "etc" / "slurm_dlrm_submit.lua")))
    (state / "shm").mkdir()
    write_fake_mps(state / "admin" / "bin", shm_dir=state / "shm")
    jobs = state / "jobs"
    jobs.mkdir()
    jobs.chmod(0o1777)
    cfg = config_from_site(site, state_dir=state, base_port=base_port, accounting=False,
                           slurm_conf_extra=rendered / "slurm-dlrm.conf", gres_conf=rendered / "gres.conf",
                           job_submit_lua=site_lua)
    cluster = LocalCluster(cfg)
    ac = AdminCluster(cluster, state, site_path, jobs)
    try:
        try:
            cluster.up(wait_s=60)
        except DlrmError as exc:
            _unavailable(str(exc))
        yield ac
    finally:
        cluster.down()
        for pid in ac.daemon_pids():  # a fake MPS daemon an epilog did not stop
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        shutil.rmtree(state, ignore_errors=True)


JOB_SCRIPT = """#!/bin/bash
env | grep -E '^(CUDA_|SLURM_JOB_ID=)' | sort > "$SLURM_SUBMIT_DIR/env-$SLURM_JOB_ID.txt"
# Who may reach the MPS pipe folder the task prolog points us at (mode, owner).
if [[ -n ${CUDA_MPS_PIPE_DIRECTORY:-} ]]; then
  { echo "PIPE_MODE=$(stat -c '%a %U' "$CUDA_MPS_PIPE_DIRECTORY")"
    [[ -e $CUDA_MPS_PIPE_DIRECTORY/control ]] && echo "PIPE_REACH=yes"; } >> "$SLURM_SUBMIT_DIR/env-$SLURM_JOB_ID.txt"
fi
"""


# The site's own job_submit.lua, calling our module first (docs/admin.md "Installs that
# chain"); its own rule: no job named "forbidden-by-site".
SITE_JOB_SUBMIT = """
local slurm_dlrm = dofile(MODULE)
local function site_rules(job_desc)
  if job_desc.name == "forbidden-by-site" then
    slurm.log_user("site rule: no job may be called forbidden-by-site")
    return slurm.ERROR
  end
  return slurm.SUCCESS
end
function slurm_job_submit(job_desc, part_list, submit_uid)
  local rc = slurm_dlrm.job_submit(job_desc, part_list, submit_uid)
  if rc ~= slurm.SUCCESS then return rc end
  return site_rules(job_desc)
end
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm_dlrm.job_modify(job_desc, job_rec, part_list, modify_uid)
end
return slurm.SUCCESS
"""

# The site's own prolog: records each job it ran for.
SITE_PROLOG = """#!/bin/bash
echo "site prolog job $SLURM_JOB_ID" >>"$(dirname "$0")/trace"
"""


def job_script(ac: AdminCluster) -> str:
    path = ac.jobs / "job.sh"
    path.write_text(JOB_SCRIPT)
    path.chmod(0o755)
    return str(path)


def no_pack_args(ac: AdminCluster, mps: int = 40, gpu_mem_mib: int = 3000) -> list[str]:
    """`slurm-dlrm submit --no-pack` on an MPS site (docs/interfaces.md section 6)."""
    return ["--parsable", f"--partition={PARTITION}", f"--gres=mps:{mps}", "--mem=2000M",
            f"--comment={format_marker('no-pack', gpu_mem_mib=gpu_mem_mib, job_id=12)}", "--job-name=tiny-a",
            f"--output={ac.jobs}/slurm-%j.out", job_script(ac)]


def pack_args(ac: AdminCluster) -> list[str]:
    return ["--parsable", f"--partition={PARTITION}", "--nodes=1", "--gres=gpu:2", "--mem=4000M",
            f"--comment={format_marker('pack', pack_id=7, extra={'pack': 'nobody-pack-7'})}",
            "--job-name=nobody-pack-7", f"--output={ac.jobs}/slurm-%j.out", job_script(ac)]


def read_env(ac: AdminCluster, job_id: int) -> dict[str, str]:
    env = {}
    for line in (ac.jobs / f"env-{job_id}.txt").read_text().splitlines():
        name, _, value = line.partition("=")
        env[name] = value
    return env


@pytest.mark.slurm
def test_plain_sbatch_is_refused_with_the_message(admin_cluster):
    for extra in ([f"--partition={PARTITION}"], []):  # named, and by default
        result = admin_cluster.sbatch("--parsable", *extra, "--wrap=true")
        assert result.returncode == 1
        assert "partition dlrm takes only jobs submitted through slurm-dlrm" in result.stderr
        assert "no slurm-dlrm marker" in result.stderr and "no memory request" in result.stderr
        assert "slurm-dlrm submit" in result.stderr
        assert "Access/permission denied" in result.stderr  # ESLURM_ACCESS_DENIED
    # Marker and memory but a share beyond one GPU: the gres code.
    args = [a if not a.startswith("--gres") else "--gres=mps:150" for a in no_pack_args(admin_cluster)]
    result = admin_cluster.sbatch(*args)
    assert result.returncode == 1 and "outside 1..100" in result.stderr
    assert "Invalid generic resource" in result.stderr


@pytest.mark.slurm
def test_no_pack_job_gets_mps_and_its_memory_fence(admin_cluster):
    result = admin_cluster.sbatch(*no_pack_args(admin_cluster, mps=40, gpu_mem_mib=3000))
    assert result.returncode == 0, result.stderr
    job_id = int(result.stdout.strip().split(";")[0])
    admin_cluster.wait(job_id)
    env = read_env(admin_cluster, job_id)
    # Slurm 22.05.8 with shards configured sets 40*100/8 = 500; the scripts repair it.
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=3000M"
    pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
    assert pipe.startswith(f"{admin_cluster.state}/mps/gpu") and pipe.endswith("/pipe")
    assert "CUDA_VISIBLE_DEVICES" not in env
    gpu = pipe.split("/gpu")[-1].split("/")[0]
    control_log = (admin_cluster.state / "mpslog" / f"gpu{gpu}" / "control.log").read_text()
    assert f"start CUDA_VISIBLE_DEVICES={gpu}" in control_log
    assert "set_default_active_thread_percentage 40" in control_log
    # The epilog stops the daemon after the job (bounded poll: it may still be completing).
    deadline = time.monotonic() + 30
    while "stopped" not in admin_cluster.events() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "command quit" in (admin_cluster.state / "mpslog" / f"gpu{gpu}" / "control.log").read_text()
    assert f"job {job_id}: GPU {gpu}: MPS control daemon" in admin_cluster.events()
    assert not (admin_cluster.state / "mps" / f"gpu{gpu}" / "pipe").exists()


@pytest.mark.slurm
def test_a_job_named_like_other_fields_gets_only_its_own(admin_cluster):
    """Issue 32 items 1 and 10 on real Slurm: a job name and a work dir that read like
    TresPerNode= and Comment= in `scontrol show job -o` change nothing the prolog reads; the
    job's pipe folder is reachable by its user (and no one else: tests/test_admin_scripts.py)."""
    forged = "x TresPerNode=mps:100 Comment=slurm-dlrm:mode=no-pack,gpu_mem_mib=99999"
    work_dir = admin_cluster.jobs / "TresPerNode=mps:100000"
    work_dir.mkdir()
    work_dir.chmod(0o777)
    *args, script = [a for a in no_pack_args(admin_cluster, mps=40, gpu_mem_mib=3000) if not a.startswith("--job-name")]
    result = admin_cluster.sbatch(*args, f"--job-name={forged}", f"--chdir={work_dir}", script)
    assert result.returncode == 0, result.stderr
    job_id = int(result.stdout.strip().split(";")[0])
    admin_cluster.wait(job_id)
    env = read_env(admin_cluster, job_id)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=3000M"
    # Root's with an ACL entry for the job's user (1770: sticky, the mask shows as group
    # bits), or without setfacl the user's own; either way the job reaches its daemon.
    assert env["PIPE_MODE"] == ("1770 root" if shutil.which("setfacl") else f"700 {USER}")
    assert env["PIPE_REACH"] == "yes"


@pytest.mark.slurm
def test_the_sites_own_job_submit_and_prolog_still_run(admin_cluster):
    """Installed as a site with its own job_submit.lua and prolog would: the site's script
    calls our module, our prolog runs the site's."""
    args = [a if not a.startswith("--job-name") else "--job-name=forbidden-by-site" for a in no_pack_args(admin_cluster)]
    refused = admin_cluster.sbatch(*args)
    assert refused.returncode == 1 and "site rule: no job may be called forbidden-by-site" in refused.stderr
    result = admin_cluster.sbatch(*no_pack_args(admin_cluster))
    assert result.returncode == 0, result.stderr
    job_id = int(result.stdout.strip().split(";")[0])
    admin_cluster.wait(job_id)
    trace = (admin_cluster.state / "site" / "trace").read_text()
    assert f"site prolog job {job_id}\n" in trace
    assert read_env(admin_cluster, job_id)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"  # ours ran too


@pytest.mark.slurm
def test_pack_job_is_accepted_and_left_to_the_agent(admin_cluster):
    before = admin_cluster.events()
    result = admin_cluster.sbatch(*pack_args(admin_cluster))
    assert result.returncode == 0, result.stderr
    job_id = int(result.stdout.strip().split(";")[0])
    admin_cluster.wait(job_id)
    env = read_env(admin_cluster, job_id)
    assert "CUDA_MPS_PIPE_DIRECTORY" not in env and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env
    assert len(env["CUDA_VISIBLE_DEVICES"].split(",")) == 2
    assert admin_cluster.events() == before  # gres/gpu: the prolog started nothing


@pytest.mark.slurm
def test_scontrol_update_that_breaks_the_rules_is_refused(admin_cluster):
    result = admin_cluster.sbatch("--hold", *no_pack_args(admin_cluster))
    assert result.returncode == 0, result.stderr
    job_id = str(int(result.stdout.strip().split(";")[0]))
    try:
        bad_comment = admin_cluster.as_user("scontrol", "update", f"JobId={job_id}", "Comment=hello")
        assert bad_comment.returncode != 0 and "Access/permission denied" in bad_comment.stderr
        bad_share = admin_cluster.as_user("scontrol", "update", f"JobId={job_id}", "TresPerNode=gres:mps:500")
        assert bad_share.returncode != 0 and "Invalid generic resource" in bad_share.stderr
        ok = admin_cluster.as_user("scontrol", "update", f"JobId={job_id}", "TresPerNode=gres:mps:60")
        assert ok.returncode == 0, ok.stderr
        rec = admin_cluster.client().show_job_raw(int(job_id))
        # Printed gres:mps:60 by 22.05, gres/mps:60 by 24.11 and 26.05.
        assert tres_items(rec["TresPerNode"]) == {"gres/mps": "60"}
        assert rec["Comment"].startswith("slurm-dlrm:mode=no-pack")
        # Root is never refused.
        admin_cluster.client().run(["scontrol", "update", f"JobId={job_id}", "Comment=root-may"])
        assert admin_cluster.client().show_job_raw(int(job_id))["Comment"] == "root-may"
    finally:
        admin_cluster.client().scancel([int(job_id)])


@pytest.mark.slurm
def test_admin_check_against_the_cluster(admin_cluster, monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_CONF", str(admin_cluster.conf))
    runner = CliRunner()
    same = runner.invoke(cli, ["admin", "check", "--site", str(admin_cluster.site_path)])
    assert same.exit_code == 0, same.output
    changed_site = tmp_path / "site.toml"
    changed_site.write_text(admin_cluster.site_path.read_text().replace("gpus = 4", "gpus = 2", 1))
    assert tomllib.loads(changed_site.read_text())["nodes"][0]["gpus"] == 2
    changed = runner.invoke(cli, ["admin", "check", "--site", str(changed_site)])
    assert changed.exit_code == 1
    assert "node node1: gres/gpu: site h100:2, cluster h100:4" in changed.output
    assert "node node2: gres/mps: site 200, cluster 400" in changed.output


def test_cluster_fragment_replaces_the_local_clusters_own_nodes(tmp_path):
    """No slurmd needed: the local cluster's slurm.conf defines each node once."""
    state = tmp_path / "s"
    state.mkdir()
    site_path = tmp_path / "site.toml"
    site_path.write_text(local_site_text(state, 20000))
    rendered = tmp_path / "r"
    write_rendered(render_site(load_site(site_path)), rendered)
    cfg = config_from_site(load_site(site_path), state_dir=state, base_port=20000,
                           slurm_conf_extra=rendered / "slurm-dlrm.conf", gres_conf=rendered / "gres.conf",
                           job_submit_lua=rendered / "job_submit.lua")
    LocalCluster(cfg).render()
    conf = cfg.slurm_conf.read_text()
    for name in ("node1", "node2"):
        assert conf.count(f"NodeName={name} ") == 1
    assert conf.count("PartitionName=") == 1
    assert f"Port={20000 + PORT_FIRST_SLURMD + 1}" in conf
    assert (cfg.etc_dir / "job_submit.lua").read_text() == (rendered / "job_submit.lua").read_text()


@pytest.mark.slurm
def test_one_user_mps_job_keeps_other_users_off_its_node(admin_cluster):
    """[mps] cross_user = "one-user": job_submit.lua gives nobody's MPS job --exclusive=user,
    so root's whole-GPU job asked onto the same node waits (3 GPUs free there) until it ends;
    MPS would otherwise run the two users' jobs on a GPU in turn."""
    hold = admin_cluster.jobs / "hold.sh"
    hold.write_text("#!/bin/bash\nsleep 60\n")
    hold.chmod(0o755)
    args = [a for a in no_pack_args(admin_cluster, mps=40) if not a.endswith("job.sh")]
    result = admin_cluster.sbatch(*args, "--nodelist=node1", str(hold))
    assert result.returncode == 0, result.stderr
    mps_job = int(result.stdout.strip().split(";")[0])
    client = admin_cluster.client()
    other = None
    try:
        deadline = time.monotonic() + 60
        while client.show_job_raw(mps_job)["JobState"] != "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.3)
        rec = client.show_job_raw(mps_job)
        assert rec["JobState"] == "RUNNING" and job_node_sharing(rec) == "user"
        other = client.sbatch("#!/bin/bash\ntrue\n", [f"--partition={PARTITION}", "--nodelist=node1",
                                                          "--gres=gpu:1", "--mem=100M",
                                                          f"--output={admin_cluster.jobs}/root-%j.out"])
        time.sleep(4)  # several scheduling passes (batch_sched_delay=0)
        assert client.show_job_raw(other)["JobState"] == "PENDING"
        client.scancel([mps_job])
        admin_cluster.wait(other)
        assert client.show_job_raw(other)["JobState"] == "COMPLETED"
    finally:
        client.scancel([j for j in (mps_job, other) if j is not None])
