"""The PRF mask: determinism, exact K per token, uniformity, pinned reference values."""
import json
import os

import pytest
import torch

from ds_twocircuit import masks

REF = os.path.join(os.path.dirname(__file__), "data", "prf_reference.json")


def test_same_key_same_mask_and_exact_k_sorted_unique():
    key = masks.mask_key(3, 1, 10, 2, 576)
    a = masks.kept_indices(key, 64, 576, 29)
    b = masks.kept_indices(key, 64, 576, 29)
    assert torch.equal(a, b)
    assert a.shape == (64, 29)
    assert bool((a[:, 1:] > a[:, :-1]).all()), "kept channels must be unique and ascending"
    assert int(a.min()) >= 0 and int(a.max()) < 576
    # different tokens of one message get different kept sets
    assert len({tuple(r.tolist()) for r in a}) == 64


@pytest.mark.parametrize("field", range(5))
def test_every_key_field_changes_the_mask(field):
    base = [11, 0, 5, 3, 64]
    other = list(base)
    other[field] += 1
    ka, kb = masks.mask_key(*base), masks.mask_key(*other)
    assert ka != kb
    a = masks.kept_indices(ka, 16, 64, 8)
    b = masks.kept_indices(kb, 16, 64, 8)
    assert not torch.equal(a, b)


def test_keep_count_rounding():
    assert masks.kept_count(576, 0.95) == 29   # round(28.8)
    assert masks.kept_count(576, 0.90) == 58   # round(57.6)
    assert masks.kept_count(2048, 0.95) == 102
    assert masks.kept_count(4, 0.99) == 1      # never zero
    assert masks.kept_count(64, 0.0) == 64


def test_kept_channels_uniform_over_keys():
    H, K, T = 32, 4, 8
    counts = torch.zeros(H)
    n_keys = 600
    for k in range(n_keys):
        idx = masks.kept_indices(masks.mask_key(0, 0, k, 0, H), T, H, K)
        counts += torch.bincount(idx.flatten(), minlength=H).float()
    expected = n_keys * T * K / H  # 600
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # chi-square with 31 dof: the 99.9% quantile is ~61.1
    assert chi2 < 61.1, (chi2, counts)
    # and pairs of channels are not correlated: channel 0 kept with 1 as often as chance
    both = 0
    for k in range(n_keys):
        m = masks.boundary_mask(masks.mask_key(1, 0, k, 0, H), (T, H), K)
        both += int((m[:, 0] * m[:, 1]).sum())
    expect_pair = n_keys * T * (K / H) * ((K - 1) / (H - 1))
    assert abs(both - expect_pair) < 5 * expect_pair ** 0.5 + 5


def test_matches_stored_reference_values_and_python_reference():
    ref = json.load(open(REF))
    for c in ref["cases"]:
        key = masks.mask_key(c["seed"], c["boundary"], c["step"], c["micro_batch"], c["hidden"])
        assert str(key) == c["key"]
        got = masks.kept_indices(key, c["tokens"], c["hidden"], c["keep"]).tolist()
        assert got == c["kept"]
        assert masks.reference_kept_indices(key, c["tokens"], c["hidden"], c["keep"]) == c["kept"]


def test_full_keep_is_identity_and_bad_keep_rejected():
    idx = masks.kept_indices(123, 3, 8, 8)
    assert idx.tolist() == [list(range(8))] * 3
    with pytest.raises(ValueError):
        masks.kept_indices(123, 3, 8, 0)


def test_schedule_warmup_and_ramp():
    s = masks.MaskSchedule(0.9, warmup_steps=2, ramp_steps=4)
    rates = [round(s.rate(i), 6) for i in range(8)]
    assert rates == [0.0, 0.0, 0.225, 0.45, 0.675, 0.9, 0.9, 0.9]
    assert s.keep(0, 100) == 100 and s.keep(7, 100) == 10
    assert masks.MaskSchedule(0.95).rate(0) == 0.95
