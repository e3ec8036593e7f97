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


def fit_advice(spec: JobSpec, gpu: GpuModel, margin_pct: float = 0.0, max_gpus: int = 8) -> list[str]:
    """What would make a job that fits no `gpu` fit one: each change alone, the least
    first found (more GPUs, half precision, tables off the GPU, smaller tables)."""
    from dataclasses import replace

    from slurm_dlrm.estimate.analytic import estimate

    def fits(s: JobSpec) -> bool:
        return copies_per_gpu(estimate(s, gpu, ranks=False), gpu, margin_pct).fits

    out: list[str] = []
    w = 2
    while w <= max_gpus and spec.world_size < w:
        if fits(replace(spec, world_size=w)):
            out.append(f"world_size: {w} (tables sharded over {w} {gpu.name} GPUs of one node; submit --no-pack)")
            break
        w *= 2
    if spec.mixed_precision == "none" or any(t.dtype == "fp32" for t in spec.tables):
        half = replace(spec, mixed_precision="bf16" if spec.mixed_precision == "none" else spec.mixed_precision,
                       tables=tuple(replace(t, dtype="fp16") if t.dtype == "fp32" else t for t in spec.tables))
        if fits(half):
            out.append("half precision (dtype: fp16 on the tables, mixed_precision: bf16)")
    hbm = sorted((i for i, t in enumerate(spec.tables) if t.placement == "hbm"),
                 key=lambda i: -spec.tables[i].rows * spec.tables[i].dim)

    def largest_to_uvm(k: int) -> JobSpec:
        moved = list(spec.tables)
        for i in hbm[:k]:
            moved[i] = replace(moved[i], placement="uvm")
        return replace(spec, tables=tuple(moved))

    # The fewest of the largest tables to move: a binary search over how many (a few
    # dozen estimates), not one estimate per table (10,000 tables ran for minutes,
    # issue 32). Moving a table frees its weights and state and costs a cache of a
    # fifth of its rows plus 5.6 bytes a row, so for tables of dim >= 4 more moved never
    # needs more GPU memory (below that the count found may be more than the fewest;
    # it always fits).
    if hbm and fits(largest_to_uvm(len(hbm))):
        lo, hi = 1, len(hbm)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(largest_to_uvm(mid)) else (mid + 1, hi)
        names = ", ".join(spec.tables[j].name for j in hbm[:lo][:10]) + (f" and {lo - 10} more" if lo > 10 else "")
        out.append(f"placement: uvm for table{'s' if lo > 1 else ''} {names} (in host memory, cached on the GPU)")
    biggest = max((t.rows for t in spec.tables), default=0)

    def capped(cap: int) -> JobSpec:
        return replace(spec, tables=tuple(replace(t, rows=min(t.rows, cap)) for t in spec.tables))

    if biggest > 1 and fits(capped(1)):
        lo, hi = 1, biggest
        while lo < hi:  # the largest cap that fits
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(capped(mid)) else (lo, mid - 1)
        out.append(f"smaller tables (scale: {{max_rows_per_table: {lo}}}; the largest has {biggest} rows)")
    return out
