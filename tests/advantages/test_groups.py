"""uids_to_group_index: verl's uid arrays to dense group ids."""

import uuid

import numpy as np
import torch

import rlvr_kernels as rk


def test_uuid_strings_numbered_by_first_appearance():
    u = [str(uuid.uuid4()) for _ in range(5)]
    index = np.array([u[3], u[1], u[3], u[0], u[1], u[4]], dtype=object)
    ids, n = rk.uids_to_group_index(index, return_num_groups=True)
    assert ids.dtype == torch.int64 and ids.tolist() == [0, 1, 0, 2, 1, 3] and n == 4


def test_numeric_lists_tensors_and_mixed_types():
    assert rk.uids_to_group_index([7, 7, 3, 9, 3]).tolist() == [0, 0, 1, 2, 1]
    assert rk.uids_to_group_index(torch.tensor([5, 3, 5, 9, 3])).tolist() == [0, 1, 0, 2, 1]
    # 1 and "1" are different uids.
    assert rk.uids_to_group_index(np.array(["b", "a", "b", 1, "1"], dtype=object)).tolist() == [0, 1, 0, 2, 3]
    assert rk.uids_to_group_index(np.array([], dtype=object)).numel() == 0


def test_same_grouping_as_verl():
    from verl.utils.groupwise import as_torch_index

    gen = np.random.default_rng(0)
    u = np.array([str(uuid.uuid4()) for _ in range(50)], dtype=object)
    index = u[gen.integers(0, 50, 400)]
    ours = rk.uids_to_group_index(index)
    theirs = as_torch_index(index, device="cpu")
    # Same partition (the numbering may differ): ids map one-to-one.
    pairs = set(zip(ours.tolist(), theirs.tolist()))
    assert len(pairs) == len(set(ours.tolist())) == len(set(theirs.tolist()))
