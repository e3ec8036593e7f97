"""benchmarks/public_colocation_check.py: the join of Lucid's two files and the sample CSV.

The files here are made up (models FakeNetA/B/C on "SynthSet"), in Lucid's exact column
layout; Lucid's own data are never in the repository (non-commercial licence).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from slurm_dlrm.interference_io import read_groups

ROOT = Path(__file__).resolve().parent.parent


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("public_colocation_check",
                                                  ROOT / "benchmarks" / "public_colocation_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


pcc = _module()

COLOCATE = """\
,model1,dataset1,gpu_num1,batchsize1,amp1,speed1,model2,dataset2,gpu_num2,batchsize2,amp2,speed2,gpu_util,gmem_util,gmem
0,FakeNetA,SynthSet,1,32,0,0.9,FakeNetB,SynthSet,1,64,1,0.75,61.5,30.25,5000
1,FakeNetA,SynthSet,1,32,0,1.2,FakeNetA,SynthSet,1,32,0,0.95,70.0,40.0,2100
2,FakeNetA,SynthSet,1,32,0,0.7,FakeNetC,SynthSet,1,32,0,0.6,80.0,50.0,6000
3,FakeNetA,SynthSet,1,32,0,0.8,FakeNetB,SynthSet,2,64,1,0.85,80.0,50.0,6000
"""
SINGLE = """\
model,dataset,batchsize,amp,speed,gpu_util,gmem_util,gmem,label
FakeNetA,SynthSet,32,0,100.0,40.5,20.25,2048.0,0
FakeNetB,SynthSet,64.0,1,50.0,25.0,12.5,3072.0,1
FakeNetD,SynthSet,32,0,10.0,5.0,1.0,1024.0,0
"""


def _files(tmp_path: Path, single: str = SINGLE) -> tuple[Path, Path]:
    c, s = tmp_path / "colocate_info.csv", tmp_path / "single_data.csv"
    c.write_text(COLOCATE)
    s.write_text(single)
    return c, s


def test_join_writes_the_documented_sample_csv_and_counts_drops(tmp_path: Path) -> None:
    c, s = _files(tmp_path)
    groups, report = pcc.join(c, s)
    assert report.pairs_read == 4 and report.joined == 2
    assert dict(report.dropped) == {"no solo row for job 2": 1,
                                    "job 2: gpu_num 2, the solo rows are one-GPU runs": 1}
    assert report.members_above_1 == 1 and report.pairs_above_1 == 1  # 1.2 kept, not clipped
    assert report.max_speed == 1.2 and report.min_speed == 0.75
    assert report.solo_rows == 3 and report.solo_keys_used == 2
    # pair 1 holds 2,100 MiB together, FakeNetA alone holds 2,048: one job's worth
    assert report.one_job_memory == 1

    out = tmp_path / "samples.csv"
    pcc.write_samples(groups, out)
    assert out.read_text().splitlines() == [
        "group,job,sm_util_pct,membw_util_pct,gpu_mem_gib,speed",
        "p1,1:FakeNetA/SynthSet/bs32/amp0,40.5,20.25,2.0,0.9",
        "p1,2:FakeNetB/SynthSet/bs64/amp1,25.0,12.5,3.0,0.75",
        "p2,1:FakeNetA/SynthSet/bs32/amp0,40.5,20.25,2.0,1.2",
        "p2,2:FakeNetA/SynthSet/bs32/amp0,40.5,20.25,2.0,0.95",
    ]
    # ... and the command's own reader takes it: a self-pair is two members, one job
    read, notes = read_groups(str(out))
    assert [g.name for g in read] == ["p1", "p2"]
    assert read[1].speeds == (1.2, 0.95)
    assert read[0].members[1].gpu_mem_bytes == 3 << 30 and read[0].members[1].membw_util_pct == 12.5
    assert notes.warnings() == []


def test_a_solo_key_given_twice_is_refused(tmp_path: Path) -> None:
    c, s = _files(tmp_path, SINGLE + "FakeNetA,SynthSet,32.0,0,99.0,41.0,20.0,2048.0,0\n")
    with pytest.raises(pcc.DataError, match="appears twice"):
        pcc.join(c, s)


def test_a_file_not_in_lucids_layout_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    c, s = _files(tmp_path, SINGLE.replace("gmem_util", "bw"))
    assert pcc.main(["--colocate", str(c), "--single", str(s)]) == 2
    err = capsys.readouterr().err
    assert "no gmem_util column" in err and err.count("\n") == 1
