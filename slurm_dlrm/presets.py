"""Named presets for the public DLRM configurations.

Facts from /work/shared/reference/dlrm-configs.md (facebookresearch/dlrm, MLPerf
Training v1 DLRM, mlcommons/training recommendation_v2/torchrec_dlrm). A preset gives
defaults for the model's shape; any field of the spec overrides it, and the `scale`
knobs shrink it (see `slurm_dlrm.spec`). Pure data, no imports.

MLP lists follow the spec's convention: output widths only (the input width of the
bottom MLP is `dense_features`, that of the top/over MLP follows from the interaction).
"""

from __future__ import annotations

from typing import Any

CRITEO_KAGGLE_ROWS = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683,
    8351593, 3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105,
    142572,
)
CRITEO_TB10M_ROWS = (
    9980333, 36084, 17217, 7378, 20134, 3, 7112, 1442, 61, 9758201,
    1333352, 313829, 10, 2208, 11156, 122, 4, 970, 14, 9994222, 7267859, 9946608, 415421,
    12420, 101, 36,
)
CRITEO_TB40M_ROWS = (
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63,
    38532951, 2953546, 403346, 10, 2208, 11938, 155, 4, 976, 14, 39979771, 25641295,
    39664984, 585935, 12972, 108, 36,
)
MLPERF_DCNV2_ROWS = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000,
    3067956, 405282, 10, 2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000,
    590152, 12973, 108, 36,
)
MLPERF_DCNV2_MULTI_HOT = (
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
)


def _one_hot_tables(rows: tuple[int, ...], dim: int) -> list[dict[str, Any]]:
    return [{"name": f"t{i}", "rows": r, "dim": dim, "pooling_factor": 1.0} for i, r in enumerate(rows)]


# Each preset is a partial spec (plain data, as a user would write it).
PRESETS: dict[str, dict[str, Any]] = {
    # facebookresearch/dlrm bench/dlrm_s_criteo_kaggle.sh: 13-512-256-64-16, 367-512-256-1.
    "criteo-kaggle": {
        "tables": _one_hot_tables(CRITEO_KAGGLE_ROWS, 16),
        "dense_features": 13,
        "bottom_mlp": [512, 256, 64, 16],
        "top_mlp": [512, 256, 1],
        "interaction": {"type": "dot"},
        "batch_size": 128,
        "optimizer": {"type": "sgd", "lr": 0.1, "fused": True},
    },
    # facebookresearch/dlrm bench/dlrm_s_criteo_terabyte.sh with --max-ind-range=10000000:
    # 13-512-256-64, 512-512-256-1.
    "criteo-terabyte-10m": {
        "tables": _one_hot_tables(CRITEO_TB10M_ROWS, 64),
        "dense_features": 13,
        "bottom_mlp": [512, 256, 64],
        "top_mlp": [512, 256, 1],
        "interaction": {"type": "dot"},
        "batch_size": 2048,
        "optimizer": {"type": "sgd", "lr": 0.1, "fused": True},
    },
    # MLPerf Training v1 DLRM: 13-512-256-128, 479-1024-1024-512-256-1.
    "criteo-terabyte-40m": {
        "tables": _one_hot_tables(CRITEO_TB40M_ROWS, 128),
        "dense_features": 13,
        "bottom_mlp": [512, 256, 128],
        "top_mlp": [1024, 1024, 512, 256, 1],
        "interaction": {"type": "dot"},
        "batch_size": 2048,
        "optimizer": {"type": "sgd", "lr": 1.0, "fused": True},
    },
    # mlcommons/training recommendation_v2/torchrec_dlrm: DLRM-DCNv2, multi-hot,
    # Adagrad lr 0.005, global batch 65,536 (here on one process; lower it or raise
    # world_size for a per-GPU batch).
    "mlperf-dcnv2": {
        "tables": [
            {"name": f"t{i}", "rows": r, "dim": 128, "multi_hot": h}
            for i, (r, h) in enumerate(zip(MLPERF_DCNV2_ROWS, MLPERF_DCNV2_MULTI_HOT, strict=True))
        ],
        "dense_features": 13,
        "bottom_mlp": [512, 256, 128],
        "top_mlp": [1024, 1024, 512, 256, 1],
        "interaction": {"type": "dcn", "layers": 3, "low_rank": 512},
        "batch_size": 65536,
        "optimizer": {"type": "adagrad", "lr": 0.005, "fused": True},
    },
}

PRESET_NAMES = tuple(PRESETS)
