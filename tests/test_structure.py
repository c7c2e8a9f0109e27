"""The shape README's layout section describes: algorithms never touch DeepSpeed or
torch.distributed; only ``ds_twocircuit/adapters/`` (and the driver ``train.py``) do."""
from __future__ import annotations

import ast
import pathlib

import ds_twocircuit

ROOT = pathlib.Path(ds_twocircuit.__file__).parent
DRIVER_AND_ADAPTERS = ("adapters", "train.py")
FORBIDDEN = ("deepspeed", "torch.distributed")


def _forbidden_uses(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "torch" and node.attr == "distributed":
            names = ["torch.distributed"]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) \
                == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
            names = [str(node.args[0].value)]
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                  if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)]
    return found


def _algorithm_modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] not in DRIVER_AND_ADAPTERS:
            yield path


def test_algorithms_never_import_deepspeed_or_torch_distributed():
    mods = list(_algorithm_modules())
    assert len(mods) > 15 and any(p.name == "spectral.py" for p in mods)
    bad = [hit for p in mods for hit in _forbidden_uses(p)]
    assert bad == [], "algorithm modules must stay free of DeepSpeed/torch.distributed " \
                      "(put the code in ds_twocircuit/adapters/):\n" + "\n".join(bad)


def test_the_check_catches_each_form(tmp_path):
    forms = {"a.py": "import deepspeed\n", "b.py": "from torch.distributed import all_reduce\n",
             "c.py": "def f():\n    import torch.distributed as dist\n",
             "d.py": "import torch\nx = torch.distributed.get_rank\n",
             "e.py": "import importlib\nimportlib.import_module('deepspeed.comm')\n",
             "f.py": "from torch import distributed\n", "ok.py": "import torch\nimport deepspeedish\n"}
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        for name, src in forms.items():
            (tmp_path / name).write_text(src)
        hits = {n: bool(_forbidden_uses(tmp_path / n)) for n in forms}
    finally:
        ROOT = old
    assert hits == {"a.py": True, "b.py": True, "c.py": True, "d.py": True, "e.py": True,
                    "f.py": True, "ok.py": False}


def test_adapters_are_where_the_readme_says():
    adapters = {p.name for p in (ROOT / "adapters").glob("*.py")}
    assert {"pipeline_engine.py", "plain_engine.py", "anchor_circuit.py", "comm.py", "dist.py",
            "checkpoint.py", "pipe_module.py"} <= adapters
    readme = (ROOT.parent / "README.md").read_text()
    for name in sorted(adapters - {"__init__.py"}):
        assert f"adapters/{name}" in readme, f"README's layout section does not name adapters/{name}"


def _resolve(owner: str):
    import importlib
    try:
        return importlib.import_module(owner)           # a module
    except ImportError:
        mod, _, cls = owner.rpartition(".")             # a class in a module
        return getattr(importlib.import_module(mod), cls)


def _has(obj, name: str) -> bool:
    import inspect
    if hasattr(obj, name):
        return True
    if inspect.isclass(obj):  # an instance attribute: assigned in the class's own source
        return any(f"self.{name}" in inspect.getsource(k) for k in obj.__mro__ if k.__module__.startswith("deepspeed"))
    return False


def test_private_deepspeed_names_are_those_checked():
    """All private DeepSpeed names the adapters override or use are listed in
    adapters/deepspeed_private.py; on another DeepSpeed version this fails until they are re-read."""
    import inspect

    import deepspeed

    from ds_twocircuit.adapters import deepspeed_private as priv
    assert deepspeed.__version__ == priv.CHECKED_VERSION, (
        f"DeepSpeed {deepspeed.__version__} is installed; the overrides in "
        f"ds_twocircuit/adapters/deepspeed_private.py were checked against {priv.CHECKED_VERSION}")
    for (owner, name), (params, _) in priv.OVERRIDDEN.items():
        obj = _resolve(owner)
        assert hasattr(obj, name), f"{owner}.{name} is gone"
        if params is not None:
            assert list(inspect.signature(getattr(obj, name)).parameters) == params, (owner, name)
    for owner, name in priv.USED:
        assert _has(_resolve(owner), name), f"{owner}.{name} is gone"


def test_every_private_override_in_the_adapters_is_listed():
    from ds_twocircuit.adapters import deepspeed_private as priv
    from ds_twocircuit.adapters.anchor_circuit import AnchorPipelineEngine
    from ds_twocircuit.adapters.pipe_module import TwoCircuitPipe
    from ds_twocircuit.adapters.pipeline_engine import MaskedPipelineEngine
    listed = {name for (_, name) in priv.OVERRIDDEN}
    for cls in (MaskedPipelineEngine, AnchorPipelineEngine, TwoCircuitPipe):
        theirs = [k for k in cls.__mro__ if k.__module__.startswith("deepspeed")]
        own = {n for n in vars(cls) if n.startswith("_") and not n.startswith("__")
               and any(hasattr(k, n) for k in theirs)}  # a private DeepSpeed name redefined
        assert own <= listed, f"{cls.__name__} overrides {sorted(own - listed)}: list them in deepspeed_private.py"
    src = (ROOT / "adapters" / "plain_engine.py").read_text()
    assert "engine._take_model_step = " in src and "_take_model_step" in listed
