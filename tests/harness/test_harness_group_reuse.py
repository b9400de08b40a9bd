"""A pooled rank hands the process groups a test created to later tests that ask
for the same ones (see [Note: Process groups reused across tests] in
harness._rank.group_cache): distinct calls stay distinct groups, a destroyed
group is created again, a failed test empties the cache, --fresh-groups
turns it off, and the ranks of a call reuse a group only if each keeps one."""

from __future__ import annotations

import textwrap

import pytest

REUSE = textwrap.dedent(
    """
    import os
    import pytest, torch
    import torch.distributed as dist
    from harness import DistributedTest

    def record(name, *groups):
        ids = ",".join(g.group_name if isinstance(g, dist.ProcessGroup) else "-" for g in groups)
        with open(os.environ["PIDS_FILE"], "a") as f:
            f.write(f"{name} {dist.get_rank()} {os.getpid()} {ids}\\n")

    def total(group):
        t = torch.ones(1, device=torch.device("cpu"))
        dist.all_reduce(t, group=group)
        return t.item()

    class TestReuse(DistributedTest):
        world_size = 3

        def test_a_first(self):
            a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
            c = dist.new_group([0, 1, 2], backend="gloo")
            record("first", a, b, c)
            assert total(c) == 3
            if dist.get_rank() < 2:
                assert a is not b and total(a) == 2 and total(b) == 2

        def test_b_again(self):
            a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
            c = dist.new_group([0, 1, 2], backend="gloo")
            record("again", a, b, c)
            assert total(c) == 3

        def test_c_destroys(self):
            c = dist.new_group([0, 1, 2], backend="gloo")
            record("destroys", c)
            assert total(c) == 3  # all ranks joined before any destroys it
            dist.destroy_process_group(c)

        def test_d_after_destroy(self):
            c = dist.new_group([0, 1, 2], backend="gloo")
            record("after_destroy", c)
            assert total(c) == 3

        def test_e_fails(self):
            c = dist.new_group([0, 1, 2], backend="gloo")
            # Every rank has joined the group before rank 0 fails: a rank that
            # fails while the others still connect tears the group down under them.
            assert total(c) == 3
            record("fails", c)
            assert False, "a failing test"

        def test_f_after_failure(self):
            c = dist.new_group([0, 1, 2], backend="gloo")
            record("after_failure", c)
            assert total(c) == 3

        def test_g_subtests(self):
            seen = []
            def body(i):
                c = dist.new_group([0, 1, 2], backend="gloo")
                seen.append(c)
                assert total(c) == 3
            self.run_subtests({"i": [0, 1, 2]}, body)
            record("subtests", *seen)
    """
)


def _names(run) -> dict[tuple[str, int], list[str]]:
    rows = [line.split() for line in (run.path / "pids.txt").read_text().splitlines()]
    return {(name, int(rank)): ids.split(",") for name, rank, _pid, ids in rows}


@pytest.mark.parametrize("groups", ["reused", "fresh"])
def test_groups_are_handed_to_later_tests(inner, groups):
    fresh = ("--fresh-groups",) if groups == "fresh" else ()
    run = inner(REUSE, "--world-size", "3", *fresh)
    run.result.assert_outcomes(passed=6, failed=1)
    names = _names(run)
    for rank in range(3):
        a1, b1, c1 = names[("first", rank)]
        a2, b2, c2 = names[("again", rank)]
        if rank < 2:
            assert a1 != b1, "two calls in one test are two groups"
        else:
            assert a1 == b1 == "-", "rank 2 is outside the group"
        (destroyed,) = names[("destroys", rank)]
        (recreated,) = names[("after_destroy", rank)]
        (failed,) = names[("fails", rank)]
        (after,) = names[("after_failure", rank)]
        sub = names[("subtests", rank)]
        if groups == "reused":
            assert (a2, b2, c2) == (a1, b1, c1), "the next test is handed the same groups"
            assert destroyed == c1
            assert recreated != destroyed, "a group the test destroyed is created again"
            assert failed == recreated
            assert after != failed, "a failed test empties the cache"
            assert len(set(sub)) == 1, "subtests are handed the same group"
        else:
            assert c2 != c1 and recreated != destroyed and after != failed
            assert len(set(sub)) == 3, "--fresh-groups: every subtest creates its own"


ASYMMETRIC = textwrap.dedent(
    """
    import datetime
    import pytest, torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from harness import DistributedTest, current_device
    from harness._rank import group_cache

    def created(ask):
        # How many groups torch created for ``ask`` on each rank: every rank of
        # the default group must create as many (NCCL splits the default
        # communicator for each, on members and non-members alike).
        original, made = c10d._new_group_with_tag, []
        def counting(*args, **kwargs):
            made.append(1)
            return original(*args, **kwargs)
        c10d._new_group_with_tag = counting
        try:
            group = ask()
        finally:
            c10d._new_group_with_tag = original
        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, len(made))
        return group, counts

    def total(group):
        t = torch.ones(1, device=current_device())
        dist.all_reduce(t, group=group)
        return t.item()

    class TestAsymmetric(DistributedTest):
        world_size = 2

        def test_a_both_ask_for_rank_0(self):
            group, counts = created(lambda: dist.new_group([0]))
            assert counts == [1, 1]
            if self.rank == 0:
                assert total(group) == 1

        def test_b_each_asks_for_itself(self):
            # upstream's mixture of experts: rank 0 held a group for its call,
            # rank 1 none for its own
            group, counts = created(lambda: dist.new_group([self.rank]))
            assert counts == [1, 1], counts
            assert total(group) == 1

        def test_c_each_again(self):
            group, counts = created(lambda: dist.new_group([self.rank]))
            assert counts == [0, 0], "both hold a group for their call"
            assert total(group) == 1

        def test_d_both_again(self):
            group, counts = created(lambda: dist.new_group([0]))
            assert counts == [0, 0], counts
            if self.rank == 0:
                assert total(group) == 1

        def test_e_members_destroy_then_ask_again(self):
            def body(i):
                group, counts = created(lambda: dist.new_group([0]))
                assert counts == ([1, 1] if i == 1 else [0, 0]), (i, counts)
                if self.rank == 0:
                    assert total(group) == 1
                    if i == 0:
                        dist.destroy_process_group(group)
            self.run_subtests({"i": [0, 1]}, body)

        def test_f_only_rank_0_asks(self):
            group_cache._PEERS_WAIT = datetime.timedelta(seconds=2)
            if self.rank == 0:
                dist.new_group([0, 1], backend="gloo")
    """
)


def test_every_rank_creates_a_group_when_any_rank_lacks_it(inner):
    """Ranks asking for different groups (upstream's mixture of experts) or a group
    destroyed on its members only: every rank calls torch when any rank holds no
    live group for its call, as NCCL needs (a rank outside the group splits the
    default communicator too); a rank whose peer never calls is told so."""
    run = inner(ASYMMETRIC, "--dist-timeout", "60")
    run.result.assert_outcomes(passed=5, failed=1)
    report = run.section("test_f_only_rank_0_asks")
    assert "rank 0 called new_group" in report
    assert "rank(s) 1 did not within 2 s" in report
    assert "mark the test fresh_pool or run with --fresh-groups" in report
