"""The dense part's quantities read off TorchRec's models, how they are priced, and the
calibration's machine-drift normalization."""

import attrs
import pytest
import torch

from torchrec_sparselift.cost.hardware import PRESETS, HardwareProfile
from torchrec_sparselift.cost.model import CostContext, DenseWork, dense_fwd_s
from torchrec_sparselift.measure.probe import ProbeTable, ProbeWorkload, probe_model


def _work(model: str, nf: int = 5, dim: int = 16):
    from torchrec.distributed.sharding_plan import get_default_sharders

    from torchrec_sparselift.semantics.dense import dense_work
    from torchrec_sparselift.semantics.tables import extract_tables

    tables = tuple(ProbeTable(f"t{i}", 100 + i, dim, (f"f{i}",)) for i in range(nf))
    w = ProbeWorkload("w", tables, model=model, dense=(32,), over=(8, 1), dcn_layers=2, dcn_rank=4)
    m = probe_model(w)
    handles = extract_tables(m, get_default_sharders(), "cpu", 64, None)
    return dense_work(m, handles), m


def test_dlrm_interaction_flops_and_activations_follow_its_shapes():
    F, D = 5, 16
    work, m = _work("dlrm", F, D)
    pairs = F * (F + 1) // 2
    assert work.interaction_flops_per_sample == 2 * (F + 1) ** 2 * D
    linear_out = sum(l.out_features for l in m.modules() if isinstance(l, torch.nn.Linear))
    inter = (F + 1) * D + (F + 1) ** 2 + pairs + D + pairs
    assert work.activation_bytes_per_sample == 4 * (F * D + 2 * linear_out + inter)
    dense_params = sum(p.numel() for n, p in m.named_parameters() if "embedding_bag_collection" not in n)
    assert work.fwd_flops_per_sample == 2 * dense_params  # tables are not dense work


def test_dcn_cross_layers_write_per_layer_intermediates_and_no_interaction_flops():
    F, D = 5, 16
    work, m = _work("dcn", F, D)
    assert work.interaction_flops_per_sample == 0
    n = (F + 1) * D
    linear_out = sum(l.out_features for l in m.modules() if isinstance(l, torch.nn.Linear))
    assert work.activation_bytes_per_sample == 4 * (F * D + 2 * linear_out + n + 2 * (3 * n + 4))


def test_dense_forward_prices_each_quantity_at_its_rate_and_falls_back_when_unset():
    d = DenseWork(param_bytes=0.0, fwd_flops_per_sample=1e6, interaction_flops_per_sample=2e5,
                  activation_bytes_per_sample=1e4)
    p = attrs.evolve(PRESETS["cpu-gloo"], dense_flops=1e10, interaction_flops=1e9, dense_mem_bw=1e8)
    ctx = CostContext(profile=p, world_size=2, local_world_size=2, batch_size=100, dense=d)
    assert dense_fwd_s(ctx) == pytest.approx(100 * (1e6 / 1e10 + 2e5 / 1e9 + 1e4 / 1e8))
    unset = attrs.evolve(p, interaction_flops=None, dense_mem_bw=None)
    ctx2 = attrs.evolve(ctx, profile=unset)
    assert dense_fwd_s(ctx2) == pytest.approx(100 * (1e6 / 1e10 + 2e5 / 1e10 + 1e4 / unset.hbm_bw))


def test_optional_rates_reject_nonpositive_values():
    with pytest.raises(ValueError, match="dense_mem_bw"):
        HardwareProfile(name="x", dense_mem_bw=0.0)
    with pytest.raises(ValueError, match="interaction_flops"):
        HardwareProfile(name="x", interaction_flops=-1.0)


def test_reference_drifts_are_relative_to_the_median_reference():
    from torchrec_sparselift.measure.steps import reference_drifts

    d = reference_drifts([1.0, 1.0, 2.0, 2.0, 1.0])
    assert d == pytest.approx([1.0, 2 ** 0.5, 2.0, 2 ** 0.5])
    with pytest.raises(ValueError, match="two positive"):
        reference_drifts([1.0])


def _drifting_probes(rank, world_size):
    """measure_probes on a machine that runs 2x slower during the second workload: the normalized
    seconds of the same plan in both workloads agree, the raw ones do not."""
    import itertools

    from torchrec_sparselift.measure import steps as sc
    from torchrec_sparselift.measure import probe

    speed = {"a": 1.0, "b": 2.0}
    phase = {"now": "a"}
    clock = itertools.count()

    class M:
        def __init__(self, s):
            self.median_s, self.attribution, self.label = s, None, "x"
            self.durations_s = (s,) * 60

    def fake_measure(label, factory, plan, batches, *a, **k):
        next(clock)
        return M(0.01 * speed[phase["now"]] * (2.0 if "column_wise" in label else 1.0))

    workloads = [ProbeWorkload(n, (ProbeTable(f"{n}0", 10, 8, (f"{n}f",)),)) for n in ("a", "b")]

    def fake_forced(model, tables, kind, *a, **k):
        phase["now"] = tables[0].name[0]
        return object(), {}

    orig = (probe.measure_plan, sc.forced_plan, probe.prebuilt_batches, probe.probe_model, probe.probe_stats)
    probe.measure_plan, sc.forced_plan = fake_measure, fake_forced
    probe.prebuilt_batches, probe.probe_model = (lambda *a, **k: []), (lambda w: None)
    probe.probe_stats = lambda *a, **k: None
    import logging

    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    sc.logger.addHandler(handler)
    try:
        # the reference is the first workload's table-wise plan ("probe_many" is not among them); it is
        # measured in the phase of the workload that ran last
        out = sc.measure_probes(None, "cpu", workloads, ["table_wise", "column_wise"],
                                progress=False, attribute=0)
        raw = sc.measure_probes(None, "cpu", workloads, ["table_wise", "column_wise"], progress=False, attribute=0,
                                normalize=False)
    finally:
        probe.measure_plan, sc.forced_plan, probe.prebuilt_batches, probe.probe_model, probe.probe_stats = orig
        sc.logger.removeHandler(handler)
    return ([(o.workload, o.kind, o.measured_s, o.drift) for o in out], [(o.workload, o.kind, o.measured_s) for o in raw],
            warned)


def test_calibration_normalizes_a_drifting_machine():
    from launcher import run_ranks

    out, raw, warned = run_ranks(_drifting_probes, 1)[0]
    norm = {(w, k): s for w, k, s, _d in out}
    assert raw[0][2] * 2 == pytest.approx(raw[2][2])  # raw: the second workload ran 2x slower
    # references: before a (phase a) 1x, after a (still a) 1x, after b 2x: drifts a 1.0, b sqrt(2)
    assert [d for _w, _k, _s, d in out] == pytest.approx([1.0, 1.0, 2 ** 0.5, 2 ** 0.5])
    assert norm[("b", "table_wise")] == pytest.approx(raw[2][2] / 2 ** 0.5)
    assert norm[("b", "column_wise")] / norm[("b", "table_wise")] == pytest.approx(2.0)
    # the drift spread sqrt(2) = 1.41x is more than MAX_DRIFT_SPREAD: the calibration says so, once
    assert len(warned) == 1 and "moved 1.41x" in warned[0] and "calibrate again" in warned[0]


def test_drift_spread():
    from torchrec_sparselift.calibration.store import MAX_DRIFT_SPREAD, drift_spread

    assert drift_spread([1.0]) == 1.0 and drift_spread([]) == 1.0
    assert drift_spread([0.9, 1.0, 1.17]) == pytest.approx(1.3)
    assert drift_spread([0.98, 1.02]) < MAX_DRIFT_SPREAD < drift_spread([0.9, 1.89])
