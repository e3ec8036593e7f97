"""The sbatch options that apply to a pack, and the pack's batch script.

Users give sbatch options to `slurm-dlrm submit` on the command line or as `#SBATCH`
lines at the top of a spec file (YAML treats them as comments), read as sbatch reads
a batch script: directives stop at the first line that is neither blank nor a comment,
and the command line wins. Only options that make sense for a whole pack are accepted;
resources (`--mem`, `--gres`, ...) come from the estimate, so they are refused.

Pure: no I/O except `render_pack_script` reading its template once.
"""

from __future__ import annotations

import os
import re
import shlex
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from functools import cache
from pathlib import Path
from typing import Any

from slurm_dlrm.errors import BadInput
from slurm_dlrm.package_data import data_dir

TEMPLATE_DIR = data_dir("templates")
PACK_TEMPLATE = "pack.sbatch.j2"

TIME_UNLIMITED = -1  # Slurm's INFINITE / UNLIMITED

# sbatch --mail-type values (Slurm 22.05 man page).
MAIL_TYPES = (
    "NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT",
    "TIME_LIMIT", "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS",
)

# Patterns as strings, compiled on first use (`re` caches them): `submit` without
# options never pays for compiling them at import.
_CONTROL = r"[\x00-\x1f\x7f]"
_NAME = r"[A-Za-z0-9_.+-]+"
_NAME_LIST = r"[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*"
# Feature expressions: names joined by & | , with counts [a*2&b] and parentheses.
_CONSTRAINT = r"[A-Za-z0-9_.&|,*\[\]():!=+-]+"
_MAIL_USER = r"[^\s'\"\\]+"


class SbatchOptionError(BadInput):
    """One bad sbatch option; names where it came from and the option."""

    def __init__(self, where: str, option: str, reason: str) -> None:
        self.where = where
        self.option = option
        self.reason = reason
        prefix = f"{where}: " if where else ""
        super().__init__(f"{prefix}{option}: {reason}")


# ---------------------------------------------------------------- time limits

_TIME_FORMS = (
    # (regex, field names) in Slurm's order: time_str2mins in src/common/parse_time.c
    (r"(\d+)", ("m",)),
    (r"(\d+):(\d+)", ("m", "s")),
    (r"(\d+):(\d+):(\d+)", ("h", "m", "s")),
    (r"(\d+)-(\d+)", ("d", "h")),
    (r"(\d+)-(\d+):(\d+)", ("d", "h", "m")),
    (r"(\d+)-(\d+):(\d+):(\d+)", ("d", "h", "m", "s")),
)


def parse_time_minutes(value: str) -> int:
    """A Slurm time limit in minutes (seconds round up, as Slurm does).

    Accepts "minutes", "minutes:seconds", "hours:minutes:seconds", "days-hours",
    "days-hours:minutes", "days-hours:minutes:seconds", and INFINITE/UNLIMITED
    (returned as TIME_UNLIMITED). Raises ValueError with the reason.
    """
    text = value.strip()
    if text.upper() in ("INFINITE", "UNLIMITED", "-1"):
        return TIME_UNLIMITED
    for pattern, names in _TIME_FORMS:
        m = re.fullmatch(pattern, text)
        if m:
            parts = dict(zip(names, (int(g) for g in m.groups()), strict=True))
            seconds = (parts.get("d", 0) * 86400 + parts.get("h", 0) * 3600
                       + parts.get("m", 0) * 60 + parts.get("s", 0))
            return -(-seconds // 60)
    raise ValueError(
        f"bad time {value!r} (use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED)")


def format_time_minutes(minutes: int) -> str:
    """Minutes as Slurm's canonical D-HH:MM:SS (or UNLIMITED)."""
    if minutes == TIME_UNLIMITED:
        return "UNLIMITED"
    days, rest = divmod(minutes, 1440)
    hours, mins = divmod(rest, 60)
    return f"{days}-{hours:02d}:{mins:02d}:00" if days else f"{hours:02d}:{mins:02d}:00"


# ---------------------------------------------------------------- time limit leads

# The least lead a short limit gets: a member's checkpoint (a DLRM step and one save)
# fits in it, and the agent starts members a second or two after Slurm starts the pack.
MIN_STOP_LEAD_S = 10.0
STOP_LEAD_FRACTION = 0.15  # of the limit, for limits too short for the site's full lead


def stop_lead_s(limit_s: float, full_lead_s: float) -> float:
    """How long before its time limit a member is told to checkpoint and stop (issue 42).

    The site's full lead (term_grace_s + 60, two minutes by default) for a limit that
    affords it; a shorter limit keeps most of its time: 15 % of it, at least 10 s (`-t 2`:
    18 s, so the job runs 102 s of its 120). Was `--signal=TERM@120` for every limit,
    which stopped `-t 1` and `-t 2` jobs at once."""
    if limit_s <= 0:
        return 0.0
    return min(full_lead_s, max(MIN_STOP_LEAD_S, STOP_LEAD_FRACTION * limit_s), limit_s / 2)


# ---------------------------------------------------------------- the options

@dataclass(frozen=True)
class SbatchOptions:
    """sbatch options of a submission; None = not given (Slurm's default applies)."""

    partition: str | None = None
    account: str | None = None
    time_minutes: int | None = None
    qos: str | None = None
    job_name: str | None = None
    constraint: str | None = None
    mail_type: str | None = None  # canonical comma list, upper case
    mail_user: str | None = None
    output: str | None = None  # sbatch filename pattern (%j, %x, ...)
    error: str | None = None
    # Per job, not per pack (issue 31): the service orders and holds jobs by them; they
    # never reach a pack's sbatch line and do not split packs.
    nice: int | None = None  # sbatch --nice: the job's priority among its user's jobs, lower first
    begin_time: float | None = None  # sbatch --begin, as epoch seconds (resolved at submit)
    # `#SBATCH --array`/`-d` in a spec, as the command line's (issue 42); per job too
    array: str | None = None
    dependency: str | None = None

    def merged_over(self, base: SbatchOptions) -> SbatchOptions:
        """These options with `base` filling the gaps (self wins, as the command line)."""
        return replace(base, **self.to_dict())

    def with_paths_from(self, cwd: str) -> SbatchOptions:
        """Relative -o/-e made absolute against `cwd`: the pack runs in its own folder."""
        def absolute(p: str | None) -> str | None:
            if p is None or p.startswith("/"):
                return p
            # `\` in a filename disables Slurm's % patterns; keep the user's intent but
            # escape what the cwd brings in.
            return str(Path(escape_filename_pattern(cwd)) / p)
        return replace(self, output=absolute(self.output), error=absolute(self.error))

    def to_dict(self) -> dict[str, Any]:
        # not dataclasses.asdict: it deep-copies, and a round calls this per pending job
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SbatchOptions:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def pack_key(self) -> tuple[tuple[str, str], ...]:
        """What jobs must share to ride in one pack: all but the job name and time.

        Time limits differ freely: the pack asks for the longest (`pack_time_minutes`);
        -o/-e are each member's own (linked to its log), not the pack's.
        """
        return tuple(sorted((k, str(v)) for k, v in self.to_dict().items()
                            if k not in ("job_name", "time_minutes", "output", "error") + PER_JOB))

    def sbatch_flags(self, *, include_job_name: bool = True) -> list[str]:
        """`--flag=value` argv items (unquoted: for an argv list or `sbatch_line`)."""
        flags = []
        for spec in OPTIONS:
            value = getattr(self, spec.attr)
            if value is None or (spec.attr == "job_name" and not include_job_name) or spec.attr in PER_JOB:
                continue
            text = format_time_minutes(value) if spec.attr == "time_minutes" else str(value)
            flags.append(f"{spec.long}={text}")
        return sorted(flags)


def pack_time_minutes(limits: Iterable[int | None]) -> int | None:
    """The pack's time limit: the longest of its members' (None = partition default,
    which may be longer than any given one, so it wins; UNLIMITED wins over all)."""
    values = list(limits)
    if not values or any(v is None for v in values):
        return None
    if TIME_UNLIMITED in values:
        return TIME_UNLIMITED
    return max(v for v in values if v is not None)


@dataclass(frozen=True)
class _OptionSpec:
    attr: str
    long: str
    short: str | None
    check: Callable[[str], Any]  # returns the stored value or raises ValueError


def _text(pattern: str, what: str, max_len: int = 200) -> Callable[[str], str]:
    def check(value: str) -> str:
        if not value:
            raise ValueError("must not be empty")
        if len(value) > max_len:
            raise ValueError(f"longer than {max_len} characters")
        if not re.fullmatch(pattern, value):
            raise ValueError(f"bad {what} {value!r}")
        return value
    return check


def _free_text(max_len: int) -> Callable[[str], str]:
    def check(value: str) -> str:
        if not value:
            raise ValueError("must not be empty")
        if len(value) > max_len:
            raise ValueError(f"longer than {max_len} characters")
        if re.search(_CONTROL, value):
            # A #SBATCH line ends at a newline, so such a value cannot reach sbatch.
            raise ValueError(f"contains a control character (newline, tab, ...): {value!r}")
        return value
    return check


def _mail_type(value: str) -> str:
    items = [v.strip().upper() for v in value.split(",")]
    bad = [v for v in items if v not in MAIL_TYPES]
    if bad or not items:
        raise ValueError(f"unknown mail type {bad[0] if bad else value!r} (one of {', '.join(MAIL_TYPES)})")
    return ",".join(items)


def _time(value: str) -> int:
    return parse_time_minutes(value)


# sbatch --nice: "The adjustment range is +/- 2147483645. Only privileged users can
# specify a negative adjustment" (sbatch(1)); without a value the adjustment is 100.
NICE_MAX = 2147483645
NICE_DEFAULT = 100


def _nice(value: str) -> int:
    try:
        n = int(value.strip())
    except ValueError:
        raise ValueError(f"bad adjustment {value!r} (an integer, 0..{NICE_MAX}; negative: root only)") from None
    if not -NICE_MAX <= n <= NICE_MAX:
        raise ValueError(f"{n} is outside -{NICE_MAX}..{NICE_MAX}")
    if n < 0 and os.geteuid() != 0:
        raise ValueError(f"{n}: only root may give a negative adjustment (0..{NICE_MAX}), as sbatch")
    return n


def _array(value: str) -> str:
    from slurm_dlrm.service.sweep import array_throttle, parse_array

    try:
        parse_array(value)
        array_throttle(value)
    except BadInput as exc:
        raise ValueError(str(exc).split(": ", 1)[-1]) from None
    return value.strip()


def _dependency(value: str) -> str:
    from slurm_dlrm.service.depend import parse_dependency

    try:
        parse_dependency(value)
    except BadInput as exc:
        raise ValueError(str(exc).split(": ", 1)[-1]) from None
    return value.strip()


def _begin(value: str) -> float:
    from slurm_dlrm.service.begin_time import parse_begin

    return parse_begin(value, time.time())


OPTIONS: tuple[_OptionSpec, ...] = (
    _OptionSpec("account", "--account", "-A", _text(_NAME, "account name")),
    _OptionSpec("constraint", "--constraint", "-C", _text(_CONSTRAINT, "feature expression", 1000)),
    _OptionSpec("error", "--error", "-e", _free_text(4096)),
    _OptionSpec("job_name", "--job-name", "-J", _free_text(200)),
    _OptionSpec("mail_type", "--mail-type", None, _mail_type),
    _OptionSpec("mail_user", "--mail-user", None, _text(_MAIL_USER, "mail address")),
    _OptionSpec("output", "--output", "-o", _free_text(4096)),
    _OptionSpec("partition", "--partition", "-p", _text(_NAME_LIST, "partition name")),
    _OptionSpec("qos", "--qos", "-q", _text(_NAME, "QOS name")),
    _OptionSpec("time_minutes", "--time", "-t", _time),
    _OptionSpec("nice", "--nice", None, _nice),
    _OptionSpec("begin_time", "--begin", "-b", _begin),
    _OptionSpec("array", "--array", "-a", _array),
    _OptionSpec("dependency", "--dependency", "-d", _dependency),
)
PER_JOB = ("nice", "begin_time", "array", "dependency")
_BY_LONG = {o.long: o for o in OPTIONS}
_BY_SHORT = {o.short: o for o in OPTIONS if o.short}
_BY_ATTR = {o.attr: o for o in OPTIONS}

# Resource options a user may know from sbatch; the service sizes packs itself.
_SIZED_BY_US = ("--mem", "--mem-per-cpu", "--mem-per-gpu", "--gres", "--gpus", "-G", "--gpus-per-node",
                "--cpus-per-task", "-c", "--nodes", "-N", "--ntasks", "-n", "--ntasks-per-node")


def refused_option(name: str, where: str = "command line") -> SbatchOptionError | None:
    """The error for a resource option sbatch knows and slurm-dlrm sizes itself (`submit
    --mem=4G` says what `#SBATCH --mem` says), or None for any other name."""
    name = name.partition("=")[0]
    if name in _SIZED_BY_US:
        return SbatchOptionError(where, name, "sized by slurm-dlrm from the estimate; remove it")
    return None


def check_option(attr: str, value: str, where: str = "") -> Any:
    """Validate one option value given by attribute name; returns what is stored."""
    spec = _BY_ATTR[attr]
    try:
        return spec.check(value)
    except ValueError as exc:
        raise SbatchOptionError(where, spec.long, str(exc)) from None


def options_from_mapping(values: Mapping[str, str | None], where: str = "command line") -> SbatchOptions:
    """Build options from attribute -> raw text (e.g. click's parsed options)."""
    unknown = set(values) - set(_BY_ATTR)
    if unknown:
        raise SbatchOptionError(where, sorted(unknown)[0], "not an sbatch option of a pack")
    return SbatchOptions(**{k: check_option(k, v, where) for k, v in values.items() if v is not None})


def parse_sbatch_args(args: Iterable[str], where: str = "command line") -> SbatchOptions:
    """Parse sbatch-style argv items (`-p x`, `-px`, `--partition=x`, `--partition x`).

    Later items win over earlier ones, as in sbatch.
    """
    items = list(args)
    values: dict[str, Any] = {}
    i = 0
    while i < len(items):
        arg = items[i]
        i += 1
        spec: _OptionSpec | None
        value: str | None = None
        if arg.startswith("--"):
            name, eq, inline = arg.partition("=")
            spec = _BY_LONG.get(name) or _unique_prefix(name, where)
            if eq:
                value = inline
        elif arg.startswith("-") and len(arg) >= 2:
            name = arg[:2]
            spec = _BY_SHORT.get(name)
            if len(arg) > 2:
                value = arg[2:]
        else:
            raise SbatchOptionError(where, arg, "not an option (expected -X VALUE or --name=VALUE)")
        if spec is None:
            reason = ("sized by slurm-dlrm from the estimate; remove it" if name in _SIZED_BY_US
                      else "not an sbatch option slurm-dlrm applies to a pack")
            raise SbatchOptionError(where, name, reason)
        if value is None and spec.attr == "nice" and (i >= len(items) or not _is_number(items[i])):
            value = str(NICE_DEFAULT)  # sbatch: a bare --nice lowers the priority by 100
        if value is None:
            if i >= len(items):
                raise SbatchOptionError(where, spec.long, "needs a value")
            value = items[i]
            i += 1
        values[spec.attr] = check_option(spec.attr, value, where)
    return SbatchOptions(**values)


def _is_number(text: str) -> bool:
    return re.fullmatch(r"[+-]?\d+", text.strip()) is not None


def _unique_prefix(name: str, where: str) -> _OptionSpec | None:
    # getopt_long accepts unambiguous prefixes (sbatch --part=x works).
    if name in _SIZED_BY_US:
        return None
    matches = [o for long, o in _BY_LONG.items() if long.startswith(name) and len(name) > 3]
    if len(matches) > 1:
        raise SbatchOptionError(where, name, "ambiguous option")
    return matches[0] if matches else None


# ---------------------------------------------------------------- #SBATCH lines

def split_sbatch_line(line: str) -> list[str]:
    """Split what follows `#SBATCH` the way sbatch's _get_argument does (Slurm 22.05).

    Single and double quotes group, a backslash escapes the next character (also
    inside quotes), an unquoted `#` starts a comment.
    """
    args: list[str] = []
    cur: list[str] = []
    in_arg = False
    quote = ""
    escape = False
    for ch in line:
        if escape:
            cur.append(ch)
            escape = False
            continue
        if ch == "\\":
            escape = in_arg = True
            continue
        if quote:
            if ch == quote:
                quote = ""
            else:
                cur.append(ch)
            continue
        if ch in "\"'":
            quote = ch
            in_arg = True
            continue
        if ch == "#":
            break
        if ch.isspace():
            if in_arg:
                args.append("".join(cur))
                cur, in_arg = [], False
            continue
        cur.append(ch)
        in_arg = True
    if in_arg:
        args.append("".join(cur))
    return args


def sbatch_directives(text: str) -> list[tuple[int, list[str]]]:
    """(line number, argv items) of each `#SBATCH` line before the first command line.

    As sbatch: blank lines and other comments are skipped; the first line that is
    neither ends the directives (YAML keys of a spec file end them).
    """
    out = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if not line.startswith("#"):
            break
        if line.startswith("#SBATCH") and (len(line) == 7 or line[7].isspace()):
            out.append((lineno, split_sbatch_line(line[7:])))
    return out


def parse_sbatch_script(text: str, source: str) -> SbatchOptions:
    """The options of the `#SBATCH` lines of one file; errors name `source:line`."""
    opts = SbatchOptions()
    for lineno, args in sbatch_directives(text):
        opts = parse_sbatch_args(args, f"{source}:{lineno}").merged_over(opts)
    return opts


# ---------------------------------------------------------------- the pack script

def sbatch_quote(value: str) -> str:
    """Quote a value for a `#SBATCH` line: shlex.quote, then escape backslashes.

    sbatch's line parser understands shell-style single quotes, but it also treats a
    backslash inside quotes as an escape (unlike a shell), so backslashes are doubled.
    A newline cannot be carried at all: a #SBATCH line ends there.
    """
    if re.search(_CONTROL, value):
        raise BadInput(f"#SBATCH value contains a control character (newline, tab, ...): {value!r}")
    return shlex.quote(value).replace("\\", "\\\\")


def sbatch_line(flag: str) -> str:
    """`--name=value` -> `--name=<quoted value>` for one #SBATCH line."""
    name, eq, value = flag.partition("=")
    return f"{name}={sbatch_quote(value)}" if eq else name


def escape_filename_pattern(path: str) -> str:
    """A literal path for sbatch -o/-e: `%` would start a replacement symbol."""
    return path.replace("%", "%%")


@dataclass(frozen=True)
class PackScript:
    """Everything the pack's batch script says; computed by the service from the plan."""

    pack_name: str  # unique; the Slurm job name the service reconciles by
    comment: str  # --comment: the marker job_submit.lua looks for (docs/interfaces.md section 6)
    nodes: int
    gpus_per_node: int
    cpus_per_node: int
    mem_per_node_mib: int
    python: str  # absolute path of the interpreter that runs the agent
    placement_path: str  # <pack_dir>/placement.json
    pack_dir: str
    signal_before_end_s: int  # SIGTERM to the agents this long before a partition's time limit
    options: SbatchOptions = SbatchOptions()
    gpu_type: str | None = None  # --gres=gpu:TYPE:N when the plan names a model
    nodelist: str | None = None  # --nodelist: the node the plan sized the pack for (issue 43)


def pack_sbatch_flags(p: PackScript) -> list[str]:
    """All `--flag=value` items of the pack (unquoted), sorted."""
    gres = f"gpu:{p.gpu_type}:{p.gpus_per_node}" if p.gpu_type else f"gpu:{p.gpus_per_node}"
    flags = [
        f"--chdir={p.pack_dir}",
        f"--comment={p.comment}",
        f"--cpus-per-task={p.cpus_per_node}",
        f"--job-name={p.pack_name}",
        f"--mem={p.mem_per_node_mib}M",
        f"--nodes={p.nodes}",
        "--no-requeue",  # a requeue would restart every member; the service decides
        "--ntasks-per-node=1",
    ]
    if p.options.time_minutes is None or p.options.time_minutes == TIME_UNLIMITED:
        # The partition's limit, unknown here: Slurm signals the agents (they checkpoint the
        # members). A limit of the pack's own is the agent's to keep, per member and to the
        # second (placement time_limit_s): Slurm's --signal may come up to 60 s early.
        flags.append(f"--signal=TERM@{p.signal_before_end_s}")
    if p.gpus_per_node > 0:
        flags.append(f"--gres={gres}")
    if p.nodelist:
        flags.append(f"--nodelist={p.nodelist}")
    if p.options.output is None:
        flags.append(f"--output={escape_filename_pattern(p.pack_dir)}/slurm-%j.out")
    # The pack's own job name wins over -J (a member's name lives in the store).
    flags.extend(p.options.sbatch_flags(include_job_name=False))
    return sorted(flags)


@cache
def _template() -> Any:
    import jinja2  # only the service renders; keeps `submit --help` light

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # noqa: S701 - a shell script; values are shlex-quoted instead
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    return env.get_template(PACK_TEMPLATE)


def render_pack_script(p: PackScript) -> str:
    """The pack's batch script: deterministic, every value quoted."""
    if p.nodes < 1 or p.cpus_per_node < 1 or p.mem_per_node_mib < 1 or p.gpus_per_node < 0:
        raise ValueError(f"pack {p.pack_name}: bad size {p.nodes} nodes, {p.cpus_per_node} cpus, "
                         f"{p.mem_per_node_mib} MiB, {p.gpus_per_node} GPUs")
    srun = [
        "srun",
        "--ntasks-per-node=1",
        f"--cpus-per-task={p.cpus_per_node}",
        "--job-name=slurm-dlrm-agent",  # the step's name in sacct (members are named steps)
        "--kill-on-bad-exit=0",  # one node's agent failing must not kill the others
        p.python, "-m", "slurm_dlrm", "agent", "--pack-file", p.placement_path,
    ]
    return str(_template().render(
        pack_name_comment=_one_line(p.pack_name),
        sbatch_lines=[sbatch_line(f) for f in pack_sbatch_flags(p)],
        srun_line=" ".join(shlex.quote(a) for a in srun),
    ))


def _one_line(text: str) -> str:
    return re.sub(_CONTROL, "?", text)
