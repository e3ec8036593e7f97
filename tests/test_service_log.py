"""The service log is rotated by size inside the service (service/servicelog.py)."""

from __future__ import annotations

import logging
import os
import re
import stat
import subprocess
import sys
import textwrap
import time

from slurm_dlrm.service import servicelog
from slurm_dlrm.service.daemon import running_pid, spawn_service, wait_until_running
from slurm_dlrm.service.submit import service_paths
from slurm_dlrm.site import REPO_SITE_FILE, load_site
from slurm_dlrm.store.store import current_user

STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING) ")


def test_rotates_by_size_keeps_n_old_files_owner_only(tmp_path):
    path = tmp_path / "service.log"
    handler = servicelog.ServiceLogHandler(path, max_bytes=2000, backups=2)
    logger = logging.getLogger("test-servicelog")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        for i in range(200):
            logger.info("round %03d: %s", i, "x" * 40)
    finally:
        logger.removeHandler(handler)
        handler.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["service.log", "service.log.1", "service.log.2"]
    for name in files:
        p = tmp_path / name
        assert p.stat().st_size <= 2000
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
        assert all(STAMP.match(line) for line in p.read_text().splitlines())
    assert "round 199" in path.read_text()  # the newest lines are in the current file


_CHILD = textwrap.dedent("""
    import logging, os, sys
    from pathlib import Path
    from slurm_dlrm.service import servicelog
    logging.basicConfig(level=logging.INFO)  # a stderr handler, as the CLI's -v sets up
    servicelog.install(Path(sys.argv[1]), redirect_std=True, max_bytes=1000, backups=2)
    for i in range(60):
        logging.getLogger("svc").info("line %02d %s", i, "y" * 30)
    print("stdout after rotation", flush=True)
    sys.stderr.write("stderr after rotation\\n"); sys.stderr.flush()
    os.write(2, b"fd 2 after rotation\\n")
""")


def test_stdout_and_stderr_follow_the_current_file(tmp_path):
    path = tmp_path / "service.log"
    with open(path, "ab") as out:  # as spawn_service starts the service
        subprocess.run([sys.executable, "-c", _CHILD, str(path)], stdout=out, stderr=out,  # noqa: S603
                       check=True, timeout=60)
    current = path.read_text()
    for text in ("stdout after rotation", "stderr after rotation", "fd 2 after rotation", "line 59"):
        assert text in current
    assert (tmp_path / "service.log.1").exists() and not (tmp_path / "service.log.3").exists()
    assert "after rotation" not in (tmp_path / "service.log.1").read_text()
    # One handler: no line twice (the CLI's stderr handler was removed).
    lines = [x for x in current.splitlines() if "line 59" in x]
    assert len(lines) == 1 and STAMP.match(lines[0])


def test_a_spawned_service_logs_to_its_rotated_file(tmp_path):
    text = REPO_SITE_FILE.read_text().replace('store_dir = "~/.local/share/slurm-dlrm"',
                                              f'store_dir = "{tmp_path}/store-{{user}}"')
    site_file = tmp_path / "site.toml"
    site_file.write_text(text)
    paths = service_paths(load_site(site_file), current_user())
    env = {**os.environ, "SLURM_DLRM_SITE": str(site_file)}
    spawn_service(paths, ["--idle-exit", "0.3", "--round-seconds", "0.2"], env=env)
    assert wait_until_running(paths, timeout_s=30) is not None
    deadline = time.monotonic() + 30
    while running_pid(paths) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running_pid(paths) is None, "the service did not exit when idle"
    lines = paths.log.read_text().splitlines()
    started = [x for x in lines if "packing service for" in x and "round every" in x]
    assert len(started) == 1 and STAMP.match(started[0]), lines
    assert any("nothing to do" in x for x in lines), lines
    assert stat.S_IMODE(paths.log.stat().st_mode) == 0o600
