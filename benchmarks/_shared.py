"""Pieces more than one benchmark uses (imported as `_shared`: a benchmark run as a
script has benchmarks/ first on sys.path). No torch here: benchmarks/_measure.py is the
torch side, run as a child."""

from __future__ import annotations

# A tiny DLRM whose member runs `true` (spec `command`): what it costs is Slurm's, the
# service's and the agent's work, never training.
PROBE_SPEC = """\
name: {name}
tables:
  - {{name: t0, rows: 1000, dim: 8}}
dense_features: 13
bottom_mlp: [16, 8]
top_mlp: [16, 1]
batch_size: 64
steps: 1
command: ["true"]
"""


def probe_spec(name: str) -> str:
    """PROBE_SPEC's YAML text, named `name`."""
    return PROBE_SPEC.format(name=name)
