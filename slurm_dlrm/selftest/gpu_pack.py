"""Step of `scripts/gpu-check.sh` (issue 38): a real pack on GPU 0, without Slurm.

A placement file like the pack script's (`<pack_dir>/placement.json`), five members of
our runner (`slurm-dlrm train`, `backend: torch`), each fenced as the service fences:
the MPS thread share the packing policy gives (`packing.common.thread_pcts` of the
estimator's SM shares) and a pinned device-memory limit of the estimate plus the
site's `packing.memory_margin_pct`. One member (`over-fence`) is fenced at a third of
its estimate: its real peak is over its fence, and it must be stopped and reported as
a GPU OOM while its neighbours finish. `slurm-dlrm agent --pack-file` runs them
(`--launch process`, our own MPS daemon; dry: the fake NVML and no MPS, where the
agent's own sampling stops a member past its fence) and samples NVML into its reports;
the reports are then ingested into a fresh store (the service's ingest) and `acct` is
read for the five jobs. pack.jsonl gets one line per member (fence, estimate, thread
share, end state, the runner's and NVML's peaks) and one with the agent's summary, the
store's samples and the acct rows.

Dry (CPU): members at the dry sizes; a CPU process's "device memory" in the fake NVML
is its RSS (hundreds of MiB), so the neighbours' fences are raised to DRY_FENCE_MIB
(said in the record) and the over-fence member's is set below its RSS.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from slurm_dlrm.selftest.gpu_configs import JOB_TYPES, MIB, Env, Out, spec_data

PACK_STEPS = 60
DRY_PACK_STEPS = 30
PACK_TIMEOUT_S = 240.0
OVER_FENCE_SHARE = 3  # the over-fence member's fence: its estimate / 3
DRY_FENCE_MIB = 8 * 1024  # dry neighbours: above a CPU runner's RSS (the fake NVML's "device memory")
DRY_OVER_FENCE_MIB = 64  # dry: below any CPU runner's RSS
HOST_LIMIT_BYTES = 24 << 30  # the members' host budget: not what this step checks
OVER = "over-fence"
# Four job types beside one another, and one that goes past its fence.
PACK_JOBS: tuple[tuple[str, str], ...] = (
    ("emb-gather-sgd", "emb-gather-sgd"),
    ("emb-gather-adagrad", "emb-gather-adagrad"),
    ("dcn-rowwise", "dcn-rowwise"),
    ("mlp-wide-sgd", "mlp-wide-sgd"),
    (OVER, "emb-gather-adagrad"),
)


def _job_type(name: str) -> dict[str, Any]:
    types = dict(JOB_TYPES)
    return types.get(name) or next(iter(types.values()))


def build_placement(out: Out, where: Env, pack_dir: Path, job_ids: list[int] | None = None,
                    pack_id: int = 38) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the placement file's content, what each member was given and why); `job_ids` and
    `pack_id`: the store's, when there is one."""
    from slurm_dlrm.estimate import estimate
    from slurm_dlrm.packing.common import thread_pcts
    from slurm_dlrm.packing.interference import util_fraction
    from slurm_dlrm.site import load_site
    from slurm_dlrm.spec import parse_spec

    site = load_site(where.site_path)
    model = site.gpu_model(where.model_name)
    margin_pct = site.packing.memory_margin_pct
    steps = DRY_PACK_STEPS if out.dry else PACK_STEPS
    rows: list[dict[str, Any]] = []
    for i, (name, type_name) in enumerate(PACK_JOBS):
        data = dict(spec_data(name, _job_type(type_name), out.dry), backend="torch", steps=steps,
                    checkpoint_every_steps=steps // 2, metrics_every_steps=5)
        spec = parse_spec(data, name)
        est = estimate(spec, model)
        run = pack_dir / name
        run.mkdir(parents=True, exist_ok=True)
        (run / "spec.json").write_text(json.dumps(data))
        fence_mib = int(est.gpu_peak_bytes * (1 + margin_pct / 100.0) / MIB) + 1
        why = f"estimate + {margin_pct:g}% (the service's fence)"
        if name == OVER:
            fence_mib = max(1, est.gpu_peak_bytes // OVER_FENCE_SHARE // MIB)
            why = f"estimate / {OVER_FENCE_SHARE}: its real peak is over its fence (meant to go over)"
        if out.dry:
            fence_mib, why = (DRY_OVER_FENCE_MIB, "dry: below the runner's RSS") if name == OVER else \
                (DRY_FENCE_MIB, "dry: above a CPU runner's RSS (the fake NVML's device memory)")
        rows.append({"job_id": job_ids[i] if job_ids else 900_001 + i, "name": name, "job_type": type_name, "spec": data,
                     "estimate_bytes": est.gpu_peak_bytes, "estimate": est.to_dict(), "fence_mib": fence_mib,
                     "fence_why": why, "sm_util_pct": est.profile.sm_util_pct, "run": str(run)})
    pcts = thread_pcts([util_fraction(r["sm_util_pct"]) for r in rows])
    members = []
    for r, pct in zip(rows, pcts, strict=True):
        r["mps_thread_pct"] = pct
        members.append({
            "job_id": r["job_id"], "name": r["name"], "node_index": 0, "gpu_index": 0, "mps_thread_pct": pct,
            "gpu_mem_limit_mib": r["fence_mib"], "gpu_mem_estimate_mib": max(1, r["estimate_bytes"] // MIB),
            "host_mem_limit_bytes": HOST_LIMIT_BYTES, "cpus": 1,
            "command": [sys.executable, "-m", "slurm_dlrm.train", str(Path(r["run"]) / "spec.json"),
                        "--device", where.device, "--no-resume"],
            "checkpoint_dir": str(Path(r["run"]) / "ckpt"), "metrics_path": str(Path(r["run"]) / "metrics.jsonl"),
        })
    placement = {"pack_id": pack_id, "user": getpass.getuser(), "mps": not out.dry, "sample_interval_s": 0.5,
                 "host_mem_tolerance_pct": 10.0, "term_grace_s": 30.0, "pack_dir": str(pack_dir), "members": members}
    return placement, rows


def _reports(pack_dir: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(pack_dir.glob("reports/*.jsonl")):
        for line in f.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict):
                    out.append(rec)
    return out


class _PackStore:
    """The service's side in a fresh store: the jobs and the pack before the agent runs
    (their ids go into the placement), then the agent's reports ingested (its NVML
    samples), the jobs moved to how they ended, and `acct`'s rows."""

    def __init__(self, where: Env) -> None:
        from slurm_dlrm.store.store import Store

        self.store = Store(where.work / "pack-store.sqlite")
        self.where = where

    def plan(self, rows: list[dict[str, Any]], placement: dict[str, Any]) -> None:
        from slurm_dlrm.store.records import NewPlacement

        for r, m in zip(rows, placement["members"], strict=True):
            r["store_job_id"] = self.store.add_job(user=placement["user"], name=r["name"], spec=r["spec"],
                                                   spec_fingerprint=r["name"], estimate=r["estimate"],
                                                   gpu_model=self.where.model_name)
            m["job_id"] = r["job_id"] = r["store_job_id"]
        news = [NewPlacement(m["job_id"], 0, 0, mps_thread_pct=m["mps_thread_pct"],
                             gpu_mem_limit_bytes=m["gpu_mem_limit_mib"] * MIB) for m in placement["members"]]
        placement["pack_id"] = self.store.add_pack(name="gpuchk-pack", user=placement["user"], policy="complementary",
                                                   n_gpus=1, gpu_model=self.where.model_name,
                                                   pack_dir=placement["pack_dir"], placements=news)
        for r in rows:
            self.store.transition_job(r["job_id"], "RUNNING", "the agent starts it", pack_id=placement["pack_id"])

    def finish(self, placement: dict[str, Any], rows: list[dict[str, Any]], states: dict[str, str]) -> dict[str, Any]:
        from slurm_dlrm.store.acct import AcctFilter, acct_rows
        from slurm_dlrm.store.ingest import ingest_pack_reports

        ingested = ingest_pack_reports(self.store, placement["pack_dir"])
        ended = {"COMPLETED": "COMPLETED", "OOM_GPU": "OOM", "OOM_HOST": "OOM", "PREEMPTED": "PREEMPTED",
                 "CANCELLED": "CANCELLED"}
        moves = []
        for r in rows:
            state = states.get(str(r["job_id"])) or ""
            try:
                self.store.transition_job(r["job_id"], ended.get(state, "FAILED"), f"agent: {state}")
            except Exception as exc:  # noqa: BLE001 - recorded, the check goes on
                moves.append(f"{r['name']}: {exc}")
        samples = self.store.conn.execute("SELECT job_id, COUNT(*), MAX(gpu_mem_bytes) FROM samples "
                                          "GROUP BY job_id ORDER BY job_id").fetchall()
        acct = acct_rows(self.store, AcctFilter(job_ids=tuple(r["job_id"] for r in rows)))
        return {"ingested": {"lines": ingested.lines, "samples": ingested.samples, "records": ingested.records},
                "samples_by_job": [list(x) for x in samples], "acct": acct, "moves_refused": moves}


def step_pack(out: Out, where: Env) -> dict[str, Any]:
    pack_dir = where.work / "pack"
    pack_dir.mkdir(parents=True, exist_ok=True)
    placement, rows = build_placement(out, where, pack_dir)
    store: _PackStore | None = None
    store_error = None
    try:
        store = _PackStore(where)
        store.plan(rows, placement)
    except ImportError as exc:  # the GPU image lacks sqlite-utils unless its wheels travel
        store, store_error = None, f"no store here ({exc}): carry sqlite-utils' wheels (scripts/gpu-check.sh)"
    (pack_dir / "placement.json").write_text(json.dumps(placement, indent=1))
    argv = [sys.executable, "-m", "slurm_dlrm", "agent", "--pack-file", str(pack_dir / "placement.json"),
            "--site", str(where.site_path), "--node-index", "0", "--node-name", "gpuchk", "--gpus", "0",
            "--launch", "process", "--mps", "off" if out.dry else "own", "--json"]
    out.log("pack: " + " ".join(argv[2:]))
    env = dict(where.env)
    env.pop("SLURM_JOB_ID", None)  # no Slurm here: the agent launches processes
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=PACK_TIMEOUT_S,  # noqa: S603
                              check=False)
        code: int | None = proc.returncode
        stdout, stderr = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, stdout, stderr = None, str(exc.stdout or ""), str(exc.stderr or "")
    seconds = round(time.monotonic() - t0, 1)
    summary: dict[str, Any] = {}
    with contextlib.suppress(ValueError, IndexError):
        summary = json.loads(stdout.strip().splitlines()[-1])
    states = {str(k): v for k, v in (summary.get("members") or {}).items()}
    reports = _reports(pack_dir)
    ends = {r["job_id"]: r for r in reports if r.get("type") == "member"}
    result: dict[str, Any] = {"agent_exit_code": code, "seconds": seconds, "agent": summary, "members": []}
    for r in rows:
        samples = [s for s in reports if s.get("type") == "sample" and s.get("job_id") == r["job_id"]]
        nvml_peak = max((s["gpu_mem_bytes"] for s in samples if s.get("gpu_mem_bytes") is not None), default=None)
        metrics = Path(r["run"]) / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        last = json.loads(lines[-1]) if lines else {}
        end = ends.get(r["job_id"], {})
        rec = {"kind": "member", "job_id": r["job_id"], "name": r["name"], "job_type": r["job_type"],
               "meant_to_go_over": r["name"] == OVER, "fence_mib": r["fence_mib"], "fence_why": r["fence_why"],
               "estimate_bytes": r["estimate_bytes"], "mps_thread_pct": r["mps_thread_pct"],
               "state": states.get(str(r["job_id"]), end.get("state")), "exit_code": end.get("exit_code"),
               "reason": end.get("reason"), "steps_done": last.get("step"), "steps_total": r["spec"]["steps"],
               "runner_peak_gpu_bytes": last.get("peak_gpu_bytes"), "nvml_peak_bytes": nvml_peak,
               "samples": len(samples)}
        result["members"].append(rec)
        out.jsonl("pack.jsonl", rec)
        out.log(f"pack {r['name']}: {rec['state']} ({rec['reason']}), fence {r['fence_mib']} MiB, estimate "
                f"{r['estimate_bytes'] / MIB:.0f} MiB, NVML peak {(nvml_peak or 0) / MIB:.0f} MiB, threads "
                f"{r['mps_thread_pct']}%")
    result["store"] = store.finish(placement, rows, states) if store is not None else {"error": store_error}
    if code != 0:
        result["agent_stderr"] = stderr.strip()[-1500:]
    out.jsonl("pack.jsonl", {"kind": "agent", **{k: v for k, v in result.items() if k != "members"},
                             "placement": placement})
    return result


def pack_verdict(pack: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets: the over-fence member a GPU OOM, no other OOM, the
    neighbours 100 % complete."""
    over = [m for m in pack["members"] if m["meant_to_go_over"]]
    others = [m for m in pack["members"] if not m["meant_to_go_over"]]
    other_ooms = [m["name"] for m in others if m["state"] in ("OOM_GPU", "OOM_HOST")]
    done = [m["name"] for m in others if m["state"] == "COMPLETED" and m["steps_done"] == m["steps_total"]]
    return {"over_fence_gpu_oom": bool(over) and all(m["state"] == "OOM_GPU" for m in over),
            "other_ooms": other_ooms, "neighbours_complete": len(done), "neighbours": len(others),
            "met": bool(over) and all(m["state"] == "OOM_GPU" for m in over) and not other_ooms
            and len(done) == len(others)}


def summary_lines(pack: dict[str, Any], dry: bool) -> list[str]:
    v = pack_verdict(pack)
    store = pack.get("store") or {}
    verdict = "DRY" if dry else ("target met" if v["met"] else "target NOT met")
    lines = [f"pack (agent --pack-file, {len(pack['members'])} members of our runner on GPU 0, "
             f"{pack['seconds']} s): over-fence member GPU OOM: {v['over_fence_gpu_oom']}; other OOMs: "
             f"{v['other_ooms'] or 'none'}; neighbours complete {v['neighbours_complete']}/{v['neighbours']}: "
             f"{verdict}"]
    for m in pack["members"]:
        lines.append(f"  {m['name']}: {m['state']} fence {m['fence_mib']} MiB, estimate "
                     f"{m['estimate_bytes'] / MIB:.0f} MiB, NVML peak {(m['nvml_peak_bytes'] or 0) / MIB:.0f} MiB, "
                     f"runner peak {(m['runner_peak_gpu_bytes'] or 0) / MIB:.0f} MiB")
    if "error" in store:
        lines.append(f"  store: {store['error']}")
    else:
        lines.append(f"  store: {store.get('ingested', {}).get('samples')} samples ingested, acct rows "
                     f"{len(store.get('acct') or [])}")
    return lines
