"""DP backends on a plain DeepSpeedEngine (no pipeline): what Accelerate / the Trainer use."""
import pytest
import torch

from dist_helpers import run_distributed

pytestmark = pytest.mark.multiproc


def _worker(rank, world, dp_cfg, steps):
    import os
    os.environ.setdefault("LOCAL_RANK", str(rank))
    from ds_twocircuit.adapters.dist import prepare_runtime
    prepare_runtime()
    import deepspeed
    from transformers import AutoModelForCausalLM
    from ds_twocircuit.adapters.plain_engine import attach_dp_backend
    from ds_twocircuit.models.presets import resolve_model

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "steps_per_print": 10 ** 9}
    if dp_cfg is not None:
        cfg["twocircuit"] = {"dp": dp_cfg}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    backend = attach_dp_backend(engine) if dp_cfg is not None else None
    g = torch.Generator().manual_seed(100 + rank)  # each replica its own data
    synced_params = []
    for s in range(steps):
        for _ in range(2):
            x = torch.randint(0, 256, (2, 16), generator=g)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
        synced_params.append(torch.cat([p.detach().flatten() for p in engine.module.parameters()]).clone())
    if backend is not None:
        backend.finalize()
    final = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    return {"final": final, "per_step": synced_params,
            "dp_bytes": __import__("ds_twocircuit.wire", fromlist=["x"]).totals()["dp"]}


def test_allreduce_backend_equals_stock_deepspeed(tmp_path):
    stock = run_distributed(_worker, 2, tmp_path / "a", None, 3, timeout=300)
    ours = run_distributed(_worker, 2, tmp_path / "b", {"backend": "allreduce"}, 3, timeout=300)
    for r in range(2):
        assert torch.equal(stock[r]["final"], ours[r]["final"])
    assert torch.equal(ours[0]["final"], ours[1]["final"])
    n = ours[0]["final"].numel()
    assert ours[0]["dp_bytes"] == 3 * n * 4       # ring with 2 ranks: the whole gradient once per step


def test_diloco_on_plain_engine_syncs_every_h(tmp_path):
    res = run_distributed(_worker, 2, tmp_path, {"backend": "diloco", "inner_steps": 2}, 4, timeout=300)
    a, b = res
    assert not torch.equal(a["per_step"][0], b["per_step"][0])   # drift between syncs
    assert torch.equal(a["per_step"][1], b["per_step"][1])       # synced after step 1 (H - 1)
    assert torch.equal(a["per_step"][3], b["per_step"][3])
    assert torch.equal(a["final"], b["final"])


def test_zero1_refused(tmp_path):
    from ds_twocircuit.config import ConfigError

    class FakeEngine:
        config = {"twocircuit": {"dp": {"backend": "powersgd"}}}

        def zero_optimization_stage(self):
            return 1
    from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: F401 (import cost only)
    from ds_twocircuit.adapters.plain_engine import attach_dp_backend
    with pytest.raises(ConfigError, match="zero_optimization.stage = 0"):
        attach_dp_backend(FakeEngine())


def test_fp16_with_diloco_refused():
    """DeepSpeed's fp16 optimizer would overwrite every outer update from its fp32 masters."""
    from ds_twocircuit.config import ConfigError
    from ds_twocircuit.adapters.plain_engine import attach_dp_backend

    class FakeEngine:
        config = {"twocircuit": {"dp": {"backend": "streaming_diloco", "inner_steps": 4, "num_fragments": 2}}}
        optimizer = None

        def zero_optimization_stage(self):
            return 0

        def fp16_enabled(self):
            return True
    with pytest.raises(ConfigError, match=r"fp16\.enabled.*fp32 master weights"):
        attach_dp_backend(FakeEngine())
    FakeEngine.config = {"twocircuit": {"dp": {"backend": "powersgd"}}}  # fine with fp16: no weight rewrite
    with pytest.raises(AttributeError):  # gets past the fp16 check (the fake has no more engine)
        attach_dp_backend(FakeEngine())


def test_inner_lr_scale_refused_where_the_optimizer_is_the_users():
    """Under Accelerate / the Trainer the optimizer and its schedule are built by the user before
    the backend is attached: ``inner_lr_scale`` is refused there, saying what lr to set instead."""
    from ds_twocircuit.config import ConfigError
    from ds_twocircuit.adapters.plain_engine import attach_dp_backend

    class FakeEngine:
        config = {"twocircuit": {"dp": {"backend": "streaming_diloco", "inner_steps": 4, "num_fragments": 2,
                                        "inner_lr_scale": "sqrt_replicas"}}}
        optimizer, dp_world_size = None, 4

        def zero_optimization_stage(self):
            return 0

        def fp16_enabled(self):
            return False
    with pytest.raises(ConfigError, match=r"inner_lr_scale = 'sqrt_replicas' .*multiply your learning rate by 2 "
                                          r"\(on 4 replicas\)"):
        attach_dp_backend(FakeEngine())
    FakeEngine.config["twocircuit"]["dp"]["inner_lr_scale"] = 1.0     # the default: gets past the check
    with pytest.raises(AttributeError, match="managed_gradient_accumulation"):
        attach_dp_backend(FakeEngine())


@pytest.mark.parametrize("section, named", [
    ({"anchor": {"replicas": 1}, "dp": {"backend": "powersgd"}}, "twocircuit.anchor only apply"),
    ({"mode": "masked", "mask_rate": 0.95, "lora": {"r": 8}}, "twocircuit.{lora, mask_rate, mode} only apply"),
])
def test_pipeline_only_keys_refused_on_a_plain_engine(section, named):
    """An anchor (or masked boundaries, or LoRA) in the config an Accelerate/Trainer run reads is
    refused, naming the keys and where they do apply, instead of training without them."""
    from ds_twocircuit.config import ConfigError
    from ds_twocircuit.adapters.plain_engine import attach_dp_backend

    class FakeEngine:
        config = {"twocircuit": section}
    with pytest.raises(ConfigError) as e:
        attach_dp_backend(FakeEngine())
    assert named in str(e.value) and "launch/train.py" in str(e.value) and "twocircuit.dp" in str(e.value)


def test_dp_metrics_keys_are_the_csv_columns():
    """Every metric the totals report has a column in the Trainer callback's CSV (none dropped)."""
    from ds_twocircuit.adapters.accelerate import CSV_COLUMNS
    from ds_twocircuit.adapters.plain_engine import DPTotals

    class Backend:
        def replicas_in_sync(self):
            return True
    t = DPTotals(dense_bytes_per_step=100, world_size=2)
    t.add({"bytes_sent": 10, "collectives": 1, "comm_s": 0.5}, Backend())
    m = t.metrics()
    assert set(m) == set(DPTotals.KEYS) <= set(CSV_COLUMNS)
    assert m["dp/compression_ratio"] == 10.0 and m["dp/bytes_sent"] == 10 and m["dp/allreduce_bytes"] == 100


_SHM_SCRIPT = """
import os, sys
import ds_twocircuit.adapters.accelerate  # noqa: F401  (what a user imports before Accelerator())
import deepspeed
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
print("SHM_OP", sys.modules["deepspeed.comm.comm"].cdb.shm_comm_op)
print("BUILT", sorted(os.listdir(os.environ["TORCH_EXTENSIONS_DIR"])) if os.path.isdir(os.environ["TORCH_EXTENSIONS_DIR"]) else [])
"""


def test_importing_the_accelerate_adapter_skips_the_shm_op_build(tmp_path):
    """Under Accelerate, DeepSpeed's process group starts in the user's code, not ours: importing
    the adapter is what keeps a fresh CPU machine from JIT-building DeepSpeed's shared-memory op
    (about a minute on 2 cores) in ``init_distributed``."""
    import os
    import subprocess
    import sys
    from launch_helpers import ROOT, free_port
    ext = tmp_path / "ext"
    env = dict(os.environ, PYTHONPATH=ROOT, TORCH_EXTENSIONS_DIR=str(ext), DS_ACCELERATOR="cpu", RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    p = subprocess.run([sys.executable, "-c", _SHM_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "SHM_OP None" in p.stdout and "BUILT []" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    assert "deepspeed_shm_comm" not in p.stdout + p.stderr
