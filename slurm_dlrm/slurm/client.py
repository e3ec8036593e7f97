"""`SlurmClient`: every Slurm command slurm-dlrm runs goes through here.

argv lists (never a shell), a timeout on every call, machine-readable output only,
and typed errors (`SlurmError` with the command, exit code and stderr). Parsing is in
`slurm_dlrm.slurm.parse` (pure functions tested on recorded output).
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from slurm_dlrm.slurm import parse
from slurm_dlrm.slurm.base import (
    AccountingDisabled,
    AcctRow,
    JobInfo,
    NodeInfo,
    PartitionRow,
    SlurmError,
    SlurmNotFound,
    SlurmTimeout,
)

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0

# sacct fields asked for when the caller names none. Explicit, because the default
# set and its column widths change between Slurm releases.
DEFAULT_SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "Start", "End", "Elapsed",
                        "NodeList", "AllocTRES")

# `--states=all`: from 23.02 `squeue --json` honours squeue's default state filter and
# omits ended jobs (22.05 listed them until MinJobAge, and ignores the flag). A pack
# that ended between two polls must still be seen as ended, not "not found".
SQUEUE_ARGV = ("squeue", "--json", "--states=all")
# `-d` adds GresUsed (allocated GPUs/MPS/shards) to each node record.
NODES_ARGV = ("scontrol", "-d", "-o", "show", "node")


class UnsupportedSlurm(SlurmError):
    """A Slurm release older than 22.05, or one whose version cannot be read."""

    def __init__(self, command: Sequence[str], stdout: str, reason: str) -> None:
        super().__init__(command, 0, "", reason)
        # Not "sinfo failed (exit 0)": sinfo answered, we refuse the release.
        self.args = (f"Slurm release {stdout.strip()[:60]!r}: {reason}",)


# The newest release the parsers are tested on (tests/data/slurm/26.05.*).
MAX_TESTED_RELEASE = (26, 5)


# `sinfo --version` answers per (bin folder, SLURM_CONF, PATH), asked once per process.
_RELEASES: dict[tuple[str, str, str], tuple[int, int, int]] = {}


class SlurmClient:
    """Runs Slurm commands. `slurm_conf` becomes SLURM_CONF in the child environment."""

    def __init__(self, slurm_conf: str | os.PathLike[str] | None = None, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, bin_dir: str | os.PathLike[str] | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.slurm_conf = str(slurm_conf) if slurm_conf is not None else None
        self.timeout_s = timeout_s
        self.bin_dir = Path(bin_dir) if bin_dir is not None else None
        self.extra_env = dict(env or {})
        self._release: tuple[int, int, int] | None = None

    # ------------------------------------------------------------ plumbing

    def child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        if self.slurm_conf is not None:
            env["SLURM_CONF"] = self.slurm_conf
        return env

    def run(self, argv: Sequence[str], *, input_text: str | None = None,
            timeout_s: float | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run one Slurm command; raise `SlurmError` (or a subclass) if it fails."""
        argv = list(argv)
        if self._release is None:
            self.release()  # the first command to Slurm checks the release (once per process)
        if self.bin_dir is not None and "/" not in argv[0]:
            argv[0] = str(self.bin_dir / argv[0])
        timeout = self.timeout_s if timeout_s is None else timeout_s
        log.debug("slurm: %s", argv)
        try:
            proc = subprocess.run(argv, input=input_text, capture_output=True, text=True,  # noqa: S603
                                  timeout=timeout, env=self.child_env(), check=False)
        except FileNotFoundError:
            raise SlurmNotFound(argv) from None
        except subprocess.TimeoutExpired as exc:
            stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            raise SlurmTimeout(argv, timeout, stderr) from None
        if check and proc.returncode != 0:
            raise SlurmError(argv, proc.returncode, proc.stderr)
        return proc

    # ------------------------------------------------------------ jobs

    def sbatch(self, script_text: str, args: Sequence[str] = ()) -> int:
        """Submit a batch script (given as text, on stdin); return the job id."""
        proc = self.run(["sbatch", "--parsable", *args], input_text=script_text)
        return parse.parse_sbatch_parsable(proc.stdout)

    def squeue(self, user: str | None = None, job_ids: Sequence[int] | None = None,
               name: str | None = None) -> list[JobInfo]:
        """Jobs Slurm still knows (pending, running, and ended < MinJobAge ago)."""
        if job_ids is not None and not job_ids:
            return []
        # Slurm 22.05.8 `squeue --json` ignores --jobs/--user/--name and prints every
        # job, so filter here; the flags still go along for newer releases that honour them.
        argv = list(SQUEUE_ARGV)
        if user is not None:
            argv += ["--user", user]
        if name is not None:
            argv += ["--name", name]
        proc = self.run(argv)
        jobs = parse.parse_squeue_json(proc.stdout)
        wanted = {int(j) for j in job_ids} if job_ids is not None else None
        return [j for j in jobs
                if (wanted is None or j.job_id in wanted)
                and (user is None or j.user == user)
                and (name is None or j.name == name)]

    def show_job(self, job_id: int) -> JobInfo | None:
        """`scontrol show job -o`; None once Slurm has forgotten the job (MinJobAge)."""
        rec = self.show_job_raw(job_id)
        return parse.job_from_scontrol(rec) if rec else None

    def show_job_raw(self, job_id: int) -> dict[str, str]:
        """`scontrol show job -o` as Key=value pairs; {} if Slurm does not know the job."""
        argv = ["scontrol", "show", "job", "-o", str(int(job_id))]
        proc = self.run(argv, check=False)
        if proc.returncode != 0:
            if "Invalid job id" in proc.stderr:
                return {}
            raise SlurmError(argv, proc.returncode, proc.stderr)
        records = parse.parse_scontrol_oneliner(proc.stdout)
        return records[0] if records else {}

    def sacct(self, job_ids: Sequence[int], fields: Sequence[str] | None = None) -> list[AcctRow]:
        """Accounting rows of the jobs and all their steps (needs slurmdbd).

        With `--duplicates`, a requeued job has one row per run (same JobID, oldest
        first); take the last. Right after a job ends the rows can lag (slurmctld
        reports to slurmdbd asynchronously): poll rather than read once.
        """
        if not job_ids:
            return []
        cols = list(fields or DEFAULT_SACCT_FIELDS)
        if "JobID" not in cols:
            cols.insert(0, "JobID")
        argv = ["sacct", "--parsable2", "--noheader", "--duplicates",
                "--jobs", ",".join(str(int(j)) for j in job_ids), "--format", ",".join(cols)]
        proc = self.run(argv, check=False)
        if proc.returncode != 0 or "accounting storage is disabled" in proc.stderr.lower():
            if "accounting storage is disabled" in proc.stderr.lower():
                raise AccountingDisabled(argv, proc.returncode, proc.stderr,
                                         "accounting storage is disabled (no slurmdbd; "
                                         "`slurm-dlrm cluster up --accounting`)")
            raise SlurmError(argv, proc.returncode, proc.stderr)
        return parse.parse_sacct_parsable2(proc.stdout, cols)

    def scancel(self, job_ids: Sequence[int], signal: str | None = None, full: bool = False) -> None:
        """Cancel (or, with `signal`, only signal) jobs. `full`: the batch shell too."""
        if not job_ids:
            return
        argv = ["scancel"]
        if signal is not None:
            argv += ["--signal", signal]
        if full:
            argv.append("--full")
        argv += [str(int(j)) for j in job_ids]
        self.run(argv)

    def requeue(self, job_id: int) -> None:
        self.run(["scontrol", "requeue", str(int(job_id))])

    # ------------------------------------------------------------ cluster

    def show_nodes(self) -> list[NodeInfo]:
        # `scontrol show node -o`: the same Key=value text on 22.05 .. 26.05. (scontrol has
        # no --json in 22.05, and 24.11's `sinfo --json` groups nodes instead of listing them.)
        proc = self.run(list(NODES_ARGV))
        return parse.parse_scontrol_nodes(proc.stdout)

    def sinfo(self) -> list[PartitionRow]:
        proc = self.run(["sinfo", "--noheader", "--format", parse.SINFO_FORMAT])
        return parse.parse_sinfo(proc.stdout)

    def ping(self) -> bool:
        """True if the primary slurmctld answers."""
        try:
            proc = self.run(["scontrol", "ping"], check=False, timeout_s=min(self.timeout_s, 10.0))
        except SlurmTimeout:
            return False
        return proc.returncode == 0 and "UP" in proc.stdout

    def version(self) -> str:
        """``YY.MM.P`` of the Slurm commands this client runs, as Slurm spells it (22.05.8)."""
        major, minor, patch = self.release()
        return f"{major}.{minor:02d}.{patch}"

    def release(self) -> tuple[int, int, int]:
        """(major, minor, patch) from `sinfo --version`, asked once per process and
        setting; `UnsupportedSlurm` below 22.05 or when the answer cannot be read.

        Every Slurm call goes through here first, so an unsupported release is one
        line at the first command, before anything is submitted.
        """
        if self._release is not None:
            return self._release
        key = (str(self.bin_dir or ""), self.slurm_conf or os.environ.get("SLURM_CONF", ""),
               os.environ.get("PATH", ""))
        release = _RELEASES.get(key)
        if release is None:
            argv = ["sinfo", "--version"]
            self._release = (0, 0, 0)  # run() must not recurse into this check
            try:
                proc = self.run(argv)
            finally:
                self._release = None
            try:
                release = parse.parse_version(proc.stdout)
            except parse.ParseError:
                raise UnsupportedSlurm(argv, proc.stdout, "`sinfo --version` does not name a release "
                                       "(slurm-dlrm supports Slurm 22.05 to 26.05)") from None
            if release[:2] < parse.MIN_RELEASE:
                raise UnsupportedSlurm(argv, proc.stdout, "older than 22.05, not supported "
                                       "(slurm-dlrm supports Slurm 22.05 to 26.05)")
            if release[:2] > MAX_TESTED_RELEASE:
                log.warning("Slurm %s is newer than the newest release slurm-dlrm is tested on (26.05); "
                            "output it cannot read stops the command with an error", proc.stdout.strip())
            _RELEASES[key] = release
        self._release = release
        return release
