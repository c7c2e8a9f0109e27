"""Checkpoints carry the accelerator's RNG state (CUDA generator of the rank's device), not only
the CPU one; on CPU nothing extra is stored."""
import torch

from ds_twocircuit.adapters import checkpoint


class _FakeCuda:
    def __init__(self):
        self.state = torch.tensor([1, 2, 3], dtype=torch.uint8)

    def device_name(self):
        return "cuda"

    def get_rng_state(self):
        return self.state.clone()

    def set_rng_state(self, s):
        self.state = s.clone()


def test_accelerator_rng_state_saved_and_restored(monkeypatch):
    import deepspeed.accelerator as acc_mod
    fake = _FakeCuda()
    monkeypatch.setattr(acc_mod, "get_accelerator", lambda: fake)
    saved = checkpoint._accelerator_rng_state()
    assert torch.equal(saved, torch.tensor([1, 2, 3], dtype=torch.uint8))
    fake.state = torch.tensor([9, 9, 9], dtype=torch.uint8)  # the generator moved on
    checkpoint._set_accelerator_rng_state(saved)
    assert torch.equal(fake.state, saved)


def test_cpu_accelerator_stores_nothing_extra():
    assert checkpoint._accelerator_rng_state() is None
