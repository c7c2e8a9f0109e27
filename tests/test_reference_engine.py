"""The single-process reference engine under the Trainer (launch/train.py --engine reference) on the
tiny preset: the clean control, the in-process anchor's clipping, bit-exact resume, simulated DP
replicas, and the byte meter. Seconds each, one process."""
import json
import os

import pytest
import torch

from launch_helpers import CONFIGS, read_metrics, read_summary, read_weights

LOWRANK = {"groups": [[8, 4]], "refresh_steps": [0], "refresh_every": 0}
SEQ, MB, GAS = 32, 2, 2


def _config(tmp_path, name="lowrank", **tc):
    cfg = json.load(open(os.path.join(CONFIGS, f"{name}.json")))
    codec = tc.pop("codec", None)
    cfg["twocircuit"].update(tc)
    if codec is not None:
        cfg["twocircuit"]["codec"] = codec
    elif cfg["twocircuit"].get("mode") == "lowrank":
        cfg["twocircuit"]["codec"] = LOWRANK
    cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = MB, GAS
    path = tmp_path / f"{name}_{abs(hash(json.dumps(tc, sort_keys=True)))}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _run(tmp_path, config, name, steps=4, extra=()):
    from ds_twocircuit import train, wire
    out = str(tmp_path / name)
    argv = ["--engine", "reference", "--model", "tiny", "--data", "deepspeed-cpp", "--deepspeed", config,
            "--steps", str(steps), "--seq-len", str(SEQ), "--eval-sequences", "4", "--output-dir", out, *extra]
    wire.reset()
    assert train.run(argv) == 0
    return read_summary(out), [m["loss"] for m in read_metrics(out)], out


def _hidden():
    from transformers import AutoConfig
    from ds_twocircuit.models.presets import resolve_model
    return AutoConfig.from_pretrained(resolve_model("tiny")).hidden_size


def test_clean_steps_train_through_a_dense_boundary_and_count_dense_bytes(tmp_path):
    dense, dense_loss, _ = _run(tmp_path, _config(tmp_path, "dense"), "dense")
    every, every_loss, _ = _run(tmp_path, _config(tmp_path, clean_every=1), "every")
    # every step clean: exactly dense training (the coded eval fits state on its own batch, uncounted)
    assert every_loss == dense_loss and every["heldout_loss"] == dense["heldout_loss"]
    assert every["wire_bytes"]["pp_codec_state"] == 0
    assert every["wire_bytes"]["pp_activations"] == dense["wire_bytes"]["pp_activations"] > 0
    coded, coded_loss, _ = _run(tmp_path, _config(tmp_path), "coded")
    half, half_loss, _ = _run(tmp_path, _config(tmp_path, clean_every=2), "half")
    assert half_loss[0] == coded_loss[0] != dense_loss[0]    # step 0 coded, step 1 clean
    assert half_loss[1] != coded_loss[1]
    H, tokens_per_step = _hidden(), MB * GAS * SEQ
    payload = 8 * 4 // 8 + 2                                  # 8 coefficients at 4 bits + one bf16 scale
    assert coded["codec"]["bytes_per_token"] == payload
    for kind in ("pp_activations", "pp_gradients"):
        assert coded["wire_bytes"][kind] == 4 * tokens_per_step * payload
        assert half["wire_bytes"][kind] == 2 * tokens_per_step * payload + 2 * tokens_per_step * H * 4
    # state: mean (H) and basis (H x 8) in bf16, shipped once at step 0
    assert coded["wire_bytes"]["pp_codec_state"] == half["wire_bytes"]["pp_codec_state"] == 2 * (H + H * 8)


def test_delayed_ef_pairs_a_dense_gradient_clipped_like_the_fast_step(tmp_path, monkeypatch):
    """The in-process anchor clips its dense gradient by the config's gradient_clipping before it is
    paired with the kept (clipped) coded gradient, as the anchor circuit does; spectral gets it raw."""
    from ds_twocircuit.anchor.corrections import DelayedErrorFeedback
    from ds_twocircuit.anchor.spectral import SpectralCorrection
    norms = []
    orig = SpectralCorrection.submit_anchor_gradients
    orig_def = DelayedErrorFeedback.submit_anchor_gradients

    def spy(orig_fn):
        def f(self, grads, source_step):
            norms.append(float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values()))))
            return orig_fn(self, grads, source_step)
        return f
    monkeypatch.setattr(SpectralCorrection, "submit_anchor_gradients", spy(orig))
    monkeypatch.setattr(DelayedErrorFeedback, "submit_anchor_gradients", spy(orig_def))
    anchor = {"enabled": True, "every": 1, "correction": "delayed_ef", "ef_lambda": 1.0, "ef_beta": 0.5}
    cfg = json.loads(open(_config(tmp_path, anchor=anchor)).read())
    cfg["gradient_clipping"] = 0.05
    path = tmp_path / "def.json"
    path.write_text(json.dumps(cfg))
    s, _, _ = _run(tmp_path, str(path), "def", steps=3)
    assert len(norms) == 2 and max(norms) <= 0.05 * (1 + 1e-4)    # delivered at steps 1 and 2
    assert s["anchor"]["updates"] == 2 and s["anchor"]["mean_staleness"] == 1.0
    # the anchor gradients are counted as anchor traffic (the fast side receives them)
    assert s["wire_bytes"]["anchor"] > 0
    norms.clear()
    cfg["twocircuit"]["anchor"] = {**anchor, "correction": "spectral"}
    path.write_text(json.dumps(cfg))
    _run(tmp_path, str(path), "spectral", steps=3)
    assert len(norms) == 2 and min(norms) > 0.05                    # unclipped: far above it


@pytest.mark.parametrize("backend", ["allreduce", "streaming_diloco", "streaming_diloco_quant"])
def test_resume_is_bit_exact(tmp_path, backend):
    dp = {"backend": "allreduce"} if backend == "allreduce" else {
        "backend": "streaming_diloco", "inner_steps": 2, "num_fragments": 2, "compression": "powersgd",
        "powersgd": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 0}}
    if backend == "streaming_diloco_quant":   # 2-bit pseudo-gradients: residuals and an all-gather in flight at the save
        dp = {"backend": "streaming_diloco", "inner_steps": 2, "num_fragments": 2, "compression": "quant",
              "quant": {"bits": 2, "block": 16}}
    cfg = _config(tmp_path, dp=dp, codec={**LOWRANK, "refresh_steps": [0, 3]})   # a refit after the resume too
    extra = ["--dp", "2"]
    full, full_loss, full_out = _run(tmp_path, cfg, "full", steps=4, extra=extra)
    _run(tmp_path, cfg, "part", steps=2, extra=[*extra, "--save-checkpoint"])
    part, part_loss, part_out = _run(tmp_path, cfg, "part", steps=4, extra=[*extra, "--resume", "auto"])
    assert part["first_step"] == 2 and part_loss == full_loss
    assert part["heldout_loss"] == full["heldout_loss"]
    # the held-out curve of the whole run survives the resume; the score before training is the first
    # part's (step 0 is not scored again, nor are the resumed weights: a resume costs no evaluation);
    # the first part's score of step 2 stays where it scored the checkpoint's weights (not where
    # DiLoCo's end-of-run average of the drifted replicas had replaced them)
    assert [p["step"] for p in part["heldout_curve"]] == ([0, 2, 4] if backend == "allreduce" else [0, 4])
    assert part["heldout_curve"][0] == full["heldout_curve"][0] and part["heldout_curve"][-1] == full["heldout_curve"][-1]
    assert (part["heldout_loss_first"], part["heldout_loss_first_se"]) == (full["heldout_loss_first"], full["heldout_loss_first_se"])
    # the resumed launch counts its own tokens and bytes; "run" counts the whole run's, as the
    # uninterrupted run does (codec state, the DP sync and its end-of-run flush included)
    from ds_twocircuit.wire import TRAINING_KINDS
    assert part["tokens"] == full["tokens"] // 2 and part["run"]["tokens"] == full["tokens"] == full["run"]["tokens"]
    assert {k: part["run"]["wire_bytes"][k] for k in TRAINING_KINDS} == {k: full["wire_bytes"][k] for k in TRAINING_KINDS}
    assert part["run"]["wire_bytes"]["pp_codec_state"] > part["wire_bytes"]["pp_codec_state"] > 0   # refits at steps 0 and 3
    assert part["run"]["bytes_per_token"] == full["bytes_per_token"] and part["run"]["steps"] == 4
    wa, wb = read_weights(os.path.join(full_out, "hf")), read_weights(os.path.join(part_out, "hf"))
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert full["dp_replicas_identical"] is True


def test_a_resume_scoring_other_windows_scores_the_resumed_weights(tmp_path):
    """The step-0 score is reused by a resume only where it was taken on as many held-out windows as
    the resumed run scores; otherwise the resumed weights are scored (the curve's points stay
    comparable with each other)."""
    cfg = _config(tmp_path)
    _run(tmp_path, cfg, "part", steps=2, extra=["--save-checkpoint"])
    first = read_summary(str(tmp_path / "part"))
    os.remove(os.path.join(str(tmp_path / "part"), "checkpoint", "global_step2", "run_totals.json"))
    part, _, _ = _run(tmp_path, cfg, "part", steps=3, extra=["--resume", "auto", "--eval-sequences", "8"])
    assert [p["step"] for p in part["heldout_curve"]] == [0, 2, 3]
    assert [p["sequences"] for p in part["heldout_curve"]] == [4, 8, 8]
    assert part["heldout_loss_first"] == part["heldout_curve"][1]["loss"] != first["heldout_loss_first"]
    assert part["run"] is None     # its checkpoint had no run totals (as one written before they existed)


def test_simulated_replicas_allreduce_equals_one_replica_on_the_same_global_batch(tmp_path):
    """Two simulated replicas with all-reduce (each half the global batch) train the weights one
    replica trains on the whole batch (gas doubled), up to the float order of the mean; and the
    DP bytes are those of a ring all-reduce of every trainable gradient at every step."""
    two, two_loss, two_out = _run(tmp_path, _config(tmp_path, "dense"), "dp2", steps=3, extra=["--dp", "2"])
    one, one_loss, one_out = _run(tmp_path, _config(tmp_path, "dense"), "dp1", steps=3,
                                  extra=["--grad-accum", str(2 * GAS)])
    assert two_loss == pytest.approx(one_loss, rel=1e-5)
    wa, wb = read_weights(os.path.join(two_out, "hf")), read_weights(os.path.join(one_out, "hf"))
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5
    grads = two["parameters"]["trainable"] * 4
    assert two["wire_bytes"]["dp"] == 3 * 2 * (2 * (2 - 1) * grads // 2)   # 3 steps, 2 replicas
    assert one["wire_bytes"]["dp"] == 0 and two["dp_replicas_identical"] is True


def test_reference_summary_is_the_pipelines(tmp_path):
    """The same summary.json keys as the pipeline engine's, plus the engine and the held-out curve."""
    s, _, out = _run(tmp_path, _config(tmp_path), "s", steps=4, extra=["--eval-every", "2"])
    assert s["engine"] == "reference" and s["mesh"] == {"dp": 1, "pp": 2, "anchor_replicas": 0, "parts": s["mesh"]["parts"]}
    assert [p["step"] for p in s["heldout_curve"]] == [0, 2, 4]
    assert s["heldout_curve"][-1]["loss"] == s["heldout_loss"] and "loss_coded" in s["heldout_curve"][0]
    for key in ("heldout_loss_first", "heldout_loss_masked", "heldout_loss_se", "wire_bytes", "bytes_per_token",
                "data", "codec", "dp_backend", "tokens_per_s"):
        assert key in s, key
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf"))
    assert m.config.tie_word_embeddings is False


@pytest.mark.multiproc
@pytest.mark.parametrize("correction", ["spectral", "delayed_ef"])
def test_the_anchor_circuit_equals_the_in_process_anchor(tmp_path, correction):
    """pp 2 x dp 2 with the anchor circuit (Z = 1 on 2 more ranks, waiting for a late anchor so the run
    is reproducible) equals the reference engine's in-process anchor: the same gradients at the same
    steps (through the DP replicas' fence), the same corrected training, the same anchor bytes."""
    from launch_helpers import torchrun
    anchor = {"enabled": True, "every": 2, "correction": correction, "max_wait_s": 120.0,
              "spectral": {"tau_mode": "relative", "tau": 0.05}}
    cfg = json.loads(open(_config(tmp_path, "m95", anchor=anchor)).read())
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.05}}
    cfg["gradient_clipping"] = 0.0
    path = tmp_path / "ap.json"
    path.write_text(json.dumps(cfg))
    pipe = str(tmp_path / "pipe")
    common = ["--model", "tiny", "--data", "deepspeed-cpp", "--deepspeed", str(path), "--steps", "8",
              "--seq-len", str(SEQ), "--pp", "2", "--eval-sequences", "0"]
    torchrun(6, [*common, "--dp", "2", "--anchor-replicas", "1", "--output-dir", pipe])
    ref, ref_loss, ref_out = _run(tmp_path, str(path), "ref", steps=8, extra=["--dp", "2", "--eval-sequences", "0"])
    p = read_summary(pipe)
    assert p["anchor"]["updates"] == ref["anchor"]["updates"] >= 2
    assert p["anchor"]["mean_staleness"] == ref["anchor"]["mean_staleness"] == 4.0   # 2 x every: the fence
    # gradients read by every replica and the fence's votes, exactly; the snapshots as weights in one
    # process and as DeepSpeed's layer files (pickle framing on top: ~36 kB a snapshot of the tiny model)
    assert 0 <= p["wire_bytes"]["anchor"] - ref["wire_bytes"]["anchor"] < 0.05 * p["wire_bytes"]["anchor"]
    assert [m["loss"] for m in read_metrics(pipe)] == pytest.approx(ref_loss, rel=1e-5)
    w, r = read_weights(os.path.join(pipe, "hf")), read_weights(os.path.join(ref_out, "hf"))
    assert max(float((w[k] - r[k]).abs().max()) for k in w) < 1e-4


def test_simulated_replicas_fail_loudly_and_recover():
    """A replica that raises stops the step with its error (the others do not hang) and the next step
    runs; replicas whose backends issue different collectives fail with a message, not a hang."""
    import threading
    from ds_twocircuit.engines.reference import InProcessGroup, run_replicas
    group = InProcessGroup(2)

    def sums(r):
        t = torch.tensor([float(r + 1)])
        group.comm(r).all_reduce_sum(t)
        return float(t)
    assert run_replicas(group, sums, 2) == [3.0, 3.0]

    def one_fails(r):
        if r == 1:
            raise ValueError("replica 1 broke")
        return sums(r)
    done = []
    t = threading.Thread(target=lambda: done.append(pytest.raises(ValueError, run_replicas, group, one_fails, 2)))
    t.start()
    t.join(30)
    assert not t.is_alive() and "replica 1 broke" in str(done[0].value)
    assert run_replicas(group, sums, 2) == [3.0, 3.0]          # the group works again

    def mismatched(r):
        return sums(r) if r == 0 else 0.0                       # replica 1 issues no collective
    t = threading.Thread(target=lambda: done.append(pytest.raises(RuntimeError, run_replicas, group, mismatched, 2)))
    t.start()
    t.join(30)
    assert not t.is_alive() and "issued different collectives" in str(done[1].value)


def test_dense_steps_and_evaluation_use_the_wire_dtype(tmp_path):
    """Clean steps and dense evaluation send the boundary through a dense codec in the run's wire dtype
    (bf16: half the fp32 bytes), as the pipeline engine does; the bf16 round trip changes the loss."""
    fp32, fp32_loss, _ = _run(tmp_path, _config(tmp_path, clean_every=1), "fp32", steps=2)
    bf16, bf16_loss, _ = _run(tmp_path, _config(tmp_path, clean_every=1, wire_dtype="bf16"), "bf16", steps=2)
    H, tokens = _hidden(), 2 * MB * GAS * SEQ
    assert fp32["wire_bytes"]["pp_activations"] == tokens * H * 4
    assert bf16["wire_bytes"]["pp_activations"] == bf16["wire_bytes"]["pp_gradients"] == tokens * H * 2
    assert bf16_loss != fp32_loss and bf16["heldout_loss"] != fp32["heldout_loss"]
    assert bf16["eval_wire_bytes"] > 0


def test_set_refuses_what_the_optimizer_does_not_take(tmp_path):
    from ds_twocircuit import train
    config = _config(tmp_path, "dense")
    for bad, needle in ((["--set", "optimizer.params.lrr=1"], "optimizer.params.lrr is not an argument"),
                        (["--set", "optimizer.parms.lr=1"], "allowed keys under optimizer: params, type"),
                        (["--set", "twocircuit.codecs=1"], "unknown key twocircuit.codecs"),
                        (["--set", "lr"], "expected KEY=VALUE")):
        args = train.parse_args(["--engine", "reference", "--model", "tiny", "--deepspeed", config, *bad])
        with pytest.raises(Exception, match=needle):
            train.make_plan(args, 1)


def test_reference_base_codes_the_drift_from_the_frozen_base_model(tmp_path):
    """twocircuit.codec.reference = base: the boundary carries the drift from the base model's own
    activation (a frozen copy the engine keeps). At step 0 the drift is zero, so the first step's loss
    is dense training's exactly, where the plain codec at the same bytes is not; the bytes are the
    layout's each way (activations: groups, gradients: grad_groups) plus the two bases of state."""
    dense, dense_loss, _ = _run(tmp_path, _config(tmp_path, "dense"), "dense", steps=2)
    plain, plain_loss, _ = _run(tmp_path, _config(tmp_path), "plain", steps=2)
    codec = {"groups": [[8, 4]], "grad_groups": [[16, 4]], "refresh_steps": [0, 1], "reference": "base"}
    ref, ref_loss, _ = _run(tmp_path, _config(tmp_path, codec=codec), "ref", steps=2)
    assert ref_loss[0] == dense_loss[0] != plain_loss[0]
    assert ref_loss[1] != dense_loss[1]                    # the gradient was coded at step 0
    H, tokens_per_step = _hidden(), MB * GAS * SEQ
    assert ref["codec"]["reference"] == "base" and ref["codec"]["grad_rank"] == 16
    assert ref["wire_bytes"]["pp_activations"] == 2 * tokens_per_step * (8 * 4 // 8 + 2)
    assert ref["wire_bytes"]["pp_gradients"] == 2 * tokens_per_step * (16 * 4 // 8 + 2)
    assert ref["wire_bytes"]["pp_codec_state"] == 2 * 2 * (H + H * 8 + H * 16)   # refreshed at steps 0 and 1
    # the coded evaluation adds the base activation too: through the codec it is near the dense score
    # (2 steps of drift), where the plain codec's 8 directions are not
    assert abs(ref["heldout_loss_masked"] - ref["heldout_loss"]) < abs(plain["heldout_loss_masked"] - plain["heldout_loss"])
    # two simulated replicas share the one frozen base model (each steps in its own thread): each
    # link gets its own tokens' base activation, so step 0 is still dense training's, on the same global batch
    dense2, dense2_loss, _ = _run(tmp_path, _config(tmp_path, "dense"), "dense2", steps=1, extra=["--dp", "2"])
    ref2, ref2_loss, _ = _run(tmp_path, _config(tmp_path, codec=codec), "ref2", steps=1, extra=["--dp", "2"])
    assert ref2_loss[0] == dense2_loss[0] and ref2["heldout_loss_masked"] is not None
