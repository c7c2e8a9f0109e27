"""Masked inference: the model as the mesh serves it, with the training's boundary masks applied.

Settings come from the run's ``summary.json`` (``mesh.pp``, the stage boundaries ``mesh.parts``,
and ``config.twocircuit``: mode, mask rate, partition, rescale, wire dtype; the mask seed
``config.mask_seed``), each overridable by a flag (``--pp``, ``--mask-rate``, ``--mask-seed``,
``--mask-partition``). The masks are the
ones :class:`ds_twocircuit.reference.BoundaryMasker` computes; keys use the engine's evaluation
step space (``EVAL_STEP_OFFSET + steps``, at the mask rate of the run's last step, as the engine's
coded evaluation) and a
micro-batch counter that advances with every forward call, so each decoded token gets a fresh
mask and a run is reproducible.
"""
from __future__ import annotations

from ds_twocircuit.masks import EVAL_STEP_OFFSET  # the engine's evaluation step space


class MaskingError(ValueError):
    pass


def mask_settings(summary: dict | None, pp: int | None = None, mask_rate: float | None = None,
                  mask_seed: int | None = None, partition: str | None = None) -> dict:
    tc = dict((summary or {}).get("config", {}).get("twocircuit") or {})
    cfg = (summary or {}).get("config", {})
    s = {
        "pp": pp if pp is not None else (summary or {}).get("mesh", {}).get("pp"),
        "mode": tc.get("mode", "random"),
        "mask_rate": mask_rate if mask_rate is not None else tc.get("mask_rate"),
        "seed": mask_seed if mask_seed is not None else next(
            (v for v in (cfg.get("mask_seed"), tc.get("mask_seed"), cfg.get("seed")) if v is not None), None),
        "partition": partition or tc.get("partition"),
        "rescale": bool(tc.get("rescale", False)),
        "wire_dtype": tc.get("wire_dtype", "auto"),
        "codec": tc.get("codec"),  # meanfill / lowrank: groups and refresh (state fitted on the first batch)
        "parts": None,
        "step": EVAL_STEP_OFFSET + int((summary or {}).get("steps", 0) or 0),
        "source": "summary.json" if summary else "flags",
    }
    mesh = (summary or {}).get("mesh", {})
    if mesh.get("parts") and partition is None and (pp is None or pp == mesh.get("pp")):
        s["parts"] = list(mesh["parts"])  # the exact stage boundaries the run used
    if mask_rate is not None and s["mode"] == "dense":
        s["mode"] = "random"
    from ds_twocircuit.codecs import available_codecs, get_codec
    if s["mode"] not in available_codecs():
        raise MaskingError(f"--masked: the run's twocircuit.mode {s['mode']!r} is not a registered codec "
                           f"({', '.join(available_codecs())})")
    if not get_codec(s["mode"]).uses_mask and s["mask_rate"] is None:
        s["mask_rate"] = 0.0
    missing = [k for k in ("pp", "mask_rate", "seed") if s[k] is None]
    if missing:
        flags = {"pp": "--pp", "mask_rate": "--mask-rate", "seed": "--mask-seed"}
        raise MaskingError("--masked: no run summary.json gives " + ", ".join(missing) + "; pass "
                           + " ".join(flags[m] for m in missing))
    if not 0.0 <= float(s["mask_rate"]) < 1.0:
        raise MaskingError(f"--mask-rate {s['mask_rate']} is outside [0, 1)")
    if int(s["pp"]) < 2:
        raise MaskingError(f"--masked with pp={s['pp']}: a single pipeline stage has no boundary to mask")
    return s


class MaskedInference:
    """Attach the boundary masks to ``model`` (forward hooks); ``remove()`` detaches them."""

    def __init__(self, model, settings: dict):
        from ds_twocircuit.codecs import build_codec
        from ds_twocircuit.config import ConfigError
        from ds_twocircuit.reference import BoundaryMasker
        self.settings = settings
        kw = {"parts": settings["parts"]} if settings.get("parts") else {}
        if settings.get("partition") and not kw:
            kw["partition"] = settings["partition"]
        try:
            probe = build_codec(settings["mode"], settings["wire_dtype"], settings.get("codec") or None)  # errors now
            if probe.needs_reference:
                raise ValueError("the run's codec codes the drift from the base model (twocircuit.codec.reference "
                                 "= \"base\"); the eval CLI cannot serve it coded yet (it would need the base "
                                 "model beside the checkpoint): score it dense, or through the codec with "
                                 "launch/bench_quality.py")

            def factory():
                return build_codec(settings["mode"], settings["wire_dtype"], settings.get("codec") or None,
                                   mask_rate=float(settings["mask_rate"]), rescale=settings["rescale"])
            self.masker = BoundaryMasker(model, int(settings["pp"]), factory, seed=int(settings["seed"]), **kw)
            self.masker.count = False   # inference on one machine: no link
        except (ConfigError, KeyError, ValueError) as e:
            raise MaskingError(f"--masked: {e}") from None
        settings["parts"] = list(self.masker.parts)
        self.calls = 0
        base = getattr(model, model.base_model_prefix, None) or model.base_model
        self._pre = base.register_forward_pre_hook(self._next_message)

    def _next_message(self, module, args):
        self.masker.set_message(self.settings["step"], self.calls)
        self.calls += 1

    def reset(self) -> None:
        """Restart the micro-batch counter (each task then sees the same masks on every run)."""
        self.calls = 0

    def remove(self) -> None:
        self._pre.remove()
        self.masker.remove()
