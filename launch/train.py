#!/usr/bin/env python
"""Launch: deepspeed --num_gpus N launch/train.py --deepspeed ds_configs/m95.json [--pp P] [...]

Also works under torchrun, or as plain `python launch/train.py` (one process, pp=1).
See `python launch/train.py --help` and the README.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ds_twocircuit.train import main  # noqa: E402

if __name__ == "__main__":
    main()
