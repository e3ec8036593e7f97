"""sbatch options of a pack and the pack's batch script.

Regenerate the golden file after an intended change:
    SLURM_DLRM_REGEN=1 /work/main/.venv/bin/python -m pytest tests/test_service_sbatch.py
"""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_dlrm.errors import EXIT_USAGE, BadInput
from slurm_dlrm.service.sbatch_options import (
    TIME_UNLIMITED,
    PackScript,
    SbatchOptionError,
    SbatchOptions,
    format_time_minutes,
    options_from_mapping,
    pack_sbatch_flags,
    pack_time_minutes,
    parse_sbatch_args,
    parse_sbatch_script,
    parse_time_minutes,
    render_pack_script,
    sbatch_directives,
    sbatch_quote,
    split_sbatch_line,
)

GOLDEN = Path(__file__).parent / "golden" / "pack.sbatch"
WEIRD = "we'ird \"dir\"; $(touch /tmp/pwned) `id` & \\x"


@pytest.mark.parametrize(
    "text, minutes",
    [
        ("90", 90),
        ("0", 0),
        ("5:30", 6),  # minutes:seconds, seconds round up
        ("5:00", 5),
        ("1:02:03", 63),  # hours:minutes:seconds
        ("2-3", 2 * 1440 + 180),  # days-hours
        ("2-3:04", 2 * 1440 + 184),
        ("1-00:00:01", 1441),
        ("UNLIMITED", TIME_UNLIMITED),
        ("infinite", TIME_UNLIMITED),
    ],
)
def test_time_formats(text, minutes):
    assert parse_time_minutes(text) == minutes


@pytest.mark.parametrize("text", ["", "1h", "1:2:3:4", "-5", "1-", "a-1", "1.5"])
def test_bad_times(text):
    with pytest.raises(ValueError):
        parse_time_minutes(text)


@pytest.mark.parametrize("minutes", [1, 59, 60, 61, 1439, 1440, 1441, 10 * 1440 + 7, TIME_UNLIMITED])
def test_time_round_trip(minutes):
    assert parse_time_minutes(format_time_minutes(minutes)) == minutes


def test_parse_args_all_forms():
    opts = parse_sbatch_args(
        ["-pgpu", "-A", "proj", "--time=1:00:00", "--qos", "high", "-J", "sweep",
         "--constraint=h100&ib", "--mail-type=end,FAIL", "--mail-user=a@b.c",
         "-o", "out-%j.txt", "--error=err.txt", "--part=dlrm"])
    assert opts == SbatchOptions(partition="dlrm", account="proj", time_minutes=60, qos="high",
                                 job_name="sweep", constraint="h100&ib", mail_type="END,FAIL",
                                 mail_user="a@b.c", output="out-%j.txt", error="err.txt")


@pytest.mark.parametrize(
    "args, option",
    [
        (["--mem=4G"], "--mem"),
        (["--gres", "gpu:1"], "--gres"),
        (["-c", "4"], "-c"),
        (["--mail-type=SOMETIMES"], "--mail-type"),
        (["-t", "soon"], "--time"),
        (["-p", "a b"], "--partition"),
        (["-J", "two\nlines"], "--job-name"),
        (["-o", "a\nb"], "--output"),
        (["--account"], "--account"),
        (["stray"], "stray"),
        (["--wckey=x"], "--wckey"),
    ],
)
def test_bad_args_are_one_line_exit_2(args, option):
    with pytest.raises(SbatchOptionError) as err:
        parse_sbatch_args(args)
    assert err.value.option == option
    assert err.value.exit_code == EXIT_USAGE
    assert "\n" not in str(err.value)


def test_directives_stop_at_first_command_and_command_line_wins():
    text = (
        "#!/bin/bash\n"
        "# a comment\n"
        "\n"
        "#SBATCH -p first --time=10  # trailing comment\n"
        "#SBATCH --job-name='a b'\n"
        "#SBATCHX -p ignored\n"
        "name: tiny\n"
        "#SBATCH -A after-the-first-key-is-ignored\n"
    )
    assert [n for n, _ in sbatch_directives(text)] == [4, 5]
    from_file = parse_sbatch_script(text, "spec.yaml")
    assert from_file == SbatchOptions(partition="first", time_minutes=10, job_name="a b")
    cli = options_from_mapping({"partition": "second", "account": None})
    merged = cli.merged_over(from_file)
    assert merged.partition == "second" and merged.time_minutes == 10 and merged.account is None


def test_script_errors_name_file_and_line():
    with pytest.raises(SbatchOptionError, match=r"^spec.yaml:2: --mem: sized by slurm-dlrm"):
        parse_sbatch_script("#SBATCH -p x\n#SBATCH --mem=1G\n", "spec.yaml")


@pytest.mark.parametrize("value", ["plain", "a b", "it's", 'say "hi"', "x;y", "$(id)", "back\\slash", "#hash", ""])
def test_sbatch_quote_round_trips_through_sbatch_line_parser(value):
    assert split_sbatch_line(f" --comment={sbatch_quote(value)}  # c") == [f"--comment={value}"]


def test_sbatch_quote_refuses_newline():
    with pytest.raises(BadInput):
        sbatch_quote("a\nb")


def test_relative_output_paths_become_absolute():
    opts = SbatchOptions(output="o-%j.txt", error="/abs/e.txt").with_paths_from("/home/u/100%")
    assert opts.output == "/home/u/100%%/o-%j.txt"
    assert opts.error == "/abs/e.txt"


def test_pack_key_ignores_job_name_only():
    a = SbatchOptions(partition="p", job_name="x")
    assert a.pack_key() == SbatchOptions(partition="p", job_name="y").pack_key()
    assert a.pack_key() == SbatchOptions(partition="p", time_minutes=5).pack_key()
    assert a.pack_key() != SbatchOptions(partition="p", qos="high").pack_key()
    assert SbatchOptions.from_dict(a.to_dict()) == a


def test_pack_time_is_the_longest():
    assert pack_time_minutes([10, 30]) == 30
    assert pack_time_minutes([10, None]) is None
    assert pack_time_minutes([10, TIME_UNLIMITED]) == TIME_UNLIMITED


def _pack(pack_dir: str = "/spool/alice/pack-7", **kw) -> PackScript:
    base = dict(
        pack_name="dlrm-pack-3f2a-7", comment="slurm-dlrm:mode=pack,pack_id=7,pack=dlrm-pack-3f2a-7",
        nodes=2, gpus_per_node=4, cpus_per_node=8, mem_per_node_mib=24000,
        python="/opt/venv/bin/python", placement_path=f"{pack_dir}/placement.json", pack_dir=pack_dir,
        signal_before_end_s=120,
        options=SbatchOptions(partition="dlrm", account="proj", time_minutes=90, job_name="ignored",
                              mail_type="END", mail_user="alice@example.org"),
        gpu_type="h100",
    )
    base.update(kw)
    return PackScript(**base)  # type: ignore[arg-type]


def test_golden_pack_script():
    text = render_pack_script(_pack())
    if os.environ.get("SLURM_DLRM_REGEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "regenerate: SLURM_DLRM_REGEN=1 pytest tests/test_service_sbatch.py"
    assert render_pack_script(_pack()) == text  # deterministic


def test_flags_sorted_and_pack_name_wins_over_job_name():
    flags = pack_sbatch_flags(_pack())
    assert flags == sorted(flags)
    assert "--job-name=dlrm-pack-3f2a-7" in flags and not any("ignored" in f for f in flags)
    assert "--gres=gpu:h100:4" in flags and "--time=01:30:00" in flags


def test_weird_paths_and_names_survive_bash_and_sbatch(tmp_path):
    pack_dir = str(tmp_path / WEIRD)
    opts = SbatchOptions(error=f"{pack_dir}/e.txt", job_name="not used")
    script = render_pack_script(_pack(pack_dir, comment=f"c {WEIRD}", options=opts,
                                      placement_path=f"{pack_dir}/with\nnewline/placement.json"))
    # What sbatch reads from the header.
    header = dict(a[0].split("=", 1) for _, a in sbatch_directives(script) if "=" in a[0])
    assert header["--chdir"] == pack_dir
    assert header["--comment"] == f"c {WEIRD}"
    assert header["--error"] == f"{pack_dir}/e.txt"
    # What bash runs: a fake srun on PATH prints its argv, NUL-separated.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "srun"
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write('\\0'.join(sys.argv[1:]))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,  # noqa: S603 - our own script, the point of the test
                         env={"PATH": f"{bindir}:/usr/bin:/bin"}, check=True).stdout
    argv = out.split("\0")
    assert argv[-4:] == ["slurm_dlrm", "agent", "--pack-file", f"{pack_dir}/with\nnewline/placement.json"]
    assert not Path("/tmp/pwned").exists()


def test_newline_in_pack_dir_is_refused_in_one_line():
    with pytest.raises(BadInput) as err:
        render_pack_script(_pack("/spool/a\nb"))
    assert "\n" not in str(err.value)
