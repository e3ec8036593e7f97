"""Train one job spec: set up (distributed, model, data), resume, loop, report,
checkpoint, and map every way of ending onto a `TRAIN_EXIT_*` code.

Signals: SIGTERM and SIGUSR1 (what Slurm sends on preemption, at the time limit with
`--signal`, and on `scontrol requeue`), and SIGINT, only set a flag; the loop sees it at
the next step boundary, writes a checkpoint and exits with TRAIN_EXIT_PREEMPTED.

Over 600 lines: the loop, its resume and its checkpoint writer share the Trainer's state
(step, model, optimizer, the writer thread), and every exit path must see all of it.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from slurm_dlrm.errors import (
    ENV_CHECKPOINT_DIR,
    ENV_METRICS_FILE,
    TRAIN_EXIT_BAD_SPEC,
    TRAIN_EXIT_FAILED,
    TRAIN_EXIT_OK,
    TRAIN_EXIT_OOM_GPU,
    TRAIN_EXIT_OOM_HOST,
    TRAIN_EXIT_PREEMPTED,
    BadInput,
)
from slurm_dlrm.train import checkpoint as ckpt
from slurm_dlrm.train.backends import TORCH, build, plan_text, resolve
from slurm_dlrm.train.built import Built
from slurm_dlrm.train.data import BatchSource, Prefetcher, make_source
from slurm_dlrm.train.evaluation import Evaluator, import_metrics_in_background, stop_reason
from slurm_dlrm.train.heldout import HeldOut
from slurm_dlrm.train.hostmem import fix_malloc_mmap_threshold
from slurm_dlrm.train.launch import ENV_RDZV_FILE
from slurm_dlrm.train.metrics import (
    MetricsWriter,
    Progress,
    human_eval_line,
    now,
    rss_and_peak_bytes,
)

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
DEFAULT_KEEP_CHECKPOINTS = 2
# A background checkpoint holds a copy of the state in host memory while it writes.
DEFAULT_ASYNC_CHECKPOINT_MAX_BYTES = 1 << 30


@dataclass
class RunOptions:
    metrics_file: Path
    checkpoint_dir: Path
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS
    steps: int | None = None  # overrides the spec's steps/epochs
    device: str = "auto"  # auto | cpu | cuda
    resume: bool = True
    tty: bool | None = None  # progress bar: None = when stdout is a terminal
    # Larger states are written synchronously instead of copied for a background write.
    async_checkpoint_max_bytes: int = DEFAULT_ASYNC_CHECKPOINT_MAX_BYTES
    # Checkpoint the final step too (a requeue after the end then has nothing to redo).
    final_checkpoint: bool = True
    # Test hook: request a stop once this many steps are done (as if signalled).
    stop_after_step: int | None = None
    # The caller ends the process with os._exit right after (`slurm-dlrm train`): the
    # model and the process group are left as they are, nothing is torn down (teardown).
    exit_after: bool = False


def default_paths(spec_name: str, metrics_file: str | None, checkpoint_dir: str | None) -> tuple[Path, Path]:
    """Option, else the agent's environment, else `./<name>.run/`; the checkpoint folder
    defaults to `ckpt/` next to the metrics file."""
    metrics = metrics_file or os.environ.get(ENV_METRICS_FILE)
    metrics_path = Path(metrics) if metrics else Path.cwd() / f"{spec_name}.run" / "metrics.jsonl"
    ckpt_dir = checkpoint_dir or os.environ.get(ENV_CHECKPOINT_DIR)
    ckpt_path = Path(ckpt_dir) if ckpt_dir else metrics_path.parent / "ckpt"
    return metrics_path.absolute(), ckpt_path.absolute()


class StopFlag:
    """Set by SIGTERM/SIGUSR1/SIGINT; read at step boundaries."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "-"


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    backend: str = "gloo"
    owns_group: bool = False


def pick_device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise BadInput("--device cuda: no CUDA device is visible")
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def sharding_local_size(device: torch.device, local_world_size: int) -> int:
    """The local world size to give torchrec's planner. torchrec places rank r's shards on
    `cuda:(r % local size)` (torchrec/distributed/sharding_plan.py `placement`), which is
    right when every rank sees all the node's GPUs (torchrun) but not when each rank sees
    only its own (a pack's agent sets CUDA_VISIBLE_DEVICES per rank, so every rank's GPU is
    its cuda:0): then the local size is the number of devices a rank sees, which also
    matches `pick_device`'s `LOCAL_RANK % device_count()`."""
    if device.type != "cuda":
        return local_world_size
    return max(1, min(local_world_size, torch.cuda.device_count()))


def init_distributed(device: torch.device) -> DistInfo:
    """One process group per run: from torchrun's (or our launcher's) environment when
    RANK/WORLD_SIZE are set, else a single-process group on an in-memory store."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():  # e.g. the benchmark builds two models in one process
        return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)),
                        int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())), dist.get_backend())
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        init_method = f"file://{env[ENV_RDZV_FILE]}" if env.get(ENV_RDZV_FILE) else "env://"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    else:
        rank, world, local_rank, local_world = 0, 1, 0, 1
        os.environ.setdefault("LOCAL_WORLD_SIZE", "1")  # torchrec asks for it
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistInfo(rank, world, local_rank, local_world, backend, owns_group=True)


def _flatten(prefix: str, obj: Any, out: dict[str, torch.Tensor]) -> None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(obj, ShardedTensor):
        for shard in obj.local_shards():
            offsets = ",".join(str(o) for o in shard.metadata.shard_offsets)
            out[f"{prefix}@{offsets}"] = shard.tensor
    elif isinstance(obj, DTensor):
        out[prefix] = obj.to_local()
    elif isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}/{k}", v, out)
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _flatten(f"{prefix}/{i}", v, out)


def state_tensors(built: Built) -> dict[str, torch.Tensor]:
    """Every tensor of the training state this rank holds, as live views: local shards of
    the tables, the fused optimizer state, dense weights and the dense optimizer."""
    out: dict[str, torch.Tensor] = {}
    _flatten("model", built.model.state_dict(), out)
    _flatten("optim", built.optimizer.state_dict(), out)
    return out


@contextlib.contextmanager
def _count_saved_tensors(counter: list[int]) -> Iterator[None]:
    """Counts the bytes autograd keeps for backward (the activations)."""
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                counter[0] += t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def predict_clicks(built: Built, device: torch.device, autocast: Callable[[], Any],
                   batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Click probabilities and labels of one held-out batch (no gradient, no update;
    call under torch.no_grad). The model's outputs (loss, logits) are let go on return."""
    if built.backend == TORCH:
        batch.sparse_features.length_per_key()  # read on the host, as HostLengths does for training
    batch = batch.to(device)
    with autocast():
        out = built.model(batch)
    if built.backend == TORCH:  # (loss, logits); torchrec's DLRMTrain: (loss, (loss, logits, labels))
        logits, labels = out[1], batch.labels
    else:
        _, (_, logits, labels) = out
    return torch.sigmoid(logits.float()), labels


def _grad_bytes(g: torch.Tensor) -> int:
    """A gradient's own bytes: a sparse one (backend torch's tables) holds its ids and rows."""
    if g.is_sparse:
        return int(g._indices().numel() * g._indices().element_size() + g._values().numel() * g._values().element_size())
    return int(g.numel() * g.element_size())


def _batch_bytes(batch: Any) -> int:
    kjt = batch.sparse_features
    return int(sum(t.numel() * t.element_size() for t in
                   (batch.dense_features, batch.labels, kjt.values(), kjt.lengths())))


@dataclass
class Trainer:
    """One rank's training: built once, then `run()` from the resumed step to the end."""

    spec: Any
    opts: RunOptions
    dist_info: DistInfo
    device: torch.device
    built: Built
    source: BatchSource
    total_steps: int
    stop: StopFlag
    start_step: int = 0
    last_saved_step: int = -1
    expect: dict[str, Any] = field(default_factory=dict)
    evaluator: Evaluator | None = None
    _writer: threading.Thread | None = None
    _writer_error: BaseException | None = None
    _static_tensor_bytes: int = 0
    _activation_bytes: int = 0
    _peak_tensor_bytes: int = 0

    @property
    def rung_steps(self) -> frozenset[int]:
        return self.evaluator.extra_steps if self.evaluator is not None else frozenset()

    @property
    def is_main(self) -> bool:
        return self.dist_info.rank == 0

    # ---------------------------------------------------------------- checkpoints

    def save_checkpoint(self, step: int, wait: bool = False) -> None:
        """Checkpoint the state after `step` steps.

        One process and a state of at most `async_checkpoint_max_bytes`: the loop only
        copies the state (milliseconds) and a background thread writes, fsyncs and
        renames it, so a slow disk does not stall training. Otherwise (several ranks,
        whose commit needs collectives, or a state too big to copy) it is written
        in place, tensor by tensor."""
        t0 = time.perf_counter()
        self.wait_for_writer()
        tensors = state_tensors(self.built)
        tensors["rng/torch"] = torch.get_rng_state()
        meta = dict(self.expect, samples_per_step=int(self.spec.batch_size) * self.dist_info.world_size)
        d = self.opts.checkpoint_dir
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.dist_info.world_size == 1 and nbytes <= self.opts.async_checkpoint_max_bytes:
            snapshot = {k: t.detach().to("cpu", copy=True) for k, t in tensors.items()}
            copy_s = time.perf_counter() - t0
            self._writer = threading.Thread(target=self._write_snapshot, args=(step, snapshot, meta, copy_s),
                                            name="checkpoint-writer", daemon=True)
            self._writer.start()
            self.last_saved_step = step
            if wait:
                self.wait_for_writer()
            return
        if self.dist_info.world_size == 1:
            path = ckpt.save(d, step, tensors, meta)
        else:
            if self.is_main:
                ckpt.prepare_tmp(d, step)
            dist.barrier()
            tmp = d / f"{ckpt.TMP_PREFIX}{ckpt.step_dir_name(step)}"
            files = ckpt.write_rank_files(tmp, self.dist_info.rank, tensors)
            gathered: list[Any] = [None] * self.dist_info.world_size
            dist.all_gather_object(gathered, files)
            path = d / ckpt.step_dir_name(step)
            if self.is_main:
                merged = {k: v for part in gathered for k, v in part.items()}
                path = ckpt.commit(d, step, merged, meta)
            dist.barrier()
        if self.is_main:
            ckpt.prune(d, self.opts.keep_checkpoints, step)
        self.last_saved_step = step
        log.info("checkpoint at step %d: %s (%.2f s)", step, path, time.perf_counter() - t0)

    def _write_snapshot(self, step: int, snapshot: dict[str, torch.Tensor], meta: dict[str, Any],
                        copy_s: float) -> None:
        t0 = time.perf_counter()
        try:
            path = ckpt.save(self.opts.checkpoint_dir, step, snapshot, meta)
            ckpt.prune(self.opts.checkpoint_dir, self.opts.keep_checkpoints, step)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._writer_error = exc
            return
        log.info("checkpoint at step %d: %s (copy %.3f s, write %.2f s in the background)",
                 step, path, copy_s, time.perf_counter() - t0)

    def wait_for_writer(self) -> None:
        """Block until the background checkpoint write is done; re-raise its failure."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._writer_error is not None:
            exc, self._writer_error = self._writer_error, None
            raise exc

    def resume(self) -> None:
        """Load the newest valid checkpoint, if any (skipping broken ones)."""
        d = self.opts.checkpoint_dir
        if self.is_main:
            ckpt.remove_stale_tmp(d)
            if not self.opts.resume:
                # Left in place, they would win over this run's at the next restart.
                (d / STOPPED_MARKER).unlink(missing_ok=True)
                n = ckpt.remove_all(d)
                if n:
                    log.warning("--no-resume: removed %d old checkpoint(s) in %s", n, d)
        if self.dist_info.world_size > 1:
            dist.barrier()
        if not self.opts.resume:
            return
        other_world: tuple[int, str] | None = None  # a checkpoint of another world size
        for _step, path in ckpt.list_steps(d):
            # Every rank verifies and checks its part first; only a checkpoint that all
            # ranks can load is copied into the live state (never half of one).
            try:
                found = ckpt.verify(path, self.expect)
                saved = ckpt.read_rank(found, self.dist_info.rank)
                rng = saved.pop("rng/torch", None)
                targets = self._load_targets(saved)
                ckpt.check_compatible(targets, saved)
            except ckpt.CheckpointError as exc:
                ok = 0
                log.warning("checkpoint %s skipped: %s", path, exc)
                if str(exc).startswith("world_size is") and other_world is None:
                    other_world = (found_step(path), str(exc))
            else:
                ok = 1
            if self.dist_info.world_size > 1:
                flag = torch.tensor([ok], dtype=torch.int32)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                ok = int(flag.item())
            if ok:
                ckpt.load_into(targets, saved)
                if rng is not None:
                    torch.set_rng_state(rng)
                self.start_step = found.step
                self.last_saved_step = found.step
                log.info("resumed from %s (step %d)", path, found.step)
                return
        if other_world is not None:
            # not resharded (issue 48): one clear line rather than silently starting over
            raise BadInput(f"the checkpoint at step {other_world[0]} in {d} was written by another world size "
                           f"({other_world[1]}); run it on that many ranks, or --no-resume to start over")
        log.info("no checkpoint to resume from in %s; starting at step 0", d)

    def _load_targets(self, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The live tensors to load `saved` into. Optimizers whose state appears only
        at the first step (Adam, SGD with momentum) get it created first (torchrec's
        KeyedOptimizer.init_state) when the checkpoint holds state they lack."""
        targets = state_tensors(self.built)
        if set(saved) - set(targets):
            for opt in self.built.lazy_optimizers:
                if not opt.state or any(not s for s in opt.state.values()):
                    opt.init_state()
            targets = state_tensors(self.built)
        return targets

    # ---------------------------------------------------------------- loop

    def _stop_requested(self, done: int) -> bool:
        if self.opts.stop_after_step is not None and done >= self.opts.stop_after_step and self.stop.signum is None:
            self.stop.signum = signal.SIGTERM
        if self.dist_info.world_size == 1:
            return self.stop.signum is not None
        flag = torch.tensor([0 if self.stop.signum is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        mp = self.spec.mixed_precision
        if mp == "none":
            return contextlib.nullcontext()
        dtype = torch.float16 if mp == "fp16" else torch.bfloat16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _tensor_bytes(self) -> int:
        if not self._static_tensor_bytes:
            tensors = state_tensors(self.built)
            seen: set[int] = set()
            total = 0
            for t in tensors.values():
                key = t.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
            grads = sum(_grad_bytes(p.grad) for p in self.built.model.parameters() if p.grad is not None)
            self._static_tensor_bytes = total + grads
        return self._static_tensor_bytes + self._activation_bytes

    def _rank_peaks(self, record: dict[str, Any]) -> dict[str, list[int | None]]:
        """Every rank's peaks so far (GPU, host RSS, live tensors), gathered at a metrics
        window (every rank reaches it at the same step) for rank 0's line: the ranks of a
        multi-node job differ (issue 48: the largest one decides the request), and `acct`
        shows each one's measured peak. -1 stands for "not measured" (no GPU)."""
        keys = ("peak_gpu_bytes", "peak_rss_bytes", "peak_tensor_bytes")
        mine = torch.tensor([-1 if record[k] is None else int(record[k]) for k in keys], dtype=torch.int64,
                            device=self.device)  # gloo: the CPU; NCCL: the rank's GPU
        every = [torch.empty_like(mine) for _ in range(self.dist_info.world_size)]
        dist.all_gather(every, mine)
        rows = [t.tolist() for t in every]
        return {f"rank_{k}": [None if row[i] < 0 else int(row[i]) for row in rows] for i, k in enumerate(keys)}

    def _predict(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return predict_clicks(self.built, self.device, self._autocast, batch)

    def _evaluate(self, done: int, metrics: MetricsWriter | None, progress: Progress | None) -> tuple[float, str]:
        """Run the held-out evaluation after `done` steps: its wall seconds, and why
        eval.stop_when ends the job now ("" to go on; the same on every rank)."""
        assert self.evaluator is not None
        t0 = time.perf_counter()
        record = self.evaluator.run(self._predict, done, now())
        reason = ""
        if record is not None and metrics is not None and progress is not None:
            metrics.write(record)
            progress.say(human_eval_line(record))
            rule = self.spec.eval.stop_when
            if rule is not None and done < self.total_steps:
                from slurm_dlrm.spec import STOP_METRICS

                history = [(int(r["step"]), float(r[f"eval_{rule.metric}"])) for r in self.evaluator.history]
                reason = stop_reason(history, rule.metric, STOP_METRICS[rule.metric], rule.target,
                                     rule.patience) or ""
        if self.dist_info.world_size > 1 and self.spec.eval.stop_when is not None:
            flag = torch.tensor([1 if reason else 0], dtype=torch.int32)
            dist.broadcast(flag, src=0)
            reason = reason or ("stopped by rank 0's eval.stop_when" if flag.item() else "")
        return time.perf_counter() - t0, reason

    def _stop_early(self, done: int, reason: str, metrics: MetricsWriter | None, progress: Progress | None) -> None:
        """eval.stop_when fired: checkpoint, leave a marker (a restart must not train on),
        say why in the metrics file and the log."""
        if done != self.last_saved_step and int(self.spec.checkpoint_every_steps):
            self.save_checkpoint(done, wait=True)
        self.wait_for_writer()
        if self.is_main:
            write_stopped_marker(self.opts.checkpoint_dir, done, reason)
            log.warning("eval.stop_when: stopping at step %d of %d: %s", done, self.total_steps, reason)
            if metrics is not None and progress is not None:
                metrics.write({"type": "stop", "t": now(), "step": done, "steps_total": self.total_steps,
                               "reason": reason})
                progress.say(f"stopped early at step {done}: {reason}")

    def run(self, on_report: Callable[[dict[str, Any]], None] | None = None) -> int:
        """Train from start_step to total_steps; return a TRAIN_EXIT_* code."""
        spec, opts = self.spec, self.opts
        metrics = MetricsWriter(opts.metrics_file) if self.is_main else None
        progress = Progress(spec.name, self.total_steps, self.start_step, opts.tty) if self.is_main else None
        every_metrics = max(1, int(spec.metrics_every_steps))
        every_ckpt = int(spec.checkpoint_every_steps)
        samples_per_step = int(spec.batch_size) * self.dist_info.world_size
        model, optimizer = self.built.model, self.built.optimizer
        if self.evaluator is not None and self.is_main and spec.eval.stop_when is not None:
            self.evaluator.load_history(opts.metrics_file, self.start_step)
        prefetch = Prefetcher(self.source, self.start_step, self.total_steps, int(spec.loader_workers),
                              int(spec.prefetch_batches), self.device)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        loss_sum = torch.zeros((), device=self.device)
        window_steps = 0
        window_t0 = time.perf_counter()
        measured_activations = False
        code = TRAIN_EXIT_OK
        try:
            if self._stop_requested(self.start_step):
                log.warning("%s before the first step; nothing new to save", self.stop.name)
                return TRAIN_EXIT_PREEMPTED
            for step, batch in prefetch:
                optimizer.zero_grad()
                if not measured_activations:
                    counter = [0]
                    with _count_saved_tensors(counter), self._autocast():
                        loss, _ = model(batch)
                    self._activation_bytes = counter[0] + _batch_bytes(batch)
                    measured_activations = True
                else:
                    with self._autocast():
                        loss, _ = model(batch)
                loss.backward()
                optimizer.step()
                loss_sum += loss.detach()
                window_steps += 1
                done = step + 1
                if done % every_metrics == 0 or done == self.total_steps:
                    if cuda:
                        torch.cuda.synchronize(self.device)
                    elapsed = time.perf_counter() - window_t0
                    rss, peak_rss = rss_and_peak_bytes()
                    record: dict[str, Any] = {
                        "t": now(),
                        "step": done,
                        "samples_per_s": window_steps * samples_per_step / elapsed if elapsed > 0 else None,
                        "step_time_s": elapsed / window_steps,
                        "loss": float(loss.item()),
                        "loss_avg": float(loss_sum.item()) / window_steps,
                        "peak_gpu_bytes": int(torch.cuda.max_memory_allocated(self.device)) if cuda else None,
                        "peak_tensor_bytes": None,
                        "rss_bytes": rss,
                        "peak_rss_bytes": peak_rss,
                        "steps_total": self.total_steps,
                        "world_size": self.dist_info.world_size,
                        "device": self.device.type,
                    }
                    self._peak_tensor_bytes = max(self._peak_tensor_bytes, self._tensor_bytes())
                    record["peak_tensor_bytes"] = self._peak_tensor_bytes
                    if self.dist_info.world_size > 1:
                        record.update(self._rank_peaks(record))
                    if metrics is not None and progress is not None:
                        metrics.write(record)
                        progress.report(record)
                    if on_report is not None:
                        on_report(record)
                    loss_sum.zero_()
                    window_steps = 0
                    window_t0 = time.perf_counter()
                if self.evaluator is not None and self.evaluator.due(done):
                    # Nothing of the step is needed any more: its batch, outputs and (backend
                    # torch, one process) gradients are let go before evaluating, not held
                    # beside it (the next step's zero_grad would drop the gradients anyway).
                    del batch, loss, _
                    optimizer.zero_grad()
                    eval_s, stop_why = self._evaluate(done, metrics, progress)
                    window_t0 += eval_s  # not training time
                    if stop_why:
                        self._stop_early(done, stop_why, metrics, progress)
                        break
                if (every_ckpt and done % every_ckpt == 0 or done in self.rung_steps) and done != self.total_steps:
                    self.save_checkpoint(done)  # a sweep's rung too: where a pause may stop it
                if done == self.total_steps:
                    if every_ckpt and opts.final_checkpoint and done != self.last_saved_step:
                        self.save_checkpoint(done)
                    break
                if self._stop_requested(done):
                    if done != self.last_saved_step:
                        self.save_checkpoint(done, wait=True)
                    self.wait_for_writer()
                    log.warning("%s: stopped at step %d with a checkpoint; exit %d",
                                self.stop.name, done, TRAIN_EXIT_PREEMPTED)
                    if progress is not None:
                        progress.say(f"{self.stop.name}: checkpoint at step {done}, exiting")
                    code = TRAIN_EXIT_PREEMPTED
                    break
            self.wait_for_writer()  # run() returns with every checkpoint on disk
        finally:
            if self._writer is not None:
                self._writer.join()
                self._writer = None
            prefetch.close()
            if progress is not None:
                progress.close()
            if metrics is not None:
                metrics.close()
        return code


STOPPED_MARKER = "stopped-early.json"


def sweep_rung_steps(spec: Any, total_steps: int) -> frozenset[int]:
    """The steps where a sweep's stopping rule judges this variant (issue 47): evaluated
    there, and checkpointed there, whatever the spec's own schedules say."""
    if spec.sweep is None or not spec.sweep.min_steps:
        return frozenset()
    from slurm_dlrm.adapt.asha import StopRule, rung_steps

    return frozenset(rung_steps(StopRule(spec.sweep.metric, spec.sweep.min_steps, spec.sweep.reduction,
                                         total_steps)))


def found_step(path: Path) -> int:
    """The step a checkpoint folder's name says (step-000000500 -> 500)."""
    return int(path.name[len(ckpt.PREFIX):])


def write_stopped_marker(checkpoint_dir: Path, step: int, reason: str) -> None:
    import json

    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    tmp = checkpoint_dir / f".{STOPPED_MARKER}.tmp"
    tmp.write_text(json.dumps({"step": step, "reason": reason}))
    os.replace(tmp, checkpoint_dir / STOPPED_MARKER)


def read_stopped_marker(checkpoint_dir: Path) -> dict[str, Any] | None:
    import json

    try:
        data = json.loads((checkpoint_dir / STOPPED_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def total_steps_of(spec: Any, source: BatchSource, override: int | None) -> int:
    if override is not None:
        return override
    if spec.epochs is not None:
        if source.steps_per_epoch is None:
            raise BadInput("epochs needs a data file (synthetic data has no epochs)")
        return int(spec.epochs) * source.steps_per_epoch
    return int(spec.steps)


def _plan_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def quiet_library_logs() -> None:
    """torchrec's planner warns about things that do not concern a training run."""
    for name in ("torchrec", "torch.distributed", "torch.fx", "fbgemm_gpu", "MethodLogger-NullHandler"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    warnings.filterwarnings("ignore", category=UserWarning, module="torchrec")
    warnings.filterwarnings("ignore", category=UserWarning, module="fbgemm_gpu")


def setup(spec: Any, opts: RunOptions, stop: StopFlag) -> Trainer:
    """Distributed group, model, optimizer, data, resume. Raises on failure."""
    from slurm_dlrm.spec import spec_fingerprint

    backend, why = resolve(getattr(spec, "backend", "auto"))
    # torchrec's metrics with torchrec; the same formulas in plain torch where torchrec is
    # not the backend (it may not import there; evaluation.py: identical numbers)
    metrics_backend = "reference" if backend == TORCH else "torchrec"
    if spec.eval.enabled and metrics_backend == "torchrec":
        import_metrics_in_background()
    dist_probe_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(opts.device, dist_probe_rank)
    info = init_distributed(device)
    if info.world_size > 1:
        _label_log_lines(info.rank)
    if info.world_size != int(spec.world_size):
        log.warning("spec asks for world_size %d; this launch has %d processes", spec.world_size, info.world_size)
    torch.manual_seed(int(spec.seed) * 1000 + info.rank)
    log.info("%s", why)  # once per job: other ranks log warnings only
    built = build(backend, spec, device, info.world_size, sharding_local_size(device, info.local_world_size))
    for note in built.notes:
        log.warning("%s", note)
    if info.world_size > 1 and info.rank == 0:
        # the plan torchrec's planner chose for this topology, in the job's log and beside
        # its metrics (issue 48: across nodes it decides what goes over the network)
        text = plan_text(built)
        log.info("sharding plan (world size %d, %d ranks per node):\n%s", info.world_size, info.local_world_size, text)
        with contextlib.suppress(OSError):
            opts.metrics_file.parent.mkdir(parents=True, exist_ok=True)
            (opts.metrics_file.parent / "sharding-plan.txt").write_text(text + "\n")
    source: BatchSource = make_source(spec, info.rank, info.world_size, pin_memory=device.type == "cuda")
    if backend == TORCH:
        from slurm_dlrm.train.backend_torch import HostLengths

        source = HostLengths(source)
    total = total_steps_of(spec, source, opts.steps)
    expect = {
        "world_size": info.world_size,
        "spec_fingerprint": spec_fingerprint(spec),
        "plan_hash": _plan_hash(plan_text(built)),
    }
    repeat = getattr(source, "repeat_every_steps", None)
    if repeat is not None and repeat < total:
        log.info("synthetic data: the features come round again every %d steps; labels are drawn afresh "
                 "at every step, so a repeat cannot be memorised", repeat)
    evaluator = None
    if spec.eval.enabled:
        evaluator = Evaluator(HeldOut(spec, info.rank, info.world_size), int(spec.eval.every_steps), total,
                              world_size=info.world_size, backend=metrics_backend,
                              extra_steps=sweep_rung_steps(spec, total))
    trainer = Trainer(spec=spec, opts=opts, dist_info=info, device=device, built=built, source=source,
                      total_steps=total, stop=stop, expect=expect, evaluator=evaluator)
    trainer.resume()
    return trainer


class _RankPrefix(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.prefix = f"rank {rank}: "

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and not record.msg.startswith(self.prefix):
            record.msg = self.prefix + record.msg
        return True


def _label_log_lines(rank: int) -> None:
    """Several ranks share one log: say whose line it is; only rank 0 tells the story."""
    prefix = _RankPrefix(rank)
    for name in ("runner", "checkpoint", "data", "model", "launch"):  # filters are not inherited
        logging.getLogger(f"slurm_dlrm.train.{name}").addFilter(prefix)
    if rank != 0:
        logging.getLogger("slurm_dlrm.train").setLevel(logging.WARNING)


# What a run left for the process's os._exit (RunOptions.exit_after): never freed here.
_LEFT_FOR_EXIT: list[Any] = []


def teardown(trainer: Trainer | None) -> None:
    """Let go of a run's model, then of the process group it created.

    In that order: DDP's Reducer holds the gloo process group, and pybind11 frees a
    Reducer keeping the GIL. Were the Reducer the group's last owner (the group already
    destroyed), ~ProcessGroupGloo would run inside that dealloc and join gloo's worker
    threads while one of them, destroying its last work (the final barrier, with the
    rank-peak all_gather's tensors), waits for the GIL: a deadlock (pytorch/pytorch#56297;
    issue 48's exit hang, caught with py-spy --native in a 2-rank backend-torch run:
    1 in 3 runs on a loaded 2-core host). Freed first, the Reducer only drops one
    reference; the group object's own destructor lets the GIL go."""
    if trainer is None:
        return
    trainer.evaluator = None
    trainer.built = None  # type: ignore[assignment]  # the run is over: nothing reads it again
    gc.collect()  # the model's reference cycles, now: before the group goes
    if trainer.dist_info.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def exit_code_for(exc: BaseException, device: torch.device | None) -> int:
    if isinstance(exc, BadInput):
        return TRAIN_EXIT_BAD_SPEC
    if isinstance(exc, torch.OutOfMemoryError):
        # torch raises the same type for a failed host allocation ("DefaultCPUAllocator").
        on_host = "CPUAllocator" in str(exc) or device is None or device.type != "cuda"
        return TRAIN_EXIT_OOM_HOST if on_host else TRAIN_EXIT_OOM_GPU
    if isinstance(exc, MemoryError):
        return TRAIN_EXIT_OOM_HOST
    return TRAIN_EXIT_FAILED


def run(spec: Any, opts: RunOptions) -> int:
    """Everything of one rank's run; never raises (but for KeyboardInterrupt outside the
    loop); returns the TRAIN_EXIT_* code."""
    quiet_library_logs()
    fix_malloc_mmap_threshold()  # host RSS follows the live tensors (train/hostmem.py)
    stop = StopFlag()
    stop.install()
    trainer: Trainer | None = None
    device: torch.device | None = None
    try:
        trainer = setup(spec, opts, stop)
        device = trainer.device
        if trainer.start_step >= trainer.total_steps:
            log.info("already done: the checkpoint is at step %d of %d", trainer.start_step, trainer.total_steps)
            return TRAIN_EXIT_OK
        stopped = read_stopped_marker(trainer.opts.checkpoint_dir) if opts.resume else None
        if stopped is not None:
            log.info("already done: eval.stop_when stopped it at step %s: %s", stopped.get("step"), stopped.get("reason"))
            return TRAIN_EXIT_OK
        code = trainer.run()
        if code == TRAIN_EXIT_OK and trainer.dist_info.world_size > 1:
            # every rank past its last collective before any leaves: a rank's exit closes
            # its gloo sockets, and a peer still reading its last collective would fail.
            # The wave-4 exit hang was not the interpreter's teardown but `teardown`'s
            # order (see there): the group destroyed first, DDP's Reducer then freed as the
            # group's last owner, with the GIL held, joining a gloo worker that waits for
            # the GIL. `slurm-dlrm train` now tears nothing down (RunOptions.exit_after):
            # its ranks end in exit_now (os._exit after flushing).
            dist.barrier()
        return code
    except BaseException as exc:  # noqa: BLE001 - every ending becomes an exit code
        if isinstance(exc, SystemExit | KeyboardInterrupt):
            raise
        code = exit_code_for(exc, device)
        if code == TRAIN_EXIT_BAD_SPEC:
            log.error("bad spec: %s", exc)
        elif code in (TRAIN_EXIT_OOM_GPU, TRAIN_EXIT_OOM_HOST):
            log.error("out of %s memory: %s", "GPU" if code == TRAIN_EXIT_OOM_GPU else "host", str(exc)[:500])
        else:
            log.exception("training failed")
        return code
    finally:
        stop.restore()
        if opts.exit_after:
            _LEFT_FOR_EXIT.append(trainer)  # os._exit follows: no dealloc of DDP, no group teardown
        else:
            teardown(trainer)
