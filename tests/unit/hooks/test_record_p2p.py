"""The peers of a rank's sends and recvs in its record (issue 44 item 5, pp-wrong-peer): the peer and direction of
the send/recv it is in, and the peers it completed one with before — on each tracker core (``hook_impl``), through
instrument.py's wrappers as a script calls ``torch.distributed.send``/``recv``/``batch_isend_irecv``."""

from __future__ import annotations

import importlib
import threading
import warnings
from typing import Any

import pytest
from conftest import new_tracker
from rankwatch.hooks.record import P2P_SLOTS, P2P_UNKNOWN, decode

instrument = importlib.import_module("rankwatch.hooks.instrument")


def snap(t: Any) -> Any:
    return decode(bytes(t._writer.map))


def wrapped(t: Any, op: str, seen: list[Any], fail: bool = False) -> Any:
    """``op`` (send/recv) wrapped as the hook wraps torch's, around a body that reads the record from inside."""

    def body(tensor: Any, peer: Any = None, group: Any = None, tag: int = 0, **kw: Any) -> int:
        seen.append(snap(t))
        if fail:
            raise RuntimeError("Connection closed by peer")
        return 0

    return instrument._wrap_collective(body, t, op)


def test_a_send_or_recv_records_its_peer_while_in_it_and_learns_it_once_done(tmp_path, hook_impl):
    t = new_tracker(tmp_path / "r.hb", rank=2, world_size=4)
    seen: list[Any] = []
    send, recv = wrapped(t, "send", seen), wrapped(t, "recv", seen)
    assert (snap(t).p2p_dir, snap(t).p2p_peer, snap(t).p2p_known) == (None, None, ())
    recv(None, 1)  # positional src
    send(None, dst=3)  # by keyword
    recv(None, src=1)
    inside = [(s.p2p_dir, s.p2p_peer, s.in_collective, s.coll_op, s.p2p_known) for s in seen]
    # inside each: its own peer and direction; known: the peers completed *before* it (not the current one)
    assert inside == [("recv", 1, True, "recv", ()), ("send", 3, True, "send", (1,)), ("recv", 1, True, "recv", (1, 3))]
    after = snap(t)
    assert (after.p2p_dir, after.p2p_peer, after.in_collective) == ("recv", 1, False)  # the newest op, done
    assert (after.p2p_known, after.p2p_known_full) == ((1, 3), False)
    # a collective after it: the word no longer belongs to the newest collective
    coll = instrument._wrap_collective(lambda *a: seen.append(snap(t)), t, "all_reduce")
    coll()
    assert (seen[-1].coll_op, seen[-1].p2p_dir, seen[-1].p2p_peer) == ("all_reduce", None, None)
    t._release()


def test_an_unnamed_peer_a_failing_op_and_another_thread_learn_nothing(tmp_path, hook_impl):
    t = new_tracker(tmp_path / "r.hb", world_size=4)
    seen: list[Any] = []
    recv, failing = wrapped(t, "recv", seen), wrapped(t, "recv", seen, fail=True)
    recv(None)  # any source
    recv(None, group_src=1)  # a group's rank only: not a global one
    assert [(s.p2p_dir, s.p2p_peer) for s in seen] == [("recv", None), ("recv", None)]
    with pytest.raises(RuntimeError):
        failing(None, 3)
    assert (seen[-1].p2p_dir, seen[-1].p2p_peer) == ("recv", 3)  # in it: its peer
    th = threading.Thread(target=recv, args=(None, 2))  # not the training thread: not recorded
    th.start()
    th.join()
    s = snap(t)
    assert s.p2p_known == ()  # nothing completed with a named peer on the training thread
    assert not s.flags & 2  # the hook stayed enabled (FLAG_DISABLED)
    t._release()


def test_a_batch_learns_its_ops_peers_and_the_set_is_marked_full_past_its_slots(tmp_path, hook_impl):
    t = new_tracker(tmp_path / "r.hb", world_size=64)

    class Op:  # torch's P2POp: ``peer`` is the global rank (canonicalized at construction)
        def __init__(self, peer: Any) -> None:
            self.peer = peer

    got: list[Any] = []
    batch = instrument._wrap_batch(lambda ops: got.append(len(ops)) or ["work"], t)
    assert batch([Op(5), Op(6), Op(None), Op(5)]) == ["work"] and got == [4]
    s = snap(t)
    assert (s.p2p_known, s.p2p_known_full, s.coll_seq_entered, s.p2p_dir) == ((5, 6), False, 0, None)
    assert batch("not a list of ops") == ["work"]  # torch's own checks judge the argument, never the hook
    batch([Op(10 + i) for i in range(P2P_SLOTS)])
    s = snap(t)
    assert len(s.p2p_known) == P2P_SLOTS and s.p2p_known[:3] == (5, 6, 10) and s.p2p_known_full
    t._release()


def test_a_peer_past_the_words_range_is_unnamed(tmp_path, hook_impl):
    t = new_tracker(tmp_path / "r.hb")
    seen: list[Any] = []
    wrapped(t, "send", seen)(None, P2P_UNKNOWN)
    wrapped(t, "send", seen)(None, 1 << 70)
    assert [(s.p2p_dir, s.p2p_peer) for s in seen] == [("send", None), ("send", None)]
    assert snap(t).p2p_known == ()
    t._release()


def test_a_tracker_bound_to_a_record_again_keeps_its_peers(tmp_path, hook_impl):
    t = new_tracker(tmp_path / "r.hb")
    for p in (4, 7):
        t.p2p_learn(p)
    # the same mapping, a second tracker over it (a forked rank re-initialising): the known peers carry over
    t2 = type(t)(t._writer)
    t2.p2p_learn(4)
    t2.p2p_learn(9)
    assert snap(t2).p2p_known == (4, 7, 9)
    t._release()
    t2._release()


def test_the_hook_never_raises_on_odd_peer_arguments(tmp_path, hook_impl):
    t = new_tracker(tmp_path / "r.hb")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a disabled hook warns: none here
        t.p2p_enter("x", 1)
        t.p2p_learn("x")
        t.p2p_learn(-5)
        t.p2p_enter(None, 2)
    s = snap(t)
    assert s.p2p_known == () and not s.flags & 2
    t._release()


@pytest.mark.skipif("c" not in importlib.import_module("rankwatch.hooks.tracker").IMPLEMENTATIONS,
                    reason="hooks/_fastpath.c not built")
def test_the_c_send_and_recv_wrappers_write_what_the_python_ones_write(tmp_path, monkeypatch):
    from rankwatch.hooks import tracker as tracker_mod
    from test_fastpath_equivalence import pair, same

    (tc, cc), (tp, cp) = pair(tmp_path, monkeypatch, "p2p")
    for t, clock in ((tc, cc), (tp, cp)):
        tracker_mod._now = clock
        seen: list[Any] = []
        send, recv, failing = wrapped(t, "send", seen), wrapped(t, "recv", seen), wrapped(t, "recv", seen, fail=True)
        recv(None, 1)
        send(None, dst=3)
        recv(None)
        with pytest.raises(RuntimeError):
            failing(None, src=0)
        send(None, 2, None, 0)
        instrument._wrap_batch(lambda ops: None, t)([type("Op", (), {"peer": 6})()])
    fast = importlib.import_module("rankwatch.hooks._fastpath")
    assert isinstance(wrapped(tc, "send", []), fast.Phase)
    same((tc, cc), (tp, cp), "the wrapped sends and recvs")
    assert snap(tc).p2p_known == (1, 3, 2, 6)
    tc._release()
    tp._release()
