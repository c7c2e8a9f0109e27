"""The DeepSpeed pipeline engine behind the Trainer: this process's stage of one replica.

A thin adapter over :class:`~ds_twocircuit.adapters.pipeline_engine.MaskedPipelineEngine` (DeepSpeed's
``PipelineEngine`` with coded boundaries) and the run's DP backend: it builds them from the plan and
answers the Trainer's questions (``ds_twocircuit.engines``) with DeepSpeed's own machinery.
"""
from __future__ import annotations

import copy

from ..engines import build_optimizer


class PipelineEngine:
    kind = "pipeline"

    def __init__(self, plan, role: str = "fast"):
        """This rank's pipeline stage, its optimizer, the MaskedPipelineEngine and its DP backend.

        ``role = "fast"``: the fast circuit (the config's optimizer, with the anchor correction
        attached when the anchor is on; the config's codec and DP backend). ``role = "anchor"``: a
        replica of the anchor circuit, built by the same code from the same plan (same stages,
        partition and LoRA adapters): dense boundaries, an engine that never steps its optimizer,
        and its gradients averaged over the Z anchor replicas."""
        import torch
        from deepspeed.runtime.config import DeepSpeedConfig
        from ..dp.registry import config_from_dict, get_backend
        from .comm import dp_comm
        from .pipe_module import build_pipeline, hf_named_parameters
        from .pipeline_engine import MaskedPipelineEngine

        if role not in ("fast", "anchor"):
            raise ValueError(f"role must be 'fast' or 'anchor', got {role!r}")
        self.plan, self.role = plan, role
        tc = plan.tc
        torch.manual_seed(plan.args.seed)
        module = build_pipeline(plan.spec, plan.pp, tc.partition, tc.tied_embeddings, lora=tc.lora,
                                seed=plan.args.seed)   # the same adapters (and names) in both circuits
        trainable = [p for p in module.parameters() if p.requires_grad]
        ds_cfg = copy.deepcopy(plan.ds_config)
        if role == "fast":
            optimizer = build_optimizer(plan, trainable)
            if tc.anchor.enabled:
                from .anchor_circuit import attach_correction
                attach_correction(optimizer, module, plan)  # hooks on the optimizer the engine steps
            engine_cls, replicas, tc_run, dp_cfg = MaskedPipelineEngine, plan.dp, tc, tc.dp
            mask_seed = tc.mask_seed if tc.mask_seed is not None else plan.args.seed
        else:
            from .anchor_circuit import AnchorPipelineEngine
            optimizer = torch.optim.SGD(trainable, lr=0.0)     # never stepped
            ds_cfg["train_batch_size"] = plan.mb * plan.gas * plan.z
            ds_cfg.pop("scheduler", None)
            ds_cfg["steps_per_print"] = None                    # the engine's step counter never moves
            engine_cls, replicas, tc_run = AnchorPipelineEngine, plan.z, tc.uncoded()
            dp_cfg, mask_seed = config_from_dict({"backend": "allreduce"}), 0
        mpu = module.mpu()
        ds = engine_cls(args=None, model=module, optimizer=optimizer, model_parameters=trainable, mpu=mpu,
                        config=ds_cfg, config_class=DeepSpeedConfig(copy.deepcopy(ds_cfg), mpu))
        named = hf_named_parameters(ds.module, plan.spec)   # Hugging Face names: as the reference engine's
        self.dp_backend = get_backend(dp_cfg.backend)(named, dp_comm(ds.grid.get_data_parallel_group(), replicas),
                                                      dp_cfg)
        ds.pipeline_enable_backward_allreduce = False  # the backend does the DP sync
        ds.setup_twocircuit(tc_run, mask_seed, self.dp_backend)
        self.ds = ds
        self.dp_rank = ds.dp_rank
        self._stream = None
        from ..data import StreamOrigin
        self.data_origin = StreamOrigin()   # moves when a checkpoint of another DP width is resumed

    # -------------------------------------------------------------- what the trainer reads
    @property
    def codec(self):
        return self.ds.codec_out

    @property
    def global_steps(self) -> int:
        return self.ds.global_steps

    @property
    def mask_seed(self) -> int:
        return self.ds.mask_seed

    @property
    def timing(self) -> dict:
        return self.ds.timing

    @property
    def step_stats(self) -> dict:
        return self.ds.step_stats

    @property
    def start_broadcast_bytes(self) -> int:
        return self.ds.start_broadcast_bytes

    def keep_fraction(self, step: int, hidden: int) -> float:
        return self.ds.keep_fraction(step, hidden)

    def lr(self) -> float:
        return self.ds.get_lr()[0]

    def parameter_counts(self) -> tuple[int, int]:
        if self.ds.grid.get_data_parallel_id() != 0:
            return 0, 0
        params = list(self.ds.module.parameters())
        return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)

    # -------------------------------------------------------------- training and evaluation
    def set_train_data(self, seqs, start_step: int) -> None:
        from ..data import MicroBatchStream
        p = self.plan
        self._stream = MicroBatchStream(seqs, p.mb, p.gas, p.dp, self.dp_rank, start_step=start_step,
                                        origin=self.data_origin)

    def train_batch(self) -> float:
        return float(self.ds.train_batch(self._stream))

    def eval_losses(self, seqs, calls: int, dense: bool, bar=None) -> list[float]:
        from ..data import MicroBatchStream
        p = self.plan
        it = MicroBatchStream(seqs, p.mb, p.gas, p.dp, self.dp_rank)
        out = []
        for _ in range(calls):
            out.append(float(self.ds.eval_batch(it, dense=dense)))
            if bar is not None:
                bar.update(1)
        return out

    def anchor_link(self, world):
        from .anchor_circuit import AnchorLink
        return AnchorLink(self.ds, self.plan, world, origin=self.data_origin)

    # -------------------------------------------------------------- state
    def save_checkpoint(self, ckpt_dir: str, fault=None) -> str:
        from .checkpoint import save_training_state
        return save_training_state(self.ds, ckpt_dir, fault, self.data_origin)

    def catch_up(self, ckpt_dir: str, step: int, world) -> None:
        """Fetch the files of checkpoint ``step`` this rank's disk lacks from the ranks that have
        them (a node without the shared output folder; counted as ``catch_up``)."""
        from .catchup import catch_up
        catch_up(self.ds, ckpt_dir, step, world)

    def load_checkpoint(self, path: str) -> int:
        from .checkpoint import load_training_state
        step, self.data_origin = load_training_state(self.ds, path)
        return step

    def finalize(self) -> bool:
        return self.dp_backend.finalize()

    def replicas_identical(self) -> bool | None:
        """Whether all DP replicas of every stage hold bitwise-identical weights (a digest per
        replica; no weights cross the wire)."""
        import torch
        import torch.distributed as dist
        from .dist import from_comm, group_agrees, to_comm, weights_digest
        if self.plan.dp == 1:
            return None
        same = group_agrees(weights_digest(self.ds.module.named_parameters()), self.ds.grid.get_data_parallel_group(),
                            self.plan.dp)
        flag = to_comm(torch.tensor([1.0 if same else 0.0]))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(from_comm(flag).item() == 1.0)

    def export_hf(self, folder: str, world) -> str | None:
        """Each stage's first replica writes its own shard of ``folder``: no weight crosses a link
        (``adapters/export.py``; what does cross is counted as ``export``)."""
        from .export import export_hf_folder
        return export_hf_folder(self.ds, self.plan, world, folder)
