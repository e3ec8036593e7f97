"""Shared pieces of the service tests: a site in tmp, a fake clock, jobs with hand-made
estimates, and a tiny "cluster" that plays Slurm's scheduler and the agents on FakeSlurm."""

from __future__ import annotations

import json
import re
import shlex
import sqlite3
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_dlrm.site import REPO_SITE_FILE, SiteConfig, parse_site

GIB = 1 << 30
MIB = 1 << 20


class FakeClock:
    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


def make_site(tmp: Path, **packing: Any) -> SiteConfig:
    data = tomllib.loads(REPO_SITE_FILE.read_text())
    data["site"]["store_dir"] = str(tmp / "store-{user}")
    data["site"]["spool_dir"] = str(tmp / "spool-{user}")
    data["packing"].update(packing)
    return parse_site(data, "test-site")


def write_site_file(tmp: Path, store_dir: Path | None = None) -> Path:
    """The repository's site.toml with each user's store and spool under `tmp` (the same
    site as `make_site(tmp)`; `store_dir`: another store folder, with `{user}` in it),
    written to tmp/site.toml for $SLURM_DLRM_SITE."""
    text = REPO_SITE_FILE.read_text()
    for key, default, ours in (("store_dir", "~/.local/share/slurm-dlrm", store_dir or tmp / "store-{user}"),
                               ("spool_dir", "~/.local/share/slurm-dlrm/spool", tmp / "spool-{user}")):
        line = f'{key} = "{default}"'
        assert line in text, f"{REPO_SITE_FILE} has no line {line}"
        text = text.replace(line, f'{key} = "{ours}"')
    site_file = tmp / "site.toml"
    site_file.write_text(text)
    return site_file


def cli(*args: str) -> Any:
    """`slurm-dlrm ARGS` in this process (click's CliRunner); exceptions propagate."""
    from click.testing import CliRunner

    from slurm_dlrm.cli import cli as main

    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def show_job(job_id: int) -> dict[str, Any]:
    """`slurm-dlrm show JOB --json`, which must succeed."""
    r = cli("show", str(job_id), "--json")
    assert r.exit_code == 0, r.output
    return dict(json.loads(r.output))


def wait_until(what: Callable[[], Any], timeout_s: float = 240.0, every_s: float = 0.5) -> Any:
    """Polls `what` until it returns something true, and returns that; fails the test
    after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what.__doc__ or what}"
        time.sleep(every_s)


def fake_service(tmp: Path, user: str = "root", **settings: Any) -> tuple[Any, Any, Any, FakeClock]:
    """`user`'s packing service over a store in `tmp` (site: `make_site(tmp)`) and a
    FakeSlurm, on one FakeClock: (service, store, slurm, clock). `settings`: more
    ServiceSettings; it dispatches at once (dispatch_window_s 0) unless told otherwise.
    The caller closes the store."""
    from slurm_dlrm.service.core import PackingService, ServiceSettings
    from slurm_dlrm.slurm.fake import FakeSlurm
    from slurm_dlrm.store.store import Store

    clock = FakeClock()
    site = make_site(tmp)
    store = Store(tmp / "store.sqlite", clock=clock)
    slurm = FakeSlurm(clock=clock, user=user)
    svc = PackingService(store, slurm, site, ServiceSettings(
        user=user, python="/venv/bin/python", **{"dispatch_window_s": 0.0, **settings}), clock=clock)
    return svc, store, slurm, clock


def old_store(path: Path, version: int, edit: Callable[[str], str] = lambda stmt: stmt) -> sqlite3.Connection:
    """A store at `path` (its folder made, 0700) as schema `version` left it: the first
    `version` migrations applied, each statement through `edit` first (a CHECK that
    version had). Returns the open connection; the caller adds rows and sets
    user_version."""
    from slurm_dlrm.store.migrations import MIGRATIONS

    path.parent.mkdir(mode=0o700)
    conn = sqlite3.connect(path)
    for m in MIGRATIONS[:version]:
        for stmt in m.statements:
            conn.execute(edit(stmt))
        if m.apply is not None:
            m.apply(conn)
    return conn


def estimate_dict(gpu_gib: float = 2.0, host_gib: float = 1.0, sm: float = 30.0, bw: float = 30.0,
                  cores: float = 1.0, label: str = "compute-bound", sps: float = 50_000.0) -> dict[str, Any]:
    gpu = int(gpu_gib * GIB)
    return {
        "gpu_peak_bytes": gpu, "host_peak_bytes": int(host_gib * GIB),
        "gpu_breakdown": {"embeddings": gpu - 600 * MIB, "cuda_context": 600 * MIB},
        "host_breakdown": {"python": int(host_gib * GIB)},
        "profile": {"sm_util_pct": sm, "membw_util_pct": bw, "host_cpu_cores": cores, "label": label,
                    "flops_per_sample": 1e6, "emb_bytes_per_sample": 1e3, "solo_samples_per_s": sps},
    }


def spec_dict(name: str, steps: int = 100) -> dict[str, Any]:
    return {"name": name, "tables": [{"name": "t0", "rows": 1000, "dim": 8}], "dense_features": 13,
            "bottom_mlp": [16, 8], "top_mlp": [16, 1], "batch_size": 64, "steps": steps}


def request_row(name: str | None, **kw: Any) -> dict[str, Any]:
    """One job row of a submit request another login node drops (service/dropbox.py)."""
    return {"name": name, "spec": spec_dict(str(name)), "spec_fingerprint": f"fp-{name}",
            "estimate": estimate_dict(), "gpu_model": "h100", "sbatch": {}, "reason": "submitted from another host",
            **kw}


def ingest_dropped(site: SiteConfig, store_dir: Path, store: Any) -> Any:
    """One round of the service's reading of dropped requests into `store`, against a
    FakeSlurm (tests/conftest.py's `dropbox_env` gives the three)."""
    from slurm_dlrm.service.dropbox import ingest_requests
    from slurm_dlrm.service.remote import appliers
    from slurm_dlrm.slurm.fake import FakeSlurm
    from slurm_dlrm.store.store import current_user

    user = current_user()
    return ingest_requests(store, store_dir, user, appliers(site, user, FakeSlurm()))


def add_job(store: Any, name: str, *, user: str = "root", sbatch: dict[str, Any] | None = None,
            **est: Any) -> int:
    kw: dict[str, Any] = {}
    if sbatch is not None:
        kw["sbatch"] = sbatch
    return int(store.add_job(user=user, name=name, spec=spec_dict(name), spec_fingerprint=f"fp-{name}",
                             estimate=estimate_dict(**est), gpu_model="h100", **kw))


@dataclass
class FakeCluster:
    """Plays Slurm's scheduler and the pack agents around a FakeSlurm."""

    slurm: Any
    clock: FakeClock

    def placement_of(self, job_id: int) -> dict[str, Any]:
        script = self.slurm.job(job_id).script
        m = re.search(r"--pack-file (.+)$", script, re.M)
        assert m, script
        path = shlex.split(m.group(1))[0]
        return dict(json.loads(Path(path).read_text()))

    def report(self, placement: dict[str, Any], records: list[dict[str, Any]], node: str = "node1") -> None:
        reports = Path(placement["pack_dir"]) / "reports"
        reports.mkdir(exist_ok=True)
        with open(reports / f"{node}.jsonl", "a") as f:
            for r in records:
                f.write(json.dumps({"t": self.clock(), "pack_id": placement["pack_id"], "node": node, **r}) + "\n")

    def member(self, placement: dict[str, Any], job_id: int, state: str, exit_code: int | None = None,
               reason: str = "") -> None:
        self.report(placement, [{"type": "member", "job_id": job_id, "state": state, "exit_code": exit_code,
                                 "reason": reason}])

    def tick(self) -> None:
        """One step of the world: start pending packs, run their members to the end, finish."""
        for j in list(self.slurm.jobs.values()):
            if j.state.name == "PENDING":
                self.slurm.start(j.job_id)
                p = self.placement_of(j.job_id)
                for m in p["members"]:
                    self.member(p, m["job_id"], "RUNNING")
                    self.report(p, [{"type": "sample", "job_id": m["job_id"], "gpu_index": m["gpu_index"],
                                     "sm_util_pct": 20.0, "gpu_mem_bytes": GIB, "rss_bytes": GIB,
                                     "samples_per_s": 1000.0}])
            elif j.state.name == "RUNNING":
                p = self.placement_of(j.job_id)
                cancelled = {int(f.name) for f in (Path(p["pack_dir"]) / "cancel").glob("[0-9]*")}
                for m in p["members"]:
                    state = "CANCELLED" if m["job_id"] in cancelled else "COMPLETED"
                    self.member(p, m["job_id"], state, 0 if state == "COMPLETED" else None)
                self.slurm.finish(j.job_id)
        self.clock.advance(5.0)


def start_pack(svc: Any, slurm: Any, cluster: FakeCluster) -> tuple[Any, int, dict[str, Any]]:
    """One round, then Slurm starts the new pack and its members report RUNNING."""
    svc.run_round()
    pack = max(svc.store.packs(), key=lambda p: p.id)
    sid = int(pack.slurm_job_id)
    slurm.start(sid)
    p = cluster.placement_of(sid)
    for m in p["members"]:
        cluster.member(p, m["job_id"], "RUNNING")
    svc.run_round()
    return svc.store.get_pack(pack.id), sid, p
