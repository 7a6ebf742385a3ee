"""The benchmark's two-level all-to-alls return exactly what ``all_to_all_single`` returns: 4 gloo ranks
emulating 2 hosts of 2 ranks (no testbed), sizes from one element to a few thousand per pair."""

import pytest
import torch
import torch.distributed as dist

from launcher import run_ranks

from benchmarks import two_level as bench


def _exact(rank: int, world: int, local: int) -> list:
    g = bench.Groups(world, local)
    out = []
    for n in (1, 3, 1024):
        x = bench.send_buffer(rank, world, n)
        want = torch.empty_like(x)
        dist.all_to_all_single(want, x)
        for name, fn in bench.RUN.items():
            out.append((name, n, bool(torch.equal(fn(x.clone(), g), want))))
        bench.check(g, n)
    # the send buffer's blocks are distinct, so an exchange that misroutes a block cannot pass
    got = bench.rail(bench.send_buffer(rank, world, 2), g).view(world, 2)
    out.append(("rail_from_each_sender", 2, all(int(got[s, 0].item()) == 4096 * (s * world + rank)
                                                for s in range(world))))
    return out


def test_two_level_schemes_equal_all_to_all_single_on_2_hosts_of_2_ranks():
    results = run_ranks(_exact, 4, 2, timeout_s=120)
    for rank, rows in enumerate(results):
        bad = [r for r in rows if not r[2]]
        assert not bad, f"rank {rank}: {bad}"
        assert {r[0] for r in rows} == {"flat", "rail", "leader", "rail_from_each_sender"}


def test_groups_refuse_a_world_that_does_not_split_into_hosts():
    with pytest.raises(ValueError, match="do not split into hosts of 3 ranks"):
        bench.Groups(4, 3)


def test_the_options_name_a_bad_size():
    with pytest.raises(SystemExit):
        bench.parse(["--sizes", "6"])
    assert bench.parse(["--sizes", "4096,8"]).sizes == [4096, 8]
