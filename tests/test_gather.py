"""trainer.gather.gather_rows: the rows F.embedding gives, and the gradients its backward gives
(summed in another order: equal to float tolerance), with and without repeated rows."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainer.gather import gather_rows, row_sums


@pytest.mark.parametrize("n, u", [(0, 3), (1, 1), (50, 7), (20_000, 900)])
def test_gather_rows_equals_embedding_forward_and_backward(n, u):
    generator = torch.Generator().manual_seed(n)
    leaf = torch.randn(u, 9, generator=generator)
    inverse = torch.randint(0, u, (n,), generator=generator)
    upstream = torch.randn(n, 9, generator=generator)
    ours, theirs = leaf.clone().requires_grad_(True), leaf.clone().requires_grad_(True)
    rows = gather_rows(ours, inverse)
    assert torch.equal(rows, F.embedding(inverse, theirs))
    rows.backward(upstream)
    F.embedding(inverse, theirs).backward(upstream)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-5)


def test_row_sums_adds_every_position_into_its_row():
    inverse = torch.tensor([2, 0, 2, 2])
    grad = torch.tensor([[1.0], [10.0], [100.0], [1000.0]])
    assert row_sums(inverse, grad, 4).flatten().tolist() == [10.0, 0.0, 1101.0, 0.0]


def test_gather_rows_without_gradients_is_an_index():
    leaf = torch.arange(6.0).view(3, 2)
    assert torch.equal(gather_rows(leaf, torch.tensor([2, 2, 0])), leaf[np.array([2, 2, 0])])
