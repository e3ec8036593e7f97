"""The site keys the admin renderer added: [slurm], nodes' test-cluster addresses, enforce."""

import tomllib

import pytest

from slurm_dlrm.errors import ConfigError
from slurm_dlrm.site import REPO_SITE_FILE, parse_site


def raw():
    return tomllib.loads(REPO_SITE_FILE.read_text())


def test_defaults():
    d = raw()
    del d["slurm"]
    site = parse_site(d)
    assert site.slurm.mps_pipe_root == "/run/slurm-dlrm/mps"
    assert site.partitions[0].enforce is True
    assert site.nodes[0].slurmd_port == 0


@pytest.mark.parametrize(
    "mutate, key",
    [
        (lambda d: d["slurm"].update(script_dir="etc/slurm"), "slurm.script_dir"),
        (lambda d: d["slurm"].update(mps_pipe_root="/tmp/with space"), "slurm.mps_pipe_root"),
        (lambda d: d["slurm"].update(mps_pipe_root="/" + "x" * 80), "slurm.mps_pipe_root"),
        (lambda d: d["slurm"].update(shm_dir="/dev/shm'"), "slurm.shm_dir"),
        (lambda d: d["slurm"].update(script_dir="/etc/slurm#x"), "slurm.script_dir"),
        (lambda d: d["slurm"].update(slurm_user="Root User"), "slurm.slurm_user"),
        (lambda d: d["slurm"].update(select_type_parameters="CR_Core"), "slurm.select_type_parameters"),
        (lambda d: d["slurm"].update(mps_control_command="nvidia-cuda-mps-control -d"), "slurm.mps_control_command"),
        (lambda d: d["slurm"].update(mps_start_timeout_s=0), "slurm.mps_start_timeout_s"),
        (lambda d: d["slurm"].update(colour=1), "slurm.colour"),
        (lambda d: d["nodes"][0].update(gpu_device_files="/dev/nvidia0"), "nodes[0].gpu_device_files"),
        (lambda d: d["nodes"][0].update(gpu_device_files="dev/nvidia{i}"), "nodes[0].gpu_device_files"),
        (lambda d: d["nodes"][0].update(slurmd_port=70000), "nodes[0].slurmd_port"),
        (lambda d: d["nodes"][0].update(gpu_device_files="/dev/{host}/nvidia{i}"), "nodes[0].gpu_device_files"),
        (lambda d: d["nodes"][0].update(node_addr="a b"), "nodes[0].node_addr"),
        (lambda d: d["partitions"][0].update(min_mps_share=101), "partitions[0].min_mps_share"),
        (lambda d: d["partitions"][0].update(name="dl rm"), "partitions[0].name"),
        (lambda d: d["partitions"].append(dict(d["partitions"][0], default=False)), "partitions[1].name"),
        (lambda d: d["partitions"][0].update(enforce="yes"), "partitions[0].enforce"),
        (lambda d: d["gpu_models"].update({"h 100": d["gpu_models"]["h100"]}), "gpu_models.h 100"),
    ],
)
def test_bad_values_name_the_key(mutate, key):
    d = raw()
    mutate(d)
    with pytest.raises(ConfigError) as err:
        parse_site(d)
    assert err.value.key == key
    assert "\n" not in str(err.value)


def test_nvml_and_single_device_file_are_fine():
    d = raw()
    d["nodes"][0].update(gpu_device_files="nvml")
    assert parse_site(d).nodes[0].uses_nvml
    d["nodes"][0].update(gpu_device_files="/dev/nvidia0", gpus=1)
    assert parse_site(d).nodes[0].gpu_device_file(0) == "/dev/nvidia0"
