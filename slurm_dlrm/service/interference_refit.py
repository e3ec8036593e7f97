"""The interference model the policy plans with, refitted from this site's measured
co-locations (docs/recovery.md "Interference model refit"): the analytic constants
(`maybe_refit`), the learned model (`maybe_refit_learned`), the choice between the
naive rule, the neighbour model and the analytic one (issue 37), and which model a
(re)started service plans with (`_initial_params`, `learned_model_path`).

Apart from `service/recovery.py` because it concerns the planner's model, not any one
job: a newcomer asking "which interference model plans, and why" looks here.
`InterferenceRefit` is one of `Recovery`'s bases (it shares `RecoveryState`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from slurm_dlrm.packing.interference import (
    DEFAULT_PARAMS,
    InterferenceParams,
    prediction_error,
    refit_interference,
)
from slurm_dlrm.service.recovery_state import ADAPT, RecoveryState
from slurm_dlrm.store.colocations import (
    colocation_samples,
    pack_colocations,
    usable_colocations,
)

log = logging.getLogger("slurm_dlrm.service.recovery")  # the recovery's log, as before the split

LEARNED_MODEL_FILE = "interference_model.json"  # in the store folder, mode 0600
REFIT_PACKS = 200  # the most recent ended packs whose co-locations feed the interference refit


class InterferenceRefit(RecoveryState):
    """The interference refit of `Recovery`."""

    # ------------------------------------------------------------ interference refit

    def learned_model_path(self) -> Path:
        """Where the service keeps the model it learnt (its own store folder)."""
        return Path(self.store.path).parent / LEARNED_MODEL_FILE

    def _initial_params(self) -> InterferenceParams:
        """The service's own learned model if it adopted one, else the site's
        `adapt.interference_model`, else the last analytic refit (else the defaults). A
        file that cannot be used is logged (and an event says why); planning goes on
        with the next in that order."""
        from slurm_dlrm.errors import BadInput
        from slurm_dlrm.store.model_file import load_model

        analytic = self._last_refit_params()
        candidates = [(self.learned_model_path(), "learned by this service")]
        site_file = self.svc.site.adapt.interference_model
        if site_file:
            candidates.append((Path(site_file).expanduser(), "site adapt.interference_model"))
        for path, what in candidates:
            if not path.exists():
                if what.startswith("site"):
                    log.warning("interference model %s (%s) does not exist; planning with the analytic model", path, what)
                continue
            try:
                model = load_model(path)
            except BadInput as exc:
                log.warning("interference model not used: %s; planning with the analytic model", exc)
                self.store.add_event(ADAPT, f"interference model not used: {exc}", data={"model_file": str(path)})
                continue
            self.interference_source = f"learned, {path} ({what})"
            return InterferenceParams(analytic.sm_contention, analytic.membw_contention, analytic.per_client_overhead,
                                      speed_model=model)
        chosen = self._last_planner_choice(analytic)
        if chosen is not None:
            self.interference_source = f"{chosen.model_name}, chosen on this site's co-locations (issue 37)"
            return chosen
        if analytic != DEFAULT_PARAMS:
            self.interference_source = "analytic, refitted"
        return analytic

    def _last_refit_params(self) -> InterferenceParams:
        """The parameters of the last refit (events survive a restart), else the defaults."""
        import json

        row = self.store.conn.execute(
            "SELECT data_json FROM events WHERE kind = ? AND data_json LIKE '%\"interference\"%' "
            "ORDER BY id DESC LIMIT 1", (ADAPT,)).fetchone()
        try:
            p = json.loads(row[0])["interference"] if row else None
            return InterferenceParams(float(p["sm_contention"]), float(p["membw_contention"]),
                                      float(p["per_client_overhead"])) if p else DEFAULT_PARAMS
        except (ValueError, KeyError, TypeError):
            return DEFAULT_PARAMS

    def maybe_refit(self) -> bool:
        """Every `adapt.refit_every_rounds` rounds: refit the interference model from the
        measured co-locations of the newest ended packs (each member's mean samples/s while
        all of its GPU's members were reporting, over the median solo rate of its spec
        from packs where it ran alone on a GPU without an MPS cap). Adopted when it lowers
        the mean error on those samples; an event records the parameters and both errors.
        True if refitted."""
        from slurm_dlrm.store.states import PACK_TERMINAL

        cfg = self.svc.site.adapt
        if self.svc.rounds % cfg.refit_every_rounds:
            return False
        # The newest ended packs by id: their samples are complete, so what each holds is
        # read once and kept (a scan of samples, the store's largest table, every time would not be cheap).
        marks = ",".join("?" * len(PACK_TERMINAL))
        packs = [int(r[0]) for r in self.store.conn.execute(
            f"SELECT id FROM packs WHERE state IN ({marks}) ORDER BY id DESC LIMIT ?",
            (*sorted(str(x) for x in PACK_TERMINAL), REFIT_PACKS))]
        for pid in packs:
            if pid not in self._colocations:
                self._colocations[pid] = pack_colocations(self.store.conn, pid)
        for pid in set(self._colocations) - set(packs):
            del self._colocations[pid]
        solo, usable = usable_colocations(self._colocations)
        used = tuple(gpu_key for gpu_key, _ in usable)
        if len(usable) < cfg.refit_min_samples or used == self._refit_key:
            return False
        self._refit_key = used
        samples = [s for _, _, s in colocation_samples(self.store, solo, usable)]
        refitted = self._refit_analytic(samples)
        learned = self.maybe_refit_learned(samples)
        chosen = self._choose_planner_model(samples)
        return refitted or learned or chosen

    def _choose_planner_model(self, samples: list[Any]) -> bool:
        """Issue 37: a model plans only if it beats the naive rule clearly on this site's own
        co-locations, held out (`packing.pairwise.choose_planner_model`: the analytic
        constants, the neighbour model, the naive rule); where none does, the naive rule
        plans and an event says so. A learned model in use keeps its own check
        (`maybe_refit_learned`). True if the model that plans changed."""
        from slurm_dlrm.packing.pairwise import NeighbourModel, choose_planner_model

        current = self.interference_params
        if current.model_name == "learned":
            return False
        try:
            choice = choose_planner_model(samples, current.analytic())
        except (ValueError, FloatingPointError) as exc:
            log.warning("choosing the interference model on %d co-located GPU(s) failed: %s; model kept",
                        len(samples), exc)
            return False
        model = choice.params.speed_model
        if choice.name == "analytic":
            if current.speed_model is None:
                return False
            self.interference_params = current.analytic()
        elif model == current.speed_model:
            return False
        else:
            a = current.analytic()
            self.interference_params = replace(a, speed_model=model)
        self.interference_source = f"{choice.name}, chosen on {len(samples)} co-located GPU(s) ({choice.how})"
        data: dict[str, Any] = {"planner_model": choice.name, "held_out_mae": choice.held_out_mae, "how": choice.how}
        if isinstance(model, NeighbourModel):
            data["neighbour"] = {"scale": model.scale, "power": model.power}
        self.store.add_event(ADAPT, f"interference: {choice.reason}", data=data)
        log.info("interference: %s", choice.reason)
        return True

    def _last_planner_choice(self, analytic: InterferenceParams) -> InterferenceParams | None:
        """The naive rule or the neighbour model if the last choice made one plan (events
        survive a restart)."""
        import json

        from slurm_dlrm.packing.pairwise import NaiveModel, NeighbourModel

        row = self.store.conn.execute(
            "SELECT data_json FROM events WHERE kind = ? AND data_json LIKE '%\"planner_model\"%' "
            "ORDER BY id DESC LIMIT 1", (ADAPT,)).fetchone()
        try:
            d = json.loads(row[0]) if row else None
            if d is None or d["planner_model"] == "analytic":
                return None
            if d["planner_model"] == "naive":
                return replace(analytic, speed_model=NaiveModel())
            n = d["neighbour"]
            return replace(analytic, speed_model=NeighbourModel(float(n["scale"]), float(n["power"])))
        except (ValueError, KeyError, TypeError):
            return None

    def _refit_analytic(self, samples: list[Any]) -> bool:
        """Refit the constants (the formula's, or the learned model's prior) on `samples`;
        adopted when they lower the mean error there. An event either way."""
        current = self.interference_params
        analytic = current.analytic()
        before = prediction_error(samples, analytic)
        try:
            fitted = refit_interference(samples, start=analytic)
        except (ValueError, FloatingPointError) as exc:  # e.g. a non-finite rate in the samples
            log.warning("interference refit on %d co-located GPU(s) failed: %s; model kept", len(samples), exc)
            return False
        after = prediction_error(samples, fitted)
        names = ("alpha", "beta", "gamma")
        change = ", ".join(f"{n} {a:.3f} -> {b:.3f}" for n, a, b in zip(names, analytic.as_tuple(), fitted.as_tuple(),
                                                                       strict=True))
        data: dict[str, Any] = {"samples": len(samples), "error_before": before, "error_after": after}
        if after < before:
            # A learned model keeps planning; the refitted constants become its prior's.
            self.interference_params = replace(fitted, speed_model=current.speed_model)
            data["interference"] = {"sm_contention": fitted.sm_contention, "membw_contention": fitted.membw_contention,
                                    "per_client_overhead": fitted.per_client_overhead}
            self.store.add_event(ADAPT, f"interference model refit from {len(samples)} co-located GPU(s): {change}; "
                                 f"mean error of the relative speed {before:.3f} -> {after:.3f}", data=data)
            log.info("interference model refit: %s", change)
            return True
        self.store.add_event(ADAPT, f"interference model kept: a refit on {len(samples)} co-located GPU(s) "
                             f"does not lower its mean error ({before:.3f} -> {after:.3f})", data=data)
        return False

    def maybe_refit_learned(self, samples: list[Any]) -> bool:
        """Every `adapt.learned_refit_every_groups` new co-located GPUs: fit the learned
        model on the same samples and plan with it only if its cross-validated error
        (leave-jobs-out when there are enough jobs) is below the analytic model's on
        them. An event records both figures either way. True if it switched."""
        import time

        from slurm_dlrm.packing.interference_eval import learned_cross_validation
        from slurm_dlrm.packing.learned import fit_learned
        from slurm_dlrm.store.model_file import save_model

        cfg = self.svc.site.adapt
        n = len(samples)
        if not cfg.learned_refit_every_groups or n < cfg.learned_min_groups:
            return False
        if self._learned_at and n - self._learned_at < cfg.learned_refit_every_groups:
            return False
        self._learned_at = n
        prior = self.interference_params.analytic()
        t0 = time.perf_counter()
        try:
            cv = learned_cross_validation(samples, prior, folds=min(5, n))
            model = fit_learned(samples, prior, info={"cv": cv, "fitted_from": f"store {self.store.path}"})
        except (ValueError, FloatingPointError, RuntimeError) as exc:
            log.warning("learned interference fit on %d co-located GPU(s) failed: %s; model kept", n, exc)
            return False
        learned, analytic = cv["learned_jobs_out_mae"], cv["analytic_mae"]
        how = "leave-jobs-out" if cv["jobs_out"] else "leave-groups-out"
        data = {"samples": n, "learned_cv_mae": learned, "analytic_mae": analytic, "cv": how,
                "fit_s": round(time.perf_counter() - t0, 2)}
        if learned < analytic:
            try:
                save_model(model, self.learned_model_path())
            except OSError as exc:
                log.warning("learned interference model not saved (%s); it plans until the service restarts", exc)
            self.interference_params = InterferenceParams(prior.sm_contention, prior.membw_contention,
                                                          prior.per_client_overhead, speed_model=model)
            self.interference_source = f"learned, {self.learned_model_path()} (learned by this service)"
            self.store.add_event(ADAPT, f"interference: the learned model plans: on {n} co-located GPU(s) its "
                                 f"{how} error {learned:.3f} beats the analytic model's {analytic:.3f}", data=data)
            return True
        self.store.add_event(ADAPT, f"interference: the learned model does not plan: on {n} co-located GPU(s) its "
                             f"{how} error {learned:.3f} does not beat the analytic model's {analytic:.3f}", data=data)
        return False
