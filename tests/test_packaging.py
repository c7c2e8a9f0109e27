"""A non-editable install finds the shipped configs: ``ds-twocircuit-train`` run from any folder
resolves its default and ``--deepspeed lowrank.json`` / ``ds_configs/m95.json`` without the source
tree. (Builds the wheel and installs it in a throwaway venv: slow.)"""
import os
import subprocess
import sys

import pytest

from launch_helpers import ROOT


def test_config_names_resolve_in_the_source_tree(tmp_path, monkeypatch):
    from ds_twocircuit.config import ConfigError, resolve_config
    monkeypatch.chdir(tmp_path)
    for name in ("lowrank.json", "ds_configs/lowrank.json", "lowrank"):
        assert resolve_config(name) == os.path.join(ROOT, "ds_configs", "lowrank.json")
    with pytest.raises(ConfigError, match=r"'nope.json' does not exist; shipped configs: .*lowrank\.json"):
        resolve_config("nope.json")
    mine = tmp_path / "lowrank.json"
    mine.write_text("{}")
    assert resolve_config("lowrank.json") == "lowrank.json"  # a file of the user's wins


@pytest.mark.slow
def test_wheel_install_ships_the_configs(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), ROOT], check=True, timeout=600)
    whl = next(p for p in os.listdir(wheels) if p.endswith(".whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", str(wheels / whl)], check=True, timeout=600)
    code = ("import os; from ds_twocircuit.config import resolve_config; from ds_twocircuit import config; "
            "p = resolve_config('ds_configs/lowrank.json'); assert os.path.isfile(p), p; "
            "assert 'site-packages' not in p and p.endswith('share/ds-twocircuit/ds_configs/lowrank.json'), p; "
            "assert os.path.isfile(resolve_config('m95')); print(p)")
    out = subprocess.run([py, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert str(venv) in out.stdout
