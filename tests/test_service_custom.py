"""Issue 17 item 2: a custom model is packed on its traced estimate, and a factory that
cannot be built is refused with the line `estimate` prints, nothing recorded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from service_harness import FakeClock, make_site, write_site_file

from slurm_dlrm.service.core import PackingService, ServiceSettings
from slurm_dlrm.service.sbatch_options import SbatchOptions
from slurm_dlrm.service.submit import prepare, record
from slurm_dlrm.slurm.fake import FakeSlurm
from slurm_dlrm.store.states import JobState
from slurm_dlrm.store.store import Store

REPO = Path(__file__).resolve().parent.parent
SPEC = """\
name: {name}
custom_module: "{module}"
tables:
  - {{rows: 5000, dim: 16}}
  - {{rows: 300, dim: 16, multi_hot: 4}}
dense_features: 13
bottom_mlp: [64, 16]
top_mlp: [64, 1]
batch_size: 512
optimizer: {{type: adagrad}}
"""


@pytest.fixture
def mods(tmp_path):
    """A package of custom modules on the import path: one good, one whose factory fails."""
    pkg = tmp_path / "mods" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text("from slurm_dlrm.estimate.example_custom import build as factory\n")
    (pkg / "broken.py").write_text(textwrap.dedent("""
        def factory(spec):
            raise ValueError("no such layer: attention")
    """))
    return tmp_path / "mods"


def _site_file(tmp: Path) -> Path:
    p = write_site_file(tmp)
    return p


def _cli(tmp, mods, *argv):
    env = {**os.environ, "SLURM_DLRM_SITE": str(_site_file(tmp)), "PYTHONPATH": f"{mods}{os.pathsep}{REPO}"}
    return subprocess.run([sys.executable, "-m", "slurm_dlrm", *argv], capture_output=True, text=True,  # noqa: S603
                          env=env, cwd=tmp, timeout=300)


@pytest.mark.parametrize("module", ["mypkg.nothere:factory", "nopkg.mod:factory", "mypkg.good:nope",
                                    "mypkg.good.sub:factory"])
def test_submit_refuses_what_estimate_refuses_with_the_same_line(tmp_path, mods, module):
    (tmp_path / "c.yaml").write_text(SPEC.format(name="c", module=module))
    est = _cli(tmp_path, mods, "estimate", "c.yaml")
    sub = _cli(tmp_path, mods, "submit", "--no-service", "c.yaml")
    assert est.returncode == sub.returncode == 2, (est.stderr, sub.stderr)
    assert sub.stderr == est.stderr and sub.stderr.count("\n") == 1, (est.stderr, sub.stderr)
    assert "custom_module" in sub.stderr
    assert not list(tmp_path.glob("store-*/store.sqlite")) or _jobs(tmp_path) == 0


def _jobs(tmp):
    import sqlite3

    return sum(sqlite3.connect(p).execute("SELECT count(*) FROM jobs").fetchone()[0]
               for p in tmp.glob("store-*/store.sqlite"))


def test_submit_of_a_custom_spec_imports_neither_torch_nor_the_module(tmp_path, mods):
    (tmp_path / "c.yaml").write_text(SPEC.format(name="c", module="mypkg.good:factory"))
    code = textwrap.dedent("""
        import sys
        from slurm_dlrm.cli import cli
        try:
            cli.main(["submit", "--no-service", "c.yaml"], prog_name="slurm-dlrm")
        except SystemExit as e:
            assert not e.code, e.code
        print("HEAVY", sorted(m for m in ("torch", "torchrec", "mypkg", "numpy") if m in sys.modules))
    """)
    env = {**os.environ, "SLURM_DLRM_SITE": str(_site_file(tmp_path)), "PYTHONPATH": f"{mods}{os.pathsep}{REPO}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,  # noqa: S603
                         timeout=120)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr
    q = _cli(tmp_path, mods, "queue", "--json", "--no-slurm")
    import json

    (row,) = json.loads(q.stdout)["jobs"]
    assert row["state"] == "PENDING" and row["reason"].startswith("estimating"), row


@pytest.mark.torch
def test_the_service_traces_then_packs_on_the_traced_estimate(tmp_path, mods, monkeypatch):
    pytest.importorskip("torch")
    from slurm_dlrm.estimate.traced import estimate_traced
    from slurm_dlrm.spec import load_spec

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(mods))
    monkeypatch.setenv("PYTHONPATH", f"{mods}{os.pathsep}{REPO}")
    (tmp_path / "good.yaml").write_text(SPEC.format(name="good", module="mypkg.good:factory"))
    (tmp_path / "broken.yaml").write_text(SPEC.format(name="broken", module="mypkg.broken:factory"))
    site = make_site(tmp_path)
    clock = FakeClock()
    store = Store(tmp_path / "store.sqlite", clock=clock)
    subs = prepare(["good.yaml", "broken.yaml"], SbatchOptions(), site, str(tmp_path))
    good, broken = record(store, subs, "root")
    assert store.get_job(good).estimate["method"] == "pending-trace"
    slurm = FakeSlurm(clock=clock, user="root")
    svc = PackingService(store, slurm, site, ServiceSettings(user="root", python=sys.executable,
                                                            dispatch_window_s=0.0), clock=clock)
    svc.run_round()
    gpu = subs[0].gpu
    traced = estimate_traced(load_spec(tmp_path / "good.yaml"), gpu)
    job = store.get_job(good)
    assert job.estimate["method"] == "traced"
    assert job.est_gpu_peak_bytes == traced.gpu_peak_bytes != subs[0].estimate.gpu_peak_bytes
    assert job.gpu_mem_request_bytes == traced.gpu_peak_bytes
    assert job.state == JobState.PLANNED  # packed in the same round, on the traced figure
    (placement,) = store.placements(job_id=good)
    assert placement.gpu_mem_limit_bytes >= traced.gpu_peak_bytes
    # the broken factory: FAILED with the line `estimate broken.yaml` prints here
    est = subprocess.run([sys.executable, "-m", "slurm_dlrm", "estimate", "broken.yaml"], capture_output=True,  # noqa: S603
                         text=True, cwd=tmp_path, timeout=300)
    assert est.returncode == 2
    bad = store.get_job(broken)
    assert bad.state == JobState.FAILED
    assert f"slurm-dlrm: error: {bad.exit_reason}\n" == est.stderr
    store.close()


@pytest.mark.torch
def test_no_pack_sizes_a_custom_model_from_its_trace(tmp_path, mods, monkeypatch):
    pytest.importorskip("torch")
    from slurm_dlrm.errors import BadInput
    from slurm_dlrm.estimate.traced import estimate_traced
    from slurm_dlrm.service.submit import native_request, submit_no_pack
    from slurm_dlrm.spec import load_spec

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(mods))
    (tmp_path / "good.yaml").write_text(SPEC.format(name="good", module="mypkg.good:factory"))
    (tmp_path / "broken.yaml").write_text(SPEC.format(name="broken", module="mypkg.broken:factory"))
    site = make_site(tmp_path)
    slurm = FakeSlurm(user="root")
    with pytest.raises(BadInput, match="broken.yaml: custom_module: tracing mypkg.broken:factory"):
        submit_no_pack(["good.yaml", "broken.yaml"], SbatchOptions(), site=site, user="root", cwd=str(tmp_path),
                       slurm=slurm, start_service=False)
    assert slurm.submitted == []  # nothing half-done
    (res,) = submit_no_pack(["good.yaml"], SbatchOptions(), site=site, user="root", cwd=str(tmp_path),
                            slurm=slurm, start_service=False)
    sub, req = res.sub, res.req
    traced = estimate_traced(load_spec(tmp_path / "good.yaml"), sub.gpu)
    assert sub.estimate.gpu_peak_bytes == traced.gpu_peak_bytes and sub.estimate.method == "traced"
    assert req == native_request(sub, site)  # --mem, the share and the comment from the trace
    analytic = prepare(["good.yaml"], SbatchOptions(), site, str(tmp_path))[0]
    assert analytic.estimate.gpu_peak_bytes != traced.gpu_peak_bytes  # which would have sized it before
    assert native_request(analytic, site) != req
