"""Every multi-node launch line the README documents, run as written across emulated nodes
(network namespaces with kernel bandwidth caps, ``launch/mesh.py --per-node-launcher``): each
node runs its own launcher, the ranks meet over the links, and the kernel's byte counters agree
with the project's own. Needs root, like tests/test_mesh.py."""
import json
import os
import subprocess
import sys

import pytest

from ds_twocircuit.export import INDEX, missing_shards
from launch_helpers import CONFIGS, ROOT, env, read_summary

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

MESH = os.path.join(ROOT, "launch", "mesh.py")


def _mesh(nodes, launcher, train_args, out, procs_per_node=1, timeout=600):
    cmd = [sys.executable, MESH, "--ranks", str(nodes), "--procs-per-node", str(procs_per_node), "--mbit", "100",
           "--per-node-launcher", launcher, "--timeout", str(timeout - 60), "--",
           "launch/train.py", "--model", "tiny", *train_args, "--eval-sequences", "0", "--output-dir", out]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    mesh = json.load(open(os.path.join(out, "mesh.json")))
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert mesh["namespace_prefix"] not in left         # this run's namespaces are gone
    s = read_summary(out)
    # the model export (on): each stage writes its shard into the folder the nodes share here
    hf = os.path.join(out, "hf")
    assert s["wire_bytes"]["export"] == 0 and os.path.isfile(os.path.join(hf, INDEX)) and not missing_shards(hf)
    return s, mesh


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun", "torchrun-c10d"])
def test_each_documented_launch_line_across_two_nodes(tmp_path, launcher):
    """PP = 2, one stage per node: DeepSpeed's launcher per node (hostfile + --no_ssh +
    --node_rank), torchrun with a static master, torchrun with c10d rendezvous."""
    out = str(tmp_path / "run")
    s, mesh = _mesh(2, launcher, ["--deepspeed", os.path.join(CONFIGS, "dense.json"), "--steps", "4",
                                  "--seq-len", "256"], out)
    assert s["mesh"]["pp"] == 2 and s["mesh"]["dp"] == 1
    wb = s["wire_bytes"]
    fwd = wb["pp_activations"] + wb["pp_handshake"] + wb["pp_codec_state"]
    assert fwd > 2_000_000 and wb["pp_gradients"] > 2_000_000
    for link, ours in (("0->1", fwd), ("1->0", wb["pp_gradients"])):
        kernel = mesh["kernel_bytes"][link]
        # payload + TCP/IP headers (~3-4%) + rendezvous, store census and scalar collectives
        assert ours <= kernel <= 1.08 * ours + 150_000, (launcher, link, kernel, ours)


def test_pp2_x_dp2_over_four_nodes(tmp_path):
    out = str(tmp_path / "run")
    s, mesh = _mesh(4, "torchrun", ["--deepspeed", os.path.join(CONFIGS, "dense.json"), "--pp", "2", "--dp", "2",
                                    "--steps", "4", "--seq-len", "256"], out)
    assert s["mesh"]["pp"] == 2 and s["mesh"]["dp"] == 2 and s["dp_replicas_identical"] is True
    wb = s["wire_bytes"]
    ours = sum(wb.values()) + s["dp_init_broadcast_bytes"]
    assert wb["dp"] > 0 and wb["pp_activations"] > 0
    kernel = mesh["kernel_bytes_total"]
    assert ours <= kernel <= 1.08 * ours + 4 * 150_000, (kernel, ours)
    # global rank = stage x dp + replica: rank 0 -> 2 and 1 -> 3 carry the boundary, 0 <-> 1 and
    # 2 <-> 3 the data-parallel sync; 0 and 3 never talk
    k = mesh["kernel_bytes"]
    assert k["0->2"] > 1_000_000 and k["1->3"] > 1_000_000 and k["0->1"] > 1_000_000
    assert k["0->3"] < 200_000 and k["3->0"] < 200_000


def test_anchor_circuit_on_its_own_node(tmp_path):
    """m95_ap across two nodes of two processes each: the fast circuit's stages on node 0, the
    anchor replica's stages on node 1; the snapshot store is a folder both see."""
    cfg = json.load(open(os.path.join(CONFIGS, "m95_ap.json")))
    # the fast circuit waits for each scheduled anchor gradient (max_wait_s): the count below does
    # not depend on how fast the anchor node happens to be
    cfg["twocircuit"]["anchor"].update(every=2, max_wait_s=60.0)
    path = tmp_path / "ap.json"
    path.write_text(json.dumps(cfg))
    out = str(tmp_path / "run")
    s, mesh = _mesh(2, "deepspeed", ["--deepspeed", str(path), "--steps", "10", "--seq-len", "64"], out,
                    procs_per_node=2)
    assert s["mesh"] == {**s["mesh"], "pp": 2, "dp": 1, "anchor_replicas": 1}
    assert s["anchor"]["updates"] >= 2 and s["wire_bytes"]["anchor"] > 0
    # the pipeline boundary of the fast circuit stays on node 0 (loopback): the links between the
    # nodes carry only the launch's control traffic
    assert s["wire_bytes"]["pp_activations"] > 0
    assert mesh["kernel_bytes_total"] < 300_000, mesh["kernel_bytes"]
