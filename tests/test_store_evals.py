"""Issue 39: held-out evaluations in the store (from a job's metrics file), acct's eval
columns, and `acct --sweep NAME --sort METRIC`. No torch needed."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_dlrm.cli import cli
from slurm_dlrm.store import JobState, NewPlacement, PackState, Store
from slurm_dlrm.store.evals import eval_curve, eval_summaries, ingest_eval_file, ingest_job_evals

T0 = 1_700_000_000.0


def _eval_line(step: int, auc: float, ne: float) -> str:
    return json.dumps({"type": "eval", "t": 100.0 + step, "step": step, "eval_auc": auc, "eval_ne": ne,
                       "eval_log_loss": 0.5, "eval_calibration": 1.0, "eval_accuracy": 0.7,
                       "eval_samples": 64, "planted_auc": 0.8}) + "\n"


def test_store_reads_eval_lines_once_and_summarises_final_and_best(tmp_path: Path):
    metrics = tmp_path / "metrics.jsonl"
    train_line = json.dumps({"t": 1.0, "step": 10, "loss": 0.6, "samples_per_s": 5.0}) + "\n"
    metrics.write_text(train_line + _eval_line(100, 0.70, 0.95) + train_line + _eval_line(200, 0.76, 0.90))
    with Store(tmp_path / "s.db") as store:
        assert store.add_job(user="u", name="e", spec={}, spec_fingerprint="f") == 1
        assert ingest_eval_file(store, 1, metrics) == 2
        assert ingest_eval_file(store, 1, metrics) == 0  # read once
        # A resume from an older checkpoint evaluates step 200 again, then goes on;
        # a line still being written waits.
        with metrics.open("a") as f:
            f.write(_eval_line(200, 0.76, 0.90) + _eval_line(300, 0.74, 0.91) + '{"type": "eval", "st')
        assert ingest_eval_file(store, 1, metrics) == 2
        (s,) = eval_summaries(store).values()
        assert (s.evals, s.last_step, s.last_auc, s.best_auc, s.best_auc_step) == (3, 300, 0.74, 0.76, 200)
        assert (s.best_ne, s.best_ne_step, s.planted_auc) == (0.90, 200, 0.8)
        assert [r["step"] for r in eval_curve(store, 1)] == [100, 200, 300]


def _sweep_store(tmp_path: Path) -> tuple[Store, list[int]]:
    """A 4-variant `--set optimizer.lr=...` sweep, 3 of them evaluated, and an unrelated job."""
    s = Store(tmp_path / "store.sqlite", clock=lambda: T0 + 1000)
    spool = tmp_path / "spool"
    ids = []
    for lr, auc in (("0.001", 0.71), ("0.01", 0.78), ("0.1", 0.75), ("1.0", None)):
        spec = {"name": f"my-dlrm-lr{lr}", "optimizer": {"type": "adagrad", "lr": float(lr)}, "seed": 0}
        j = s.add_job(user="u", name=spec["name"], spec=spec, spec_fingerprint="f", submit_time=T0)
        ids.append(j)
        if auc is not None:
            d = spool / "jobs" / str(j)
            d.mkdir(parents=True)
            (d / "metrics.jsonl").write_text(_eval_line(100, auc - 0.02, 0.95) +
                                            _eval_line(200, auc, round(1.6 - auc, 2)))
    other = s.add_job(user="u", name="my-dlrm2", spec={"name": "my-dlrm2", "seed": 5}, spec_fingerprint="g",
                      submit_time=T0)
    pack = s.add_pack(name="pk-1", user="u", policy="complementary", n_gpus=1, t=T0,
                      placements=[NewPlacement(j, 0, 0) for j in ids])
    s.transition_pack(pack, PackState.QUEUED, "sub", slurm_job_id="101", t=T0)
    s.transition_pack(pack, PackState.RUNNING, "run", nodes="node1", t=T0 + 10)
    for j in ids:
        s.transition_job(j, JobState.RUNNING, "started", t=T0 + 10)
    assert ingest_job_evals(s, spool, since=T0) == 6
    return s, [*ids, other]


def test_acct_columns_show_final_and_best_evaluations(tmp_path: Path):
    s, ids = _sweep_store(tmp_path)
    res = CliRunner().invoke(cli, ["acct", "--db", str(s.path), "--json", "-o",
                                   "JobID,AUC,NE,BestAUC,BestAUCStep,BestNE,BestNEStep,EvalStep,PlantedAUC"])
    assert res.exit_code == 0, res.output
    got = {r["JobID"]: r for r in json.loads(res.output)}
    assert got[ids[1]] == {"JobID": ids[1], "AUC": 0.78, "NE": 0.82, "BestAUC": 0.78, "BestAUCStep": 200,
                           "BestNE": 0.82, "BestNEStep": 200, "EvalStep": 200, "PlantedAUC": 0.8}
    assert got[ids[3]]["AUC"] is None and got[ids[3]]["EvalStep"] is None
    table = CliRunner().invoke(cli, ["acct", "--db", str(s.path)]).output
    assert table.splitlines()[0].split()[-1] == "AUC" and "0.7800" in table


def test_acct_sweep_lists_each_variant_with_what_varied_sorted_by_a_metric(tmp_path: Path):
    s, ids = _sweep_store(tmp_path)
    res = CliRunner().invoke(cli, ["acct", "--db", str(s.path), "--sweep", "my-dlrm", "--sort", "auc"])
    assert res.exit_code == 0, res.output
    head, *rows = res.output.splitlines()
    assert head.split()[:4] == ["JobID", "Name", "State", "optimizer.lr"] and "GPUHours" in head
    assert [int(r.split()[0]) for r in rows] == [ids[1], ids[2], ids[0], ids[3]]  # best AUC first, unevaluated last
    assert rows[0].split()[3:5] == ["0.01", "0.7800"]
    res = CliRunner().invoke(cli, ["acct", "--db", str(s.path), "--sweep", "my-dlrm", "--sort", "ne", "--csv"])
    table = list(csv.DictReader(io.StringIO(res.output)))
    assert [r["optimizer.lr"] for r in table] == ["0.01", "0.1", "0.001", "1.0"] and table[3]["AUC"] == ""
    res = CliRunner().invoke(cli, ["acct", "--db", str(s.path), "--sweep", "my-dlrm", "--json"])
    first = json.loads(res.output)[0]
    assert first["varied"] == {"optimizer.lr": 0.01} and first["AUC"] == 0.78 and "GPUHours" in first


@pytest.mark.parametrize(("args", "what"), [
    (["--sweep", "nope"], "--sweep"), (["--sweep", "my-dlrm", "--sort", "speed"], "--sort"),
    (["--sort", "auc"], "--sort"),
])
def test_acct_sweep_bad_input_is_one_line_and_exit_2(tmp_path: Path, args, what):
    s, _ = _sweep_store(tmp_path)
    res = CliRunner().invoke(cli, ["acct", "--db", str(s.path), *args])
    assert res.exit_code == 2
    assert res.output.startswith(f"slurm-dlrm: error: {what}") and res.output.count("\n") == 1


def test_report_draws_loss_and_auc_curves_and_compares_the_sweep(tmp_path: Path):
    from slurm_dlrm.store.report import write_report

    s, ids = _sweep_store(tmp_path)
    spool = tmp_path / "spool"
    with (spool / "jobs" / str(ids[1]) / "metrics.jsonl").open("a") as f:
        for step in (10, 20, 30):
            f.write(json.dumps({"t": T0 + step, "step": step, "loss": 0.7 - step / 100, "loss_avg": 0.7}) + "\n")
    w = write_report(s, tmp_path / "r.html", since=T0 - 100, until=T0 + 2000, now=T0 + 1000, spool_dir=spool)
    html = w.html.read_text()
    assert {p.name for p in w.pngs} >= {"r-curves.png", "r-sweep.png"}
    assert "Training loss and held-out AUC per job" in html and "Sweep: the variants compared" in html
    assert "3 variants of my-dlrm; varied: optimizer.lr" in html  # the unevaluated one is left out
    # without evaluations there is nothing to compare: the page says so
    empty = Store(tmp_path / "empty.sqlite", clock=lambda: T0)
    w = write_report(empty, tmp_path / "e.html", since=T0 - 100, until=T0 + 2000, now=T0)
    assert "no job in this window has held-out evaluations" in w.html.read_text()


def test_queue_shows_the_last_auc_and_show_reads_the_last_eval_and_stop_lines(tmp_path: Path):
    from slurm_dlrm.service.joblog import last_metrics
    from slurm_dlrm.service.queue import format_table, queue_rows

    s, ids = _sweep_store(tmp_path)
    rows = {r["job_id"]: r for r in queue_rows(s, user="u", service={"running": False}, include_ended=True)}
    assert rows[ids[1]]["auc"] == 0.78 and rows[ids[3]]["auc"] is None
    table = format_table(list(rows.values()))
    assert "AUC" in table.splitlines()[0] and "0.78" in table
    spool = tmp_path / "spool"
    with (spool / "jobs" / str(ids[1]) / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"t": T0, "step": 210, "loss": 0.5, "samples_per_s": 9.0}) + "\n")
        f.write(json.dumps({"type": "stop", "t": T0, "step": 210, "reason": "auc reached the target"}) + "\n")
    assert last_metrics(spool, ids[1])["step"] == 210 and "type" not in last_metrics(spool, ids[1])
    assert last_metrics(spool, ids[1], "eval")["eval_auc"] == 0.78
    assert last_metrics(spool, ids[1], "stop")["reason"] == "auc reached the target"
    assert last_metrics(spool, ids[0], "stop") is None


def _peaks_line(step: int, rss: list[int], tensor: list[int]) -> str:
    """Rank 0's metrics line of a multi-rank run (train/runner.py `_rank_peaks`): on the CPU
    no rank measures GPU memory."""
    return json.dumps({"t": 100.0 + step, "step": step, "loss": 0.6, "world_size": len(rss),
                       "peak_rss_bytes": rss[0], "rank_peak_gpu_bytes": [None] * len(rss),
                       "rank_peak_rss_bytes": rss, "rank_peak_tensor_bytes": tensor}) + "\n"


def test_acct_shows_every_rank_s_measured_peak_of_a_multi_rank_job(tmp_path: Path):
    """Issue 48 item 3: a multi-node job's ranks each have their peak in acct (measured by
    the runner, gathered into rank 0's metrics lines); MaxRSS is the largest rank's, as
    sacct's MaxRSS is its largest task's; a requeued attempt that peaks lower keeps the
    first attempt's peak."""
    mib = 1 << 20
    with Store(tmp_path / "s.db") as store:
        job = store.add_job(user="u", name="mn", spec={}, spec_fingerprint="f")
        single = store.add_job(user="u", name="one", spec={}, spec_fingerprint="g")
        d = tmp_path / "spool" / "jobs"
        (d / str(job)).mkdir(parents=True)
        (d / str(single)).mkdir(parents=True)
        metrics = d / str(job) / "metrics.jsonl"
        metrics.write_text(_peaks_line(5, [300 * mib, 310 * mib, 290 * mib, 305 * mib], [10, 40, 20, 30]) +
                           _peaks_line(10, [320 * mib, 330 * mib, 300 * mib, 340 * mib], [11, 41, 21, 31]))
        (d / str(single) / "metrics.jsonl").write_text(json.dumps({"t": 1.0, "step": 5, "peak_rss_bytes": 9}) + "\n")
        for j in (job, single):
            ingest_eval_file(store, j, d / str(j) / "metrics.jsonl")
        with metrics.open("a") as f:  # the requeued attempt starts afresh and peaks lower
            f.write(_peaks_line(5, [200 * mib, 200 * mib, 200 * mib, 200 * mib], [1, 1, 1, 1]))
        ingest_eval_file(store, job, metrics)
    cols = "JobID,MaxRSS,RankMaxRSS,RankMaxTensor,RankMaxGPUMem"
    res = CliRunner().invoke(cli, ["acct", "--db", str(tmp_path / "s.db"), "--json", "-o", cols])
    assert res.exit_code == 0, res.output
    got = {r["JobID"]: r for r in json.loads(res.output)}
    assert got[job] == {"JobID": job, "MaxRSS": 340 * mib, "RankMaxRSS": [320 * mib, 330 * mib, 300 * mib, 340 * mib],
                        "RankMaxTensor": [11, 41, 21, 31], "RankMaxGPUMem": [None] * 4}
    assert got[single]["RankMaxRSS"] is None and got[single]["MaxRSS"] is None  # no rank lists: no rows
    table = CliRunner().invoke(cli, ["acct", "--db", str(tmp_path / "s.db"), "-o", cols]).output
    assert "320.0M,330.0M,300.0M,340.0M" in table and "-,-,-,-" in table, table
