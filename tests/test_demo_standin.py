"""`demo --standin`: the sweep's specs with stand-in members (the Slurm matrix runs it where
torch is not installed). The live run is the matrix's demo leg; here, the spec copies."""

from __future__ import annotations

import sys

from slurm_dlrm.service.demo import default_specs, standin_specs
from slurm_dlrm.service.sbatch_options import parse_sbatch_script
from slurm_dlrm.spec import load_spec


def test_standin_specs_keep_the_spec_and_its_sbatch_lines_and_run_the_standin(tmp_path):
    originals = default_specs(3)
    copies = standin_specs(originals, tmp_path / "run", sys.executable)
    assert [c.name for c in copies] == [o.name for o in originals]
    for orig, copy in zip(originals, copies, strict=True):
        a, b = load_spec(orig), load_spec(copy)
        assert b.command is not None and b.command[:3] == (sys.executable, "-m", "slurm_dlrm.emulated.standin")
        assert b.command[b.command.index("--steps") + 1] == str(a.steps)
        # everything the estimate and the packing read is the original's
        assert a.to_dict() | {"command": None} == b.to_dict() | {"command": None}
        assert parse_sbatch_script(orig.read_text(), "a") == parse_sbatch_script(copy.read_text(), "a")
    assert (tmp_path / "run").stat().st_mode & 0o777 == 0o700
