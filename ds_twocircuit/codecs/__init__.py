"""Boundary codecs as plugins (see :mod:`.base`): the registry, the interface, and the built-ins
``dense``, ``random`` (the paper's PRF mask), ``topk``, ``meanfill`` and ``lowrank``."""
from .base import (DENSE, WIRE_DTYPES, Codec, Message, available_codecs, build_codec, codec_config,  # noqa: F401
                   config_dict, get_codec, make_codec, register_codec, wire_dtype)
