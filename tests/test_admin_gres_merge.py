"""`admin render --site-gres-conf`: the site's own gres.conf lines survive the install
(issue 32, also noticed: "gres.conf is still installed whole")."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from slurm_dlrm.admin.gres_merge import parse_gres_conf
from slurm_dlrm.cli import cli

SITE = Path(__file__).resolve().parent.parent / "site-config" / "site.toml"  # GPU nodes node[1-2]

SITE_GRES = """\
# the site's gres.conf before slurm-dlrm
AutoDetect=off
NodeName=node[1-2] Name=gpu Type=a100 File=/dev/nvidia[0-3]
NodeName=node1 AutoDetect=nvml
NodeName=node[1-2] Name=fpga File=/dev/fpga0   # other gres on our nodes
NodeName=viz[1-4] Name=gpu Type=t4 \\
    File=/dev/nvidia0
Name=bandwidth Type=lustre Count=4G
"""


def render(tmp_path: Path, site_gres: str) -> tuple[int, str, str]:
    src = tmp_path / "gres.site.conf"
    src.write_text(site_gres)
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["admin", "render", "--site", str(SITE), "--out", str(out),
                                   "--site-gres-conf", str(src)])
    text = (out / "gres.conf").read_text() if (out / "gres.conf").exists() else ""
    return res.exit_code, text, res.stderr


def test_the_sites_other_lines_are_kept_and_ours_replace_its_gpu_lines(tmp_path):
    code, text, err = render(tmp_path, SITE_GRES)
    assert code == 0, err
    lines = [ln.text for ln in parse_gres_conf(text)]
    # kept: other gres on our nodes, other nodes, node-less lines of other gres
    assert "NodeName=node[1-2] Name=fpga File=/dev/fpga0" in lines
    assert "NodeName=viz[1-4] Name=gpu Type=t4 File=/dev/nvidia0" in lines
    assert "Name=bandwidth Type=lustre Count=4G" in lines
    assert "AutoDetect=off" in lines
    # replaced: the site's gpu and AutoDetect lines for our nodes
    assert not any("a100" in ln or ln == "NodeName=node1 AutoDetect=nvml" for ln in lines)
    assert any(ln.startswith("NodeName=node[1-2] Name=gpu Type=h100 File=") for ln in lines)  # ours
    assert "# Kept from the site's own gres.conf" in text


def test_a_line_half_ours_is_refused_in_one_line_and_nothing_written(tmp_path):
    for bad in ("NodeName=node[2-3] Name=mps Count=400\n", "Name=gpu File=/dev/nvidia0\n"):
        code, text, err = render(tmp_path, bad)
        assert code == 2 and text == "", err
        assert len(err.strip().splitlines()) == 1 and "gres.site.conf:1" in err


def test_without_the_option_the_rendered_file_is_ours_alone(tmp_path):
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["admin", "render", "--site", str(SITE), "--out", str(out)])
    assert res.exit_code == 0
    assert "Kept from the site" not in (out / "gres.conf").read_text()
