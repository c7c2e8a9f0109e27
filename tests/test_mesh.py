"""launch/mesh.py: ranks in their own network namespaces with kernel bandwidth caps; the kernel's
byte counters agree with the project's own accounting (plus TCP/IP framing)."""
import json
import os
import subprocess
import sys

import pytest

from launch_helpers import CONFIGS, ROOT, env, read_summary

pytestmark = pytest.mark.multiproc


def test_kernel_counts_what_the_project_counts(tmp_path):
    out = str(tmp_path / "run")
    cmd = [sys.executable, os.path.join(ROOT, "launch", "mesh.py"), "--ranks", "2", "--mbit", "100", "--",
           "launch/train.py", "--model", "tiny", "--deepspeed", os.path.join(CONFIGS, "dense.json"),
           "--steps", "4", "--seq-len", "256", "--eval-sequences", "0", "--no-save-model", "--output-dir", out]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    s = read_summary(out)
    mesh = json.load(open(os.path.join(out, "mesh.json")))
    ours_fwd = s["wire_bytes"]["pp_activations"] + s["wire_bytes"]["pp_handshake"] + s["wire_bytes"]["pp_codec_state"]
    ours_bwd = s["wire_bytes"]["pp_gradients"]
    assert ours_fwd > 2_000_000
    for link, ours in (("0->1", ours_fwd), ("1->0", ours_bwd)):
        kernel = mesh["kernel_bytes"][link]
        # payload + TCP/IP headers (~3-4%) + rendezvous and scalar collectives (tens of KB)
        assert ours <= kernel <= 1.08 * ours + 150_000, (link, kernel, ours)
    # nothing left behind
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "tcm" not in left


@pytest.mark.parametrize("cfg", ["dense.json", "m95_dp.json"])
def test_kernel_counts_the_dp_bytes_the_project_counts(tmp_path, cfg):
    """DP = 2 on two namespaces (no pipeline): the kernel's per-direction byte counter equals each
    rank's share of the project's DP bytes (counted at every collective from the tensor it is
    handed), plus DeepSpeed's start-up weight broadcast from replica 0 (reported apart as
    ``dp_init_broadcast_bytes``), plus TCP/IP framing and scalar collectives. Plain all-reduce and
    Streaming DiLoCo with PowerSGD (compressed, overlapped, fragment-staggered)."""
    out = str(tmp_path / "run")
    cmd = [sys.executable, os.path.join(ROOT, "launch", "mesh.py"), "--ranks", "2", "--mbit", "100", "--",
           "launch/train.py", "--model", "tiny", "--deepspeed", os.path.join(CONFIGS, cfg), "--pp", "1",
           "--dp", "2", "--steps", "12", "--seq-len", "256", "--eval-sequences", "0", "--no-save-model",
           "--output-dir", out]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    s = read_summary(out)
    mesh = json.load(open(os.path.join(out, "mesh.json")))
    wb = s["wire_bytes"]
    assert sum(v for k, v in wb.items() if k.startswith("pp_")) == 0 and wb["dp"] > 0
    per_rank = wb["dp"] // 2  # two replicas, each sends half of every ring all-reduce's total
    init = s["dp_init_broadcast_bytes"]
    assert init > 100_000
    for link, ours in (("0->1", per_rank + init), ("1->0", per_rank)):
        kernel = mesh["kernel_bytes"][link]
        assert ours <= kernel <= 1.08 * ours + 150_000, (link, kernel, ours, cfg)


def test_mesh_refuses_bad_arguments(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "mesh.py"), "--ranks", "2", "--link", "0-1",
                        "--", "launch/train.py"], cwd=ROOT, env=env(), capture_output=True, text=True)
    assert p.returncode != 0 and "expected I-J:MBIT" in p.stderr
