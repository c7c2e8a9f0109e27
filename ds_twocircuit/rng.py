"""Seeds derived from (run seed, tensor name, counter), the same on every rank and every machine
(``zlib.crc32``, not Python's salted ``hash``). Used for PowerSGD's initial Q and the randomized
SVD's test matrices, so that every replica draws the same random matrices without sending them."""
from __future__ import annotations

import zlib

import torch


def derived_seed(seed: int, name: str, counter: int) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode()) * 7919 + int(counter)) % (2 ** 62)


def derived_generator(seed: int, name: str, counter: int) -> torch.Generator:
    """A CPU generator seeded with :func:`derived_seed` (draw on the CPU, then move: the same
    numbers on every device)."""
    return torch.Generator(device="cpu").manual_seed(derived_seed(seed, name, counter))
