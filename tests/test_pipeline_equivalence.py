"""The masked multi-process pipeline equals a single-process model with the same masks in its
graph; with p = 0 it equals stock DeepSpeed. (tiny preset, fp32, gloo)"""
import json
import os

import pytest
import torch

from launch_helpers import CONFIGS, ROOT, read_metrics, read_summary, read_weights, torchrun

pytestmark = pytest.mark.multiproc

STEPS = 3
SEQ = 32


def _config(tmp_path, name="m95", **over):
    cfg = json.load(open(os.path.join(CONFIGS, f"{name}.json")))
    cfg["twocircuit"].update(over)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path), cfg


def reference(cfg, pp, dp, steps=STEPS, seed=0, lora=None):
    """The same config file on the single-process reference engine (launch/train.py --engine
    reference: the whole model, the config's codec pair at the same boundaries, the DP replicas
    simulated); returns its training losses and final weights. ``lora``: the ``twocircuit.lora`` dict."""
    import tempfile
    from ds_twocircuit import train
    cfg = json.loads(json.dumps(cfg))
    if lora:
        cfg["twocircuit"]["lora"] = dict(lora)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        out = os.path.join(tmp, "run")
        rc = train.run(["--engine", "reference", "--model", "tiny", "--deepspeed", path, "--pp", str(pp),
                        "--dp", str(dp), "--steps", str(steps), "--seq-len", str(SEQ), "--seed", str(seed),
                        "--output-dir", out, "--eval-sequences", "0"])
        assert rc == 0
        losses = [m["loss"] for m in read_metrics(out)]
        state = _reference_state(os.path.join(out, "hf"), lora)
    return losses, state


def _reference_state(hf_dir, lora):
    """The reference run's weights under the names the pipeline's hf/ folder uses (its adapters'
    under LoRA)."""
    if lora:
        from safetensors.torch import load_file
        return load_file(os.path.join(hf_dir, "adapter_model.safetensors"))
    return read_weights(hf_dir)


def _compare(out, ref_losses, ref_state, atol=2e-5, mean_atol=None):
    got = [m["loss"] for m in read_metrics(out)]
    assert len(got) == len(ref_losses)
    for a, b in zip(got, ref_losses):
        assert abs(a - b) < 1e-4 * max(1.0, abs(b)), (got, ref_losses)
    w = read_weights(os.path.join(out, "hf"))
    assert set(w) <= set(ref_state)
    worst = max(float((w[k] - ref_state[k]).abs().max()) for k in w)
    assert worst < atol, f"max parameter difference {worst}"
    if mean_atol is not None:
        n = sum(w[k].numel() for k in w)
        mean = sum(float((w[k] - ref_state[k]).abs().sum()) for k in w) / n
        print(f"parameter difference: max {worst:.3g}, mean {mean:.3g}")
        assert mean < mean_atol, f"mean parameter difference {mean}"
    return worst


SGD_LR = 0.05


@pytest.mark.parametrize("pp,dp", [(2, 2), (4, 1)])   # pp 2 x dp 1: test_codec_conformance
def test_masked_pipeline_matches_single_process_reference(tmp_path, pp, dp):
    """SGD: the update is lr x gradient, so the two computations' different float reduction orders
    (which differ between CPUs) move a weight by ~lr x 1e-7 relative: a tight tolerance that holds
    on any machine and still catches a wrong mask, scale or boundary (those move weights by >1e-3)."""
    path, cfg = _config(tmp_path, "m95", mask_rate=0.9)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": SGD_LR}}
    cfg["gradient_clipping"] = 0.0   # clipping: test_clipping_uses_the_whole_models_norm
    with open(path, "w") as f:
        json.dump(cfg, f)
    out = str(tmp_path / "run")
    torchrun(pp * dp, ["--model", "tiny", "--deepspeed", path, "--pp", str(pp), "--steps", str(STEPS),
                       "--seq-len", str(SEQ), "--output-dir", out, "--eval-sequences", "0"])
    ref_losses, ref_state = reference(cfg, pp, dp)
    _compare(out, ref_losses, ref_state, atol=2e-6)
    # and the masks really were on: an unmasked reference lands far outside that tolerance
    _, dense_state = reference({**cfg, "twocircuit": {**cfg["twocircuit"], "mode": "dense", "mask_rate": 0.0}}, pp, dp)
    w = read_weights(os.path.join(out, "hf"))
    assert max(float((w[k] - dense_state[k]).abs().max()) for k in w) > 1e-4


@pytest.mark.parametrize("pp,tied", [(4, "untie"), (2, "sync")])
def test_clipping_uses_the_whole_models_norm(tmp_path, pp, tied):
    """Gradient clipping (every shipped config clips at 1.0) by the norm of the whole model, as
    the single-process reference and the quality study clip: DeepSpeed alone would count only
    stage 0's parameters (adapters.pipe_module.mark_stage_parameters). ``sync``: the tied embedding held
    by the first and last stage is counted once. SGD, so the clip factor shows in every weight."""
    path, cfg = _config(tmp_path, "m95", mask_rate=0.9, tied_embeddings=tied)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": SGD_LR}}
    cfg["gradient_clipping"] = 0.05      # far below the gradient's norm: active at every step
    with open(path, "w") as f:
        json.dump(cfg, f)
    out = str(tmp_path / "run")
    torchrun(pp, ["--model", "tiny", "--deepspeed", path, "--pp", str(pp), "--steps", str(STEPS),
                  "--seq-len", str(SEQ), "--output-dir", out, "--eval-sequences", "0"])
    ref_losses, ref_state = reference(cfg, pp, 1)
    _compare(out, ref_losses, ref_state, atol=2e-6)
    # and clipping was on: the unclipped reference lands far away
    _, unclipped = reference({**cfg, "gradient_clipping": 0.0}, pp, 1)
    w = read_weights(os.path.join(out, "hf"))
    assert max(float((w[k] - unclipped[k]).abs().max()) for k in w) > 1e-4


def test_masked_pipeline_adamw_matches_reference(tmp_path):
    """AdamW (the shipped configs' optimizer) at its own justified tolerance. AdamW's update of an
    element is about lr x m/sqrt(v), bounded by ~lr whatever the gradient's size: a rounding
    difference in a near-zero gradient element can therefore move that element by up to ~2 lr
    per step (sign flip), which is why the worst element is bounded by 2 x lr x steps, while the
    bulk of the weights (mean difference) must agree as tightly as the SGD check."""
    path, cfg = _config(tmp_path, "m95", mask_rate=0.9)
    cfg["gradient_clipping"] = 0.0
    with open(path, "w") as f:
        json.dump(cfg, f)
    lr = cfg["optimizer"]["params"]["lr"]
    out = str(tmp_path / "run")
    torchrun(4, ["--model", "tiny", "--deepspeed", path, "--pp", "2", "--steps", str(STEPS),
                 "--seq-len", str(SEQ), "--output-dir", out, "--eval-sequences", "0"])
    ref_losses, ref_state = reference(cfg, 2, 2)
    _compare(out, ref_losses, ref_state, atol=2 * lr * STEPS, mean_atol=1e-6)
    _, dense_state = reference({**cfg, "twocircuit": {**cfg["twocircuit"], "mode": "dense", "mask_rate": 0.0}}, 2, 2)
    w = read_weights(os.path.join(out, "hf"))
    n = sum(w[k].numel() for k in w)
    assert sum(float((w[k] - dense_state[k]).abs().sum()) for k in w) / n > 1e-5


def test_p0_equals_stock_deepspeed(tmp_path):
    path, cfg = _config(tmp_path, "m95", mask_rate=0.0)
    out = str(tmp_path / "ours")
    torchrun(2, ["--model", "tiny", "--deepspeed", path, "--pp", "2", "--steps", str(STEPS),
                 "--seq-len", str(SEQ), "--output-dir", out, "--eval-sequences", "0"])
    stock_out = str(tmp_path / "stock")
    script = os.path.join(ROOT, "tests", "scripts", "stock_pipeline.py")
    from launch_helpers import _run, env, free_port
    import sys
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
          "--master_port", str(free_port()), script, path, stock_out, str(STEPS), str(SEQ)], 600, True)
    ours = read_weights(os.path.join(out, "hf"))
    stock = torch.load(os.path.join(stock_out, "weights.pt"))
    assert set(ours) == set(stock)
    for k in ours:
        assert torch.equal(ours[k], stock[k]), k
    assert [m["loss"] for m in read_metrics(out)] == json.load(open(os.path.join(stock_out, "losses.json")))
    s = read_summary(out)
    assert s["wire_bytes"]["pp_activations"] == s["wire_bytes"]["pp_gradients"] > 0
