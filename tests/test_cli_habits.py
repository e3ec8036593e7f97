"""Slurm's habits (issue 23): the options and forms a user of sbatch/squeue/sacct/scancel
types without thinking, on our commands."""

from __future__ import annotations

import os
from datetime import datetime

import pytest
from service_harness import write_site_file
from test_store_acct import T0, hist, invoke  # noqa: F401 - hist is a fixture

from slurm_dlrm.store.acct import parse_time


def test_acct_takes_sacct_state_abbreviations_time_forms_and_x(hist):  # noqa: F811
    s, ids, _ = hist
    res = invoke(s, "-X", "-s", "CD", "-o", "JobID", "-P", "-n", "--starttime", f"@{T0 - 100}", "--endtime", "now")
    assert res.exit_code == 0, res.output
    assert res.output.split() == [str(ids["A"]), str(ids["C"]), str(ids["D"])]
    res = invoke(s, "-s", "PD,oom", "-o", "Name", "-P", "-n")
    assert res.output.split() == ["B", "E"]


def test_acct_parsable_is_formatted_like_sacct_and_raw_behind_raw(hist):  # noqa: F811
    s, ids, _ = hist
    res = invoke(s, "-P", "-j", str(ids["A"]), "-o", "JobID,MaxGPUMem,Elapsed,ExitCode")
    assert res.output == f"JobID|MaxGPUMem|Elapsed|ExitCode\n{ids['A']}|3.0G|00:01:40|0:0\n"
    res = invoke(s, "-P", "--raw", "-n", "-j", str(ids["A"]), "-o", "JobID,MaxGPUMem,Elapsed,ExitCode")
    assert res.output == f"{ids['A']}|{(3 << 30) + 5}|100.0|0\n"
    res = invoke(s, "--raw")
    assert res.exit_code == 2 and "--raw: goes with -P" in res.output


def test_acct_exit_code_is_code_colon_signal(hist):  # noqa: F811
    s, ids, _ = hist
    for code, shown in ((5, "5:0"), (143, "0:15"), (137, "0:9")):
        s.conn.execute("UPDATE jobs SET exit_code = ? WHERE id = ?", (code, ids["A"]))
        s.conn.commit()
        res = invoke(s, "-P", "-n", "-j", str(ids["A"]), "-o", "ExitCode")
        assert res.output.strip() == shown


@pytest.mark.parametrize("text, want", [
    ("now-1hours", T0 - 3600), ("now-90minutes", T0 - 5400), ("now-30", T0 - 30), ("now+2days", T0 + 2 * 86400),
    ("now-1weeks", T0 - 604800), ("1h", T0 - 3600),
])
def test_slurm_relative_times(text, want):
    assert parse_time(text, "-S", T0) == want


def test_slurm_clock_and_date_forms():
    day = datetime.fromtimestamp(T0).replace(hour=0, minute=0, second=0, microsecond=0)
    assert parse_time("today", "-S", T0) == parse_time("midnight", "-S", T0) == day.timestamp()
    assert parse_time("14:30", "-S", T0) == day.replace(hour=14, minute=30).timestamp()
    assert parse_time("1121", "-S", T0) == day.replace(month=11, day=21).timestamp()
    assert parse_time("11/21/25", "-S", T0) == day.replace(year=2025, month=11, day=21).timestamp()


# ------------------------------------------------------------------ usage errors

@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_DLRM_SITE", str(write_site_file(tmp_path)))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(*args: str):
    from click.testing import CliRunner

    from slurm_dlrm.cli import cli

    return CliRunner().invoke(cli, list(args))


@pytest.mark.parametrize("args, line", [
    (["queue", "--zzzz"], "slurm-dlrm: error: queue: No such option '--zzzz' (see slurm-dlrm queue --help)"),
    (["show", "abc"], "slurm-dlrm: error: job id 'abc': expected N, N_M (task M of array N) or N_[M-K]"),
    (["submit"], "slurm-dlrm: error: submit: Missing argument 'SPEC...' (see slurm-dlrm submit --help)"),
    (["frobnicate"], "slurm-dlrm: error: No such command 'frobnicate' (see slurm-dlrm --help)"),
    (["submit", "--mem=4G", "x.yaml"], "slurm-dlrm: error: command line: --mem: sized by slurm-dlrm from the "
                                       "estimate; remove it"),
    (["submit", "-c", "4", "x.yaml"], "slurm-dlrm: error: command line: -c: sized by slurm-dlrm from the "
                                      "estimate; remove it"),
])
def test_usage_errors_are_one_documented_line(env, args, line):
    r = run(*args)
    assert (r.exit_code, r.output) == (2, line + "\n")


def test_mem_on_the_command_line_and_in_the_spec_say_the_same(env):
    spec = env / "x.yaml"
    spec.write_text("#SBATCH --mem=4G\nname: x\n")
    in_spec = run("submit", str(spec)).output
    on_line = run("submit", "--mem=4G", str(spec)).output
    assert in_spec == f"slurm-dlrm: error: {spec}:1: --mem: sized by slurm-dlrm from the estimate; remove it\n"
    assert on_line == "slurm-dlrm: error: command line: --mem: sized by slurm-dlrm from the estimate; remove it\n"


def test_ctrl_c_during_wait_says_the_jobs_go_on(env):
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    spec = Path(__file__).resolve().parent.parent / "examples" / "sweep" / "tiny-a.yaml"
    proc = subprocess.Popen([sys.executable, "-m", "slurm_dlrm", "submit", "--no-service", "--wait", str(spec)],  # noqa: S603
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
                            # a background job's SIGINT is ignored, and Python then keeps it so
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None
    first = proc.stdout.readline()  # recorded; no service: it stays pending, --wait waits
    assert first.startswith("Submitted job ")
    job_id = int(first.split()[2])
    assert proc.stderr is not None
    assert f"job {job_id} (tiny-a) PENDING" in proc.stderr.readline()  # --wait's first line: it waits
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1] == (f"slurm-dlrm: interrupted; job(s) {job_id} go on "
                                            f"(slurm-dlrm queue to see them, slurm-dlrm cancel ID to stop one)")
    assert run("show", str(job_id), "--json").output.count('"state": "PENDING"') == 1


# ------------------------------------------------------------------ estimate of a misfit

BIG = """name: big
tables:
  - {name: t0, rows: 100000000, dim: 64, pooling_factor: 1.0}
  - {name: t1, rows: 100000000, dim: 64, pooling_factor: 1.0}
  - {name: t2, rows: 100000, dim: 64}
dense_features: 13
bottom_mlp: [64, 64]
top_mlp: [64, 1]
interaction: {type: dot}
batch_size: 1024
optimizer: {type: adagrad, lr: 0.01}
"""


def test_estimate_of_a_spec_no_gpu_holds_exits_2_and_says_what_would_fit(tmp_path):
    import json
    from dataclasses import replace

    from slurm_dlrm.estimate import copies_per_gpu, estimate
    from slurm_dlrm.site import REPO_SITE_FILE, load_site
    from slurm_dlrm.spec import load_spec

    spec_file = tmp_path / "big.yaml"
    spec_file.write_text(BIG)
    r = run("estimate", "--site", str(REPO_SITE_FILE), "--json", str(spec_file))
    assert r.exit_code == 2
    *body, last = r.output.strip().splitlines()
    assert last.startswith(f"slurm-dlrm: error: {spec_file}: fits no GPU: needs ") and "it would fit with " in last
    advice = json.loads("\n".join(body))[0]["advice"]
    assert [a.split(" ")[0] for a in advice] == ["world_size:", "half", "placement:", "smaller"]
    # Each piece of advice is true: the changed spec fits an H100, and the cap is the largest that does.
    site = load_site(REPO_SITE_FILE)
    gpu = site.gpu_model("h100")
    margin = site.packing.memory_margin_pct
    spec = load_spec(spec_file)

    def fits(s):
        return copies_per_gpu(estimate(s, gpu), gpu, margin).fits

    assert not fits(spec)
    assert fits(replace(spec, world_size=int(advice[0].split()[1])))
    assert fits(replace(spec, mixed_precision="bf16", tables=tuple(replace(t, dtype="fp16") for t in spec.tables)))
    assert fits(replace(spec, tables=(replace(spec.tables[0], placement="uvm"), *spec.tables[1:])))
    cap = int(advice[3].split("max_rows_per_table: ")[1].split("}")[0])
    assert fits(replace(spec, tables=tuple(replace(t, rows=min(t.rows, cap)) for t in spec.tables)))
    assert not fits(replace(spec, tables=tuple(replace(t, rows=min(t.rows, cap + 1)) for t in spec.tables)))
    # A spec that fits is exit 0, no advice.
    r = run("estimate", "--site", str(REPO_SITE_FILE), "--json", str(Path_examples() / "tiny-a.yaml"))
    assert r.exit_code == 0 and "advice" not in json.loads(r.output)[0]


def Path_examples():  # noqa: N802
    from pathlib import Path

    return Path(__file__).resolve().parent.parent / "examples" / "sweep"


# ------------------------------------------------------------------ queue, cancel, completion, spec

def _submit(*specs: str) -> list[int]:
    r = run("submit", "--no-service", "--parsable", *specs)
    assert r.exit_code == 0, r.output
    return [int(x) for x in r.output.split()]


def test_queue_takes_squeues_filters_and_columns(env):
    ex = Path_examples()
    a, b, c = _submit(str(ex / "tiny-a.yaml"), str(ex / "tiny-b.yaml"), str(ex / "tiny-a.yaml"))
    run("cancel", str(c))
    r = run("queue", "--me", "-n", "tiny-a", "-o", "jobid,name,STATE", "--no-slurm")
    assert r.exit_code == 0, r.output
    assert r.stdout.split("\n")[:2] == ["JOBID  NAME    STATE", f"{a}      tiny-a  PENDING"]
    r = run("queue", "-t", "CA", "-o", "JOBID,STATE", "--noheader", "--no-slurm")  # an ended state implies --all
    assert r.stdout == f"{c}      CANCELLED\n"
    r = run("queue", "-j", f"{b},{c}", "-u", os.environ.get("USER") or _me(), "-o", "JOBID", "--noheader", "--no-slurm")
    assert r.stdout.split() == [str(b)]  # as squeue -j (Slurm 22.05): an ended job only with -t (issue 42)
    r = run("queue", "-j", f"{b},{c}", "-t", "all", "-o", "JOBID", "--noheader", "--no-slurm")
    assert r.stdout.split() == [str(b), str(c)]
    assert run("queue", "-u", "someone-else").output.startswith("slurm-dlrm: error: -u/--user: your store holds only ")
    r = run("queue", "-o", "JOBID,COLOUR")
    assert r.exit_code == 2 and "unknown column 'COLOUR'" in r.output


def _me() -> str:
    from slurm_dlrm.store.store import current_user

    return current_user()


def test_cancel_by_name_state_and_pack(env):
    ex = Path_examples()
    a, b, c = _submit(str(ex / "tiny-a.yaml"), str(ex / "tiny-b.yaml"), str(ex / "tiny-a.yaml"))
    r = run("cancel", "-n", "tiny-a", "-t", "PD")
    assert r.exit_code == 0 and r.output.splitlines() == [f"job {a} cancelled (was pending)",
                                                          f"job {c} cancelled (was pending)"]
    r = run("cancel", "-n", "tiny-a")
    assert r.exit_code == 0 and r.output == "slurm-dlrm cancel: no active job of yours matches\n"
    assert run("cancel", "--pack", "dlrm-nope").output == "slurm-dlrm: error: --pack: no pack dlrm-nope of yours\n"
    assert run("cancel", "-t", "CD").exit_code == 2
    assert run("cancel").output.startswith("slurm-dlrm: error: give job ids, or -n NAME")
    assert json_state(b) == "PENDING"


def json_state(job_id: int) -> str:
    import json

    return json.loads(run("show", str(job_id), "--json").output)["state"]


def test_completion_scripts_complete_job_ids_and_columns(env):
    import subprocess
    import sys

    ex = Path_examples()
    a, b = _submit(str(ex / "tiny-a.yaml"), str(ex / "tiny-b.yaml"))
    for shell in ("bash", "zsh"):
        r = run("completion", shell)
        assert r.exit_code == 0 and "_SLURM_DLRM_COMPLETE" in r.output
    script = run("completion", "bash").output
    # bash itself loads the script and registers the function
    out = subprocess.run(["bash", "-c", script + "\ncomplete -p slurm-dlrm"], capture_output=True, text=True,  # noqa: S603, S607
                         timeout=30).stdout
    assert "_slurm_dlrm_completion" in out

    def complete(words: str, cword: int) -> list[str]:
        env_ = {**os.environ, "COMP_WORDS": words, "COMP_CWORD": str(cword), "_SLURM_DLRM_COMPLETE": "bash_complete"}
        p = subprocess.run([sys.executable, "-c", "from slurm_dlrm.cli import main; main()"], env=env_,  # noqa: S603
                           capture_output=True, text=True, timeout=60)
        return [line.split(",", 1)[1] for line in p.stdout.splitlines()]

    assert complete("slurm-dlrm show ", 2) == [str(b), str(a)]
    assert complete("slurm-dlrm cancel ", 2) == [str(b), str(a)]
    assert complete("slurm-dlrm queue -o JOBID,ST", 3) == ["JOBID,STATE", "JOBID,START_TIME"]  # START_TIME: with --start
    assert "requeue" in complete("slurm-dlrm re", 1)


def test_spec_example_is_a_valid_spec_and_submit_help_shows_the_format(env):
    from slurm_dlrm.spec import load_spec

    r = run("spec", "--example")
    assert r.exit_code == 0
    (env / "ex.yaml").write_text(r.output)
    spec = load_spec(env / "ex.yaml")
    assert spec.name == "my-dlrm" and len(spec.tables) == 2
    assert run("estimate", str(env / "ex.yaml")).exit_code == 0
    help_text = run("submit", "--help").output
    assert "Spec format (all fields: slurm-dlrm spec --example):" in help_text and "bottom_mlp:" in help_text


# ------------------------------------------------------------------ sweeps and --test-only

def test_a_sweep_over_one_spec_records_one_job_per_variant(env):
    import json

    ex = Path_examples()
    r = run("submit", "--no-service", "--json", str(ex / "tiny-a.yaml"), "--set", "optimizer.lr=0.01,0.1",
            "--set", "bottom_mlp=[32,8],[64,8]", "--array", "0-1")
    assert r.exit_code == 0, r.output
    jobs = json.loads(r.output)
    assert len(jobs) == 8
    assert jobs[0]["name"] == "tiny-a-lr0.01-bottom_mlp_32__8_-0" and jobs[-1]["name"] == "tiny-a-lr0.1-bottom_mlp_64__8_-1"
    specs = {j["name"]: json.loads(run("show", str(i), "--json").output)["spec"]
             for i, j in zip(range(1, 9), jobs, strict=True)}
    s0, s7 = specs[jobs[0]["name"]], specs[jobs[-1]["name"]]
    assert (s0["optimizer"]["lr"], s0["bottom_mlp"], s0["seed"]) == (0.01, [32, 8], 0)
    assert (s7["optimizer"]["lr"], s7["bottom_mlp"], s7["seed"]) == (0.1, [64, 8], 1)
    # a variant that does not validate names its values, and nothing is recorded
    before = run("queue", "--no-slurm", "--json").output
    r = run("submit", "--no-service", str(ex / "tiny-a.yaml"), "--set", "optimizer.lr=0.1,-1")
    assert r.exit_code == 2 and "[optimizer.lr=-1]" in r.output and r.output.count("\n") == 1, r.output
    assert run("queue", "--no-slurm", "--json").output == before
    for bad in (["--set", "lr"], ["--array", "3-1"], ["--set", "tables.9.rows=5"]):
        r = run("submit", "--no-service", str(ex / "tiny-a.yaml"), *bad)
        assert r.exit_code == 2 and r.output.startswith("slurm-dlrm: error: "), r.output


def test_test_only_prints_the_sbatch_line_and_records_nothing(env):
    ex = Path_examples()
    r = run("submit", "--test-only", "--no-pack", "-p", "dlrm", "-o", "my out/%j.txt", str(ex / "tiny-a.yaml"))
    assert r.exit_code == 0, r.output
    line = r.stdout.strip()  # stderr: the note on MPS across users (docs/admin.md)
    assert line.startswith("tiny-a: sbatch --parsable ") and line.endswith(" job.sbatch")
    import shlex

    argv = shlex.split(line.split(": ", 1)[1])  # quoted for a shell: it splits back into the flags
    assert "--partition=dlrm" in argv and f"--output={env}/my out/%j.txt" in argv
    assert any(a.startswith("--gres=") for a in argv) and any(a.startswith("--mem=") for a in argv)
    r = run("submit", "--test-only", str(ex / "tiny-a.yaml"), "--array", "0-2")
    assert [ln.split(":")[0] for ln in r.output.splitlines()] == ["tiny-a-0", "tiny-a-1", "tiny-a-2"]
    assert "--time=00:30:00" in r.output and "--no-requeue" in r.output
    assert not list(env.glob("store-*/*.db")) and not list(env.glob("spool-*"))
