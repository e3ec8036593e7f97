"""admin check's comparison, on `scontrol show node|partition -o` pasted from a local
Slurm 22.05.8 cluster started with the rendered files of SITE below."""

from __future__ import annotations

import tomllib

import pytest

from slurm_dlrm.admin.check import (
    check_job_submit_script,
    compare,
    compare_config,
    nodes_from_scontrol,
    nodes_from_seam,
    parse_gres,
    parse_scontrol_config,
    parse_scontrol_output,
    parse_time_limit_minutes,
    partitions_from_scontrol,
    partitions_from_sinfo,
)
from slurm_dlrm.admin.render import build_context, render_site
from slurm_dlrm.site import parse_site
from slurm_dlrm.slurm.parse import parse_scontrol_nodes, parse_sinfo

SITE = """
[site]
name = "exp"
[gpu_models.h100]
memory_gib = 80
sm_count = 132
mem_bandwidth_gbps = 3350
fp32_tflops = 67.0
tf32_tflops = 494.0
cuda_context_mib = 520
cublas_workspace_mib = 32
[gpu_models.a100]
memory_gib = 40
sm_count = 108
mem_bandwidth_gbps = 1555
fp32_tflops = 19.5
tf32_tflops = 156.0
cuda_context_mib = 450
cublas_workspace_mib = 8
[[nodes]]
names = "node[1-2]"
gpu_model = "h100"
gpus = 2
cpus = 4
memory_mib = 4000
gpu_device_files = "/tmp/admin-exp/dev/nvidia{i}"
node_addr = "127.0.0.1"
slurmd_port = 27821
[[partitions]]
name = "dlrm"
nodes = "node[1-2]"
default = true
max_time_minutes = 60
max_gpus_per_job = 4
[mps]
shards_per_gpu = 8
[slurm]
config_dir = "/tmp/admin-exp"
script_dir = "/tmp/admin-exp/scripts"
slurm_user = "root"
mps_control_command = "/tmp/admin-exp/bin/nvidia-cuda-mps-control"
mps_pipe_root = "/tmp/admin-exp/mps"
mps_log_root = "/tmp/admin-exp/mpslog"
shm_dir = "/dev/shm"
accounting_tres = false
"""

NODES = """\
NodeName=node1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=4 CPUTot=4 CPULoad=4.62 AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:h100:2,mps:h100:200,shard:h100:16 NodeAddr=127.0.0.1 NodeHostName=node1 Port=27821 Version=22.05.8 OS=Linux 6.18.44-fc-v657 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=4000 AllocMem=0 FreeMem=20751 Sockets=4 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=dlrm  BootTime=2026-11-22T00:13:26 SlurmdStartTime=2026-11-22T00:32:58 LastBusyTime=2026-11-22T00:33:21 CfgTRES=cpu=4,mem=4000M,billing=4 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s
NodeName=node2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=4 CPUTot=4 CPULoad=4.62 AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:h100:2,mps:h100:200,shard:h100:16 NodeAddr=127.0.0.1 NodeHostName=node2 Port=27822 Version=22.05.8 OS=Linux 6.18.44-fc-v657 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=4000 AllocMem=0 FreeMem=20751 Sockets=4 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=dlrm  BootTime=2026-11-22T00:13:26 SlurmdStartTime=2026-11-22T00:32:58 LastBusyTime=2026-11-22T00:32:58 CfgTRES=cpu=4,mem=4000M,billing=4 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s
"""

PARTITIONS = """\
PartitionName=dlrm AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED MaxTime=01:00:00 MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=node[1-2] PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=8 TotalNodes=2 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED TRES=cpu=8,mem=8000M,node=2,billing=8
"""


def site(**changes):
    raw = tomllib.loads(SITE)
    for dotted, value in changes.items():
        where = raw
        *path, key = dotted.split(".")
        for p in path:
            where = where[int(p)] if p.isdigit() else where[p]
        where[key] = value
    return parse_site(raw)


def diffs(s=None, nodes=NODES, partitions=PARTITIONS):
    return [str(d) for d in compare(s or site(), nodes_from_scontrol(parse_scontrol_output(nodes)),
                                    partitions_from_scontrol(parse_scontrol_output(partitions)))]


def test_the_config_that_made_the_cluster_matches():
    assert diffs() == []


@pytest.mark.parametrize("change, expected", [
    ({"nodes.0.gpus": 4}, ["node node1: gres/gpu: site h100:4, cluster h100:2",
                           "node node1: gres/mps: site 400, cluster 200",
                           "node node1: gres/shard: site 32, cluster 16"]),
    ({"mps.mps_per_gpu": 50}, ["node node1: gres/mps: site 100, cluster 200"]),
    ({"mps.shards_per_gpu": 0}, ["node node1: gres/shard: site -, cluster h100:16"]),
    ({"mps.enabled": False}, ["node node1: gres/mps: site -, cluster h100:200"]),
    ({"nodes.0.gpu_model": "a100"}, ["node node1: gres/gpu: site a100:2, cluster h100:2"]),
    ({"nodes.0.cpus": 8}, ["node node1: CPUs: site 8, cluster 4"]),
    ({"nodes.0.memory_mib": 4096}, ["node node1: RealMemory: site 4096, cluster 4000"]),
    ({"nodes.0.names": "node[1-3]", "partitions.0.nodes": "node[1-3]"},
     ["node node3: NodeName: site defined, cluster -", "partition dlrm: Nodes: site node[1-3], cluster node[1-2]"]),
    ({"partitions.0.max_time_minutes": 90}, ["partition dlrm: MaxTime: site 90 min, cluster 60 min"]),
    ({"partitions.0.default": False}, ["partition dlrm: Default: site NO, cluster YES"]),
    ({"partitions.0.name": "dlrm2"}, ["partition dlrm2: PartitionName: site defined, cluster -"]),
])
def test_one_changed_value_is_named(change, expected):
    got = diffs(site(**change))
    # Each node of the group shows the same node difference; look at node1 and partitions.
    assert [d for d in got if not d.startswith("node node2")] == expected


def test_parsers():
    nodes = parse_scontrol_output(NODES)
    assert [n["NodeName"] for n in nodes] == ["node1", "node2"]
    assert nodes[0]["OS"].startswith("Linux ") and nodes[0]["RealMemory"] == "4000"
    assert parse_gres("gpu:h100:4(S:0,1),mps:h100:400,shard:32")["shard"].count == 32
    assert parse_gres("(null)") == {}
    assert [parse_time_limit_minutes(v) for v in ("UNLIMITED", "1-00:00:00", "01:00:00", "30", "00:00:30")] == [
        None, 1440, 60, 30, 1]


# `sinfo --json` and `sinfo --format ...` of the same cluster (what SlurmClient parses).
SINFO = """\
dlrm*|up|idle|node[1-2]|2|4|4000|gpu:h100:2,mps:h100:200,shard:h100:16|1:00:00
"""


def test_seam_records_compare_like_scontrol_records():
    nodes = nodes_from_seam(parse_scontrol_nodes(NODES))
    partitions = partitions_from_sinfo(parse_sinfo(SINFO))
    assert compare(site(), nodes, partitions) == []
    changed = [str(d) for d in compare(site(**{"mps.mps_per_gpu": 50}), nodes, partitions)]
    assert changed == ["node node1: gres/mps: site 100, cluster 200", "node node2: gres/mps: site 100, cluster 200"]


def test_sinfo_rows_of_one_partition_merge():
    rows = parse_sinfo("dlrm*|up|idle|node1|1|4|4000|gpu:h100:2|1:00:00\n"
                       "dlrm*|up|allocated|node2|1|4|4000|gpu:h100:2|1:00:00\n")
    (p,) = partitions_from_sinfo(rows)
    assert p.nodes == ("node1", "node2") and p.default and p.max_time_minutes == 60


# `scontrol show config` of the same cluster (only the keys admin check reads, plus neighbours).
CONFIG = """\
Configuration data as of 2026-11-22T00:46:16
AccountingStorageTRES   = cpu,mem,energy,node,billing,fs/disk,vmem,pages
ClusterName             = exp
Epilog                  = /tmp/admin-exp/scripts/epilog.sh
EpilogMsgTime           = 2000 usec
GresTypes               = gpu,mps,shard
JobSubmitPlugins        = lua
Prolog                  = /tmp/admin-exp/scripts/prolog.sh
PrologEpilogTimeout     = 65534
PrologFlags             = Alloc
SelectType              = select/cons_tres
SelectTypeParameters    = CR_CORE_MEMORY
SlurmctldPort           = 27817
TaskProlog              = /tmp/admin-exp/scripts/task_prolog.sh
"""


def test_config_that_made_the_cluster_matches():
    assert compare_config(site(), parse_scontrol_config(CONFIG)) == []


def test_indexed_prolog_epilog_of_newer_releases():
    # 23.11+ print `Prolog[0] = ...` (one line per script) where 22.05 printed `Prolog = ...`.
    indexed = CONFIG.replace("Prolog                  =", "Prolog[0]               =") \
        .replace("Epilog                  =", "Epilog[0]               =")
    assert "Prolog[0]" in indexed and "Epilog[0]" in indexed
    assert parse_scontrol_config(indexed)["Prolog"] == parse_scontrol_config(CONFIG)["Prolog"]
    assert compare_config(site(), parse_scontrol_config(indexed)) == []
    two = parse_scontrol_config(indexed + "Prolog[1]               = /etc/slurm/other.sh\n")
    assert two["Prolog"] == parse_scontrol_config(CONFIG)["Prolog"] + ",/etc/slurm/other.sh"


@pytest.mark.parametrize("change, expected", [
    ({"mps.shards_per_gpu": 0}, ["config: GresTypes: site gpu,mps, cluster gpu,mps,shard "
                                 '(the fragment drops shard: keep with [slurm] site_gres_types = "shard")']),
    ({"slurm.script_dir": "/etc/slurm/dlrm"}, [
        f"config: {key}: site /etc/slurm/dlrm/{name}.sh, cluster /tmp/admin-exp/scripts/{name}.sh (the fragment "
        f'replaces /tmp/admin-exp/scripts/{name}.sh: set [slurm] site_{name} = "/tmp/admin-exp/scripts/{name}.sh" '
        "so ours runs it)"
        for key, name in (("Prolog", "prolog"), ("Epilog", "epilog"), ("TaskProlog", "task_prolog"))]),
    ({"slurm.select_type_parameters": "CR_CPU_Memory"},
     ["config: SelectTypeParameters: site CR_CPU_Memory, cluster CR_CORE_MEMORY "
      "(the fragment sets [slurm] select_type_parameters)"]),
    # The item Slurm lacks is named (Slurm's own default TRES are never the site's to keep).
    ({"slurm.accounting_tres": True}, [
        "config: AccountingStorageTRES: site gres/gpu,gres/gpu:h100,gres/mps,gres/shard, "
        "cluster cpu,mem,energy,node,billing,fs/disk,vmem,pages (missing gres/gpu,gres/gpu:h100,gres/mps,gres/shard)"]),
])
def test_config_differences_are_named(change, expected):
    assert [str(d) for d in compare_config(site(**change), parse_scontrol_config(CONFIG))] == expected


def test_missing_plugin_and_prolog_flags():
    config = parse_scontrol_config(CONFIG)
    config.update(JobSubmitPlugins="(null)", PrologFlags="Contain")
    assert [str(d) for d in compare_config(site(), config)] == [
        "config: JobSubmitPlugins: site lua, cluster - (missing lua)",
        "config: PrologFlags: site Alloc, cluster Contain "
        '(missing Alloc; the fragment drops Contain: keep with [slurm] site_prolog_flags = "Contain")']


def test_one_missing_tres_item_is_named():
    config = parse_scontrol_config(CONFIG)
    config["AccountingStorageTRES"] = "cpu,mem,energy,node,billing,fs/disk,vmem,pages,gres/gpu,gres/mps,gres/shard"
    (d,) = compare_config(site(**{"slurm.accounting_tres": True}), config)
    assert d.field == "AccountingStorageTRES" and d.note == "missing gres/gpu:h100"


def test_tres_slurm_adds_for_gpus_are_not_the_sites_to_keep():
    """24.11 and 26.05 list gres/gpumem and gres/gpuutil as soon as gres/gpu is tracked
    (their `scontrol show config` of the local cluster's installed fragment): not a drop."""
    config = parse_scontrol_config(CONFIG)
    config["AccountingStorageTRES"] = ("cpu,mem,energy,node,billing,fs/disk,vmem,pages,gres/gpu,gres/gpu:h100,"
                                       "gres/gpumem,gres/gpuutil,gres/mps,gres/shard")
    assert compare_config(site(**{"slurm.accounting_tres": True}), config) == []


# What a cluster with its own settings has before slurm-dlrm is installed.
SITE_OWN = {"GresTypes": "gpu,fpga", "JobSubmitPlugins": "require_timelimit,lua", "PrologFlags": "Contain,X11",
            "Prolog": "/etc/slurm/prolog.d/*", "Epilog": "/etc/slurm/epilog.sh", "TaskProlog": "(null)",
            "AccountingStorageTRES": "cpu,mem,energy,node,billing,fs/disk,vmem,pages,license/matlab"}


def test_check_names_every_setting_the_fragment_would_change_and_what_keeps_it():
    config = {**parse_scontrol_config(CONFIG), **SITE_OWN}
    diffs = {d.field: d for d in compare_config(site(**{"slurm.accounting_tres": True}), config)}
    assert set(diffs) == {"GresTypes", "JobSubmitPlugins", "Prolog", "Epilog", "TaskProlog", "PrologFlags",
                          "AccountingStorageTRES"}
    assert diffs["GresTypes"].note == 'missing mps,shard; the fragment drops fpga: keep with [slurm] site_gres_types = "fpga"'
    assert "drops require_timelimit" in diffs["JobSubmitPlugins"].note
    assert 'site_prolog = "/etc/slurm/prolog.d/*" so ours runs it' in diffs["Prolog"].note
    assert 'site_epilog = "/etc/slurm/epilog.sh"' in diffs["Epilog"].note
    assert diffs["TaskProlog"].note == "not installed"
    assert 'site_prolog_flags = "Contain,X11"' in diffs["PrologFlags"].note
    assert "missing gres/gpu,gres/gpu:h100,gres/mps,gres/shard" in diffs["AccountingStorageTRES"].note
    assert 'site_accounting_tres = "license/matlab"' in diffs["AccountingStorageTRES"].note


def test_with_the_site_keys_the_fragment_keeps_the_clusters_settings():
    keep = {"slurm.accounting_tres": True, "slurm.site_gres_types": "fpga",
            "slurm.site_job_submit_plugins": "require_timelimit", "slurm.site_prolog": "/etc/slurm/prolog.d/*",
            "slurm.site_epilog": "/etc/slurm/epilog.sh", "slurm.site_prolog_flags": "Contain,X11",
            "slurm.site_accounting_tres": "license/matlab"}
    s = site(**keep)
    before = {**parse_scontrol_config(CONFIG), **SITE_OWN}
    diffs = {d.field: d for d in compare_config(s, before)}
    # Still changes (ours must be installed), but nothing of the cluster's is dropped.
    assert not any("drops" in d.note or "replaces" in d.note for d in diffs.values()), diffs
    assert diffs["Prolog"].note == "ours runs /etc/slurm/prolog.d/* first ([slurm] site_prolog)"
    # The rendered fragment, as slurmctld would then run it: no difference left.
    ctx = build_context(s)["slurm_conf"]
    after = {**before, "GresTypes": ctx["gres_types"], "JobSubmitPlugins": ctx["job_submit_plugins"],
             "PrologFlags": ctx["prolog_flags"], "Prolog": ctx["scripts"]["prolog"],
             "Epilog": ctx["scripts"]["epilog"], "TaskProlog": ctx["scripts"]["task_prolog"],
             "AccountingStorageTRES": "cpu,mem,energy,node,billing,fs/disk,vmem,pages," + ctx["accounting_storage_tres"]}
    assert ctx["gres_types"] == "fpga,gpu,mps,shard" and ctx["prolog_flags"] == "Contain,X11,Alloc"
    assert ctx["job_submit_plugins"] == "require_timelimit,lua"
    assert ctx["accounting_storage_tres"] == "license/matlab,gres/gpu,gres/gpu:h100,gres/mps,gres/shard"
    assert compare_config(s, after) == []


def test_a_site_job_submit_lua_that_does_not_call_the_module_is_named():
    s = site()
    assert check_job_submit_script(s, None) == []  # not readable here: nothing claimed
    files = {f.name: f.text for f in render_site(s)}
    assert check_job_submit_script(s, files["job_submit.lua"]) == []
    chained = 'local m = dofile("/tmp/admin-exp/slurm_dlrm_submit.lua")\nfunction slurm_job_submit() end\n'
    assert check_job_submit_script(s, chained) == []
    (d,) = check_job_submit_script(s, "function slurm_job_submit() return slurm.SUCCESS end\n")
    assert d.field == "job_submit.lua" and "Installs that chain" in d.note
