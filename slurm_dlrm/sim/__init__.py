"""Discrete-event simulator: replay a workload on a cluster through the packing
policies (pure; the CLI `slurm-dlrm simulate` reads the files and draws the plots)."""

from slurm_dlrm.sim.engine import simulate
from slurm_dlrm.sim.files import (
    SimCluster,
    SimJob,
    SimNode,
    Workload,
    generate_jobs,
    parse_cluster,
    parse_workload,
    workload_summary,
)
from slurm_dlrm.sim.planner_view import job_demand
from slurm_dlrm.sim.report import (
    comparison_table,
    ideal_makespan_bounds_s,
    ideal_makespan_s,
    ideal_throughput_bounds_jobs_per_h,
    ideal_throughput_jobs_per_h,
)
from slurm_dlrm.sim.results import JobOutcome, SimResult
from slurm_dlrm.sim.snapshot import Snapshot

__all__ = ["JobOutcome", "SimCluster", "SimJob", "SimNode", "SimResult", "Snapshot", "Workload", "comparison_table",
           "generate_jobs", "ideal_makespan_bounds_s", "ideal_makespan_s", "ideal_throughput_bounds_jobs_per_h",
           "ideal_throughput_jobs_per_h", "job_demand",
           "parse_cluster", "parse_workload", "simulate", "workload_summary"]
