import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Project-local caches: the converted model, the tiny preset and DeepSpeed's JIT extensions are
# built once per checkout and never shared with unrelated processes.
os.environ.setdefault("DS_TWOCIRCUIT_CACHE", os.path.join(ROOT, ".cache", "ds_twocircuit"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".cache", "torch_extensions"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
