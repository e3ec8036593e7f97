import tomllib

import pytest

from slurm_dlrm.errors import ConfigError
from slurm_dlrm.site import REPO_SITE_FILE, expand_hostlist, load_site, parse_site


def raw():
    return tomllib.loads(REPO_SITE_FILE.read_text())


def test_example_site_loads():
    site = load_site(REPO_SITE_FILE)
    assert site.gpu_models["h100"].memory_bytes == 80 * 2**30
    assert site.nodes[0].hostnames == ["node1", "node2"]
    assert site.default_partition.name == "dlrm"


@pytest.mark.parametrize(
    "mutate, key",
    [
        (lambda d: d["packing"].update(policy="best"), "packing.policy"),
        (lambda d: d["packing"].update(memory_margin_pct=-1), "packing.memory_margin_pct"),
        (lambda d: d["gpu_models"]["h100"].update(sm_count="many"), "gpu_models.h100.sm_count"),
        (lambda d: d["mps"].update(colour="red"), "mps.colour"),
        (lambda d: d["nodes"][0].update(gpus=True), "nodes[0].gpus"),
        (lambda d: d["partitions"][0].update(nodes="node9"), "partitions[0].nodes"),
        (lambda d: d["nodes"][0].update(gpu_model="v100"), "nodes[0].gpu_model"),
        (lambda d: d.update(extra=1), "extra"),
    ],
)
def test_bad_values_name_the_key(mutate, key):
    d = raw()
    mutate(d)
    with pytest.raises(ConfigError) as err:
        parse_site(d)
    assert err.value.key == key
    assert "\n" not in str(err.value)


def test_hostlist():
    assert expand_hostlist("n[01-03,7],gpu") == ["n01", "n02", "n03", "n7", "gpu"]
