"""DelayedErrorFeedback: pairs the kept compressed gradient with the anchor's dense gradient of the
same step, adds lambda x EMA of the error to later gradients, checkpoints its state."""
import pytest
import torch

from ds_twocircuit.anchor.corrections import DelayedErrorFeedback


def _setup(every=2, lam=1.0, beta=0.5):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(3, 4))
    inner = torch.optim.SGD([w], lr=1.0)
    return w, DelayedErrorFeedback(inner, {"w": w}, every=every, lam=lam, beta=beta)


def _step(opt, w, g, step):
    w.grad = g.clone()
    opt.step(step=step)
    return w.grad.clone()  # what the inner optimizer used


def test_error_of_the_snapshot_step_corrects_later_steps():
    w, opt = _setup(every=2, lam=1.0, beta=0.5)
    g0, g1, g2 = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(_step(opt, w, g0, 0), g0)          # no correction yet; g0 kept (snapshot step)
    dense0 = g0 + torch.ones(3, 4)                          # the anchor's dense gradient of step 0
    opt.submit_anchor_gradients({"w": dense0}, 0)
    used = _step(opt, w, g1, 1)
    assert torch.allclose(used, g1 + torch.ones(3, 4))      # c = dense0 - g0 = 1, lambda 1
    # step 2 is a snapshot step: it keeps its *compressed* gradient (before the correction)
    used2 = _step(opt, w, g2, 2)
    assert torch.allclose(used2, g2 + 1.0)
    opt.submit_anchor_gradients({"w": g2 + 3.0}, 2)         # error 3: EMA 0.5 x 1 + 0.5 x 3 = 2
    assert torch.allclose(_step(opt, w, g1, 3), g1 + 2.0)
    assert opt.last_stats()["delayed_ef/staleness"] == 1.0


def test_unpaired_anchor_gradient_is_skipped_and_lambda_scales():
    w, opt = _setup(every=5, lam=0.5)
    g = torch.randn(3, 4)
    _step(opt, w, g, 0)
    with pytest.warns(RuntimeWarning, match="no kept compressed gradient for step 3"):
        opt.submit_anchor_gradients({"w": torch.zeros(3, 4)}, 3)
    assert torch.equal(_step(opt, w, g, 1), g)
    opt.submit_anchor_gradients({"w": g + 2.0}, 0)
    assert torch.allclose(_step(opt, w, g, 2), g + 1.0)     # 0.5 x 2
    with pytest.raises(ValueError, match="not finite"):
        _step(opt, w, g, 5)
        opt.submit_anchor_gradients({"w": torch.full((3, 4), float("nan"))}, 5)


def test_state_round_trip_continues_identically():
    w, opt = _setup(every=1)
    _step(opt, w, torch.ones(3, 4), 0)
    opt.submit_anchor_gradients({"w": torch.full((3, 4), 3.0)}, 0)
    _step(opt, w, torch.ones(3, 4), 1)
    sd = opt.state_dict()
    w2, opt2 = _setup(every=1)
    w2.data.copy_(w.data)
    opt2.load_state_dict(sd)
    opt.submit_anchor_gradients({"w": torch.zeros(3, 4)}, 1)
    opt2.submit_anchor_gradients({"w": torch.zeros(3, 4)}, 1)
    g = torch.randn(3, 4)
    assert torch.equal(_step(opt, w, g, 2), _step(opt2, w2, g, 2))


def test_anchor_correction_is_a_config_choice():
    from ds_twocircuit.config import ConfigError, TwoCircuitConfig
    tc = TwoCircuitConfig.from_dict({"anchor": {"enabled": True, "correction": "delayed_ef", "ef_lambda": 0.5}})
    assert tc.anchor.correction == "delayed_ef" and tc.anchor.ef_lambda == 0.5 and tc.anchor.ef_beta == 0.5
    with pytest.raises(ConfigError, match=r"twocircuit\.anchor\.correction = 'clean'; allowed: spectral, delayed_ef"):
        TwoCircuitConfig.from_dict({"anchor": {"correction": "clean"}})
    with pytest.raises(ConfigError, match=r"twocircuit\.anchor\.ef_beta"):
        TwoCircuitConfig.from_dict({"anchor": {"ef_beta": 1.0}})
