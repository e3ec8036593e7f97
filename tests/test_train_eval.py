"""Issue 39: held-out evaluation metrics (both implementations), the `eval:` spec
section, and evaluations in the store (ingested from a job's metrics file)."""

from __future__ import annotations

import math

import pytest

from slurm_dlrm import spec as spec_mod
from slurm_dlrm.errors import SpecError

torch = pytest.importorskip("torch")
pytest.importorskip("torchrec")

from slurm_dlrm.train.evaluation import EvalAccumulator, compute  # noqa: E402


def _cases():
    g = torch.Generator().manual_seed(7)
    p = torch.rand(3000, generator=g)
    yield p, (torch.rand(3000, generator=g) < p).float()  # informative
    q = torch.round(torch.rand(500, generator=g) * 4) / 4  # many ties
    yield q, (torch.rand(500, generator=g) < 0.3).float()
    yield torch.tensor([0.2, 0.7, 0.9]), torch.ones(3)  # one class only
    yield torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0])  # clamped logs


@pytest.mark.parametrize("case", range(4))
def test_reference_and_torchrec_metrics_are_identical(case: int):
    preds, labels = list(_cases())[case]
    assert compute(preds, labels, "reference") == compute(preds, labels, "torchrec")


def test_metrics_against_hand_computed_values():
    preds = torch.tensor([0.9, 0.8, 0.3, 0.1])
    labels = torch.tensor([1.0, 0.0, 1.0, 0.0])
    r = compute(preds, labels)
    assert r.auc == pytest.approx(0.75)  # 3 of the 4 (positive, negative) pairs ordered right
    bce = float(torch.nn.functional.binary_cross_entropy(preds.double(), labels.double()))
    assert r.log_loss == pytest.approx(bce, rel=1e-12)  # nats, like the training loss
    assert r.ne == pytest.approx(bce / math.log(2.0))  # base rate 0.5: 1 bit of entropy
    assert r.calibration == pytest.approx(2.1 / 2.0)
    assert r.accuracy == 0.5 and r.samples == 4  # 0.9 -> 1 and 0.1 -> 0 right and r.label_mean == 0.5
    acc = EvalAccumulator()
    acc.update(preds[:2], labels[:2])
    acc.update(preds[2:], labels[2:])
    assert acc.compute() == r
    with pytest.raises(ValueError, match="backend"):
        compute(preds, labels, "nope")


BASE = {"name": "e", "tables": [{"rows": 10, "dim": 4}], "dense_features": 3, "bottom_mlp": [4],
        "top_mlp": [4, 1], "batch_size": 8, "optimizer": {"type": "sgd"}}


@pytest.mark.parametrize(("value", "field"), [
    ({"every_steps": -1}, "eval.every_steps"),
    ({"every_steps": "10"}, "eval.every_steps"),
    ({"batches": 0}, "eval.batches"),
    ({"holdout": 0.9}, "eval.holdout"),
    ({"holdout": "first-file"}, "eval.holdout"),
    ({"holdout": 0}, "eval.holdout"),
    ({"batch": 3}, "eval.batch"),
    ("yes", "eval"),
])
def test_bad_eval_values_name_the_field(value, field):
    with pytest.raises(SpecError) as err:
        spec_mod.parse_spec({**BASE, "eval": value})
    assert err.value.field == field


def test_eval_section_defaults_round_trip_and_fingerprint():
    plain = spec_mod.parse_spec(BASE)
    assert plain.eval.enabled and plain.eval.every_steps == spec_mod.EVAL_DEFAULT_EVERY_STEPS
    assert "eval" not in plain.to_dict()  # old specs keep their dict (and fingerprint)
    custom = spec_mod.parse_spec({**BASE, "eval": {"every_steps": 0, "batches": 3, "holdout": 0.1}})
    off = spec_mod.parse_spec({**BASE, "eval": False})
    for s in (custom, off):
        assert spec_mod.parse_spec(s.to_dict()) == s
        assert spec_mod.spec_fingerprint(s) == spec_mod.spec_fingerprint(plain)
    assert not off.eval.enabled


def test_stop_when_rule_target_and_patience():
    from slurm_dlrm.train.evaluation import stop_reason

    up = [(100, 0.70), (200, 0.74), (300, 0.73), (400, 0.74)]
    assert stop_reason(up[:2], "auc", True, 0.74, None) == "auc 0.7400 at step 200 reached the target 0.74"
    assert stop_reason(up[:1], "auc", True, 0.74, None) is None
    # patience 2: neither 0.73 nor 0.74 beat 0.74 (equal is no improvement)
    assert stop_reason(up, "auc", True, None, 2) == \
        "auc has not improved on 0.7400 in 2 evaluations (last 0.7400 at step 400)"
    assert stop_reason(up[:3], "auc", True, None, 2) is None  # only 0.73 after the best
    assert stop_reason(up, "auc", True, None, 3) is None  # 0.74 at 200 beat 0.70
    down = [(1, 0.9), (2, 0.85)]
    assert stop_reason(down, "ne", False, 0.86, None) is not None  # lower is better
    assert stop_reason(down, "ne", False, None, 1) is None
    assert stop_reason([], "auc", True, 0.5, 1) is None


@pytest.mark.parametrize(("stop_when", "field"), [
    ({"metric": "speed", "target": 1}, "eval.stop_when.metric"),
    ({"target": 1.5}, "eval.stop_when.target"),
    ({}, "eval.stop_when.target"),
    ({"patience": 0}, "eval.stop_when.patience"),
])
def test_bad_stop_when_names_the_field(stop_when, field):
    with pytest.raises(SpecError) as err:
        spec_mod.parse_spec({**BASE, "eval": {"stop_when": stop_when}})
    assert err.value.field == field


def test_evaluator_makes_held_out_batches_one_at_a_time_with_the_same_metrics():
    """Issue 51: the Evaluator makes each held-out batch when it needs it and keeps only
    a 3 x samples buffer; the batches and the metrics are those of the set made up front."""
    from slurm_dlrm.spec import parse_spec
    from slurm_dlrm.train.evaluation import Evaluator
    from slurm_dlrm.train.heldout import HeldOut, eval_batches

    spec = parse_spec({"name": "e", "tables": [{"rows": 500, "dim": 8, "pooling_factor": 2.0},
                                                {"rows": 90, "dim": 8, "multi_hot": 3}],
                       "dense_features": 4, "bottom_mlp": [8], "top_mlp": [4, 1], "batch_size": 64,
                       "eval": {"batches": 5}})
    upfront, planted = eval_batches(spec)
    held = HeldOut(spec)
    made = []

    def predict(batch):
        made.append(batch)
        w = torch.arange(1, 5, dtype=torch.float32)
        return torch.sigmoid(batch.dense_features @ w), batch.labels

    for k in range(held.count):  # the same batch k, made again
        b, p = held.batch(k)
        assert torch.equal(b.dense_features, upfront[k].dense_features)
        assert torch.equal(b.sparse_features.values(), upfront[k].sparse_features.values())
        assert torch.equal(b.labels, upfront[k].labels)
        assert p is not None
    ev = Evaluator(held, 0, 10)
    rec = ev.run(predict, 10, 0.0)
    assert rec is not None and len(made) == 5
    preds = torch.cat([predict(b)[0] for b in upfront])
    labels = torch.cat([b.labels for b in upfront])
    want = compute(preds, labels)
    assert rec["eval_auc"] == want.auc and rec["eval_ne"] == want.ne and rec["eval_samples"] == 5 * 64
    assert planted is not None and rec["planted_auc"] == compute(planted, labels).auc


def _samples_of(batches) -> tuple[list, list]:
    """Every sample of `batches` as (dense row, label, ids of each key), and their planted P(click)."""
    rows, planted = [], []
    for b, p in batches:
        kjt = b.sparse_features
        keys, n = list(kjt.keys()), int(b.labels.shape[0])
        lengths = kjt.lengths().view(len(keys), n).tolist()
        values = kjt.values().tolist()
        at, ids = 0, [[None] * n for _ in keys]
        for k in range(len(keys)):
            for i in range(n):
                ids[k][i] = values[at : at + lengths[k][i]]
                at += lengths[k][i]
        assert at == len(values)
        for i in range(n):
            rows.append((b.dense_features[i].tolist(), float(b.labels[i]), [ids[k][i] for k in range(len(keys))]))
        planted += p.tolist()
    return rows, planted


def test_eval_samples_are_the_same_examples_whatever_the_batch_size():
    """Issue 47: a sweep's variants are judged on one held-out set. With `eval.samples`
    the held-out samples do not depend on the batch size (made in fixed chunks); they are
    evaluated in batches of the training batch size, the last one shorter. With
    `eval.batches` each batch size had its own set."""
    from slurm_dlrm.spec import parse_spec
    from slurm_dlrm.train.evaluation import Evaluator
    from slurm_dlrm.train.heldout import HeldOut

    base = {"name": "e", "tables": [{"rows": 500, "dim": 8, "pooling_factor": 2.0},
                                    {"rows": 90, "dim": 8, "multi_hot": 3}, {"rows": 40, "dim": 8}],
            "dense_features": 4, "bottom_mlp": [8], "top_mlp": [4, 1]}
    seen = {}
    for b in (64, 300):
        held = HeldOut(parse_spec({**base, "batch_size": b, "eval": {"samples": 1000}}))
        assert held.count == math.ceil(1000 / b) and held.samples == 1000
        made = [held.batch(k) for k in range(held.count)]
        assert [int(x.labels.shape[0]) for x, _ in made] == [b] * (held.count - 1) + [1000 - b * (held.count - 1)]
        seen[b] = _samples_of(made)

        def predict(batch):
            w = torch.arange(1, 5, dtype=torch.float32)
            return torch.sigmoid(batch.dense_features @ w), batch.labels

        rec = Evaluator(held, 0, 10).run(predict, 10, 0.0)
        assert rec is not None and rec["eval_samples"] == 1000
        seen[b] += (rec["planted_auc"], rec["eval_auc"])
    assert seen[64][:3] == seen[300][:3]  # the same samples, labels and planted AUC
    assert seen[64][3] == pytest.approx(seen[300][3], abs=1e-5)  # float32 matmuls of other shapes
    old = {b: _samples_of([HeldOut(parse_spec({**base, "batch_size": b, "eval": {"batches": 2}})).batch(k)
                           for k in range(2)])[0][:64] for b in (64, 300)}
    assert old[64] != old[300]  # eval.batches: another set per batch size
