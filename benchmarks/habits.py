"""A Slurm user's habits, side by side (issue 42): the same invocations against Slurm's own
sbatch/squeue/sacct/scancel and against slurm-dlrm's submit/queue/acct/cancel, on the
local cluster, compared on what they accept and print (ids, states, exit codes).

Each row of `TABLE` is one habit: the Slurm argv, ours, and how to compare them.
`same`: both accept (exit 0) or both refuse (exit != 0), and print the same lines once
ids are named by what they are (`A`, `ARR_1`, a new id `<id>`) and sacct's `CANCELLED by
N` is read as CANCELLED. `accepts`: both accept, outputs not compared (tables whose
columns differ by design). `refused`: ours refuses in one line `slurm-dlrm: error: ...`
saying what to do instead, where Slurm accepts (a resource option slurm-dlrm sizes
itself, a signal to one member). Anything else counts in `differs`.

The Slurm side submits held jobs (`sbatch -H`), ours records jobs without a service
(`submit --no-service`): both stay PENDING, nothing runs. Every Slurm job made here is
cancelled at the end. Names carry a per-run tag (Slurm's accounting remembers runs).

    python benchmarks/habits.py            # the local cluster of this checkout (root)

Last line: `habits: invocations=N same_as_slurm=S refused_with_reason=R differs=D`.
tests/test_habits_live.py runs a subset in CI.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _shared import probe_spec  # noqa: E402 - benchmarks/ is on sys.path (this script's folder)


@dataclass(frozen=True)
class Habit:
    what: str
    slurm: tuple[str, ...]  # argv; {A} {ARR} {C} {D1}.. {TAG} {USER} {SCRIPT:...} filled per side
    ours: tuple[str, ...]
    mode: str = "same"  # same | accepts | refused
    ci: bool = False  # also in tests/test_habits_live.py's subset
    sort: bool = False  # compare the lines as a set (Slurm's order is its priority's)


def h(what: str, slurm: str, ours: str, mode: str = "same", ci: bool = False, sort: bool = False) -> Habit:
    return Habit(what, tuple(shlex.split(slurm)), tuple(shlex.split(ours)), mode, ci, sort)


Q = "queue --no-slurm"  # ours, not asking Slurm for pack reasons (there are no packs)
TABLE: tuple[Habit, ...] = (
    # ---------------------------------------------------------------- squeue
    h("ids of my jobs", "squeue -h -r -o %i -n {A_NAME},{ARR_NAME}", f"{Q} -h -r -o %i -n {{A_NAME}},{{ARR_NAME}}",
      ci=True, sort=True),
    h("ids and state codes", "squeue -h -r -o '%i %t' -n {A_NAME},{ARR_NAME} --sort=i",
      f"{Q} -h -r -o '%i %t' -n {{A_NAME}},{{ARR_NAME}} --sort=i", ci=True),
    h("ids and state names", "squeue -h -r -o '%i %T' -n {A_NAME} ", f"{Q} -h -r -o '%i %T' -n {{A_NAME}}"),
    h("-j one job", "squeue -h -o %i -j {A}", f"{Q} -h -o %i -j {{A}}", ci=True),
    h("-j an array task N_M", "squeue -h -r -o %i -j {ARR}_1", f"{Q} -h -r -o %i -j {{ARR}}_1", ci=True),
    h("-j an array's id: all its tasks", "squeue -h -r -o %i -j {ARR} --sort=i", f"{Q} -h -r -o %i -j {{ARR}} --sort=i",
      ci=True),
    h("-j a list", "squeue -h -r -o %i -j {ARR}_2,{A} --sort=i", f"{Q} -h -r -o %i -j {{ARR}}_2,{{A}} --sort=i"),
    h("-j an ended job: nothing", "squeue -h -o %i -j {C}", f"{Q} -h -o %i -j {{C}}", ci=True),
    h("-j an unknown id", "squeue -h -o %i -j 999999", f"{Q} -h -o %i -j 999999", ci=True),
    h("-t PD", "squeue -h -r -t PD -o %i -n {A_NAME},{ARR_NAME} --sort=i",
      f"{Q} -h -r -t PD -o %i -n {{A_NAME}},{{ARR_NAME}} --sort=i"),
    h("-t PENDING", "squeue -h -r -t PENDING -o %i -n {A_NAME} ", f"{Q} -h -r -t PENDING -o %i -n {{A_NAME}}"),
    h("-t pd (any case)", "squeue -h -r -t pd -o %i -n {A_NAME}", f"{Q} -h -r -t pd -o %i -n {{A_NAME}}"),
    h("-t R: nothing running", "squeue -h -t R -o %i -n {A_NAME}", f"{Q} -h -t R -o %i -n {{A_NAME}}"),
    h("-t CG: nothing completing", "squeue -h -t CG -o %i -n {A_NAME}", f"{Q} -h -t CG -o %i -n {{A_NAME}}", ci=True),
    h("-t PD,R", "squeue -h -r -t PD,R -o %i -n {A_NAME}", f"{Q} -h -r -t PD,R -o %i -n {{A_NAME}}"),
    h("-t all", "squeue -h -r -t all -o %i -n {A_NAME}", f"{Q} -h -r -t all -o %i -n {{A_NAME}}", ci=True),
    h("--states=all", "squeue -h -r --states=all -o %i -n {A_NAME}", f"{Q} -h -r --states=all -o %i -n {{A_NAME}}"),
    h("-t a bad state", "squeue -h -t bogus", f"{Q} -h -t bogus", ci=True),
    h("--name", "squeue -h -r --name={A_NAME} -o '%i %j'", f"{Q} -h -r --name={{A_NAME}} -o '%i %j'"),
    h("-u me", "squeue -h -r -u {USER} -n {A_NAME} -o %i", f"{Q} -h -r -u {{USER}} -n {{A_NAME}} -o %i"),
    h("--me", "squeue -h -r --me -n {A_NAME} -o %i", f"{Q} -h -r --me -n {{A_NAME}} -o %i"),
    h("-p the partition", "squeue -h -r -p dlrm -n {A_NAME} -o '%i %P'", f"{Q} -h -r -p dlrm -n {{A_NAME}} -o '%i %P'"),
    h("--noheader", "squeue --noheader -r -o %i -n {A_NAME}", f"{Q} --noheader -r -o %i -n {{A_NAME}}"),
    h("widths and alignment", "squeue -h -r -o '%.10i|%.9P|%12j|%.2t' -n {ARR_NAME} --sort=i",
      f"{Q} -h -r -o '%.10i|%.9P|%12j|%.2t' -n {{ARR_NAME}} --sort=i", ci=True),
    h("--sort=-i", "squeue -h -r -o %i -n {ARR_NAME} --sort=-i", f"{Q} -h -r -o %i -n {{ARR_NAME}} --sort=-i"),
    h("%F array job id", "squeue -h -r -o '%i %F' -j {ARR}_1", f"{Q} -h -r -o '%i %F' -j {{ARR}}_1"),
    h("%K array task id", "squeue -h -r -o '%i task=%K' -j {ARR}_2", f"{Q} -h -r -o '%i task=%K' -j {{ARR}}_2"),
    h("%j name", "squeue -h -r -o '%j' -j {A}", f"{Q} -h -r -o '%j' -j {{A}}"),
    h("%M time of a pending job", "squeue -h -o '%i %M' -j {A}", f"{Q} -h -o '%i %M' -j {{A}}"),
    h("%l time limit", "squeue -h -o '%i %l' -j {T}", f"{Q} -h -o '%i %l' -j {{T}}"),
    h("-l long", "squeue -l -j {A}", f"{Q} -l -j {{A}}", mode="accepts"),
    h("the header", "squeue -o '%i %j %t' -j {A}", f"{Q} -o '%i %j %t' -j {{A}}"),
    # ---------------------------------------------------------------- sacct
    h("-j JobID,State", "sacct -X -n -P -j {A} -o JobID,State", "acct -X -n -P -j {A} -o JobID,State", ci=True),
    h("JobName", "sacct -X -n -P -j {A} -o JobID,JobName", "acct -X -n -P -j {A} -o JobID,JobName", ci=True),
    h("Partition", "sacct -X -n -P -j {A} -o JobID,Partition", "acct -X -n -P -j {A} -o JobID,Partition"),
    h("JobIDRaw", "sacct -X -n -P -j {A} -o JobIDRaw,State", "acct -X -n -P -j {A} -o JobIDRaw,State"),
    h("ExitCode of a pending job", "sacct -X -n -P -j {A} -o JobID,ExitCode", "acct -X -n -P -j {A} -o JobID,ExitCode"),
    h("--brief", "sacct -X -n -P -b -j {A}", "acct -X -n -P -b -j {A}", ci=True),
    h("a cancelled job", "sacct -X -n -P -j {C} -o JobID,State", "acct -X -n -P -j {C} -o JobID,State", ci=True),
    h("-j a list", "sacct -X -n -P -j {A},{C} -o JobID,State", "acct -X -n -P -j {A},{C} -o JobID,State"),
    h("-s CA", "sacct -X -n -P -s CA -j {A},{C} -o JobID", "acct -X -n -P -s CA -j {A},{C} -o JobID"),
    # sacct lists a job that never became eligible (held) only when asked for by id
    h("--name", "sacct -X -n -P --name={A_NAME} -j {A},{C} -o JobID,State",
      "acct -X -n -P --name={A_NAME} -j {A},{C} -o JobID,State"),
    h("-u me", "sacct -X -n -P -u {USER} -j {A} -o JobID", "acct -X -n -P -u {USER} -j {A} -o JobID"),
    h("-S now-1hours", "sacct -X -n -P -S now-1hours -j {A} -o JobID", "acct -X -n -P -S now-1hours -j {A} -o JobID"),
    h("--starttime today", "sacct -X -n -P --starttime today -j {A} -o JobID",
      "acct -X -n -P --starttime today -j {A} -o JobID"),
    h("--parsable2", "sacct -X -n --parsable2 -j {A} -o JobID,State", "acct -X -n --parsable2 -j {A} -o JobID,State"),
    h("the header", "sacct -X -P -j {A} -o JobID,State", "acct -X -P -j {A} -o JobID,State"),
    h("an unknown id", "sacct -X -n -P -j 999999 -o JobID", "acct -X -n -P -j 999999 -o JobID", ci=True),
    h("a bad column", "sacct -o NoSuchColumn", "acct -o NoSuchColumn"),
    h("--helpformat", "sacct --helpformat", "acct --helpformat", mode="accepts"),
    # ---------------------------------------------------------------- sbatch
    h("--parsable prints the id", "sbatch -H --parsable -J {TAG}-s1 {SCRIPT}", "submit --no-service --parsable -J {TAG}-s1 {SPEC}",
      ci=True),
    h("--parsable --array: one id", "sbatch -H --parsable --array=0-1 -J {TAG}-s2 {SCRIPT}",
      "submit --no-service --parsable --array=0-1 -J {TAG}-s2 {SPEC}", ci=True),
    h("--array with %N", "sbatch -H --parsable --array=0-3%2 -J {TAG}-s3 {SCRIPT}",
      "submit --no-service --parsable --array=0-3%2 -J {TAG}-s3 {SPEC}"),
    h("#SBATCH --array in the script", "sbatch -H --parsable -J {TAG}-s4 {ARRAY_SCRIPT}",
      "submit --no-service --parsable -J {TAG}-s4 {ARRAY_SPEC}"),
    h("-p a partition that does not exist", "sbatch -H --parsable -p nosuchpart {SCRIPT}",
      "submit --parsable -p nosuchpart {SPEC}", ci=True),
    # Slurm 22.05 takes it (the job waits forever, DependencyNeverSatisfied); ours knows every job
    # of yours and refuses at once, exit 1, as the issue asks
    h("-d afterok on an unknown job", "sbatch -H --parsable -d afterok:999999 -J {TAG}-r0 {SCRIPT}",
      "submit --no-service --parsable -d afterok:999999 {SPEC}", mode="refused", ci=True),
    h("-d afterok on a job", "sbatch -H --parsable -d afterok:{A} -J {TAG}-s5 {SCRIPT}",
      "submit --no-service --parsable -d afterok:{A} -J {TAG}-s5 {SPEC}"),
    h("-d afterok on an array", "sbatch -H --parsable -d afterok:{ARR} -J {TAG}-s6 {SCRIPT}",
      "submit --no-service --parsable -d afterok:{ARR} -J {TAG}-s6 {SPEC}"),
    h("-d singleton", "sbatch -H --parsable -d singleton -J {TAG}-s7 {SCRIPT}",
      "submit --no-service --parsable -d singleton -J {TAG}-s7 {SPEC}"),
    h("-t 2", "sbatch -H --parsable -t 2 -J {TAG}-s8 {SCRIPT}", "submit --no-service --parsable -t 2 -J {TAG}-s8 {SPEC}"),
    h("-t a bad time", "sbatch -H --parsable -t 1:2:3:4:5 {SCRIPT}", "submit --no-service --parsable -t 1:2:3:4:5 {SPEC}"),
    h("--nice=10", "sbatch -H --parsable --nice=10 -J {TAG}-s9 {SCRIPT}",
      "submit --no-service --parsable --nice=10 -J {TAG}-s9 {SPEC}"),
    h("--begin=now+1hour", "sbatch -H --parsable --begin=now+1hour -J {TAG}-s10 {SCRIPT}",
      "submit --no-service --parsable --begin=now+1hour -J {TAG}-s10 {SPEC}"),
    h("-D --chdir", "sbatch -H --parsable -D /tmp -J {TAG}-s11 {SCRIPT}",
      "submit --no-service --parsable -D /tmp -J {TAG}-s11 {SPEC}"),
    h("-o with %j", "sbatch -H --parsable -o /tmp/{TAG}-%j.out -J {TAG}-s12 {SCRIPT}",
      "submit --no-service --parsable -o /tmp/{TAG}-%j.out -J {TAG}-s12 {SPEC}"),
    h("--export=ALL", "sbatch -H --parsable --export=ALL -J {TAG}-s13 {SCRIPT}",
      "submit --no-service --parsable --export=ALL -J {TAG}-s13 {SPEC}"),
    h("--test-only", "sbatch --test-only -p dlrm {SCRIPT}", "submit --test-only -p dlrm {SPEC}", mode="accepts"),
    h("--test-only, a bad partition", "sbatch --test-only -p nosuchpart {SCRIPT}", "submit --test-only -p nosuchpart {SPEC}"),
    h("--mem (sized by us)", "sbatch -H --parsable --mem=1G -J {TAG}-r1 {SCRIPT}",
      "submit --no-service --parsable --mem=1G {SPEC}", mode="refused"),
    h("--gres (sized by us)", "sbatch -H --parsable --gres=gpu:1 -J {TAG}-r2 {SCRIPT}",
      "submit --no-service --parsable --gres=gpu:1 {SPEC}", mode="refused"),
    h("--export=NONE", "sbatch -H --parsable --export=NONE -J {TAG}-r3 {SCRIPT}",
      "submit --no-service --parsable --export=NONE {SPEC}", mode="refused"),
    # ---------------------------------------------------------------- scancel (last: they change the jobs)
    h("an unknown id", "scancel 999999", "cancel 999999", ci=True),
    h("a bad id form", "scancel 2__0", "cancel 2__0"),
    # scancel --signal to a held job waits for it to start (a minute here): not run on Slurm's side
    h("--signal to a job", "true", "cancel --signal=USR1 {A}", mode="refused"),
    h("one job", "scancel {D1}", "cancel {D1}", ci=True),
    h("...is CANCELLED", "sacct -X -n -P -j {D1} -o JobID,State", "acct -X -n -P -j {D1} -o JobID,State", ci=True),
    h("an array task", "scancel {ARR}_2", "cancel {ARR}_2", ci=True),
    h("...the others stay", "squeue -h -r -o %i -j {ARR} --sort=i", f"{Q} -h -r -o %i -j {{ARR}} --sort=i", ci=True),
    h("-n NAME", "scancel -n {D2_NAME}", "cancel -n {D2_NAME}"),
    h("...is gone from the queue", "squeue -h -o %i -n {D2_NAME}", f"{Q} -h -o %i -n {{D2_NAME}}"),
    h("-t PD -n NAME", "scancel -t PD -n {D3_NAME}", "cancel -t PD -n {D3_NAME}"),
    h("...is gone from the queue", "squeue -h -o %i -n {D3_NAME}", f"{Q} -h -o %i -n {{D3_NAME}}"),
    h("the whole array by its id", "scancel {ARR}", "cancel {ARR}"),
    h("...nothing left of it", "squeue -h -r -o %i -j {ARR}", f"{Q} -h -r -o %i -j {{ARR}}"),
)


@dataclass
class Side:
    """One side's ids and files: `ids` name -> job id as that side prints it."""

    ids: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)

    def fill(self, argv: Sequence[str], common: dict[str, str]) -> list[str]:
        values = {**common, **self.ids, **self.files}
        return [re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), a) for a in argv]

    def normalise(self, text: str, tag: str) -> list[str]:
        """Lines with ids named (A, ARR_1, ...), a new id as <id>, `CANCELLED by N` as CANCELLED."""
        by_id = {v: k for k, v in self.ids.items() if not k.endswith("_NAME")}
        out = []
        for line in text.splitlines():
            line = re.sub(r"CANCELLED by \d+", "CANCELLED", line.rstrip())
            line = re.sub(r"(?<![\w:.%=-])(\d+)(?=_\d|_\[|[\s|,)]|$)", lambda m: by_id.get(m.group(1), m.group(1)), line)
            line = re.sub(r"^\d+$", "<id>", line)  # sbatch --parsable: a new job's id
            # padding follows the ids' lengths, which differ between the sides
            out.append(re.sub(r" +", " ", line.replace(tag, "TAG")).strip())
        return out


@dataclass
class Result:
    habit: Habit
    slurm_rc: int
    ours_rc: int
    slurm_out: list[str]
    ours_out: list[str]
    ours_err: str
    verdict: str  # same | refused | differs


def run_slurm(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)  # noqa: S603
    return p.returncode, p.stdout, p.stderr


def run_ours(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """In this process (CliRunner), as the command line would run it."""
    from click.testing import CliRunner

    from slurm_dlrm.cli import cli

    r = CliRunner().invoke(cli, argv, env=env)
    return r.exit_code, r.stdout, r.stderr


def judge(habit: Habit, s: tuple[int, list[str]], o: tuple[int, list[str], str]) -> str:
    s_rc, s_out = s
    o_rc, o_out, o_err = o
    if habit.mode == "refused":
        one_line = o_err.count("\n") == 1 and o_err.startswith("slurm-dlrm: error: ")
        return "refused" if o_rc != 0 and one_line else "differs"
    if (s_rc == 0) != (o_rc == 0):
        return "differs"
    if habit.mode == "accepts" or s_rc != 0:
        if s_rc != 0 and not (o_err.startswith("slurm-dlrm: error: ") and o_err.count("\n") == 1):
            return "differs"  # a refusal is one line
        return "same"
    a, b = (sorted(s_out), sorted(o_out)) if habit.sort else (s_out, o_out)
    return "same" if a == b else "differs"


class World:
    """The jobs both sides start from, and the environments to run each side in."""

    def __init__(self, slurm_conf: str, work: Path) -> None:
        self.tag = f"hab{uuid.uuid4().hex[:6]}"
        self.work = work
        self.slurm_env = {**os.environ, "SLURM_CONF": slurm_conf}
        site = (REPO / "site-config" / "site.toml").read_text()
        site = site.replace('store_dir = "~/.local/share/slurm-dlrm"', f'store_dir = "{work}/store-{{user}}"')
        site = site.replace('spool_dir = "~/.local/share/slurm-dlrm/spool"', f'spool_dir = "{work}/spool-{{user}}"')
        (work / "site.toml").write_text(site)
        self.ours_env = {"SLURM_CONF": slurm_conf, "SLURM_DLRM_SITE": str(work / "site.toml")}
        self.slurm = Side()
        self.ours = Side()
        self.user = _user()
        self.slurm_made: list[str] = []
        script = work / "job.sh"
        script.write_text("#!/bin/bash\ntrue\n")
        array_script = work / "array.sh"
        array_script.write_text("#!/bin/bash\n#SBATCH --array=0-1\ntrue\n")
        spec = work / "job.yaml"
        spec.write_text(probe_spec(f"{self.tag}-spec"))
        array_spec = work / "array.yaml"
        array_spec.write_text("#SBATCH --array=0-1\n" + probe_spec(f"{self.tag}-spec"))
        self.slurm.files = {"SCRIPT": str(script), "ARRAY_SCRIPT": str(array_script)}
        self.ours.files = {"SPEC": str(spec), "ARRAY_SPEC": str(array_spec)}

    def common(self) -> dict[str, str]:
        return {"TAG": self.tag, "USER": self.user,
                **{f"{k}_NAME": f"{self.tag}-{k.lower()}" for k in ("A", "ARR", "C", "D1", "D2", "D3", "T")}}

    def make(self) -> None:
        """A, an array ARR (tasks 0-2), C (cancelled), T (-t 2), D1-D3 (to cancel): each side."""
        extra = {"ARR": ["--array=0-2"], "T": ["-t", "2"]}
        for key in ("A", "ARR", "C", "D1", "D2", "D3", "T"):
            name = f"{self.tag}-{key.lower()}"
            rc, out, err = run_slurm(["sbatch", "-H", "--parsable", "-J", name, *extra.get(key, []),
                                      self.slurm.files["SCRIPT"]], self.slurm_env)
            if rc != 0:
                raise RuntimeError(f"sbatch: {err.strip()}")
            self.slurm.ids[key] = out.strip().split(";")[0]
            self.slurm_made.append(self.slurm.ids[key])
            rc, out, err = run_ours(["submit", "--no-service", "--parsable", "-J", name, *extra.get(key, []),
                                     self.ours.files["SPEC"]], self.ours_env)
            if rc != 0:
                raise RuntimeError(f"submit: {err.strip()}")
            self.ours.ids[key] = out.strip()
        run_slurm(["scancel", self.slurm.ids["C"]], self.slurm_env)
        run_ours(["cancel", self.ours.ids["C"]], self.ours_env)

    def wait_for_accounting(self, timeout_s: float = 20.0) -> None:
        """slurmdbd records new jobs a moment after sbatch answers; sacct asks it."""
        deadline = time.monotonic() + timeout_s
        want = {self.slurm.ids[k] for k in ("A", "C", "D1")}
        while time.monotonic() < deadline:
            rc, out, _ = run_slurm(["sacct", "-X", "-n", "-P", "-o", "JobID", "-j", ",".join(sorted(want))],
                                   self.slurm_env)
            if rc == 0 and want <= set(out.split()):
                return
            time.sleep(0.3)

    def run(self, habit: Habit) -> Result:
        common = self.common()
        s_argv = self.slurm.fill(habit.slurm, common)
        o_argv = self.ours.fill(habit.ours, common)
        s_rc, s_out, _s_err = run_slurm(s_argv, self.slurm_env)
        if s_rc == 0 and s_argv[0] == "sbatch" and "--parsable" in s_argv:
            self.slurm_made.append(s_out.strip().split(";")[0])
        o_rc, o_out, o_err = run_ours(o_argv, self.ours_env)
        s_lines = self.slurm.normalise(s_out, self.tag)
        o_lines = self.ours.normalise(o_out, self.tag)
        verdict = judge(habit, (s_rc, s_lines), (o_rc, o_lines, o_err))
        return Result(habit, s_rc, o_rc, s_lines, o_lines, o_err, verdict)

    def clean(self) -> None:
        if self.slurm_made:
            run_slurm(["scancel", *self.slurm_made], self.slurm_env)


def _user() -> str:
    from slurm_dlrm.store.store import current_user

    return current_user()


def run_table(slurm_conf: str, habits: Sequence[Habit] = TABLE,
              report: Callable[[Result], Any] | None = None) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="habits-") as tmp:
        world = World(slurm_conf, Path(tmp))
        try:
            world.make()
            world.wait_for_accounting()
            results = []
            for habit in habits:
                res = world.run(habit)
                results.append(res)
                if report is not None:
                    report(res)
            return results
        finally:
            world.clean()


def summary(results: Sequence[Result]) -> str:
    same = sum(r.verdict == "same" for r in results)
    refused = sum(r.verdict == "refused" for r in results)
    differs = sum(r.verdict == "differs" for r in results)
    return f"habits: invocations={len(results)} same_as_slurm={same} refused_with_reason={refused} differs={differs}"


def main() -> int:
    from slurm_dlrm.localcluster import LocalCluster, default_state_dir

    cluster = LocalCluster.at(default_state_dir())
    if cluster is None or not cluster.status(query_nodes=False).up:
        print("habits: the local cluster of this checkout is not up (slurm-dlrm cluster up)", file=sys.stderr)
        return 1
    if not cluster.config.accounting:
        print("habits: the local cluster runs without accounting, so sacct cannot answer "
              "(slurm-dlrm cluster down; slurm-dlrm cluster up --accounting)", file=sys.stderr)
        return 1
    conf = str(cluster.config.slurm_conf)
    t0 = time.perf_counter()

    def show(r: Result) -> None:
        mark = {"same": "=", "refused": "R", "differs": "X"}[r.verdict]
        print(f"{mark} {r.habit.what:<40} slurm rc={r.slurm_rc:<2} ours rc={r.ours_rc:<2}  "
              f"{' '.join(r.habit.slurm[:1])} | {' '.join(r.habit.ours[:1])}")
        if r.verdict == "differs":
            print(f"    slurm: {r.slurm_out}\n    ours:  {r.ours_out} {r.ours_err.strip()!r}")

    results = run_table(conf, TABLE, show)
    print(f"wall {time.perf_counter() - t0:.1f} s (Slurm {os.path.basename(conf)} at {conf})")
    print(summary(results))
    return 0 if all(r.verdict != "differs" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
