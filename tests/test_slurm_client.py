"""SlurmClient against stand-in binaries (no cluster): argv, env, errors, timeouts."""

import os
import stat
from pathlib import Path

import pytest

from slurm_dlrm.errors import EXIT_RUNTIME
from slurm_dlrm.slurm import (
    JobState,
    SlurmBackend,
    SlurmClient,
    SlurmError,
    SlurmNotFound,
    SlurmTimeout,
)
from slurm_dlrm.slurm.base import AccountingDisabled

DATA = Path(__file__).parent / "data" / "slurm"


def make_bin(bin_dir: Path, name: str, body: str) -> None:
    """A stand-in Slurm command that logs its argv and SLURM_CONF, then runs `body`."""
    path = bin_dir / name
    path.write_text(f'#!/bin/sh\nprintf "%s\\n" "$0 $*" "conf=$SLURM_CONF" >> "{bin_dir}/calls.log"\n'
                    f'cat > "{bin_dir}/{name}.stdin"\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def bin_dir(tmp_path):
    d = tmp_path / "bin with space"
    d.mkdir()
    # Every client asks `sinfo --version` once before its first command.
    (d / "sinfo").write_text(f'#!/bin/sh\ncat "{DATA / "22.05.8" / "sinfo_version.txt"}"\n')
    (d / "sinfo").chmod(0o755)
    return d


def test_sbatch_passes_script_on_stdin_and_args_verbatim(bin_dir):
    make_bin(bin_dir, "sbatch", 'echo "4242;clusterx"')
    client = SlurmClient("/etc/x/slurm.conf", bin_dir=bin_dir)
    script = "#!/bin/bash\necho 'a;b' $HOME\n"
    job_id = client.sbatch(script, ["--job-name=x; rm -rf /", "--gres=gpu:1"])
    assert job_id == 4242
    assert (bin_dir / "sbatch.stdin").read_text() == script
    calls = (bin_dir / "calls.log").read_text().splitlines()
    assert calls[0].endswith("sbatch --parsable --job-name=x; rm -rf / --gres=gpu:1")  # (sinfo logs nothing)
    assert calls[1] == "conf=/etc/x/slurm.conf"


def test_squeue_filters_client_side_because_22_05_ignores_filters(bin_dir):
    make_bin(bin_dir, "squeue", f'cat "{DATA / "squeue_mixed.json"}"')
    client = SlurmClient(bin_dir=bin_dir)
    assert isinstance(client, SlurmBackend)
    assert [j.job_id for j in client.squeue(job_ids=[2, 6, 99])] == [2, 6]
    assert [j.job_id for j in client.squeue(name="gpu job")] == [1]
    assert client.squeue(user="nobody") == []
    assert client.squeue(job_ids=[]) == []
    assert {j.state for j in client.squeue()} == {JobState.RUNNING, JobState.FAILED, JobState.PENDING}


def test_show_job_unknown_id_is_none(bin_dir):
    make_bin(bin_dir, "scontrol", 'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1')
    assert SlurmClient(bin_dir=bin_dir).show_job(99) is None


def test_show_job_parses_scontrol(bin_dir):
    make_bin(bin_dir, "scontrol", f'cat "{DATA / "scontrol_show_job_multinode.txt"}"')
    job = SlurmClient(bin_dir=bin_dir).show_job(3)
    assert job is not None and job.nodes == "node[1-2]" and job.state is JobState.RUNNING


def test_failed_command_raises_with_command_exit_code_and_stderr(bin_dir):
    make_bin(bin_dir, "scancel", 'echo "scancel: error: Kill job error on job id 5: Invalid job id specified" >&2; exit 1')
    with pytest.raises(SlurmError) as info:
        SlurmClient(bin_dir=bin_dir).scancel([5], signal="USR1", full=True)
    err = info.value
    assert err.command[-4:] == ["--signal", "USR1", "--full", "5"]
    assert err.returncode == 1 and "Invalid job id" in err.stderr
    assert "Invalid job id specified" in str(err) and err.exit_code == EXIT_RUNTIME


def test_sacct_disabled_is_typed(bin_dir):
    make_bin(bin_dir, "sacct", 'echo "Slurm accounting storage is disabled" >&2; exit 1')
    with pytest.raises(AccountingDisabled, match="accounting storage is disabled"):
        SlurmClient(bin_dir=bin_dir).sacct([1])


def test_sacct_asks_explicit_fields(bin_dir):
    make_bin(bin_dir, "sacct", f'cat "{DATA / "sacct_parsable2.txt"}"')
    rows = SlurmClient(bin_dir=bin_dir).sacct([1, 2, 3, 4, 5])
    assert len(rows) == 12 and rows[0]["JobName"] == "gpu job"
    call = (bin_dir / "calls.log").read_text().splitlines()[0]
    assert "--parsable2 --noheader" in call and "--format JobID,JobName,State,ExitCode" in call


def test_missing_binary_is_a_clear_error(bin_dir):
    with pytest.raises(SlurmNotFound) as info:
        SlurmClient(bin_dir=bin_dir).squeue()
    assert "squeue not found" in str(info.value) and "slurm-wlm" in str(info.value)


def test_missing_binary_on_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SlurmNotFound, match="sinfo not found"):
        SlurmClient().sinfo()


def test_timeout_is_typed_and_fast(bin_dir):
    make_bin(bin_dir, "squeue", "sleep 5")
    client = SlurmClient(bin_dir=bin_dir, timeout_s=0.3)
    with pytest.raises(SlurmTimeout) as info:
        client.squeue()
    assert info.value.timeout_s == 0.3 and "no answer after 0.3 s" in str(info.value)


def test_ping_false_when_controller_down(bin_dir):
    make_bin(bin_dir, "scontrol", 'echo "Slurmctld(primary) at vm is DOWN"; exit 1')
    assert SlurmClient(bin_dir=bin_dir).ping() is False
    make_bin(bin_dir, "scontrol", 'echo "Slurmctld(primary) at vm is UP"')
    assert SlurmClient(bin_dir=bin_dir).ping() is True


def test_child_env_sets_slurm_conf_only_when_given(monkeypatch):
    monkeypatch.delenv("SLURM_CONF", raising=False)
    assert "SLURM_CONF" not in SlurmClient().child_env()
    assert SlurmClient(os.path.join("a", "b.conf")).child_env()["SLURM_CONF"] == "a/b.conf"


def test_make_backend_defaults_to_the_commands(monkeypatch):
    from slurm_dlrm.errors import BadInput
    from slurm_dlrm.slurm import ENV_BACKEND, make_backend

    monkeypatch.delenv(ENV_BACKEND, raising=False)
    backend = make_backend("/x/slurm.conf")
    assert isinstance(backend, SlurmClient) and backend.slurm_conf == "/x/slurm.conf"
    monkeypatch.setenv(ENV_BACKEND, "pyslurm")
    with pytest.raises(BadInput, match="not implemented"):
        make_backend()
    with pytest.raises(BadInput, match="unknown backend"):
        make_backend(kind="rest")


@pytest.mark.parametrize("answer", ["slurm 21.08.8\n", "slurm-wlm 17.11.2\n", "something else\n", ""])
def test_unsupported_release_is_refused_before_the_first_command(bin_dir, answer):
    from slurm_dlrm.slurm import UnsupportedSlurm

    (bin_dir / "sinfo").write_text(f"#!/bin/sh\nprintf '%s' '{answer}'\n")
    make_bin(bin_dir, "sbatch", 'echo 42')
    with pytest.raises(UnsupportedSlurm) as info:
        SlurmClient(bin_dir=bin_dir).sbatch("#!/bin/sh\n")
    assert not (bin_dir / "calls.log").exists()  # sbatch never ran
    msg = str(info.value)
    assert "\n" not in msg and "supports Slurm 22.05 to 26.05" in msg and info.value.exit_code == EXIT_RUNTIME


def test_release_is_asked_once_per_process(bin_dir):
    from slurm_dlrm.slurm import client as client_mod

    client_mod._RELEASES.clear()
    (bin_dir / "sinfo").write_text(f'#!/bin/sh\necho asked >> "{bin_dir}/asked"\necho "slurm 24.11.5"\n')
    make_bin(bin_dir, "scancel", "true")
    for _ in range(3):
        SlurmClient(bin_dir=bin_dir).scancel([1])
    assert (bin_dir / "asked").read_text() == "asked\n"
    assert SlurmClient(bin_dir=bin_dir).version() == "24.11.5"


def test_cli_names_an_unsupported_release_in_one_line(bin_dir, monkeypatch, tmp_path):
    from click.testing import CliRunner

    from slurm_dlrm.cli import cli

    (bin_dir / "sinfo").write_text("#!/bin/sh\necho 'slurm 21.08.8'\n")
    make_bin(bin_dir, "sbatch", 'echo 42')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(tmp_path))
    spec = Path(__file__).parent.parent / "examples" / "sweep" / "tiny-a.yaml"
    r = CliRunner().invoke(cli, ["submit", "--no-pack", str(spec)])
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert lines == ["slurm-dlrm: error: Slurm release 'slurm 21.08.8': older than 22.05, not supported "
                     "(slurm-dlrm supports Slurm 22.05 to 26.05)"]
    assert not (bin_dir / "calls.log").exists()  # nothing submitted
    assert list(tmp_path.rglob("store.sqlite")) == []  # and nothing recorded (--no-pack jobs are rows)
