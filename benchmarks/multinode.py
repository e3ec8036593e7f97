"""Multi-node jobs (issue 48): four ranks over the local cluster's two nodes, and the
per-rank memory estimate against a measured run.

1. Live, on the local Slurm cluster (tests/test_multinode_live.py, run by pytest with
   $SLURM_DLRM_MULTINODE_RESULTS set so each scenario records how far it got):
   - trained: `nodes: 2, gpus_per_node: 2` (W = 4, gloo on the CPU) submitted through
     `slurm-dlrm submit` completes, its accounting charging 4 GPUs for its time;
   - exact_resume: the same spec cancelled mid-run (every rank checkpoints) and
     requeued ends with the losses of the uninterrupted run at every logged step and
     its final state equal to the last bit (both runs' checkpoints, every rank);
   - node_loss_resumed: a stand-in runner per rank; the first node's slurmd and the
     job's steps there killed -> Slurm NODE_FAIL -> the service requeues it -> it
     resumes from its last checkpoint and completes.
2. Per-rank estimate: the same 4-rank topology (2 ranks per node) trained on the CPU by
   the runner's own model build (benchmarks/_measure.py, one process per rank), each
   rank's peak of live tensor bytes measured; beside it our per-rank estimate (the
   plan `estimate` prints) and torchrec's planner's own per-rank estimate.

    python benchmarks/multinode.py [--skip-live]

Ends with one line:
    multinode: ranks=4 nodes=2 trained=1 exact_resume=1 node_loss_resumed=1 estimate_max_rank_err_pct=X planner_err_pct=Y
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
MIB = 1 << 20

# Unequal tables, so the ranks differ; two per rank on average.
SPEC = {"name": "mn-bench", "tables": [{"name": f"t{i}", "rows": rows, "dim": 16}
                                       for i, rows in enumerate([60000, 40000, 25000, 20000, 12000, 8000, 5000,
                                                                 3000])],
        "dense_features": 13, "bottom_mlp": [64, 16], "top_mlp": [64, 1], "batch_size": 512,
        "optimizer": {"type": "adagrad", "lr": 0.01}, "loader_workers": 0, "prefetch_batches": 1,
        "nodes": 2, "gpus_per_node": 2, "checkpoint_every_steps": 0}


def live() -> dict[str, int]:
    with tempfile.TemporaryDirectory(prefix="multinode-bench-") as tmp:
        results = Path(tmp) / "results.json"
        env = dict(os.environ, SLURM_DLRM_MULTINODE_RESULTS=str(results), PYTHONPATH=str(REPO))
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",  # noqa: S603
                               "--basetemp", str(Path(tmp) / "t"), str(REPO / "tests" / "test_multinode_live.py")],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
        out = proc.stdout.strip().splitlines()
        for line in [ln for ln in out if ln.startswith(("E ", "FAILED"))][:12]:  # why, when one fails
            print(f"  {line[:300]}")
        print(f"live tests: {(out or ['(no output)'])[-1]}")
        got = json.loads(results.read_text()) if results.exists() else {}
    return {k: int(bool(got.get(k))) for k in ("trained", "exact_resume", "node_loss_resumed")}


def measure(steps: int) -> dict[str, object]:
    out = subprocess.run([sys.executable, str(HERE / "_measure.py"), json.dumps(SPEC), str(steps)],  # noqa: S603
                         capture_output=True, text=True, timeout=1800, env=dict(os.environ, PYTHONPATH=str(REPO)))
    if out.returncode != 0:
        raise SystemExit(f"measure failed: {out.stderr.strip().splitlines()[-3:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-live", action="store_true", help="only the per-rank estimate (no Slurm)")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    from slurm_dlrm.estimate import estimate
    from slurm_dlrm.spec import parse_spec

    spec = parse_spec(SPEC)
    est = estimate(spec, None)
    m = measure(args.steps)
    measured = [int(b) for b in m["per_rank_peak_tensor_bytes"]]  # type: ignore[union-attr]
    planner = [int(b) for b in m["planner_rank_bytes"]]  # type: ignore[union-attr]
    print(f"{'rank':>4} {'node':>4} {'tables':<10} {'measured':>10} {'estimate':>10} {'err%':>7} | "
          f"{'planner':>10} {'err%':>7}")
    errs, perrs = [], []
    for r, meas in enumerate(measured):
        ours = est.ranks[r].tensor_peak_bytes
        e, pe = 100.0 * (ours - meas) / meas, 100.0 * (planner[r] - meas) / meas
        errs.append(e)
        perrs.append(pe)
        print(f"{r:>4} {r // 2:>4} {','.join(map(str, est.ranks[r].tables)):<10} {meas / MIB:>9.2f}M "
              f"{ours / MIB:>9.2f}M {e:>+7.2f} | {planner[r] / MIB:>9.2f}M {pe:>+7.1f}")
    worst = max(range(len(errs)), key=lambda i: abs(errs[i]))
    pworst = max(range(len(perrs)), key=lambda i: abs(perrs[i]))
    print(f"largest rank: measured {max(measured) / MIB:.2f} MiB (rank {measured.index(max(measured))}), "
          f"estimate {max(r.tensor_peak_bytes for r in est.ranks) / MIB:.2f} MiB: the request follows it")
    figures = {"trained": 0, "exact_resume": 0, "node_loss_resumed": 0} if args.skip_live else live()
    print(f"multinode: ranks={spec.world_size} nodes={spec.nodes} trained={figures['trained']} "
          f"exact_resume={figures['exact_resume']} node_loss_resumed={figures['node_loss_resumed']} "
          f"estimate_max_rank_err_pct={abs(errs[worst]):.2f} planner_err_pct={abs(perrs[pworst]):.1f}")


if __name__ == "__main__":
    main()
