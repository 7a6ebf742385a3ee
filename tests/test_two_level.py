"""The two-level all-to-all's price (``cost.two_level``): equal to the flat one where there is nothing to
regroup, fewer cross-host messages with more ranks per host, the same cross-host bytes, the
equations' terms, and validation errors that name the field."""

import math

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrec_sparselift.cost import two_level as tl
from torchrec_sparselift.cost.hardware import PRESETS

prices = st.builds(tl.A2APrices, intra_bw=st.floats(1e6, 1e12), inter_bw=st.floats(1e6, 1e12),
                   call_s=st.floats(0, 1e-3), intra_message_s=st.floats(0, 1e-4), inter_message_s=st.floats(0, 1e-3),
                   copy_byte_s=st.floats(0, 1e-9), host_link_shared=st.booleans())
sizes = st.floats(0, 8e6)


@settings(max_examples=60, deadline=None)
@given(p=prices, L=st.integers(1, 8), s=sizes, scheme=st.sampled_from(tl.TWO_LEVEL_SCHEMES))
def test_on_one_host_the_two_level_price_is_the_flat_one(p, L, s, scheme):
    shape = tl.A2AShape(1, L, s)
    two, flat = tl.two_level_price(shape, p, scheme), tl.flat_price(shape, p)
    assert two.seconds == flat.seconds and two.calls == 1 and two.inter_messages == 0


@settings(max_examples=60, deadline=None)
@given(p=prices, H=st.integers(1, 8), s=sizes, scheme=st.sampled_from(tl.TWO_LEVEL_SCHEMES))
def test_with_one_rank_per_host_the_two_level_price_is_the_flat_one(p, H, s, scheme):
    shape = tl.A2AShape(H, 1, s)
    assert tl.two_level_price(shape, p, scheme).seconds == tl.flat_price(shape, p).seconds


@settings(max_examples=80, deadline=None)
@given(p=prices, H=st.integers(2, 6), L=st.integers(1, 7), s=sizes, scheme=st.sampled_from(tl.TWO_LEVEL_SCHEMES))
def test_more_ranks_per_host_never_make_the_two_level_send_more_cross_host_messages(p, H, L, s, scheme):
    """Per rank at a fixed number of hosts, and in all at a fixed world size; never more than flat."""
    a, b = (tl.two_level_price(tl.A2AShape(H, n, s), p, scheme) for n in (L, L + 1))
    assert b.inter_messages <= a.inter_messages
    W = H * L
    totals = [tl.two_level_price(tl.A2AShape(W // n, n, s), p, scheme) for n in range(1, W + 1) if W % n == 0]
    total = [t.inter_messages_per_host_pair * (W // n) * (W // n - 1) for t, n in
             zip(totals, [n for n in range(1, W + 1) if W % n == 0])]
    assert total == sorted(total, reverse=True)
    flat = tl.flat_price(tl.A2AShape(H, L, s), p)
    two = tl.two_level_price(tl.A2AShape(H, L, s), p, scheme)
    assert two.inter_messages <= flat.inter_messages
    assert two.inter_messages_per_host_pair <= flat.inter_messages_per_host_pair


@settings(max_examples=60, deadline=None)
@given(p=prices, H=st.integers(2, 5), L=st.integers(2, 5), s=st.floats(1, 8e6))
def test_the_rail_scheme_carries_the_same_cross_host_bytes_and_more_intra_host_bytes(p, H, L, s):
    flat, rail = tl.flat_price(tl.A2AShape(H, L, s), p), tl.two_level_price(tl.A2AShape(H, L, s), p, "rail")
    assert math.isclose(rail.inter_bytes, flat.inter_bytes, rel_tol=1e-9)
    assert math.isclose(rail.intra_bytes, (L - 1) * H * s, rel_tol=1e-9)
    assert math.isclose(flat.intra_bytes, (L - 1) * s, rel_tol=1e-9)
    assert math.isclose(rail.copy_bytes, 2 * H * L * s, rel_tol=1e-9)


def test_the_uniform_equations():
    p = tl.A2APrices(intra_bw=1e9, inter_bw=1e8, call_s=1e-4, intra_message_s=1e-5, inter_message_s=1e-4,
                     copy_byte_s=1e-10, host_link_shared=True)
    H, L, s = 2, 4, 1e5
    W = H * L
    flat = tl.flat_price(tl.A2AShape(H, L, s), p)
    assert flat.seconds == pytest.approx(1e-4 + 3e-5 + 4e-4 + max(3 * s / 1e9, 4 * s / 1e8))
    rail = tl.two_level_price(tl.A2AShape(H, L, s), p, "rail")
    assert rail.seconds == pytest.approx(2e-4 + 3e-5 + 1e-4 + 3 * H * s / 1e9 + 4 * s / 1e8 + 2 * W * s * 1e-10)
    lead = tl.two_level_price(tl.A2AShape(H, L, s), p, "leader")
    assert lead.seconds == pytest.approx(3e-4 + 2 * 3e-5 + 1e-4 + 2 * 3 * W * s / 1e9 + L * L * s / (L * 1e8)
                                         + 2 * L * W * s * 1e-10)
    assert (flat.inter_messages, rail.inter_messages, lead.inter_messages) == (4, 1, 1)
    assert (flat.inter_messages_per_host_pair, rail.inter_messages_per_host_pair,
            lead.inter_messages_per_host_pair) == (16, 4, 1)
    # a leader alone on a link per rank gets one rank's rate
    own = tl.two_level_price(tl.A2AShape(H, L, s), attrs.evolve(p, host_link_shared=False), "leader")
    assert own.seconds - lead.seconds == pytest.approx(L * L * s / 1e8 - L * s / 1e8)


def test_a_matrix_of_pair_bytes_prices_as_its_uniform_size():
    p = tl.A2APrices(intra_bw=2e9, inter_bw=3e8, call_s=5e-5, intra_message_s=2e-6, inter_message_s=4e-5,
                     copy_byte_s=3e-10, host_link_shared=False)
    for scheme in tl.SCHEMES:
        a = tl.price(tl.A2AShape(3, 2, 1000.0), p, scheme)
        b = tl.price(tl.A2AShape(3, 2, [[1000.0] * 6 for _ in range(6)]), p, scheme)
        assert a.seconds == pytest.approx(b.seconds)


def test_a_skewed_matrix_prices_the_busiest_link():
    p = tl.A2APrices(intra_bw=1e12, inter_bw=1e6, call_s=0, intra_message_s=0, inter_message_s=0, copy_byte_s=0,
                     host_link_shared=False)
    S = [[0.0] * 4 for _ in range(4)]
    S[0][2] = 1e6  # rank 0 (host 0) sends 1 MB to rank 2 (host 1)
    assert tl.flat_price(tl.A2AShape(2, 2, S), p).seconds == pytest.approx(1.0)
    shared = attrs.evolve(p, host_link_shared=True)  # the host's link carries 2 ranks' rate
    assert tl.flat_price(tl.A2AShape(2, 2, S), shared).seconds == pytest.approx(0.5)


def test_where_it_wins_many_ranks_per_host_small_messages_high_message_latency():
    nvlink = tl.prices_from_profile(PRESETS["h100"],
                                    intra_message_s=2e-6, inter_message_s=1e-5)
    small, large = tl.A2AShape(8, 8, 4096.0), tl.A2AShape(8, 8, 4e6)
    assert tl.price(small, nvlink, "rail").seconds < tl.flat_price(small, nvlink).seconds
    assert tl.price(large, nvlink, "rail").seconds > tl.flat_price(large, nvlink).seconds
    be = tl.break_even_message_s(small, nvlink, "rail")
    assert be is not None and 0 < be < 1e-5
    at = attrs.evolve(nvlink, inter_message_s=be)
    assert tl.price(small, at, "rail").seconds == pytest.approx(tl.flat_price(small, at).seconds)
    assert tl.break_even_message_s(tl.A2AShape(1, 8, 4096.0), nvlink) is None  # nothing saved on one host


@pytest.mark.parametrize("field,value,words", [
    ("intra_bw", 0, "A2APrices.intra_bw must be a positive"),
    ("inter_bw", float("inf"), "A2APrices.inter_bw must be a positive"),
    ("call_s", -1e-6, "A2APrices.call_s must be a finite number >= 0"),
    ("inter_message_s", "1e-5", "A2APrices.inter_message_s"),
    ("copy_byte_s", float("nan"), "A2APrices.copy_byte_s"),
    ("host_link_shared", 1, "A2APrices.host_link_shared must be True or False"),
])
def test_prices_validation_names_the_field(field, value, words):
    kw = dict(intra_bw=1e9, inter_bw=1e8, call_s=0, intra_message_s=0, inter_message_s=0, copy_byte_s=0)
    kw[field] = value
    with pytest.raises(ValueError, match=words):
        tl.A2APrices(**kw)


@pytest.mark.parametrize("kw,words", [
    (dict(hosts=0, ranks_per_host=2, pair_bytes=1.0), "A2AShape.hosts must be an int >= 1"),
    (dict(hosts=2, ranks_per_host=True, pair_bytes=1.0), "A2AShape.ranks_per_host"),
    (dict(hosts=2, ranks_per_host=2, pair_bytes=-1.0), "A2AShape.pair_bytes must hold finite byte counts"),
    (dict(hosts=2, ranks_per_host=2, pair_bytes=[[1.0] * 4] * 3), "A2AShape.pair_bytes must be one number or a 4 x 4"),
])
def test_shape_validation_names_the_field(kw, words):
    with pytest.raises(ValueError, match=words):
        tl.A2AShape(**kw)


def test_an_unknown_scheme_is_named():
    p = tl.A2APrices(intra_bw=1e9, inter_bw=1e8, call_s=0, intra_message_s=0, inter_message_s=0, copy_byte_s=0)
    with pytest.raises(ValueError, match="'ring' is not one of rail, leader"):
        tl.two_level_price(tl.A2AShape(2, 2, 1.0), p, "ring")



@pytest.mark.parametrize("local", [4, 8])
def test_a_multi_host_plan_notes_the_two_level_price_and_a_one_host_plan_does_not(local):
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.models.dlrm import DLRM

    from torchrec_sparselift import SparseLiftPlanner

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=64, num_embeddings=200_000, feature_names=[f"f{i}"])
              for i in range(6)]
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
                 dense_in_features=13, dense_arch_layer_sizes=[128, 64], over_arch_layer_sizes=[64, 1])
    topo = Topology(world_size=8, local_world_size=local, compute_device="cuda", hbm_cap=80 << 30)
    planner = SparseLiftPlanner(topology=topo, batch_size=2048, hardware="h100", debug=False, time_budget_s=2,
                                solver="heuristic")
    res = planner.plan_with_result(model, get_default_sharders())
    notes = [n for n in res.rewrites.notes if n.startswith("two-level all-to-all")]
    if local == 8:
        assert notes == []
    else:
        assert len(notes) == 1 and "across 2 hosts x 4 ranks" in notes[0] and "not run" in notes[0], res.rewrites.notes


@settings(max_examples=60, deadline=None)
@given(hosts=st.integers(1, 4), per_host=st.integers(1, 4), pair=st.floats(0, 1e7),
       shared=st.booleans(), scheme=st.sampled_from(["flat", "rail", "leader"]))
def test_a_uniform_shape_is_priced_in_closed_form_as_its_matrix(hosts, per_host, pair, shared, scheme):
    p = tl.A2APrices(intra_bw=1e11, inter_bw=1e9, call_s=2e-5, intra_message_s=1e-6, inter_message_s=5e-6,
                     copy_byte_s=1e-11, host_link_shared=shared)
    w = hosts * per_host
    uniform = tl.A2AShape(hosts, per_host, pair)
    matrix = tl.A2AShape(hosts, per_host, [[pair] * w for _ in range(w)])
    assert uniform.uniform and not matrix.uniform
    a, b = tl.price(uniform, p, scheme), tl.price(matrix, p, scheme)
    assert attrs.evolve(a, parts={}) == pytest.approx(attrs.evolve(b, parts={})) or (
        a.seconds == pytest.approx(b.seconds, rel=1e-12)
        and (a.intra_bytes, a.inter_bytes, a.copy_bytes) == pytest.approx((b.intra_bytes, b.inter_bytes, b.copy_bytes)))


def test_the_plan_note_at_thousands_of_ranks_never_builds_the_matrix(monkeypatch):
    def no_matrix(self):
        raise AssertionError("a uniform shape is priced in closed form, not on its W x W matrix")

    monkeypatch.setattr(tl.A2AShape, "matrix", no_matrix)
    note = tl.plan_note(512, 8, 5e7, PRESETS["h100"])
    assert note is not None and "512 hosts x 8 ranks" in note
