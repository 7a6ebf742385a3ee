"""Momentum-scaled row-wise AdaGrad: a row-aware replica merge for 2D sparse parallelism.

Replicas train with TorchRec's fused ``EXACT_ROWWISE_ADAGRAD`` locally; at every replica sync,
instead of averaging weights and accumulators (TorchRec's ``DMPCollection.sync``), each row is
merged as one 1D-equivalent AdaGrad step on the replicas' summed pseudo-gradients, with an
accumulator increment estimated at the 1D scale and an optional per-row momentum on the merged
step. Equations and rationale: docs/optimizer.md; numpy reference:
:func:`torchrec_sparselift.optim.reference.momentum_scaled_merge`.

Enable it with one argument::

    model = build_2d_model_parallel(..., replica_sync=MomentumScaledRowWiseAdagrad(momentum=0.0))

The merge is split into a local part (:func:`local_payload`), one SUM all-reduce over the replica
group, and a local finish (:func:`finish_merge`); both parts are pure tensor functions.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import attrs
import torch
import torch.distributed as dist

__all__ = [
    "MomentumScaledRowWiseAdagrad",
    "MergeStats",
    "local_payload",
    "finish_merge",
    "interval_denominator",
    "PRECONDITIONERS",
]

_DTYPE = torch.float64

#: How a replica's displacement is turned back into a gradient and the merged gradient into a
#: step: "end" divides by the AdaGrad denominator at the end of the interval, sqrt(a) + eps (exact
#: for one step); "interval" by its harmonic mean along the interval (docs/optimizer.md).
PRECONDITIONERS = ("end", "interval")


def _unit_interval(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(
            f"{attribute.name} must be in [0, 1), got {value}; 0 disables the momentum term."
        )


def _check_preconditioner(preconditioner: str) -> None:
    if preconditioner not in PRECONDITIONERS:
        raise ValueError(f"preconditioner must be one of {PRECONDITIONERS}, got {preconditioner!r}")


def interval_denominator(
    a0: torch.Tensor, a1: torch.Tensor, steps: int, eps: float, preconditioner: str = "interval"
) -> torch.Tensor:
    """AdaGrad's denominator for an interval of ``steps`` steps that took the accumulator from
    ``a0`` to ``a1`` (per row, float64).

    ``"end"``: ``sqrt(a1) + eps``. ``"interval"``: the harmonic mean of ``sqrt(a_t) + eps`` along a
    path growing the accumulator by equal increments, ``a_t = a0 + t (a1 - a0) / steps``::

        h = steps / sum_{t=1..steps} 1 / (sqrt(a_t) + eps)

    the one denominator with which a constant gradient moves a row as far in one step as in
    ``steps`` AdaGrad steps. Both agree for ``steps == 1`` and when ``a0`` dominates ``a1 - a0``.
    """
    _check_preconditioner(preconditioner)
    a0 = a0.to(_DTYPE)
    a1 = a1.to(_DTYPE)
    if preconditioner == "end" or steps == 1:
        return a1.sqrt() + eps
    inc = (a1 - a0) / steps
    inv = torch.zeros_like(a1)
    for t in range(1, steps + 1):
        inv += 1.0 / ((a0 + t * inc).clamp_min(0).sqrt() + eps)
    return steps / inv


def local_payload(
    anchor_w: torch.Tensor,
    anchor_a: torch.Tensor,
    w: torch.Tensor,
    a: torch.Tensor,
    lr: float,
    eps: float,
    sync_interval: int = 1,
    preconditioner: str = "interval",
    grad_scale: float = 1.0,
) -> torch.Tensor:
    """This replica's contribution to the merge, ``[rows, dim + 3]``: ``[G, mean(G^2), dA, touched]``.

    ``G = -(w - w0) h / lr`` is the pseudo-gradient, with ``h`` the interval's AdaGrad denominator
    (:func:`interval_denominator`; exactly the gradient when one step passed since the anchor),
    ``dA = a - a0`` the accumulator growth, ``touched`` 1.0 for rows whose weight or accumulator
    changed. Summing payloads over replicas gives the inputs of :func:`finish_merge`.

    ``grad_scale`` converts this replica's gradients to its share of the 1D gradient: ``G`` is
    multiplied by it, ``mean(G^2)`` and ``dA`` (sums of squared gradients) by its square. 1 when
    a table row's gradient is the sum over the ranks that looked it up; ``1 / R`` under TorchRec's
    gradient division (its all-to-all backward divides by the process group's size: by the
    sharding group's ``L`` ranks in 2D, by all ``W = R L`` in 1D). With ``lr == 0`` nothing moved
    and ``G`` is 0.
    """
    dw = w.to(_DTYPE) - anchor_w.to(_DTYPE)
    da = a.to(_DTYPE) - anchor_a.to(_DTYPE)
    touched = ((da > 0) | (dw != 0).any(dim=1)).to(_DTYPE)
    if lr == 0:
        G = torch.zeros_like(dw)
    else:
        h = interval_denominator(anchor_a, a, sync_interval, eps, preconditioner)
        G = -dw * (h * (grad_scale / lr)).unsqueeze(1)
    return torch.cat(
        [G, G.pow(2).mean(dim=1, keepdim=True), (da * grad_scale ** 2).unsqueeze(1), touched.unsqueeze(1)], dim=1
    )


def finish_merge(
    anchor_w: torch.Tensor,
    anchor_a: torch.Tensor,
    momentum_buf: torch.Tensor,
    summed_payload: torch.Tensor,
    lr: float,
    eps: float,
    sync_interval: int,
    momentum: float,
    preconditioner: str = "interval",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merged ``(w, a, momentum_buf, k)`` from the anchor and the replica-summed payload.

    Untouched rows (``k == 0``) keep the anchor and their momentum buffer. Results are float64;
    ``k`` is the number of replicas that touched each row. ``momentum_buf`` may be a scalar
    zero tensor when ``momentum == 0``. ``preconditioner`` must match the payloads'
    (:func:`interval_denominator`).
    """
    dim = anchor_w.shape[1]
    S = summed_payload[:, :dim]
    Q = summed_payload[:, dim]
    U = summed_payload[:, dim + 1]
    k = summed_payload[:, dim + 2].round()
    w0 = anchor_w.to(_DTYPE)
    a0 = anchor_a.to(_DTYPE)
    m0 = momentum_buf.to(_DTYPE)
    S2 = S.pow(2).mean(dim=1)
    # the floor mean(S^2)/N bounds the merged step's rms by lr*sqrt(N) (docs/optimizer.md)
    dA = torch.maximum(U + (S2 - Q) / sync_interval, S2 / sync_interval)
    a_new = a0 + dA
    D = -lr * S / interval_denominator(a0, a_new, sync_interval, eps, preconditioner).unsqueeze(1)
    m_new = momentum * m0 + D
    touched = (k > 0).unsqueeze(1)
    w_out = torch.where(touched, w0 + m_new, w0)
    a_out = torch.where(touched.squeeze(1), a_new, a0)
    m_out = torch.where(touched, m_new, m0)
    return w_out, a_out, m_out, k


@attrs.frozen
class MergeStats:
    """What the last merge did: rows touched by exactly k replicas, for k = 0..R."""

    rows_by_touch_count: Tuple[int, ...]


@attrs.frozen
class MomentumScaledRowWiseAdagrad:
    """Replica sync rule for 2D sparse parallelism (see module docstring and docs/optimizer.md).

    ``momentum``: per-row heavy-ball coefficient on the merged step (0 disables it; then a sync
    after every step reproduces 1D row-wise AdaGrad exactly). ``preconditioner``: "interval"
    (default) or "end", the AdaGrad denominator used to invert and re-apply the interval's steps
    (:func:`interval_denominator`; identical for ``sync_interval == 1``). Requires the sharded tables to use
    the fused ``EXACT_ROWWISE_ADAGRAD`` without weight decay. Keeps, per local table row, an
    anchor copy of weights and accumulator and (if ``momentum > 0``) a float64 momentum buffer.
    ``gradient_division`` (default: TorchRec's ``comm_ops.get_gradient_division()``, True unless
    changed): each replica's table gradients are its sharding group's mean, not its sum, so the
    merge combines the replicas' mean rather than their sum, as 1D's all-to-all averages over the
    whole world.
    This state is not part of the model's ``state_dict``: after loading a checkpoint, call the
    model's ``install_replica_sync`` again to re-anchor (the momentum buffer restarts at zero).
    """

    momentum: float = attrs.field(default=0.0, validator=_unit_interval)
    preconditioner: str = attrs.field(default="interval")
    #: whether a replica's table gradients are divided by its sharding group's size (TorchRec's
    #: ``comm_ops`` gradient division; the merge then scales them by ``1 / R``: :func:`local_payload`);
    #: None reads TorchRec's setting when binding
    gradient_division: Optional[bool] = attrs.field(default=None)

    @preconditioner.validator
    def _check(self, attribute: attrs.Attribute, value: str) -> None:
        _check_preconditioner(value)

    def bind(self, slots: Sequence[Any], replica_pg: dist.ProcessGroup, sync_interval: int):
        """Bind to one rank's ``RowWiseAdagradSlot`` s; the current state becomes the anchor."""
        if sync_interval < 1:
            raise ValueError(f"sync_interval must be >= 1, got {sync_interval}")
        division = self.gradient_division
        if division is None:
            from torchrec.distributed.comm_ops import get_gradient_division

            division = bool(get_gradient_division())
        return _MomentumScaledSession(self, list(slots), replica_pg, sync_interval, division)


class _MomentumScaledSession:
    """Per-rank state of :class:`MomentumScaledRowWiseAdagrad`: anchors and momentum buffers."""

    def __init__(
        self,
        rule: MomentumScaledRowWiseAdagrad,
        slots: List[Any],
        replica_pg: dist.ProcessGroup,
        sync_interval: int,
        gradient_division: bool = False,
    ) -> None:
        self.rule = rule
        self.slots = slots
        self.replica_pg = replica_pg
        self.sync_interval = sync_interval
        self.num_replicas = dist.get_world_size(replica_pg)
        self.grad_scale = 1.0 / self.num_replicas if gradient_division else 1.0
        self.anchor_w = [s.weight.detach().clone() for s in slots]
        self.anchor_a = [s.accumulator.detach().clone() for s in slots]
        # with momentum 0 the buffer stays a broadcast scalar zero: no per-row memory
        self.momentum_buf = [
            torch.zeros_like(s.weight, dtype=_DTYPE)
            if rule.momentum > 0
            else torch.zeros((), dtype=_DTYPE)
            for s in slots
        ]
        self.last_stats = MergeStats(rows_by_touch_count=())

    @torch.no_grad()
    def sync(self) -> None:
        """Merge this rank's slots with the same slots of the other replicas (one all-reduce)."""
        if not self.slots:
            return
        hyper = [(s.learning_rate(), s.eps()) for s in self.slots]
        payloads = [
            local_payload(aw, aa, s.weight, s.accumulator, lr, eps, self.sync_interval,
                          self.rule.preconditioner, self.grad_scale)
            for s, aw, aa, (lr, eps) in zip(self.slots, self.anchor_w, self.anchor_a, hyper)
        ]
        sizes = [p.numel() for p in payloads]
        flat = torch.cat([p.reshape(-1) for p in payloads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.replica_pg)
        counts = torch.zeros(self.num_replicas + 1, dtype=torch.long)
        for i, (slot, part, (lr, eps)) in enumerate(
            zip(self.slots, torch.split(flat, sizes), hyper)
        ):
            summed = part.view(payloads[i].shape)
            w, a, m, k = finish_merge(
                self.anchor_w[i],
                self.anchor_a[i],
                self.momentum_buf[i],
                summed,
                lr,
                eps,
                self.sync_interval,
                self.rule.momentum,
                self.rule.preconditioner,
            )
            slot.weight.copy_(w)
            slot.accumulator.copy_(a)
            if self.rule.momentum > 0:
                self.momentum_buf[i] = m
            self.anchor_w[i] = slot.weight.detach().clone()
            self.anchor_a[i] = slot.accumulator.detach().clone()
            counts += torch.bincount(k.long(), minlength=self.num_replicas + 1)
        self.last_stats = MergeStats(rows_by_touch_count=tuple(int(c) for c in counts))
