"""`slurm-dlrm exporter` scraped over HTTP while a pack runs on the local Slurm cluster.

The packing service runs in this process (rounds every 0.5 s, its status file written
as `serve` writes it), its members are stand-ins (slurm_dlrm/emulated/standin/, no
torch) under the real agent, NVML is the fake that plays the driver for the members
(`discover_members`), and the exporter is the real command in its own process. Its text
is parsed with prometheus_client's parser, as Prometheus would.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_faults_live import add_standin

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slurm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:  # noqa: S310 - our own server
        assert r.status == 200
        text = r.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def samples(fams, name: str, **labels) -> list:
    family = re.sub(r"_(total|bucket|count|sum)$", "", name)
    return [s for s in fams.get(family, []) if s.name == name
            and all(s.labels.get(k) == v for k, v in labels.items())]


@pytest.fixture
def live(slurm_cluster, tmp_path, monkeypatch):
    from slurm_dlrm.service.core import PackingService, ServiceSettings
    from slurm_dlrm.site import load_site
    from slurm_dlrm.store.store import Store, current_user

    text = (REPO / "site-config" / "site.toml").read_text()
    text = text.replace('store_dir = "~/.local/share/slurm-dlrm"', f'store_dir = "{tmp_path}/store-{{user}}"')
    text = text.replace('spool_dir = "~/.local/share/slurm-dlrm/spool"', f'spool_dir = "{tmp_path}/spool-{{user}}"')
    assert text.count("sample_interval_s = 2.0") == 1
    text = text.replace("sample_interval_s = 2.0", "sample_interval_s = 0.5")
    site_file = tmp_path / "site.toml"
    site_file.write_text(text)
    scenario = tmp_path / "nvml.json"
    scenario.write_text(json.dumps({"gpu_count": 4, "discover_members": True}))
    monkeypatch.setenv("SLURM_DLRM_FAKE_NVML", str(scenario))  # sbatch exports it to the agents
    site = load_site(str(site_file))
    user = current_user()
    store = Store.for_user(site, user)
    svc = PackingService(store, slurm_cluster.client(), site,
                         ServiceSettings(user=user, python=sys.executable, max_attempts=2))
    port = free_port()
    log = (tmp_path / "exporter.log").open("w")
    proc = subprocess.Popen(  # noqa: S603 - fixed argv
        [sys.executable, "-m", "slurm_dlrm", "exporter", "--all-users", "--site", str(site_file),
         "--addr", "127.0.0.1", "--port", str(port), "--slow-every", "0"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "exporter.log").read_text()
                time.sleep(0.2)
        yield svc, store, site, site_file, port
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        ids = [int(p.slurm_job_id) for p in store.packs(["SUBMITTING", "QUEUED", "RUNNING"]) if p.slurm_job_id]
        if ids:
            slurm_cluster.client().scancel(ids)
        store.close()


def test_exporter_scraped_while_a_pack_runs(live):
    from slurm_dlrm.service.daemon import write_status
    from slurm_dlrm.service.submit import service_paths
    from slurm_dlrm.store.acct import AcctFilter, acct_rows

    svc, store, site, site_file, port = live
    user = svc.settings.user
    paths = service_paths(site, user)
    ids = [add_standin(store, user, f"m{i}", ["--steps", "60", "--step-s", "0.25"]) for i in range(3)]

    def round_() -> None:
        stats = svc.run_round()
        write_status(paths, {**svc.status(), "round_seconds": round(stats.seconds, 4)})  # as `serve` does

    def gpu_sampled() -> bool:
        n = store.conn.execute("SELECT count(*) FROM samples WHERE job_id IS NULL AND t > ?",
                               (time.time() - 30,)).fetchone()[0]
        return n > 0 and all(store.get_job(j).state == "RUNNING" for j in ids)

    deadline = time.monotonic() + 120
    while not gpu_sampled():
        assert time.monotonic() < deadline, [store.get_job(j).state for j in ids]
        round_()
        time.sleep(0.5)
    round_()
    fams = scrape(port)
    u = {"user": user}
    assert sum(s.value for s in samples(fams, "slurm_dlrm_jobs", state="RUNNING", **u)) == 3
    # Each scrape is answered on a new thread of the exporter's HTTP server, which reads
    # the stores through the connections the warm-up (and each scrape) left open.
    again = scrape(port)
    assert sum(s.value for s in samples(again, "slurm_dlrm_jobs", state="RUNNING", **u)) == 3
    assert sum(s.value for s in samples(again, "slurm_dlrm_store_errors_total")) == 0
    assert sum(s.value for s in samples(fams, "slurm_dlrm_packs", state="RUNNING", **u)) >= 1
    members = samples(fams, "slurm_dlrm_gpu_members", **u)
    assert sum(s.value for s in members) == 3
    pack_ids = {store.get_job(j).pack_id for j in ids}
    assert {s.labels["slurm_job_id"] for s in members} == {store.get_pack(p).slurm_job_id for p in pack_ids}
    assert all(s.labels["node"] and s.labels["partition"] and s.labels["gpu_model"] for s in members)
    fenced = {tuple(sorted(s.labels.items())): s.value for s in samples(fams, "slurm_dlrm_gpu_memory_fenced_bytes")}
    assert fenced and all(v > 0 for v in fenced.values())
    total = samples(fams, "slurm_dlrm_gpu_memory_total_bytes", **u)
    assert total and all(s.value == site.gpu_models[s.labels["gpu_model"]].memory_bytes for s in total)
    # the fake driver reports the members' RSS as their GPU memory: some GPU has memory in use
    used = samples(fams, "slurm_dlrm_gpu_memory_used_bytes", **u)
    assert used and max(s.value for s in used) > 0
    assert samples(fams, "slurm_dlrm_gpu_sm_utilization_ratio", **u)
    assert [s.value for s in samples(fams, "slurm_dlrm_service_slurm_reachable", **u)] == [1.0]
    assert samples(fams, "slurm_dlrm_service_last_round_age_seconds", **u)[0].value < 60
    assert sum(s.value for s in samples(fams, "slurm_dlrm_store_errors_total")) == 0

    # a second exporter on the same port: one line, exit 1
    res = subprocess.run([sys.executable, "-m", "slurm_dlrm", "exporter", "--site", str(site_file),  # noqa: S603
                          "--addr", "127.0.0.1", "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        f"slurm-dlrm: error: exporter: cannot listen on 127.0.0.1:{port}: port in use"]

    deadline = time.monotonic() + 150
    while not all(store.get_job(j).state in ("COMPLETED", "FAILED", "CANCELLED", "OOM") for j in ids):
        assert time.monotonic() < deadline, [store.get_job(j).state for j in ids]
        round_()
        time.sleep(0.5)
    while store.packs(["SUBMITTING", "QUEUED", "RUNNING"]) and time.monotonic() < deadline:
        round_()
        time.sleep(0.5)
    fams = scrape(port)
    assert sum(s.value for s in samples(fams, "slurm_dlrm_jobs", state="COMPLETED", **u)) == 3
    assert not samples(fams, "slurm_dlrm_gpu_members", **u)  # no running pack, no GPU series
    charged = sum(s.value for s in samples(fams, "slurm_dlrm_gpu_charged_seconds_total", **u))
    rows = acct_rows(store, AcctFilter())
    assert charged == pytest.approx(3600 * sum(r["gpu_hours"] for r in rows), rel=1e-6) and charged > 0
    assert sum(s.value for s in samples(fams, "slurm_dlrm_queue_wait_seconds_count", **u)) == 3
    assert os.path.exists(store.path)
