"""Step 3 of `scripts/gpu-check.sh`: the co-location table.

One warm worker process per job type (`python -m slurm_dlrm.selftest.gpu_worker
colocate`), timed alone (NVML's SM and memory-controller busy shares sampled through the
agent's seam meanwhile, and GPM's SM utilisation, SM occupancy, DRAM bandwidth and
tensor activity where the GPU has GPM) and in groups of 2, 3, 4 and 5, under our own
MPS daemon (the agent's `open_mps`; each worker gets the agent's `member_env`) or, when
its clients cannot use it, time-slicing. Each group runs with the MPS thread shares
the agent would set for it (`packing.common.thread_pcts` of the members' solo SM
shares, rounded up to a ladder so that warm workers can be shared between groups; both
recorded), and every window (alone and group) runs twice, so the noise floor is in the
data. Written to colocation.jsonl and colocation.csv, the CSV in the form `slurm-dlrm
interference eval --samples` reads (docs/packing.md), one group per window.
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_dlrm.selftest.gpu_configs import GIB, Env, Out, spec_data

WORKER_READY_TIMEOUT_S = 180.0
NVML_SAMPLE_S = 0.1
# Each worker's MPS memory limit: a fence against a runaway, far above what any job type
# here takes (the fence itself is the selftest's check).
COLOCATE_MEM_LIMIT_MIB = 12 * 1024
MIN_WINDOW_S = 0.5
WINDOW_OVERHEAD_S = 0.5  # per window: the commands, NVML's set-up, reading the events
# Groups measured per size (issue 38: >= 40 in all, sizes 2-5), each window twice.
GROUPS_PER_SIZE = {2: 12, 3: 12, 4: 10, 5: 8}
DRY_GROUPS_PER_SIZE = {2: 1, 3: 1, 4: 1, 5: 1}
REPEATS = 2
# MPS thread shares a warm worker can run at: the agent's share for a member is rounded
# up to the next one (never below what the agent would give).
THREAD_PCT_LADDER = (20, 30, 40, 50, 75, 100)
_WORKER_SEQ = itertools.count()  # each worker its own member job id


@dataclass
class Worker:
    name: str
    proc: subprocess.Popen[str]
    ready: dict[str, Any] | None = None

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        # A worker that died (CUDA error, OOM) shows as an "error" event at the next read,
        # not as a broken pipe that would end the whole table.
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def read(self, timeout_s: float) -> dict[str, Any]:
        """The next event; an "error" event when the worker died or said nothing in time."""
        import selectors

        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    break
                line = self.proc.stdout.readline()
                if not line:
                    return {"event": "error", "error": f"worker exited ({self.proc.poll()})"}
                with contextlib.suppress(ValueError):
                    ev = json.loads(line)
                    if isinstance(ev, dict) and "event" in ev:
                        return ev
        finally:
            sel.close()
        return {"event": "error", "error": f"no answer in {timeout_s:.0f} s"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.send("quit")
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _open_mps(out: Out, where: Env) -> Any:
    from slurm_dlrm.agent.mps import open_mps

    mps = open_mps(True, ["0"], where.work, "chk", env=where.env, site_mode="own")
    out.log(f"co-location: MPS {mps.mode}: {mps.detail}")
    return mps


def _member_env(where: Env, mps: Any, i: int, name: str, thread_pct: int = 100) -> dict[str, str]:
    from slurm_dlrm.agent.launch import member_env
    from slurm_dlrm.agent.placement import MemberPlacement

    m = MemberPlacement(job_id=700_000 + i, name=name, node_index=0, gpu_index=0, mps_thread_pct=thread_pct,
                        gpu_mem_limit_mib=COLOCATE_MEM_LIMIT_MIB, host_mem_limit_bytes=0, cpus=1, command=(),
                        checkpoint_dir=str(where.work / name), metrics_path=str(where.work / name / "m.jsonl"))
    gpus = [where.env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]]
    return member_env(where.env, m, gpus, mps)


def _window(out: Out, where: Env, workers: list[Worker], seconds: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run one timed window on these workers at once; NVML sampled meanwhile."""
    from slurm_dlrm.agent.nvml import Nvml

    nv = Nvml()
    nvml_ok = nv.init() and where.nvml_index is not None
    for w in workers:
        w.send(f"run {seconds}")
    gpm_start_s = min(0.5, seconds / 3)  # past the first kernels, as the busy shares
    gpm: Any = None  # None: not begun; False: no GPM here
    sm: list[float] = []
    bw: list[float] = []
    mem_by_pid: dict[int, int] = {}
    t_end = time.monotonic() + seconds
    while nvml_ok and time.monotonic() < t_end:
        time.sleep(NVML_SAMPLE_S)
        assert where.nvml_index is not None
        snap = nv.sample([where.nvml_index])
        if gpm is None and time.monotonic() > t_end - seconds + gpm_start_s:
            gpm = nv.gpm_begin(where.nvml_index) or False
        if snap.gpus and time.monotonic() > t_end - seconds + gpm_start_s:  # past the first kernels
            g = snap.gpus[0]
            if g.sm_util_pct is not None:
                sm.append(g.sm_util_pct)
            if g.mem_util_pct is not None:
                bw.append(g.mem_util_pct)
        for p in snap.processes:
            if p.gpu_mem_bytes is not None:
                mem_by_pid[p.pid] = max(mem_by_pid.get(p.pid, 0), p.gpu_mem_bytes)
    gpm_metrics = nv.gpm_end(gpm) if gpm else None  # None: no GPM here (before Hopper)
    nv.shutdown()
    events = [w.read(seconds + 120) for w in workers]
    nvml = {"sm_util_pct": round(statistics.fmean(sm), 1) if sm else None,
            "membw_util_pct": round(statistics.fmean(bw), 1) if bw else None, "samples": len(sm),
            "gpu_mem_bytes_by_pid": {str(k): v for k, v in mem_by_pid.items()}, "gpm": gpm_metrics}
    return events, nvml


def _no_mps(detail: str) -> Any:
    from slurm_dlrm.agent.mps import MpsSetup

    return MpsSetup("off", None, detail)


def _quit_mps(mps: Any) -> None:
    if mps.daemon is not None and mps.mode == "own":
        with contextlib.suppress(Exception):
            mps.daemon.quit()


def _start_workers(out: Out, where: Env, job_types: tuple[tuple[str, dict[str, Any]], ...], mps: Any,
                   thread_pct: int = 100) -> list[Worker]:
    """One warm worker per job type, each an MPS client of `mps` when it is on (at this
    MPS thread share); started together, waited for one by one."""
    workers = []
    for name, overrides in job_types:
        spec_file = where.work / f"{name}.json"
        spec_file.write_text(json.dumps(spec_data(name, overrides, out.dry)))
        argv = [sys.executable, "-m", "slurm_dlrm.selftest.gpu_worker", "colocate", str(spec_file),
                "--device", where.device]
        if where.nvml_index is not None:
            argv += ["--nvml-index", str(where.nvml_index)]
        env = _member_env(where, mps, next(_WORKER_SEQ), name, thread_pct)
        if out.dry:
            env["CUDA_VISIBLE_DEVICES"] = "0"  # the fake NVML's member discovery reads it
        with open(where.work / f"{name}-{thread_pct}.err", "w") as err:  # the child keeps its own descriptor
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,  # noqa: S603
                                    stderr=err, text=True)
        workers.append(Worker(name, proc))
    for w in workers:
        w.ready = w.read(WORKER_READY_TIMEOUT_S)
        if w.ready.get("event") != "ready":
            with contextlib.suppress(OSError):
                tail = (where.work / f"{w.name}-{thread_pct}.err").read_text().strip().splitlines()[-1:]
                w.ready["stderr"] = tail[0][:300] if tail else ""
            out.log(f"co-location {w.name}: did not start: {w.ready.get('error')} {w.ready.get('stderr', '')}")
    return workers


def fit_window_s(window_s: float, windows: int, seconds_left: float | None) -> float:
    """The window that lets every alone and pair window finish in what is left of the
    budget (each window also costs ~WINDOW_OVERHEAD_S of commands and NVML set-up)."""
    if seconds_left is None or windows <= 0:
        return window_s
    return min(window_s, max(MIN_WINDOW_S, seconds_left / windows - WINDOW_OVERHEAD_S))


def choose_groups(names: list[str], per_size: dict[int, int], seed: int = 38) -> list[tuple[str, ...]]:
    """For each size, that many distinct groups of the job types, each job type in about
    as many groups as the others (greedy over a seeded shuffle: the same every run)."""
    rng = random.Random(seed)
    out: list[tuple[str, ...]] = []
    counts = dict.fromkeys(names, 0)  # over all sizes
    for k, want in sorted(per_size.items()):
        if k > len(names):
            continue
        combos = list(itertools.combinations(names, k))
        rng.shuffle(combos)
        for _ in range(min(want, len(combos))):
            best = min(range(len(combos)), key=lambda i: (sum(counts[n] for n in combos[i]), i))
            group = combos.pop(best)
            for n in group:
                counts[n] += 1
            out.append(group)
    return out


def group_thread_pcts(solo_sm_pct: list[float | None]) -> tuple[list[int], list[int]]:
    """(the MPS thread shares the agent would set for these members, the ladder step each
    runs at: the next one up). An unknown solo SM share counts as a busy GPU (100 %)."""
    from slurm_dlrm.packing.common import thread_pcts
    from slurm_dlrm.packing.interference import util_fraction

    agent = thread_pcts([util_fraction(100.0 if x is None else x) for x in solo_sm_pct])
    return agent, [next(p for p in THREAD_PCT_LADDER if p >= a) for a in agent]


def _solo_rate(alone: dict[str, Any]) -> float | None:
    rates = [ev.get("steps_per_s") for ev in alone.get("windows", [alone.get("window") or {}])]
    rates = [r for r in rates if r]
    return statistics.fmean(rates) if rates else None


def step_colocation(out: Out, where: Env, job_types: tuple[tuple[str, dict[str, Any]], ...],
                    window_s: float, deadline: float | None = None) -> dict[str, Any]:
    from slurm_dlrm.estimate import estimate
    from slurm_dlrm.site import load_site
    from slurm_dlrm.spec import parse_spec

    model = load_site(where.site_path).gpu_model(where.model_name)
    mps = _open_mps(out, where)
    workers: list[Worker] = []
    extra: list[Worker] = []
    result: dict[str, Any] = {"mode": "mps" if mps.on else "time-slicing", "mps_detail": mps.detail, "alone": {},
                              "groups": [], "repeats": REPEATS}
    try:
        workers = _start_workers(out, where, job_types, mps)
        live = [w for w in workers if w.ready and w.ready.get("event") == "ready"]
        if mps.on and len(live) < 2:
            # The daemon started but its clients could not use it: time-slicing still gives a table.
            why = "; ".join(f"{w.name}: {(w.ready or {}).get('error')}" for w in workers if w not in live)[:500]
            for w in workers:
                w.stop()
            _quit_mps(mps)
            mps = _no_mps(f"MPS daemon started, but {len(workers) - len(live)} of {len(workers)} clients failed "
                          f"({why}): time-slicing instead")
            out.log(f"co-location: {mps.detail}")
            result.update(mode="time-slicing", mps_detail=mps.detail)
            workers = _start_workers(out, where, job_types, mps)
            live = [w for w in workers if w.ready and w.ready.get("event") == "ready"]
        mode = result["mode"]
        groups = choose_groups([w.name for w in live], DRY_GROUPS_PER_SIZE if out.dry else GROUPS_PER_SIZE)
        n_windows = REPEATS * (len(live) + len(groups))
        left = None if deadline is None else deadline - time.monotonic()
        # extra workers (other thread shares) start once per group size: ~20 s each on a GPU
        fitted = fit_window_s(window_s, n_windows, None if left is None else left - 20.0 * 4)
        if fitted < window_s:
            out.log(f"co-location: {left:.0f} s of the budget left for {n_windows} windows: "
                    f"{fitted:.2f} s each instead of {window_s:g} s")
        window_s = result["window_s"] = fitted
        by_name = {w.name: w for w in live}
        for w in live:
            spec = parse_spec(spec_data(w.name, dict(job_types)[w.name], out.dry), w.name)
            prof = estimate(spec, model).profile
            runs = [_window(out, where, [w], window_s) for _ in range(REPEATS)]
            evs = [r[0][0] for r in runs]
            nvml = runs[0][1]
            sm = [r[1]["sm_util_pct"] for r in runs if r[1]["sm_util_pct"] is not None]
            bw = [r[1]["membw_util_pct"] for r in runs if r[1]["membw_util_pct"] is not None]
            nvml = dict(nvml, sm_util_pct=round(statistics.fmean(sm), 1) if sm else None,
                        membw_util_pct=round(statistics.fmean(bw), 1) if bw else None,
                        repeats=[r[1] for r in runs])
            mem = nvml["gpu_mem_bytes_by_pid"].get(str(w.proc.pid)) or (w.ready or {}).get("nvml_process_bytes")
            rec = {"kind": "alone", "job": w.name, "mode": mode, "window": evs[0], "windows": evs, "nvml": nvml,
                   "gpu_mem_bytes": mem, "estimator_profile": {"sm_util_pct": prof.sm_util_pct,
                                                               "membw_util_pct": prof.membw_util_pct,
                                                               "label": prof.label},
                   "from_step_times": step_time_profile(evs[0], prof, model, spec.mixed_precision != "none")}
            result["alone"][w.name] = rec
            out.jsonl("colocation.jsonl", rec)
            out.log(f"alone {w.name}: {[round(e.get('steps_per_s') or 0, 1) for e in evs]} steps/s, "
                    f"SM {nvml['sm_util_pct']}%, mem-bw {nvml['membw_util_pct']}%, GPM {runs[0][1]['gpm']}")
        for k in sorted({len(g) for g in groups}):
            sized = [g for g in groups if len(g) == k]
            shares = {g: group_thread_pcts([result["alone"][n]["nvml"]["sm_util_pct"] for n in g]) for g in sized}
            # warm workers at the other shares this size needs (dry: for pairs only, to keep CI short)
            need = sorted({(n, p) for g in sized for n, p in zip(g, shares[g][1], strict=True) if p != 100})
            if out.dry and k > 2:
                need = []
                shares = {g: (a, [100] * len(g)) for g, (a, _) in shares.items()}
            at: dict[tuple[str, int], Worker] = {(w.name, 100): w for w in live}
            for share in sorted({p for _, p in need}):
                started = _start_workers(out, where, tuple((n, dict(job_types)[n]) for n, p in need if p == share),
                                         mps, share)
                extra.extend(started)
                at.update({(w.name, share): w for w in started if w.ready and w.ready.get("event") == "ready"})
            for g in sized:
                agent_pct, pct = shares[g]
                members: list[Worker | None] = [at.get((n, p)) for n, p in zip(g, pct, strict=True)]
                if any(m is None for m in members):  # a worker at that share did not start: at 100 %
                    members = [by_name[n] for n in g]
                    pct = [100] * len(g)
                for r in range(REPEATS):
                    events, nvml = _window(out, where, [m for m in members if m is not None], window_s)
                    rec = {"kind": "group", "size": k, "jobs": list(g), "repeat": r, "mode": mode,
                           "agent_thread_pct": agent_pct, "thread_pct": pct, "windows": events, "nvml": nvml}
                    result["groups"].append(rec)
                    out.jsonl("colocation.jsonl", rec)
                    speeds = [_speed(result["alone"][n], ev) for n, ev in zip(g, events, strict=True)]
                    out.log(f"group {'+'.join(g)} (repeat {r + 1}, threads {pct}): speeds {speeds}, "
                            f"GPM {nvml['gpm']}")
            for w in extra:  # this size's extra clients leave the MPS server
                w.stop()
            extra = []
    finally:
        for w in workers + extra:
            w.stop()
        _quit_mps(mps)
    write_colocation_csv(out, result)
    return result


def step_time_profile(ev: dict[str, Any], prof: Any, model: Any, half: bool) -> dict[str, Any] | None:
    """The job's achieved FLOP/s and embedding bytes/s (the estimator's per-sample counts
    times the measured samples/s) as shares of the GPU model's peaks: a second view of
    the profile beside NVML's busy shares, which read ~100 % for any job that keeps a
    kernel running."""
    rate = ev.get("samples_per_s")
    if not rate:
        return None
    tflops = rate * prof.flops_per_sample / 1e12
    gbps = rate * prof.emb_bytes_per_sample / 1e9
    peak_tflops = 2 * model.tf32_tflops if half else model.fp32_tflops
    return {"achieved_tflops": round(tflops, 3), "sm_pct_of_peak": round(100 * tflops / peak_tflops, 2),
            "achieved_emb_gbps": round(gbps, 2), "membw_pct_of_peak": round(100 * gbps / model.mem_bandwidth_gbps, 2),
            "peak_tflops": peak_tflops, "peak_gbps": model.mem_bandwidth_gbps}


def _speed(alone: dict[str, Any], ev: dict[str, Any]) -> float | None:
    solo = _solo_rate(alone)
    together = ev.get("steps_per_s")
    return round(together / solo, 4) if solo and together is not None else None


def write_colocation_csv(out: Out, result: dict[str, Any]) -> Path:
    """One row per member of each measured group window (a repeat is its own group, so
    the noise floor is in the samples), in `interference eval --samples` form: the solo
    profile (NVML's shares alone, else the estimator's, marked in the JSONL)."""
    path = out.folder / "colocation.csv"
    with open(path, "w", newline="") as f:
        tag = "DRY: fake NVML/MPS, CPU torch: NOT a GPU measurement" if out.dry else "measured on a GPU"
        f.write(f"# {tag}; mode {result['mode']}; speeds are co-located steps/s over alone steps/s (mean of "
                f"{result.get('repeats', 1)} alone windows); group gNNNrR = group NNN, repeat R\n")
        w = csv.writer(f)
        w.writerow(["group", "job", "sm_util_pct", "membw_util_pct", "gpu_mem_gib", "solo_rate", "colocated_rate"])
        numbers: dict[tuple[str, ...], int] = {}
        for group in result["groups"]:
            i = numbers.setdefault(tuple(group["jobs"]), len(numbers) + 1)
            rows = []
            for name, ev in zip(group["jobs"], group["windows"], strict=True):
                alone = result["alone"][name]
                solo = _solo_rate(alone)
                if not solo or ev.get("steps_per_s") is None:
                    break
                sm = alone["nvml"]["sm_util_pct"]
                bw = alone["nvml"]["membw_util_pct"]
                if sm is None or bw is None:
                    sm, bw = alone["estimator_profile"]["sm_util_pct"], alone["estimator_profile"]["membw_util_pct"]
                mem_gib = (alone.get("gpu_mem_bytes") or 0) / GIB
                rows.append([f"g{i:03d}r{group['repeat'] + 1}", name, f"{min(100.0, sm):.1f}", f"{min(100.0, bw):.1f}",
                             f"{mem_gib:.3f}", f"{solo:.4f}", f"{ev['steps_per_s']:.4f}"])
            if len(rows) == len(group["jobs"]):
                w.writerows(rows)
    return path
