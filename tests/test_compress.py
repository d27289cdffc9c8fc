"""trainer/compress.py: PowerSGD's dense exchange. Two real replicas (gloo) end with the same
averaged gradients; a gradient the rank holds whole comes through exactly; what a compression
leaves out is kept and sent later (error feedback); factors sent in bfloat16 cost half the bytes
and lose nothing the error feedback does not keep."""

import numpy as np
import torch
from torch import nn

from trainer.compress import PowerSgd
from trainer.group import launch_local


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 1))  # a (10, 12) matrix, small parts


def _replica_grads(rank_r: int, wire: str = "float32") -> list[np.ndarray]:
    import torch.distributed as dist

    me = dist.get_rank()
    net = _net()
    compressor = PowerSgd(net, torch.optim.Adam(net.parameters()), rank_r, seed=0, wire=getattr(torch, wire))
    u, v = torch.arange(10.0) + me, torch.ones(12) * (me + 1)
    net[0].weight.grad = torch.outer(u, v)  # rank 1 on each replica: their mean has rank <= 2
    net[0].bias.grad = torch.full((10,), float(me))
    net[2].weight.grad = torch.full((1, 10), 2.0 * me)
    sent = compressor.all_reduce()
    assert sent > 0
    grads = [p.grad.numpy().copy() for p in net.parameters()]
    return grads + [compressor.errors[0].numpy().copy(), np.array([sent])]  # not tensors: a
    # tensor crosses the result queue as shared memory its sender must outlive


def test_two_replicas_get_the_same_mean_gradients():
    a, b = (list(map(torch.from_numpy, grads)) for grads in launch_local(_replica_grads, 2, 2))
    for x, y in zip(a[:-2], b[:-2], strict=True):  # (the last two: each replica's own error, bytes)
        assert torch.equal(x, y)
    mean = (
        torch.outer(torch.arange(10.0), torch.ones(12)) + torch.outer(torch.arange(10.0) + 1, 2 * torch.ones(12))
    ) / 2
    torch.testing.assert_close(a[0], mean, rtol=1e-5, atol=1e-4)  # rank 2 holds the mean whole
    torch.testing.assert_close(a[1], torch.full((10,), 0.5))  # vectors as they are
    torch.testing.assert_close(a[2], torch.full((1, 10), 1.0))  # min(1, 10) <= 2r: as it is


def test_bfloat16_factors_cost_half_and_the_error_keeps_their_rounding():
    fp32, bf16 = (launch_local(_replica_grads, 2, 2, wire) for wire in ("float32", "bfloat16"))
    for x, y in zip(bf16[0][:-2], bf16[1][:-2], strict=True):
        assert np.array_equal(x, y)  # the replicas still take the same step
    plain = 4 * (10 + 10 + 1)  # the vectors and the (1, 10) matrix: float32 either way
    factors = 4 * (10 + 12) * 2  # P (10, 2) and Q (12, 2)
    assert fp32[0][-1][0] == plain + factors and bf16[0][-1][0] == plain + factors // 2
    u = [torch.outer(torch.arange(10.0) + me, torch.ones(12) * (me + 1)) for me in (0, 1)]
    mean = (u[0] + u[1]) / 2
    got = torch.from_numpy(bf16[0][0])
    assert not torch.allclose(got, mean, rtol=1e-5, atol=1e-5)  # bfloat16 rounded it...
    torch.testing.assert_close(got, mean, rtol=2e-2, atol=5e-2)
    errors = (torch.from_numpy(bf16[0][-2]) + torch.from_numpy(bf16[1][-2])) / 2
    torch.testing.assert_close(got + errors, mean, rtol=1e-5, atol=1e-4)  # ...and kept what it rounded off


def test_what_a_compression_leaves_out_is_sent_later():
    net = _net()
    compressor = PowerSgd(net, torch.optim.Adam(net.parameters()), 1, seed=0)
    assert [p.shape for p in compressor.matrices] == [torch.Size([10, 12])]
    g = torch.randn(10, 12, generator=torch.Generator().manual_seed(3))
    net[0].weight.grad = g.clone()
    compressor.all_reduce()
    first = net[0].weight.grad.clone()
    assert torch.linalg.matrix_rank(first) == 1
    torch.testing.assert_close(first + compressor.errors[0], g)  # nothing lost: kept as the error
    total = first.clone()
    for _ in range(60):  # no new gradient: the error drains out through the next compressions
        net[0].weight.grad = torch.zeros(10, 12)
        compressor.all_reduce()
        total += net[0].weight.grad
    torch.testing.assert_close(total, g, rtol=1e-3, atol=1e-3)
