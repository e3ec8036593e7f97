"""The service's half of a sweep's stopping rule (issue 47, docs/sweeps.md): read the
rung evaluations from the store, ask the pure rule (adapt/asha.py), act.

Each round, after the evaluations are ingested and before dispatch:
- every rung result (a variant's held-out eval at one of its rung steps) not yet judged
  is judged: one event `sweep_go_on` or `sweep_pause` per (variant, rung);
- a paused variant that is running is asked to stop through the agent's stop path
  (`<pack_dir>/cancel/<id>`, as `cancel` does: it checkpoints at its next step boundary
  and exits; its neighbours go on); when the agent reports it stopped it goes back to
  PENDING, held there (`held_ids`: dispatch skips it) with the verdict as its reason, so
  its GPU share is refilled in the round that sees it stop;
- a paused variant now within its rung's top (later variants lowered the cut) is
  promoted: event `sweep_promote`, no longer held, it resumes from its checkpoint.

A running variant does not wait at a rung: it evaluates and checkpoints there and goes
on. A pause lands a few steps later (the service's latency); those steps are not lost
(it stops with a checkpoint there and a promotion resumes from it), and training is
deterministic across a stop and resume, so its curve is the same whether it was paused
or not. A result at a later rung counts only once the variant went on (or was promoted)
at the rung before: steps run past a pause judge nothing.

State: which jobs belong to which sweep (read once per job, they never change); the
decisions themselves live in the events table, so a restarted service goes on where it
stopped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_dlrm.adapt.asha import (
    RungResult,
    StopRule,
    Verdict,
    eval_noise_sd,
    judge,
    promotable,
    rung_steps,
)

log = logging.getLogger(__name__)

GO_ON, PAUSE, PROMOTE = "sweep_go_on", "sweep_pause", "sweep_promote"
KINDS = (GO_ON, PAUSE, PROMOTE)
# rule metric -> the evals column holding it
COLUMN = {"auc": "auc", "ne": "ne", "loss": "log_loss"}
PAUSED_REASON = "SweepPaused"  # queue's reason prefix for a held variant


@dataclass(frozen=True)
class Member:
    job_id: int
    sweep: str  # the sweep's id
    rule: StopRule


def sweep_name(sweep_id: str) -> str:
    """The name a user gives a sweep (-J or the spec's): its id without the random tag."""
    return sweep_id.rsplit(".", 1)[0]


def member_of(job_id: int, spec: dict[str, Any] | None) -> Member | None:
    sw = (spec or {}).get("sweep")
    if not isinstance(sw, dict) or not sw.get("id") or not sw.get("min_steps"):
        return None
    try:
        rule = StopRule(str(sw.get("metric") or "auc"), int(sw["min_steps"]), int(sw.get("reduction") or 3),
                        int((spec or {}).get("steps") or 0))
    except (TypeError, ValueError):
        return None
    return Member(job_id, str(sw["id"]), rule)


def pause_reason(v: Verdict, rule: StopRule) -> str:
    """`show`'s words: "auc 0.7121 at step 400 is below rung 1's cut 0.7502 (3 of 9 go on)"."""
    step = rung_steps(rule)[v.rung]
    cut = f"{v.cut:.4f}" if v.cut is not None else "-"
    side = "below" if rule.metric == "auc" else "above"
    noise = f" by more than its eval noise {v.margin:.4f}" if v.margin > 0 else ""
    return (f"{rule.metric} {v.value:.4f} at step {step} is {side} rung {v.rung}'s cut {cut}{noise} "
            f"({v.keep} of {v.reached} go on)")


def verdict_data(v: Verdict, rule: StopRule) -> dict[str, Any]:
    return {"rung": v.rung, "step": rung_steps(rule)[v.rung], "metric": rule.metric, "value": v.value,
            "cut": v.cut, "keep": v.keep, "reached": v.reached, "rank": v.rank, "margin": v.margin}


@dataclass
class SweepState:
    """One sweep's decisions so far, read from the events table."""

    decided: dict[tuple[int, int], str] = field(default_factory=dict)  # (job, rung) -> go_on / pause
    promoted: set[tuple[int, int]] = field(default_factory=set)  # (job, rung)
    last: dict[int, tuple[str, int]] = field(default_factory=dict)  # job -> (kind, rung) of its latest decision


def held_job_ids(store: Any, job_ids: Iterable[int] | None = None) -> set[int]:
    """Jobs whose latest sweep decision is a pause (dispatch must not start them)."""
    where = "job_id IS NOT NULL"
    args: tuple[int, ...] = ()
    if job_ids is not None:
        ids = list(job_ids)
        where, args = f"job_id IN ({','.join('?' * len(ids))})", tuple(ids)
    last: dict[int, str] = {}
    for job_id, kind in store.conn.execute(
            f"SELECT job_id, kind FROM events WHERE kind IN (?, ?, ?) AND {where} ORDER BY id", (*KINDS, *args)):
        last[int(job_id)] = kind
    return {j for j, k in last.items() if k == PAUSE}


def is_paused(store: Any, job: Any) -> bool:
    """A sweep variant held PENDING at a rung (its latest sweep decision is a pause)."""
    return str(job.state) == "PENDING" and job.id in held_job_ids(store, [job.id])


def promote_by_hand(store: Any, job: Any) -> str | None:
    """`requeue ID` of a paused variant: promoted by the user (None: the job is not paused)."""
    if not is_paused(store, job):
        return None
    pauses = store.events(job_id=job.id, kind=PAUSE)
    data = dict(pauses[-1].get("data") or {}) if pauses else {}
    store.add_event(PROMOTE, "promoted by the user (requeue); resumes from its checkpoint", job_id=job.id,
                    data={**data, "by": "user"})
    return f"job {job.id} promoted by hand; it resumes from its checkpoint"


class SweepStop:
    """Judges rung results, pauses and promotes (see the module's doc). One per service."""

    def __init__(self, store: Any, user: str, clock: Any) -> None:
        self.store = store
        self.user = user
        self.clock = clock
        self.members: dict[int, Member] = {}
        self._scanned_id = 0
        self.held: set[int] = set()

    # ------------------------------------------------------------ reading

    def _scan(self) -> None:
        rows = self.store.conn.execute(
            "SELECT j.id, s.spec_json FROM jobs j JOIN job_specs s ON s.job_id = j.id "
            "WHERE j.user = ? AND j.id > ? AND s.spec_json LIKE '%\"sweep\"%' ORDER BY j.id",
            (self.user, self._scanned_id)).fetchall()
        top = self.store.conn.execute("SELECT max(id) FROM jobs").fetchone()[0]
        for job_id, spec_json in rows:
            try:
                m = member_of(int(job_id), json.loads(spec_json))
            except ValueError:
                m = None
            if m is not None:
                self.members[m.job_id] = m
        self._scanned_id = max(self._scanned_id, int(top or 0))

    def _states(self, ids: list[int]) -> dict[int, str]:
        marks = ",".join("?" * len(ids))
        return {int(i): str(s) for i, s in self.store.conn.execute(
            f"SELECT id, state FROM jobs WHERE id IN ({marks})", ids)}

    def _results(self, members: list[Member]) -> list[tuple[int, int, float, float, float]]:
        """(job, rung, value, t, noise_sd) of every eval at a rung step, in arrival order;
        noise_sd is the variant's eval noise from its own evals up to that step (asha.eval_noise_sd)."""
        ids = [m.job_id for m in members]
        rungs_of = {m.job_id: rung_steps(m.rule) for m in members}  # each variant's own rule
        marks = ",".join("?" * len(ids))
        column = COLUMN[members[0].rule.metric]
        out = []
        seen: dict[int, list[tuple[int, float]]] = {}
        for job_id, step, t, value in self.store.conn.execute(
                f"SELECT job_id, step, t, {column} FROM evals WHERE job_id IN ({marks}) ORDER BY t, job_id", ids):
            if value is None:
                continue
            own = seen.setdefault(int(job_id), [])
            own.append((int(step), float(value)))
            steps = rungs_of[int(job_id)]
            if step not in steps:
                continue
            noise = eval_noise_sd([e for e in own if e[0] <= step])
            out.append((int(job_id), steps.index(step), float(value), float(t), noise))
        return out

    def _decisions(self, ids: list[int]) -> SweepState:
        marks = ",".join("?" * len(ids))
        st = SweepState()
        for job_id, kind, data_json in self.store.conn.execute(
                f"SELECT job_id, kind, data_json FROM events WHERE kind IN (?, ?, ?) AND job_id IN ({marks}) "
                "ORDER BY id", (*KINDS, *ids)):
            rung = int((json.loads(data_json) if data_json else {}).get("rung", 0))
            if kind == PROMOTE:
                st.promoted.add((int(job_id), rung))
            else:
                st.decided[(int(job_id), rung)] = kind
            st.last[int(job_id)] = (kind, rung)
        return st

    # ------------------------------------------------------------ the round

    def run(self) -> list[str]:
        """Judge, pause and promote in every sweep with a live variant; what was done."""
        self._scan()
        by_sweep: dict[str, list[Member]] = {}
        for m in self.members.values():
            by_sweep.setdefault(m.sweep, []).append(m)
        done: list[str] = []
        held: set[int] = set()
        for members in by_sweep.values():
            states = self._states([m.job_id for m in members])
            if not any(s in ("PENDING", "PLANNED", "RUNNING") for s in states.values()):
                continue
            done += self._sweep(members, states)
            st = self._decisions([m.job_id for m in members])
            held |= {j for j, (kind, _) in st.last.items() if kind == PAUSE}
        self.held = held
        return done

    def _sweep(self, members: list[Member], states: dict[int, str]) -> list[str]:
        ids = [m.job_id for m in members]
        rule = members[0].rule  # the sweep's metric and reduction; rung steps are each variant's own
        own = {m.job_id: m.rule for m in members}  # (variants with other steps have other rungs)
        st = self._decisions(ids)

        def went_on(job: int, rung: int) -> bool:
            return st.decided.get((job, rung)) == GO_ON or (job, rung) in st.promoted

        # a result counts once its variant went on past the rung before (steps run past a pause judge nothing)
        arrived = [x for x in self._results(members) if x[1] == 0 or went_on(x[0], x[1] - 1)]
        results = [RungResult(str(j), r, rung_steps(own[j])[r], v, n) for j, r, v, _, n in arrived]
        done: list[str] = []
        for job, rung, _value, _t, _noise in arrived:
            if (job, rung) in st.decided:
                continue
            v = judge(rule, results, str(job), rung)
            st.decided[(job, rung)] = GO_ON if v.go_on else PAUSE
            st.last[job] = (st.decided[(job, rung)], rung)
            if v.go_on:
                near = (f", within its eval noise {v.margin:.4f} of the cut {v.cut:.4f}"
                        if v.rank > v.keep and v.cut is not None else "")
                self.store.add_event(GO_ON, f"goes on at rung {rung}: {rule.metric} {v.value:.4f} ranks {v.rank} "
                                     f"of {v.reached} ({v.keep} go on){near}", job_id=job,
                                     data=verdict_data(v, own[job]))
            else:
                done.append(self._pause(job, v, own[job], states.get(job, "")))
        paused = {str(j): r for j, (kind, r) in st.last.items()
                  if kind == PAUSE and states.get(j) == "PENDING"}  # stopped, not cancelled
        for name in promotable(rule, results, paused):
            job, rung = int(name), paused[name]
            v = judge(rule, results, name, rung)
            self.store.add_event(PROMOTE, f"promoted at rung {rung}: later variants lowered the cut to "
                                 f"{v.cut if v.cut is not None else v.value:.4f} ({v.keep} of {v.reached} go on); "
                                 "resumes from its checkpoint", job_id=job, data=verdict_data(v, own[job]))
            st.last[job] = (PROMOTE, rung)
            done.append(f"job {job}: promoted at rung {rung}")
        return done

    def _pause(self, job_id: int, v: Verdict, rule: StopRule, state: str) -> str:
        """Record the pause first (a restart still holds it), then stop a running member."""
        why = pause_reason(v, rule)
        job = self.store.get_job(job_id)
        self.store.add_event(PAUSE, f"paused: {why}", job_id=job_id, pack_id=job.pack_id,
                             data=verdict_data(v, rule))
        if state == "RUNNING" and job.pack_id is not None:
            pack = self.store.get_pack(job.pack_id)
            if pack.pack_dir:
                from slurm_dlrm.service.common import write_atomic
                from slurm_dlrm.service.daemon import ensure_private_dir

                cancel_dir = Path(pack.pack_dir) / "cancel"
                ensure_private_dir(cancel_dir)
                write_atomic(cancel_dir / str(job_id), f"{self.clock()} sweep-pause\n")
        log.info("job %d: paused at rung %d: %s", job_id, v.rung, why)
        return f"job {job_id}: paused at rung {v.rung} ({why})"

    # ------------------------------------------------------------ the agent's report

    def on_member_cancelled(self, job: Any, t: float) -> bool:
        """The agent stopped a member: if the sweep paused it, back to PENDING, held there
        (RUNNING -> PENDING, resumes from its checkpoint once promoted); True then."""
        from slurm_dlrm.store.states import JobState

        if job.state != JobState.RUNNING:
            return False
        # from the events alone: after a restart this report may come before the first run()
        rows = self.store.conn.execute(
            "SELECT id, kind, reason, pack_id FROM events WHERE job_id = ? AND kind IN (?, ?, ?) "
            "ORDER BY id DESC LIMIT 1", (job.id, *KINDS)).fetchall()
        if not rows or rows[0][1] != PAUSE or rows[0][3] != job.pack_id:
            return False
        if self.store.conn.execute(  # the user's own cancel after the pause wins: CANCELLED
                "SELECT 1 FROM events WHERE job_id = ? AND id > ? AND kind = 'note' AND reason LIKE 'cancel requested%'",
                (job.id, rows[0][0])).fetchone():
            return False
        self.store.transition_job(job.id, JobState.PENDING, f"{PAUSED_REASON}: {rows[0][2]}; resumes from its "
                                  "checkpoint if promoted (requeue promotes it by hand)", t=t)
        self.held.add(job.id)
        return True


def sweep_marks(store: Any, job_ids: list[int]) -> dict[int, tuple[str, str]]:
    """What queue shows of sweep variants: job -> (its rung, e.g. "1 on", "0 paused",
    "0 promoted"; the reason of a pause)."""
    if not job_ids:
        return {}
    out: dict[int, tuple[str, str]] = {}
    marks = ",".join("?" * len(job_ids))
    words = {GO_ON: "on", PAUSE: "paused", PROMOTE: "promoted"}
    for job_id, kind, reason, data_json in store.conn.execute(
            f"SELECT job_id, kind, reason, data_json FROM events WHERE kind IN (?, ?, ?) AND job_id IN ({marks}) "
            "ORDER BY id", (*KINDS, *job_ids)):
        rung = (json.loads(data_json) if data_json else {}).get("rung", 0)
        out[int(job_id)] = (f"{rung} {words[kind]}", str(reason))
    return out
