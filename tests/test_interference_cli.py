"""The interference model's validation tools: memory keys, sample files, `slurm-dlrm interference`."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from slurm_dlrm.packing import SoloProfile, interference_model, predict_colocated_speeds
from slurm_dlrm.packing.interference import _profile_of

GIB = 1 << 30
MIB = 1 << 20


# ---------------------------------------------------------------- memory in any unit

@pytest.mark.parametrize("mem", [{"gpu_mem_bytes": 8 * GIB}, {"gpu_mem_mib": 8192}, {"gpu_mem_gib": 8},
                                 {"gpu_mem_gib": "8"}, {"gpu_mem_bytes": 8.0 * GIB}])
def test_profile_memory_from_any_unit_as_key(mem):
    assert _profile_of({"sm_util_pct": 30, "membw_util_pct": 10, **mem}) == SoloProfile(30, 10, 8 * GIB)


def test_profile_memory_from_any_unit_as_attribute():
    @dataclass
    class InMib:
        sm_util_pct: float
        membw_util_pct: float
        gpu_mem_mib: float

    @dataclass
    class InGib:
        sm_util_pct: float
        membw_util_pct: float
        gpu_mem_gib: float

    assert _profile_of(InMib(30, 10, 1536)).gpu_mem_bytes == 1536 * MIB
    assert _profile_of(InGib(30, 10, 1.5)).gpu_mem_bytes == 1536 * MIB
    # bytes win over the other units; no memory at all is 0
    assert _profile_of({"sm_util_pct": 1, "membw_util_pct": 1, "gpu_mem_bytes": 5, "gpu_mem_gib": 9}).gpu_mem_bytes == 5
    assert _profile_of({"sm_util_pct": 1, "membw_util_pct": 1, "gpu_mem_bytes": None, "gpu_mem_gib": 1}).gpu_mem_bytes == GIB
    assert _profile_of({"sm_util_pct": 1, "membw_util_pct": 1}).gpu_mem_bytes == 0


def test_memory_in_gib_decides_the_fit_like_bytes():
    members = [{"sm_util_pct": 20, "membw_util_pct": 30, "gpu_mem_gib": 50},
               {"sm_util_pct": 40, "membw_util_pct": 10, "gpu_mem_mib": 40 * 1024}]
    assert interference_model(members, gpu_memory_bytes=80 * GIB) == [0.0, 0.0]
    fits = predict_colocated_speeds(members, gpu_memory_bytes=96 * GIB)
    assert fits == predict_colocated_speeds([SoloProfile(20, 30), SoloProfile(40, 10)])
    assert 0 < min(fits) < 1
