"""Catching up on a checkpoint without a shared folder (ds_twocircuit.catchup): who sends which
file to whom. Pure planning; the transfer through DeepSpeed is in
tests/test_elastic.py::test_pipeline_and_reference_merge_alike (its last width change runs as two
nodes without a shared folder)."""
from ds_twocircuit.catchup import MARKER_LAST, Inventory, Transfer, needed_files, plan

STATES = ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]   # DeepSpeed's, one per stage
LAYERS0 = ["layer_00-model_states.pt", "layer_01-model_states.pt"]
LAYERS1 = ["layer_02-model_states.pt", "layer_03-model_states.pt"]
STAGE0, STAGE1 = LAYERS0 + STATES, LAYERS1 + STATES                      # what a stage's rank loads


def _files(names, size=100):
    return {n: size + i for i, n in enumerate(names)}


def test_needed_files_are_the_stages_own_and_the_replica_state_to_load_or_merge():
    same = needed_files(1, 1, 2, 2, STAGE1)
    assert same == [*STAGE1, "twocircuit/stage01_dp0001.pt", MARKER_LAST]        # its own state
    wider = needed_files(0, 1, 1, 2, STAGE0)
    assert wider == [*STAGE0, "twocircuit/stage00_dp0000.pt", MARKER_LAST]       # the one old replica's
    narrower = needed_files(0, 0, 3, 1, STAGE0)
    assert narrower[-4:-1] == [f"twocircuit/stage00_dp{d:04d}.pt" for d in range(3)]   # all, merged


def test_a_shared_folder_sends_nothing():
    everything = _files([*LAYERS0, *LAYERS1, *STATES, "twocircuit/stage00_dp0000.pt", "twocircuit/stage01_dp0000.pt",
                         MARKER_LAST])
    invs = [Inventory(r, r % 2, "nfs", dict(everything), needed_files(r % 2, r // 2, 1, 2, STAGE1 if r % 2 else STAGE0))
            for r in range(4)]
    assert plan(invs) == ([], {})


def test_a_new_node_gets_each_file_once_from_its_own_stage_first_and_the_marker_last():
    """PP 2 x DP 2 from a DP-1 checkpoint: node A (ranks 0, 1: stage 0 and 1 of replica 0) holds the
    checkpoint; node B (ranks 2, 3: both stages of replica 1) has an empty folder; a third node C
    (rank 4, stage 1) holds stage 1's files too."""
    a = _files([*LAYERS0, *LAYERS1, *STATES, "twocircuit/stage00_dp0000.pt", "twocircuit/stage01_dp0000.pt",
                MARKER_LAST])
    c = {n: a[n] for n in [*STAGE1, "twocircuit/stage01_dp0000.pt"]}
    invs = [Inventory(0, 0, "A", dict(a), needed_files(0, 0, 1, 2, STAGE0)),
            Inventory(1, 1, "A", dict(a), needed_files(1, 0, 1, 2, STAGE1)),
            Inventory(2, 0, "B", {}, needed_files(0, 1, 1, 2, STAGE0)),
            Inventory(3, 1, "B", {}, needed_files(1, 1, 1, 2, STAGE1)),
            Inventory(4, 1, "C", dict(c), needed_files(1, 0, 1, 1, STAGE1))]
    transfers, missing = plan(invs)
    assert missing == {}
    # node C needs the marker only, from rank 1 (stage 1, like C's rank); node B everything of both
    # stages, once, received by rank 2
    assert [t for t in transfers if t.dst == 4] == [Transfer(1, 4, MARKER_LAST, a[MARKER_LAST])]
    to_b = [t for t in transfers if t.dst == 2]
    assert sorted(t.name for t in to_b) == sorted([*LAYERS0, *LAYERS1, *STATES, "twocircuit/stage00_dp0000.pt",
                                                   "twocircuit/stage01_dp0000.pt", MARKER_LAST])
    assert to_b[-1].name == MARKER_LAST and all(t.size == a[t.name] for t in to_b)
    assert not any(t.dst == 3 for t in transfers)          # shares rank 2's disk
    # senders: the lowest rank of a stage B runs (both) that has the file
    assert {t.src for t in to_b} == {0}


def test_the_sender_is_a_rank_of_the_receivers_stage_where_one_has_the_file():
    shared = _files(LAYERS1)
    invs = [Inventory(0, 0, "A", dict(shared), []),                # stage 0 has it (lower rank)
            Inventory(3, 1, "C", dict(shared), []),                # stage 1 has it: preferred
            Inventory(5, 1, "B", {}, list(LAYERS1))]
    transfers, _ = plan(invs)
    assert {t.src for t in transfers} == {3} and {t.dst for t in transfers} == {5}


def test_a_file_no_rank_has_is_named_with_the_rank_that_needs_it():
    """Same width, but replica 1's own state was only on the disk that is gone."""
    a = _files([*STAGE0, "twocircuit/stage00_dp0000.pt", MARKER_LAST])
    invs = [Inventory(0, 0, "A", dict(a), needed_files(0, 0, 2, 2, STAGE0)),
            Inventory(1, 0, "B", {}, needed_files(0, 1, 2, 2, STAGE0))]
    transfers, missing = plan(invs)
    assert missing == {1: ["twocircuit/stage00_dp0001.pt"]}
    assert {t.name for t in transfers} == {*STAGE0, MARKER_LAST}
