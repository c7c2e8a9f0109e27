"""DeepSpeed and ``torch.distributed`` adapters: the only library modules (with the driver
``ds_twocircuit/train.py``) that import either. Everything else in ``ds_twocircuit`` is a pure
algorithm on tensors and files (``tests/test_structure.py`` enforces it).

- ``pipeline_engine``: ``MaskedPipelineEngine`` (a DeepSpeed ``PipelineEngine``): every boundary
  byte is sent in ``MaskedPipelineEngine._send`` through the configured codec.
- ``pipe_module``: the model as a DeepSpeed ``PipelineModule`` (stages, tied embeddings).
- ``comm``: ``TorchComm``, the DP backends' communicator: every DP byte leaves in
  ``TorchComm.all_reduce_sum``.
- ``plain_engine``: a DP backend in place of a plain ``DeepSpeedEngine``'s all-reduce.
- ``accelerate``: the same for Accelerate / the Hugging Face Trainer.
- ``anchor_circuit``: the anchor circuit's engine and the fast circuit's link to it.
- ``export``: the end-of-run model export across the ranks (each stage writes its own shard).
- ``checkpoint``: training state around DeepSpeed's checkpoints (commit markers).
- ``dist``: process groups for the two circuits, comm device, the launcher's store.
"""
