"""Chaos on the live cluster: every fault at once, nothing lost, nothing run twice (issue 49).

On this checkout's local Slurm cluster with accounting (started if not running, and then
stopped at the end; one already running is reused and left running), the packing service
runs a workload of 62 stand-in jobs (slurm_dlrm/emulated/standin/: no torch, the real
agent, fences, packing and accounting): packed singles, gangs (world_size 2), `--no-pack`
jobs, an `--array`, a sweep (`--set`) and a job with `-d afterok:`, all submitted through
`slurm-dlrm submit` at seeded times. Meanwhile a seeded nemesis injects, at seeded random
times, each of: SIGKILL of the service (restarted a few seconds later, as a watchdog
would); SIGKILL of an agent; SIGKILL of a member; slurmctld SIGKILLed and started again;
a node lost and back (its slurmd and its jobs' processes SIGKILLed, the slurmd started
again); the store's file system (a tmpfs of its own, 64 MiB) full for 30 s; a torn line
(a partial JSON line) appended to a running pack's report file; a user `cancel` then
`requeue` of a running member of a pack in the middle of a refill (a joiner planned into
the pack, not started yet).
The same seed gives the same fault schedule and workload.

The invariants are checked over the whole history (benchmarks/chaos_checks.py): the
runners' own metrics lines (each line carries its process id: one run = one process),
the store's event rows, and a monitor sampling the store every 2 s during the run.

    python benchmarks/chaos_live.py [--seed 1] [--short] [--keep]

Full mode: submissions over 10 min, faults (each kind twice) over 14 min, about 17 min in
all; --short: submissions over 2.5 min, faults (each kind once) over 3.3 min, about 8 min. Needs root (tmpfs mount, the
local cluster). Last line:
`chaos: seed= faults= kinds= jobs= completed_pct= lost= duplicated= overlapping_attempts=
bad_resumes= integrity=`

Over 600 lines: the nine faults, the two login nodes' commands and the run's set-up and
clean-up read together; the invariants are apart, in chaos_checks.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

PY = sys.executable
STORE_FS_MIB = 64
FAULT_KINDS = ("kill_service", "takeover", "kill_agent", "kill_member", "restart_slurmctld", "node_lost", "store_full",
               "torn_report", "cancel_requeue")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- the workload

@dataclass
class Submission:
    name: str  # unique: the job name(s) in the store
    args: list[str]  # extra `submit` arguments
    expect_jobs: int
    steps: int
    world_size: int = 1
    after: str | None = None  # the name of the submission it depends on (afterok)
    at_s: float = 0.0
    ids: list[int] = field(default_factory=list)
    tries: int = 0


def spec_text(name: str, steps: int, step_s: float, every: int, world_size: int = 1) -> str:
    argv = [PY, "-m", "slurm_dlrm.emulated.standin", "--steps", str(steps), "--step-s", str(step_s),
            "--checkpoint-every", str(every)]
    spec = {"name": name, "tables": [{"name": "t0", "rows": 100, "dim": 8}], "dense_features": 4,
            "bottom_mlp": [8], "top_mlp": [8, 1], "batch_size": 16, "steps": steps, "world_size": world_size,
            "checkpoint_every_steps": every, "command": argv}
    return json.dumps(spec) + "\n"  # JSON is YAML


def make_workload(rng: random.Random, folder: Path, submit_window_s: float, short: bool) -> list[Submission]:
    folder.mkdir(parents=True, exist_ok=True)
    subs: list[Submission] = []

    def add(name: str, steps: int, args: list[str], expect: int = 1, world_size: int = 1,
            after: str | None = None) -> None:
        step_s = 0.1 if short else rng.choice((0.1, 0.2))
        (folder / f"{name}.yaml").write_text(spec_text(name, steps, step_s, every=10, world_size=world_size))
        subs.append(Submission(name, args, expect, steps, world_size, after))

    lo, hi = (300, 900) if short else (600, 1500)
    for i in range(36):
        add(f"single-{i:02d}", rng.randint(lo, hi), [])
    for i in range(6):
        add(f"gang-{i}", rng.randint(lo, hi), [], world_size=2)
    for i in range(4):
        add(f"nopack-{i}", rng.randint(lo, hi), ["--no-pack"])
    add("array", rng.randint(lo, hi), ["--array", "0-7"], expect=8)
    add("sweep", rng.randint(lo, hi), ["--set", "batch_size=16,32", "--set", "seed=1,2,3"], expect=6)
    add("dep-base", lo, [])
    add("dep-child", lo, [], after="dep-base")
    rng.shuffle(subs)
    for s in subs:
        s.at_s = rng.uniform(0, submit_window_s)
    # the child after its parent
    base = next(s for s in subs if s.name == "dep-base")
    child = next(s for s in subs if s.name == "dep-child")
    base.at_s, child.at_s = min(base.at_s, child.at_s), max(base.at_s, child.at_s) + 1.0
    return sorted(subs, key=lambda s: s.at_s)


# Where the user types commands: "login-a" (this host) but while login-a is down in a
# takeover (its service killed, login-b's not yet holding the store), on login-b.
command_host = ["login-a"]
commands_on_a = [0]  # login-a's commands still running (a takeover waits them out: login-a is down)
commands_lock = threading.Lock()


def user_command(argv: list[str], timeout_s: float, host: str | None = None) -> subprocess.CompletedProcess[str]:
    with commands_lock:
        on_a = (host or command_host[0]) == "login-a"
        commands_on_a[0] += on_a
    if not on_a:
        argv = ["unshare", "--uts", "--", "sh", "-c", 'hostname login-b && exec "$@"', "sh", *argv]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)  # noqa: S603
    finally:
        with commands_lock:
            commands_on_a[0] -= on_a


def submit_one(sub: Submission, folder: Path, by_name: dict[str, Submission], env: Env) -> bool:
    args = [PY, "-m", "slurm_dlrm", "submit", "--parsable", str(folder / f"{sub.name}.yaml"), *sub.args]
    if sub.after:
        parent = by_name[sub.after]
        parent_id = parent.ids[0] if parent.ids else ids_by_name(env, parent.name)
        if parent_id is None:
            return False
        args += ["-d", f"afterok:{parent_id}"]
    sub.tries += 1
    r = user_command(args, 180)
    if r.returncode != 0 and "runs on host login-b, which alone writes your store; run this there" in r.stderr:
        r = user_command(args, 180, host="login-b")  # --no-pack: the user goes to that host, as told
    if r.returncode != 0:
        log(f"submit {sub.name}: exit {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}")
        # On a login node whose service runs elsewhere, a submit not answered within 3 of
        # its rounds is still applied once, later (docs/service.md): not tried again.
        return "did not record request" in r.stderr
    sub.ids = [int(x) for x in r.stdout.split() if x.strip().isdigit()]
    return True


def ids_by_name(env: Env, name: str) -> int | None:
    try:
        jobs, _ = read_store(env)
    except Exception:  # noqa: BLE001 - the store being written, or full
        return None
    return next((j.id for j in jobs if j.name == name), None)


# ---------------------------------------------------------------- the nemesis

@dataclass
class Env:
    cluster: Any
    site: Any
    user: str
    paths: Any  # ServicePaths
    store_fs: Path
    spool_dir: Path
    rng: random.Random
    stop: threading.Event


def ours(pid: int, env: Env) -> bool:
    from slurm_dlrm.localcluster.processes import is_ours

    return is_ours(pid, env.cluster.config.state_dir)


def procs_matching(env: Env, needle: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmd and ours(int(d.name), env):
            out.append(int(d.name))
    return sorted(out)


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def read_store(env: Env) -> tuple[list[Any], list[Any]]:
    from slurm_dlrm.store.store import Store

    with Store.for_user(env.site, env.user, readonly=True) as store:
        return store.jobs(user=env.user), store.packs(user=env.user)


def fault_kill_service(env: Env) -> str:
    from slurm_dlrm.service.daemon import running_pid, spawn_service, wait_until_running

    pid = running_pid(env.paths)
    if pid is None:
        return "no service running"
    kill(pid)
    down_s = env.rng.uniform(2, 10)
    time.sleep(down_s)
    while command_host[0] != "login-a" and not env.stop.is_set():
        time.sleep(1)  # login-a's watchdog waits until login-a is back
    spawn_service(env.paths, ["--round-seconds", "1"])
    ok = wait_until_running(env.paths, timeout_s=60) is not None
    return f"service {pid} SIGKILLed, restarted after {down_s:.0f} s ({'running' if ok else 'NOT running'})"


def fault_takeover(env: Env) -> str:
    """A second login node: a service started on host login-b (a UTS namespace of its own,
    the same network, so the same Slurm) stands by on the lease; the active one is
    SIGKILLed; login-b's takes the store over when the lease runs out."""
    from slurm_dlrm.service.daemon import read_status, running_pid

    pid = running_pid(env.paths)
    if pid is None:
        return "no service running"
    argv = ["unshare", "--uts", "--", "sh", "-c", 'hostname login-b && exec "$@"', "sh",
            PY, "-m", "slurm_dlrm", "-v", "serve", "--log-file", str(env.paths.log), "--round-seconds", "1"]
    with open(env.paths.log, "ab", buffering=0) as out:
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,  # noqa: S603
                         start_new_session=True, cwd=str(env.paths.store_dir))
    time.sleep(env.rng.uniform(2, 6))
    with commands_lock:
        command_host[0] = "login-b"  # login-a goes down: no more commands (or service starts) there
    deadline = time.monotonic() + 120
    while commands_on_a[0] and time.monotonic() < deadline:
        time.sleep(0.2)
    pid = running_pid(env.paths) or pid
    kill(pid)
    t_kill = time.monotonic()
    try:
        while time.monotonic() - t_kill < 120 and not env.stop.is_set():
            status = read_status(env.paths) or {}
            if status.get("host") == "login-b" and running_pid(env.paths) not in (None, pid):
                return f"service {pid} SIGKILLed; login-b's took over after {time.monotonic() - t_kill:.0f} s"
            time.sleep(1)
    finally:
        command_host[0] = "login-a"
    return f"service {pid} SIGKILLed; login-b's did NOT take over within 120 s"


def fault_kill_agent(env: Env) -> str | None:
    pids = procs_matching(env, "slurm_dlrm agent")
    if not pids:
        return None
    pid = env.rng.choice(pids)
    kill(pid)
    return f"agent {pid} SIGKILLed (of {len(pids)})"


def fault_kill_member(env: Env) -> str | None:
    pids = procs_matching(env, "slurm_dlrm.emulated.standin")
    if not pids:
        return None
    pid = env.rng.choice(pids)
    kill(pid)
    return f"member {pid} SIGKILLed (of {len(pids)})"


def fault_restart_slurmctld(env: Env) -> str:
    ctld = next(d for d in env.cluster.daemons() if d.name == "slurmctld")
    if ctld.pid is not None:
        kill(ctld.pid)
    down_s = env.rng.uniform(3, 15)
    time.sleep(down_s)
    env.cluster.up(wait_s=120)
    return f"slurmctld {ctld.pid} SIGKILLed, started again after {down_s:.0f} s"


def fault_node_lost(env: Env) -> str:
    """A node crash: its slurmd and every process of a job step on it die at once."""
    node = env.rng.choice(env.cluster.config.node_names)
    slurmd = next(d for d in env.cluster.daemons() if d.name == f"slurmd-{node}")
    victims = {slurmd.pid} if slurmd.pid else set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            environ = (d / "environ").read_bytes()
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if f"SLURMD_NODENAME={node}\0".encode() in environ and ours(int(d.name), env):
            victims.add(int(d.name))
            with contextlib.suppress(OSError):
                if Path(f"/proc/{ppid}/comm").read_text().strip() == "slurmstepd":
                    victims.add(ppid)
    for pid in victims:
        if pid:
            kill(pid)
    down_s = env.rng.uniform(10, 40)
    time.sleep(down_s)
    env.cluster.up(wait_s=120)
    return f"{node}: slurmd and {len(victims) - 1} step process(es) SIGKILLed, slurmd back after {down_s:.0f} s"


def fault_store_full(env: Env) -> str:
    filler = env.store_fs / "filler"
    written = 0
    with open(filler, "wb") as f:
        block = b"\0" * (1 << 20)
        try:
            while True:
                f.write(block)
                f.flush()
                written += 1
        except OSError:
            pass
    for _ in range(30):
        if env.stop.is_set():
            break
        time.sleep(1)
    filler.unlink()
    return f"store file system full for 30 s ({written} MiB filler)"


def fault_torn_report(env: Env) -> str | None:
    _, packs = read_store(env)
    files = [f for p in packs if str(p.state) == "RUNNING" and p.pack_dir
             for f in sorted((Path(p.pack_dir) / "reports").glob("*.jsonl"))]
    if not files:
        return None
    path = env.rng.choice(files)
    with open(path, "ab") as f:
        f.write(b'{"kind": "sample", "pack_id": 1, "job_id": ')
    return f"torn line appended to {path.parent.parent.name}/reports/{path.name}"


def refills_in_flight(env: Env) -> list[tuple[int, list[int], int]]:
    """Each RUNNING pack being refilled: one of its members ended and a joiner is PLANNED
    into it (the service wrote its join file; its agent has not started it yet). As
    (pack id, its running members' ids, jobs pending)."""
    from slurm_dlrm.store.store import Store

    with Store.for_user(env.site, env.user, readonly=True) as store:
        jobs = store.jobs(user=env.user)
        running_packs = sorted(p.id for p in store.packs(user=env.user) if str(p.state) == "RUNNING")
        pending = sum(1 for j in jobs if str(j.state) == "PENDING")
        out = []
        for pack_id in running_packs:
            members = [j for j in jobs if j.pack_id == pack_id and j.mode == "pack"]
            live = sorted(j.id for j in members if str(j.state) == "RUNNING")
            if live and any(str(j.state) == "PLANNED" for j in members) \
                    and any(pl.end_time is not None for pl in store.placements(pack_id=pack_id)):
                out.append((pack_id, live, pending))
    return out


def fault_cancel_requeue(env: Env) -> str | None:
    """The user cancels a running member of a pack in the middle of a refill (a joiner
    planned into a slot that freed, not started yet), then requeues it: the pack loses a
    second member while its first refill is in flight. Waits for such a moment."""
    deadline = time.monotonic() + 240
    found: list[tuple[int, list[int], int]] = []
    while not env.stop.is_set() and time.monotonic() < deadline:
        try:
            found = refills_in_flight(env)
        except Exception:  # noqa: BLE001 - the store being written, or full
            found = []
        if found:
            break
        time.sleep(0.3)
    if not found:
        return None
    pack_id, live, pending = env.rng.choice(found)
    job_id = env.rng.choice(live)
    env_cancelled.add(job_id)
    c = user_command([PY, "-m", "slurm_dlrm", "cancel", str(job_id)], 120)
    time.sleep(env.rng.uniform(0, 3))
    r = user_command([PY, "-m", "slurm_dlrm", "requeue", str(job_id)], 300)
    if r.returncode == 0:
        env_requeued.add(job_id)
    return (f"job {job_id} of pack {pack_id} (a joiner planned into it) cancelled (exit {c.returncode}) and "
            f"requeued (exit {r.returncode}{': ' + r.stderr.strip()[-200:] if r.returncode else ''}) with "
            f"{pending} pending")


env_cancelled: set[int] = set()  # jobs the user cancelled
env_requeued: set[int] = set()  # ... and requeued after

FAULTS = {"kill_service": fault_kill_service, "takeover": fault_takeover, "kill_agent": fault_kill_agent, "kill_member": fault_kill_member,
          "restart_slurmctld": fault_restart_slurmctld, "node_lost": fault_node_lost,
          "store_full": fault_store_full, "torn_report": fault_torn_report, "cancel_requeue": fault_cancel_requeue}


def fault_schedule(rng: random.Random, window_s: float, rounds: int, submit_window_s: float) -> list[tuple[float, str]]:
    """Each kind `rounds` times at uniform random times in [0.05, 1] x window_s; a
    cancel+requeue scaled into the submissions' window (refills happen while jobs still
    arrive; seed 3 drew one after the queue had emptied). The same draws either way."""
    sched = [(rng.uniform(0.05 * window_s, window_s), kind) for kind in FAULT_KINDS for _ in range(rounds)]
    scale = 0.9 * submit_window_s / window_s
    return sorted((t * scale if kind == "cancel_requeue" else t, kind) for t, kind in sched)


def nemesis(env: Env, schedule: list[tuple[float, str]], t0: float, done: list[dict[str, Any]]) -> None:
    """Each fault at its time in a thread of its own: faults overlap (the store full while
    a takeover waits for the lease, slurmctld restarted while a node is down)."""
    threads = []
    for at_s, kind in schedule:
        while time.monotonic() - t0 < at_s:
            if env.stop.wait(0.5):
                return
        th = threading.Thread(target=inject, args=(env, kind, t0, done), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()


def inject(env: Env, kind: str, t0: float, done: list[dict[str, Any]]) -> None:
    # a fault that needs something (a running agent, member, pack) waits for it, up to 60 s
    deadline = time.monotonic() + 60
    t = time.monotonic() - t0
    while True:
        try:
            what = FAULTS[kind](env)
        except Exception as exc:  # noqa: BLE001 - a fault that fails is reported, not fatal
            what = f"fault failed: {type(exc).__name__}: {exc}"
        if what is not None or time.monotonic() > deadline or env.stop.is_set():
            break
        time.sleep(2)
        t = time.monotonic() - t0
    done.append({"t_s": round(t, 1), "kind": kind, "what": what or "nothing to hit (skipped)",
                 "hit": what is not None and "NOT" not in what and not what.startswith("fault failed")})
    log(f"nemesis {kind} at {t:.0f} s: {what or 'nothing to hit (skipped)'}")


# ---------------------------------------------------------------- set-up

def site_text(workdir: Path, store_fs: Path) -> str:
    from slurm_dlrm.site import REPO_SITE_FILE

    text = REPO_SITE_FILE.read_text()
    subs = {"store_dir": f'"{store_fs}/store-{{user}}"', "spool_dir": f'"{workdir}/spool-{{user}}"',
            # quick to notice a dead agent or a lost pack, and to stop members
            "sample_interval_s": "0.5", "heartbeat_timeout_s": "30.0", "term_grace_s": "10.0",
            # a service a `submit` starts (after a kill) runs rounds as often as ours
            "round_seconds": "1.0"}
    for key, value in subs.items():
        text, n = re.subn(rf"^{key} = \S+", f"{key} = {value}", text, count=1, flags=re.M)
        assert n == 1, key
    return text


def ensure_cluster() -> tuple[Any, bool]:
    from slurm_dlrm.localcluster import LocalCluster, config_from_site, default_state_dir
    from slurm_dlrm.site import REPO_SITE_FILE, load_site

    state_dir = default_state_dir()
    existing = LocalCluster.at(state_dir)
    if existing is not None and existing.status(query_nodes=False).up and existing.config.accounting:
        return existing, False
    if existing is not None:
        existing.down()
    cluster = LocalCluster(config_from_site(load_site(REPO_SITE_FILE), state_dir=state_dir, accounting=True))
    cluster.up(wait_s=180)
    return cluster, True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--short", action="store_true", help="a few minutes instead of >= 15")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (its path is printed)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("chaos_live: needs root (the local cluster, a tmpfs for the store)", file=sys.stderr)
        return 2
    from chaos_checks import Monitor, check_history

    from slurm_dlrm.service.daemon import spawn_service, wait_until_running
    from slurm_dlrm.service.submit import service_paths
    from slurm_dlrm.site import load_site
    from slurm_dlrm.store.store import current_user

    rng = random.Random(args.seed)
    submit_window_s, fault_window_s, rounds = (150.0, 200.0, 1) if args.short else (600.0, 840.0, 2)
    t_start = time.monotonic()
    cluster, started_here = ensure_cluster()
    log(f"cluster {'started' if started_here else 'reused'}: {cluster.config.slurm_conf}")
    workdir = Path(tempfile.mkdtemp(prefix="chaos-live-", dir="/tmp"))
    store_fs = workdir / "store-fs"
    store_fs.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={STORE_FS_MIB}m,mode=0700", "tmpfs", str(store_fs)],  # noqa: S603, S607
                   check=True)
    stop_evt = threading.Event()
    paths = None
    try:
        (workdir / "site.toml").write_text(site_text(workdir, store_fs))
        os.environ["SLURM_DLRM_SITE"] = str(workdir / "site.toml")
        os.environ["SLURM_CONF"] = str(cluster.config.slurm_conf)
        os.environ["PYTHONPATH"] = str(REPO)
        site = load_site(workdir / "site.toml")
        user = current_user()
        paths = service_paths(site, user)
        spawn_service(paths, ["--round-seconds", "1"])
        if wait_until_running(paths, timeout_s=60) is None:
            raise RuntimeError(f"the packing service did not start; see {paths.log}")
        subs = make_workload(rng, workdir / "specs", submit_window_s, args.short)
        schedule = fault_schedule(rng, fault_window_s, rounds, submit_window_s)
        log(f"seed {args.seed}: {sum(s.expect_jobs for s in subs)} jobs in {len(subs)} submissions over "
            f"{submit_window_s:.0f} s; {len(schedule)} faults over {fault_window_s:.0f} s: "
            + ", ".join(f"{k}@{t:.0f}" for t, k in schedule))
        env = Env(cluster, site, user, paths, store_fs, site.spool_dir_for(user), random.Random(args.seed + 1000),
                  stop_evt)
        monitor = Monitor(site, user, stop_evt)
        faults: list[dict[str, Any]] = []
        t0 = time.monotonic()
        threads = [threading.Thread(target=nemesis, args=(env, schedule, t0, faults), daemon=True),
                   threading.Thread(target=monitor.run, daemon=True)]
        for th in threads:
            th.start()
        by_name = {s.name: s for s in subs}
        queue = list(subs)
        while queue:  # submissions at their times; a refused one is tried again (as a user would)
            s = queue[0]
            while time.monotonic() - t0 < s.at_s:
                time.sleep(0.2)
            if submit_one(s, workdir / "specs", by_name, env):
                queue.pop(0)
            else:
                s.at_s = time.monotonic() - t0 + 5
                queue.sort(key=lambda x: x.at_s)
        log(f"all {len(subs)} submissions in after {time.monotonic() - t0:.0f} s "
            f"({sum(s.tries for s in subs) - len(subs)} retried)")
        threads[0].join()  # the nemesis ends after its last fault
        deadline = time.monotonic() + (900 if not args.short else 600)
        while time.monotonic() < deadline:
            jobs, packs = read_store(env)
            open_jobs = [j for j in jobs if str(j.state) in ("PENDING", "PLANNED", "RUNNING")]
            if not open_jobs and not [p for p in packs if str(p.state) in ("SUBMITTING", "QUEUED", "RUNNING")]:
                break
            time.sleep(3)
        stop_evt.set()
        threads[1].join(timeout=30)
        stop_services(paths)
        paths = None
        result = check_history(site, user, cluster, subs, env_cancelled, env_requeued, monitor)
        wall_s = time.monotonic() - t_start
        print()
        print(f"{'t_s':>6}  {'fault':<18} what")
        for f in sorted(faults, key=lambda f: f["t_s"]):
            print(f"{f['t_s']:>6}  {f['kind']:<18} {f['what']}")
        print()
        for line in result["report"]:
            print(line)
        hit = [f for f in faults if f["hit"]]
        kinds = len({f["kind"] for f in hit})
        print(f"wall {wall_s:.0f} s; work folder {workdir}{'' if args.keep else ' (removed)'}")
        print(f"chaos: seed={args.seed} faults={len(hit)} kinds={kinds} jobs={result['jobs']} "
              f"completed_pct={result['completed_pct']:g} lost={result['lost']} duplicated={result['duplicated']} "
              f"overlapping_attempts={result['overlapping_attempts']} bad_resumes={result['bad_resumes']} "
              f"integrity={result['integrity']}")
        ok = result["ok"] and kinds == len(FAULT_KINDS)
        return 0 if ok else 1
    finally:
        stop_evt.set()
        if paths is not None:
            stop_services(paths)
        cleanup(cluster, started_here, workdir, store_fs, args.keep)


def stop_services(paths: Any, timeout_s: float = 60.0) -> None:
    """SIGTERM this run's services, on either "host" (login-b's too; `stop` refuses a
    service on another host), standbys included, and wait until they are gone."""
    log_arg = str(paths.log)
    pids = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()
            and log_arg in _cmdline(d) and " serve " in _cmdline(d) and not _cmdline(d).startswith("unshare")]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in pids):
        if time.monotonic() > deadline:
            for pid in pids:
                kill(pid)
            break
        time.sleep(0.2)


def _cmdline(d: Path) -> str:
    try:
        return (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def cleanup(cluster: Any, started_here: bool, workdir: Path, store_fs: Path, keep: bool) -> None:
    """What the run started does not outlive it: the cluster if it started it (else this
    run's Slurm jobs), the service, the tmpfs."""
    if started_here:
        cluster.down()
    else:  # someone else's cluster: only this run's Slurm jobs go
        with contextlib.suppress(Exception):
            from slurm_dlrm.site import load_site
            from slurm_dlrm.store.store import Store, current_user

            site = load_site(workdir / "site.toml")
            with Store.for_user(site, current_user(), readonly=True) as store:
                ids = {int(p.slurm_job_id) for p in store.packs() if p.slurm_job_id}
                ids |= {int(j.slurm_job_id) for j in store.jobs() if j.slurm_job_id and j.mode != "pack"}
            live = [j.job_id for j in cluster.client().squeue() if j.job_id in ids and not j.state.is_terminal]
            if live:
                cluster.client().scancel(live)
    if keep:
        # the store leaves the tmpfs for the work folder
        subprocess.run(["cp", "-a", str(store_fs), str(workdir / "store-copy")], check=False)  # noqa: S603, S607
    subprocess.run(["umount", str(store_fs)], check=False)  # noqa: S603, S607
    if not keep:
        subprocess.run(["rm", "-rf", str(workdir)], check=False)  # noqa: S603, S607


if __name__ == "__main__":
    sys.exit(main())
