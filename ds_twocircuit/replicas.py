"""Merging the states of data-parallel replicas, for a run that resumes on another DP width.

The rule everywhere: what the replicas agree on is taken from the first one; what they hold each
their own (local weights between DiLoCo syncs, inner optimizer moments, error-feedback buffers, a
codec's running statistics) is averaged, as the end-of-run sync averages drifted weights. Growing
the width copies the merged state to every new replica, so they start identical.
"""
from __future__ import annotations

import torch


def mean_state(states: list):
    """The element-wise mean of floating-point tensors over ``states`` (nested dicts, lists and
    tuples of one structure); any other leaf (integers, step counters, flags) from the first."""
    first = states[0]
    if len(states) == 1:
        return first
    if isinstance(first, dict):
        return {k: mean_state([s[k] for s in states]) for k in first}
    if isinstance(first, (list, tuple)):
        out = [mean_state([s[i] for s in states]) for i in range(len(first))]
        return type(first)(out) if isinstance(first, tuple) else out
    if torch.is_tensor(first) and first.is_floating_point():
        acc = first.detach().to(torch.float64).clone()
        for s in states[1:]:
            acc += s.detach().to(torch.float64)
        return (acc / len(states)).to(first.dtype)
    return first


