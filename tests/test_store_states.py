"""Job and pack state machines: every legal edge works and logs, every illegal one is refused."""

from __future__ import annotations

import itertools

import pytest

from slurm_dlrm.store import (
    JOB_TERMINAL,
    JOB_TRANSITIONS,
    PACK_TERMINAL,
    PACK_TRANSITIONS,
    IllegalTransition,
    JobState,
    NewPlacement,
    PackState,
    StaleState,
    Store,
    StoreError,
    UnknownEntity,
)

J, P = JobState, PackState


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "s" / "store.sqlite", clock=Clock())
    yield s
    s.close()


def new_job(store: Store, name: str = "j") -> int:
    return store.add_job(user="alice", name=name, spec={"name": name}, spec_fingerprint="fp",
                         estimate={"gpu_peak_bytes": 1 << 30, "host_peak_bytes": 2 << 30})


def new_pack(store: Store, *job_ids: int, name: str | None = None) -> int:
    return store.add_pack(name=name or f"pack-{store.clock()}", user="alice", policy="complementary", n_gpus=1,
                          placements=[NewPlacement(j, 0, 0, mps_thread_pct=50) for j in job_ids])


# Shortest way to put a job in each state, through legal edges only.
def job_in(store: Store, state: JobState) -> int:
    j = new_job(store)
    if state == J.PENDING:
        return j
    if state in (J.CANCELLED, J.FAILED):
        store.transition_job(j, state, "setup")
        return j
    new_pack(store, j)
    if state == J.PLANNED:
        return j
    store.transition_job(j, J.RUNNING, "setup")
    if state != J.RUNNING:
        store.transition_job(j, state, "setup")
    return j


def pack_in(store: Store, state: PackState) -> int:
    p = new_pack(store)
    path = {
        P.SUBMITTING: [], P.QUEUED: [P.QUEUED], P.RUNNING: [P.QUEUED, P.RUNNING],
        P.COMPLETED: [P.QUEUED, P.RUNNING, P.COMPLETED], P.FAILED: [P.FAILED],
        P.CANCELLED: [P.QUEUED, P.CANCELLED], P.LOST: [P.QUEUED, P.LOST],
    }[state]
    for s in path:
        store.transition_pack(p, s, "setup")
    return p


def test_tables_are_consistent():
    # Terminal states have no way out, except the documented requeues (OOM by the
    # service; CANCELLED, FAILED and TIMEOUT by the user's `slurm-dlrm requeue`).
    for (src, dst) in JOB_TRANSITIONS:
        if src in JOB_TERMINAL:
            assert (src, dst) in {(J.OOM, J.PENDING), (J.CANCELLED, J.PENDING), (J.FAILED, J.PENDING),
                                  (J.TIMEOUT, J.PENDING)}
    assert not any(src in PACK_TERMINAL for src, _ in PACK_TRANSITIONS)
    # Every state is reachable from the initial one.
    for table, start, states in ((JOB_TRANSITIONS, J.PENDING, J), (PACK_TRANSITIONS, P.SUBMITTING, P)):
        seen, todo = {start}, [start]
        while todo:
            s = todo.pop()
            for (a, b) in table:
                if a == s and b not in seen:
                    seen.add(b)
                    todo.append(b)
        assert seen == set(states)
    # Cancel from every non-terminal job state.
    for s in set(J) - JOB_TERMINAL:
        assert (s, J.CANCELLED) in JOB_TRANSITIONS or s == J.CANCELLED


@pytest.mark.parametrize("src,dst", sorted(JOB_TRANSITIONS, key=str))
def test_every_legal_job_edge_is_taken_and_logged(store, src, dst):
    j = job_in(store, src)
    assert store.get_job(j).state == src
    n_events = len(store.events(job_id=j))
    kw = {"pack_id": new_pack(store)} if dst == J.PLANNED else {}
    job = store.transition_job(j, dst, f"because {src}->{dst}", **kw)
    assert job.state == dst == store.get_job(j).state
    events = store.events(job_id=j)
    assert len(events) == n_events + 1
    last = events[-1]
    assert (last["kind"], last["from_state"], last["to_state"]) == ("job_state", src.value, dst.value)
    assert last["reason"] == f"because {src}->{dst}"


@pytest.mark.parametrize("src,dst", [(a, b) for a, b in itertools.product(J, J) if (a, b) not in JOB_TRANSITIONS])
def test_every_illegal_job_edge_is_refused_without_side_effects(store, src, dst):
    j = job_in(store, src)
    before = store.get_job(j)
    n_events = len(store.events(job_id=j))
    with pytest.raises(IllegalTransition) as err:
        store.transition_job(j, dst, "nope", pack_id=new_pack(store))
    assert (err.value.src, err.value.dst) == (src.value, dst.value)
    assert store.get_job(j) == before
    assert len(store.events(job_id=j)) == n_events


@pytest.mark.parametrize("src,dst", sorted(PACK_TRANSITIONS, key=str))
def test_every_legal_pack_edge(store, src, dst):
    p = pack_in(store, src)
    pack = store.transition_pack(p, dst, "why", slurm_job_id="42")
    assert pack.state == dst == store.get_pack(p).state
    assert store.get_pack(p).slurm_job_id == "42"
    ev = store.events(pack_id=p)[-1]
    assert (ev["from_state"], ev["to_state"], ev["reason"]) == (src.value, dst.value, "why")
    if dst in PACK_TERMINAL:
        assert store.get_pack(p).end_time is not None


@pytest.mark.parametrize("src,dst", [(a, b) for a, b in itertools.product(P, P) if (a, b) not in PACK_TRANSITIONS])
def test_every_illegal_pack_edge_is_refused(store, src, dst):
    p = pack_in(store, src)
    before = store.get_pack(p)
    with pytest.raises(IllegalTransition):
        store.transition_pack(p, dst, "nope")
    assert store.get_pack(p) == before


def test_requeue_counts_attempts_and_keeps_history(store):
    j = new_job(store)
    p1 = new_pack(store, j)
    store.transition_job(j, J.RUNNING, "started")
    first_start = store.get_job(j).start_time
    store.transition_job(j, J.OOM, "CUDA OOM", exit_code=3)
    assert store.get_job(j).end_time is not None
    store.transition_job(j, J.PENDING, "retry with +20% memory", gpu_mem_request_bytes=3 << 30)
    job = store.get_job(j)
    assert (job.attempt, job.end_time, job.exit_code, job.gpu_mem_request_bytes) == (1, None, None, 3 << 30)
    # A pack that never started does not count as an attempt.
    p2 = new_pack(store, j)
    store.transition_job(j, J.PENDING, "sbatch refused")
    assert store.get_job(j).attempt == 1
    p3 = new_pack(store, j)
    store.transition_job(j, J.RUNNING, "started again")
    store.transition_job(j, J.PENDING, "node failure")
    assert store.get_job(j).attempt == 2
    assert store.get_job(j).start_time == first_start
    pl = {p.pack_id: p for p in store.placements(job_id=j)}
    assert pl[p1].start_time is not None and pl[p1].end_time is not None
    assert pl[p2].start_time is None and pl[p3].end_time is not None
    assert [e["to_state"] for e in store.events(job_id=j)] == [
        "PENDING", "PLANNED", "RUNNING", "OOM", "PENDING", "PLANNED", "PENDING", "PLANNED", "RUNNING", "PENDING"]


def test_add_pack_is_atomic(store):
    a, b = new_job(store, "a"), new_job(store, "b")
    store.transition_job(b, J.CANCELLED, "user")
    with pytest.raises(IllegalTransition):
        new_pack(store, a, b, name="bad")
    assert store.find_pack_by_name("bad") is None
    assert store.get_job(a).state == J.PENDING
    assert store.placements(job_id=a) == []


def test_find_submitting_pack_by_name_and_reconcile(store):
    j = new_job(store)
    p = new_pack(store, j, name="dlrm-alice-7f3a")
    found = store.find_pack_by_name("dlrm-alice-7f3a")
    assert found is not None and found.id == p and found.state == P.SUBMITTING
    assert [x.id for x in store.packs([P.SUBMITTING])] == [p]
    store.transition_pack(p, P.QUEUED, "found in squeue after restart", slurm_job_id="1234", nodes="node[1-2]")
    pack = store.get_pack(p)
    assert (pack.slurm_job_id, pack.nodes, pack.state) == ("1234", "node[1-2]", P.QUEUED)
    assert store.placements(pack_id=p)[0].node == "node1"
    with pytest.raises(StoreError):
        new_pack(store, name="dlrm-alice-7f3a")


def test_expect_is_compare_and_set(store):
    j = job_in(store, J.RUNNING)
    with pytest.raises(StaleState):
        store.transition_job(j, J.COMPLETED, "done", expect=J.PLANNED)
    store.transition_job(j, J.COMPLETED, "done", expect=J.RUNNING, exit_code=0)
    assert store.get_job(j).exit_code == 0


def test_unknown_ids(store):
    with pytest.raises(UnknownEntity):
        store.transition_job(999, J.CANCELLED, "x")
    with pytest.raises(UnknownEntity):
        store.get_pack(999)


def test_nested_write_rolls_back_together(store):
    j = new_job(store)
    with pytest.raises(RuntimeError):
        with store.write():
            store.transition_job(j, J.CANCELLED, "user")
            raise RuntimeError("crash before commit")
    assert store.get_job(j).state == J.PENDING
    assert [e["to_state"] for e in store.events(job_id=j)] == ["PENDING"]


def test_docs_list_exactly_the_edges_of_the_code():
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "store.md").read_text()

    def edges(section: str) -> set[tuple[str, str]]:
        body = doc.split(f"### {section}\n", 1)[1].split("\n#", 1)[0]
        out = set()
        for line in body.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 3 and cells[0].isupper() and cells[1].isupper():
                out.add((cells[0], cells[1]))
        return out

    assert edges("Jobs") == {(a.value, b.value) for a, b in JOB_TRANSITIONS}
    assert edges("Packs") == {(a.value, b.value) for a, b in PACK_TRANSITIONS}


def test_a_transition_dated_by_slurm_is_not_before_the_one_before_it(store):
    """Slurm's times are whole seconds, cut down: a --no-pack job PLANNED at x.46 that
    Slurm says started at x.0 had its RUNNING event dated before its PLANNED one (issue 49,
    chaos_live: events out of order). Each is dated at least at the one before it; a
    later Slurm time is kept as it is."""
    j = store.add_job(user="alice", name="np", spec={"name": "np"}, spec_fingerprint="fp", mode="no-pack")
    planned = store.transition_job(j, J.PLANNED, "submitted to Slurm as job 16", slurm_job_id="16")
    running = store.transition_job(j, J.RUNNING, "Slurm job 16 started", t=planned.updated_time - 0.46)
    assert running.start_time == running.updated_time == planned.updated_time
    done = store.transition_job(j, J.COMPLETED, "exited 0", t=planned.updated_time + 7.0)
    assert done.end_time == planned.updated_time + 7.0
    times = [e["t"] for e in store.events(job_id=j, kind="job_state")]
    assert times == sorted(times)
    p = new_pack(store, new_job(store))
    queued = store.transition_pack(p, P.QUEUED, "sbatch", slurm_job_id="17")
    ended = store.transition_pack(p, P.FAILED, "Slurm: FAILED", t=queued.updated_time - 0.9)
    assert ended.end_time == queued.updated_time
    times = [e["t"] for e in store.events(pack_id=p, kind="pack_state")]
    assert times == sorted(times)
