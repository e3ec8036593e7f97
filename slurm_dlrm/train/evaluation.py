"""Model-quality metrics of a held-out evaluation: AUC, NE, log-loss, calibration, accuracy.

Backend-agnostic: `EvalAccumulator.update(predictions, labels)` takes click
probabilities and 0/1 labels from any model; `compute()` returns `EvalResult`.
Two implementations of the same definitions, chosen by name:

- `torchrec`: torchrec.metrics' own functions (`get_ne_states`/`compute_ne`/
  `compute_logloss`, `compute_auc`, `get_calibration_states`/`compute_calibration`,
  `get_accuracy_states`/`compute_accuracy`), the numbers torchrec users know;
- `reference`: the same formulas written in plain torch, for a backend without
  torchrec (tests/test_train_eval.py checks both give identical numbers on the same
  predictions).

Definitions (torchrec.metrics, weights 1):
- AUC: sort by prediction (descending), trapezoid area of cumulative true positives
  over cumulative false positives; 0.5 when one class is absent.
- NE: cross-entropy of the predictions / entropy of the mean label (both clamped to
  [eta, 1-eta], eta 1e-12); < 1 beats predicting the base rate.
- log_loss: mean cross-entropy in nats (torchrec's `compute_logloss` is in bits; x ln 2
  here, so that it reads like the training loss, BCE-with-logits).
- calibration: sum of predictions / sum of labels (1 is calibrated; 0 with no positives).
- accuracy: share of samples with (prediction >= 0.5) == label.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

ETA = 1e-12  # torchrec's NEMetric default
BACKENDS = ("torchrec", "reference")
METRICS = ("auc", "ne", "log_loss", "calibration", "accuracy")


@dataclass(frozen=True)
class EvalResult:
    auc: float
    ne: float
    log_loss: float
    calibration: float
    accuracy: float
    samples: int
    label_mean: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def compute(predictions: torch.Tensor, labels: torch.Tensor, backend: str = "torchrec") -> EvalResult:
    """The five metrics of probabilities `predictions` against 0/1 `labels` (1-D, same length)."""
    preds = predictions.detach().reshape(-1).double().cpu()
    labs = labels.detach().reshape(-1).double().cpu()
    if preds.numel() != labs.numel():
        raise ValueError(f"{preds.numel()} predictions for {labs.numel()} labels")
    if backend == "torchrec":
        values = _torchrec(preds, labs)
    elif backend == "reference":
        values = _reference(preds, labs)
    else:
        raise ValueError(f"unknown metrics backend {backend!r} (one of {', '.join(BACKENDS)})")
    n = int(labs.numel())
    return EvalResult(*values, samples=n, label_mean=float(labs.mean()) if n else 0.0)


def _torchrec(preds: torch.Tensor, labs: torch.Tensor) -> tuple[float, float, float, float, float]:
    from torchrec.metrics.accuracy import compute_accuracy, get_accuracy_states
    from torchrec.metrics.auc import compute_auc
    from torchrec.metrics.calibration import compute_calibration, get_calibration_states
    from torchrec.metrics.ne import compute_logloss, compute_ne, get_ne_states

    # torchrec's metric states are (n_tasks, n_samples): one task here.
    p, y = preds.unsqueeze(0), labs.unsqueeze(0)
    w = torch.ones_like(p)
    ne_s = get_ne_states(y, p.clone(), w, ETA)  # it clamps the predictions in place
    ne = compute_ne(ne_s["cross_entropy_sum"], ne_s["weighted_num_samples"], ne_s["pos_labels"],
                    ne_s["neg_labels"], ETA)
    logloss_bits = compute_logloss(ne_s["cross_entropy_sum"], ne_s["pos_labels"].clone(),
                                   ne_s["neg_labels"], ETA)
    auc = compute_auc(1, [p], [y], [w])
    cal_s = get_calibration_states(y, p, w)
    cal = compute_calibration(cal_s["calibration_num"], cal_s["calibration_denom"])
    acc_s = get_accuracy_states(y, p, w)
    acc = compute_accuracy(acc_s["accuracy_sum"], acc_s["weighted_num_samples"])
    return (float(auc[0]), float(ne[0]), float(logloss_bits[0]) * math.log(2.0), float(cal[0]), float(acc[0]))


def _reference(preds: torch.Tensor, labs: torch.Tensor) -> tuple[float, float, float, float, float]:
    """torchrec.metrics' formulas in plain torch, operation for operation (so the
    floating-point results are the same, not only close)."""
    n = labs.numel()
    p = preds.clamp(min=ETA, max=1 - ETA)
    ce = -labs * torch.log2(p) - (1.0 - labs) * torch.log2(1.0 - p)
    ce_sum = torch.sum(ce)
    pos, neg = torch.sum(labs), torch.sum(1.0 - labs)
    mean_label = (pos / torch.tensor(float(n), dtype=torch.float64).clamp(min=ETA)).clamp(min=ETA, max=1 - ETA)
    ce_norm = -pos * torch.log2(mean_label) - neg * torch.log2(1.0 - mean_label)
    ne = ce_sum / ce_norm
    logloss_bits = ce_sum / (pos + neg).clamp(min=ETA)
    if n:
        order = torch.argsort(preds, descending=True)
        sl = labs[order]
        cum_fp = torch.cumsum(1.0 - sl, dim=0)
        cum_tp = torch.cumsum(sl, dim=0)
        if float(cum_fp[-1] * cum_tp[-1]) == 0.0:
            auc = 0.5
        else:
            auc = float(torch.trapz(cum_tp, cum_fp) / cum_fp[-1] / cum_tp[-1])
    else:
        auc = 0.5
    denom = torch.sum(labs)
    cal = 0.0 if float(denom) <= 0.0 else float(torch.sum(preds) / denom)
    hits = torch.sum(((preds >= 0.5) == labs).double())
    acc = 0.0 if n == 0 else float(hits / torch.tensor(float(n), dtype=torch.float64))
    return (auc, float(ne), float(logloss_bits) * math.log(2.0), cal, acc)


def stop_reason(history: list[tuple[int, float]], metric: str, higher_is_better: bool,
                target: float | None, patience: int | None) -> str | None:
    """eval.stop_when's rule over the evaluations so far ((step, value), in step order):
    stop when the last value reaches `target`, or when none of the last `patience`
    evaluations improved on the best before them. None: go on."""
    if not history:
        return None
    step, value = history[-1]
    if target is not None and (value >= target if higher_is_better else value <= target):
        return f"{metric} {value:.4f} at step {step} reached the target {target:g}"
    if patience is not None and len(history) > patience:
        before = [v for _, v in history[:-patience]]
        best = max(before) if higher_is_better else min(before)
        recent = [v for _, v in history[-patience:]]
        if not any((v > best) if higher_is_better else (v < best) for v in recent):
            return (f"{metric} has not improved on {best:.4f} in {patience} evaluation"
                    f"{'s' if patience != 1 else ''} (last {value:.4f} at step {step})")
    return None


def import_metrics_in_background() -> threading.Thread:
    """Import torchrec.metrics in a thread: it imports torchmetrics (2-4 s of CPU), which
    then overlaps the model's build instead of delaying the first evaluation."""

    def warm() -> None:
        import torchrec.metrics.accuracy
        import torchrec.metrics.auc
        import torchrec.metrics.calibration
        import torchrec.metrics.ne  # noqa: F401

    thread = threading.Thread(target=warm, name="import-torchrec-metrics", daemon=True)
    thread.start()
    return thread


class EvalAccumulator:
    """Predictions and labels of one evaluation, batch by batch (AUC needs them all:
    a few thousand to a few hundred thousand floats)."""

    def __init__(self) -> None:
        self._preds: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []

    def update(self, predictions: torch.Tensor, labels: torch.Tensor) -> None:
        self._preds.append(predictions.detach().reshape(-1).float().cpu())
        self._labels.append(labels.detach().reshape(-1).float().cpu())

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._preds:
            return torch.zeros(0), torch.zeros(0)
        return torch.cat(self._preds), torch.cat(self._labels)

    def compute(self, backend: str = "torchrec") -> EvalResult:
        preds, labels = self.tensors()
        return compute(preds, labels, backend)


def eval_record(step: int, result: EvalResult, *, t: float, eval_s: float, batches: int,
                planted_auc: float | None = None) -> dict[str, object]:
    """One metrics-file line (`"type": "eval"`), the names acct and the store read."""
    rec: dict[str, object] = {"type": "eval", "t": t, "step": step}
    rec.update({f"eval_{k}": v for k, v in result.as_dict().items()})
    rec["eval_batches"] = batches
    rec["eval_s"] = eval_s
    if planted_auc is not None:
        rec["planted_auc"] = planted_auc
    return rec


Predict = Callable[[Any], tuple[torch.Tensor, torch.Tensor]]


class HeldOutSet(Protocol):
    """What the Evaluator reads (slurm_dlrm/train/heldout.py `HeldOut`): how many held-out
    batches this rank has, and batch k with the planted model's P(click) of its samples
    (None for real data)."""

    count: int
    samples: int | None  # eval.samples: the samples of all `count` batches (the last may be shorter)

    def batch(self, k: int) -> tuple[Any, torch.Tensor | None]: ...


class Evaluator:
    """The runner's held-out evaluation: the same `held.count` batches (this rank's share
    of the held-out set) every `every_steps` steps and at the last step.

    Backend-agnostic: `run(predict, step)` only needs `predict(batch) -> (probabilities,
    labels)`. Every rank evaluates its batches (a sharded model's forward is
    collective); rank 0 gathers all predictions and computes the metrics on the whole
    set. Nothing here touches the torch RNG or the training batches, so evaluating
    never changes the training run.

    Memory (issue 51): one held-out batch at a time is made, predicted and dropped; the
    predictions, labels and planted P(click) go straight into one preallocated
    3 x samples float32 buffer (no per-batch list, no concatenation, no stack), and
    rank 0 alone receives the other ranks' buffers (`gather`, not `all_gather`).
    slurm_dlrm/estimate/timeline_eval.py replays exactly this."""

    def __init__(self, held: HeldOutSet, every_steps: int, total_steps: int, *, world_size: int = 1,
                 backend: str = "torchrec", extra_steps: Iterable[int] = ()) -> None:
        self.held = held
        self.every_steps = every_steps
        self.extra_steps = frozenset(extra_steps)  # a sweep's rung steps (issue 47): evaluated as well
        self.total_steps = total_steps
        self.world_size = world_size
        self.backend = backend
        self.planted_auc: float | None = None
        self.total_s = 0.0  # wall time spent evaluating, for the overhead figure
        self.history: list[dict[str, Any]] = []  # this job's evaluation records (rank 0)
        self._planted_given = False

    def load_history(self, metrics_file: Any, upto_step: int) -> None:
        """A resumed run's earlier evaluations (steps <= `upto_step`) from its metrics file,
        so that eval.stop_when's patience counts across restarts."""
        import json

        seen: dict[int, dict[str, Any]] = {}
        try:
            with open(metrics_file, "rb") as f:
                for line in f:
                    try:
                        r = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(r, dict) and r.get("type") == "eval" and isinstance(r.get("step"), int) \
                            and r["step"] <= upto_step:
                        seen[r["step"]] = r
        except OSError:
            return
        self.history = [seen[k] for k in sorted(seen)]

    def due(self, done: int) -> bool:
        return done == self.total_steps or (self.every_steps > 0 and done % self.every_steps == 0) \
            or done in self.extra_steps

    def _predict_one(self, predict: Predict, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Batch k made, predicted, and let go when this returns (only its outputs stay)."""
        batch, planted = self.held.batch(k)
        probs, labels = predict(batch)
        return probs, labels, planted

    def predictions(self, predict: Predict) -> torch.Tensor:
        """3 x samples float32 on the host: this rank's predictions, labels and planted
        P(click) (NaN for real data), batch after batch."""
        rows: torch.Tensor | None = None
        filled = 0
        self._planted_given = False
        with torch.no_grad():
            for k in range(self.held.count):
                probs, labels, planted = self._predict_one(predict, k)
                n = probs.numel()
                if rows is None:  # every held-out batch has the first one's size (eval.samples: the last
                    # may be shorter, and `samples` says how many in all)
                    rows = torch.empty(3, getattr(self.held, "samples", None) or n * self.held.count)
                    if planted is None:
                        rows[2].fill_(float("nan"))
                rows[0, filled : filled + n].copy_(probs.reshape(-1))
                rows[1, filled : filled + n].copy_(labels.reshape(-1))
                if planted is not None:
                    rows[2, filled : filled + n].copy_(planted.reshape(-1))
                    self._planted_given = True
                filled += n
                del probs, labels, planted
        return rows[:, :filled] if rows is not None else torch.zeros(3, 0)

    def run(self, predict: Predict, step: int, t: float) -> dict[str, object] | None:
        """Evaluate; the metrics-file record on rank 0, None on the other ranks."""
        t0 = time.perf_counter()
        local = self.predictions(predict)
        if self.world_size > 1:
            import torch.distributed as dist

            # rank 0 alone receives, into one ranks x 3 x samples buffer (rank-major, as a
            # concatenation would order them)
            gathered = torch.empty(self.world_size, *local.shape) if dist.get_rank() == 0 else None
            dist.gather(local, gather_list=list(gathered.unbind(0)) if gathered is not None else None, dst=0)
            del local
            if gathered is None:
                self.total_s += time.perf_counter() - t0
                return None
            local = gathered.transpose(0, 1)  # 3 x ranks x samples, a view
        result = compute(local[0], local[1], self.backend)
        if self.planted_auc is None and self._planted_given:
            self.planted_auc = compute(local[2], local[1], self.backend).auc
        eval_s = time.perf_counter() - t0
        self.total_s += eval_s
        record = eval_record(step, result, t=t, eval_s=eval_s, batches=self.held.count * self.world_size,
                             planted_auc=self.planted_auc)
        self.history = [r for r in self.history if r["step"] != step] + [record]
        return record
