"""Fences a member cannot lift (issue 22): MPS v3 namespaces and cgroup dmem, against the
fake `nvidia-cuda-mps-control` (v3 protocol and configuration file) and a fake cgroup tree.
The target: a member that sets CUDA_MPS_PINNED_DEVICE_MEM_LIMIT higher in its own
environment is still held to its fence with v3 or dmem (read from the daemon's and the
cgroup's state); with v2 it is not, and the agent says so once per pack."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from slurm_dlrm.agent import fences
from slurm_dlrm.agent.loop import Agent, AgentOptions
from slurm_dlrm.agent.placement import parse_placement
from slurm_dlrm.agent.reports import read_reports
from slurm_dlrm.emulated import mps_control as fake_mps_control
from slurm_dlrm.emulated import nvml as fake_nvml
from slurm_dlrm.emulated.standin import member_entry, placement_dict, rank_entries

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
GIB = 1 << 30
REGIONS = {"nvidia/0000:3b:00.0/vidmem": 80 * GIB, "nvidia/0000:5e:00.0/vidmem": 80 * GIB}
LIFT = ["--set-env", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=99999M", "--mps-client", "--steps", "3", "--step-s", "0.05"]


def _world(tmp_path, monkeypatch, *, v3: bool, cgroup: str | None = None):
    """Fake MPS (with or without v3), fake NVML (2 x 80 GiB), a fake cgroup tree or none."""
    fake_mps_control.install_launcher(tmp_path / "bin", v3=v3)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_MPS_PROTOCOL_VERSION", raising=False)
    scenario = tmp_path / "nvml.json"
    scenario.write_text(json.dumps({"gpu_count": 2, "driver_version": "615.10" if v3 else "550.54.15"}))
    monkeypatch.setenv(fake_nvml.ENV_FAKE_NVML, str(scenario))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    (tmp_path / "state").mkdir()
    monkeypatch.setenv(fake_mps_control.ENV_STATE_COPY, str(tmp_path / "state"))
    croot = tmp_path / "cgroup"
    if cgroup == "dmem":
        fences.make_fake_cgroup_tree(croot, REGIONS)
    elif cgroup == "no-dmem":
        fences.make_fake_cgroup_tree(croot, REGIONS, dmem=False)
    elif cgroup == "one-region":
        fences.make_fake_cgroup_tree(croot, dict(list(REGIONS.items())[:1]))
    monkeypatch.setenv(fences.ENV_CGROUP_ROOT, str(croot))  # absent folder: no cgroup v2
    (tmp_path / "tmp").mkdir()
    return tmp_path


def _run(world, members, **opts):
    pack = world / "pack"
    base = dict(node_index=0, node_name="n1", gpus=["0", "1"], launch="process", tmp_root=str(world / "tmp"),
                heartbeat_every_s=0.5)
    base.update(opts)
    agent = Agent(parse_placement(placement_dict(pack, members, sample_interval_s=0.1)), AgentOptions(**base))
    agent.run()
    return agent, read_reports(agent.reports.path)


def _member(world, job_id, gpu, args=None, estimate_mib=None, **kw):
    env_out = world / f"env-{job_id}.json"
    entry = member_entry(world / "pack", job_id, gpu, args=[*(args or ["--steps", "3", "--step-s", "0.05"]),
                                                            "--env-out", str(env_out)], **kw)
    if estimate_mib is not None:
        entry["gpu_mem_estimate_mib"] = estimate_mib
    return entry


def _daemon_state(world):
    (state,) = [json.loads(p.read_text()) for p in (world / "state").glob("fake-mps-state-*.json")]
    return state


def _pid(world, job_id):
    return json.loads((world / f"env-{job_id}.json").read_text())["pid"]


def _events(recs):
    return [r["event"] for r in recs if r["type"] == "agent"]


# ------------------------------------------------------------------ the target


def test_v3_member_that_raises_its_own_limit_is_still_held_to_its_fence(tmp_path, monkeypatch):
    world = _world(tmp_path, monkeypatch, v3=True)
    agent, recs = _run(world, [_member(world, 1, 0, LIFT, gpu_mem_limit_mib=3000, mps_thread_pct=40),
                               _member(world, 2, 1, gpu_mem_limit_mib=5000, mps_thread_pct=60)])
    assert [m.state for m in agent.members] == ["COMPLETED", "COMPLETED"]
    state = _daemon_state(world)
    assert state["protocol"] == 3
    # the configuration file gave each member its own namespace with its limits
    assert state["v3_servers"]["pack"]["namespaces"] == {
        "job1": {"pinned_memory_limit_mib": 3000, "active_thread_percentage": 40.0},
        "job2": {"pinned_memory_limit_mib": 5000, "active_thread_percentage": 60.0}}
    client = state["clients"][str(_pid(world, 1))]
    assert client["namespace"] == "job1" and client["requested_limit_mib"] == 99999
    assert client["effective_limit_mib"] == 3000  # the fence, not what the member asked for
    started = next(r for r in recs if r["type"] == "agent" and r["event"] == "mps_started")
    assert started["fence"] == "v3" and started["protocol"] == 3 and started["fence_caps"]["mps_v3"] is True
    running = next(r for r in recs if r["type"] == "member" and r["job_id"] == 1 and r["state"] == "RUNNING")
    assert running["fence"]["kind"] == "v3" and running["fence"]["namespace"] == "job1"
    env = json.loads((world / "env-1.json").read_text())["env"]
    assert env["CUDA_MPS_PIPE_DIRECTORY"].endswith("/pipe/pack/job1")
    assert "fence_env_only" not in _events(recs)


def test_v2_member_lifts_its_own_limit_and_the_agent_says_so_once(tmp_path, monkeypatch):
    world = _world(tmp_path, monkeypatch, v3=False)
    agent, recs = _run(world, [_member(world, 1, 0, LIFT, gpu_mem_limit_mib=3000),
                               _member(world, 2, 0, LIFT, gpu_mem_limit_mib=3000)])
    assert [m.state for m in agent.members] == ["COMPLETED", "COMPLETED"]
    state = _daemon_state(world)
    assert state["protocol"] == 2
    assert state["clients"][str(_pid(world, 1))]["effective_limit_mib"] == 99999  # the hole v2 has
    assert _events(recs).count("fence_env_only") == 1  # once per pack, not per member
    started = next(r for r in recs if r["type"] == "agent" and r["event"] == "mps_started")
    assert started["fence"] == "v2" and "Unrecognized option: -p" in started["fence_caps"]["mps_v3_detail"]


def test_dmem_holds_the_fence_whatever_the_member_sets(tmp_path, monkeypatch):
    world = _world(tmp_path, monkeypatch, v3=False, cgroup="dmem")
    agent, recs = _run(world, [_member(world, 1, 1, LIFT, gpu_mem_limit_mib=3000, estimate_mib=2500)])
    assert agent.members[0].state == "COMPLETED"
    cg = Path(agent.members[0].fence["dmem_cgroup"])
    region = "nvidia/0000:5e:00.0/vidmem"  # GPU 1 in PCI order
    assert (cg / "dmem.max").read_text() == f"{region} {3000 * MIB}\n"  # hard limit = the fence
    assert (cg / "dmem.min").read_text() == f"{region} {2500 * MIB}\n"  # soft limit = the estimate
    assert (cg / "cgroup.procs").read_text().split() == [str(_pid(world, 1))]  # joined before exec
    assert "+dmem" in (cg.parent / "cgroup.subtree_control").read_text()
    assert (cg.parent / "agent" / "cgroup.procs").read_text().split() == [str(os.getpid())]
    assert "fence_env_only" not in _events(recs)  # the kernel holds it: nothing to warn about


# ------------------------------------------------------------------ bad input


def test_a_namespace_the_daemon_refuses_stops_that_member_only(tmp_path, monkeypatch):
    world = _world(tmp_path, monkeypatch, v3=True)
    real = fences.namespace_table

    def with_unknown_key(ns):  # a configuration the daemon refuses, for job 2's namespace
        return {**real(ns), **({"memory_limit": "1G"} if ns.name == "job2" else {})}

    monkeypatch.setattr(fences, "namespace_table", with_unknown_key)
    agent, recs = _run(world, [_member(world, 1, 0), _member(world, 2, 1), _member(world, 3, 1)])
    assert [m.state for m in agent.members] == ["COMPLETED", "FAILED", "COMPLETED"]
    reason = agent.members[1].reason
    assert "\n" not in reason and "unknown key 'servers.pack.namespaces.job2.memory_limit'" in reason
    assert not (world / "env-2.json").exists()  # never started
    assert set(_daemon_state(world)["v3_servers"]["pack"]["namespaces"]) == {"job1", "job3"}


def test_a_limit_above_the_gpu_memory_is_refused_the_others_run(tmp_path, monkeypatch):
    world = _world(tmp_path, monkeypatch, v3=True)
    agent, _ = _run(world, [_member(world, 1, 0, gpu_mem_limit_mib=90 * 1024), _member(world, 2, 0)])
    assert [m.state for m in agent.members] == ["FAILED", "COMPLETED"]
    assert agent.members[0].reason == "gpu_mem_limit_mib 92160 is above GPU 0's memory (81920 MiB)"
    assert set(_daemon_state(world)["v3_servers"]["pack"]["namespaces"]) == {"job2"}


def test_a_gpu_without_a_dmem_region_stops_its_member_only(tmp_path, monkeypatch):
    world = _world(tmp_path, monkeypatch, v3=False, cgroup="one-region")
    agent, _ = _run(world, [_member(world, 1, 0), _member(world, 2, 1)])
    assert [m.state for m in agent.members] == ["COMPLETED", "FAILED"]
    assert agent.members[1].reason == "dmem: no nvidia region for GPU 1 in dmem.capacity (1 listed)"


def test_dmem_on_without_the_controller_names_it(tmp_path, monkeypatch):
    world = _world(tmp_path, monkeypatch, v3=False, cgroup="no-dmem")
    agent, recs = _run(world, [_member(world, 1, 0)], dmem_mode="on")
    assert agent.members[0].state == "FAILED"
    assert agent.members[0].reason.startswith("mps.dmem = on but no dmem controller in ")
    # auto on the same node: no dmem, MPS v2, the member runs
    agent, recs = _run(world, [_member(world, 4, 0)])
    assert agent.members[0].state == "COMPLETED"


def test_mode_v3_on_a_node_without_it_starts_no_member(tmp_path, monkeypatch):
    world = _world(tmp_path, monkeypatch, v3=False)
    agent, _ = _run(world, [_member(world, 1, 0)], fence_mode="v3")
    assert agent.members[0].state == "FAILED"
    assert agent.members[0].reason.startswith("mps.mode = v3 but this node has no MPS v3: ")


def test_a_joiner_gets_its_namespace_from_the_running_daemon(tmp_path, monkeypatch):
    world = _world(tmp_path, monkeypatch, v3=True)
    pack = world / "pack"
    joins = pack / "joins"
    joins.mkdir(parents=True)
    joiner = _member(world, 9, 1, LIFT, gpu_mem_limit_mib=2048, mps_thread_pct=30)
    (joins / "9.json").write_text(json.dumps(joiner))
    data = placement_dict(pack, [_member(world, 1, 0, ["--steps", "10", "--step-s", "0.05"])], sample_interval_s=0.1)
    data["join_grace_s"] = 0.5
    agent = Agent(parse_placement(data), AgentOptions(node_index=0, node_name="n1", gpus=["0", "1"],
                                                      tmp_root=str(world / "tmp"), heartbeat_every_s=0.5))
    agent.run()
    assert [m.state for m in agent.members] == ["COMPLETED", "COMPLETED"]
    state = _daemon_state(world)
    assert state["v3_servers"]["pack"]["namespaces"]["job9"] == {"pinned_memory_limit_mib": 2048,
                                                                 "active_thread_percentage": 30.0}
    assert any(c.startswith("namespace create --server=pack --name=job9") for c in state["commands"])
    assert state["clients"][str(_pid(world, 9))]["effective_limit_mib"] == 2048


# ------------------------------------------------------------------ the fake and the pure parts


def test_fake_v3_daemon_follows_the_documented_interface(tmp_path, monkeypatch):
    exe = fake_mps_control.install_launcher(tmp_path / "bin", v3=True)
    old = fake_mps_control.install_launcher(tmp_path / "old")
    assert fences.probe_mps_v3(str(exe))[0] is True
    ok, why = fences.probe_mps_v3(str(old))
    assert not ok and why.endswith("Unrecognized option: -p")
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "p"), "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "l")}

    def run(*argv, stdin=None, **extra):
        return subprocess.run([str(exe), *argv], input=stdin, env={**env, **extra},  # noqa: S603 - our fake
                              capture_output=True, text=True, timeout=30)

    cfg = tmp_path / "c.toml"
    # unknown server key: a configuration error, one line, no daemon (MPS v3 Configuration File)
    cfg.write_text('schema_version = "1.0"\n[servers.s]\nuid = 1\nmax_clients = 4\n')
    proc = run("-d", "-p", "3", "-a", str(cfg))
    assert proc.returncode == 1 and "unknown key 'servers.s.max_clients'" in proc.stderr
    assert not (tmp_path / "p" / fake_mps_control.PID_FILE).exists()
    # CUDA_MPS_PROTOCOL_VERSION=3 wins over -p 2; a v3 daemon refuses the legacy shell
    cfg.write_text(fences.v3_config_toml(os.getuid(), [fences.NamespaceLimits("a", 1024, 50)]))
    assert run("-d", "-p", "2", "-a", str(cfg), CUDA_MPS_PROTOCOL_VERSION="3").returncode == 0
    try:
        legacy = run(stdin="get_server_list\n")
        assert legacy.returncode == 1 and "protocol 3" in legacy.stderr
        out = run("namespace", "get", "--server=pack", "--name=a")
        assert out.returncode == 0 and "pinned_memory_limit_mib=1024" in out.stdout
        bad = run("namespace", "set", "--server=pack", "--name=a", "--active-thread-percentage=150")
        assert bad.returncode == 1 and "outside 1..100" in bad.stderr
    finally:
        assert run("-q").returncode == 0


def test_config_round_trips_through_the_fakes_parser():
    ns = [fences.NamespaceLimits("job1", 3000, 40), fences.NamespaceLimits("job2", 8192, 60, "GPU-abc", 4)]
    servers = fake_mps_control.parse_v3_config(fences.v3_config_toml(1000, ns))
    assert servers["pack"]["uid"] == 1000
    assert servers["pack"]["namespaces"]["job1"] == {"pinned_memory_limit_mib": 3000, "active_thread_percentage": 40.0}
    assert servers["pack"]["namespaces"]["job2"]["sm_partition"] == "job2"
    assert servers["pack"]["sm_partitions"] == {"job2": {"uuid": "GPU-abc", "chunks": 4}}
    assert fences.mem_value(8192) == "8G" and fences.mem_value(3000) == "3000M"


def test_mode_choice_and_region_lookup():
    caps = fences.FenceCaps("550.54", "x", False, "no v3", True, False, "no dmem")
    assert fences.choose_mode("auto", caps) == "v2" and fences.choose_mode("v2", caps) == "v2"
    with pytest.raises(fences.FenceError, match="mps.mode = v3 but this node has no MPS v3: no v3"):
        fences.choose_mode("v3", caps)
    assert fences.use_dmem("auto", caps) is False
    with pytest.raises(fences.FenceError, match="mps.dmem = on but no dmem"):
        fences.use_dmem("on", caps)
    assert fences.region_for_gpu(REGIONS, 0, "00000000:5E:00.0") == "nvidia/0000:5e:00.0/vidmem"
    assert fences.region_for_gpu(REGIONS, 0) == "nvidia/0000:3b:00.0/vidmem"


def test_admin_check_fences_reports_what_the_site_requires_and_the_host_lacks(tmp_path, monkeypatch):
    import tomllib

    from click.testing import CliRunner

    from slurm_dlrm.cli import cli
    from slurm_dlrm.commands import admin as admin_cmd
    from slurm_dlrm.site import REPO_SITE_FILE

    exe = fake_mps_control.install_launcher(tmp_path / "bin")  # a driver before r615
    croot = tmp_path / "cg"
    fences.make_fake_cgroup_tree(croot, REGIONS, dmem=False)
    text = REPO_SITE_FILE.read_text().replace('mode = "auto"', 'mode = "v3"').replace('dmem = "auto" ', 'dmem = "on" ')
    text = text.replace('mps_control_command = "nvidia-cuda-mps-control"', f'mps_control_command = "{exe}"')
    text = text.replace('cgroup_root = "/sys/fs/cgroup"', f'cgroup_root = "{croot}"')
    site = tmp_path / "site.toml"
    site.write_text(text)
    assert tomllib.loads(text)["mps"]["mode"] == "v3"
    monkeypatch.setattr(admin_cmd, "_live_records", lambda: ([], [], {}))
    monkeypatch.setenv(fake_nvml.ENV_FAKE_NVML, str(tmp_path / "nvml.json"))
    (tmp_path / "nvml.json").write_text(json.dumps({"gpu_count": 1}))
    result = CliRunner().invoke(cli, ["admin", "check", "--site", str(site), "--fences", "--json"])
    assert result.exit_code == 1
    out = json.loads(result.stdout)
    gaps = {d["field"]: d for d in out["differences"] if d["subject"].startswith("host ")}
    assert gaps["mps.mode"]["site"] == "v3" and "Unrecognized option: -p" in gaps["mps.mode"]["cluster"]
    assert gaps["mps.dmem"]["site"] == "on" and "no dmem controller" in gaps["mps.dmem"]["cluster"]
    assert out["fences"]["mps_v3"] is False and out["fences"]["driver_version"] == "550.54.15"


def test_a_cgroup_the_agent_may_not_divide_skips_dmem_with_auto(tmp_path, monkeypatch):
    world = _world(tmp_path, monkeypatch, v3=False, cgroup="dmem")
    own = fences.own_cgroup(world / "cgroup")
    (own / "agent").write_text("")  # a file where the leaf must go: mkdir fails like a root-owned cgroup
    agent, recs = _run(world, [_member(world, 1, 0)])
    assert agent.members[0].state == "COMPLETED" and agent.dmem is None
    (event,) = [r for r in recs if r["type"] == "agent" and r["event"] == "dmem_not_applied"]
    assert event["detail"].startswith("dmem: cannot create ") and "going on without dmem" in event["detail"]
    assert "fence_env_only" in _events(recs)  # nothing else holds it on this v2 node
    agent, _ = _run(world, [_member(world, 2, 0)], dmem_mode="on")
    assert agent.members[0].state == "FAILED" and agent.members[0].reason.startswith("dmem: cannot create ")


def test_sm_partition_for_a_member_that_asks_for_isolation_on_r620(tmp_path, monkeypatch):
    world = _world(tmp_path, monkeypatch, v3=True)
    (world / "nvml.json").write_text(json.dumps({"gpu_count": 2, "driver_version": "620.3"}))
    isolated = _member(world, 1, 1)
    isolated["sm_chunks"] = 4
    agent, _ = _run(world, [isolated, _member(world, 2, 1)])
    assert [m.state for m in agent.members] == ["COMPLETED", "COMPLETED"]
    server = _daemon_state(world)["v3_servers"]["pack"]
    (part,) = server["sm_partitions"].values()
    assert part["chunks"] == 4 and part["uuid"] == agent._gpu_uuid[1]
    assert server["namespaces"]["job1"]["sm_partition"] == "job1" and "sm_partition" not in server["namespaces"]["job2"]
    # on r615 the namespace schema has no devices key: no partition is asked for
    world2 = _world(tmp_path / "r615", monkeypatch, v3=True)
    isolated = _member(world2, 3, 1)
    isolated["sm_chunks"] = 4
    agent, _ = _run(world2, [isolated])
    assert agent.members[0].state == "COMPLETED" and _daemon_state(world2)["v3_servers"]["pack"]["sm_partitions"] == {}


def test_each_rank_of_a_job_has_its_own_v3_namespace_and_dmem_cgroup(tmp_path, monkeypatch):
    world = _world(tmp_path, monkeypatch, v3=True, cgroup="dmem")
    ranks = rank_entries(_member(world, 5, 0, LIFT), [0, 1], gpu_mem_limit_mib=[3000, 4000], mps_thread_pct=[40, 60])
    agent, recs = _run(world, ranks)
    assert agent.job_states == {5: "COMPLETED"}
    assert _daemon_state(world)["v3_servers"]["pack"]["namespaces"] == {
        "job5-r0": {"pinned_memory_limit_mib": 3000, "active_thread_percentage": 40.0},
        "job5-r1": {"pinned_memory_limit_mib": 4000, "active_thread_percentage": 60.0}}
    for r, m in enumerate(agent.members):
        env = json.loads((world / f"env-5.json.rank{r}").read_text())
        assert env["env"]["CUDA_MPS_PIPE_DIRECTORY"].endswith(f"/pipe/pack/job5-r{r}")
        client = _daemon_state(world)["clients"][str(env["pid"])]
        assert client["effective_limit_mib"] == (3000, 4000)[r]  # its own fence, whatever it asked for
        assert Path(m.fence["dmem_cgroup"]).name == f"member-5-r{r}"
        assert m.fence["dmem_max_bytes"] == (3000, 4000)[r] * MIB
