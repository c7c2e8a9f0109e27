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


def _package_modules(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    """Dotted name -> file of every module of the package in folder ``root``."""
    mods = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join([package, *parts])] = path
    return mods


def _imported(name: str, path: pathlib.Path, is_package: bool) -> set[str]:
    """Every module name ``path`` (module ``name``) imports, at module level or inside a function:
    ``import a.b``, ``from a import b`` (a and a.b), relative forms, ``import_module("a.b")``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = name if is_package else name.rpartition(".")[0]   # what a level-1 relative import means
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = here.split(".")[:len(here.split(".")) - (node.level - 1)]
                base = ".".join(pkg + ([node.module] if node.module else []))
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) \
                == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
            found.add(str(node.args[0].value))
    return found


def _import_cycle(root: pathlib.Path, package: str) -> list[str] | None:
    """One import cycle among the modules of ``package`` (first module repeated at the end), or
    None.  A module importing a parent package only implicitly (``import a.b`` runs ``a``) is not
    an edge: only what the source names is."""
    mods = _package_modules(root, package)
    edges = {m: sorted(n for n in _imported(m, p, p.name == "__init__.py") if n in mods and n != m)
             for m, p in mods.items()}
    state: dict[str, int] = {}   # 1: on the current path, 2: done

    def visit(m, path):
        state[m] = 1
        for n in edges[m]:
            if state.get(n) == 1:
                return path[path.index(n):] + [m, n] if n in path else [m, n]
            if n not in state:
                cycle = visit(n, path + [m])
                if cycle:
                    return cycle
        state[m] = 2
        return None

    for m in mods:
        if m not in state:
            cycle = visit(m, [])
            if cycle:
                return cycle
    return None


def test_dp_package_has_no_import_cycle():
    """ds_twocircuit.dp imports one way (config <- base <- backends <- registry): a module that
    imports another which imports it back, even inside a function, is a circle (the config and
    the registry once held one)."""
    root = ROOT / "dp"
    mods = _package_modules(root, "ds_twocircuit.dp")
    assert {"ds_twocircuit.dp.config", "ds_twocircuit.dp.registry", "ds_twocircuit.dp.base"} <= set(mods)
    cycle = _import_cycle(root, "ds_twocircuit.dp")
    assert cycle is None, "import cycle in ds_twocircuit.dp: " + " -> ".join(cycle)


def test_the_cycle_check_catches_each_form(tmp_path):
    cases = {  # (module a, module b): which forms close a circle
        "top-level": ("from pkg.b import x\n", "from pkg.a import y\n"),
        "in a function": ("def f():\n    from pkg.b import x\n", "import pkg.a\n"),
        "relative": ("from .b import x\n", "from . import a\n"),
        "import_module": ("import importlib\nimportlib.import_module('pkg.b')\n", "from .a import y\n"),
        "three modules": ("from .b import x\n", "from .c import y\n"),
        "one way only": ("from .b import x\n", "import os\n"),
    }
    got = {}
    for case, (a, b) in cases.items():
        root = tmp_path / case.replace(" ", "_") / "pkg"
        root.mkdir(parents=True)
        (root / "__init__.py").write_text("")
        (root / "a.py").write_text(a)
        (root / "b.py").write_text(b)
        (root / "c.py").write_text("from pkg import a\n" if case == "three modules" else "")
        got[case] = _import_cycle(root, "pkg")
    assert got["one way only"] is None
    assert got["three modules"] == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    for case in ("top-level", "in a function", "relative", "import_module"):
        assert got[case] == ["pkg.a", "pkg.b", "pkg.a"], (case, got[case])


def test_no_training_loop_in_launch():
    """The studies run the Trainer (launch/train.py --engine reference): no launch/ script builds or
    steps an optimizer of its own (issue: five training loops, one of which clipped differently)."""
    launch = ROOT.parent / "launch"
    bad = []
    for path in sorted(launch.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "optim" and isinstance(node.value, ast.Name) \
                    and node.value.id == "torch":
                bad.append(f"{path.name}:{node.lineno}: torch.optim")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.optim"):
                bad.append(f"{path.name}:{node.lineno}: from {node.module}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step" \
                    and "opt" in ast.unparse(node.func.value).lower():
                bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node.func)}()")
    assert len(list(launch.glob("*.py"))) > 5
    assert bad == [], "a training loop in launch/ (run the Trainer instead):\n" + "\n".join(bad)
