"""The stateful codecs (meanfill, lowrank) across real processes: the multi-process engine equals
the single-process reference with the same codec pair in its graph, and every byte is counted where
it is sent (payload both ways, codec state apart). tiny preset, fp32, gloo."""
import json
import os

import pytest

from launch_helpers import CONFIGS, read_metrics, read_summary, read_weights, torchrun
from test_pipeline_equivalence import SEQ, STEPS, _compare, _config, reference

pytestmark = pytest.mark.multiproc

GROUPS = [[8, 8], [16, 4]]          # rank 24 of the tiny model's 64 channels: 8 + 8 + 4 = 20 bytes/token


def _sgd_config(tmp_path, mode, **tc):
    path, cfg = _config(tmp_path, "m95", mode=mode, **tc)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.05}}
    cfg["gradient_clipping"] = 0.0  # DeepSpeed's pipeline norm is not the global one (see the SGD test)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path, cfg


# pp 2 x dp 1 (with sqrt_std) and meanfill: tests/test_codec_conformance.py, over every codec
@pytest.mark.parametrize("pp,dp,norm", [(2, 2, "none"), (3, 1, "none")])
def test_lowrank_pipeline_matches_reference_and_counts_bytes(tmp_path, pp, dp, norm):
    path, cfg = _sgd_config(tmp_path, "lowrank", mask_rate=0.0,
                            codec={"groups": GROUPS, "refresh_steps": [0, 2], "refresh_every": 0,
                                   "coef_norm": norm})
    out = str(tmp_path / "run")
    torchrun(pp * dp, ["--model", "tiny", "--deepspeed", path, "--pp", str(pp), "--steps", str(STEPS),
                       "--seq-len", str(SEQ), "--output-dir", out, "--eval-sequences", "0"])
    ref_losses, ref_state = reference(cfg, pp, dp)
    # 4-bit coefficients: the two computations' different float reduction orders (which differ
    # between CPUs) can move a coefficient that sits on a rounding edge by one level, which moves
    # the weights it feeds by ~lr x 1e-4 (seen: max 1e-5, mean 4e-8 at pp 2 x dp 2); the bulk of the
    # weights must agree far more tightly than an uncoded run's (which lands >10x that mean away)
    _compare(out, ref_losses, ref_state, atol=1e-4, mean_atol=5e-7)
    uncoded = {k: v for k, v in cfg["twocircuit"].items() if k != "codec"}
    _, dense_state = reference({**cfg, "twocircuit": {**uncoded, "mode": "dense"}}, pp, dp)
    w = read_weights(os.path.join(out, "hf"))
    n = sum(w[k].numel() for k in w)
    assert sum(float((w[k] - dense_state[k]).abs().sum()) for k in w) / n > 10 * 5e-7
    s = read_summary(out)
    H, r = 64, 24
    tokens_per_link = STEPS * cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * SEQ
    links = (pp - 1) * dp
    wb = s["wire_bytes"]
    assert wb["pp_activations"] == links * tokens_per_link * 20
    assert wb["pp_gradients"] == links * tokens_per_link * 20
    # refreshes at steps 0 and 2 (of 0..2): mean + basis (+ r coefficient scales) in bf16, once
    # per link each
    assert wb["pp_codec_state"] == links * 2 * 2 * (H + H * r + (r if norm == "sqrt_std" else 0))
    assert s["mask_rate"] == 0.0 and s["config"]["twocircuit"]["codec"]["groups"] == GROUPS


def test_lowrank_coded_and_dense_eval_and_resume(tmp_path):
    """Coded evaluation goes through the codec, dense evaluation does not; a run resumed from a
    checkpoint continues bit-for-bit (codec state saved per rank)."""
    path, cfg = _config(tmp_path, "m95", mode="lowrank", mask_rate=0.0,
                        codec={"groups": GROUPS, "refresh_steps": [0, 3], "refresh_every": 0})
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    common = ["--model", "tiny", "--deepspeed", path, "--pp", "2", "--seq-len", str(SEQ), "--eval-sequences", "8"]
    torchrun(2, common + ["--steps", "4", "--output-dir", full])
    torchrun(2, common + ["--steps", "2", "--output-dir", part, "--save-checkpoint"])
    torchrun(2, common + ["--steps", "4", "--output-dir", part, "--resume", os.path.join(part, "checkpoint")])
    a, b = read_summary(full), read_summary(part)
    assert a["heldout_loss"] == b["heldout_loss"] and a["heldout_loss_masked"] == b["heldout_loss_masked"]
    assert a["heldout_loss"] != a["heldout_loss_masked"]
    from launch_helpers import read_weights
    wa, wb_ = read_weights(os.path.join(full, "hf")), read_weights(os.path.join(part, "hf"))
    import torch
    assert all(torch.equal(wa[k], wb_[k]) for k in wa)


@pytest.mark.parametrize("grad_basis, grad_rank, pp, state_bits, metric, metric_rank", [
    ("activations", 16, 2, 16, "none", 0), ("forward", 6, 2, 16, "none", 0), ("forward", 6, 3, 16, "none", 0),
    ("activations", 16, 2, 8, "none", 0), ("forward", 6, 2, 16, "gradient", 0), ("forward", 6, 3, 8, "gradient", 0),
    ("forward", 6, 2, 8, "gradient", 12)])
def test_lowrank_reference_base_pipeline_matches_reference_and_counts_bytes(tmp_path, grad_basis, grad_rank, pp,
                                                                             state_bits, metric, metric_rank):
    """reference = base across processes: stage 0 codes the drift from the base model's activation
    of its input ids, the last stage adds back its own computation of it from the labels (the same
    ids), a middle stage (pp 3) does both with the ids it reads from its own copy of the data stream,
    each from the model folder's weights; equal to the single-process engine, and the bytes each way
    on every link are the layout's (activations 8 x 4 bits, gradients 16 x 4 bits on a basis of
    their own, or 6 x 4 bits on the forward's) plus the state (the gradient's basis only where it
    has its own; with ``state_bits`` 8 both bases cross as int8 with a bf16 scale per direction). With
    ``metric`` "gradient" each receiver (the middle stage too) sends its gradient metric (step 0's
    gradient messages and step 1's first) back on step 1's first gradient message, counted as
    pp_grad_state, and step 2 refits in it on both ends (refreshes listed: step 0 only); with
    ``metric_rank`` 12 as its 12 leading eigenvectors in int8 and their eigenvalues."""
    codec = {"groups": [[8, 4]], "grad_groups": [[grad_rank, 4]], "refresh_steps": [0, 2], "refresh_every": 0,
             "reference": "base", "grad_basis": grad_basis, "state_bits": state_bits, "metric": metric}
    if metric != "none":   # the metric of step 0's gradients and step 1's first crosses then; step 2 refits in it
        codec.update(refresh_steps=[0], metric_steps=[1], metric_rank=metric_rank)
    path, cfg = _sgd_config(tmp_path, "lowrank", mask_rate=0.0, codec=codec)
    out = str(tmp_path / "run")
    torchrun(pp, ["--model", "tiny", "--deepspeed", path, "--pp", str(pp), "--steps", str(STEPS),
                  "--seq-len", str(SEQ), "--output-dir", out, "--eval-sequences", "0"])
    ref_losses, ref_state = reference(cfg, pp, 1)
    _compare(out, ref_losses, ref_state, atol=1e-4, mean_atol=5e-7)
    # step 0 is exact (zero drift): the first loss is dense training's
    uncoded = {k: v for k, v in cfg["twocircuit"].items() if k != "codec"}
    dense_losses, _ = reference({**cfg, "twocircuit": {**uncoded, "mode": "dense"}}, pp, 1)
    s = read_summary(out)
    assert abs(read_metrics(out)[0]["loss"] - dense_losses[0]) < 1e-5
    H = 64
    tokens = STEPS * cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * SEQ
    wb = s["wire_bytes"]
    assert wb["pp_activations"] == (pp - 1) * tokens * (8 * 4 // 8 + 2)
    assert wb["pp_gradients"] == (pp - 1) * tokens * (grad_rank * 4 // 8 + 2)
    own = grad_rank if grad_basis == "activations" else 0
    basis = (lambda r: 2 * H * r) if state_bits == 16 else (lambda r: H * r + 2 * r if r else 0)
    refits = 2     # steps 0 and 2 (listed, or after the metric)
    assert wb["pp_codec_state"] == (pp - 1) * refits * (2 * H + basis(8) + basis(own))
    k = metric_rank
    metric_bytes = H * k + 2 * k + 2 * (k + 1) if k else H * (H + 1)
    assert wb["pp_grad_state"] == ((pp - 1) * metric_bytes if metric == "gradient" else 0)


def test_reference_base_middle_stage_keeps_its_stream_in_step(tmp_path):
    """pp 3: the middle stage reads one micro-batch of its own data stream per forward pass, in
    training, on a clean step (dense boundaries: nothing coded, the stream read all the same), in
    coded evaluations between training steps (--eval-every 2: the evaluation's stream swapped in and
    the training's back), and after a resume from a checkpoint. A stream one micro-batch out of step
    would add another sequence's base activation and land far from the single-process engine."""
    codec = {"groups": [[8, 4]], "grad_groups": [[6, 4]], "refresh_steps": [0], "refresh_every": 2,
             "reference": "base", "grad_basis": "forward", "moments_halflife": 1.5}   # aged alike by both engines
    path, cfg = _sgd_config(tmp_path, "lowrank", mask_rate=0.0, codec=codec, clean_every=2)
    common = ["--model", "tiny", "--deepspeed", path, "--pp", "3", "--seq-len", str(SEQ), "--eval-sequences", "8",
              "--eval-every", "2"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    torchrun(3, common + ["--steps", "4", "--output-dir", full])
    torchrun(3, common + ["--steps", "2", "--output-dir", part, "--save-checkpoint"])
    torchrun(3, common + ["--steps", "4", "--output-dir", part, "--resume", os.path.join(part, "checkpoint")])
    from ds_twocircuit import train
    ref_out = str(tmp_path / "ref")
    assert train.run(["--engine", "reference"] + common + ["--steps", "4", "--output-dir", ref_out]) == 0
    a, b, r = read_summary(full), read_summary(part), read_summary(ref_out)
    assert [m["loss"] for m in read_metrics(full)] == pytest.approx([m["loss"] for m in read_metrics(ref_out)], abs=1e-4)
    for key in ("heldout_loss", "heldout_loss_masked"):
        assert a[key] == b[key]                              # resumed: bit for bit
        assert a[key] == pytest.approx(r[key], abs=1e-4)     # the single-process engine
    assert a["heldout_loss"] != a["heldout_loss_masked"]
    ca, cr = a["heldout_curve"], r["heldout_curve"]
    assert [c["step"] for c in ca] == [c["step"] for c in cr] == [0, 2, 4]
    assert b["heldout_curve"] == ca      # the resumed run's: its first launch's scores of steps 0 and 2 kept
    # the whole run's bytes, summed over the three ranks at the checkpoint and added to the resumed
    # launch's: the uninterrupted run's (a launch's one-off shape handshake apart)
    from ds_twocircuit.wire import TRAINING_KINDS
    kinds = [k for k in TRAINING_KINDS if k != "pp_handshake"]
    assert b["run"]["tokens"] == a["tokens"] == 2 * b["tokens"]
    assert {k: b["run"]["wire_bytes"][k] for k in kinds} == {k: a["wire_bytes"][k] for k in kinds}
    assert b["run"]["wire_bytes"]["pp_codec_state"] > b["wire_bytes"]["pp_codec_state"] > 0
    for x, y in zip(ca, cr):      # the evaluations between training steps too
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-4)
        assert x["loss_coded"] == pytest.approx(y["loss_coded"], abs=1e-4)
    wa, wb_ = read_weights(os.path.join(full, "hf")), read_weights(os.path.join(part, "hf"))
    import torch
    assert all(torch.equal(wa[k], wb_[k]) for k in wa)


def test_reference_base_is_exact_at_step_zero_in_bf16(tmp_path):
    """A bf16 engine casts the stage's parameters but keeps its buffers (rotary inv_freq) fp32: the
    base model's copy must do the same, or the drift at step 0 is bf16 rounding (seen: 4.9e-4 at
    most, 1.2e-5 of the activations' energy, above the codec's zero-drift floor, so the first basis
    was fitted on noise) instead of zero. With the dtypes mirrored, step 0 is dense training's."""
    losses = {}
    for name, over in (("dense", {}), ("lowrank20", {"groups": [[16, 4]], "grad_groups": [[16, 4]]})):
        cfg = json.load(open(os.path.join(CONFIGS, f"{name}.json")))
        cfg["bf16"] = {"enabled": True}
        if over:
            cfg["twocircuit"]["codec"].update(over)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        out = str(tmp_path / name)
        torchrun(2, ["--model", "tiny", "--deepspeed", str(path), "--pp", "2", "--steps", "1",
                     "--seq-len", str(SEQ), "--output-dir", out, "--eval-sequences", "0", "--no-save-model"])
        losses[name] = read_metrics(out)[0]["loss"]
        if name == "dense":   # the engine trained in bf16: its dense wire carries 2 bytes a channel
            tokens = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * SEQ
            assert read_summary(out)["wire_bytes"]["pp_activations"] == tokens * 64 * 2
    assert losses["lowrank20"] == losses["dense"]
