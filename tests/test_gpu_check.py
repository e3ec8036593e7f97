"""scripts/gpu-check.sh (issues 33, 38): the --dry run against the fakes and the CPU (our
runner per memory config, a real pack under the agent, co-location groups of 2-5 with
repeats and GPM), its bad input, and the plain-torch DLRM it measures on a GPU (it must
be the model the estimator describes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_dlrm.interference_io import read_groups

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu-check.sh"

# What the GPU machine's image lacks (docs/install.md): the dry run must not need them.
HIDDEN = ("sqlite_utils", "torchrec", "fbgemm_gpu")
_HIDER = f"""
import sys
for name in {HIDDEN!r}:
    sys.modules[name] = None  # import -> ModuleNotFoundError, as on the GPU machine
"""


def _script(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,  # noqa: S603, S607
                          env=env, timeout=timeout, check=False)


@pytest.mark.torch
def test_dry_run_writes_what_the_gpu_run_writes_and_says_dry(tmp_path):
    pytest.importorskip("torch")
    hider = tmp_path / "hide"
    hider.mkdir()
    (hider / "sitecustomize.py").write_text(_HIDER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_DLRM_", "CUDA_MPS_"))}
    env["PYTHONPATH"] = str(hider)
    env["PYTHON"] = sys.executable
    out = tmp_path / "out"
    proc = _script("--dry", str(out), env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["colocation.csv", "colocation.jsonl", "log.txt", "memory.jsonl",
                                                     "pack.jsonl", "selftest.json", "summary.txt"]  # <= 8 files back
    summary = (out / "summary.txt").read_text()
    assert summary.startswith("DRY RUN") and "NOTHING HERE WAS MEASURED ON A GPU" in summary
    assert summary == proc.stdout

    selftest = json.loads((out / "selftest.json").read_text())
    assert selftest["dry"] is True and selftest["exit_code"] == 0
    statuses = {c["status"] for c in selftest["checks"]}
    assert "PASS" not in statuses and "DRY" in statuses  # the fakes: never a hardware PASS

    # memory: our runner (backend torch, torchrec hidden) per config, beside the estimate
    memory = [json.loads(line) for line in (out / "memory.jsonl").read_text().splitlines()]
    assert memory and all(r["dry"] is True and r["status"] == "DRY" for r in memory), [r.get("error") for r in memory]
    for r in memory:
        assert r["spec"]["backend"] == "torch" and r["runner"]["exit_code"] == 0
        assert r["estimate_bytes"] > 0 and any("backend torch" in n for n in r["estimate_notes"])
        assert r["measured"]["max_memory_allocated_bytes"] is None  # the CPU: no CUDA peak is made up
        assert r["measured"]["nvml_process_bytes"] > 0  # the fake NVML saw the runner through the agent's seam

    # a real pack: the agent runs five of our runners; the one past its fence is a GPU OOM
    pack = [json.loads(line) for line in (out / "pack.jsonl").read_text().splitlines()]
    members = {r["name"]: r for r in pack if r["kind"] == "member"}
    assert len(members) == 5
    assert members["over-fence"]["state"] == "OOM_GPU" and members["over-fence"]["meant_to_go_over"]
    for name, m in members.items():
        if name != "over-fence":
            assert m["state"] == "COMPLETED" and m["steps_done"] == m["steps_total"], m
        assert m["samples"] > 0 and m["fence_mib"] > 0 and m["estimate_bytes"] > 0
    agent = next(r for r in pack if r["kind"] == "agent")
    assert agent["agent_exit_code"] == 0
    store = agent["store"]
    assert store["ingested"]["samples"] > 0 and not store["moves_refused"]
    assert sorted(row["state"] for row in store["acct"]) == ["COMPLETED"] * 4 + ["OOM"]
    assert "over-fence member GPU OOM: True; other OOMs: none; neighbours complete 4/4" in summary

    # co-location: alone twice, groups of 2, 3, 4 and 5 twice each, GPM beside the shares
    coloc = [json.loads(line) for line in (out / "colocation.jsonl").read_text().splitlines()]
    alone = [r for r in coloc if r["kind"] == "alone"]
    groups = [r for r in coloc if r["kind"] == "group"]
    assert len(alone) == 8 and all(len(r["windows"]) == 2 for r in alone) and all(r["dry"] for r in coloc)
    assert sorted(r["size"] for r in groups) == [2, 2, 3, 3, 4, 4, 5, 5]
    assert sorted(r["repeat"] for r in groups) == [0] * 4 + [1] * 4
    assert {r["mode"] for r in coloc} == {"mps"}  # the fake daemon started through the agent's MPS seam
    for r in groups:
        assert len(r["agent_thread_pct"]) == r["size"] and all(1 <= p <= 100 for p in r["thread_pct"])
        assert all(p >= a for p, a in zip(r["thread_pct"], r["agent_thread_pct"], strict=True))  # never below
        assert set(r["nvml"]["gpm"]) == {"sm_util_pct", "sm_occupancy_pct", "tensor_util_pct", "dram_bw_util_pct"}
    csv_text = (out / "colocation.csv").read_text()
    assert csv_text.startswith("# DRY")
    read, _notes = read_groups(str(out / "colocation.csv"))  # the reader `interference eval --samples` uses
    assert sorted(len(g.members) for g in read) == [2, 2, 3, 3, 4, 4, 5, 5] and all(g.speeds for g in read)
    assert "4 measured groups x2 (sizes {2: 1, 3: 1, 4: 1, 5: 1}" in summary


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "old.txt").write_text("x")
    env = dict(os.environ, PYTHON=sys.executable)
    cases = [
        ([str(full)], "must be a new or empty folder"),
        ([str(tmp_path / "a"), "--window-s", "0"], "--window-s 0.0: must be > 0"),
        ([str(tmp_path / "b"), "--model", "nosuch"], "unknown GPU model 'nosuch'"),
        ([str(tmp_path / "c"), "--site", str(tmp_path / "none.toml")], "no such file"),
    ]
    for args, message in cases:
        proc = _script("--dry", *args, env=env)
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr
        assert proc.stdout == ""
    no_gpu = _script(str(tmp_path / "d"), env={k: v for k, v in env.items() if k != "SLURM_DLRM_FAKE_NVML"})
    assert no_gpu.returncode == 2 and "use --dry" in no_gpu.stderr and len(no_gpu.stderr.strip().splitlines()) == 1
    faked = _script(str(tmp_path / "e"), env=dict(env, SLURM_DLRM_FAKE_NVML=str(tmp_path / "x.json")))
    assert faked.returncode == 2 and "never uses the fake NVML" in faked.stderr
    assert not any((tmp_path / n).exists() for n in "abcde")
    assert _script(env=env).returncode == 2  # no OUTDIR: usage


# ---------------------------------------------------------------- the plain-torch DLRM


def _spec(**over):
    from slurm_dlrm.spec import parse_spec

    data = {"name": "t", "tables": [{"rows": 300, "dim": 8}, {"rows": 200, "dim": 8, "pooling_factor": 3.0},
                                    {"rows": 100, "dim": 8, "multi_hot": 2}],
            "dense_features": 5, "bottom_mlp": [16, 8], "top_mlp": [12, 1], "batch_size": 16, **over}
    return parse_spec(data, "t")


@pytest.mark.torch
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("interaction", [{"type": "dot"}, {"type": "dcn", "layers": 2, "low_rank": 4}])
def test_plain_dlrm_is_the_model_the_estimator_counts(optimizer, interaction):
    torch = pytest.importorskip("torch")
    from slurm_dlrm.estimate.timeline import dense_param_bytes, embedding_optimizer_state_bytes
    from slurm_dlrm.selftest.plain_dlrm import build_trainer

    spec = _spec(optimizer={"type": optimizer}, interaction=interaction)
    trainer = build_trainer(spec, torch.device("cpu"))
    for _ in range(2):
        assert trainer.step() > 0
    dense = sum(p.numel() * p.element_size() for n, p in trainer.model.named_parameters() if not n.startswith("tables."))
    tables = sum(p.numel() * p.element_size() for p in trainer.model.tables.parameters())
    assert dense == dense_param_bytes(spec)  # same MLP, interaction and DCN shapes
    assert tables == sum(t.weight_bytes for t in spec.tables)
    assert trainer.optimizer_state_bytes()["embedding"] == embedding_optimizer_state_bytes(spec)


@pytest.mark.torch
def test_rowwise_adagrad_keeps_one_accumulator_per_row_and_updates_only_looked_up_rows():
    torch = pytest.importorskip("torch")
    from slurm_dlrm.selftest.plain_dlrm import RowwiseAdagrad

    w = torch.nn.Parameter(torch.ones(4, 2))
    opt = RowwiseAdagrad([w], lr=0.5, eps=0.0)
    w.grad = torch.sparse_coo_tensor(torch.tensor([[1, 3, 1]]), torch.tensor([[1.0, 3.0], [2.0, 2.0], [1.0, 1.0]]),
                                     (4, 2))
    opt.step()
    # row 1: gradient (2, 4) after coalescing, mean square 10; row 3: (2, 2), mean square 4
    acc = opt.state[w]["sum"]
    assert acc.tolist() == [0.0, 10.0, 0.0, 4.0]
    expect = torch.ones(4, 2)
    expect[1] -= 0.5 * torch.tensor([2.0, 4.0]) / 10.0 ** 0.5
    expect[3] -= 0.5 * torch.tensor([2.0, 2.0]) / 2.0
    assert torch.allclose(w.detach(), expect)


@pytest.mark.torch
def test_colocation_falls_back_to_time_slicing_when_mps_clients_fail(tmp_path, monkeypatch):
    """The daemon starts but its clients cannot use it (a driver or VM without working
    MPS): the table is still measured, by time-slicing, and says so."""
    pytest.importorskip("torch")
    from slurm_dlrm.emulated import nvml as fake_nvml
    from slurm_dlrm.selftest import gpu_check as G
    from slurm_dlrm.selftest import gpu_colocation as C

    monkeypatch.setenv(fake_nvml.ENV_FAKE_NVML, "")  # prepare() points it at its scenario; restored after
    out = G.Out(tmp_path / "out", dry=True)
    out.folder.mkdir()
    where = G.prepare(out, G.DEFAULT_SITE, None)
    real = C._start_workers
    calls = []

    def start(out_, where_, job_types, mps, thread_pct=100):
        calls.append(mps.on)
        if not mps.on:
            return real(out_, where_, job_types, mps, thread_pct)
        workers = []
        for name, _ in job_types:  # clients that die at CUDA's first call
            proc = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE,  # noqa: S603
                                    stdout=subprocess.PIPE, text=True)
            workers.append(C.Worker(name, proc, ready={"event": "error", "error": "CUDA error: MPS client failed"}))
        return workers

    monkeypatch.setattr(C, "_start_workers", start)
    try:
        result = C.step_colocation(out, where, G.JOB_TYPES[:2], 0.2)
    finally:
        import shutil

        shutil.rmtree(where.work, ignore_errors=True)
    assert calls[:2] == [True, False] and not any(calls[2:])  # then time-slicing only
    assert result["mode"] == "time-slicing" and "2 of 2 clients failed" in result["mps_detail"]
    assert len(result["alone"]) == 2 and len(result["groups"]) == 2  # the one pair, twice
    read, _ = read_groups(str(out.folder / "colocation.csv"))
    assert [len(g.members) for g in read] == [2, 2]
    assert "mode time-slicing" in (out.folder / "colocation.csv").read_text().splitlines()[0]


def test_colocation_windows_shrink_to_end_inside_the_budget():
    from slurm_dlrm.selftest.gpu_colocation import MIN_WINDOW_S, WINDOW_OVERHEAD_S, fit_window_s

    assert fit_window_s(3.0, 36, None) == 3.0  # dry: no budget
    assert fit_window_s(3.0, 36, 600.0) == 3.0  # room enough
    fitted = fit_window_s(3.0, 36, 90.0)
    assert fitted == pytest.approx(90.0 / 36 - WINDOW_OVERHEAD_S) and 36 * (fitted + WINDOW_OVERHEAD_S) <= 90.0
    assert fit_window_s(3.0, 36, 5.0) == MIN_WINDOW_S  # never below a measurable window


@pytest.mark.torch
def test_a_worker_that_dies_costs_its_own_pairs_only(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from slurm_dlrm.emulated import nvml as fake_nvml
    from slurm_dlrm.selftest import gpu_check as G
    from slurm_dlrm.selftest import gpu_colocation as C

    monkeypatch.setenv(fake_nvml.ENV_FAKE_NVML, "")
    out = G.Out(tmp_path / "out", dry=True)
    out.folder.mkdir()
    where = G.prepare(out, G.DEFAULT_SITE, None)
    real = C._start_workers

    def start(out_, where_, job_types, mps, thread_pct=100):
        if thread_pct != 100:  # the extra workers at other thread shares: as they are
            return real(out_, where_, job_types, mps, thread_pct)
        workers = real(out_, where_, job_types[:2], mps)
        # says it is ready, then dies (a CUDA error, an OOM) before its first window
        proc = subprocess.Popen([sys.executable, "-c", "print('{\"event\": \"ready\"}', flush=True)"],  # noqa: S603
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        proc.wait(timeout=60)
        dying = C.Worker(job_types[2][0], proc)
        dying.ready = dying.read(60)
        assert dying.ready["event"] == "ready"
        return [*workers, dying]

    monkeypatch.setattr(C, "_start_workers", start)
    try:
        result = C.step_colocation(out, where, G.JOB_TYPES[:3], 0.2)
    finally:
        import shutil

        shutil.rmtree(where.work, ignore_errors=True)
    dead = G.JOB_TYPES[2][0]
    assert result["alone"][dead]["window"]["event"] == "error"
    assert len(result["groups"]) == 4  # a pair and the triple, each tried twice
    read, _ = read_groups(str(out.folder / "colocation.csv"))  # only groups whose members all ran
    assert all(dead not in {str(j) for j in g.jobs} for g in read)
    with_dead = [g for g in result["groups"] if dead in g["jobs"]]
    assert len(read) == len(result["groups"]) - len(with_dead)


def test_gpu_sizes_cover_the_issue_and_fit_the_gpu():
    """The GPU-size configs (the dry run uses the small ones): they parse, cover what the
    issue asks, and the eight job types fit their MPS limits and one 80 GB GPU together."""
    from slurm_dlrm.estimate import estimate
    from slurm_dlrm.selftest.gpu_colocation import COLOCATE_MEM_LIMIT_MIB
    from slurm_dlrm.selftest.gpu_configs import JOB_TYPES, MEMORY_CONFIGS, spec_data
    from slurm_dlrm.site import REPO_SITE_FILE, load_site
    from slurm_dlrm.spec import parse_spec

    h100 = load_site(REPO_SITE_FILE).gpu_model("h100")
    memory = [parse_spec(spec_data(n, o, dry=False), n) for n, o in MEMORY_CONFIGS]
    assert len(memory) >= 12
    assert {s.optimizer.type for s in memory} >= {"sgd", "adagrad", "adam"}
    assert {s.mixed_precision for s in memory} == {"none", "bf16"}
    assert {s.interaction.type for s in memory} == {"dot", "dcn"}
    assert min(s.batch_size for s in memory) == 512 and max(s.batch_size for s in memory) == 16384
    assert {s.optimizer.fused for s in memory} == {True, False}
    jobs = [parse_spec(spec_data(n, o, dry=False), n) for n, o in JOB_TYPES]
    assert len(jobs) >= 8 and len({s.name for s in jobs}) == len(jobs)
    peaks = [estimate(s, h100).gpu_peak_bytes for s in jobs]
    assert max(peaks) < COLOCATE_MEM_LIMIT_MIB * (1 << 20) / 2  # the fence is a guard, never the limit met
    assert sum(peaks) < 0.5 * h100.memory_gib * (1 << 30)  # all eight warm workers on one GPU
    ids = [sum(t.ids_per_sample for t in s.tables) * s.batch_size for s in jobs]
    assert max(ids) / min(ids) >= 32  # ids per step: gather-heavy (1 M) to one id per table (32 k)


def test_groups_cover_sizes_2_to_5_with_every_job_type_about_as_often():
    from collections import Counter

    from slurm_dlrm.selftest.gpu_colocation import (
        GROUPS_PER_SIZE,
        REPEATS,
        choose_groups,
        group_thread_pcts,
    )
    from slurm_dlrm.selftest.gpu_configs import JOB_TYPES

    names = [n for n, _ in JOB_TYPES]
    groups = choose_groups(names, GROUPS_PER_SIZE)
    assert len(groups) >= 40 and len(set(groups)) == len(groups) and REPEATS == 2
    assert Counter(len(g) for g in groups) == Counter(GROUPS_PER_SIZE)
    per_job = Counter(n for g in groups for n in g)
    assert max(per_job.values()) - min(per_job.values()) <= 2
    assert choose_groups(names, GROUPS_PER_SIZE) == groups  # the same every run
    # busy members (NVML reads ~100 % SM alone): the agent caps each at 1.5x its share
    agent, applied = group_thread_pcts([100.0, 100.0, 100.0])
    assert agent == [50, 50, 50] and applied == [50, 50, 50]
    agent, applied = group_thread_pcts([30.0, 20.0])  # they fit: nobody capped
    assert agent == applied == [100, 100]
    agent, applied = group_thread_pcts([90.0, 100.0, 80.0, None])
    assert all(a <= p for a, p in zip(agent, applied, strict=True)) and applied[3] == applied[1]


def test_pack_placement_fences_members_as_the_service_does(tmp_path, monkeypatch):
    """Fences of the pack step: estimate + the site's margin, the over-fence member at a
    third of its estimate; thread shares from the packing policy; our runner as command."""
    from slurm_dlrm.emulated import nvml as fake_nvml
    from slurm_dlrm.estimate import estimate
    from slurm_dlrm.selftest import gpu_check as G
    from slurm_dlrm.selftest import gpu_pack as P
    from slurm_dlrm.site import load_site
    from slurm_dlrm.spec import parse_spec

    monkeypatch.setenv(fake_nvml.ENV_FAKE_NVML, "")
    out = G.Out(tmp_path / "out", dry=False)  # GPU sizes and fences, nothing started
    out.folder.mkdir()
    where = G.prepare(G.Out(tmp_path / "out", dry=True), G.DEFAULT_SITE, None)
    try:
        placement, rows = P.build_placement(out, where, tmp_path / "pack")
    finally:
        import shutil

        shutil.rmtree(where.work, ignore_errors=True)
    site = load_site(G.DEFAULT_SITE)
    h100 = site.gpu_model(where.model_name)
    margin = site.packing.memory_margin_pct
    assert len(placement["members"]) == 5 and placement["mps"] is True
    for m, r in zip(placement["members"], rows, strict=True):
        est = estimate(parse_spec(r["spec"], r["name"]), h100).gpu_peak_bytes
        assert r["spec"]["backend"] == "torch" and m["command"][1:3] == ["-m", "slurm_dlrm.train"]
        if r["name"] == P.OVER:
            assert m["gpu_mem_limit_mib"] * (1 << 20) < est / 2  # its real peak is over its fence
        else:
            assert est * (1 + margin / 100) <= m["gpu_mem_limit_mib"] * (1 << 20) < est * (1 + margin / 100) + (2 << 20)
        assert 10 <= m["mps_thread_pct"] <= 100
