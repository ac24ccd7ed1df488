"""``outside``: ranks whose lines wait for someone they cannot name wait for the ranks that printed no such
line — and for ranks known to exist that printed nothing at all (a node lost at once). Pure rule tests over
facts, and the world-size lines that make a rank known without a line of its own."""

from __future__ import annotations

from rankwatch.watchdog.core.facts import OWN_TIMEOUT, PEER_GONE, FactSet, Rung, Waits
from rankwatch.watchdog.core.rules.waits import rule_outside
from rankwatch.watchdog.diagnose.facts import Evidence, collect
from rankwatch.watchdog.diagnose.log_facts import unseen_ranks
from rankwatch.watchdog.diagnose.parser import SourceParser


def _facts(seen: tuple[int, ...], waiting: set[int], unseen: tuple[int, ...] = (), source: str = PEER_GONE) -> FactSet:
    f = FactSet(ranks=seen, unseen=unseen)
    f.waits = [Waits(r, None, "", None, None, Rung.WAITING, source) for r in sorted(waiting)]
    return f


def test_a_node_lost_at_once_names_nobody() -> None:
    # 4 nodes x 2: node 2 (ranks 4, 5) SIGKILLed; rank 7 torn down before printing; the rest lost a peer
    found = rule_outside(_facts((0, 1, 2, 3, 6, 7), {0, 1, 2, 3, 6}, unseen=(4, 5)))
    assert found is not None and found.ranks == []
    assert found.data["decided"] is False and found.confidence == "low"
    assert (found.data["silent"], found.data["unseen"]) == ([4, 5, 7], [4, 5])


def test_without_the_world_the_lone_survivor_is_named() -> None:
    # the same log read without the unseen ranks: what the fix guards against (the one silent rank seen)
    found = rule_outside(_facts((0, 1, 2, 3, 6, 7), {0, 1, 2, 3, 6}))
    assert found is not None and found.ranks == [7]


def test_unseen_ranks_alone_name_nobody() -> None:
    # every rank that printed waits and one known rank left no line: an excerpt that shows only some ranks
    # (a public issue's paste) is no evidence against the rank left out; the later rules decide, as before
    assert rule_outside(_facts((1, 2), {1, 2}, unseen=(0,), source=OWN_TIMEOUT)) is None
    assert rule_outside(_facts((1, 2), {1, 2}, source=OWN_TIMEOUT)) is None


def test_one_silent_seen_rank_is_named_as_before() -> None:
    found = rule_outside(_facts((0, 1, 2, 3), {0, 2, 3}, source=OWN_TIMEOUT))
    assert found is not None and (found.ranks, found.kind, found.data["unseen"]) == ([1], "hang", [])


def _evidence(lines: list[str]) -> Evidence:
    p = SourceParser("t.log", None)
    events = [e for i, line in enumerate(lines, 1) for e in p.feed(i, line)]
    return collect(events)


def test_unseen_ranks_come_from_world_size_lines_and_the_highest_rank() -> None:
    timeout = ("[rank{}]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
               "peer [10.0.0.2]:1234")
    assert unseen_ranks(_evidence([timeout.format(0), timeout.format(3)])) == (1, 2)
    stated = [timeout.format(0), "[rank0]: NCCL INFO comm 0x55d1 rank 0 nranks 6 cudaDev 0 busId 1000 - Init COMPLETE"]
    assert unseen_ranks(_evidence(stated)) == (1, 2, 3, 4, 5)
    assert unseen_ranks(_evidence([timeout.format(0), "WORLD_SIZE=4"])) == (1, 2, 3)
    # torchrun's rendezvous line: group_world_size counts nodes, global_world_sizes ranks
    rdzv = ("INFO:torch.distributed.elastic.agent.server.api:[default] Rendezvous complete for workers. Result: "
            "restart_count=0 master_addr=n0 master_port=29500 group_rank=0 group_world_size=2 local_ranks=[0, 1] "
            "role_ranks=[0, 1] global_ranks=[0, 1] role_world_sizes=[4, 4] global_world_sizes=[4, 4]")
    assert unseen_ranks(_evidence([timeout.format(0), rdzv])) == (1, 2, 3)
    assert unseen_ranks(_evidence([timeout.format(0), "group_world_size=9 local_world_size=9"])) == ()
