"""DLRM job spec: load, validate, normalise, fingerprint (contract: docs/interfaces.md §1).

Pure: the only I/O is reading the one file `load_spec` is given; no torch import.
Every error is a `SpecError(field, reason)` whose field is a dotted path such as
``tables[2].rows``, so the CLI prints one line and exits 2.

Resolution order: a `preset` gives defaults for every field the spec leaves out
(`tables` replaces the preset's tables as a whole), then `scale` caps rows and
overrides the dim of every table (and the bottom MLP's last width).

Over 600 lines: the spec is one contract (docs/interfaces.md section 1), its dataclasses,
limits, parsing and cross-field checks in one place, so that every field's refusal names
its dotted path the same way and `to_dict` mirrors `parse_spec` field for field.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_dlrm.errors import SpecError, short_repr
from slurm_dlrm.presets import PRESET_NAMES, PRESETS

DTYPES = ("fp32", "fp16", "bf16")
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
PLACEMENTS = ("hbm", "uvm", "host")
INTERACTIONS = ("dot", "dcn")
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
MIXED_PRECISION = ("none", "fp16", "bf16")
# The built-in runner's model code: torchrec + fbgemm-gpu, or plain PyTorch
# (nn.EmbeddingBag + MLPs); auto: torchrec where fbgemm-gpu imports (docs/runner.md).
BACKENDS = ("auto", "torchrec", "torch")
DATA_TYPES = ("synthetic", "criteo-tsv", "criteo-npy")
_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_CUSTOM_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*")

# Size limits (issue 32; docs/interfaces.md section 1 lists them). Each is far above
# any real DLRM, so that none refuses a real job, and low enough that reading and
# estimating the largest spec they allow stays under 2 s (benchmarks/spec_limits.py).
# torchrec's production models have hundreds to about a thousand tables; the largest
# published tables have about 1e10 rows; MLPs have 2-10 layers of at most a few
# thousand units; DCN v2 uses 2-4 cross layers. The estimate replays every layer once
# per rank, so layers x world_size is what its time grows with.
MAX_SPEC_BYTES = 4 << 20  # a 10,000-table spec written out in full is about 1.5 MiB
MAX_TABLES = 10_000
MAX_ROWS = 1 << 40  # about 1.1e12
MAX_DIM = 65_536
MAX_IDS_PER_SAMPLE = 100_000  # pooling_factor and multi_hot (long user histories: thousands)
MAX_MLP_LAYERS = 100  # bottom_mlp, top_mlp, and DCN's interaction.layers
MAX_WIDTH = 1 << 20  # an MLP width, dense_features, DCN's low_rank
MAX_BATCH_SIZE = 1 << 24  # per process
# A job's ranks share one node (docs/packing.md "Multi-GPU jobs"); sites allow at most
# 64 GPUs per node (site.py).
MAX_WORLD_SIZE = 64
# Loader threads and batches they keep ready: more than any node has cores.
MAX_LOADER_WORKERS = 1_024
MAX_PREFETCH_BATCHES = 1_024
MAX_COUNT = 1 << 53  # steps, epochs, seed, every-N-steps: exact in JSON and in SQLite
MAX_COMMAND_ARGS = 4_096
MAX_COMMAND_BYTES = 128 << 10  # Linux's MAX_ARG_STRLEN for one argument; here for all
MAX_PATH_CHARS = 4_096  # PATH_MAX
MAX_CUSTOM_MODULE_CHARS = 256


@dataclass(frozen=True)
class TableSpec:
    name: str
    rows: int
    dim: int
    pooling_factor: float | None = 1.0  # mean ids per sample; None when multi_hot is set
    multi_hot: int | None = None  # fixed ids per sample
    dtype: str = "fp32"
    placement: str = "hbm"

    @property
    def ids_per_sample(self) -> float:
        """Mean number of ids one sample looks up in this table."""
        if self.multi_hot is not None:
            return float(self.multi_hot)
        return float(self.pooling_factor if self.pooling_factor is not None else 1.0)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def weight_bytes(self) -> int:
        return self.rows * self.dim * self.dtype_bytes


@dataclass(frozen=True)
class Interaction:
    type: str = "dot"
    layers: int | None = None  # dcn only
    low_rank: int | None = None  # dcn only


@dataclass(frozen=True)
class Optimizer:
    type: str = "adagrad"
    lr: float = 0.01
    fused: bool = True


@dataclass(frozen=True)
class DataSpec:
    type: str = "synthetic"
    zipf_alpha: float | None = 1.05  # synthetic only
    path: str | None = None  # criteo-* only


# Held-out evaluation (docs/runner.md "Evaluation"). Default interval: 8 eval batches
# every 200 steps is about 1.5% of a CPU job's training time (a forward pass costs about
# a third of a training step; benchmarks/eval_quality.py measures it).
EVAL_DEFAULT_EVERY_STEPS = 200
EVAL_DEFAULT_BATCHES = 8
EVAL_MAX_BATCHES = 100_000
EVAL_MAX_SAMPLES = 100_000_000
# eval.samples on synthetic data: the held-out samples are made in chunks of this many,
# chunk c a function of (seed, rank, c) whatever the training batch size, so variants of
# a sweep with different batch sizes are judged on the same examples (train/heldout.py).
EVAL_SAMPLE_CHUNK = 256
EVAL_MAX_HOLDOUT_FRACTION = 0.5
EVAL_METRICS = ("auc", "ne", "log_loss", "calibration", "accuracy")


# eval.stop_when's metrics and whether higher is better
STOP_METRICS = {"auc": True, "accuracy": True, "ne": False, "log_loss": False}


@dataclass(frozen=True)
class StopWhen:
    """End the job (COMPLETED) when `metric` reaches `target`, or when it has not
    improved on its best for `patience` evaluations in a row."""

    metric: str = "auc"
    target: float | None = None
    patience: int | None = None


@dataclass(frozen=True)
class EvalSpec:
    enabled: bool = True
    every_steps: int = EVAL_DEFAULT_EVERY_STEPS  # 0: only at the end
    batches: int = EVAL_DEFAULT_BATCHES  # per rank, the same held-out batches each time
    # Per rank: the held-out set as a number of samples, the same examples whatever the
    # batch size (replaces `batches`; evaluated in batches of the training batch size,
    # the last one shorter). A sweep with a stopping rule sets it for all its variants.
    samples: int | None = None
    # Criteo data: "auto" (the last file when there are several, else the last 5% of
    # the samples), "last-file", or a fraction of the samples (the last ones).
    holdout: str | float = "auto"
    stop_when: StopWhen | None = None


# A sweep's stopping rule (issue 47, docs/sweeps.md): successive halving at rungs
# min_steps * reduction**k. `id` names the sweep the variant belongs to (submit writes
# it: the variants of one submit); min_steps 0 in a spec file: submit's default.
SWEEP_STOPS = ("asha",)
SWEEP_METRICS = ("auc", "ne", "loss")  # adapt/asha.py's METRICS (tests/test_asha.py checks they agree)


@dataclass(frozen=True)
class SweepSpec:
    stop: str = "asha"
    metric: str = "auc"  # one of adapt.asha.METRICS
    min_steps: int = 0  # the first rung's step; 0: chosen at submit
    reduction: int = 3
    id: str | None = None  # the sweep's id (submit writes it), shared by its variants


@dataclass(frozen=True)
class Scale:
    max_rows_per_table: int | None = None
    dim: int | None = None


@dataclass(frozen=True)
class JobSpec:
    name: str
    tables: tuple[TableSpec, ...]
    dense_features: int
    bottom_mlp: tuple[int, ...]
    top_mlp: tuple[int, ...]
    interaction: Interaction
    batch_size: int
    optimizer: Optimizer
    mixed_precision: str = "none"
    loader_workers: int = 2
    prefetch_batches: int = 2
    steps: int | None = 1000
    epochs: int | None = None
    data: DataSpec = DataSpec()
    seed: int = 0
    world_size: int = 1
    checkpoint_every_steps: int = 500
    metrics_every_steps: int = 10
    command: tuple[str, ...] | None = None
    eval: EvalSpec = EvalSpec()
    preset: str | None = None
    scale: Scale | None = None
    # "pkg.module:factory": factory(spec) -> torch.nn.Module replaces the DLRM model;
    # such a spec is estimated by tracing (slurm_dlrm.estimate.traced).
    custom_module: str | None = None
    backend: str = "auto"  # one of BACKENDS
    sweep: SweepSpec | None = None  # a sweep's stopping rule (issue 47)
    # A multi-node job (issue 48): `nodes` whole nodes with `gpus_per_node` ranks each
    # (world_size = nodes x gpus_per_node). None: the service picks the nodes from the
    # partition's GPUs per node where world_size passes one node's.
    nodes: int | None = None
    gpus_per_node: int | None = None
    source: str | None = field(default=None, compare=False)  # the file it came from, for messages

    @property
    def emb_dim(self) -> int:
        return self.tables[0].dim

    def to_dict(self) -> dict[str, Any]:
        """Plain data that `parse_spec` turns back into an equal spec."""
        out: dict[str, Any] = {"name": self.name}
        if self.preset is not None:
            out["preset"] = self.preset
        if self.scale is not None:
            out["scale"] = {k: v for k, v in vars(self.scale).items() if v is not None}
        out["tables"] = [_table_dict(t) for t in self.tables]
        out["dense_features"] = self.dense_features
        out["bottom_mlp"] = list(self.bottom_mlp)
        out["top_mlp"] = list(self.top_mlp)
        inter: dict[str, Any] = {"type": self.interaction.type}
        if self.interaction.type == "dcn":
            inter.update(layers=self.interaction.layers, low_rank=self.interaction.low_rank)
        out["interaction"] = inter
        out["batch_size"] = self.batch_size
        out["optimizer"] = {"type": self.optimizer.type, "lr": self.optimizer.lr, "fused": self.optimizer.fused}
        out["mixed_precision"] = self.mixed_precision
        out["loader_workers"] = self.loader_workers
        out["prefetch_batches"] = self.prefetch_batches
        if self.epochs is not None:
            out["epochs"] = self.epochs
        else:
            out["steps"] = self.steps
        data: dict[str, Any] = {"type": self.data.type}
        if self.data.type == "synthetic":
            data["zipf_alpha"] = self.data.zipf_alpha
        else:
            data["path"] = self.data.path
        out["data"] = data
        out["seed"] = self.seed
        out["world_size"] = self.world_size
        out["checkpoint_every_steps"] = self.checkpoint_every_steps
        out["metrics_every_steps"] = self.metrics_every_steps
        if self.eval != EvalSpec():  # left out when default: old specs keep their dict
            out["eval"] = (False if not self.eval.enabled else
                           {"every_steps": self.eval.every_steps, "batches": self.eval.batches,
                            "holdout": self.eval.holdout})
            if self.eval.enabled and self.eval.samples is not None:  # left out when unset: old fingerprints
                out["eval"]["samples"] = self.eval.samples
            sw = self.eval.stop_when
            if self.eval.enabled and sw is not None:
                out["eval"]["stop_when"] = {k: v for k, v in vars(sw).items() if v is not None}
        out["command"] = list(self.command) if self.command is not None else None
        if self.custom_module is not None:
            out["custom_module"] = self.custom_module
        if self.backend != "auto":  # left out by default: older specs keep their fingerprint
            out["backend"] = self.backend
        if self.sweep is not None:
            out["sweep"] = {k: v for k, v in vars(self.sweep).items() if v is not None}
        if self.nodes is not None:  # left out unless set, as backend
            out["nodes"] = self.nodes
            out["gpus_per_node"] = self.gpus_per_node
        return out


def _table_dict(t: TableSpec) -> dict[str, Any]:
    d: dict[str, Any] = {"name": t.name, "rows": t.rows, "dim": t.dim}
    if t.multi_hot is not None:
        d["multi_hot"] = t.multi_hot
    else:
        d["pooling_factor"] = t.pooling_factor
    d["dtype"] = t.dtype
    d["placement"] = t.placement
    return d


# ---------------------------------------------------------------- fingerprint

# Fields that do not change the job's structure (memory or speed): ignored.
_FINGERPRINT_IGNORES = ("name", "seed", "steps", "epochs", "checkpoint_every_steps", "metrics_every_steps",
                        "command", "preset", "scale", "eval", "sweep")


def spec_fingerprint(spec: JobSpec) -> str:
    """A short hash of the job's structure: two specs that differ only in names, seed,
    run length, learning rate, paths or the way they were written (preset + scale vs.
    tables spelled out) get the same fingerprint."""
    d = spec.to_dict()
    for key in _FINGERPRINT_IGNORES:
        d.pop(key, None)
    for t in d["tables"]:
        t.pop("name", None)
    d["optimizer"].pop("lr", None)
    d["data"].pop("path", None)
    d["data"].pop("zipf_alpha", None)  # changes which rows are hot, not how much memory
    blob = json.dumps(d, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ---------------------------------------------------------------- validation helpers

_MISSING: Any = object()


class _Obj:
    """Reads typed fields from one mapping and refuses the ones it never read."""

    def __init__(self, data: Any, where: str, source: str | None) -> None:
        if not isinstance(data, dict):
            raise SpecError(where or "spec", f"must be a mapping, got {_type_name(data)}", source)
        self.data = data
        self.where = where
        self.source = source
        self.seen: set[str] = set()

    def field(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def error(self, key: str, reason: str) -> SpecError:
        return SpecError(self.field(key), reason, self.source)

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        self.seen.add(key)
        if key not in self.data:
            if default is _MISSING:
                raise self.error(key, "missing")
            return default
        return self.data[key]

    def int_(self, key: str, default: Any = _MISSING, *, min_value: int = 1, max_value: int = MAX_COUNT) -> Any:
        value = self.raw(key, default)
        if value is None and default is None:
            return None
        if key not in self.data:
            return value
        return _as_int(value, self.field(key), self.source, min_value, max_value)

    def float_(self, key: str, default: Any = _MISSING, *, positive: bool = True,
               max_value: float | None = None) -> Any:
        value = self.raw(key, default)
        if key not in self.data or (value is None and default is None):
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(key, f"must be a number, got {_type_name(value)} {short_repr(value)}")
        if value != value or value in (float("inf"), float("-inf")):
            raise self.error(key, "must be a finite number")
        if positive and value <= 0:
            raise self.error(key, f"must be > 0, got {short_repr(value)}")
        if max_value is not None and value > max_value:
            raise self.error(key, f"must be <= {max_value:,g}, got {short_repr(value)}")
        return float(value)

    def str_(self, key: str, default: Any = _MISSING, *, choices: tuple[str, ...] | None = None) -> Any:
        value = self.raw(key, default)
        if key not in self.data or (value is None and default is None):
            return value
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, got {_type_name(value)} {short_repr(value)}")
        if choices is not None and value not in choices:
            raise self.error(key, f"must be one of {', '.join(choices)}; got {short_repr(value)}")
        return value

    def bool_(self, key: str, default: Any = _MISSING) -> Any:
        value = self.raw(key, default)
        if key not in self.data:
            return value
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {_type_name(value)} {short_repr(value)}")
        return value

    def int_list(self, key: str, default: Any = _MISSING, *, max_len: int = MAX_MLP_LAYERS,
                 max_value: int = MAX_WIDTH) -> Any:
        value = self.raw(key, default)
        if key not in self.data:
            return value
        if not isinstance(value, list):
            raise self.error(key, f"must be a list of integers, got {_type_name(value)} {short_repr(value)}")
        if not value:
            raise self.error(key, "must not be empty")
        if len(value) > max_len:
            raise self.error(key, f"at most {max_len:,} layers, got {len(value):,}")
        return tuple(_as_int(v, f"{self.field(key)}[{i}]", self.source, 1, max_value) for i, v in enumerate(value))

    def done(self) -> None:
        unknown = sorted(set(map(str, self.data)) - self.seen)
        if unknown:
            key = unknown[0] if len(unknown[0]) <= 60 else unknown[0][:60] + "..."  # a key is user text too
            raise self.error(key, "unknown field")


def _type_name(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list",
             dict: "mapping", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _as_int(value: Any, field: str, source: str | None, min_value: int, max_value: int = MAX_COUNT) -> int:
    # YAML may give 1.0e+7 for a row count; accept a float only if it is integral.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(field, f"must be an integer, got {_type_name(value)} {short_repr(value)}", source)
    if value < min_value:
        what = "> 0" if min_value == 1 else f">= {min_value}"
        raise SpecError(field, f"must be {what}, got {value}", source)
    if value > max_value:
        raise SpecError(field, f"must be <= {max_value:,} (the limit), got {short_repr(value)}", source)
    return value


# ---------------------------------------------------------------- parsing

def parse_spec(data: Any, source: str | None = None) -> JobSpec:
    """Validate plain data (from YAML/JSON) into a `JobSpec`; raise `SpecError`."""
    first = _Obj(data, "", source)
    preset_name = first.str_("preset", None, choices=PRESET_NAMES)
    # The preset's fields are defaults; the spec's own fields win (tables as a whole).
    merged: dict[str, Any] = copy.deepcopy(PRESETS[preset_name]) if preset_name else {}
    merged.update(data)
    view = _Obj(merged, "", source)
    view.seen.add("preset")
    name = view.str_("name")
    if not _NAME_RE.fullmatch(name):
        raise view.error("name", "1-64 of letters, digits, '.', '_' and '-'")
    scale = _parse_scale(view, source)

    raw_tables = view.raw("tables", None)
    if raw_tables is None:
        raise view.error("tables", "missing (give tables or a preset)")
    if not isinstance(raw_tables, list):
        raise view.error("tables", f"must be a list of tables, got {_type_name(raw_tables)}")
    if not raw_tables:
        raise view.error("tables", "must not be empty")
    if len(raw_tables) > MAX_TABLES:
        raise view.error("tables", f"at most {MAX_TABLES:,} tables, got {len(raw_tables):,}")
    tables = tuple(_parse_table(raw, i, source, scale) for i, raw in enumerate(raw_tables))
    seen_names: set[str] = set()
    for i, t in enumerate(tables):
        if t.name in seen_names:
            raise SpecError(f"tables[{i}].name", f"duplicate table name {t.name!r}", source)
        seen_names.add(t.name)
    dim = tables[0].dim
    for i, t in enumerate(tables):
        if t.dim != dim:
            # torchrec's DLRM interacts all embeddings with the bottom MLP's output.
            raise SpecError(f"tables[{i}].dim", f"must equal tables[0].dim ({dim}): DLRM needs one embedding dim", source)

    dense_features = view.int_("dense_features", max_value=MAX_WIDTH)
    bottom_mlp = view.int_list("bottom_mlp")
    if scale is not None and scale.dim is not None:
        bottom_mlp = bottom_mlp[:-1] + (scale.dim,)
    if bottom_mlp[-1] != dim:
        raise view.error("bottom_mlp", f"last width must equal the embedding dim ({dim}), got {bottom_mlp[-1]}")
    top_mlp = view.int_list("top_mlp")
    if top_mlp[-1] != 1:
        raise view.error("top_mlp", f"last width must be 1 (one logit), got {top_mlp[-1]}")
    if len(top_mlp) < 2:
        raise view.error("top_mlp", "needs at least two layers (torchrec's OverArch refuses one)")

    interaction = _parse_interaction(view.raw("interaction", {"type": "dot"}), source)
    batch_size = view.int_("batch_size", max_value=MAX_BATCH_SIZE)
    optimizer = _parse_optimizer(view.raw("optimizer", {"type": "adagrad"}), source)
    mixed_precision = view.str_("mixed_precision", "none", choices=MIXED_PRECISION)
    loader_workers = view.int_("loader_workers", 2, min_value=0, max_value=MAX_LOADER_WORKERS)
    prefetch_batches = view.int_("prefetch_batches", 2, min_value=0, max_value=MAX_PREFETCH_BATCHES)
    data_spec = _parse_data(view.raw("data", {"type": "synthetic"}), source)

    has_steps, has_epochs = view.has("steps"), view.has("epochs")
    if has_steps and has_epochs:
        raise view.error("epochs", "give steps or epochs, not both")
    if has_epochs:
        epochs = view.int_("epochs")
        view.seen.add("steps")
        steps = None
        if data_spec.type == "synthetic":
            raise view.error("epochs", "needs a data file (data.type criteo-tsv or criteo-npy); use steps with synthetic data")
    else:
        steps = view.int_("steps", 1000)
        view.seen.add("epochs")
        epochs = None
    seed = view.int_("seed", 0, min_value=0)
    world_size = view.int_("world_size", 1, max_value=MAX_WORLD_SIZE)
    nodes = view.int_("nodes", None, max_value=MAX_WORLD_SIZE)
    gpus_per_node = view.int_("gpus_per_node", None, max_value=MAX_WORLD_SIZE)
    if (nodes is None) != (gpus_per_node is None):
        raise view.error("nodes" if nodes is None else "gpus_per_node", "give nodes and gpus_per_node together")
    if nodes is not None:
        if nodes * gpus_per_node > MAX_WORLD_SIZE:
            raise view.error("nodes", f"nodes x gpus_per_node is at most {MAX_WORLD_SIZE}, got {nodes * gpus_per_node}")
        if view.has("world_size") and world_size != nodes * gpus_per_node:
            raise view.error("world_size", f"is {world_size}, but nodes x gpus_per_node is {nodes * gpus_per_node}")
        world_size = nodes * gpus_per_node
    checkpoint_every_steps = view.int_("checkpoint_every_steps", 500, min_value=0)
    metrics_every_steps = view.int_("metrics_every_steps", 10)
    eval_spec = _parse_eval(view.raw("eval", None), source)

    command_raw = view.raw("command", None)
    command: tuple[str, ...] | None = None
    if command_raw is not None:
        if not isinstance(command_raw, list) or not command_raw:
            raise view.error("command", "must be a non-empty list of strings (an argv) or null")
        if len(command_raw) > MAX_COMMAND_ARGS:
            raise view.error("command", f"at most {MAX_COMMAND_ARGS:,} arguments, got {len(command_raw):,}")
        for i, arg in enumerate(command_raw):
            if not isinstance(arg, str):
                raise SpecError(f"command[{i}]", f"must be a string, got {_type_name(arg)} {short_repr(arg)}", source)
            if "\0" in arg:  # no argv can carry it (execve would refuse it at run time)
                raise SpecError(f"command[{i}]", "must not contain a NUL character", source)
        if sum(len(arg.encode("utf-8", "surrogatepass")) + 1 for arg in command_raw) > MAX_COMMAND_BYTES:
            raise view.error("command", f"at most {MAX_COMMAND_BYTES // 1024} KiB of arguments in all")
        command = tuple(command_raw)

    custom_module = view.str_("custom_module", None)
    if custom_module is not None and len(custom_module) > MAX_CUSTOM_MODULE_CHARS:
        raise view.error("custom_module", f"at most {MAX_CUSTOM_MODULE_CHARS} characters, got {len(custom_module):,}")
    if custom_module is not None and not _CUSTOM_MODULE_RE.fullmatch(custom_module):
        raise view.error("custom_module", f"must look like 'package.module:factory', got {short_repr(custom_module)}")

    backend = view.str_("backend", "auto", choices=BACKENDS)
    sweep = _parse_sweep(view.raw("sweep", None), source, steps)

    view.done()
    return JobSpec(
        name=name, tables=tables, dense_features=dense_features, bottom_mlp=bottom_mlp, top_mlp=top_mlp,
        interaction=interaction, batch_size=batch_size, optimizer=optimizer, mixed_precision=mixed_precision,
        loader_workers=loader_workers, prefetch_batches=prefetch_batches, steps=steps, epochs=epochs,
        data=data_spec, seed=seed, world_size=world_size, checkpoint_every_steps=checkpoint_every_steps,
        metrics_every_steps=metrics_every_steps, command=command, eval=eval_spec, preset=preset_name, scale=scale,
        custom_module=custom_module, backend=backend, sweep=sweep, nodes=nodes, gpus_per_node=gpus_per_node,
        source=source,
    )


def _parse_scale(top: _Obj, source: str | None) -> Scale | None:
    raw = top.raw("scale", None)
    if raw is None:
        return None
    s = _Obj(raw, "scale", source)
    scale = Scale(max_rows_per_table=s.int_("max_rows_per_table", None, max_value=MAX_ROWS),
                  dim=s.int_("dim", None, max_value=MAX_DIM))
    s.done()
    return scale


def _parse_table(raw: Any, i: int, source: str | None, scale: Scale | None) -> TableSpec:
    t = _Obj(raw, f"tables[{i}]", source)
    name = t.str_("name", f"t{i}")
    if not _NAME_RE.fullmatch(name):
        raise t.error("name", "1-64 of letters, digits, '.', '_' and '-'")
    rows = t.int_("rows", max_value=MAX_ROWS)
    dim = t.int_("dim", max_value=MAX_DIM)
    if t.has("pooling_factor") and t.has("multi_hot"):
        raise t.error("multi_hot", "give pooling_factor or multi_hot, not both")
    multi_hot = t.int_("multi_hot", None, max_value=MAX_IDS_PER_SAMPLE)
    pooling_factor = t.float_("pooling_factor", None, max_value=MAX_IDS_PER_SAMPLE)
    if multi_hot is None and pooling_factor is None:
        pooling_factor = 1.0
    dtype = t.str_("dtype", "fp32", choices=DTYPES)
    placement = t.str_("placement", "hbm", choices=PLACEMENTS)
    t.done()
    if scale is not None:
        if scale.max_rows_per_table is not None:
            rows = min(rows, scale.max_rows_per_table)
        if scale.dim is not None:
            dim = scale.dim
    return TableSpec(name=name, rows=rows, dim=dim, pooling_factor=pooling_factor, multi_hot=multi_hot,
                     dtype=dtype, placement=placement)


def _parse_interaction(raw: Any, source: str | None) -> Interaction:
    o = _Obj(raw, "interaction", source)
    kind = o.str_("type", choices=INTERACTIONS)
    if kind == "dot":
        o.done()
        return Interaction("dot")
    inter = Interaction("dcn", layers=o.int_("layers", 3, max_value=MAX_MLP_LAYERS),
                        low_rank=o.int_("low_rank", 512, max_value=MAX_WIDTH))
    o.done()
    return inter


def _parse_optimizer(raw: Any, source: str | None) -> Optimizer:
    o = _Obj(raw, "optimizer", source)
    opt = Optimizer(type=o.str_("type", choices=OPTIMIZERS), lr=o.float_("lr", 0.01), fused=o.bool_("fused", True))
    o.done()
    return opt


def _parse_data(raw: Any, source: str | None) -> DataSpec:
    o = _Obj(raw, "data", source)
    kind = o.str_("type", "synthetic", choices=DATA_TYPES)
    if kind == "synthetic":
        spec = DataSpec(kind, zipf_alpha=o.float_("zipf_alpha", 1.05, positive=False))
        if spec.zipf_alpha is not None and spec.zipf_alpha < 0:
            raise o.error("zipf_alpha", f"must be >= 0, got {spec.zipf_alpha}")
    else:
        path = o.str_("path")
        if not path:
            raise o.error("path", "must not be empty")
        if len(path) > MAX_PATH_CHARS or "\0" in path:
            raise o.error("path", f"must be at most {MAX_PATH_CHARS:,} characters, without NUL")
        spec = DataSpec(kind, zipf_alpha=None, path=path)
    o.done()
    return spec


def _parse_eval(raw: Any, source: str | None) -> EvalSpec:
    if raw is None or raw is True:
        return EvalSpec()
    if raw is False:
        return EvalSpec(enabled=False)
    o = _Obj(raw, "eval", source)
    every = o.int_("every_steps", EVAL_DEFAULT_EVERY_STEPS, min_value=0)
    batches = o.int_("batches", EVAL_DEFAULT_BATCHES, max_value=EVAL_MAX_BATCHES)
    samples = o.int_("samples", None, max_value=EVAL_MAX_SAMPLES)
    holdout_raw = o.raw("holdout", "auto")
    holdout: str | float
    if isinstance(holdout_raw, str):
        if holdout_raw not in ("auto", "last-file"):
            raise o.error("holdout", f"must be auto, last-file or a fraction in (0, {EVAL_MAX_HOLDOUT_FRACTION}]; "
                                     f"got {short_repr(holdout_raw)}")
        holdout = holdout_raw
    else:
        holdout = o.float_("holdout", max_value=EVAL_MAX_HOLDOUT_FRACTION)
    stop = _parse_stop_when(o.raw("stop_when", None), source)
    o.done()
    return EvalSpec(enabled=True, every_steps=every, batches=batches, samples=samples, holdout=holdout,
                    stop_when=stop)


def _parse_stop_when(raw: Any, source: str | None) -> StopWhen | None:
    if raw is None:
        return None
    o = _Obj(raw, "eval.stop_when", source)
    metric = o.str_("metric", "auc", choices=tuple(STOP_METRICS))
    target = o.float_("target", None)
    patience = o.int_("patience", None, max_value=MAX_COUNT)
    if target is not None and STOP_METRICS[metric] and target > 1.0:
        raise o.error("target", f"{metric} is at most 1; got {short_repr(target)}")
    if target is None and patience is None:
        raise o.error("target", "give a target, a patience (evaluations without improvement), or both")
    o.done()
    return StopWhen(metric=metric, target=target, patience=patience)


def _parse_sweep(raw: Any, source: str | None, steps: int | None) -> SweepSpec | None:
    if raw is None:
        return None
    o = _Obj(raw, "sweep", source)
    stop = o.str_("stop", "asha", choices=SWEEP_STOPS)
    metric = o.str_("metric", "auc", choices=SWEEP_METRICS)
    reduction = o.int_("reduction", 3, min_value=2, max_value=100)
    min_steps = o.int_("min_steps", 0, min_value=0)
    sweep_id = o.str_("id", None)
    if sweep_id is not None and not _NAME_RE.fullmatch(sweep_id):
        raise o.error("id", "1-64 of letters, digits, '.', '_' and '-'")
    if steps is None:
        raise o.error("stop", "needs steps: an epochs spec's length is known only once its data is read")
    if min_steps >= steps:
        raise o.error("min_steps", f"must be below the spec's steps ({steps}), got {min_steps}")
    o.done()
    return SweepSpec(stop=stop, metric=metric, min_steps=min_steps, reduction=reduction, id=sweep_id)


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def read_spec_text(path: str | Path) -> str:
    """The text of a spec file, read whole (at most `MAX_SPEC_BYTES`); SpecError when it
    cannot be read, is not UTF-8, is too large or is not a regular file.

    Opened with O_NONBLOCK, then fstat on the open descriptor: open() of a FIFO with no
    writer returns at once instead of blocking, and the check is on the very file that
    would be read (a stat() before open() could be raced by a rename). A FIFO, a
    character device (/dev/zero, a tty) or a socket never ends or blocks, so only a
    regular file is read.
    """
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise SpecError("spec", f"cannot read {p}: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise SpecError("spec", f"cannot read {p}: it is {_file_kind(mode)}, not a regular file")
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_SPEC_BYTES:  # bounded: the file may grow while it is read
            chunk = os.read(fd, MAX_SPEC_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        raw = b"".join(chunks)
    except OSError as exc:
        raise SpecError("spec", f"cannot read {p}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError("spec", f"file is larger than {MAX_SPEC_BYTES >> 20} MiB (the limit)", str(p))
    try:
        return raw.decode()
    except UnicodeDecodeError as exc:
        raise SpecError("spec", f"cannot read {p}: {exc}") from None


def load_spec(path: str | Path, text: str | None = None) -> JobSpec:
    """Read a spec file (YAML; JSON accepted) and validate it. `text`: the file's text
    when the caller has read it already (`read_spec_text`), so it is read once."""
    import yaml  # parsing only; kept local so `import slurm_dlrm.spec` stays cheap

    from slurm_dlrm.strict_load import DuplicateKeyError, InputLimitError, load_json, load_yaml

    p = Path(path)
    if text is None:
        text = read_spec_text(p)
    try:
        data = load_json(text) if p.suffix.lower() == ".json" else load_yaml(text)
    except (DuplicateKeyError, InputLimitError) as exc:
        raise SpecError("spec", str(exc), str(p)) from None
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        first = " ".join(str(exc).split())[:200]
        raise SpecError("spec", f"not valid {'JSON' if p.suffix.lower() == '.json' else 'YAML'}: {first}", str(p)) from None
    if data is None:
        raise SpecError("spec", "file is empty", str(p))
    return parse_spec(data, str(p))
