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
    parent_rss, _ = rss_and_peak_bytes()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: 256 MiB of its own, touched
        try:
            block = bytearray(256 << 20)
            block[:: 4096] = b"\x01" * len(block[:: 4096])
            os.write(w, str(rss_and_peak_bytes()[0]).encode())
        finally:
            os._exit(0)
    os.close(w)
    child_rss = int(os.read(r, 64).decode())
    os.close(r)
    os.waitpid(pid, 0)
    assert child_rss > parent_rss + (200 << 20)
    assert rss_and_peak_bytes()[0] < child_rss - (200 << 20)
