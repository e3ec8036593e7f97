"""Does a job fit a GPU model, and how many copies of it fit one GPU. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from slurm_dlrm.errors import SpecError
from slurm_dlrm.estimate.analytic import Estimate, table_bytes_with_state
from slurm_dlrm.site import GpuModel, SiteConfig
from slurm_dlrm.spec import JobSpec

GIB = 1 << 30


@dataclass(frozen=True)
class Fit:
    gpu_model: str
    gpu_mem_bytes: int
    gpu_peak_bytes: int  # of one copy, with the site's packing margin
    copies: int  # how many copies fit one GPU by memory (0: does not fit)

    @property
    def fits(self) -> bool:
        return self.copies > 0


def copies_per_gpu(est: Estimate, gpu: GpuModel, margin_pct: float = 0.0) -> Fit:
    """Copies of the job one GPU holds by memory. Each copy is counted with its own
    CUDA context (MPS clients each keep per-client state), so this is conservative."""
    need = int(est.gpu_peak_bytes * (1 + margin_pct / 100))
    copies = gpu.memory_bytes // need if need > 0 else 0
    return Fit(gpu.name, gpu.memory_bytes, need, int(copies))


def check_tables_fit(spec: JobSpec, site: SiteConfig) -> None:
    """Raise SpecError for an HBM table that, with its optimizer state and a CUDA
    context, fits no GPU model of the site."""
    if not site.gpu_models:
        return
    best = max(site.gpu_models.values(), key=lambda g: g.memory_bytes - g.cuda_context_bytes)
    room = best.memory_bytes - best.cuda_context_bytes
    for i, t in enumerate(spec.tables):
        if t.placement != "hbm":
            continue
        need = table_bytes_with_state(spec, i)
        if need > room:
            raise SpecError(
                f"tables[{i}].rows",
                f"table {t.name} needs {need / GIB:.1f} GiB with its {spec.optimizer.type} state; the largest GPU "
                f"({best.name}) has {room / GIB:.1f} GiB after the CUDA context (shrink it, or place it uvm/host)",
                spec.source,
            )
