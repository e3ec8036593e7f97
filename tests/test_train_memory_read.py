"""The runner's memory readings (train/metrics.py rss_and_peak_bytes): one read of
/proc/self/status through a kept-open descriptor (issue 47), still this process's own
after a fork. No torch."""

from __future__ import annotations

import os
import sys

import pytest

from slurm_dlrm.train.metrics import peak_rss_bytes, rss_and_peak_bytes, rss_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_one_read_gives_what_the_two_readings_give():
    rss, peak = rss_and_peak_bytes()
    assert abs(rss - rss_bytes()) < 32 << 20 and abs(peak - peak_rss_bytes()) < 32 << 20
    assert peak >= rss > 1 << 20


def test_a_forked_child_reads_its_own_memory_not_its_parents():
    rss_and_peak_bytes()  # the parent's descriptor is open now
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: 256 MiB of its own, touched, read before and after
        try:
            before = rss_and_peak_bytes()[0]
            block = bytearray(256 << 20)
            block[:: 4096] = b"\x01" * len(block[:: 4096])
            os.write(w, f"{before} {rss_and_peak_bytes()[0]}".encode())
        finally:
            os._exit(0)
    os.close(w)
    before, after = (int(v) for v in os.read(r, 64).decode().split())
    os.close(r)
    os.waitpid(pid, 0)
    # Read through the parent's descriptor, the child would see the parent's figure both
    # times. (Not "child > parent": a fork child starts without the parent's file-backed
    # pages, which are hundreds of MiB in a process that imported torch.)
    assert after > before + (200 << 20)
