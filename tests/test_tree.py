import pytest
import torch

from hasten.core.tree import TokenTree


def test_chain_is_a_tree_with_one_branch():
    chain = TokenTree.chain(3)
    assert chain.parents == (-1, 0, 1) and chain.is_chain
    assert chain.leaf_paths == [[0, 1, 2]]
    assert torch.equal(chain.block_mask, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert chain.block_positions.tolist() == [0, 1, 2, 3]


def test_from_paths_builds_parents_depths_and_mask():
    tree = TokenTree.from_paths([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    assert tree.parents == (-1, -1, 0, 0, 2)
    assert tree.depths == (1, 1, 2, 2, 3)
    assert not tree.is_chain
    assert sorted(tree.leaf_paths) == [[0, 2, 4], [0, 3], [1]]
    mask = tree.block_mask
    assert mask[5].tolist() == [True, True, False, True, False, True]  # node 4 sees root, 0, 2, itself
    assert mask[2].tolist() == [True, False, True, False, False, False]  # node 1 sees only root and itself


def test_bad_trees_are_rejected():
    with pytest.raises(ValueError, match="parent"):
        TokenTree((0,))
    with pytest.raises(ValueError, match="no parent path"):
        TokenTree.from_paths([(0, 0)])
