"""`slurm-dlrm train SPEC`: click glue for slurm_dlrm.train (torch is imported only when
the command runs, so the other commands stay fast)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import click

from slurm_dlrm.errors import TRAIN_EXIT_BAD_SPEC, BadInput

HELP = """Train the DLRM a job spec describes (torchrec, sharded), with progress, checkpoints
and resume.

\b
Example:
  slurm-dlrm train spec.yaml
  SLURM_DLRM_METRICS_FILE=run/metrics.jsonl slurm-dlrm train spec.yaml --steps 200
  python -m slurm_dlrm.train spec.yaml --device cpu

Writes one JSON line every `metrics_every_steps` to the metrics file ($SLURM_DLRM_METRICS_FILE,
else ./<name>.run/metrics.jsonl) and checkpoints every `checkpoint_every_steps` and on
SIGTERM/SIGUSR1 into $SLURM_DLRM_CHECKPOINT_DIR (else ckpt/ next to the metrics file);
starts from the newest valid checkpoint there. world_size > 1 launches that many local
ranks unless torchrun already did.

Exit codes: 0 done, 1 failed, 2 bad spec, 3 GPU out of memory, 4 host out of memory,
5 stopped by a signal after writing a checkpoint.
"""


@click.command("train", help=HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False))
@click.option("--metrics-file", type=click.Path(dir_okay=False), default=None,
              help="JSON-lines progress file (default: $SLURM_DLRM_METRICS_FILE, else ./<name>.run/metrics.jsonl).")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), default=None,
              help="Checkpoint folder (default: $SLURM_DLRM_CHECKPOINT_DIR, else ckpt/ next to the metrics file).")
@click.option("--keep-checkpoints", type=click.IntRange(min=1), default=2, show_default=True,
              help="How many of the newest checkpoints to keep.")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Train this many steps (overrides the spec).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="auto: CUDA when a GPU is visible, else the CPU (gloo).")
@click.option("--no-resume", is_flag=True, help="Start at step 0; existing checkpoints in the folder are removed.")
@click.option("--sync-checkpoints", is_flag=True,
              help="Write checkpoints in the training thread (no host-memory copy of the state; "
                   "by default states up to 1 GiB are copied and written in the background).")
def train(spec_path: str, metrics_file: str | None, checkpoint_dir: str | None, keep_checkpoints: int,
          steps: int | None, device: str, no_resume: bool, sync_checkpoints: bool) -> None:
    _setup_logging()
    from slurm_dlrm.spec import load_spec

    try:
        spec = load_spec(spec_path)
    except BadInput as exc:
        click.echo(f"slurm-dlrm: error: {exc}", err=True)
        sys.exit(TRAIN_EXIT_BAD_SPEC)

    from slurm_dlrm.train.runner import default_paths

    metrics_path, ckpt_dir = default_paths(spec.name, metrics_file, checkpoint_dir)
    from slurm_dlrm.train.slurm_ranks import dist_env_from_slurm

    try:
        os.environ.update(dist_env_from_slurm(os.environ))  # one rank per srun task (multi-node job)
    except BadInput as exc:
        click.echo(f"slurm-dlrm: error: {exc}", err=True)
        sys.exit(TRAIN_EXIT_BAD_SPEC)
    if spec.world_size > 1 and "RANK" not in os.environ:
        from slurm_dlrm.train.launch import launch_local

        child_args = [os.path.abspath(spec_path), "--metrics-file", str(metrics_path),
                      "--checkpoint-dir", str(ckpt_dir), "--keep-checkpoints", str(keep_checkpoints),
                      "--device", device]
        if steps is not None:
            child_args += ["--steps", str(steps)]
        if no_resume:
            child_args.append("--no-resume")
        if sync_checkpoints:
            child_args.append("--sync-checkpoints")
        sys.exit(launch_local(spec.world_size, child_args))

    from slurm_dlrm.train.runner import RunOptions, run

    opts = RunOptions(metrics_file=metrics_path, checkpoint_dir=ckpt_dir, keep_checkpoints=keep_checkpoints,
                      steps=steps, device=device, resume=not no_resume, exit_after=True)
    if sync_checkpoints:
        opts.async_checkpoint_max_bytes = 0
    exit_now(run(spec, opts))


def exit_now(code: int) -> None:
    """Exit without the interpreter's teardown: run() returns with every checkpoint on
    disk, its metrics file closed and its threads joined, so what is left is Python
    freeing torch's and torchrec's thousands of modules and objects: 1-4 s of CPU per
    member on a loaded host, charged to its GPU share (issue 47: sweep_stop's fixed cost
    per variant). The logs and standard streams are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _setup_logging() -> None:
    """The runner's own notes (resume, checkpoints, fallbacks) belong in the job's log."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ours = logging.getLogger("slurm_dlrm.train")
    if ours.getEffectiveLevel() > logging.INFO:
        ours.setLevel(logging.INFO)
