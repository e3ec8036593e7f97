"""The simulated cluster as one run holds it: each node's free capacity (`NodeState`),
the packs on them (`PackState`, one Slurm allocation each), their GPUs (`GpuState`)
and members (`MemberState`, with their true profiles), and `SimState`, everything the
run's parts share: the settings, the clock and its events, the queue, the counters.

Apart from the event loop (sim/engine.py) because every part of a run (progress, the
pack lifecycle, the dispatch round, snapshots) reads and changes this state; the loop
only drives it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from slurm_dlrm.packing.dispatch import DispatchConfig
from slurm_dlrm.packing.interference import InterferenceParams
from slurm_dlrm.packing.model import JobDemand, PackingLimits
from slurm_dlrm.sim.events import EventQueue
from slurm_dlrm.sim.faults import FaultRuntime
from slurm_dlrm.sim.files import RetryPolicy, SimCluster, SimJob, SlurmTiming
from slurm_dlrm.sim.sweep import SweepRuntime


@dataclass
class NodeState:
    name: str
    gpu_model: str
    gpus: int
    cpus: int
    memory_bytes: int
    free_gpus: int
    free_cpus: int
    free_mem: int
    down: bool = False  # failed, until repaired (faults only)


@dataclass
class MemberState:
    job: SimJob
    fence_bytes: int | None  # None: no fence (the whole GPU is reachable)
    progress_start: float
    progress: float
    ready_at: float = math.inf
    cpus: int = 0
    host_mem: int = 0
    ready: bool = False
    peaked: bool = False
    peak_progress: float = 0.0
    speed: float = 0.0
    ended: bool = False
    soft_bytes: int | None = None  # dmem: the soft limit (dmem.min), the estimate it was packed on
    rank: int = 0  # a multi-GPU job's rank (its siblings are members of the same job)
    raw_speed: float = 0.0  # its GPU's speed for it; a rank runs at its slowest sibling's (`speed`)

    @property
    def scale(self) -> float:
        return self.job.scales[self.rank] if self.rank < len(self.job.scales) else 1.0

    @property
    def true_mem(self) -> int:
        return int(self.job.true_gpu_mem_bytes * self.scale)

    @property
    def true_sm(self) -> float:
        return self.job.true_sm_util_pct * self.scale

    @property
    def true_bw(self) -> float:
        return self.job.true_membw_util_pct * self.scale


@dataclass
class GpuState:
    members: list[MemberState] = field(default_factory=list)


@dataclass
class PackState:
    pack_id: int
    node: NodeState
    gpu_count: int
    cpus: int
    host_mem: int
    mps: bool
    gpus: list[GpuState]
    start_s: float = math.nan
    live: int = 0
    asked_cpus: int = 0  # what the pack asked Slurm for at its start (refill: its allocation)
    asked_mem: int = 0
    idle_since_s: float | None = None  # its last member ended (slurm.pack_release_s pending)
    agent_cpus: int = 0  # the pack's agent (AGENT_CPUS, AGENT_MEM_MIB), held beside its members
    agent_mem: int = 0


@dataclass
class WholeNodeJobs:
    """The whole-node multi-node jobs of one run (issue 48, sim/multinode.py): waiting
    (in arrival order), the nodes each waits for, running (nodes, start)."""

    waiting: deque[int] = field(default_factory=deque)
    reserved: dict[int, list[str]] = field(default_factory=dict)
    running: dict[int, tuple[list[str], float]] = field(default_factory=dict)

    def held_nodes(self) -> set[str]:
        """Nodes the policy may not use now: reserved for a waiting job or held by a running one."""
        return {n for names in self.reserved.values() for n in names} | {
            n for names, _ in self.running.values() for n in names}


@dataclass
class SimState:
    """One run's shared state (sim/engine.py `simulate` makes it from its arguments)."""

    # The run's settings.
    cluster: SimCluster
    policy: str
    truth: InterferenceParams
    plan_params: InterferenceParams | None
    faults: FaultRuntime | None
    limits: PackingLimits
    dispatch: DispatchConfig
    slurm: SlurmTiming
    retry: RetryPolicy
    jobs: dict[int, SimJob]
    nodes: list[NodeState]
    by_name: dict[str, NodeState]
    fenced: bool  # mem-best-fit, complementary: each member has a fence
    # first-fit models gres/shard: each job is its own Slurm job on a shard of a GPU, so
    # a busy GPU with a free shard takes new jobs (the other policies own whole GPUs).
    shard_mode: bool
    # mem-best-fit and complementary refill their running packs: pending jobs join pack
    # GPUs with room (OpenGpu.pack, docs/packing.md), as the live service does.
    refill: bool
    # dmem: plan on the estimates; the usual fence stays as each member's hard limit.
    dmem: bool
    plan_limits: PackingLimits
    # Fences follow the estimate's observed error (round_limits); dmem plans on the
    # estimates by design, so it keeps its own limits.
    learn_margin: bool
    # Each pack's agent (one per node of a pack); first-fit's members are Slurm jobs of their own.
    agent_cpus: int
    agent_mem: int
    # The clock.
    now: float
    first_arrival: float
    events: EventQueue = field(default_factory=EventQueue)
    # The queue and the dispatcher.
    pending: dict[int, JobDemand] = field(default_factory=dict)
    waited: dict[int, int] = field(default_factory=dict)
    last_round: float | None = None
    arrived_since: int = 0
    tick_at: float | None = None
    dirty: bool = False
    observe_armed: bool = False
    # Each job's run so far: checkpointed progress, OOM retries, user resubmissions,
    # the estimate it is planned with.
    progress_saved: dict[int, float] = field(default_factory=dict)
    attempts: dict[int, int] = field(default_factory=dict)
    resubmits: dict[int, int] = field(default_factory=dict)
    est_mem: dict[int, int] = field(default_factory=dict)
    mem_errors: list[float] = field(default_factory=list)
    # The packs holding GPUs.
    running_packs: list[PackState] = field(default_factory=list)
    next_pack_id: int = 0
    shard_gpus: dict[str, tuple[PackState, int]] = field(default_factory=dict)  # f"{pack_id}:{gpu_index}" -> its pack and GPU
    # What the run measures (sim/results.py).
    outcome_end: dict[int, float] = field(default_factory=dict)
    first_start: dict[int, float] = field(default_factory=dict)
    outcome_state: dict[int, str] = field(default_factory=dict)
    oom_of: dict[int, int] = field(default_factory=dict)
    rounds: int = 0
    ooms: int = 0
    packs_made: int = 0
    evictions: int = 0
    alloc_gpu_s: float = 0.0
    busy_gpu_s: float = 0.0
    member_s: float = 0.0
    held_cpu_s: float = 0.0
    held_mem_byte_s: float = 0.0
    backlog_s: float = 0.0  # time with jobs waiting, and solo work done then
    backlog_work_s: float = 0.0
    # A sweep with a stopping rule (issue 47, sim/sweep.py): its variants pause at rungs.
    sweep: SweepRuntime | None = None
    # Whole-node multi-node jobs (issue 48, sim/multinode.py); None: the workload has none.
    whole_node: WholeNodeJobs | None = None

    def policy_nodes_closed(self) -> set[str]:
        """Nodes no new pack or joiner may use: a multi-node job holds or waits for them."""
        return self.whole_node.held_nodes() if self.whole_node is not None else set()

    def gpu_bytes(self, node: NodeState) -> int:
        return self.cluster.gpu_model(node.gpu_model).memory_bytes

    def ctx_bytes(self, node: NodeState) -> int:
        g = self.cluster.gpu_model(node.gpu_model)
        return g.cuda_context_bytes + g.cublas_workspace_bytes
