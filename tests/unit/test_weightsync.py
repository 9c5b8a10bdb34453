import threading
import time

import pytest
import torch

from reflow.procs import free_port
from reflow.weightsync import TensorSpec, make_group, plan_buckets, receive_weights, send_weights, specs_of


def test_buckets_respect_size_and_dtype():
    specs = [TensorSpec("a", (10,), "float32"), TensorSpec("b", (10,), "float32"),
             TensorSpec("c", (100,), "float32"), TensorSpec("d", (4,), "bfloat16")]
    buckets = plan_buckets(specs, bucket_bytes=80)
    assert [[s.name for s in b] for b in buckets] == [["a", "b"], ["c"], ["d"]]


def test_gloo_broadcast_round_trips_named_tensors():
    torch.manual_seed(0)
    named = [("w1", torch.randn(3, 5)), ("w2", torch.randn(7)), ("h", torch.randn(2, 2).half())]
    port = free_port()
    received = {}

    def receiver():
        group = make_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=30)
        for name, t in receive_weights(group, specs_of(named), 64, torch.device("cpu")):
            received[name] = t.clone()

    thread = threading.Thread(target=receiver)
    thread.start()
    group = make_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=30)
    sent = send_weights(group, named, bucket_bytes=64)
    thread.join(30)
    assert sent == sum(t.numel() * t.element_size() for _, t in named)
    for name, t in named:
        torch.testing.assert_close(received[name], t)


def test_a_peer_that_never_joins_the_broadcast_is_an_error_after_the_timeout():
    # The peer joins the group, then hangs (a dead or stuck engine): the sender's
    # collective fails after the group's timeout instead of waiting forever.
    port = free_port()
    joined, release = threading.Event(), threading.Event()

    def silent_peer():
        group = make_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=1)
        joined.set()
        release.wait(30)
        del group

    thread = threading.Thread(target=silent_peer)
    thread.start()
    group = make_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=1)
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
    port = free_port()
    outcome = {}

    def survivor():
        group = make_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=120)
        try:
            list(receive_weights(group, specs_of([("w", torch.ones(4))]), 64,
                                 torch.device("cpu")))
            outcome["error"] = None
        except RuntimeError as err:
            outcome["error"] = str(err)

    thread = threading.Thread(target=survivor)
    thread.start()
    group = make_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=120)
    keep = group  # a reference left elsewhere (a traceback's frame) does not hold it open
    time.sleep(0.5)
    keep.abort()
    thread.join(60)
    assert not thread.is_alive(), "the survivor is still blocked in the receive"
    assert outcome["error"] and "closed" in outcome["error"].lower()
    assert group.group is None
