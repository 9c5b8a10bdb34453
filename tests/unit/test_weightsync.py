import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from reflow.procs import free_port
from reflow.weightsync import (TensorSpec, check_rendezvous_key, make_group, new_rendezvous_key,
                               plan_buckets, receive_weights, send_weights, specs_of)


def test_buckets_respect_size_and_dtype():
    specs = [TensorSpec("a", (10,), "float32"), TensorSpec("b", (10,), "float32"),
             TensorSpec("c", (100,), "float32"), TensorSpec("d", (4,), "bfloat16")]
    buckets = plan_buckets(specs, bucket_bytes=80)
    assert [[s.name for s in b] for b in buckets] == [["a", "b"], ["c"], ["d"]]


def test_gloo_broadcast_round_trips_named_tensors():
    torch.manual_seed(0)
    named = [("w1", torch.randn(3, 5)), ("w2", torch.randn(7)), ("h", torch.randn(2, 2).half())]
    port, key = free_port(), new_rendezvous_key()
    received = {}

    def receiver():
        group = make_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=30, rendezvous_key=key)
        for name, t in receive_weights(group, specs_of(named), 64, torch.device("cpu")):
            received[name] = t.clone()

    thread = threading.Thread(target=receiver)
    thread.start()
    group = make_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=30, rendezvous_key=key)
    sent = send_weights(group, named, bucket_bytes=64)
    thread.join(30)
    assert sent == sum(t.numel() * t.element_size() for _, t in named)
    for name, t in named:
        torch.testing.assert_close(received[name], t)


def test_a_peer_that_never_joins_the_broadcast_is_an_error_after_the_timeout():
    # The peer joins the group, then hangs (a dead or stuck engine): the sender's
    # collective fails after the group's timeout instead of waiting forever.
    port, key = free_port(), new_rendezvous_key()
    joined, release = threading.Event(), threading.Event()

    def silent_peer():
        group = make_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=1, rendezvous_key=key)
        joined.set()
        release.wait(30)
        del group

    thread = threading.Thread(target=silent_peer)
    thread.start()
    group = make_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=1, rendezvous_key=key)
    assert joined.wait(30)
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError):
            send_weights(group, [("w", torch.ones(4))])
        assert time.monotonic() - started < 10
    finally:
        release.set()
        thread.join(30)


def test_an_aborted_group_fails_a_peer_s_pending_receive_at_once():
    # The sender gave up on a broadcast (another engine died): a surviving peer
    # still waiting to receive must be free to join the next group now, not after
    # the group's timeout (600 s by default; 120 s here, far above what is waited).
    port, key = free_port(), new_rendezvous_key()
    outcome = {}

    def survivor():
        group = make_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=120, rendezvous_key=key)
        try:
            list(receive_weights(group, specs_of([("w", torch.ones(4))]), 64,
                                 torch.device("cpu")))
            outcome["error"] = None
        except RuntimeError as err:
            outcome["error"] = str(err)

    thread = threading.Thread(target=survivor)
    thread.start()
    group = make_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=120, rendezvous_key=key)
    keep = group  # a reference left elsewhere (a traceback's frame) does not hold it open
    time.sleep(0.5)
    keep.abort()
    thread.join(60)
    assert not thread.is_alive(), "the survivor is still blocked in the receive"
    assert outcome["error"] and "closed" in outcome["error"].lower()
    assert group.group is None


def test_rendezvous_keys_are_fresh_and_well_formed():
    keys = {new_rendezvous_key() for _ in range(100)}
    assert len(keys) == 100
    assert all(check_rendezvous_key(k) == k for k in keys)
    for bad in ("", "AB" * 16, "ab" * 15, "ab" * 17, "ab" * 15 + "a\n", "ab" * 15 + "zz", None):
        with pytest.raises(ValueError, match="rendezvous_key: must be 32 lowercase hex"):
            check_rendezvous_key(bad)
    with pytest.raises(ValueError, match="rendezvous_key"):  # before anything listens
        make_group("127.0.0.1", free_port(), 0, 2, "gloo", timeout_s=1, rendezvous_key="")


def test_a_stranger_without_the_key_cannot_join_while_the_group_forms():
    # Two strangers reach the group's store (right address, port and rank) while
    # the trainer waits for its peer: one with a key of its own, one with none
    # (the fixed prefix every group used before keys). Neither ever meets the
    # group: each one's rendezvous times out. The real peer, which joins last,
    # still forms the group with the trainer and receives the broadcast.
    port, key = free_port(), new_rendezvous_key()
    named = [("w", torch.arange(12.0).reshape(3, 4))]
    received, outcomes, groups = {}, {}, {}
    connected = threading.Event()

    def trainer():
        # Kept (store and all) until the strangers are done: they must time out on
        # a store that is up, not fail on one that went away.
        group = groups["trainer"] = make_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=60,
                                               rendezvous_key=key)
        outcomes["sent"] = send_weights(group, named, bucket_bytes=64)

    def stranger(name, join):
        started = time.monotonic()
        try:
            join()
            outcomes[name] = "joined"
        except (RuntimeError, ValueError) as err:  # gloo's rendezvous timeout
            outcomes[name] = f"refused after {time.monotonic() - started:.1f}s: {err}"

    def without_key():
        # Connects with a long timeout (the store is up), rendezvous with a short one.
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False,
                              timeout=timedelta(seconds=30))
        connected.set()
        dist.ProcessGroupGloo(dist.PrefixStore("reflow-wsync", store), 1, 2,
                              timedelta(seconds=3))

    def wrong_key():
        make_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=3,
                   rendezvous_key=new_rendezvous_key())

    def peer():
        group = groups["peer"] = make_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=60,
                                            rendezvous_key=key)
        received.update((n, t.clone()) for n, t in
                        receive_weights(group, specs_of(named), 64, torch.device("cpu")))

    leader = threading.Thread(target=trainer)
    leader.start()
    strangers = [threading.Thread(target=stranger, args=("no key", without_key))]
    strangers[0].start()
    assert connected.wait(30), "the stranger never reached the store"
    strangers.append(threading.Thread(target=stranger, args=("wrong key", wrong_key)))
    strangers[1].start()
    time.sleep(0.5)  # both strangers wait in their rendezvous before the real peer comes
    follower = threading.Thread(target=peer)
    follower.start()
    for thread in (leader, follower):
        thread.join(60)
        assert not thread.is_alive()
    # The group formed and broadcast while both strangers still waited.
    assert outcomes["sent"] == 12 * 4 and not any(name in outcomes
                                                  for name in ("no key", "wrong key"))
    torch.testing.assert_close(received["w"], named[0][1])
    for thread in strangers:
        thread.join(60)
        assert not thread.is_alive()
    for name in ("no key", "wrong key"):
        assert outcomes[name].startswith("refused"), (name, outcomes[name])
        assert "timeout" in outcomes[name].lower(), (name, outcomes[name])
    for group in groups.values():
        group.abort()


def test_a_rendezvous_timeout_does_not_print_the_key():
    # gloo's timeout names the store keys it waited for; the group's key is a
    # secret that would reach the logs and GetStatus with them.
    port, key = free_port(), new_rendezvous_key()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    with pytest.raises(RuntimeError, match="timeout") as err:
        make_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=1, rendezvous_key=key)
    assert key not in str(err.value) and "<rendezvous_key>" in str(err.value)
    del store
