"""The memory the recovery's sections share: event kinds, `RecoveryConfig`, and
`RecoveryState`, the base of `Recovery` and of its parts (`service/warm_start.py`,
`service/interference_refit.py`).

Apart so that each part can be its own module, typed against the same attributes,
without importing `service/recovery.py` (which imports them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slurm_dlrm.adapt import PerfModel, Profile
from slurm_dlrm.packing.interference import InterferenceParams
from slurm_dlrm.store.colocations import PackColocations

LEARNED = "learned"  # event kind: a correction learned for a spec fingerprint
MOVE = "move"  # event kind: a member was asked to checkpoint so it can be moved
ADAPT = "adapt"  # event kind: warm start, warm-up update, share tuning


@dataclass(frozen=True)
class RecoveryConfig:
    straggler_ratio: float = 0.7
    straggler_sustained_s: float = 120.0
    warmup_s: float = 60.0  # measured window that replaces the predicted profile
    profile_change_pct: float = 25.0
    min_perf_points: int = 3  # distinct (share, cpus) settings before a perf model is trusted


class RecoveryState:
    """What `Recovery.__init__` sets, and the helpers every section uses: the store,
    the per-round caches (`_fresh`) and the events written once per run (`_once`)."""

    svc: Any
    config: RecoveryConfig
    started_at: float
    announced: set[tuple[str, int, int]]
    _cache_round: int
    _history: dict[str, tuple[tuple[float, float, int], list[Profile]]]
    _site_runs: dict[str, list[Any]]
    _ran_on: dict[int, str | None]
    _learned_events: list[dict[str, Any]] | None
    _perf: dict[str, PerfModel | None]
    _busy: dict[str | None, int]
    _pending: dict[tuple[tuple[str, str], ...], list[Any]] | None
    _repack_checked: dict[tuple[int, int], float]
    _replan: set[tuple[int, int]]
    _refit_key: tuple[tuple[int, int, int], ...]
    _judged: tuple[int, int]
    _colocations: dict[int, PackColocations]
    _learned_at: int
    interference_source: str
    interference_params: InterferenceParams

    def _fresh(self) -> None:
        if self._cache_round != self.svc.rounds:
            self._cache_round = self.svc.rounds
            self._history.clear()
            self._site_runs.clear()
            self._learned_events = None
            self._pending = None
            self._perf.clear()
            self._busy.clear()

    @property
    def store(self) -> Any:
        return self.svc.store

    def _once(self, what: str, job: Any) -> bool:
        key = (what, int(job.id), int(job.attempt))
        if key in self.announced:
            return False
        self.announced.add(key)
        return True
