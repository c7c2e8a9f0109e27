"""Magnitude pruning: exact sparsity, only decoder matrices, exact restore, 0 changes nothing."""
import pytest
import torch

from eval.pruning import Pruner, prunable


@pytest.fixture
def tiny():
    from transformers import AutoModelForCausalLM
    from ds_twocircuit.models.presets import resolve_model
    return AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32).eval()


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_prunable_are_the_2d_decoder_matrices(tiny):
    names = [n for n, _ in prunable(tiny)]
    suffixes = {n.split(".", 3)[-1] for n in names}
    assert suffixes == {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                        "mlp.down_proj.weight"}
    assert len(names) == 7 * tiny.config.num_hidden_layers
    assert not any("embed" in n or "norm" in n or "lm_head" in n for n in names)


@pytest.mark.parametrize("scope", ["per-layer", "global"])
@pytest.mark.parametrize("sparsity", [0.1, 0.3, 0.5, 0.9])
def test_achieved_sparsity_equals_requested(tiny, scope, sparsity):
    before = _state(tiny)
    pruner = Pruner(tiny)
    stats = pruner.apply(sparsity, scope)
    assert stats["achieved"] == pytest.approx(sparsity, abs=len(pruner.params) / pruner.total)
    if scope == "global":
        assert stats["pruned_parameters"] == round(sparsity * pruner.total)
    for name, p in pruner.params:
        orig = before[name]
        zeroed = p == 0
        if scope == "per-layer":  # every matrix exactly at the requested density
            assert int(zeroed.sum()) == round(sparsity * p.numel()), name
            assert orig[zeroed].abs().max() <= orig[~zeroed].abs().min()  # the smallest went
        assert torch.equal(p[~zeroed], orig[~zeroed])  # the others are untouched
    if scope == "global":  # one threshold over all matrices
        pruned = torch.cat([before[n][p == 0].abs() for n, p in pruner.params])
        kept = torch.cat([before[n][p != 0].abs() for n, p in pruner.params])
        assert pruned.max() <= kept.min()
    after = tiny.state_dict()
    for k in before:  # embeddings, norms, head untouched
        if k not in dict(pruner.params):
            assert torch.equal(after[k], before[k]), k


@pytest.mark.parametrize("scope", ["per-layer", "global"])
def test_zero_sparsity_changes_nothing_and_restore_is_exact(tiny, scope):
    before = _state(tiny)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        ref = tiny(ids).logits
    pruner = Pruner(tiny)
    stats = pruner.apply(0.0, scope)
    assert stats["achieved"] == 0.0
    with torch.no_grad():
        assert torch.equal(tiny(ids).logits, ref)
    pruner.apply(0.7, scope)
    with torch.no_grad():
        assert not torch.equal(tiny(ids).logits, ref)
    pruner.apply(0.0, scope)  # each sparsity starts from the original weights
    for k, v in tiny.state_dict().items():
        assert torch.equal(v, before[k]), k
    pruner.apply(0.4, scope)
    pruner.restore()
    for k, v in tiny.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_ties_are_broken_to_the_exact_count(tiny):
    with torch.no_grad():
        for _, p in prunable(tiny):
            p.fill_(0.5)  # every entry ties
    pruner = Pruner(tiny)
    for scope in ("per-layer", "global"):
        stats = pruner.apply(0.25, scope)
        assert stats["achieved"] == pytest.approx(0.25, abs=len(pruner.params) / pruner.total)


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5])
def test_bad_sparsity_is_rejected(tiny, bad):
    with pytest.raises(ValueError, match="outside"):
        Pruner(tiny).apply(bad)
    with pytest.raises(ValueError, match="scope"):
        Pruner(tiny).apply(0.1, "per-head")
