"""`slurm-dlrm spec --example`: the job spec format, as a spec that runs."""

from __future__ import annotations

import click

# Valid as printed (tests load it); the contract is docs/interfaces.md section 1.
EXAMPLE = """\
# A slurm-dlrm job spec (YAML or JSON). Submit it with: slurm-dlrm submit my.yaml
# Every size has a limit far above real models (docs/interfaces.md section 1, "Limits").
# sbatch options may come first, as sbatch reads them:
#SBATCH --time=00:30:00
name: my-dlrm                 # required; [A-Za-z0-9._-]{1,64}
# preset: criteo-kaggle       # or a preset's tables: criteo-kaggle | criteo-terabyte-10m | criteo-terabyte-40m | mlperf-dcnv2
# scale: {max_rows_per_table: 20000, dim: 16}   # shrink a preset (or the tables below)
tables:                       # required unless a preset gives them; at most 10,000
  - name: t0
    rows: 100000
    dim: 16
    pooling_factor: 1.0       # mean ids per sample (1 = one-hot); or multi_hot: N (fixed ids per sample)
    dtype: fp32               # fp32 | fp16 | bf16
    placement: hbm            # hbm | uvm | host
  - {name: t1, rows: 5000, dim: 16, multi_hot: 3}
dense_features: 13
bottom_mlp: [128, 16]         # last width = the tables' dim; at most 100 layers
top_mlp: [128, 1]             # last width must be 1
interaction: {type: dot}      # or {type: dcn, layers: 3, low_rank: 512}
batch_size: 512               # per process
optimizer: {type: adagrad, lr: 0.01}   # sgd | adagrad | rowwise_adagrad | adam
mixed_precision: none         # none | fp16 | bf16
loader_workers: 0             # loader threads; at most 1,024
prefetch_batches: 2
steps: 200                    # or epochs: N (with a data file)
data: {type: synthetic, zipf_alpha: 1.05}   # or {type: criteo-tsv, path: day_0.tsv} / {type: criteo-npy, path: DIR}
seed: 0
world_size: 1                 # ranks (GPUs) per job, all on one node (at most 64): packed (W GPUs of a pack) or --no-pack
checkpoint_every_steps: 50    # cancel/requeue and preemption resume from the last one
metrics_every_steps: 10
eval: {every_steps: 200, batches: 8}   # held-out AUC, NE, log-loss, calibration, accuracy every N steps
                              # and at the end (0: at the end only; eval: false turns it off); Criteo data
                              # also takes holdout: auto | last-file | 0.05 (a fraction of the samples)
# command: [python, train.py] # optional argv replacing `slurm-dlrm train SPEC`
# custom_module: pkg.mod:factory   # optional: factory(spec) -> nn.Module replaces DLRM
# sweep: {stop: asha, metric: auc, min_steps: 40, reduction: 3}   # with --set: stop a sweep's losers
                              # at rungs min_steps x reduction^k (docs/sweeps.md; or submit --stop asha)
"""

@click.command("spec", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--example", is_flag=True, required=True, help="Print an annotated spec with every field.")
def spec(example: bool) -> None:
    """Print the job spec format: an annotated spec with every field, valid as it is.

    \b
    Example:
      slurm-dlrm spec --example > my.yaml && slurm-dlrm estimate my.yaml
    """
    click.echo(EXAMPLE, nl=False)
