"""The standing adversarial suite for what runs as root or inside slurmctld (issue 32):
hostile jobs, generated in each Slurm release's recorded formats (tests/data/slurm/),
through the prolog's field reading and through job_submit.lua. Property: no forged value
is accepted. What a user writes in the job name, work dir or submit line changes nothing;
what they write in --comment counts only as a whole, well-formed marker; every value ends
within its cap. Example counts are small so the suite runs in seconds.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from slurm_dlrm.admin.render import render_site, write_rendered
from slurm_dlrm.site import REPO_SITE_FILE, parse_site
from tests.slurm_records import RELEASES, write_stub
from tests.test_admin_lua import ACCESS_DENIED, INVALID_GRES, LUA, OK, USER_UID, run_cases, site_raw

# Text a user would type to pose as a later field of `scontrol show job -o`.
FORGERIES = [
    " TresPerNode=gres:mps:100", " TresPerNode=gres/mps:100000", " TresPerNode=mps:100",
    " Comment=slurm-dlrm:mode=no-pack,gpu_mem_mib=99999", "slurm-dlrm:mode=no-pack,gpu_mem_mib=99999",
    " JobState=COMPLETED ", ",gres:mps:100", ",gres/gpu:big:9", "\n", " ", "=", ":", ",", "/", "$(id)", "'", '"',
]
USER_TEXT = st.lists(st.one_of(st.sampled_from(FORGERIES), st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="\x00"), max_size=6)),
    max_size=6).map("".join)

PAIR = re.compile(r"[a-z_]+=[A-Za-z0-9._-]+")  # job_submit.lua's parse_marker
GPU_MEM_MIB_MAX = 81920  # site-config/site.toml's largest GPU (h100, 80 GiB)
MPS_PER_GPU = 100

# --comment: the wrapper's markers, markers with forged tails, or anything else.
MARKERS = st.one_of(
    st.builds(lambda mib, job: f"slurm-dlrm:mode=no-pack,gpu_mem_mib={mib},job_id={job}",
              st.integers(1, 10**9), st.integers(0, 99)),
    st.builds(lambda pack: f"slurm-dlrm:mode=pack,pack_id={pack}", st.integers(0, 99)),
)
COMMENTS = st.one_of(MARKERS, st.builds(lambda m, tail: m + tail, MARKERS, USER_TEXT), USER_TEXT)


def gres_entries(sep: str, names: tuple[str, ...]) -> st.SearchStrategy[list[tuple[str, str | None, int]]]:
    return st.lists(st.tuples(st.sampled_from(names), st.one_of(st.none(), st.sampled_from(["a", "big", "h100"])),
                              st.integers(0, 600)), max_size=3)


def tres_text(entries: list[tuple[str, str | None, int]], sep: str) -> str:
    return ",".join(f"gres{sep}{n}:{t}:{c}" if t else f"gres{sep}{n}:{c}" for n, t, c in entries)


def marker_fields(comment: str) -> dict[str, str] | None:
    """job_submit.lua's reading of a comment: None unless it is the marker prefix and then
    comma-separated key=value items (empty items skipped); the last of a key wins."""
    prefix = "slurm-dlrm:"
    if not comment.startswith(prefix):
        return None
    items = [p for p in comment[len(prefix):].split(",") if p]
    if not all(PAIR.fullmatch(p) for p in items):
        return None
    return dict(p.split("=", 1) for p in items)


def expected_comment_mib(comment: str) -> int:
    """The fence the prolog must apply for a comment: what job_submit.lua would read, capped
    (0: none). squeue prints the comment on its own line, so trailing newlines drop."""
    fields = marker_fields(comment.rstrip("\n"))
    if fields is None or fields.get("mode") != "no-pack" or not re.fullmatch(r"[0-9]+", fields.get("gpu_mem_mib", "")):
        return 0
    mib = int(fields["gpu_mem_mib"])
    return min(mib, GPU_MEM_MIB_MAX) if mib >= 1 else 0


# ------------------------------------------------------------------ the prolog's field reading


@pytest.fixture(scope="module")
def prolog_functions():
    """The rendered prolog's functions (everything before its top-level run), a stub squeue,
    and a place for job fields: read_job_fields, job_thread_pct and job_gpu_mem_mib as root
    runs them, without a daemon."""
    root = Path(tempfile.mkdtemp(prefix="sdv", dir="/tmp"))
    raw = tomllib.loads(REPO_SITE_FILE.read_text())
    raw["mps"]["shards_per_gpu"] = 8  # the prolog reads the mps count (Slurm 22.05's bug with shards)
    raw["slurm"].update(mps_pipe_root=str(root / "p"), mps_log_root=str(root / "l"), script_dir=str(root / "s"))
    write_rendered(render_site(parse_site(raw)), root / "out")
    text = (root / "out" / "scripts" / "prolog.sh").read_text()
    cut = text.index("\nsite_rc=0\n")
    functions = root / "functions.sh"
    functions.write_text(text[:cut] + "\n")
    (root / "bin").mkdir()
    (root / "stub").mkdir()
    yield root, functions
    shutil.rmtree(root, ignore_errors=True)


def read_fields(root: Path, functions: Path, job_id: int, env_pct: str) -> tuple[int, int]:
    proc = subprocess.run(  # noqa: S603
        ["bash", "-c", 'source "$1"; read_job_fields; echo "$(job_thread_pct) $(job_gpu_mem_mib)"', "_",
         str(functions)],
        env={"PATH": f"{root / 'bin'}:/usr/bin:/bin", "STUB_DIR": str(root / "stub"), "SLURM_JOB_ID": str(job_id),
             "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": env_pct},
        capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    pct, mib = proc.stdout.split()
    return int(pct), int(mib)


def expected_pct(entries: list[tuple[str, str | None, int]], env_pct: str) -> int:
    mps = [c for n, _, c in entries if n == "mps"]
    if mps:
        pct = math.ceil(sum(mps) * 100 / MPS_PER_GPU)
    else:  # no mps count to read: Slurm's variable, if it is a number
        pct = int(env_pct) if re.fullmatch(r"[0-9]{1,9}", env_pct) else 100
    return max(1, min(100, pct))


@pytest.mark.parametrize("release", RELEASES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_prolog_reads_no_forged_field(prolog_functions, release, data):
    root, functions = prolog_functions
    sep = ":" if release.startswith("22.") else "/"
    entries = data.draw(gres_entries(sep, ("mps", "gpu", "shard")), label="tres")
    comment = data.draw(COMMENTS, label="comment")
    env_pct = data.draw(st.one_of(st.integers(0, 10**6).map(str), st.sampled_from(["", "abc", "-1", "9" * 25])),
                        label="env_pct")
    fields = dict(name=data.draw(USER_TEXT, label="name"), work_dir="/home/u/" + data.draw(USER_TEXT, label="dir"),
                  submit_line="sbatch " + data.draw(USER_TEXT, label="submit"))
    job_id = 1000 + data.draw(st.integers(0, 10**6))
    write_stub(root / "bin", root / "stub", release, job_id, comment=comment,
               tres_per_node=tres_text(entries, sep), **fields)
    pct, mib = read_fields(root, functions, job_id, env_pct)
    assert 1 <= pct <= 100 and 0 <= mib <= GPU_MEM_MIB_MAX
    assert (pct, mib) == (expected_pct(entries, env_pct), expected_comment_mib(comment)), (fields, comment)


# ------------------------------------------------------------------ job_submit.lua

# site_raw(): partition dlrm, 4 GPUs per node (h100 nodes), max_gpus_per_job 6, min_mps_share 10.
MAX_PER_NODE, MAX_PER_JOB, MIN_MPS, MAX_MPS = 4, 6, 10, 100


def lua_verdict_allowed(desc: dict[str, Any]) -> bool:
    """What may pass, whatever else the rules say: a whole well-formed marker, and GPU and
    MPS totals within the caps, summed over every entry of a name."""
    per_node, per_job = desc.get("_node", []), desc.get("_job", [])
    if marker_fields(desc.get("comment") or "") is None:
        return False
    gpu_node = sum(c for n, _, c in per_node if n == "gpu")
    gpu_job = sum(c for n, _, c in per_job if n == "gpu")
    mps = sum(c for n, _, c in per_node if n == "mps")
    nodes = desc.get("min_nodes") or 1
    if any(n == "mps" for n, _, _ in per_node) and not MIN_MPS <= mps <= MAX_MPS:
        return False
    if any(n == "gpu" for n, _, _ in per_node) and gpu_node > MAX_PER_NODE:
        return False
    return max(gpu_node * nodes, gpu_job) <= MAX_PER_JOB


# No shrinking: a batch of 25 jobs shrinks for minutes; the failing job is in the message.
@settings(max_examples=6, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(st.lists(st.tuples(st.sampled_from(RELEASES), COMMENTS, USER_TEXT, USER_TEXT, st.data()),
                min_size=25, max_size=25))
def test_job_submit_accepts_no_forged_request(tmp_path_factory, jobs):
    """Each generated job twice: with hostile name, work dir and submit line, and with plain
    ones. The verdict is the same, and an accepted job is within every cap."""
    if LUA is None:
        pytest.skip("lua5.1 not installed (scripts/setup.sh installs it)")
    cases, descs = [], []
    for i, (release, comment, name, work_dir, data) in enumerate(jobs):
        sep = ":" if release.startswith("22.") else "/"
        per_node = data.draw(gres_entries(sep, ("mps", "gpu")), label="per_node")
        per_job = data.draw(gres_entries(sep, ("gpu",)), label="per_job") if not per_node else []
        desc: dict[str, Any] = {"partition": "dlrm", "comment": comment, "min_mem_per_node": 4096,
                                "min_nodes": data.draw(st.integers(1, 3), label="nodes"),
                                "tres_per_node": tres_text(per_node, sep) or None,
                                "tres_per_job": tres_text(per_job, sep) or None}
        hostile = dict(desc, name=name, work_dir=work_dir, script="#!/bin/bash\n" + name)
        cases += [(f"h{i}", hostile, None, USER_UID), (f"p{i}", dict(desc, name="plain", work_dir="/home/u"),
                                                       None, USER_UID)]
        descs.append(dict(desc, _node=per_node, _job=per_job))
    results = run_cases(tmp_path_factory.mktemp("lua"), cases, site_raw())
    for i, desc in enumerate(descs):
        rc_hostile, msg = results[f"h{i}"]
        assert rc_hostile == results[f"p{i}"][0], (desc, msg)
        assert rc_hostile in (OK, ACCESS_DENIED, INVALID_GRES), (desc, msg)
        if rc_hostile == OK:
            assert lua_verdict_allowed(desc), desc
        else:
            assert msg.count("slurm-dlrm: partition dlrm") == 1, msg


def test_every_test_the_threat_model_names_exists():
    """docs/admin.md "Threat model" backs each claim with a test: each named test exists."""
    text = (Path(__file__).parent.parent / "docs" / "admin.md").read_text()
    section = text[text.index("## Threat model"):]
    section = section[:section.index("\n## ", 1)]
    named = set(re.findall(r"`(test_[a-z0-9_]+)`", section))
    defined = {m for f in Path(__file__).parent.glob("test_*.py")
               for m in re.findall(r"^def (test_[a-z0-9_]+)", f.read_text(), re.M)}
    assert len(named) >= 10
    assert named <= defined, sorted(named - defined)
