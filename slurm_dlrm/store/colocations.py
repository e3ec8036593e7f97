"""Measured co-locations in the store, as the interference model's samples.

One code path for the service's live refit (`Recovery.maybe_refit`) and for
`slurm-dlrm interference eval --store`: an ended pack's agent samples give each member
alone on an uncapped GPU a solo rate, and each shared GPU its members' rates while all
of them were reporting; a member's relative speed is its co-located rate over the
median solo rate of its spec (fingerprint). Profiles are the estimate's, as the policy
sees them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from slurm_dlrm.packing.interference import CoLocationSample, SoloProfile, build_samples

GpuKey = tuple[int, int, int]  # (pack, node index, GPU index)
Member = tuple[int, str, float]  # (job, spec fingerprint, samples/s while all members reported)


@dataclass(frozen=True)
class PackColocations:
    """What one ended pack tells the refit."""

    solo: list[tuple[str, float]]  # (fingerprint, samples/s) of members alone on an uncapped GPU
    groups: list[tuple[GpuKey, list[Member]]]  # shared GPUs and their members' rates


def pack_colocations(conn: Any, pack_id: int) -> PackColocations:
    """Read one pack's solo rates and co-located GPUs from its samples and placements."""
    spans = {int(j): (float(a), float(b), float(s)) for j, a, b, s in conn.execute(
        "SELECT job_id, min(t), max(t), avg(samples_per_s) FROM samples WHERE pack_id = ? "
        "AND job_id IS NOT NULL AND samples_per_s IS NOT NULL GROUP BY job_id", (pack_id,))}
    gpus: dict[GpuKey, list[tuple[int, str]]] = {}
    capped: set[GpuKey] = set()
    for jid, node, gpu, fp, share in conn.execute(
            "SELECT p.job_id, p.node_index, p.gpu_index, j.spec_fingerprint, p.mps_thread_pct "
            "FROM placements p JOIN jobs j ON j.id = p.job_id WHERE p.pack_id = ?", (pack_id,)):
        key = (pack_id, int(node), int(gpu))
        gpus.setdefault(key, []).append((int(jid), str(fp)))
        if share is not None and share < 100:
            capped.add(key)
    solo: list[tuple[str, float]] = []
    groups: list[tuple[GpuKey, list[Member]]] = []
    for key, members in sorted(gpus.items()):
        if any(jid not in spans for jid, _ in members):
            continue
        if len(members) == 1:
            if key not in capped:
                solo.append((members[0][1], spans[members[0][0]][2]))
            continue
        t0 = max(spans[jid][0] for jid, _ in members)
        t1 = min(spans[jid][1] for jid, _ in members)
        if t1 <= t0:
            continue  # never all reporting at once
        ids = [jid for jid, _ in members]
        rates = {int(j): float(r) for j, r in conn.execute(
            f"SELECT job_id, avg(samples_per_s) FROM samples WHERE pack_id = ? AND job_id IN "
            f"({','.join('?' * len(ids))}) AND t BETWEEN ? AND ? AND samples_per_s IS NOT NULL GROUP BY job_id",
            (pack_id, *ids, t0, t1))}
        if len(rates) == len(ids):
            groups.append((key, [(jid, fp, rates[jid]) for jid, fp in members]))
    return PackColocations(solo, groups)


def usable_colocations(by_pack: Mapping[int, PackColocations]) -> tuple[dict[str, float],
                                                                      list[tuple[GpuKey, list[Member]]]]:
    """The median solo rate per fingerprint over these packs, and the shared GPUs
    (in pack order) whose every member's spec has one."""
    solo_by_fp: dict[str, list[float]] = {}
    for pid in sorted(by_pack):
        for fp, sps in by_pack[pid].solo:
            solo_by_fp.setdefault(fp, []).append(sps)
    solo = {fp: statistics.median(v) for fp, v in solo_by_fp.items()}
    usable = [(key, members) for pid in sorted(by_pack) for key, members in by_pack[pid].groups
              if all(fp in solo for _, fp, _ in members)]
    return solo, usable


def colocation_samples(store: Any, solo: Mapping[str, float],
                       usable: Iterable[tuple[GpuKey, list[Member]]]) -> list[tuple[GpuKey, tuple[int, ...],
                                                                                    CoLocationSample]]:
    """One sample per shared GPU, with its job ids in the sample's member order (by id),
    through `build_samples`; a GPU whose solo rate is not positive gives none."""
    out: list[tuple[GpuKey, tuple[int, ...], CoLocationSample]] = []
    for key, members in usable:
        profiles: dict[int, SoloProfile] = {}
        solo_by_job: dict[int, float] = {}
        for jid, fp, _ in members:
            prof = (store.get_job(jid).estimate or {}).get("profile") or {}
            profiles[jid] = SoloProfile(float(prof.get("sm_util_pct") or 0.0), float(prof.get("membw_util_pct") or 0.0))
            solo_by_job[jid] = solo[fp]
        ids = tuple(sorted(profiles))
        out.extend((key, ids, s) for s in build_samples(solo_by_job, profiles, [{jid: rate for jid, _, rate in members}]))
    return out


def store_colocation_samples(store: Any, max_packs: int | None = None) -> list[tuple[GpuKey, tuple[int, ...],
                                                                                  CoLocationSample]]:
    """Every usable co-location of the store's ended packs (the newest `max_packs`)."""
    from slurm_dlrm.store.states import PACK_TERMINAL

    marks = ",".join("?" * len(PACK_TERMINAL))
    limit = "" if max_packs is None else f" LIMIT {int(max_packs)}"
    packs = [int(r[0]) for r in store.conn.execute(
        f"SELECT id FROM packs WHERE state IN ({marks}) ORDER BY id DESC{limit}",
        tuple(sorted(str(x) for x in PACK_TERMINAL)))]
    solo, usable = usable_colocations({pid: pack_colocations(store.conn, pid) for pid in packs})
    return colocation_samples(store, solo, usable)
