"""Model presets written from inside a process group (Accelerate, the Trainer, torchrun scripts)."""
import os

import pytest
import torch

from dist_helpers import run_distributed

pytestmark = pytest.mark.multiproc


def _materialize_on(rank, world, folder):
    import torch.distributed as dist
    from ds_twocircuit.models.presets import materialize_tiny
    out = None
    if rank == 1:              # not rank 0: transformers alone would write only the tokenizer here
        out = sorted(os.listdir(materialize_tiny(folder)))
    dist.barrier()
    return out


def test_a_preset_written_by_a_non_zero_rank_is_whole(tmp_path):
    files = run_distributed(_materialize_on, 2, tmp_path / "dist", str(tmp_path / "tiny"))[1]
    assert {"config.json", "model.safetensors", "tokenizer.json", ".complete"} <= set(files)
    from transformers import AutoModelForCausalLM
    from ds_twocircuit.models.presets import materialize_tiny
    here = AutoModelForCausalLM.from_pretrained(str(tmp_path / "tiny")).state_dict()
    ref = AutoModelForCausalLM.from_pretrained(materialize_tiny(str(tmp_path / "tiny_single"))).state_dict()
    assert here.keys() == ref.keys() and all(torch.equal(here[k], ref[k]) for k in ref)
