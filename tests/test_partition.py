"""Stage partitioning: every stage holds a decoder; balanced accounts for the LM head's cost."""
import pytest

from ds_twocircuit.config import ConfigError
from ds_twocircuit.models.layers import boundary_layers, partition_parts


@pytest.mark.parametrize("method", ["balanced", "type", "uniform"])
@pytest.mark.parametrize("n,p", [(4, 1), (4, 2), (4, 4), (30, 2), (30, 4), (30, 7), (16, 16)])
def test_parts_are_contiguous_and_each_stage_has_a_decoder(method, n, p):
    parts = partition_parts(n, p, method, head_cost=8.0, embed_cost=0.8)
    assert parts[0] == 0 and parts[-1] == n + 3 and len(parts) == p + 1
    for s in range(p):
        decoders = [i for i in range(parts[s], parts[s + 1]) if 1 <= i <= n]
        assert decoders, (parts, s)
    # every boundary is the output of a decoder layer
    assert all(1 <= b <= n for b in boundary_layers(parts))


def test_balanced_moves_decoders_away_from_the_head_stage():
    # SmolLM2-135M: the 49k x 576 head costs about 8 decoder layers
    assert partition_parts(30, 2, "balanced", head_cost=8.0, embed_cost=0.8) == [0, 20, 33]
    assert partition_parts(30, 2, "type") == [0, 16, 33]
    # the most expensive stage is no worse than any other contiguous split
    w = [0.8] + [1.0] * 30 + [0.0, 8.0]
    parts = partition_parts(30, 4, "balanced", head_cost=8.0, embed_cost=0.8)
    worst = max(sum(w[parts[s]:parts[s + 1]]) for s in range(4))
    assert worst <= 10.0 + 1e-9


def test_too_many_stages_and_bad_method():
    with pytest.raises(ConfigError, match="more pipeline stages"):
        partition_parts(4, 5)
    with pytest.raises(ConfigError, match="allowed: balanced, type, uniform"):
        partition_parts(4, 2, "zigzag")
