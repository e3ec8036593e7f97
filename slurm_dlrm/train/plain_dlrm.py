"""A plain-torch DLRM built from a `JobSpec`: the runner's `backend: torch`
(slurm_dlrm/train/backend_torch.py) and what `scripts/gpu-check.sh` runs on a GPU
machine that has torch but neither torchrec nor fbgemm-gpu (too large to carry there).

Same shapes as the runner's torchrec model (slurm_dlrm/train/model.py), so the
estimator's figures for the spec describe it: one `nn.EmbeddingBag` (sum pooling) per
table, the bottom MLP (ReLU after every layer), the dot interaction (pairwise dots of
the F+1 vectors, upper triangle, beside the dense vector) or DCN (a low-rank cross net
on the F+1 vectors), the top MLP (no ReLU after its last layer), BCE-with-logits loss;
`mixed_precision` runs the forward under `torch.autocast`.

Where plain torch differs from torchrec/fbgemm (each is recorded by the check, never
hidden): a *fused* spec's tables get sparse gradients and a torch optimizer instead of
fbgemm's update inside the backward kernel (SGD and Adagrad take sparse gradients,
Adam becomes `SparseAdam` with the same two moments, row-wise Adagrad is
`RowwiseAdagrad` below: one fp32 per row, as fbgemm keeps it); a *non-fused* spec's
tables get dense full-table gradients and the torch optimizer, as torchrec's dense
kernel does, but without DDP's gradient bucket (one process, no DDP here).

Imports torch: only the runner and the check's child processes import this module.
(`slurm_dlrm.selftest.plain_dlrm` re-exports it under the same names.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slurm_dlrm.spec import JobSpec

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def mlp(sizes: list[int], relu_last: bool, device: torch.device) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1], device=device))
        if relu_last or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class LowRankCrossNet(nn.Module):
    """torchrec's LowRankCrossNet: x_{l+1} = x0 * (W (V x_l) + b) + x_l."""

    def __init__(self, n: int, layers: int, rank: int, device: torch.device) -> None:
        super().__init__()
        self.W = nn.ParameterList(nn.Parameter(torch.empty(n, rank, device=device).uniform_(-0.05, 0.05))
                                  for _ in range(layers))
        self.V = nn.ParameterList(nn.Parameter(torch.empty(rank, n, device=device).uniform_(-0.05, 0.05))
                                  for _ in range(layers))
        self.b = nn.ParameterList(nn.Parameter(torch.zeros(n, device=device)) for _ in range(layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for W, V, b in zip(self.W, self.V, self.b, strict=True):
            x = x0 * (torch.nn.functional.linear(torch.nn.functional.linear(x, V), W) + b) + x
        return x


class PlainDLRM(nn.Module):
    def __init__(self, spec: JobSpec, device: torch.device, sparse_tables: bool) -> None:
        super().__init__()
        F, D = len(spec.tables), spec.emb_dim
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(t.rows, t.dim, mode="sum", sparse=sparse_tables, device=device,
                            dtype=TORCH_DTYPES[t.dtype])
            for t in spec.tables)
        self.bottom = mlp([spec.dense_features, *spec.bottom_mlp], relu_last=True, device=device)
        self.dcn: LowRankCrossNet | None = None
        if spec.interaction.type == "dcn":
            top_in = (F + 1) * D
            self.dcn = LowRankCrossNet(top_in, spec.interaction.layers or 0, spec.interaction.low_rank or 0, device)
        else:
            top_in = D + math.comb(F + 1, 2)
            self.register_buffer("triu", torch.triu_indices(F + 1, F + 1, offset=1, device=device), persistent=False)
        self.top = mlp([top_in, *spec.top_mlp], relu_last=False, device=device)

    def forward(self, dense: torch.Tensor, ids: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = [bag(i, o).to(x.dtype) for bag, i, o in zip(self.tables, ids, offsets, strict=True)]
        vectors = torch.stack([x, *pooled], dim=1)  # B x (F+1) x D
        if self.dcn is not None:
            z = self.dcn(vectors.flatten(1))
        else:
            dots = torch.bmm(vectors, vectors.transpose(1, 2))
            triu: torch.Tensor = self.triu  # type: ignore[assignment]  # a registered buffer
            z = torch.cat([x, dots[:, triu[0], triu[1]]], dim=1)
        return self.top(z).squeeze(1)


class RowwiseAdagrad(torch.optim.Optimizer):
    """fbgemm's row-wise Adagrad on sparse gradients: one fp32 accumulator per row
    (the mean of the row's squared gradient), the row scaled by it."""

    def __init__(self, params: Any, lr: float, eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
                g = p.grad.coalesce() if p.grad.is_sparse else p.grad.to_sparse().coalesce()
                rows, values = g.indices()[0], g.values().float()
                acc = state["sum"].index_add_(0, rows, values.pow(2).mean(dim=1))
                scale = group["lr"] / (acc[rows].sqrt() + group["eps"])
                p.index_add_(0, rows, (-values * scale.unsqueeze(1)).to(p.dtype))


@dataclass
class Trainer:
    spec: JobSpec
    model: PlainDLRM
    optimizers: list[torch.optim.Optimizer]
    batches: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]]
    notes: list[str]
    step_count: int = 0

    def step(self) -> float:
        dense, ids, offsets, labels = self.batches[self.step_count % len(self.batches)]
        self.step_count += 1
        amp = self.spec.mixed_precision in ("fp16", "bf16")
        with torch.autocast(dense.device.type, dtype=TORCH_DTYPES.get(self.spec.mixed_precision, torch.bfloat16),
                            enabled=amp):
            logits = self.model(dense, ids, offsets)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), labels)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in self.optimizers:
            opt.step()
        return float(loss.detach())

    def optimizer_state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state, tables apart from the dense part."""
        table_params = {id(p) for p in self.model.tables.parameters()}
        out = {"embedding": 0, "dense": 0}
        for opt in self.optimizers:
            for p, state in opt.state.items():
                n = sum(v.numel() * v.element_size() for v in state.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0)  # not the step counters
                out["embedding" if id(p) in table_params else "dense"] += n
        return out


def optimizers_for(spec: JobSpec, model: PlainDLRM, sparse: bool) -> tuple[list[torch.optim.Optimizer], list[str]]:
    kind, lr = spec.optimizer.type, spec.optimizer.lr
    tables = list(model.tables.parameters())
    dense = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
    dense_cls: Any = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "rowwise_adagrad": torch.optim.Adagrad,
                      "adam": torch.optim.Adam}[kind]
    notes = []
    if not sparse:
        # torchrec's non-fused path: dense table gradients, the same torch optimizer
        table_cls = torch.optim.Adagrad if kind == "rowwise_adagrad" else dense_cls
        if kind == "rowwise_adagrad":
            notes.append("non-fused row-wise Adagrad: plain torch has none; torch Adagrad (full-size state)")
        return [table_cls(tables, lr=lr), dense_cls(dense, lr=lr)], notes
    notes.append("fused optimizer: fbgemm updates rows inside the backward kernel; plain torch: sparse "
                 "gradients + a torch optimizer step")
    if kind == "adam":
        table_opt: torch.optim.Optimizer = torch.optim.SparseAdam(tables, lr=lr)
        notes.append("Adam tables: torch.optim.SparseAdam (two fp32 moments, as fbgemm)")
    elif kind == "rowwise_adagrad":
        table_opt = RowwiseAdagrad(tables, lr=lr)
    else:
        table_opt = dense_cls(tables, lr=lr)
    return [table_opt, dense_cls(dense, lr=lr)], notes


def make_batches(spec: JobSpec, device: torch.device, count: int, seed: int = 0
                 ) -> list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]]:
    """`count` batches on the device: ids uniform over each table's rows (the most
    bandwidth a lookup can ask for), lengths fixed (multi-hot, one-hot) or Poisson."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B = spec.batch_size
    out = []
    for _ in range(count):
        dense = torch.randn(B, spec.dense_features, generator=g).to(device)
        labels = torch.randint(0, 2, (B,), generator=g).float().to(device)
        ids, offsets = [], []
        for t in spec.tables:
            if t.multi_hot is not None or (t.pooling_factor or 1.0) == 1.0:
                lengths = torch.full((B,), int(t.multi_hot or 1), dtype=torch.int64)
            else:
                lengths = torch.poisson(torch.full((B,), float(t.pooling_factor or 1.0)), generator=g).long()
            offsets.append(torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]).to(device))
            ids.append(torch.randint(0, t.rows, (int(lengths.sum()),), generator=g).to(device))
        out.append((dense, ids, offsets, labels))
    return out


def build_trainer(spec: JobSpec, device: torch.device, batches: int = 2) -> Trainer:
    if spec.world_size != 1 or spec.custom_module:
        raise ValueError(f"{spec.name}: the plain-torch DLRM covers one process and the built-in model only")
    if any(t.placement != "hbm" for t in spec.tables):
        raise ValueError(f"{spec.name}: the plain-torch DLRM keeps every table in device memory (placement hbm)")
    sparse = spec.optimizer.fused
    torch.manual_seed(spec.seed)
    model = PlainDLRM(spec, device, sparse_tables=sparse)
    optimizers, notes = optimizers_for(spec, model, sparse)
    return Trainer(spec, model, optimizers, make_batches(spec, device, batches, spec.seed), notes)


# The names the first GPU check's code used (slurm_dlrm.selftest.plain_dlrm re-exports them).
_TORCH_DTYPES = TORCH_DTYPES
_mlp = mlp
_optimizers = optimizers_for
