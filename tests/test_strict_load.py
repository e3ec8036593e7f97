"""Issue 17 item 4: a key given twice in a spec, site file or sample file is refused
with one line naming the key and its line (exit 2), never loaded as the last one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_dlrm.errors import BadInput, ConfigError, SpecError
from slurm_dlrm.interference_io import read_groups
from slurm_dlrm.site import load_site
from slurm_dlrm.spec import load_spec
from slurm_dlrm.strict_load import DuplicateKeyError, load_json, load_yaml

EXAMPLE = sorted((Path(__file__).resolve().parent.parent / "examples" / "sweep").glob("*.yaml"))[0]


def test_yaml_refuses_a_repeated_key_and_names_its_line():
    with pytest.raises(DuplicateKeyError, match=r"duplicate key 'name' at line 3 \(first at line 1\)"):
        load_yaml("name: x\nsteps: 3\nname: y\n")
    with pytest.raises(DuplicateKeyError, match="'rows' at line 4"):
        load_yaml("tables:\n  - rows: 10\n    dim: 4\n    rows: 20\n")
    assert load_yaml("a: 1\nb: {a: 2}\n") == {"a": 1, "b": {"a": 2}}  # same key in other mappings is fine


def test_json_refuses_a_repeated_key_with_its_line():
    with pytest.raises(DuplicateKeyError, match="'batch_size' at line 3"):
        load_json('{\n "batch_size": 1,\n "batch_size": 2\n}')
    with pytest.raises(DuplicateKeyError, match="'sm' at line 7"):
        load_json('{"sm": 1, "sm": 2}', line=7)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_spec_with_a_duplicate_key_is_refused(tmp_path, suffix):
    good = load_yaml(EXAMPLE.read_text())
    if suffix == ".yaml":
        text = EXAMPLE.read_text().rstrip("\n") + f"\nbatch_size: {good['batch_size'] * 2}\n"
        line = len(text.splitlines())
    else:
        body = json.dumps(good, indent=1)
        text = body[:-1].rstrip() + ',\n "name": "other"\n}'
        line = len(text.splitlines()) - 1
    path = tmp_path / f"spec{suffix}"
    path.write_text(text)
    key = "batch_size" if suffix == ".yaml" else "name"
    with pytest.raises(SpecError, match=f"duplicate key '{key}' at line {line}"):
        load_spec(path)
    # the CLI: one line, exit 2, for estimate and for submit (nothing recorded)
    for argv in (["estimate", str(path)], ["submit", "--parsable", str(path)]):
        proc = subprocess.run([sys.executable, "-m", "slurm_dlrm", *argv], capture_output=True, text=True,  # noqa: S603
                              env={"PATH": "/usr/bin:/bin", "SLURM_DLRM_SITE": _site(tmp_path)}, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and f"duplicate key '{key}' at line {line}" in proc.stderr
        assert proc.stdout == ""
    assert not list((tmp_path / "store").glob("*/store.sqlite")) or _no_jobs(tmp_path)


def _site(tmp: Path) -> str:
    from slurm_dlrm.site import REPO_SITE_FILE

    out = []
    for line in REPO_SITE_FILE.read_text().splitlines():
        if line.startswith("store_dir ="):
            line = f'store_dir = "{tmp}/store/{{user}}"'
        elif line.startswith("spool_dir ="):
            line = f'spool_dir = "{tmp}/spool/{{user}}"'
        out.append(line)
    p = tmp / "site.toml"
    p.write_text("\n".join(out) + "\n")
    return str(p)


def _no_jobs(tmp: Path) -> bool:
    import sqlite3

    return all(sqlite3.connect(db).execute("SELECT count(*) FROM jobs").fetchone()[0] == 0
               for db in (tmp / "store").glob("*/store.sqlite"))


def test_site_file_with_a_repeated_key_names_it(tmp_path):
    p = tmp_path / "site.toml"
    p.write_text('[site]\nstore_dir = "/tmp/a"\nstore_dir = "/tmp/b"\n')
    with pytest.raises(ConfigError, match="duplicate key 'store_dir' at line 3"):
        load_site(p)
    p.write_text('[site]\nstore_dir = "/tmp/a"\n\n[site]\n')
    with pytest.raises(ConfigError, match="duplicate key 'site' at line 4"):
        load_site(p)


def test_sample_files_refuse_repeated_keys(tmp_path):
    member = '{"sm_util_pct": 50, "membw_util_pct": 20, "speed": 0.9}'
    jl = tmp_path / "s.jsonl"
    jl.write_text(f'{{"group": "a", "members": [{member}, {member}]}}\n'
                  f'{{"group": "b", "group": "c", "members": [{member}, {member}]}}\n')
    with pytest.raises(BadInput, match="duplicate key 'group' at line 2"):
        read_groups(str(jl))
    whole = tmp_path / "s.json"
    whole.write_text('[\n {"group": "a",\n  "members": [{"sm_util_pct": 5, "sm_util_pct": 6}]}\n]\n')
    with pytest.raises(BadInput, match="duplicate key 'sm_util_pct' at line 3"):
        read_groups(str(whole))
    csv = tmp_path / "s.csv"
    csv.write_text("group,sm_util_pct,membw_util_pct,sm_util_pct,speed\na,1,2,3,0.5\n")
    with pytest.raises(BadInput, match="line 1: column 'sm_util_pct' appears twice"):
        read_groups(str(csv))


def test_workload_file_with_a_repeated_key_is_refused(tmp_path):
    from slurm_dlrm.commands.simulate import read_data_file

    p = tmp_path / "w.yaml"
    p.write_text("jobs:\n  - name: a\n    arrival_s: 0\n    arrival_s: 5\n")
    with pytest.raises(BadInput, match="duplicate key 'arrival_s' at line 4"):
        read_data_file(str(p), "workload")
