"""Issue 42 items 4 and 5 (+ issue 43 item 8): what sbatch refuses at once is refused at
submit (a partition Slurm does not have, a dependency on an unknown job), arrays as
sbatch takes them (`#SBATCH --array`/`-d` in a spec, the `%N` throttle), and -o/-e as
each member's own log."""

from __future__ import annotations

import json

import pytest
from test_cli_habits import Path_examples, env, run  # noqa: F401 - env is a fixture

from slurm_dlrm.errors import DlrmError


def test_test_only_refuses_a_partition_and_a_dependency_sbatch_would(env):  # noqa: F811
    spec = str(Path_examples() / "tiny-a.yaml")
    r = run("submit", "--test-only", "-p", "nosuchpart", spec)
    assert r.exit_code == 1 and r.output.startswith("slurm-dlrm: error: -p/--partition nosuchpart: invalid "
                                                    "partition specified"), r.output
    r = run("submit", "--test-only", "-d", "afterok:9999", spec)
    assert r.exit_code == 1 and "job 9999: no such job in your store (Job dependency problem)" in r.output
    assert run("submit", "--test-only", "-p", "dlrm", spec).exit_code == 0


def test_submit_asks_slurm_for_the_partition_before_recording(tmp_path):
    from service_harness import make_site

    from slurm_dlrm.service.sbatch_options import SbatchOptions
    from slurm_dlrm.service.submit import check_partitions, prepare
    from slurm_dlrm.slurm.fake import FakeSlurm

    site = make_site(tmp_path)
    spec = str(Path_examples() / "tiny-a.yaml")
    good = prepare([spec], SbatchOptions(partition="dlrm"), site, str(tmp_path))
    check_partitions(FakeSlurm(), site, good)
    bad = prepare([spec], SbatchOptions(partition="dlrm,gpu-big"), site, str(tmp_path))
    with pytest.raises(DlrmError, match="-p/--partition gpu-big: invalid partition specified .*nothing recorded"):
        check_partitions(FakeSlurm(), site, bad)


def test_sbatch_array_and_dependency_lines_in_a_spec_work_as_on_the_command_line(env):  # noqa: F811
    text = (Path_examples() / "tiny-a.yaml").read_text()
    first = run("submit", "--no-service", "--parsable", str(Path_examples() / "tiny-b.yaml")).output.strip()
    (env / "arr.yaml").write_text(f"#SBATCH --array=0-3%2\n#SBATCH -d afterok:{first}\n" + text)
    r = run("submit", "--no-service", "--parsable", str(env / "arr.yaml"))
    assert (r.exit_code, r.output) == (0, "2\n"), r.output  # before: "--array: not an sbatch option ..."
    jobs = json.loads(run("queue", "--json", "--no-slurm").output)["jobs"]
    assert [j["name"] for j in jobs] == ["tiny-b", "tiny-a-0", "tiny-a-1", "tiny-a-2", "tiny-a-3"]
    r = run("show", "2_3", "--json")
    assert json.loads(r.output)["options"]["dependency"] == f"afterok:{first}"
    (env / "bad.yaml").write_text("#SBATCH --array=0-3%0\n" + text)
    r = run("submit", "--no-service", str(env / "bad.yaml"))
    assert r.exit_code == 2 and "bad.yaml:1: --array: " in r.output


def test_the_array_throttle_holds_tasks_over_it(tmp_path):
    from service_harness import add_job

    from slurm_dlrm.service.depend import within_array_throttle
    from slurm_dlrm.store import Store
    from slurm_dlrm.store.states import JobState

    with Store(tmp_path / "s" / "store.sqlite") as s:
        ids = [s.add_job(user="root", name=f"t{i}", spec={}, spec_fingerprint="f", sbatch={"array_throttle": 2},
                         array_task_id=i, array_job_id=None if i == 0 else 1) for i in range(4)]
        other = add_job(s, "other")
        pending = s.jobs([JobState.PENDING])
        assert [j.id for j in within_array_throttle(s, pending)] == [ids[0], ids[1], other]
        pid = s.add_pack(name="p", user="root", policy="exclusive", n_gpus=1)
        s.transition_job(ids[0], JobState.PLANNED, "planned", pack_id=pid)
        assert [j.id for j in within_array_throttle(s, s.jobs([JobState.PENDING]))] == [ids[1], other]


def test_output_patterns_name_the_members_own_log(tmp_path):
    from service_harness import FakeClock, FakeCluster, add_job, make_site, start_pack

    from slurm_dlrm.service.core import PackingService, ServiceSettings
    from slurm_dlrm.service.pack_folder import expand_output_pattern
    from slurm_dlrm.slurm.fake import FakeSlurm
    from slurm_dlrm.store import Store

    clock = FakeClock()
    with Store(tmp_path / "store.sqlite", clock=clock) as store:
        slurm = FakeSlurm(clock=clock, user="root")
        svc = PackingService(store, slurm, make_site(tmp_path), ServiceSettings(
            user="root", python="/venv/bin/python", dispatch_window_s=0.0), clock=clock)
        j = add_job(store, "mine", sbatch={"output": "/home/u/out-%j-%x.txt", "error": "/home/u/err-%4j.txt"})
        _pack, sid, placement = start_pack(svc, slurm, FakeCluster(slurm, clock))
        (entry,) = placement["members"]
        assert entry["output_links"] == [f"/home/u/err-{j:04d}.txt", f"/home/u/out-{j}-mine.txt"]
        assert "/home/u" not in slurm.job(sid).script  # before: the pack's output, %j its Slurm id
        job = store.get_job(j)
    assert expand_output_pattern("/a/%%j\\%j", job, "u", None) == "/a/%%j%j"  # a backslash: no patterns
    assert expand_output_pattern("/a/%A_%a.%u.%N", job, "u", "node2") == f"/a/{j}_0.u.node2"
