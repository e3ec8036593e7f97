"""Atomic, verified checkpoints (slurm_dlrm.train.checkpoint)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from slurm_dlrm.train import checkpoint as ckpt  # noqa: E402

EXPECT = {"world_size": 1, "spec_fingerprint": "abc", "plan_hash": "p1"}


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(10, 4, generator=g)
    return {
        "w": big[2:6],  # a view of a larger storage: only the view is stored
        "b": torch.randn(3, generator=g).to(torch.bfloat16),
        "step": torch.tensor(7.0),
        "ids": torch.arange(5, dtype=torch.int64),
    }


def test_roundtrip_copies_into_live_tensors(tmp_path: Path):
    saved_state = _state(1)
    path = ckpt.save(tmp_path, 40, saved_state, EXPECT)
    assert path.name == "step-000000040"
    assert (path / "rank0.bin").stat().st_size == 4 * 4 * 4 + 3 * 2 + 4 + 5 * 8
    found = ckpt.newest_valid(tmp_path, EXPECT)
    assert found is not None and found.step == 40
    live = _state(2)
    ckpt.load_into(live, ckpt.read_rank(found, 0))
    for name, t in saved_state.items():
        assert torch.equal(live[name], t), name
    assert live["b"].dtype == torch.bfloat16


def test_mismatched_shapes_load_nothing(tmp_path: Path):
    ckpt.save(tmp_path, 1, {"a": torch.ones(3), "b": torch.ones(2)}, EXPECT)
    found = ckpt.newest_valid(tmp_path, EXPECT)
    assert found is not None
    live = {"a": torch.zeros(3), "b": torch.zeros(4)}
    with pytest.raises(ckpt.CheckpointError, match="b"):
        ckpt.load_into(live, ckpt.read_rank(found, 0))
    assert torch.equal(live["a"], torch.zeros(3))  # untouched: checked before copying
    with pytest.raises(ckpt.CheckpointError, match="missing"):
        ckpt.load_into({"a": torch.zeros(3)}, {"c": torch.zeros(3)})


def test_corrupt_partial_and_foreign_checkpoints_are_skipped(tmp_path: Path, caplog):
    for step in (10, 20, 30, 40):
        ckpt.save(tmp_path, step, _state(step), EXPECT)
    # 40: a flipped byte; 30: manifest missing (a crash mid-write by an older version);
    # 20: written for another spec. 10 is the newest good one.
    data = bytearray((tmp_path / "step-000000040" / "rank0.bin").read_bytes())
    data[5] ^= 0xFF
    (tmp_path / "step-000000040" / "rank0.bin").write_bytes(bytes(data))
    (tmp_path / "step-000000030" / "manifest.json").unlink()
    m = tmp_path / "step-000000020" / "manifest.json"
    m.write_text(json.dumps(dict(json.loads(m.read_text()), spec_fingerprint="other")))
    with caplog.at_level(logging.WARNING):
        found = ckpt.newest_valid(tmp_path, EXPECT)
    assert found is not None and found.step == 10
    text = caplog.text
    assert "step-000000040" in text and "sha256" in text
    assert "step-000000030" in text and "no manifest" in text
    assert "step-000000020" in text and "spec_fingerprint" in text


def test_truncated_file_and_bad_manifest(tmp_path: Path):
    ckpt.save(tmp_path, 5, _state(5), EXPECT)
    p = tmp_path / "step-000000005"
    (p / "rank0.bin").write_bytes((p / "rank0.bin").read_bytes()[:-3])
    with pytest.raises(ckpt.CheckpointError, match="bytes"):
        ckpt.verify(p, EXPECT)
    (p / "manifest.json").write_text("{not json")
    with pytest.raises(ckpt.CheckpointError, match="unreadable"):
        ckpt.verify(p, EXPECT)
    assert ckpt.newest_valid(tmp_path, EXPECT) is None


def test_prune_keeps_newest_and_stale_tmp_is_removed(tmp_path: Path):
    for step in (1, 2, 3, 4):
        ckpt.save(tmp_path, step, {"x": torch.ones(1) * step}, EXPECT)
    ckpt.prune(tmp_path, 2, 4)
    assert [s for s, _ in ckpt.list_steps(tmp_path)] == [4, 3]
    # A later step left by something else never pushes out the one just written.
    ckpt.save(tmp_path, 9, {"x": torch.ones(1)}, dict(EXPECT, spec_fingerprint="other"))
    ckpt.save(tmp_path, 5, {"x": torch.ones(1)}, EXPECT)
    ckpt.prune(tmp_path, 2, 5)
    assert [s for s, _ in ckpt.list_steps(tmp_path)] == [9, 5, 4]
    assert ckpt.remove_all(tmp_path) == 3 and ckpt.list_steps(tmp_path) == []
    for step in (3, 4):
        ckpt.save(tmp_path, step, {"x": torch.ones(1) * step}, EXPECT)
    tmp = ckpt.prepare_tmp(tmp_path, 5)
    (tmp / "rank0.bin").write_bytes(b"half")
    assert [s for s, _ in ckpt.list_steps(tmp_path)] == [4, 3]  # never listed
    ckpt.remove_stale_tmp(tmp_path)
    assert not tmp.exists()
    # Saving the same step twice replaces it.
    ckpt.save(tmp_path, 4, {"x": torch.ones(1) * 9}, EXPECT)
    found = ckpt.newest_valid(tmp_path, EXPECT)
    assert found is not None and ckpt.read_rank(found, 0)["x"].item() == 9
