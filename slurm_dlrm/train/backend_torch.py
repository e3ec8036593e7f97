"""`backend: torch`: the runner trains the plain-PyTorch DLRM (slurm_dlrm/train/plain_dlrm.py,
the model scripts/gpu-check.sh measures) instead of torchrec's.

What maps to what (docs/runner.md "backend: torch"):
- tables: one `nn.EmbeddingBag` (sum) each, every table in the process's device memory
  (placement uvm/host needs fbgemm's UVM kernels: refused on a GPU, a note on the CPU);
- `optimizer.fused: true` (default): sparse table gradients (ids x dim) and a torch
  optimizer step after backward (SGD, Adagrad; Adam -> SparseAdam; row-wise Adagrad ->
  plain_dlrm.RowwiseAdagrad, one fp32 per row as fbgemm keeps it). fbgemm instead
  updates the rows inside the backward kernel: same maths, a transient sparse gradient;
- `fused: false`: dense full-table gradients and the same torch optimizer (row-wise
  Adagrad: torch Adagrad, full-size state: plain torch has no dense row-wise Adagrad);
- one process: the model as is; several ranks: DistributedDataParallel over the whole
  model (`gradient_as_bucket_view`), every rank holding every table (data parallel,
  not torchrec's table-wise sharding). NCCL has no sparse all-reduce: on CUDA with
  several ranks the tables take dense gradients (non-fused), said in the log.

The runner sees the same interface as torchrec's: `model(batch) -> (loss, logits)` on a
torchrec-layout batch (or train/batch.py's stand-in), one optimizer object with
`zero_grad`, `step` and a `state_dict` of live tensors, so checkpoints and exact resume
are the runner's own code.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from slurm_dlrm.errors import BadInput
from slurm_dlrm.estimate.backend import TORCH
from slurm_dlrm.train.built import Built
from slurm_dlrm.train.plain_dlrm import PlainDLRM, optimizers_for


class PlainDLRMTrain(nn.Module):
    """PlainDLRM on a batch in torchrec's layout, with torchrec DLRMTrain's loss."""

    def __init__(self, model: PlainDLRM) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        kjt = batch.sparse_features
        dense = batch.dense_features
        n_tables = len(self.model.tables)
        # length_per_key comes from the host copy (HostLengths): no device sync here
        ids = torch.split(kjt.values(), kjt.length_per_key())
        lengths = kjt.lengths().view(n_tables, -1)
        ends = torch.cumsum(lengths, dim=1, dtype=torch.int64)
        offsets = ends - lengths  # each bag's first id, per table
        del ends
        logits = self.model(dense, list(ids), list(offsets.unbind(0)))
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


class HostLengths:
    """A batch source whose batches know their ids per table before they reach the
    device (torchrec's KJT and the stand-in carry `length_per_key` through `to()`)."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.sequential = source.sequential
        self.steps_per_epoch = source.steps_per_epoch
        self.inline = source.inline

    def batch(self, step: int) -> Any:
        b = self.source.batch(step)
        b.sparse_features.length_per_key()
        return b

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if close is not None:
            close()


class LazyState:
    """One torch optimizer whose state may appear only at its first step (Adam,
    SparseAdam): `init_state()` creates it with a zero-gradient step (no parameter
    moves: every update is a multiple of the zero gradient or its moments), as
    torchrec's KeyedOptimizer.init_state does, so a checkpoint can be loaded into it."""

    def __init__(self, opt: torch.optim.Optimizer, sparse: bool) -> None:
        self.opt = opt
        self.sparse = sparse

    @property
    def state(self) -> Any:
        return self.opt.state

    def init_state(self) -> None:
        touched = []
        for group in self.opt.param_groups:
            for p in group["params"]:
                if self.opt.state.get(p):
                    continue
                if self.sparse:
                    p.grad = torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.int64, device=p.device),
                                                     torch.zeros((0, *p.shape[1:]), dtype=p.dtype, device=p.device),
                                                     p.shape)
                else:
                    p.grad = torch.zeros_like(p)
                touched.append(p)
        if touched:
            self.opt.step()
        for p in touched:
            p.grad = None


class PlainOptimizer:
    """The tables' optimizer and the dense one as one object for the runner.

    SparseAdam counts its steps in a Python int, which a checkpoint of tensors cannot
    hold: each such count is mirrored in an int64 tensor that the state dict carries
    (and a load fills), read back before every step."""

    def __init__(self, parts: dict[str, torch.optim.Optimizer]) -> None:
        self.parts = parts
        self._int_steps: list[dict[str, Any]] = []  # param states with an int step, in mirror order
        self._mirror = torch.zeros(0, dtype=torch.int64)
        self._mirrored: list[int] = []

    def zero_grad(self) -> None:
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=True)

    def _sync_in(self) -> None:
        if not self._int_steps:
            return
        now = self._mirror.tolist()
        if now != self._mirrored:  # a checkpoint was loaded into the mirror
            for state, n in zip(self._int_steps, now, strict=True):
                state["step"] = int(n)

    def _sync_out(self) -> None:
        steps = [(state, int(state["step"])) for opt in self.parts.values() for state in opt.state.values()
                 if isinstance(state.get("step"), int)]
        if len(steps) != len(self._int_steps):
            self._int_steps = [state for state, _ in steps]
            self._mirror = torch.zeros(len(steps), dtype=torch.int64)
        self._mirrored = [n for _, n in steps]
        if steps:
            self._mirror.copy_(torch.tensor(self._mirrored, dtype=torch.int64))

    def step(self) -> None:
        self._sync_in()
        for opt in self.parts.values():
            opt.step()
        self._sync_out()

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: opt.state_dict() for name, opt in self.parts.items()}
        if self._int_steps:
            out["int_steps"] = self._mirror
        return out

    def init_state_done(self) -> None:
        """After LazyState.init_state: mirror the counts it created."""
        self._sync_out()


class _LazyAll:
    """LazyState over every part, so the runner's one `init_state()` call covers them
    and the int step mirror follows."""

    def __init__(self, optimizer: PlainOptimizer, lazies: list[LazyState]) -> None:
        self.optimizer = optimizer
        self.lazies = lazies

    @property
    def state(self) -> dict[Any, Any]:
        merged: dict[Any, Any] = {}
        for lz in self.lazies:
            for group in lz.opt.param_groups:
                for p in group["params"]:
                    merged[p] = lz.opt.state.get(p, {})
        return merged

    def init_state(self) -> None:
        for lz in self.lazies:
            lz.init_state()
        self.optimizer.init_state_done()


def build(spec: Any, device: torch.device, world_size: int, local_world_size: int) -> Built:
    """The plain-torch model and optimizers (after init_process_group and seeding)."""
    del local_world_size  # every rank holds every table: no placement to plan
    if getattr(spec, "custom_module", None):
        raise BadInput("custom_module: the built-in runner trains its DLRM only; give a `command` for a custom model")
    notes: list[str] = []
    on_cuda = device.type == "cuda"
    if any(t.placement != "hbm" for t in spec.tables):
        if on_cuda:
            raise BadInput("tables with placement uvm/host need fbgemm's UVM kernels (backend torchrec); "
                           "backend torch keeps every table in device memory")
        notes.append("table placement uvm/host applies on a GPU only; on the CPU every table is in host memory")
    sparse = bool(spec.optimizer.fused)
    if sparse and on_cuda and world_size > 1:
        sparse = False
        notes.append("backend torch, several ranks on CUDA: NCCL has no sparse all-reduce; the tables take dense "
                     "gradients (the non-fused path: more memory, same maths)")
    module = PlainDLRM(spec, device, sparse_tables=sparse)
    opts, opt_notes = optimizers_for(spec, module, sparse)
    notes.extend(f"backend torch: {n}" for n in opt_notes)
    train_model: nn.Module = PlainDLRMTrain(module)
    if world_size > 1:
        train_model = DistributedDataParallel(train_model, device_ids=[device] if on_cuda else None,
                                              gradient_as_bucket_view=True,
                                              process_group=dist.GroupMember.WORLD)
    optimizer = PlainOptimizer({"embedding": opts[0], "dense": opts[1]})
    lazy = _LazyAll(optimizer, [LazyState(opts[0], sparse), LazyState(opts[1], False)])
    return Built(model=train_model, optimizer=optimizer, fused=sparse, lazy_optimizers=[lazy], notes=notes,
                 backend=TORCH)


def plan_text(built: Built) -> str:
    """How the state is laid out: checkpoints are loaded only into the same layout."""
    model = built.model
    ddp = isinstance(model, DistributedDataParallel)
    inner: PlainDLRMTrain = model.module if ddp else model
    tables = ", ".join(f"{tuple(p.shape)}:{p.dtype}" for p in inner.model.tables.parameters())
    opts = ", ".join(f"{k}={type(o).__name__}" for k, o in built.optimizer.parts.items())
    return (f"torch: tables replicated {'(DDP)' if ddp else '(one process)'} [{tables}], "
            f"table gradients {'sparse' if built.fused else 'dense'}, {opts}")
