"""ds-twocircuit: communication-efficient LLM adaptation over slow links, on DeepSpeed.

Fast circuit: masked pipeline boundaries (``masks``, ``codec``; on DeepSpeed:
``adapters.pipeline_engine.MaskedPipelineEngine``)
and compressed data-parallel sync (``dp``). Anchor circuit: unmasked gradients on stale snapshots
(``anchor``) feeding a spectral correction of the masked gradients.
"""
__version__ = "0.1.0"
