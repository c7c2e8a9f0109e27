"""Bad input fails before any process group exists, naming the key or file and what is allowed."""
import json
import os
import re

import pytest

from ds_twocircuit.config import ConfigError, TwoCircuitConfig, apply_overrides
from ds_twocircuit.train import make_plan, parse_args, run

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(os.path.dirname(HERE), "ds_configs")


def _cfg(tmp_path, **tc_over):
    base = json.load(open(os.path.join(CONFIGS, "m95.json")))
    top = tc_over.pop("_top", {})
    base["twocircuit"].update(tc_over)
    base.update(top)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(base))
    return str(path)


def _wide_tiny(tmp_path, hidden: int) -> str:
    """A model folder with tiny's config at another hidden size (planning reads only the config)."""
    from ds_twocircuit.models.presets import resolve_model
    cfg = json.load(open(os.path.join(resolve_model("tiny"), "config.json")))
    cfg["hidden_size"] = hidden
    folder = tmp_path / f"tiny{hidden}"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def _plan(tmp_path, argv, world=2):
    args = parse_args(["--model", "tiny"] + argv)
    return make_plan(args, world)


def test_shipped_configs_validate(tmp_path):
    for name in ("dense", "m90", "m95", "topk90"):
        plan = _plan(tmp_path, ["--deepspeed", os.path.join(CONFIGS, f"{name}.json")])
        assert plan.pp == 2 and plan.dp == 1
        assert plan.ds_config["train_batch_size"] == plan.mb * plan.gas


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(CONFIGS) if f.endswith(".json")))
def test_every_shipped_config_validates_with_its_documented_mesh(tmp_path, name):
    # m95_dp, lowrank_dp100, dense_dp200_olr15(_q3), dense_dp200_sqrtlr_q3(_delayed): a compressed DP sync
    is_dp = re.search(r"_dp\d*(_olr\d+|_sqrtlr)?(_q\d)?(_delayed)?$", name) is not None
    dp = 2 if is_dp else 1
    z = 1 if "_ap" in name else 0
    argv = ["--deepspeed", os.path.join(CONFIGS, f"{name}.json"), "--pp", "2", "--dp", str(dp)]
    if z:
        argv += ["--anchor-replicas", "1"]
    if name.startswith("lowrank"):   # 224 coefficients per token: a boundary at least that wide
        argv += ["--model", _wide_tiny(tmp_path, 256)]
    plan = _plan(tmp_path, argv, world=2 * dp + 2 * z)
    assert (plan.pp, plan.dp, plan.z) == (2, dp, z)
    mode, p = {"dense": ("dense", None), "m90": ("random", 0.90), "m95": ("random", 0.95),
               "topk90": ("topk", 0.90), "lowrank": ("lowrank", None), "lowrank20": ("lowrank", None),
               "meanfill95": ("meanfill", 0.95)}[name.split("_")[0]]
    assert plan.tc.mode == mode
    assert plan.tc.effective_mask_rate == (0.0 if p is None else pytest.approx(p))
    assert plan.tc.anchor.enabled == bool(z)
    assert (plan.tc.dp.backend != "allreduce") == is_dp


def _dp_plan(tmp_path, dp, scale, scheduler=None, lr=1e-4):
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": lr}}}
    if scheduler is not None:
        ds["scheduler"] = scheduler
    path = _cfg(tmp_path, mode="dense", mask_rate=0.0, _top=ds,
                dp={"backend": "streaming_diloco", "inner_steps": 4, "num_fragments": 2, "inner_lr_scale": scale})
    return _plan(tmp_path, ["--deepspeed", path, "--pp", "2", "--dp", str(dp)], world=2 * dp)


def test_inner_lr_scale_multiplies_the_optimizer_and_scheduler_lrs(tmp_path):
    """``twocircuit.dp.inner_lr_scale``: the optimizer's lr (the one both engines build from) and a
    DeepSpeed scheduler's absolute lrs times sqrt(dp) (or the number); dp 1 keeps them."""
    for dp, want in ((1, 1e-4), (2, 1e-4 * 2 ** 0.5), (4, 2e-4)):
        assert _dp_plan(tmp_path, dp, "sqrt_replicas").optimizer[1]["lr"] == pytest.approx(want, rel=1e-12)
    assert _dp_plan(tmp_path, 2, 1.5).optimizer[1]["lr"] == pytest.approx(1.5e-4, rel=1e-12)
    assert _dp_plan(tmp_path, 2, 1.0).optimizer[1]["lr"] == 1e-4
    path = _cfg(tmp_path, mode="dense", mask_rate=0.0,        # --lr is the base the scale multiplies
                dp={"backend": "streaming_diloco", "inner_steps": 4, "num_fragments": 2, "inner_lr_scale": "sqrt_replicas"})
    plan = _plan(tmp_path, ["--deepspeed", path, "--pp", "2", "--dp", "4", "--lr", "3e-4"], world=8)
    assert plan.optimizer[1]["lr"] == pytest.approx(6e-4, rel=1e-12)
    warm = {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-4, "warmup_num_steps": 5, "total_num_steps": 50}}
    plan = _dp_plan(tmp_path, 4, "sqrt_replicas", warm)
    assert plan.ds_config["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": pytest.approx(2e-4),
                                                     "warmup_num_steps": 5, "total_num_steps": 50}
    cycle = {"type": "OneCycle", "params": {"cycle_min_lr": [1e-5, 2e-5], "cycle_max_lr": 1e-4, "decay_lr_rate": 0.1}}
    params = _dp_plan(tmp_path, 4, "sqrt_replicas", cycle).ds_config["scheduler"]["params"]
    assert params == {"cycle_min_lr": [pytest.approx(2e-5), pytest.approx(4e-5)], "cycle_max_lr": pytest.approx(2e-4),
                      "decay_lr_rate": 0.1}   # a rate, not a lr: unscaled
    # the shipped DP candidate: AdamW at 1e-4 on one replica, sqrt(2) x 1e-4 on two
    path = os.path.join(CONFIGS, "dense_dp200_sqrtlr_q3.json")
    plan = _plan(tmp_path, ["--deepspeed", path, "--pp", "2", "--dp", "2"], world=4)
    assert plan.optimizer[1]["lr"] == pytest.approx(1e-4 * 2 ** 0.5, rel=1e-12) and plan.tc.dp.outer_lr == 1.0


@pytest.mark.parametrize("scheduler,match", [
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 5}}, r"scheduler\.params\.warmup_max_lr is not set"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-5, "cycle_max_lr": "big"}},
     r"scheduler\.params\.cycle_max_lr must be a number"),
    ({"type": "Cosine", "params": {}}, r"scheduler\.type = 'Cosine' with twocircuit\.dp\.inner_lr_scale"),
])
def test_inner_lr_scale_refuses_a_scheduler_lr_it_cannot_scale(tmp_path, scheduler, match):
    with pytest.raises(ConfigError, match=match):
        _dp_plan(tmp_path, 2, "sqrt_replicas", scheduler)


@pytest.mark.parametrize("rate", [1.0, -0.1, 1.5])
def test_mask_rate_outside_range(tmp_path, rate):
    with pytest.raises(ConfigError, match=r"twocircuit\.mask_rate .*\[0\.0, 1\.0\)"):
        _plan(tmp_path, ["--deepspeed", _cfg(tmp_path, mask_rate=rate)])


def test_more_stages_than_layers(tmp_path):
    with pytest.raises(ConfigError, match=r"--pp 8: more pipeline stages than the model's 4 decoder"):
        _plan(tmp_path, ["--deepspeed", _cfg(tmp_path), "--pp", "8"], world=8)


def test_unknown_twocircuit_key(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key twocircuit\.mask_rat;"):
        _plan(tmp_path, ["--deepspeed", _cfg(tmp_path, mask_rat=0.9)])
    with pytest.raises(ConfigError, match=r"unknown key twocircuit\.anchor\.evry"):
        TwoCircuitConfig.from_dict({"anchor": {"evry": 3}})
    with pytest.raises(ConfigError, match=r"twocircuit\.dp"):
        TwoCircuitConfig.from_dict({"dp": {"backend": "allreduce", "bogus": 1}})


def test_zero2_with_pipeline(tmp_path):
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage = 2 cannot be used with pipeline"):
        _plan(tmp_path, ["--deepspeed", _cfg(tmp_path, _top={"zero_optimization": {"stage": 2}})])


def test_model_path_missing(tmp_path):
    args = parse_args(["--model", str(tmp_path / "nope"), "--deepspeed", _cfg(tmp_path)])
    with pytest.raises(ConfigError, match=r"--model .*nope.* does not exist"):
        make_plan(args, 2)


def test_empty_corpus(tmp_path):
    empty = tmp_path / "corpus"
    empty.mkdir()
    (empty / "blank.txt").write_text("")
    with pytest.raises(ConfigError, match=r"--data .*corpus.*empty"):
        _plan(tmp_path, ["--deepspeed", _cfg(tmp_path), "--data", str(empty)])


def test_seq_len_above_model_limit(tmp_path):
    with pytest.raises(ConfigError, match=r"--seq-len 4096 is above the model's limit \(max_position_embeddings = 512\)"):
        _plan(tmp_path, ["--deepspeed", _cfg(tmp_path), "--seq-len", "4096"])


def test_config_file_missing_and_invalid_json(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist"):
        _plan(tmp_path, ["--deepspeed", str(tmp_path / "missing.json")])
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(ConfigError, match=r"bad\.json.*not valid JSON"):
        _plan(tmp_path, ["--deepspeed", str(bad)])


def test_world_does_not_fit_mesh(tmp_path):
    with pytest.raises(ConfigError, match=r"multiple of --pp"):
        _plan(tmp_path, ["--deepspeed", _cfg(tmp_path), "--pp", "2"], world=3)


def test_run_returns_exit_code_2_with_message(tmp_path, capsys, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    rc = run(["--model", "tiny", "--deepspeed", _cfg(tmp_path, mask_rate=1.0)])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: twocircuit.mask_rate") and "Traceback" not in err


def test_diloco_refuses_zero_and_bf16_under_pp(tmp_path):
    dp = {"backend": "diloco", "inner_steps": 4}
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage = 1 re-syncs"):
        _plan(tmp_path, ["--deepspeed", _cfg(tmp_path, dp=dp, _top={"zero_optimization": {"stage": 1}})])
    with pytest.raises(ConfigError, match=r"bf16\.enabled"):
        _plan(tmp_path, ["--deepspeed", _cfg(tmp_path, dp=dp, _top={"bf16": {"enabled": True}})])
    with pytest.raises(ConfigError, match=r"fp16\.enabled: DeepSpeed's fp16 optimizer keeps fp32 master"):
        _plan(tmp_path, ["--deepspeed", _cfg(tmp_path, dp=dp, _top={"fp16": {"enabled": True}})])


def test_streaming_diloco_refuses_synced_tied_embeddings(tmp_path):
    dp = {"backend": "streaming_diloco", "inner_steps": 4, "num_fragments": 2}
    with pytest.raises(ConfigError, match=r"tied_embeddings = 'sync'"):
        _plan(tmp_path, ["--deepspeed", _cfg(tmp_path, dp=dp, tied_embeddings="sync")])


SHIPPED_WITH_DP = sorted(os.path.join(d, f) for d in (CONFIGS, os.path.join(CONFIGS, "accelerate"))
                         for f in os.listdir(d) if f.endswith(".json"))


@pytest.mark.parametrize("path", SHIPPED_WITH_DP, ids=os.path.basename)
def test_shipped_dp_section_is_recorded_as_its_backend_and_its_own_keys(path):
    """summary.json's config.twocircuit.dp: the backend's name and its own keys, with what the file
    says (defaults filled in), and none of another backend's keys."""
    raw = json.load(open(path))["twocircuit"]
    tc = TwoCircuitConfig.from_dict(raw)
    dp, d = tc.dp, json.loads(json.dumps(tc.to_dict()))["dp"]
    assert set(d) == {"backend"} | type(dp).keys() and d["backend"] == raw["dp"]["backend"]
    for k, v in raw["dp"].items():
        assert ({kk: d[k][kk] for kk in v} if isinstance(v, dict) else d[k]) == v, k


def test_anchor_launch_shapes(tmp_path):
    plan = _plan(tmp_path, ["--deepspeed", os.path.join(CONFIGS, "m95_ap.json"), "--pp", "2",
                            "--anchor-replicas", "1"], world=4)
    assert (plan.pp, plan.dp, plan.z, plan.anchor_ranks) == (2, 1, 1, 2)
    with pytest.raises(ConfigError, match=r"plus 1 anchor replica"):
        _plan(tmp_path, ["--deepspeed", os.path.join(CONFIGS, "m95_ap.json"), "--pp", "2"], world=2)
    plan = _plan(tmp_path, ["--deepspeed", os.path.join(CONFIGS, "m95_ap.json"), "--pp", "2", "--anchor-only",
                            "--dp", "3"], world=2)
    assert (plan.z, plan.anchor_ranks, plan.dp) == (1, 2, 3)


def test_plan_and_config_are_read_once_and_never_written(tmp_path):
    import dataclasses
    plan = _plan(tmp_path, ["--deepspeed", os.path.join(CONFIGS, "m95_ap.json"), "--pp", "2",
                            "--anchor-replicas", "1", "--anchor-store", str(tmp_path / "s")], world=4)
    assert plan.tc.anchor.enabled and plan.tc.anchor.store == str(tmp_path / "s")  # flags applied
    for obj, attr in ((plan, "dp"), (plan.tc, "mode"), (plan.tc.anchor, "enabled"),
                      (plan.tc.anchor.spectral, "alpha"), (plan.tc.dp, "backend"),
                      (TwoCircuitConfig.from_dict({"mode": "lowrank"}).codec, "refresh_every")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, attr, getattr(obj, attr))
    # the shipped file itself says anchor.store = "" : the override made a copy
    raw = json.load(open(os.path.join(CONFIGS, "m95_ap.json")))["twocircuit"]
    assert TwoCircuitConfig.from_dict(raw).anchor.store == raw.get("anchor", {}).get("store", "")
    d = plan.tc.to_dict()
    assert json.loads(json.dumps(d))["dp"]["backend"] == plan.tc.dp.backend and "explicit" not in d["dp"]


@pytest.mark.parametrize("section, message", [
    ({"mask_rate": 2}, "twocircuit.mask_rate = 2.0 is outside the allowed range [0.0, 1.0)"),
    ({"dp": {"backend": "diloco", "outer_momentum": 1.5}},
     "twocircuit.dp.outer_momentum = 1.5 is outside the allowed range [0.0, 1.0)"),
    ({"dp": {"backend": "diloco", "inner_steps": 0}},
     "twocircuit.dp.inner_steps = 0 is outside the allowed range [1, inf)"),
    ({"anchor": {"every": "5"}}, "twocircuit.anchor.every must be an integer, got '5'"),
    ({"dp": {"backend": "diloco", "inner_steps": "5"}}, "twocircuit.dp.inner_steps must be an integer, got '5'"),
    ({"rescale": 1}, "twocircuit.rescale must be true or false, got 1"),
    ({"dp": {"backend": "diloco", "nesterov": 1}}, "twocircuit.dp.nesterov must be true or false, got 1"),
    ({"anchor": {"spectral": {"alpha": float("nan")}}}, "twocircuit.anchor.spectral.alpha must be finite"),
    ({"dp": {"inner_step": 3}}, "unknown key twocircuit.dp.inner_step; allowed keys under twocircuit.dp:"),
    ({"mode": "lowrank", "codec": {"group": []}}, "unknown key twocircuit.codec.group; allowed keys under twocircuit.codec:"),
    ({"codec": {"groups": []}}, "twocircuit.codec is not used by twocircuit.mode = 'random'"),
    ({"dp": [1]}, "twocircuit.dp must be a JSON object, got list"),
])
def test_one_wording_for_every_section(section, message):
    """config.py and dp/config.py share one kit (configkit): the same error reads the same."""
    with pytest.raises(ConfigError) as ei:
        TwoCircuitConfig.from_dict(section)
    assert str(ei.value).startswith(message), str(ei.value)


@pytest.mark.parametrize("name", ["powersgd", "diloco", "streaming_diloco"])
def test_shipped_accelerate_configs_point_at_valid_deepspeed_jsons(name):
    folder = os.path.join(CONFIGS, "accelerate")
    yaml = open(os.path.join(folder, f"{name}.yaml")).read()
    assert f"deepspeed_config_file: ds_configs/accelerate/{name}.json" in yaml
    assert "distributed_type: DEEPSPEED" in yaml and "mixed_precision" not in yaml  # Accelerate refuses it
    ds = json.load(open(os.path.join(folder, f"{name}.json")))
    assert TwoCircuitConfig.from_dict(ds["twocircuit"]).dp.backend == name
    # integers, not "auto": Accelerate on a CPU host counts one process per rank
    assert all(isinstance(ds[k], int) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"))
    assert "train_batch_size" not in ds


def test_lora_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(ConfigError, match=r"twocircuit\.lora with twocircuit\.tied_embeddings = 'sync'.*use 'freeze'"):
        TwoCircuitConfig.from_dict({"tied_embeddings": "sync", "lora": {"r": 8}})
    with pytest.raises(ConfigError, match=r"--lora-r must be >= 0"):
        _plan(tmp_path, ["--deepspeed", os.path.join(CONFIGS, "m95.json"), "--lora-r", "-1"])
    with pytest.raises(ConfigError, match=r"twocircuit\.lora\.target_modules must be a non-empty list"):
        TwoCircuitConfig.from_dict({"lora": {"r": 8, "target_modules": []}})
    plan = _plan(tmp_path, ["--deepspeed", os.path.join(CONFIGS, "m95.json"), "--lora-r", "16"])
    assert plan.tc.lora.r == 16 and plan.tc.lora.enabled


def test_lora_refuses_a_stage_without_decoder_layers(tmp_path, monkeypatch):
    from ds_twocircuit.models import layers
    # tiny has 4 decoders (pipeline layers 1..4, norm 5, head 6): stage 1 = the norm alone
    monkeypatch.setattr(layers.ModelSpec, "parts", lambda self, n, m: [0, 5, 6, 7])
    argv = ["--deepspeed", os.path.join(CONFIGS, "m95.json"), "--pp", "3"]
    assert _plan(tmp_path, argv, world=3).pp == 3                  # without LoRA: allowed
    with pytest.raises(ConfigError, match=r"stage 1 of --pp 3 holds no decoder layer"):
        _plan(tmp_path, argv + ["--lora-r", "8"], world=3)


def test_software_throttle_refuses_bad_rates_and_nccl(tmp_path, capsys, monkeypatch):
    from ds_twocircuit import pacing
    with pytest.raises(ConfigError, match=r"--pace-mbit must be >= 0 Mbit/s"):
        _plan(tmp_path, ["--deepspeed", os.path.join(CONFIGS, "m95.json"), "--pace-mbit", "-8"])
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(pacing, "_configured", False)
    monkeypatch.setenv(pacing.ENV, "eight")
    assert run(["--model", "tiny", "--deepspeed", os.path.join(CONFIGS, "m95.json"), "--pp", "1"]) == 2
    assert "DS_TWOCIRCUIT_PACE_MBIT='eight': expected a rate in Mbit/s" in capsys.readouterr().err
    import ds_twocircuit.adapters.dist as dist_adapter
    monkeypatch.setattr(dist_adapter, "comm_backend", lambda: "nccl")
    assert run(["--model", "tiny", "--deepspeed", os.path.join(CONFIGS, "m95.json"), "--pp", "1",
                "--pace-mbit", "200"]) == 2
    err = capsys.readouterr().err
    assert "paces gloo's sends" in err and "this run uses nccl" in err and "launch/mesh.py" in err
    pacing.configure(None)


def test_lowrank_codec_wider_than_the_boundary_is_refused_before_start(tmp_path):
    """lowrank.json (224 coefficients) on a model whose boundary is 64 wide: found in the plan, with
    what to use, instead of a traceback from the first send."""
    with pytest.raises(ConfigError, match=r"224 coefficients per token, but the boundary of --model tiny is 64 "
                                          r"wide; use at most 64 \(e\.g\. \"groups\": \[\[64, 4\]\]\)"):
        _plan(tmp_path, ["--deepspeed", os.path.join(CONFIGS, "lowrank.json")])
    assert _plan(tmp_path, ["--deepspeed", os.path.join(CONFIGS, "lowrank.json"), "--pp", "1"], world=1).pp == 1


def test_set_warns_only_for_keys_deepspeed_does_not_name(tmp_path):
    """--set bf16.enabled=true (how a GPU user turns bf16 on) adds a key DeepSpeed reads: no spelling
    warning; a misspelt section or field still warns, and the value lands either way."""
    import warnings
    from ds_twocircuit.adapters.dsconfig import deepspeed_knows
    base = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 0}}
    for good in ("bf16.enabled=true", "fp16.loss_scale=0", "gradient_clipping=0.5", "wall_clock_breakdown=true",
                 "zero_optimization.overlap_comm=true", "optimizer.params.weight_decay=0.1",
                 "activation_checkpointing.partition_activations=true"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = apply_overrides(base, [good], known=deepspeed_knows)
        key, value = good.split("=")
        node = out
        for k in key.split("."):
            node = node[k]
        assert node == json.loads(value)
    for bad in ("bf61.enabled=true", "bf16.enable=true", "gradient_cliping=1.0", "zero_optimization.overlap_com=true",
                "optimizer.parms.lr=1"):
        with pytest.warns(UserWarning, match="check its spelling"):
            apply_overrides(base, [bad], known=deepspeed_knows)
    # the driver passes DeepSpeed's names: a GPU user's --set bf16.enabled=true reaches the plan silently
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        plan = _plan(tmp_path, ["--deepspeed", os.path.join(CONFIGS, "m95.json"), "--set", "bf16.enabled=true"])
    assert plan.ds_config["bf16"] == {"enabled": True}


def test_device_is_the_reference_engines_and_must_exist(tmp_path):
    """--device names where --engine reference computes; the pipeline engine takes the launcher's
    accelerator, and a CUDA device that is not there fails before any model is loaded."""
    with pytest.raises(ConfigError, match=r"--device 'cuda:99': no such CUDA device here"):
        _plan(tmp_path, ["--engine", "reference", "--device", "cuda:99"], world=1)
    with pytest.raises(ConfigError, match=r"only --engine reference takes a device"):
        _plan(tmp_path, ["--device", "cuda"])
    with pytest.raises(ConfigError, match=r"not a device"):
        _plan(tmp_path, ["--engine", "reference", "--device", "gpu0"], world=1)
    plan = _plan(tmp_path, ["--engine", "reference", "--device", "cpu", "--deepspeed",
                            os.path.join(CONFIGS, "m95.json")], world=1)
    assert plan.args.device == "cpu"


SHIPPED_SYNC = "dp100_q4_f4_tau4"     # the fullstack_screen.jsonl rows the shipped 4-bit sync comes from


def _benchmark_rows(name: str) -> list[dict]:
    """Every row of docs/benchmarks/<name>.jsonl, in file order (reruns included)."""
    with open(os.path.join(os.path.dirname(CONFIGS), "docs", "benchmarks", f"{name}.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("shipped, screened", [("dense_dp200", "dp100_q4"), ("lowrank_dp200", "lowrank_dp100_q4")])
def test_dp200_configs_are_the_screened_files(shipped, screened):
    """README's quality claims for the 4-bit sync come from fullstack_screen.jsonl, whose rows ran
    docs/benchmarks/fullstack_screen_configs/*.json, the shipped schedule (4 fragments, a 4-step
    overlap window) as the --set overrides of its SHIPPED_SYNC rows: the shipped file must be that
    config."""
    root = os.path.dirname(CONFIGS)
    rows = _benchmark_rows("fullstack_screen")
    screened_rows = [r for r in rows if r["label"] == SHIPPED_SYNC]
    assert screened_rows
    overrides = {tuple(r["overrides"]) for r in screened_rows}
    assert overrides == {("twocircuit.dp.num_fragments=4", "twocircuit.dp.overlap_steps=4")}
    assert {r["config"] for r in screened_rows} == {"docs/benchmarks/fullstack_screen_configs/dp100_q4.json"}
    a = json.load(open(os.path.join(CONFIGS, f"{shipped}.json")))
    b = json.load(open(os.path.join(root, "docs", "benchmarks", "fullstack_screen_configs", f"{screened}.json")))
    assert a == apply_overrides(b, list(next(iter(overrides)))) and a != b
    dp = a["twocircuit"]["dp"]
    assert (dp["backend"], dp["compression"], dp["quant"]["bits"]) == ("streaming_diloco", "quant", 4)


def test_lowrank20_is_the_screened_drift_layout():
    """codec20_drift_screen.jsonl's lowrank_base_f88_gradfwd_every10 rows ran ds_configs/lowrank.json
    with --set overrides: the shipped lowrank20.json must be exactly that config, so that a user who
    runs the file trains what was measured (and the next seeds can run the file itself)."""
    rows = _benchmark_rows("codec20_drift_screen")
    screened = [r for r in rows if r["label"] == "lowrank_base_f88_gradfwd_every10"]
    assert screened
    shipped = json.load(open(os.path.join(CONFIGS, "lowrank20.json")))
    for r in screened:
        if r["config"].endswith("lowrank20.json"):
            assert r["overrides"] == []
            continue
        assert r["config"] == "ds_configs/lowrank.json"
        assert shipped == apply_overrides(json.load(open(os.path.join(CONFIGS, "lowrank.json"))), r["overrides"])
    codec = shipped["twocircuit"]["codec"]
    assert (codec["groups"], codec["grad_groups"], codec["reference"], codec["grad_basis"], codec["refresh_every"]) \
        == ([[88, 4]], [[88, 4]], "base", "forward", 10)
    # the coefficients and their bf16 scale each way (46 bytes), as every screened run measured them,
    # and with the refits' state the busier direction stays under 1/20 of SmolLM2's bf16 boundary
    # (576 channels x 2 bytes / 20 = 57.6)
    per_token = sum(n * bits for n, bits in codec["groups"]) / 8 + 2
    assert per_token == sum(n * bits for n, bits in codec["grad_groups"]) / 8 + 2 == 46
    for r in screened:
        assert r["pp_bytes_per_token_bwd"] == per_token and per_token < r["pp_bytes_per_token_fwd"] <= 576 * 2 / 20
        assert r["pp_bytes_ratio_bf16_busier"] >= 20


def test_quality_rows_copied_from_screens_ran_the_file_they_name():
    """docs/benchmarks/quality.jsonl (issue 26's study) names each row by its shipped config file; a row
    that ran under another name (a screen's label, or lowrank.json + --set overrides before the file
    existed) keeps that in ``ran_as``, and what it ran must be exactly the file it names now."""
    root = os.path.dirname(CONFIGS)
    rows = _benchmark_rows("quality")
    assert {r["domain"] for r in rows} == {"sympy", "deepspeed-cpp"}
    moved = [r for r in rows if "ran_as" in r]
    assert moved
    for r in rows:
        assert r["overrides"] == [] and r["label"] == os.path.basename(r["config"])[:-5]
        named = json.load(open(os.path.join(root, r["config"])))
        if "ran_as" in r:
            ran = json.load(open(os.path.join(root, r["ran_as"]["config"])))
            assert named == apply_overrides(ran, r["ran_as"]["overrides"]), r["ran_as"]


def test_the_full_stack_candidate_is_the_codec_candidate_with_the_dp_candidates_sync():
    """ds_configs/lowrank20_metric98_m20_dp200_sqrtlr_q3_delayed.json (issue 27's full stack): exactly the
    codec study's candidate (lowrank20_metric98_m20.json) with the sync whose quality fullstack.md measures
    alone (dense_dp200_sqrtlr_q3_delayed.json: dense_dp200.json's sync at 3 bits, outer lr 1, the inner lr
    times sqrt(N), the delayed merge rule), so the two compressions' costs can be told apart."""
    for old in ("lowrank20_metric98_m20_dp200_olr15.json", "lowrank20_metric98_m20_dp200_olr15_q3.json",
                "lowrank20_metric98_m20_dp200_sqrtlr_q3.json"):
        assert not os.path.exists(os.path.join(CONFIGS, old))   # renamed, no rows
    stack = json.load(open(os.path.join(CONFIGS, "lowrank20_metric98_m20_dp200_sqrtlr_q3_delayed.json")))
    codec = json.load(open(os.path.join(CONFIGS, "lowrank20_metric98_m20.json")))
    sync = json.load(open(os.path.join(CONFIGS, "dense_dp200_sqrtlr_q3_delayed.json")))
    assert stack["twocircuit"]["dp"] == sync["twocircuit"]["dp"] and sync["twocircuit"]["dp"]["backend"] != "allreduce"
    assert stack["twocircuit"]["dp"]["outer_lr"] == 1.0 and stack["twocircuit"]["dp"]["quant"]["bits"] == 3
    assert stack["twocircuit"]["dp"]["inner_lr_scale"] == "sqrt_replicas"
    assert stack["twocircuit"]["dp"]["merge_rule"] == "delayed" and "merge_alpha" not in stack["twocircuit"]["dp"]
    # the mix file is the 3-bit outer-lr file's sync at outer lr 1 with the sqrt(N) inner lr; the
    # delayed file is the mix file with only the merge rule changed (the next test)
    olr = json.load(open(os.path.join(CONFIGS, "dense_dp200_olr15_q3.json")))["twocircuit"]["dp"]
    mix = json.load(open(os.path.join(CONFIGS, "dense_dp200_sqrtlr_q3.json")))["twocircuit"]["dp"]
    assert {**olr, "outer_lr": 1.0, "inner_lr_scale": "sqrt_replicas"} == mix
    assert {k: v for k, v in stack["twocircuit"].items() if k != "dp"} == \
        {k: v for k, v in codec["twocircuit"].items() if k != "dp"}
    assert {k: v for k, v in stack.items() if k != "twocircuit"} == {k: v for k, v in codec.items() if k != "twocircuit"}


def test_the_delayed_dp_candidate_is_the_screened_config():
    """ds_configs/dense_dp200_sqrtlr_q3_delayed.json equals, key for key, the screen config whose
    41-step rows (fullstack_screen.md, both domains) made it the DP candidate: dense_dp200_sqrtlr_q3.json
    with the delayed merge rule instead of the 50/50 mix, so its 250k-token rows train what was screened."""
    root = os.path.dirname(CONFIGS)
    screened = json.load(open(os.path.join(root, "docs", "benchmarks", "fullstack_screen_configs",
                                           "dp200_sqrtlr_q3_delayed.json")))
    shipped = json.load(open(os.path.join(CONFIGS, "dense_dp200_sqrtlr_q3_delayed.json")))
    assert shipped == screened
    mix = json.load(open(os.path.join(CONFIGS, "dense_dp200_sqrtlr_q3.json")))
    dp = dict(mix["twocircuit"]["dp"])
    assert dp.pop("merge_alpha") == 0.5
    assert shipped == {**mix, "twocircuit": {**mix["twocircuit"], "dp": {**dp, "merge_rule": "delayed"}}}
    screen_rows = [r for r in _benchmark_rows("fullstack_screen") if r["label"] == "dp200_sqrtlr_q3_delayed"]
    assert {r["domain"] for r in screen_rows} == {"sympy", "deepspeed-cpp"}
    assert all(r["config"] == "docs/benchmarks/fullstack_screen_configs/dp200_sqrtlr_q3_delayed.json"
               and r["overrides"] == [] for r in screen_rows)
    plan_dp = TwoCircuitConfig.from_dict(shipped["twocircuit"]).dp
    assert plan_dp.merge_rule == "delayed" and plan_dp.outer_lr == 1.0


def test_lowrank20_metric98_is_lowrank20_plus_the_screened_metric_layout():
    """ds_configs/lowrank20_metric98.json is lowrank20.json plus the overrides of the 20-step screen row
    lowrank20_metric_f98_s8 (the basis in the gradient metric, 98 coefficients each way, the refits'
    basis in int8), so its runs train what was screened. Its bytes from the file: 51 a token each way
    plus the refits' state, which over the study's 123 steps of 1,024 tokens a replica keeps the forward
    under 1/20 of SmolLM2's bf16 boundary (57.6), and the metric's one upper triangle back."""
    rows = _benchmark_rows("codec20_drift_screen")
    screen = [r for r in rows if r["label"] == "lowrank20_metric_f98_s8"]
    assert screen and all(r["config"] == "ds_configs/lowrank20.json" for r in screen)
    shipped = json.load(open(os.path.join(CONFIGS, "lowrank20_metric98.json")))
    base = json.load(open(os.path.join(CONFIGS, "lowrank20.json")))
    for r in screen:
        assert shipped == apply_overrides(base, r["overrides"])
    study = _benchmark_rows("quality")
    own = [r for r in rows + study if r["label"] == "lowrank20_metric98"]
    assert own and all(r["config"] == "ds_configs/lowrank20_metric98.json" and r["overrides"] == []
                       for r in own)   # the rows under the file's name ran it without overrides
    from ds_twocircuit.codecs.lowrank import LowRankConfig
    codec = vars(LowRankConfig(**shipped["twocircuit"]["codec"]))   # with the defaults (metric_steps)
    H, T = 576, 123 * 1024                           # SmolLM2's width; the study's tokens per replica
    per_token = sum(n * b for n, b in codec["groups"]) / 8 + 2
    assert per_token == sum(n * b for n, b in codec["grad_groups"]) / 8 + 2 == 51
    rank = sum(n for n, _ in codec["groups"])
    last, every = max(codec["refresh_steps"]), codec["refresh_every"]
    refits = len(codec["refresh_steps"]) + len(range(last + every, 123, every))   # 0, 2, 8, 32, then every 10
    state = rank * H + rank * 2 + H * 2 + rank * 2   # int8 basis + its per-direction bf16 scales, mean, coef scales
    assert refits == 13 and codec["metric_steps"] == [1] and 2 in codec["refresh_steps"]   # the metric's refit rides on step 2's
    fwd = per_token + refits * state / T
    assert fwd <= H * 2 / 20 < fwd + 1
    assert per_token + H * (H + 1) / T < H * 2 / 20   # the metric's bf16 upper triangle, once, back
    for r in screen:   # the screen's state bytes are its 3 refits' (steps 0, 2, 8) on each of 2 replicas
        assert r["pp_codec_state_bytes"] == 3 * 2 * state and r["pp_grad_state_bytes"] == 2 * H * (H + 1)


def test_lowrank20_metric98_m20_is_the_candidate_with_the_screened_metric_refits():
    """ds_configs/lowrank20_metric98_m20.json is lowrank20_metric98.json with the gradient metric sent again
    every 20 steps (metric_every; window 8, rank 128), the codec20 screen's lowrank20_metric98_m20w8k128
    row: that row listed the steps (1, 21, ..., 101) for its 123 steps, and the file's metric steps are
    the same through step 120. Its bytes from the file over the study's 123 steps of 1,024 tokens a
    replica: the forward with its refits (a metric crossing on step s refits on step s + 1, off the
    10-step schedule only at 22) and the backward with seven rank-128 metrics both stay under 1/20 of
    SmolLM2's bf16 boundary (57.6)."""
    rows = _benchmark_rows("codec20_drift_screen")
    study = _benchmark_rows("quality")
    shipped = json.load(open(os.path.join(CONFIGS, "lowrank20_metric98_m20.json")))
    base = json.load(open(os.path.join(CONFIGS, "lowrank20_metric98.json")))
    assert shipped == apply_overrides(base, ["twocircuit.codec.metric_every=20", "twocircuit.codec.metric_window=8",
                                             "twocircuit.codec.metric_rank=128"])
    from ds_twocircuit.codecs import build_codec
    from ds_twocircuit.codecs.lowrank import LowRankConfig
    screen = [r for r in rows if r["label"] == "lowrank20_metric98_m20w8k128"]
    assert screen and all(r["config"] == "ds_configs/lowrank20_metric98.json" for r in screen)
    for r in screen:
        ran = apply_overrides(base, r["overrides"])["twocircuit"]["codec"]
        listed, every = build_codec("lowrank", cfg=ran), build_codec("lowrank", cfg=shipped["twocircuit"]["codec"])
        assert [s for s in range(121) if listed.metric_due(s)] == [s for s in range(121) if every.metric_due(s)] \
            == [1, 21, 41, 61, 81, 101]
        # the gradients each metric takes, too (from step 113 the file collects for its step-121 metric)
        assert all(listed.metric_collects(s, f) == every.metric_collects(s, f) for s in range(113) for f in (True, False))
        assert not listed.metric_collects(113, True) and every.metric_collects(113, True)
    own = [r for r in rows + study if r["label"] == "lowrank20_metric98_m20"]
    assert all(r["config"] == "ds_configs/lowrank20_metric98_m20.json" and r["overrides"] == [] for r in own)
    codec = vars(LowRankConfig(**shipped["twocircuit"]["codec"]))
    H, T, steps = 576, 123 * 1024, 123
    shipped_codec = build_codec("lowrank", cfg=shipped["twocircuit"]["codec"])
    metrics = [s for s in range(steps) if shipped_codec.metric_due(s)]
    assert metrics == [1, 21, 41, 61, 81, 101, 121]
    rank, last, every = sum(n for n, _ in codec["groups"]), max(codec["refresh_steps"]), codec["refresh_every"]
    refits = set(codec["refresh_steps"]) | set(range(last + every, steps, every)) | {s + 1 for s in metrics if s + 1 < steps}
    assert len(refits) == 14 and sorted(refits - set(range(last + every, steps, every)) - set(codec["refresh_steps"])) == [22]
    per_token = sum(n * b for n, b in codec["groups"]) / 8 + 2
    state = rank * H + rank * 2 + H * 2 + rank * 2
    k = codec["metric_rank"]
    metric_bytes = H * k + k * 2 + (k + 1) * 2      # int8 eigenvectors, their bf16 scales, k + 1 bf16 eigenvalues
    assert metric_bytes == 74242
    fwd, bwd = per_token + len(refits) * state / T, per_token + len(metrics) * metric_bytes / T
    assert bwd < fwd <= H * 2 / 20
    for r in screen:   # the screen's 123 steps: 6 metrics (its list ends at 101) and the same 14 refits
        assert r["pp_grad_state_bytes"] == 2 * 6 * metric_bytes
        assert r["pp_codec_state_bytes"] == 2 * len(refits) * state


def test_dense_dp200_olr15_is_the_screened_outer_lr():
    """ds_configs/dense_dp200_olr15.json is dense_dp200.json with the override of fullstack_screen.jsonl's
    dp200_olr15 rows (outer lr 1.5), screened on both domains before the file existed, so that its
    250k-token rows train what was screened; dense_dp200.json itself, and its measured rows, stay as they
    were."""
    _, _, base = _screened_on_both_domains("dp200_olr15", "dense_dp200", "twocircuit.dp.outer_lr=1.5", "dense_dp200_olr15")
    assert base["twocircuit"]["dp"]["outer_lr"] == 1.0


def _screened_on_both_domains(label: str, base: str, override: str, shipped: str):
    """fullstack_screen.jsonl's ``label`` rows ran ``base`` with the one ``override`` on both domains, and
    ds_configs/<shipped>.json is exactly that: (the screen's rows, all rows, the base config)."""
    rows = _benchmark_rows("fullstack_screen")
    screened = [r for r in rows if r["label"] == label]
    assert {r["domain"] for r in screened} == {"sympy", "deepspeed-cpp"}
    assert {(r["config"], tuple(r["overrides"])) for r in screened} == {(f"ds_configs/{base}.json", (override,))}
    file = json.load(open(os.path.join(CONFIGS, f"{shipped}.json")))
    cfg = json.load(open(os.path.join(CONFIGS, f"{base}.json")))
    assert file == apply_overrides(cfg, [override]) and file != cfg
    return screened, rows, cfg


def test_dense_dp200_olr15_q3_is_the_screened_3bit_sync_at_100x_against_bf16():
    """ds_configs/dense_dp200_olr15_q3.json (issue 27's DP candidate) is dense_dp200_olr15.json with its
    pseudo-gradients at 3 bits, what fullstack_screen.jsonl's dp200_olr15_q3 rows ran on both domains
    before the file existed. Its training-loop bytes are the 4-bit file's times 26 / 34 (the payload of a
    block of 64: 24 bytes of codes and a bf16 scale, against 32 and the scale), as the screens measured;
    on the 4-bit file's 250k-token rows that puts it at 100x or more fewer DP bytes in the loop than the
    bf16 all-reduce of a bf16 run (the 4-bit file: 87.8x)."""
    from ds_twocircuit.dp.quantmean import QuantConfig
    screened, rows, _ = _screened_on_both_domains("dp200_olr15_q3", "dense_dp200_olr15", "twocircuit.dp.quant.bits=3",
                                                  "dense_dp200_olr15_q3")
    assert QuantConfig(bits=3).payload_bytes(64) == 26 and QuantConfig(bits=4).payload_bytes(64) == 34
    for r in screened:   # the same syncs as the 4-bit screen on the same domain and seed, 26 / 34 the bytes
        four = [x for x in rows if x["label"] == "dp200_olr15" and (x["domain"], x["seed"]) == (r["domain"], r["seed"])]
        assert four and r["dp_bytes_per_token_training"] / four[-1]["dp_bytes_per_token_training"] == \
            pytest.approx(26 / 34, rel=1e-5)
    study = _benchmark_rows("fullstack")
    measured = [r for r in study if r["label"] == "dense_dp200_olr15"]
    assert {r["domain"] for r in measured} == {"sympy", "deepspeed-cpp"}
    for r in measured:
        allreduce = next(d for d in study if d["label"] == "dense" and (d["domain"], d["seed"]) == (r["domain"], r["seed"]))
        bf16 = allreduce["dp_bytes_per_token_training"] / 2   # a bf16 run's all-reduce
        assert bf16 / r["dp_bytes_per_token_training"] < 100 <= bf16 / (r["dp_bytes_per_token_training"] * 26 / 34)


def test_delayed_screen_config_is_the_dp_candidate_with_the_delayed_rule():
    """fullstack_screen.md reads dp200_olr15_delayed as dense_dp200_olr15.json with the 50/50 mix
    replaced by the delayed merge rule, nothing else: the screen-only file must be exactly that (and
    valid), and its row must have run that file."""
    root = os.path.dirname(CONFIGS)
    rel = "docs/benchmarks/fullstack_screen_configs/dp200_olr15_delayed.json"
    screen = json.load(open(os.path.join(root, rel)))
    base = json.load(open(os.path.join(CONFIGS, "dense_dp200_olr15.json")))
    dp = dict(base["twocircuit"]["dp"])
    assert dp.pop("merge_alpha") == 0.5 and "merge_rule" not in dp
    expected = {**base, "twocircuit": {**base["twocircuit"], "dp": {**dp, "merge_rule": "delayed"}}}
    assert screen == expected
    cfg = TwoCircuitConfig.from_dict(screen["twocircuit"]).dp
    assert (cfg.merge_rule, cfg.overlap_steps, cfg.outer_lr) == ("delayed", 4, 1.5)
    rows = [r for r in _benchmark_rows("fullstack_screen") if r["label"] == "dp200_olr15_delayed"]
    assert rows and {(r["config"], tuple(r["overrides"])) for r in rows} == {(rel, ())}
