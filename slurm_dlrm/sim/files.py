"""Workload and cluster descriptions for the simulator: parse and validate plain data.

Pure: the CLI reads the YAML/JSON file and hands the parsed dict here. Every error is
a `BadInput` naming the dotted key, e.g. ``cluster.nodes[0].gpus: must be >= 1``.
The formats are documented in docs/simulate.md; examples live in benchmarks/sim/.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from slurm_dlrm.errors import BadInput
from slurm_dlrm.packing.dispatch import DispatchConfig
from slurm_dlrm.packing.model import LABELS, FairConfig, PackingLimits
from slurm_dlrm.site import GIB, MIB, GpuModel

# ---------------------------------------------------------------- data


@dataclass(frozen=True)
class SimJob:
    """One job of a workload: what the estimator says and what really happens."""

    job_id: int
    name: str
    arrival_s: float
    solo_duration_s: float  # true run time alone on a GPU
    gpu_mem_bytes: int  # estimate, without the CUDA context
    host_mem_bytes: int
    sm_util_pct: float
    membw_util_pct: float
    host_cpu_cores: float
    label: str
    true_gpu_mem_bytes: int  # what it really peaks at (OOM if above its fence)
    true_sm_util_pct: float
    true_membw_util_pct: float
    est_duration_s: float | None = None  # what the policy is told
    peak_at_frac: float = 0.0  # share of the run before the memory peak is reached
    priority: float = 0.0
    user: str = "sim"
    # A multi-GPU job (issue 18): `world_size` ranks, rank r's GPU memory, SM and
    # bandwidth demand (estimated and true) the job's figures x `rank_scales[r]` (the
    # job's figures are its fullest rank's, as the estimator reports); host memory and
    # CPUs per rank as the job's. Empty scales: every rank as the job.
    world_size: int = 1
    rank_scales: tuple[float, ...] = ()
    # When its wait began, if before `arrival_s` (None: its arrival): a job carried into a
    # forward run from a snapshot (sim/start_estimate.py) keeps its wait so far.
    submitted_s: float | None = None
    # A variant of a sweep with a stopping rule (JobDemand.may_pause; sim/sweep.py).
    may_pause: bool = False
    # What it really peaks at in host memory (None: its estimate, `host_mem_bytes`); past
    # its share of the pack's --mem the agent stops it (or the kernel kills it): OOM_HOST.
    true_host_mem_bytes: int | None = None
    # A whole-node multi-node job (issue 48, sim/multinode.py): `world_size` ranks over
    # `nodes` whole nodes, not packed; 1: an ordinary job.
    nodes: int = 1

    @property
    def scales(self) -> tuple[float, ...]:
        """Each rank's share of the job's per-rank figures (one 1.0 for a one-rank job)."""
        if self.rank_scales:
            return self.rank_scales
        return (1.0,) * max(1, self.world_size)


@dataclass(frozen=True)
class Workload:
    name: str
    jobs: tuple[SimJob, ...]


@dataclass(frozen=True)
class SimNode:
    name: str
    gpu_model: str
    gpus: int
    cpus: int
    memory_bytes: int


@dataclass(frozen=True)
class SlurmTiming:
    submit_to_start_s: float = 2.0  # sbatch -> running: scheduler pass on submit + prolog
    member_startup_s: float = 20.0  # python + torch import + CUDA context, per member start
    pack_release_s: float = 0.0  # last member ended -> GPUs free: agent join grace + exit + epilog
    join_start_s: float = 0.0  # a joiner planned -> its process started (the agent's look at its joins)


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 3  # OOM-killed job resubmitted at most this many times
    mem_bump_pct: float = 25.0  # a retried job's GPU estimate grows by this (DLRover-RM)
    checkpoint_every_frac: float = 0.1  # progress since the last checkpoint is lost
    # Past max_retries a job has failed; its user resubmits it (from its last checkpoint,
    # this long after the failure) up to this many times. 0: a failed job stays failed.
    user_resubmits: int = 0
    user_resubmit_delay_s: float = 0.0


@dataclass(frozen=True)
class SimCluster:
    name: str
    gpu_models: tuple[GpuModel, ...]
    nodes: tuple[SimNode, ...]
    limits: PackingLimits = field(default_factory=PackingLimits)
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    slurm: SlurmTiming = field(default_factory=SlurmTiming)
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    @property
    def gpu_count(self) -> int:
        return sum(n.gpus for n in self.nodes)

    def gpu_model(self, name: str) -> GpuModel:
        for g in self.gpu_models:
            if g.name == name:
                return g
        raise KeyError(name)


# ---------------------------------------------------------------- validation helpers


class _Table:
    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, Mapping):
            raise BadInput(f"{where}: must be a mapping, got {type(data).__name__}")
        self.data = data
        self.where = where
        self.seen: set[str] = set()

    def key(self, k: str) -> str:
        return f"{self.where}.{k}"

    def num(self, k: str, default: float | None = None, *, lo: float | None = None, hi: float | None = None) -> float:
        self.seen.add(k)
        if k not in self.data:
            if default is None:
                raise BadInput(f"{self.key(k)}: missing")
            return default
        v = self.data[k]
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise BadInput(f"{self.key(k)}: must be a number, got {v!r}")
        if lo is not None and v < lo:
            raise BadInput(f"{self.key(k)}: must be >= {lo:g}, got {v!r}")
        if hi is not None and v > hi:
            raise BadInput(f"{self.key(k)}: must be <= {hi:g}, got {v!r}")
        return float(v)

    def headroom(self, k: str) -> float | None:
        """A percentage 0..1000, or "share" (None: the pack's GPUs' whole share)."""
        raw = self.data.get(k)
        if isinstance(raw, str):
            if raw != "share":
                raise BadInput(f'{self.key(k)}: must be a percentage (0..1000) or "share", got {raw!r}')
            self.seen.add(k)
            return None
        return self.num(k, 100.0, lo=0, hi=1000)

    def int_(self, k: str, default: int | None = None, *, lo: int | None = None, hi: int | None = None) -> int:
        v = self.num(k, None if default is None else float(default), lo=lo, hi=hi)
        if v != int(v):
            raise BadInput(f"{self.key(k)}: must be an integer, got {v!r}")
        return int(v)

    def str_(self, k: str, default: str | None = None, choices: tuple[str, ...] | None = None) -> str:
        self.seen.add(k)
        if k not in self.data:
            if default is None:
                raise BadInput(f"{self.key(k)}: missing")
            return default
        v = self.data[k]
        if not isinstance(v, str) or not v:
            raise BadInput(f"{self.key(k)}: must be a non-empty string, got {v!r}")
        if choices is not None and v not in choices:
            raise BadInput(f"{self.key(k)}: must be one of {', '.join(choices)}; got {v!r}")
        return v

    def range_(self, k: str, default: tuple[float, float] | None = None, *, lo: float = 0.0,
               hi: float | None = None) -> tuple[float, float]:
        """A fixed number or a [low, high] pair (drawn uniformly)."""
        self.seen.add(k)
        if k not in self.data:
            if default is None:
                raise BadInput(f"{self.key(k)}: missing")
            return default
        v = self.data[k]
        pair = list(v) if isinstance(v, list | tuple) else [v, v]
        if (len(pair) != 2 or any(isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) for x in pair)
                or pair[0] > pair[1] or pair[0] < lo or (hi is not None and pair[1] > hi)):
            bound = f" within [{lo:g}, {hi:g}]" if hi is not None else f" >= {lo:g}"
            raise BadInput(f"{self.key(k)}: must be a number or [low, high] with low <= high{bound}, got {v!r}")
        return float(pair[0]), float(pair[1])

    def sub(self, k: str) -> _Table:
        self.seen.add(k)
        return _Table(self.data.get(k, {}), self.key(k))

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            raise BadInput(f"{self.key(unknown[0])}: unknown key")


# ---------------------------------------------------------------- cluster


def parse_cluster(data: Any, default_gpu_models: Mapping[str, GpuModel] | None = None) -> SimCluster:
    """A `SimCluster` from a cluster file's parsed content.

    `gpu_models` may be omitted when `default_gpu_models` (the site config's) has the
    models the nodes name.
    """
    top = _Table(data, "cluster")
    name = top.str_("name", "cluster")
    models: dict[str, GpuModel] = dict(default_gpu_models or {})
    gm = top.sub("gpu_models")
    for mname in sorted(gm.data):
        t = gm.sub(mname)
        models[mname] = GpuModel(
            name=mname, memory_gib=t.num("memory_gib", lo=1), sm_count=t.int_("sm_count", 100, lo=1),
            mem_bandwidth_gbps=t.num("mem_bandwidth_gbps", 1000.0, lo=1), fp32_tflops=t.num("fp32_tflops", 20.0, lo=0.1),
            tf32_tflops=t.num("tf32_tflops", 150.0, lo=0.1), cuda_context_mib=t.num("cuda_context_mib", 500.0, lo=0),
            cublas_workspace_mib=t.num("cublas_workspace_mib", 32.0, lo=0))
        t.done()
    gm.done()
    top.seen.add("nodes")
    raw_nodes = data.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise BadInput("cluster.nodes: at least one node is required")
    nodes: list[SimNode] = []
    for i, raw in enumerate(raw_nodes):
        t = _Table(raw, f"cluster.nodes[{i}]")
        model = t.str_("gpu_model")
        if model not in models:
            raise BadInput(f"cluster.nodes[{i}].gpu_model: unknown GPU model {model!r} (known: {', '.join(sorted(models)) or 'none'})")
        count = t.int_("count", 1, lo=1, hi=100000)
        base = t.str_("name", f"node{i}")
        gpus = t.int_("gpus", lo=1, hi=64)
        cpus = t.int_("cpus", lo=1)
        mem = int(t.num("memory_gib", lo=1) * GIB)
        t.done()
        for k in range(count):
            nodes.append(SimNode(base if count == 1 else f"{base}-{k}", model, gpus, cpus, mem))
    if len({n.name for n in nodes}) != len(nodes):
        raise BadInput("cluster.nodes: node names must be unique")
    p = top.sub("packing")
    limits = PackingLimits(
        max_members_per_gpu=p.int_("max_members_per_gpu", 8, lo=1, hi=48),
        mps_client_limit=p.int_("mps_client_limit", 48, lo=1, hi=48),
        memory_margin_pct=p.num("memory_margin_pct", 5.0, lo=0, hi=100),
        max_gpus_per_pack=p.int_("max_gpus_per_pack", 4, lo=1, hi=64),
        shards_per_gpu=p.int_("shards_per_gpu", 8, lo=1, hi=48),
        target_load=p.num("target_load", 1.0, lo=0.1, hi=4.0),
        min_gain=p.num("min_gain", 0.05, lo=0.0, hi=1.0),
        refill_headroom_pct=p.headroom("refill_headroom_pct"),
        exact_budget_s=p.num("exact_budget_s", 0.2, lo=0.001, hi=60.0),
        exact_max_pairs=p.int_("exact_max_pairs", 600, lo=1),
        exact_window=p.int_("exact_window", 8, lo=0))
    dispatch = DispatchConfig(
        round_seconds=p.num("round_seconds", 10.0, lo=0.1), round_batch_size=p.int_("round_batch_size", 16, lo=1),
        max_wait_rounds=p.int_("max_wait_rounds", 30, lo=1),
        fairness=p.str_("fairness", "slowdown", choices=("rounds", "slowdown")),
        fair_config=FairConfig(overdue_slowdown=p.num("overdue_slowdown", FairConfig().overdue_slowdown, lo=1.0),
                               gang_reserve_slowdown=p.num("gang_reserve_slowdown", 2.0, lo=1.0),
                               min_wait_s=p.num("overdue_min_wait_s", 600.0, lo=0.0)))
    p.done()
    s = top.sub("slurm")
    slurm = SlurmTiming(submit_to_start_s=s.num("submit_to_start_s", 2.0, lo=0),
                        member_startup_s=s.num("member_startup_s", 20.0, lo=0),
                        pack_release_s=s.num("pack_release_s", 0.0, lo=0),
                        join_start_s=s.num("join_start_s", 0.0, lo=0))
    s.done()
    r = top.sub("retry")
    retry = RetryPolicy(max_retries=r.int_("max_retries", 3, lo=0, hi=100), mem_bump_pct=r.num("mem_bump_pct", 25.0, lo=0),
                        checkpoint_every_frac=r.num("checkpoint_every_frac", 0.1, lo=0.001, hi=1.0),
                        user_resubmits=r.int_("user_resubmits", 0, lo=0, hi=1000),
                        user_resubmit_delay_s=r.num("user_resubmit_delay_s", 0.0, lo=0))
    r.done()
    top.done()
    used = {n.gpu_model for n in nodes}
    return SimCluster(name, tuple(models[m] for m in sorted(used)), tuple(nodes), limits, dispatch, slurm, retry)


# ---------------------------------------------------------------- workload

ProfileFn = Callable[[Mapping[str, Any], str], dict[str, Any]]


def _profile_from_spec(spec_data: Mapping[str, Any], gpu: GpuModel, where: str) -> dict[str, Any]:
    """Estimate a spec's profile with `slurm_dlrm.estimate` (imported when needed)."""
    try:
        from slurm_dlrm.estimate import estimate  # type: ignore[attr-defined]
        from slurm_dlrm.spec import parse_spec
    except ImportError as exc:
        raise BadInput(f"{where}: spec-based jobs need slurm_dlrm.estimate ({exc})") from None
    from slurm_dlrm.packing.model import demand_from_estimate

    spec = parse_spec(dict(spec_data), where)
    est = estimate(spec, gpu)
    d = demand_from_estimate(est, job_id=0, user="sim", submit_time_s=0.0)
    return {"sm_util_pct": d.sm_util_pct, "membw_util_pct": d.membw_util_pct, "gpu_mem_bytes": d.gpu_mem_bytes,
            "host_mem_bytes": d.host_mem_bytes, "host_cpu_cores": d.host_cpu_cores, "label": d.label,
            "solo_samples_per_s": d.solo_samples_per_s,
            "samples": float(getattr(spec, "steps", 0) or 0) * float(getattr(spec, "batch_size", 0) or 0)}


def _explicit_job(i: int, raw: Any, gpu_models: Mapping[str, GpuModel]) -> SimJob:
    t = _Table(raw, f"workload.jobs[{i}]")
    name = t.str_("name", f"job{i}")
    arrival = t.num("arrival_s", 0.0, lo=0)
    prof = t.sub("profile")
    solo_key_given = "solo_duration_s" in t.data
    if "spec" in t.data:
        t.seen.add("spec")
        model = t.str_("gpu_model", sorted(gpu_models)[0] if gpu_models else "h100")
        if model not in gpu_models:
            raise BadInput(f"workload.jobs[{i}].gpu_model: unknown GPU model {model!r}")
        if not isinstance(t.data["spec"], Mapping):
            raise BadInput(f"workload.jobs[{i}].spec: must be a mapping (a job spec)")
        est = _profile_from_spec(t.data["spec"], gpu_models[model], f"workload.jobs[{i}].spec")
        sm, bw, mem, host, cpus, label = (est["sm_util_pct"], est["membw_util_pct"], est["gpu_mem_bytes"],
                                          est["host_mem_bytes"], est["host_cpu_cores"], est["label"])
        default_solo = est["samples"] / est["solo_samples_per_s"] if est["solo_samples_per_s"] > 0 and est["samples"] > 0 else None
    else:
        sm = prof.num("sm_util_pct", lo=0, hi=100)
        bw = prof.num("membw_util_pct", lo=0, hi=100)
        mem = int(prof.num("gpu_mem_gib", lo=0) * GIB)
        host = int(prof.num("host_mem_gib", 1.0, lo=0) * GIB)
        cpus = prof.num("host_cpu_cores", 1.0, lo=0.1)
        label = prof.str_("label", _label(sm, bw, cpus), LABELS)
        default_solo = None
    prof.done()
    if not solo_key_given and default_solo is None:
        raise BadInput(f"workload.jobs[{i}].solo_duration_s: missing")
    solo = t.num("solo_duration_s", default_solo, lo=1)
    tr = t.sub("true")
    true_mem = int(tr.num("gpu_mem_gib", mem / GIB, lo=0) * GIB)
    true_sm = tr.num("sm_util_pct", sm, lo=0, hi=100)
    true_bw = tr.num("membw_util_pct", bw, lo=0, hi=100)
    tr.done()
    est_dur = t.num("est_duration_s", solo, lo=0)
    peak = t.num("peak_at_frac", 0.0, lo=0, hi=1)
    prio = t.num("priority", 0.0)
    world = t.int_("world_size", 1, lo=1, hi=64)
    scales = _rank_scales(t, world)
    nodes = t.int_("nodes", 1, lo=1, hi=64)  # > 1: whole nodes, not packed (issue 48)
    if world % nodes:
        raise BadInput(f"workload.jobs[{i}].nodes: {nodes} does not divide world_size {world}")
    t.done()
    return SimJob(i, name, arrival, solo, mem, host, sm, bw, cpus, label, true_mem, true_sm, true_bw, est_dur, peak, prio,
                  world_size=world, rank_scales=scales, nodes=nodes)


def _rank_scales(t: _Table, world: int) -> tuple[float, ...]:
    t.seen.add("rank_scales")
    raw = t.data.get("rank_scales")
    if raw is None:
        return ()
    if (not isinstance(raw, list) or len(raw) != world
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x <= 1 for x in raw)):
        raise BadInput(f"{t.key('rank_scales')}: must be a list of {world} numbers in (0, 1] (one per rank)")
    return tuple(float(x) for x in raw)


def _label(sm: float, bw: float, cpus: float) -> str:
    if max(sm, bw) < 12.0 and cpus >= 4:
        return "host-bound"
    return "memory-bound" if bw > sm else "compute-bound"


def _duration(rng: random.Random, t: _Table) -> float:
    dist = t.str_("dist", "lognormal", ("lognormal", "pareto", "fixed"))
    lo = t.num("min_s", 60.0, lo=1)
    hi = t.num("max_s", 86400.0, lo=1)
    if dist == "lognormal":
        v = t.num("median_s", 1800.0, lo=1) * math.exp(rng.gauss(0.0, t.num("sigma", 1.0, lo=0)))
    elif dist == "pareto":
        v = t.num("scale_s", 900.0, lo=1) * rng.paretovariate(t.num("alpha", 1.5, lo=0.1))
    else:
        v = t.num("value_s", 1800.0, lo=1)
    return min(max(v, lo), hi)


def generate_jobs(gen: Mapping[str, Any], gpu_models: Mapping[str, GpuModel], seed: int,
                  first_id: int = 0) -> list[SimJob]:
    """Jobs from a `generate:` section: classes drawn by weight, Poisson arrivals,
    heavy-tailed durations, and noisy "true" memory and utilisation."""
    t = _Table(gen, "workload.generate")
    rng = random.Random(seed)
    n = t.int_("jobs", lo=1, hi=1_000_000)
    rate = t.num("arrival_rate_per_h", 0.0, lo=0)
    start = t.num("start_s", 0.0, lo=0)
    mem_noise = t.num("mem_noise_pct", 0.0, lo=0, hi=100) / 100.0
    util_noise = t.num("util_noise_pct", 0.0, lo=0, hi=100) / 100.0
    dur_noise = t.num("duration_estimate_noise_pct", 0.0, lo=0, hi=100) / 100.0
    peak = t.range_("peak_at_frac", (0.0, 0.0), hi=1.0)
    # Multi-GPU jobs (issue 18): this share of the jobs gets a world_size drawn from
    # `multi_gpu_ranks`, its rank 0 the fullest, the others lighter by a uniform draw
    # from `multi_gpu_rank_scale` (table-wise sharding is uneven). Drawn from their own
    # random stream, so a workload without them is unchanged.
    multi_share = t.num("multi_gpu_share", 0.0, lo=0, hi=1)
    t.seen.add("multi_gpu_ranks")
    multi_ranks = gen.get("multi_gpu_ranks", [2, 4])
    if (not isinstance(multi_ranks, list) or not multi_ranks
            or not all(isinstance(x, int) and not isinstance(x, bool) and 2 <= x <= 64 for x in multi_ranks)):
        raise BadInput("workload.generate.multi_gpu_ranks: must be a list of integers 2..64")
    rank_scale = t.range_("multi_gpu_rank_scale", (0.5, 1.0), hi=1.0)
    multi_rng = random.Random(seed * 7919 + 18)
    dur_t = t.sub("duration")
    t.seen.add("classes")
    raw_classes = gen.get("classes")
    if not isinstance(raw_classes, list) or not raw_classes:
        raise BadInput("workload.generate.classes: at least one class is required")
    classes: list[tuple[float, str, Any]] = []  # (weight, name, sampler)
    spec_cache: dict[int, dict[str, Any]] = {}
    for ci, raw in enumerate(raw_classes):
        c = _Table(raw, f"workload.generate.classes[{ci}]")
        weight = c.num("weight", 1.0, lo=0)
        cname = c.str_("name", f"class{ci}")
        if "spec" in c.data or "preset" in c.data:
            c.seen.update({"spec", "preset"})
            spec = dict(c.data.get("spec") or {})
            if "preset" in c.data:
                spec.setdefault("preset", c.data["preset"])
            spec.setdefault("name", cname)
            model = c.str_("gpu_model", sorted(gpu_models)[0] if gpu_models else "h100")
            if model not in gpu_models:
                raise BadInput(f"workload.generate.classes[{ci}].gpu_model: unknown GPU model {model!r}")
            spec_cache[ci] = _profile_from_spec(spec, gpu_models[model], f"workload.generate.classes[{ci}]")
            classes.append((weight, cname, ("spec", ci)))
        else:
            p = c.sub("profile")
            sampler = {"sm": p.range_("sm_util_pct", hi=100), "bw": p.range_("membw_util_pct", hi=100),
                       "mem": p.range_("gpu_mem_gib"), "host": p.range_("host_mem_gib", (1.0, 1.0)),
                       "cpus": p.range_("host_cpu_cores", (1.0, 1.0), lo=0.1),
                       "label": p.str_("label", "", LABELS) if "label" in p.data else ""}
            p.done()
            classes.append((weight, cname, ("profile", sampler)))
        c.done()
    t.done()
    total_w = sum(w for w, _, _ in classes)
    if total_w <= 0:
        raise BadInput("workload.generate.classes: weights must not all be 0")
    jobs: list[SimJob] = []
    now = start
    for k in range(n):
        if rate > 0 and k > 0:
            now += rng.expovariate(rate / 3600.0)
        pick = rng.random() * total_w
        chosen = classes[-1]
        for cls in classes:
            pick -= cls[0]
            if pick < 0:
                chosen = cls
                break
        _w, cname, (kind, payload) = chosen
        duration = _duration(rng, dur_t)
        if kind == "spec":
            est = spec_cache[payload]
            sm, bw, mem, host, cpus, label = (est["sm_util_pct"], est["membw_util_pct"], est["gpu_mem_bytes"],
                                              est["host_mem_bytes"], est["host_cpu_cores"], est["label"])
        else:
            sm = rng.uniform(*payload["sm"])
            bw = rng.uniform(*payload["bw"])
            mem = int(rng.uniform(*payload["mem"]) * GIB)
            host = int(rng.uniform(*payload["host"]) * GIB)
            cpus = round(rng.uniform(*payload["cpus"]), 1)
            label = payload["label"] or _label(sm, bw, cpus)
        true_mem = int(mem * (1.0 + rng.uniform(-mem_noise, mem_noise)))
        true_sm = min(100.0, sm * (1.0 + rng.uniform(-util_noise, util_noise)))
        true_bw = min(100.0, bw * (1.0 + rng.uniform(-util_noise, util_noise)))
        est_dur = duration * (1.0 + rng.uniform(-dur_noise, dur_noise))
        world = 1
        scales: tuple[float, ...] = ()
        if multi_share > 0 and multi_rng.random() < multi_share:
            world = multi_rng.choice(multi_ranks)
            scales = (1.0, *sorted((round(multi_rng.uniform(*rank_scale), 3) for _ in range(world - 1)), reverse=True))
        jobs.append(SimJob(first_id + k, f"{cname}-{first_id + k}", round(now, 3), round(duration, 3), mem, host,
                           round(sm, 3), round(bw, 3), cpus, label, true_mem, round(true_sm, 3), round(true_bw, 3),
                           round(est_dur, 3), round(rng.uniform(*peak), 4), world_size=world, rank_scales=scales))
    dur_t.done()
    return jobs


def parse_workload(data: Any, gpu_models: Mapping[str, GpuModel], seed: int | None = None) -> Workload:
    """A `Workload` from a workload file's parsed content (explicit `jobs:` and/or a
    `generate:` section; `seed` overrides the file's)."""
    top = _Table(data, "workload")
    name = top.str_("name", "workload")
    file_seed = top.int_("seed", 0)
    jobs: list[SimJob] = []
    top.seen.add("jobs")
    raw_jobs = data.get("jobs", [])
    if not isinstance(raw_jobs, list):
        raise BadInput("workload.jobs: must be a list")
    for i, raw in enumerate(raw_jobs):
        jobs.append(_explicit_job(i, raw, gpu_models))
    if "generate" in data:
        top.seen.add("generate")
        jobs.extend(generate_jobs(data["generate"], gpu_models, file_seed if seed is None else seed, first_id=len(jobs)))
    top.done()
    if not jobs:
        raise BadInput("workload: no jobs (give jobs: or generate:)")
    jobs.sort(key=lambda j: (j.arrival_s, j.job_id))
    return Workload(name, tuple(jobs))


def workload_summary(w: Workload) -> dict[str, float]:
    n = len(w.jobs)
    return {"jobs": n,
            "mean_sm_util_pct": sum(j.true_sm_util_pct for j in w.jobs) / n,
            "mean_membw_util_pct": sum(j.true_membw_util_pct for j in w.jobs) / n,
            "mean_gpu_mem_gib": sum(j.true_gpu_mem_bytes for j in w.jobs) / n / GIB,
            "mean_host_cpu_cores": sum(j.host_cpu_cores for j in w.jobs) / n,
            "mean_solo_duration_s": sum(j.solo_duration_s for j in w.jobs) / n,
            "last_arrival_s": max(j.arrival_s for j in w.jobs)}


__all__ = ["MIB", "RetryPolicy", "SimCluster", "SimJob", "SimNode", "SlurmTiming", "Workload", "generate_jobs",
           "parse_cluster", "parse_workload", "workload_summary"]
