"""Evaluation of adapted checkpoints: ``python -m eval`` (see :mod:`eval.cli`).

Modules: ``checkpoint`` (HF folders, run folders, DeepSpeed pipeline checkpoints), ``tasks``
(registry of the paper's evaluation table and offline stand-ins), ``generation`` (batched KV-cache
decoding), ``likelihood`` (multiple-choice and perplexity scoring), ``scoring`` (pure metrics),
``sandbox`` (confined execution of model-written code), ``pruning`` (magnitude pruning),
``masking`` (masked inference), ``report`` (table, JSON, plot), ``bench`` (generation benchmark).
"""
