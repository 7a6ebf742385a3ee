"""Math of the momentum-scaled row-wise AdaGrad merge: reference vs fused kernel, 1D, implementation."""

import numpy as np
import pytest
import torch

from torchrec_sparselift.optim import MomentumScaledRowWiseAdagrad, finish_merge, local_payload
from torchrec_sparselift.optim.reference import (
    momentum_scaled_merge,
    plain_average_merge,
    rowwise_adagrad_step,
)

LR, EPS = 0.05, 1e-3


def _sparse_grads(rng, num_replicas, rows, dim, touch_prob):
    """Per-replica gradients where each row is touched by a random subset of replicas."""
    g = rng.normal(size=(num_replicas, rows, dim))
    mask = rng.random(size=(num_replicas, rows)) < touch_prob
    return g * mask[:, :, None]


def test_reference_step_matches_fused_rowwise_adagrad_kernel():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    torch.manual_seed(0)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(12, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR,
        eps=EPS,
        pooling_mode=PoolingMode.SUM,
    )
    w0 = tbe.split_embedding_weights()[0].detach().double().numpy().copy()
    a0 = tbe.get_optimizer_state()[0]["sum"].detach().double().numpy().copy()
    indices = torch.tensor([1, 1, 3, 7, 3])
    offsets = torch.tensor([0, 2, 4, 5])
    out = tbe(indices, offsets)
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    g = np.zeros_like(w0)
    for bag, (lo, hi) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        for idx in indices[lo:hi].tolist():
            g[idx] += upstream[bag].double().numpy()
    w_ref, a_ref = rowwise_adagrad_step(w0, a0, g, LR, EPS)
    np.testing.assert_allclose(tbe.split_embedding_weights()[0].detach().numpy(), w_ref, atol=1e-6)
    np.testing.assert_allclose(tbe.get_optimizer_state()[0]["sum"].numpy(), a_ref, atol=1e-6)


@pytest.mark.parametrize("num_replicas", [2, 4])
def test_merge_after_every_step_reproduces_1d_rowwise_adagrad(num_replicas):
    rng = np.random.default_rng(1)
    rows, dim = 40, 6
    w = rng.normal(size=(rows, dim))
    a = rng.random(rows) * 0.1
    w1d, a1d = w.copy(), a.copy()
    m = np.zeros_like(w)
    for _ in range(5):
        g = _sparse_grads(rng, num_replicas, rows, dim, touch_prob=0.4)
        local = [rowwise_adagrad_step(w, a, g[r], LR, EPS) for r in range(num_replicas)]
        w, a, m = momentum_scaled_merge(
            w, a, np.stack([x[0] for x in local]), np.stack([x[1] for x in local]),
            m, LR, EPS, sync_interval=1, momentum=0.0,
        )
        w1d, a1d = rowwise_adagrad_step(w1d, a1d, g.sum(axis=0), LR, EPS)
    np.testing.assert_allclose(w, w1d, atol=1e-10)
    np.testing.assert_allclose(a, a1d, atol=1e-10)


def test_plain_average_moves_row_of_one_replica_only_one_over_r_as_far():
    num_replicas, dim = 4, 3
    w = np.zeros((1, dim))
    a = np.full(1, 1.0)
    g = np.zeros((num_replicas, 1, dim))
    g[0, 0] = 1.0  # only replica 0 sees this tail row
    local = [rowwise_adagrad_step(w, a, g[r], LR, EPS) for r in range(num_replicas)]
    w_avg, _ = plain_average_merge(np.stack([x[0] for x in local]), np.stack([x[1] for x in local]))
    w_1d, _ = rowwise_adagrad_step(w, a, g.sum(axis=0), LR, EPS)
    w_ms, _, _ = momentum_scaled_merge(
        w, a, np.stack([x[0] for x in local]), np.stack([x[1] for x in local]),
        np.zeros_like(w), LR, EPS, sync_interval=1, momentum=0.0,
    )
    np.testing.assert_allclose(w_avg, w_1d / num_replicas, atol=1e-12)
    np.testing.assert_allclose(w_ms, w_1d, atol=1e-12)


def _implementation_merge(anchor_w, anchor_a, replica_w, replica_a, m, interval, momentum):
    """The distributed implementation with the all-reduce replaced by an explicit sum."""
    payloads = [
        local_payload(
            torch.tensor(anchor_w, dtype=torch.float32), torch.tensor(anchor_a, dtype=torch.float32),
            torch.tensor(replica_w[r], dtype=torch.float32), torch.tensor(replica_a[r], dtype=torch.float32),
            LR, EPS, interval,
        )
        for r in range(replica_w.shape[0])
    ]
    w, a, m, k = finish_merge(
        torch.tensor(anchor_w, dtype=torch.float32), torch.tensor(anchor_a, dtype=torch.float32),
        torch.tensor(m), sum(payloads), LR, EPS, interval, momentum,
    )
    return w.numpy(), a.numpy(), m.numpy(), k.numpy()


@pytest.mark.parametrize("momentum", [0.0, 0.6])
def test_implementation_matches_reference_over_several_syncs(momentum):
    rng = np.random.default_rng(2)
    num_replicas, rows, dim, interval = 4, 60, 5, 3
    w = rng.normal(size=(rows, dim)).astype(np.float32).astype(np.float64)
    a = (rng.random(rows) * 0.1).astype(np.float32).astype(np.float64)
    w_ref, a_ref, m_ref = w.copy(), a.copy(), np.zeros_like(w)
    m_impl = np.zeros_like(w)
    for _ in range(3):
        replica_w, replica_a = [], []
        for r in range(num_replicas):
            wr, ar = w_ref.copy(), a_ref.copy()
            for _ in range(interval):
                wr, ar = rowwise_adagrad_step(wr, ar, _sparse_grads(rng, 1, rows, dim, 0.12)[0], LR, EPS)
            # the fused kernel stores float32: feed both sides the same float32 states
            replica_w.append(wr.astype(np.float32).astype(np.float64))
            replica_a.append(ar.astype(np.float32).astype(np.float64))
        replica_w, replica_a = np.stack(replica_w), np.stack(replica_a)
        w_impl, a_impl, m_impl, k = _implementation_merge(
            w_ref, a_ref, replica_w, replica_a, m_impl, interval, momentum
        )
        w_ref, a_ref, m_ref = momentum_scaled_merge(
            w_ref, a_ref, replica_w, replica_a, m_ref, LR, EPS, interval, momentum
        )
        np.testing.assert_allclose(w_impl, w_ref, atol=1e-6)
        np.testing.assert_allclose(a_impl, a_ref, atol=1e-6)
        np.testing.assert_allclose(m_impl, m_ref, atol=1e-6)
        assert (k == 0).any() and (k == 1).any() and (k >= 2).any()
        w_ref = w_ref.astype(np.float32).astype(np.float64)
        a_ref = a_ref.astype(np.float32).astype(np.float64)


def test_untouched_rows_keep_anchor_and_momentum():
    anchor_w = torch.ones(3, 2)
    anchor_a = torch.full((3,), 0.5)
    buf = torch.full((3, 2), 0.25, dtype=torch.float64)
    replica = anchor_w.clone()
    replica[1] -= 0.1  # only row 1 moves
    replica_a = anchor_a.clone()
    replica_a[1] += 0.2
    summed = local_payload(anchor_w, anchor_a, replica, replica_a, LR, EPS) + local_payload(
        anchor_w, anchor_a, anchor_w, anchor_a, LR, EPS
    )
    w, a, m, k = finish_merge(anchor_w, anchor_a, buf, summed, LR, EPS, 1, 0.9)
    assert k.tolist() == [0, 1, 0]
    for row in (0, 2):
        assert torch.equal(w[row], anchor_w[row].double())
        assert torch.equal(m[row], buf[row])
        assert a[row] == anchor_a[row]
    assert not torch.equal(w[1], anchor_w[1].double())


@pytest.mark.parametrize("bad", [-0.1, 1.0])
def test_momentum_outside_unit_interval_is_refused(bad):
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        MomentumScaledRowWiseAdagrad(momentum=bad)


def test_fresh_row_with_opposing_replicas_moves_at_most_lr_sqrt_n():
    """Pseudo-gradients of a fresh row are amplified; the accumulator floor keeps the step bounded."""
    interval, dim = 4, 3
    w0, a0 = np.zeros((1, dim)), np.zeros(1)
    replica_w, replica_a = [], []
    for sign, touches in ((1.0, 3), (-1.0, 1)):  # replica 0 pushes 3 times, replica 1 once back
        w, a = w0, a0
        for _ in range(touches):
            w, a = rowwise_adagrad_step(w, a, np.full((1, dim), sign), LR, EPS)
        replica_w.append(w)
        replica_a.append(a)
    w, a, _ = momentum_scaled_merge(
        w0, a0, np.stack(replica_w), np.stack(replica_a), np.zeros_like(w0), LR, EPS, interval, 0.0
    )
    step_rms = np.sqrt(np.mean((w - w0) ** 2))
    assert 0.0 < step_rms <= LR * np.sqrt(interval) + 1e-12
    assert a[0] > 0.0


@pytest.mark.parametrize("num_replicas", [2, 4])
def test_interval_preconditioner_recovers_1d_for_a_fresh_row_every_replica_touches(num_replicas):
    """A fresh row pushed by a constant gradient on every step by every replica: 1D moves it
    ~2 lr sqrt(N); inverting the replicas' N local steps as one step ("end") halves that and
    inflates the accumulator, the interval's harmonic-mean denominator recovers both."""
    from torchrec_sparselift.optim import interval_denominator

    N, dim, lr, eps = 32, 4, 0.05, 1e-8
    g = np.array([[0.3, -0.2, 0.5, 0.1]])
    w1, a1 = np.zeros((1, dim)), np.zeros(1)
    for _ in range(N):  # 1D: the summed gradient every step
        w1, a1 = rowwise_adagrad_step(w1, a1, g, lr, eps)
    rw, ra = [], []
    for _ in range(num_replicas):  # each replica: its 1/R share, N local steps
        w, a = np.zeros((1, dim)), np.zeros(1)
        for _ in range(N):
            w, a = rowwise_adagrad_step(w, a, g / num_replicas, lr, eps)
        rw.append(w)
        ra.append(a)
    zero_w, zero_a = torch.zeros(1, dim, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    out = {}
    for pre in ("end", "interval"):
        summed = sum(local_payload(zero_w, zero_a, torch.from_numpy(w), torch.from_numpy(a), lr, eps, N, pre)
                     for w, a in zip(rw, ra))
        w, a, _, _ = finish_merge(zero_w, zero_a, torch.zeros((), dtype=torch.float64), summed, lr, eps,
                                  N, 0.0, pre)
        out[pre] = (np.linalg.norm(w.numpy()) / np.linalg.norm(w1), float(a[0]) / a1[0])
    assert 0.97 < out["interval"][0] < 1.03 and 0.9 < out["interval"][1] < 1.1
    assert out["end"][0] < 0.7 and out["end"][1] > 2.0
    # one step: both denominators are AdaGrad's own
    a0, a_end = torch.tensor([0.0, 2.0]), torch.tensor([1.0, 3.0])
    assert torch.allclose(interval_denominator(a0, a_end, 1, eps), a_end.double().sqrt() + eps)


def test_frozen_tables_lr_zero_merge_without_nan():
    """A table trained at learning rate 0 (frozen embeddings) moves nowhere; its merge must not
    divide 0 by 0."""
    from torchrec_sparselift.optim.momentum_scaled import finish_merge, local_payload

    w0 = torch.randn(5, 4)
    a0 = torch.zeros(5)
    a1 = torch.tensor([0.0, 0.3, 0.0, 0.1, 0.0])  # the kernel still grows the accumulator
    p = local_payload(w0, a0, w0.clone(), a1, lr=0.0, eps=1e-8, sync_interval=2, grad_scale=0.5)
    assert torch.isfinite(p).all()
    w, a, _, k = finish_merge(w0, a0, torch.zeros(()), p + p, 0.0, 1e-8, 2, 0.0)
    assert torch.equal(w, w0.double()) and torch.isfinite(a).all() and int((k > 0).sum()) == 2
