"""Resuming on another data-parallel width (nodes come and go): per-replica state is merged, not
refused, the training stream continues at the first unseen sequence, and the pipeline engine and the
reference engine merge alike. Tiny preset."""
import json
import os

import pytest
import torch

from launch_helpers import CONFIGS, read_metrics, read_summary, read_weights, torchrun, torchrun_nodes

SEQ, MB, GAS = 16, 2, 2
BACKENDS = {
    "allreduce": {"backend": "allreduce"},
    "powersgd": {"backend": "powersgd", "powersgd": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 0}},
    "diloco": {"backend": "diloco", "inner_steps": 2},
    "streaming_diloco": {"backend": "streaming_diloco", "inner_steps": 4, "num_fragments": 2,
                         "compression": "powersgd",
                         "powersgd": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 0}},
}


def _config(tmp_path, backend, name="lowrank", optimizer="AdamW"):
    cfg = json.load(open(os.path.join(CONFIGS, f"{name}.json")))
    cfg["twocircuit"]["dp"] = BACKENDS[backend]
    if cfg["twocircuit"]["mode"] == "lowrank":
        cfg["twocircuit"]["codec"] = {"groups": [[8, 4]], "refresh_steps": [0, 3]}
    cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = MB, GAS
    if optimizer == "SGD":
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.05}}
        cfg["gradient_clipping"] = 0.0
    path = tmp_path / f"{backend}_{name}_{optimizer}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _args(config, out, steps, dp, extra=()):
    return ["--model", "tiny", "--deepspeed", config, "--steps", str(steps), "--seq-len", str(SEQ), "--pp", "2",
            "--dp", str(dp), "--eval-sequences", "0", "--output-dir", out, *extra]


def _reference(config, out, steps, dp, extra=()):
    from ds_twocircuit import train
    assert train.run(["--engine", "reference", *_args(config, out, steps, dp, extra)]) == 0
    return read_summary(out)


def test_the_stream_continues_without_repeating_or_skipping():
    from ds_twocircuit.data import MicroBatchStream, StreamOrigin

    class Seqs:   # records which sequences are read
        def batch(self, start, count):
            return torch.arange(start, start + count)
    seen = []
    for dp, steps, origin in ((2, range(0, 3), StreamOrigin()), (1, range(3, 5), StreamOrigin(3, 3 * 2 * GAS)),
                              (3, range(5, 7), StreamOrigin(5, 3 * 2 * GAS + 2 * 1 * GAS))):
        for r in range(dp):
            s = MicroBatchStream(Seqs(), MB, GAS, dp, r, start_step=steps[0], origin=origin)
            for _ in range(len(steps) * GAS):
                seen += next(s)[0].tolist()
    assert sorted(seen) == list(range(len(seen))) and len(seen) == (3 * 2 + 2 * 1 + 2 * 3) * GAS * MB
    with pytest.raises(ValueError, match="before the stream's origin"):
        MicroBatchStream(Seqs(), MB, GAS, 1, 0, start_step=2, origin=StreamOrigin(3, 12))


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_reference_resume_on_another_width_merges_the_replicas(tmp_path, backend):
    """2 -> 1 -> 2 replicas on the reference engine: the shrunk run starts from the replicas' mean
    (weights and optimizer moments; the backend's and the codec's state by their own rules) and the
    first sequence no replica has seen; the grown run's replicas start identical and end identical."""
    from ds_twocircuit import train
    from ds_twocircuit.engines.reference import ReferenceEngine
    config = _config(tmp_path, backend)
    out = str(tmp_path / "run")
    _reference(config, out, 3, 2, ["--save-checkpoint"])    # DiLoCo: replicas drift after step 2's sync
    saved = torch.load(os.path.join(out, "checkpoint", "global_step3", "twocircuit", "reference.pt"),
                       weights_only=False)
    # the engine on one replica, loaded from the 2-replica checkpoint
    args = train.parse_args(["--engine", "reference", *_args(config, out, 5, 1, ["--resume", "auto"])])
    engine = ReferenceEngine(train.make_plan(args, 1))
    assert engine.load_checkpoint(os.path.join(out, "checkpoint")) == 3
    a, b = saved["replicas"]

    def avg(x, y):   # by hand: the replicas' mean, in float64, back to the tensor's dtype
        return ((x.double() + y.double()) / 2).to(x.dtype)
    got = engine.replicas[0].model.state_dict()
    assert all(torch.equal(got[k], avg(a["model"][k], b["model"][k])) for k in got)
    if backend in ("diloco", "streaming_diloco"):   # replicas drift between syncs: the mean is new
        assert any(not torch.equal(a["model"][k], b["model"][k]) for k in got)
    opt = engine.replicas[0].optimizer.state_dict()["state"]
    for i, st in opt.items():
        assert torch.equal(st["exp_avg_sq"], avg(a["optimizer"]["state"][i]["exp_avg_sq"],
                                                 b["optimizer"]["state"][i]["exp_avg_sq"]))
    dp = engine.replicas[0].backend.state_dict()
    comp = dp.get("compressor")
    if comp is not None:   # error feedback still owed by the replicas' mean: averaged, never reset
        errs_a, errs_b = a["dp_backend"]["compressor"]["error"], b["dp_backend"]["compressor"]["error"]
        assert set(comp["error"]) == set(errs_a)
        assert all(torch.equal(comp["error"][k], avg(errs_a[k], errs_b[k])) for k in comp["error"])
    if backend == "powersgd":   # compressed from step 0: every step left a residual
        assert comp["error"] and any(float(v.abs().max()) > 0 for v in comp["error"].values())
    if backend in ("diloco", "streaming_diloco"):
        assert dp["pending"] == [] and all(torch.equal(x, y) for x, y in zip(dp["backup"], a["dp_backend"]["backup"]))
    assert engine.data_origin.step == 3 and engine.data_origin.micro_batches == 3 * 2 * GAS
    # the run goes on: 2 more steps on 1 replica, then 2 more on 2 replicas
    s1 = _reference(config, out, 5, 1, ["--resume", "auto", "--save-checkpoint"])
    assert s1["first_step"] == 3 and s1["mesh"]["dp"] == 1
    s2 = _reference(config, out, 7, 2, ["--resume", "auto"])
    assert s2["first_step"] == 5 and s2["dp_replicas_identical"] is True
    losses = [m["loss"] for m in read_metrics(out)]
    assert [m["step"] for m in read_metrics(out)] == list(range(7)) and all(l < 7 for l in losses)


def test_inner_lr_scale_follows_the_width_on_resume(tmp_path):
    """``inner_lr_scale: "sqrt_replicas"`` on the reference engine: lr x sqrt(2) on 2 replicas; the
    checkpoint's optimizer state (which carries that lr) resumed on 1 replica trains at the base lr,
    and back on 2 at sqrt(2) again, as fresh runs at those widths would."""
    import math
    cfg = json.load(open(_config(tmp_path, "streaming_diloco")))
    cfg["twocircuit"]["dp"]["inner_lr_scale"] = "sqrt_replicas"
    base = cfg["optimizer"]["params"]["lr"]
    config = tmp_path / "sqrt.json"
    config.write_text(json.dumps(cfg))
    out = str(tmp_path / "run")
    _reference(str(config), out, 2, 2, ["--save-checkpoint"])
    _reference(str(config), out, 4, 1, ["--resume", "auto", "--save-checkpoint"])
    _reference(str(config), out, 5, 2, ["--resume", "auto"])
    lrs = [m["lr"] for m in read_metrics(out)]
    want = [base * math.sqrt(2)] * 2 + [base] * 2 + [base * math.sqrt(2)]
    assert lrs == pytest.approx(want, rel=1e-12)


def test_the_dp_candidates_sync_resumes_on_another_width(tmp_path):
    """The DP candidate's sync (ds_configs/dense_dp200_sqrtlr_q3_delayed.json: 3-bit pseudo-gradients
    with error feedback, the delayed merge rule, the sqrt(N) inner lr), shortened (H 4, 2 fragments,
    a 2-step window), saved on 2 replicas after 6 steps: fragment 0's round has finished (its
    residuals are non-zero and differ per replica) and fragment 1's is in flight, with each
    replica's delayed-rule deltas. Resumed on 1 replica: the residuals are the replicas' mean (still
    owed), the in-flight sync is dropped (the averaged weights hold its progress and the next sync
    sends it again), the lr is the base lr; back on 2 replicas the run ends with identical replicas."""
    import math
    from ds_twocircuit import train
    from ds_twocircuit.engines.reference import ReferenceEngine
    cfg = json.load(open(os.path.join(CONFIGS, "dense_dp200_sqrtlr_q3_delayed.json")))
    cfg["twocircuit"]["dp"].update(inner_steps=4, num_fragments=2, overlap_steps=2)
    cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = MB, GAS
    config = str(tmp_path / "candidate.json")
    open(config, "w").write(json.dumps(cfg))
    out = str(tmp_path / "run")
    _reference(config, out, 6, 2, ["--save-checkpoint"])
    saved = torch.load(os.path.join(out, "checkpoint", "global_step6", "twocircuit", "reference.pt"),
                       weights_only=False)
    a, b = (r["dp_backend"] for r in saved["replicas"])
    assert [p["fragment"] for p in a["pending"]] == [1] and a["pending"][0]["local"] is not None
    assert any(float(e.abs().max()) > 0 for e in a["quant_errors"])
    assert any(not torch.equal(x, y) for x, y in zip(a["quant_errors"], b["quant_errors"]))
    args = train.parse_args(["--engine", "reference", *_args(config, out, 8, 1, ["--resume", "auto"])])
    engine = ReferenceEngine(train.make_plan(args, 1))
    assert engine.load_checkpoint(os.path.join(out, "checkpoint")) == 6
    dp = engine.replicas[0].backend.state_dict()
    assert dp["pending"] == [] and dp["dirty"] == [True, True]
    assert all(torch.equal(e, torch.stack([x, y]).mean(0)) for e, x, y in zip(dp["quant_errors"], a["quant_errors"],
                                                                                b["quant_errors"]))
    _reference(config, out, 8, 1, ["--resume", "auto", "--save-checkpoint"])
    s = _reference(config, out, 10, 2, ["--resume", "auto"])
    assert s["first_step"] == 8 and s["dp_replicas_identical"] is True
    base = cfg["optimizer"]["params"]["lr"]
    assert [m["lr"] for m in read_metrics(out)] == pytest.approx(
        [base * math.sqrt(2)] * 6 + [base] * 2 + [base * math.sqrt(2)] * 2, rel=1e-12)


def _same(a, b) -> bool:
    """Nested dicts / lists of tensors and plain values, equal exactly."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_reference_resume_on_another_width_keeps_the_anchor_state(tmp_path):
    """With the anchor on (M95 + spectral correction, an anchor gradient every 2 steps): 2 -> 1
    replicas. The replicas hold the same anchor state (the same anchor gradients reach both), so
    the merge keeps it exactly, and the run goes on taking anchor updates on the new width."""
    from ds_twocircuit import train
    from ds_twocircuit.engines.reference import ReferenceEngine
    config = _config(tmp_path, "streaming_diloco", name="m95_ap")
    cfg = json.load(open(config))
    cfg["twocircuit"]["anchor"]["every"] = 2
    open(config, "w").write(json.dumps(cfg))
    out = str(tmp_path / "run")
    s0 = _reference(config, out, 6, 2, ["--save-checkpoint"])
    assert s0["anchor"]["updates"] >= 1
    saved = torch.load(os.path.join(out, "checkpoint", "global_step6", "twocircuit", "reference.pt"), weights_only=False)
    a, b = (r["optimizer"]["spectral"] for r in saved["replicas"])
    assert a["anchor_updates"] >= 1 and a["matrices"] and _same(a, b)
    args = train.parse_args(["--engine", "reference", *_args(config, out, 8, 1, ["--resume", "auto"])])
    engine = ReferenceEngine(train.make_plan(args, 1))
    assert engine.load_checkpoint(os.path.join(out, "checkpoint")) == 6
    assert _same(engine.replicas[0].optimizer.state_dict()["spectral"], a)
    s1 = _reference(config, out, 8, 1, ["--resume", "auto"])
    assert s1["first_step"] == 6 and s1["mesh"]["dp"] == 1 and s1["anchor"]["updates"] >= 1


@pytest.mark.parametrize("backend", ["powersgd", "streaming_diloco"])
def test_error_feedback_on_resize_averages_or_resets(backend):
    """``powersgd.error_feedback_on_resize``: the merged residual is the old replicas' mean
    (default) or zero; everything else the merge keeps is the same either way."""
    from ds_twocircuit.dp.registry import get_backend
    cls = get_backend(backend)
    errs = [{"w": torch.full((3, 2), float(v))} for v in (1.0, 3.0)]
    states = [{"backend": backend, "names": ["w"], "compressor": {"error": e, "q": {"w": torch.ones(2, 1)}, "rounds": 4},
               "fragments": [["w"]], "pending": [], "dirty": [False], "backup": [torch.zeros(3, 2)],
               "momentum": None} for e in errs]
    cfg = {**BACKENDS[backend]}
    averaged = cls.merge_replica_states(states, cls.config_class.coerce(cfg, backend=backend))
    cfg["powersgd"] = {**cfg["powersgd"], "error_feedback_on_resize": "reset"}
    reset = cls.merge_replica_states(states, cls.config_class.coerce(cfg, backend=backend))
    assert torch.equal(averaged["compressor"]["error"]["w"], torch.full((3, 2), 2.0))
    assert torch.equal(reset["compressor"]["error"]["w"], torch.zeros(3, 2))
    assert reset["compressor"]["q"] is states[0]["compressor"]["q"] and reset["compressor"]["rounds"] == 4
    # the rule touches the error buffers only: everything else of the merge is the same
    assert averaged.keys() == reset.keys()
    assert all(averaged[k] == reset[k] for k in averaged if k != "compressor")
    assert averaged["compressor"]["q"] is reset["compressor"]["q"]


@pytest.mark.multiproc
def test_pipeline_and_reference_merge_alike(tmp_path):
    """Streaming DiLoCo with PowerSGD (the most per-replica state) on pp 2: dp 2 -> 1 -> 2 through
    DeepSpeed equals the same chain on the reference engine (SGD: a tight tolerance on any CPU),
    with ``inner_lr_scale: "sqrt_replicas"``: both engines' lr follows the width at each resume.
    The last width change runs as two nodes without a shared folder: node 1 (both ranks of stage 1)
    starts with an empty output folder and fetches the files its stage loads from node 0 at
    --resume auto, each once, counted as ``catch_up``."""
    import glob
    from ds_twocircuit.export import merge
    config = _config(tmp_path, "streaming_diloco", name="m95", optimizer="SGD")
    cfg = json.load(open(config))       # and the inner lr follows the width (sqrt(2) on 2 replicas)
    cfg["twocircuit"]["dp"]["inner_lr_scale"] = "sqrt_replicas"
    open(config, "w").write(json.dumps(cfg))
    pipe, ref, node1 = str(tmp_path / "pipe"), str(tmp_path / "ref"), str(tmp_path / "node1")
    for steps, dp in ((3, 2), (5, 1), (7, 2)):
        extra = ["--save-checkpoint"] + (["--resume", "auto"] if steps > 3 else [])
        if steps < 7:
            torchrun(2 * dp, _args(config, pipe, steps, dp, extra))
        else:
            # ranks 0, 1: stage 0 of both replicas (node 0); ranks 2, 3: stage 1 (node 1, no files)
            torchrun_nodes(2, [_args(config, pipe, steps, dp, extra), _args(config, node1, steps, dp, extra)])
        _reference(config, ref, steps, dp, extra)
    a, b = [m["loss"] for m in read_metrics(pipe)], [m["loss"] for m in read_metrics(ref)]
    assert len(a) == 7 and a == pytest.approx(b, rel=1e-5)
    lr = cfg["optimizer"]["params"]["lr"]
    for out in (pipe, ref):   # both engines: sqrt(2) x lr on 2 replicas, lr on 1, rescaled at each resume
        assert [m["lr"] for m in read_metrics(out)] == pytest.approx([lr * 2 ** 0.5] * 3 + [lr] * 2 + [lr * 2 ** 0.5] * 2)
    # what node 1 fetched: stage 1's layer files, DeepSpeed's engine state files (its loader reads
    # stage 0's and counts them all), the one old replica's state file (merged into both new
    # replicas) and the marker, byte for byte as node 0 has them
    tag0, tag1 = os.path.join(pipe, "checkpoint", "global_step5"), os.path.join(node1, "checkpoint", "global_step5")
    fetched = sorted(os.path.relpath(f, tag1) for f in glob.glob(os.path.join(tag1, "**", "*"), recursive=True)
                     if os.path.isfile(f))
    layers = sorted(os.path.basename(f) for f in glob.glob(os.path.join(tag0, "layer_*")))
    fetched_layers = [f for f in fetched if f.startswith("layer_")]
    assert set(fetched) - set(fetched_layers) == {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
                                                  "twocircuit/COMPLETE.json", "twocircuit/stage01_dp0000.pt"}
    assert 0 < len(fetched_layers) < len(layers) and fetched_layers == layers[-len(fetched_layers):]   # stage 1's
    for f in fetched:
        assert open(os.path.join(tag0, f), "rb").read() == open(os.path.join(tag1, f), "rb").read(), f
    for folder in (pipe, node1):                        # the disks' names are gone again
        assert not [f for f in os.listdir(os.path.join(folder, "checkpoint")) if f.startswith(".disk")]
    files = sum(8 + os.path.getsize(os.path.join(tag1, f)) for f in fetched)
    counted = read_summary(pipe)["wire_bytes"]["catch_up"]
    assert files < counted < files + 4 * 4096           # the files, plus four ranks' inventories
    # the export: each stage's shard on its own node; merged, the reference engine's weights
    merged = str(tmp_path / "merged")
    merge([os.path.join(pipe, "hf"), os.path.join(node1, "hf")], merged)
    w, r = read_weights(merged), read_weights(os.path.join(ref, "hf"))
    assert max(float((w[k] - r[k]).abs().max()) for k in w) < 1e-5
    assert read_summary(pipe)["dp_replicas_identical"] is True


def test_bench_resize_compares_the_merge_rules_on_the_same_tokens(tmp_path):
    """launch/bench_resize.py on the tiny preset with PowerSGD from step 0 (every step leaves a
    residual): the two resized runs start from the uninterrupted run's checkpoint, train the same
    tokens, and differ only by the error-feedback rule."""
    import subprocess
    import sys
    from launch_helpers import ROOT
    cfg = json.load(open(os.path.join(CONFIGS, "dense_dp.json")))
    cfg["twocircuit"]["dp"] = BACKENDS["powersgd"]
    path = tmp_path / "powersgd.json"
    path.write_text(json.dumps(cfg))
    p = subprocess.run([sys.executable, "launch/bench_resize.py", "--config", str(path), "--model", "tiny",
                        "--before", "2", "--after", "2", "--eval-sequences", "16", "--work-dir", str(tmp_path / "w"),
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.load(open(tmp_path / "resize.json"))
    by = {e["run"]: e for e in res["entries"]}
    assert [by[r]["dp"] for r in ("uninterrupted", "average", "reset")] == [2, 1, 1]
    assert by["uninterrupted"]["last_step"] == 3 and by["average"]["first_step"] == by["reset"]["first_step"] == 2
    # the same training tokens: 2 steps on 2 replicas, then 2 on one == 3 steps on 2 replicas
    tokens_per_replica_step = by["average"]["launch_tokens"] // 2
    assert by["uninterrupted"]["launch_tokens"] == 2 * tokens_per_replica_step * 3
    # the merged model is the same either way; the residual each rule keeps is not
    assert by["average"]["heldout_loss_at_change"] == by["reset"]["heldout_loss_at_change"]
    assert res["reset_minus_average"] != 0.0
    assert "| `reset` | 1 | 2..4 |" in open(tmp_path / "resize.md").read()


def _mesh_module():
    import importlib.util
    from launch_helpers import ROOT
    spec = importlib.util.spec_from_file_location("mesh", os.path.join(ROOT, "launch", "mesh.py"))
    mesh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mesh)
    return mesh


def _agent(mesh, net, node, port, out, steps, save_interval, log):
    """Node ``node`` of the emulated mesh ``net`` (its own network namespace, capped links): a
    torchrun agent with elastic membership (1 to 4 nodes, c10d rendezvous hosted by node 0) running
    one process, one pipeline stage."""
    import subprocess
    from launch_helpers import ROOT, TRAIN, env
    cmd = mesh.elastic_node_command(
        1, 4, f"{mesh.SUBNET}.1:{port}", [TRAIN, "--model", "tiny", "--deepspeed", os.path.join(CONFIGS, "dense_dp.json"),
                                         "--pp", "2", "--steps", str(steps), "--seq-len", "16", "--eval-sequences", "0",
                                         "--save-interval", str(save_interval), "--resume", "auto", "--output-dir", out,
                                         "--no-save-model"],
        host=node == 0, last_call_timeout_s=2, max_restarts=5, local_addr=f"{mesh.SUBNET}.{node + 1}")
    return subprocess.Popen(["ip", "netns", "exec", net.ns(node), *cmd], cwd=ROOT,
                            env=env({**mesh.ELASTIC_ENV, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}),
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.multiproc
@pytest.mark.slow
def test_torchrun_elastic_regroups_on_the_nodes_left_and_takes_a_new_one_in(tmp_path):
    """Four nodes of one stage each under ``torchrun --nnodes 1:4``, each in its own network
    namespace of the emulated mesh (launch/mesh.py: 200 Mbit/s links): PP 2 x DP 2. One node is
    killed outright (agent and worker): its replica has lost a stage, so the three nodes left
    regroup by themselves as one whole pipeline from the newest committed checkpoint, and the rank
    left over sits out. A new node joins: PP 2 x DP 2 again, to the end. Nothing is repeated or
    skipped in the record, the loss goes on from where it was, at most one checkpoint interval is
    redone, and the replicas end identical."""
    import re
    import time
    import psutil
    mesh = _mesh_module()
    net = mesh.Mesh(5, 200.0, {})
    out, port, steps, every = str(tmp_path / "run"), 29500, 240, 5
    logs = {n: str(tmp_path / f"{n}.log") for n in "abcde"}

    def done():
        try:
            return [json.loads(l)["step"] for l in open(os.path.join(out, "metrics.jsonl"))]
        except (OSError, ValueError):
            return []

    def text():
        return "".join(open(f).read() for f in logs.values() if os.path.exists(f))

    def wait_for(cond, what, limit=240):
        t0 = time.time()
        while not cond():
            assert time.time() - t0 < limit, f"timed out waiting for {what}: " + text()[-4000:]
            time.sleep(0.5)

    agent = {n: (lambda k=k, n=n: _agent(mesh, net, k, port, out, steps, every, logs[n])) for k, n in enumerate("abcde")}
    agents = {}
    net.up()
    try:
        agents["a"] = agent["a"]()
        time.sleep(1)
        agents.update({n: agent[n]() for n in "bcd"})
        wait_for(lambda: len(done()) >= 30, "30 steps on four nodes")
        victim = psutil.Process(agents["d"].pid)
        for p in [victim, *victim.children(recursive=True)]:   # the node is gone: agent and worker
            p.kill()
        killed_at = done()[-1]
        wait_for(lambda: "sits out" in text() and done() and done()[-1] > killed_at + 20,
                 "the nodes left to go on as one pipeline")
        agents["e"] = agent["e"]()
        for n in "abce":
            assert agents[n].wait(timeout=300) == 0, text()[-4000:]
        links = net.link_bytes()
    finally:
        for p in agents.values():
            if p.poll() is None:
                os.killpg(p.pid, 9)
        net.down()
    assert links["0->1"] > 0 and links["4->0"] > 0        # the nodes talked over the mesh's links
    log = text()
    widths = [t.count("ProcessCoord(pipe=0") for t in re.findall(r"Using topology: (\{.*\})", log)]
    assert widths == [2, 1, 2], widths                        # two replicas, then one, then two again
    assert log.count("[ds_twocircuit] rank 2 sits out: 3 ranks make 1 whole pipeline(s) of --pp 2") == 1
    # the line at the loss names the lost rank and the way on without its node
    lost = [l for l in log.splitlines() if l.startswith("[ds_twocircuit] rank ") and "stopped or cannot be reached" in l]
    # the node may die while a step runs or while a checkpoint is written: both lines name where
    assert lost and re.search(r"stopped (at step|while writing the checkpoint of step) \d+: "
                              r"rank \d \(stage \d, replica \d\) stopped or cannot be reached", lost[0]), lost[0]
    assert "resume the 1 replica(s) left with --dp 1" in lost[0]
    resumed = sorted(int(s) for s in re.findall(r"--resume auto: continuing from \S+global_step(\d+)", log))
    assert len(resumed) == 2 and resumed[0] < resumed[1]
    redo = [int(n) for n in re.findall(r"(\d+) step\(s\) to redo", log)]
    assert redo and max(redo) <= every                       # at most one checkpoint interval lost
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == list(range(steps))   # every step once
    loss = [r["loss"] for r in rows]
    for r in resumed:                                         # the curve goes on where it was
        before, after = sum(loss[r - 5:r]) / 5, sum(loss[r:r + 5]) / 5
        assert after < before + 0.3, (r, before, after)
    assert sum(loss[-10:]) / 10 < sum(loss[:10]) / 10 - 0.5
    s = read_summary(out)
    assert s["mesh"]["dp"] == 2 and s["first_step"] == resumed[1] and s["dp_replicas_identical"] is True


def test_a_fixed_mesh_refuses_ranks_that_fill_no_whole_pipeline(monkeypatch):
    """Outside torchrun (DeepSpeed's launcher, a fixed mesh) 3 ranks for --pp 2 stay an error; under
    torchrun (a regroup) the rank left over sits out (the test above)."""
    from ds_twocircuit import train
    dense = ["--model", "tiny", "--deepspeed", os.path.join(CONFIGS, "dense.json"), "--pp", "2"]
    args = train.parse_args(dense)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(train.ConfigError, match="must be a positive multiple of --pp"):
        train.make_plan(args, 3)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    plan = train.make_plan(args, 3)
    assert (plan.pp, plan.dp, plan.spare_ranks) == (2, 1, 1)
    with pytest.raises(train.ConfigError, match="positive multiple of --pp"):   # an explicit --dp: no spares
        train.make_plan(train.parse_args([*dense, "--dp", "2"]), 3)
