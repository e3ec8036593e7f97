"""Golden files of `slurm-dlrm admin render`, plus checks that hold for any site.

Regenerate the golden files after an intended change with:

    SLURM_DLRM_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/test_admin_render.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_dlrm.admin.render import build_context, lua_str, render_site, sh_quote, write_rendered
from slurm_dlrm.cli import cli
from slurm_dlrm.site import REPO_SITE_FILE, load_site, parse_site

GOLDEN = Path(__file__).parent / "golden" / "admin"
SITES = {"example": REPO_SITE_FILE, "variant": GOLDEN / "variant" / "site.toml"}
REGEN = os.environ.get("SLURM_DLRM_REGEN_GOLDEN") == "1"


@pytest.mark.parametrize("case", sorted(SITES))
def test_golden(case):
    files = render_site(load_site(SITES[case]))
    folder = GOLDEN / case
    if REGEN:
        for f in files:
            dest = folder / f.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(f.text)
    for f in files:
        golden = folder / f.name
        assert golden.is_file(), f"no golden file {golden}; regenerate (see module docstring)"
        assert f.text == golden.read_text(), f"{case}/{f.name} differs from its golden file"
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != "site.toml"}
    assert on_disk == {f.name for f in files}, "stale golden files"


def test_variant_renders_what_the_site_asks_for():
    files = {f.name: f.text for f in render_site(load_site(SITES["variant"]))}
    # No MPS: no prolog scripts, no Prolog= lines, no gres/mps anywhere.
    assert not any(name.startswith("scripts/") for name in files)
    assert "Prolog=" not in files["slurm-dlrm.conf"] and "Name=mps" not in files["gres.conf"]
    # Test-cluster nodes get one line each with consecutive ports.
    assert "NodeName=small2 CPUs=16 RealMemory=64000 Gres=gpu:l4:2,shard:8 NodeAddr=127.0.0.1 Port=17002" in files[
        "slurm-dlrm.conf"]
    assert "NodeName=gpu[01-04] AutoDetect=nvml" in files["gres.conf"]


def test_context_bounds_come_from_the_inventory():
    ctx = build_context(load_site(SITES["variant"]))
    rules = {r["name"]: r for r in ctx["job_submit"]["partitions"]}
    # debug mixes l4 (24 GiB) and a100 (40 GiB) nodes: the smaller GPU bounds gpu_mem_mib.
    assert rules["debug"]["gpu_mem_mib_max"] == 24 * 1024
    assert rules["debug"]["max_gpus_per_node"] == 8
    assert rules["dlrm-big"]["max_gpus_per_node"] == 8 and rules["dlrm-big"]["enforce"] is True
    assert ctx["job_submit"]["default_partition"] == "debug"


@pytest.mark.parametrize(("mode", "dmem"), [("auto", "auto"), ("v3", "on"), ("v2", "off")])
def test_fence_keys_reach_the_prolog(mode, dmem):
    raw = tomllib.loads(REPO_SITE_FILE.read_text())
    raw["mps"].update(mode=mode, dmem=dmem)
    raw["slurm"].update(cgroup_root="/sys/fs/cgroup", job_cgroup="slurm.slice/job_{job_id}")
    files = {f.name: f.text for f in render_site(parse_site(raw))}
    prolog = files["scripts/prolog.sh"]
    assert f"\nFENCE_MODE={mode}\n" in prolog and f"\nDMEM_MODE={dmem}\n" in prolog
    assert "\nJOB_CGROUP='slurm.slice/job_{job_id}'\n" in prolog
    # the task prolog exports the memory variable only for a v2 daemon (the prolog's record)
    assert "${proto:-2} != 3" in files["scripts/task_prolog.sh"]


def test_bad_fence_keys_are_one_line():
    raw = tomllib.loads(REPO_SITE_FILE.read_text())
    raw["mps"]["mode"] = "v4"
    with pytest.raises(Exception, match="mps.mode"):
        parse_site(raw)
    raw = tomllib.loads(REPO_SITE_FILE.read_text())
    raw["slurm"]["job_cgroup"] = "/abs/job_{job_id}; rm -rf /"
    with pytest.raises(Exception, match="slurm.job_cgroup"):
        parse_site(raw)


def test_thread_pct_workaround_only_with_shards():
    raw = tomllib.loads(REPO_SITE_FILE.read_text())
    assert build_context(parse_site(raw))["mps_scripts"]["recompute_thread_pct"] is True
    raw["mps"]["shards_per_gpu"] = 0
    assert build_context(parse_site(raw))["mps_scripts"]["recompute_thread_pct"] is False


def test_scripts_pass_shellcheck(tmp_path):
    if shutil.which("shellcheck") is None:
        # CI runs scripts/setup.sh, which installs it: missing there is a failure.
        ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
        (pytest.fail if ci else pytest.skip)("shellcheck not installed (scripts/setup.sh installs it)")
    write_rendered(render_site(load_site(REPO_SITE_FILE)), tmp_path)
    scripts = sorted(str(p) for p in (tmp_path / "scripts").glob("*.sh"))
    assert len(scripts) == 3
    subprocess.run(["shellcheck", *scripts], check=True, timeout=60)  # noqa: S603


def test_scripts_parse_in_bash(tmp_path):
    write_rendered(render_site(load_site(REPO_SITE_FILE)), tmp_path)
    for script in (tmp_path / "scripts").glob("*.sh"):
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)  # noqa: S603
        assert os.access(script, os.X_OK)


def test_weird_paths_are_quoted(tmp_path):
    """A path with a quote or $ is refused; a legal odd one reaches the scripts quoted."""
    raw = tomllib.loads(REPO_SITE_FILE.read_text())
    raw["slurm"]["mps_control_command"] = "/opt/nv;idia/bin/nvidia-cuda-mps-control"
    files = {f.name: f.text for f in render_site(parse_site(raw))}
    assert "MPS_CONTROL='/opt/nv;idia/bin/nvidia-cuda-mps-control'" in files["scripts/prolog.sh"]
    write_rendered(render_site(parse_site(raw)), tmp_path)
    subprocess.run(["bash", "-n", str(tmp_path / "scripts" / "prolog.sh")], check=True, timeout=30)  # noqa: S603


def test_quoting_helpers():
    assert sh_quote("a b'c") == "'a b'\"'\"'c'"
    assert lua_str('a"b\\c\nd\x00é') == '"a\\"b\\\\c\\010d\\000\\195\\169"'


def test_cli_render_writes_files_and_lists_install_paths(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["admin", "render", "--site", str(REPO_SITE_FILE), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    import json

    listed = json.loads(result.output)
    assert {e["file"] for e in listed["files"]} == {f.name for f in render_site(load_site(REPO_SITE_FILE))}
    for entry in listed["files"]:
        assert (out / entry["file"]).is_file()
        assert entry["install_path"].startswith("/etc/slurm/")


def test_cli_render_bad_site_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "site.toml"
    bad.write_text(REPO_SITE_FILE.read_text().replace('mps_pipe_root = "/run/slurm-dlrm/mps"',
                                                       'mps_pipe_root = "relative/dir"'))
    result = CliRunner().invoke(cli, ["admin", "render", "--site", str(bad), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "slurm.mps_pipe_root" in result.output and result.output.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_per_node_device_folders():
    """A test cluster keeps each node's fake devices in its own folder: {node} in the pattern."""
    raw = tomllib.loads(REPO_SITE_FILE.read_text())
    raw["nodes"][0]["gpu_device_files"] = "/tmp/c/dev/{node}/nvidia{i}"
    gres = {f.name: f.text for f in render_site(parse_site(raw))}["gres.conf"]
    assert "NodeName=node2 Name=gpu Type=h100 File=/tmp/c/dev/node2/nvidia3" in gres
    assert "NodeName=node1 Name=mps Count=100 File=/tmp/c/dev/node1/nvidia0" in gres
    assert "node[1-2]" not in gres
