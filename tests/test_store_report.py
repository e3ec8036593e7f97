"""`slurm-dlrm report`: the HTML embeds every plot inline and the PNG files exist."""

from __future__ import annotations

import base64
import json
import re
import time

from click.testing import CliRunner

from slurm_dlrm.cli import cli
from slurm_dlrm.store import Store
from slurm_dlrm.store.synthetic import populate


def test_report_renders_plots_inline_and_beside(tmp_path):
    db = tmp_path / "s" / "store.sqlite"
    now = time.time()
    with Store(db) as s:
        populate(s, n_jobs=12, samples_per_job=40, t0=now - 3600, seed=1, final_running=1)
    out = tmp_path / "out dir" / "rep.html"
    res = CliRunner().invoke(cli, ["report", "--db", str(db), "-S", "2h", "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    written = json.loads(res.output)
    pngs = [tmp_path / "out dir" / f"rep-{n}.png" for n in ("gpu-util", "gantt", "memory")]
    assert sorted(written["png"]) == sorted(map(str, pngs))
    html = out.read_text()
    inline = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(inline) == 3
    for png in pngs:
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
        assert base64.b64encode(data).decode() in inline
    assert "GPU-hours charged" in html and "syn-11" in html
    assert "<script" not in html  # self-contained, nothing fetched


def test_report_of_an_empty_window(tmp_path):
    db = tmp_path / "s" / "store.sqlite"
    Store(db).close()
    out = tmp_path / "empty.html"
    res = CliRunner().invoke(cli, ["report", "--db", str(db), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "no samples in this window" not in out.read_text()  # text is in the PNG, not the HTML
    assert out.read_text().count("data:image/png;base64,") == 3
    res = CliRunner().invoke(cli, ["report", "--db", str(db), "-S", "1h", "-E", "2h"])
    assert res.exit_code == 2 and "--since" in res.output
