"""Batch sources of the runner: synthetic power-law data and the Criteo readers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchrec")
spec_mod = pytest.importorskip("slurm_dlrm.spec")

from slurm_dlrm.errors import BadInput, SpecError  # noqa: E402
from slurm_dlrm.train.data import (  # noqa: E402
    CriteoNpyBatches,
    CriteoTsvBatches,
    Prefetcher,
    SyntheticBatches,
    parse_criteo_lines,
    zipf_ids,
)


def make_spec(**over):
    base = {
        "name": "t",
        "tables": [
            {"rows": 1000, "dim": 8, "pooling_factor": 3.0},
            {"rows": 50, "dim": 8, "multi_hot": 4},
            {"rows": 7, "dim": 8},
        ],
        "dense_features": 13,
        "bottom_mlp": [16, 8],
        "top_mlp": [8, 1],
        "batch_size": 256,
        "optimizer": {"type": "adagrad", "lr": 0.05},
        "seed": 3,
        "eval": False,  # the readers' own tests read every sample; holdouts are tested apart
    }
    base.update(over)
    return spec_mod.parse_spec(base)


def test_zipf_ids_stay_in_range_and_are_skewed():
    rng = np.random.default_rng(0)
    rows = 10_000
    ids = zipf_ids(rng, rows, 1.05, 200_000)
    assert ids.min() >= 0 and ids.max() < rows
    counts = np.bincount(ids, minlength=rows)
    top = np.sort(counts)[::-1]
    # Power law: the hottest 1% of rows take far more than 1% of the lookups...
    assert top[: rows // 100].sum() > 0.3 * len(ids)
    # ...and uniform ids (alpha 0) do not.
    flat = np.bincount(zipf_ids(rng, rows, 0.0, 200_000), minlength=rows)
    assert np.sort(flat)[::-1][: rows // 100].sum() < 0.03 * len(ids)


def test_synthetic_batches_follow_the_spec_and_are_a_function_of_the_step():
    spec = make_spec()
    src = SyntheticBatches(spec)
    b = src.batch(5)
    kjt = b.sparse_features
    assert kjt.keys() == ["t0", "t1", "t2"]
    assert tuple(b.dense_features.shape) == (256, 13)
    assert tuple(b.labels.shape) == (256,)
    per_table = kjt.to_dict()
    assert abs(per_table["t0"].lengths().float().mean().item() - 3.0) < 0.4
    assert per_table["t1"].lengths().tolist() == [4] * 256
    assert per_table["t2"].lengths().tolist() == [1] * 256
    for name, rows in (("t0", 1000), ("t1", 50), ("t2", 7)):
        v = per_table[name].values()
        assert int(v.min()) >= 0 and int(v.max()) < rows
    # Same step -> same batch, from a fresh source too (what resume relies on).
    again = SyntheticBatches(spec).batch(5)
    assert np.array_equal(again.sparse_features.values().numpy(), kjt.values().numpy())
    assert np.array_equal(again.dense_features.numpy(), b.dense_features.numpy())
    other = src.batch(6)
    assert not np.array_equal(other.dense_features.numpy(), b.dense_features.numpy())
    # The ring of made-up-front batches holds exactly what per-step making gives.
    unringed = SyntheticBatches(spec, ring_batches=0)
    assert not unringed.ring and len(src.ring) == 32
    assert np.array_equal(unringed.batch(5).sparse_features.values().numpy(), kjt.values().numpy())
    assert np.array_equal(src.batch(37).dense_features.numpy(), unringed.batch(5).dense_features.numpy())
    assert not np.array_equal(unringed.batch(37).dense_features.numpy(), b.dense_features.numpy())
    # Another rank sees other data.
    assert not np.array_equal(SyntheticBatches(spec, rank=1).batch(5).dense_features.numpy(),
                              b.dense_features.numpy())


def _tsv_line(i: int) -> str:
    dense = [str(i * 3 + k) if (i + k) % 5 else "" for k in range(13)]
    dense[1] = "-2"  # Criteo has a few negative counts
    sparse = [format(0x1000 * i + k, "08x") if (i + k) % 7 else "" for k in range(26)]
    return "\t".join([str(i % 2), *dense, *sparse]) + "\n"


def test_parse_criteo_lines_handles_missing_and_negative_values():
    dense, sparse, labels = parse_criteo_lines([_tsv_line(1), _tsv_line(2)])
    assert labels.tolist() == [1.0, 0.0]
    assert dense.shape == (2, 13) and sparse.shape == (2, 26)
    assert dense[0, 0] == pytest.approx(np.log1p(3))
    assert dense[0, 1] == 0.0  # negative -> 0 before log1p
    assert dense[0, 4] == 0.0  # (1+4) % 5 == 0: missing -> 0
    assert sparse[0, 1] == 0x1001
    assert sparse[0, 6] == 0  # (1+6) % 7 == 0: missing -> 0
    with pytest.raises(BadInput, match="40"):
        parse_criteo_lines(["1\t2\t3\n"])


def test_criteo_tsv_batches_in_order_resume_and_wrap(tmp_path: Path):
    path = tmp_path / "day_0"
    path.write_text("".join(_tsv_line(i) for i in range(10)))
    spec = make_spec(batch_size=3, data={"type": "criteo-tsv", "path": str(path)})
    src = CriteoTsvBatches(spec)
    assert src.n_samples == 10 and src.steps_per_epoch == 3
    seq = [src.batch(s) for s in range(5)]
    assert seq[0].labels.tolist() == [0.0, 1.0, 0.0]
    assert seq[1].labels.tolist() == [1.0, 0.0, 1.0]
    # ids are the hashes mod each table's rows, one id per sample and feature
    t0 = seq[0].sparse_features.to_dict()["t0"]
    assert t0.values().tolist() == [0 % 1000, (0x1000 + 0) % 1000, (0x2000 + 0) % 1000]
    assert seq[0].sparse_features.to_dict()["t2"].values().max().item() < 7
    # Step 3 wraps to the start (epoch 2); a fresh reader asked for step 4 first agrees.
    assert seq[3].labels.tolist() == seq[0].labels.tolist()
    fresh = CriteoTsvBatches(spec).batch(4)
    assert np.array_equal(fresh.dense_features.numpy(), seq[4].dense_features.numpy())
    # Two ranks split each global batch.
    r1 = CriteoTsvBatches(make_spec(batch_size=2, data={"type": "criteo-tsv", "path": str(path)}), rank=1, world_size=2)
    assert r1.steps_per_epoch == 2
    assert r1.batch(0).labels.tolist() == [0.0, 1.0]  # lines 2, 3
    with pytest.raises(SpecError, match="dense"):
        CriteoTsvBatches(make_spec(dense_features=4, data={"type": "criteo-tsv", "path": str(path)}))


def _write_npy_day(prefix: Path, n: int, start: int) -> None:
    idx = np.arange(start, start + n)
    np.save(f"{prefix}_dense.npy", np.repeat(idx[:, None], 13, axis=1).astype(np.float32))
    np.save(f"{prefix}_sparse.npy", (idx[:, None] * 100 + np.arange(26)[None, :]).astype(np.int64))
    np.save(f"{prefix}_labels.npy", (idx % 2).reshape(-1, 1).astype(np.int32))


def test_criteo_npy_batches_span_files(tmp_path: Path):
    _write_npy_day(tmp_path / "day_0", 5, 0)
    _write_npy_day(tmp_path / "day_1", 5, 5)
    spec = make_spec(batch_size=4, data={"type": "criteo-npy", "path": str(tmp_path)})
    src = CriteoNpyBatches(spec)
    assert src.n_samples == 10 and src.steps_per_epoch == 2
    b1 = src.batch(1)  # rows 4..7: across day_0 and day_1
    assert b1.dense_features[:, 0].tolist() == [4.0, 5.0, 6.0, 7.0]
    assert b1.labels.tolist() == [0.0, 1.0, 0.0, 1.0]
    t1 = b1.sparse_features.to_dict()["t1"].values().tolist()
    assert t1 == [(r * 100 + 1) % 50 for r in (4, 5, 6, 7)]
    assert src.batch(2).dense_features[0, 0].item() == 0.0  # wraps
    one_day = CriteoNpyBatches(make_spec(batch_size=4, data={"type": "criteo-npy", "path": str(tmp_path / "day_1")}))
    assert one_day.batch(0).dense_features[0, 0].item() == 5.0
    with pytest.raises(SpecError, match="categorical"):
        CriteoNpyBatches(make_spec(tables=[{"rows": 10, "dim": 8}] * 27, batch_size=4,
                                   data={"type": "criteo-npy", "path": str(tmp_path)}))
    with pytest.raises(SpecError, match="no batch"):
        CriteoNpyBatches(make_spec(batch_size=64, data={"type": "criteo-npy", "path": str(tmp_path)}))


def test_prefetcher_yields_every_step_in_order_with_threads(tmp_path: Path):
    path = tmp_path / "day_0"
    path.write_text("".join(_tsv_line(i) for i in range(12)))
    src = CriteoTsvBatches(make_spec(batch_size=2, data={"type": "criteo-tsv", "path": str(path)}))
    pf = Prefetcher(src, 2, 9, workers=2, depth=3)
    got = [(step, b.labels.tolist()) for step, b in pf]
    pf.close()
    assert [s for s, _ in got] == list(range(2, 9))
    direct = CriteoTsvBatches(make_spec(batch_size=2, data={"type": "criteo-tsv", "path": str(path)}))
    assert [labels for _, labels in got] == [direct.batch(s).labels.tolist() for s in range(2, 9)]


# ---------------------------------------------------------------- issue 39: planted labels, holdouts


def test_planted_labels_depend_on_dense_and_table_ids_and_are_redrawn_every_step():
    from slurm_dlrm.train.data import PlantedModel
    from slurm_dlrm.train.evaluation import compute
    from slurm_dlrm.train.heldout import eval_batches

    spec = make_spec(eval={"batches": 8})
    src = SyntheticBatches(spec)
    planted = PlantedModel(spec)
    # Hot ids carry weights, cold ones none: the tables matter, not only dense features.
    hot_ids, hot_w = planted.hot[0]
    assert len(hot_ids) == 128 and np.count_nonzero(hot_w) == 128
    assert planted.id_weights(0, hot_ids).tolist() == hot_w.tolist()
    cold = np.setdiff1d(np.arange(1000), hot_ids)
    assert not planted.id_weights(0, cold).any()
    # Same features every 32 steps, other labels: a repeat cannot be memorised.
    assert src.repeat_every_steps == 32
    a, b = src.batch(5), src.batch(37)
    assert np.array_equal(a.dense_features.numpy(), b.dense_features.numpy())
    assert not np.array_equal(a.labels.numpy(), b.labels.numpy())
    assert np.array_equal(SyntheticBatches(spec).batch(37).labels.numpy(), b.labels.numpy())  # resume
    # The eval stream: other samples, the same planted model; its AUC beats dense-only.
    batches, probs = eval_batches(spec)
    assert len(batches) == 8 and probs is not None and probs.numel() == 8 * 256
    ev_dense = torch.cat([x.dense_features for x in batches])
    train_dense = torch.from_numpy(src._dense)
    assert not (ev_dense[:, None, :] == train_dense[None, :64, :]).all(-1).any()
    labels = torch.cat([x.labels for x in batches])
    best = compute(probs, labels).auc
    dense_only = compute(torch.sigmoid(ev_dense.double() @ torch.from_numpy(planted.dense_w)), labels).auc
    assert 0.7 < best and best > dense_only + 0.03


def test_criteo_holdout_last_file_or_fraction(tmp_path: Path):
    for day in range(3):
        np.save(tmp_path / f"day_{day}_dense.npy", np.full((20, 13), day, dtype=np.float32))
        np.save(tmp_path / f"day_{day}_sparse.npy", np.arange(20 * 26).reshape(20, 26) + 1000 * day)
        np.save(tmp_path / f"day_{day}_labels.npy", np.zeros(20, dtype=np.int32))
    data = {"type": "criteo-npy", "path": str(tmp_path)}
    auto = make_spec(batch_size=4, data=data, eval={"batches": 100})
    train = CriteoNpyBatches(auto)
    assert train.n_samples == 40 and train.steps_per_epoch == 10  # days 0 and 1
    assert {float(train.batch(s).dense_features[0, 0]) for s in range(10)} == {0.0, 1.0}
    from slurm_dlrm.train.heldout import eval_batches

    held, planted = eval_batches(auto)
    assert planted is None and len(held) == 5  # all of day 2, no more
    assert {float(b.dense_features[0, 0]) for b in held} == {2.0}
    frac = make_spec(batch_size=4, data=data, eval={"holdout": 0.2})
    assert CriteoNpyBatches(frac).n_samples == 48
    one_day = make_spec(batch_size=4, data={"type": "criteo-npy", "path": str(tmp_path / "day_0")},
                        eval={"holdout": "last-file"})
    with pytest.raises(SpecError, match="eval.holdout"):
        CriteoNpyBatches(one_day)
