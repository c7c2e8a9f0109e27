"""Every tensor of ours handed to a collective lives on the backend's device (NCCL rejects CPU
tensors) and has an NCCL dtype. On this CPU machine the check is made to fail for real: the comm
device is pretended to be ``meta``, so a tensor that did not go through ``to_comm`` arrives on the
CPU and the fake collective rejects it."""
import types

import pytest
import torch
import torch.distributed as dist

NCCL_DTYPES = (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
               torch.float32, torch.float64)


@pytest.fixture
def pretend_accelerator(monkeypatch):
    import ds_twocircuit.adapters.anchor_circuit as circuit
    import ds_twocircuit.adapters.dist as tcdist
    registry, calls = {}, []

    def to_comm(t):
        m = t.to("meta")
        registry[id(m)] = t.clone()
        return m

    def from_comm(m):
        assert m.device.type == "meta", "read back a tensor that never went to the comm device"
        return registry[id(m)].clone()

    def collective(t, *a, **k):
        assert t.device.type == "meta", f"a {t.device} tensor was handed to a collective"
        assert id(t) in registry and t.dtype in NCCL_DTYPES
        calls.append((tuple(t.shape), t.dtype))
        return types.SimpleNamespace(wait=lambda: None) if k.get("async_op") else None

    for mod in (tcdist, circuit):
        monkeypatch.setattr(mod, "to_comm", to_comm)
        monkeypatch.setattr(mod, "from_comm", from_comm)
    monkeypatch.setattr(dist, "all_reduce", collective)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(slice(None), [obj] * len(out)))
    return calls


def test_summary_reductions_use_the_comm_device(pretend_accelerator):
    from ds_twocircuit import wire
    from ds_twocircuit.adapters.dist import World
    from ds_twocircuit.adapters.engine import PipelineEngine
    world = World("fast", 0, 2, 0, 2, 0, "nccl")
    wire.count("pp_activations", 123)
    totals = world.sum({**wire.totals(), "dp_final_sync": 7})
    assert totals["dp_final_sync"] == 7 and totals["pp_activations"] >= 123
    assert world.sum({"a": 1.5, "b": 2.0}) == {"a": 1.5, "b": 2.0}
    assert world.max(3.0) == 3.0
    engine = PipelineEngine.__new__(PipelineEngine)
    engine.ds = types.SimpleNamespace(module=torch.nn.Linear(2, 2),
                                      grid=types.SimpleNamespace(get_data_parallel_group=lambda: None))
    engine.plan = types.SimpleNamespace(dp=2)
    assert engine.replicas_identical() is True
    assert len(pretend_accelerator) == 4


def test_anchor_link_finish_uses_the_comm_device(pretend_accelerator):
    from ds_twocircuit.adapters.anchor_circuit import AnchorLink
    link = types.SimpleNamespace(world=types.SimpleNamespace(rank=1), updates=3, staleness=[20, 21, 22],
                                 wait_s=0.5, publish_s=1.0, refresh_s=0.25, every=20,
                                 store=types.SimpleNamespace(root="/x"), received_bytes=10, _vote=None)
    out = AnchorLink.finish(link)
    assert out["updates"] == 3 and out["wait_s"] == 0.5 and out["refresh_s"] == 0.25
    assert len(pretend_accelerator) == 2


def test_anchor_fence_vote_uses_the_comm_device(pretend_accelerator):
    """DP > 1: the asynchronous vote of the anchor fence goes to the comm device as int32, and its
    result read back one period later picks the gradients every replica held."""
    from ds_twocircuit.adapters.anchor_circuit import AnchorLink
    from ds_twocircuit.anchor.fence import AnchorFence
    grads = {"w": torch.ones(2, 2)}
    got = types.SimpleNamespace(source_step=0, grads=grads)
    link = types.SimpleNamespace(fence=AnchorFence(4), _vote=None, opt=types.SimpleNamespace(last_anchor_source_step=None),
                                 plan=types.SimpleNamespace(dp=2), dp_group=None,
                                 _read_store=lambda after, latest: got if after is None else None)
    assert AnchorLink._fence_step(link, 3, None) == (None, None)  # not a fence step: nothing at all
    assert AnchorLink._fence_step(link, 4, None) == (None, None)  # loads and votes
    assert pretend_accelerator == [((8,), torch.int32)]
    src, g = AnchorLink._fence_step(link, 8, None)                  # the vote's result: use step 0
    assert src == 0 and g is grads and len(pretend_accelerator) == 2


def test_comm_device_is_the_accelerator_under_nccl(monkeypatch):
    import deepspeed.accelerator as acc
    from ds_twocircuit.adapters.dist import comm_device
    assert comm_device() == torch.device("cpu")  # no process group / gloo
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(acc, "get_accelerator", lambda: types.SimpleNamespace(current_device_name=lambda: "cuda:3"))
    assert comm_device() == torch.device("cuda:3")


def test_catch_up_moves_checkpoint_files_on_the_comm_device(monkeypatch, tmp_path):
    """A checkpoint file fetched at --resume auto (adapters/catchup.py) travels as int64 length +
    uint8 chunks, every tensor on the comm device (meta here), and arrives byte for byte; the
    sender counts 8 + its size as catch_up."""
    import ds_twocircuit.adapters.catchup as cu
    import ds_twocircuit.adapters.dist as tcdist
    from ds_twocircuit import wire
    registry, pipe, seen = {}, [], []

    def to_comm(t):
        m = t.to("meta")
        registry[id(m)] = t.clone()
        return m

    def send(t, dst):
        assert t.device.type == "meta" and id(t) in registry and t.dtype in NCCL_DTYPES
        seen.append(t.dtype)
        pipe.append(registry[id(t)].clone())

    def recv(t, src):
        assert t.device.type == "meta" and id(t) in registry and t.dtype in NCCL_DTYPES
        registry[id(t)].copy_(pipe.pop(0))

    monkeypatch.setattr(tcdist, "to_comm", to_comm)
    monkeypatch.setattr(tcdist, "from_comm", lambda m: registry[id(m)].clone())
    monkeypatch.setattr(dist, "send", send)
    monkeypatch.setattr(dist, "recv", recv)
    monkeypatch.setattr(cu, "CHUNK", 4)
    src, dst = tmp_path / "a" / "layer_03-model_states.pt", tmp_path / "b" / "layer_03-model_states.pt"
    src.parent.mkdir()
    src.write_bytes(bytes(range(10)))
    wire.reset()
    assert cu._send_file(str(src), 10, 1) == 18
    assert seen == [torch.int64, torch.uint8, torch.uint8, torch.uint8]     # 4 + 4 + 2 bytes
    cu._recv_file(str(dst), 10, 0)
    assert dst.read_bytes() == bytes(range(10)) and pipe == []
    assert wire.totals()["catch_up"] == 18
