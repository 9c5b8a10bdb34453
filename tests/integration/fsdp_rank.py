"""One rank of an FSDP trainer group, as its own process (FSDP2 needs the
process's default torch.distributed group): trains a few steps on the same
batches as a single unsharded trainer and writes what the test compares.

    python -m tests.integration.fsdp_rank MODEL OUT PORT RANK WORLD [--resume DIR] [--lora]

With --lora both trainers train rank-4 adapters (trainer/lora.py) on the frozen model.
"""

import argparse
import json
import sys

import torch

# Every rank's processes share it as a job's ranks share the leader's (an RPC away).
RENDEZVOUS_KEY = "f5" * 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("port", type=int)
    ap.add_argument("rank", type=int)
    ap.add_argument("world", type=int)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--save", default="")
    ap.add_argument("--resume", default="")
    ap.add_argument("--lora", action="store_true")
    args = ap.parse_args()

    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from reflow.core.config import parse_job_spec
    from reflow.trainer import fsdp
    from reflow.trainer.step import compute_step
    from tests.unit.test_micro_batches import _trajectories

    torch.manual_seed(0)
    spec = parse_job_spec({"model": {"path": args.model},
                           "trainer": {"max_grad_norm": 1e6, "max_tokens_per_micro_batch": 64,
                                       "logprob_chunk_tokens": 16},
                           "replay": {"replay_weight": 0.5},
                           **({"lora": {"rank": 4, "alpha": 8}} if args.lora else {})})
    cpu = torch.device("cpu")

    def fresh():
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                     local_files_only=True)
        if spec.lora is not None:
            from reflow.trainer.lora import apply_lora

            torch.manual_seed(1)  # the same adapter initialisation in both trainers
            apply_lora(model, spec.lora)
            # B = 0 would leave A's gradient 0 on the first step: start both away from it.
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if ".lora_B." in name:
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2))
                                * 0.01)
        return model

    def optimizer_of(params):
        return torch.optim.AdamW([p for p in params if p.requires_grad],
                                 lr=spec.trainer.learning_rate,
                                 weight_decay=spec.trainer.weight_decay)

    vocab = fresh().config.vocab_size
    batches = [_trajectories(13, vocab) for _ in range(args.steps)]  # 13: uneven over ranks

    group = fsdp.ShardedGroup.build("127.0.0.1", args.port, args.rank, args.world, cpu, 120.0,
                                    rendezvous_key=RENDEZVOUS_KEY)
    root = fsdp.shard_policy(fresh(), group.mesh, cpu)
    opt = optimizer_of(root.parameters())
    report = {"rank": args.rank}
    single = fresh()
    single_opt = optimizer_of(single.parameters())
    if args.resume:
        model_state, optim_state = fsdp.policy_state(root, opt)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=args.resume)
        fsdp.load_policy_state(root, opt, state["model"], state["optimizer"])
        report["loaded"] = _whole_state(root, opt)
        # The unsharded trainer goes on from the same checkpoint, for the comparison.
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(single, single_opt)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=args.resume, no_dist=True)
        set_state_dict(single, single_opt, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
    for trajectories in batches:
        # The weight-sync check's probe between steps (trainer/sync_check.py), as the
        # trainer scores it after each publish: it must leave the steps unchanged.
        from reflow.trainer.sync_check import trainer_probe_logprobs

        probes = [trainer_probe_logprobs(m, list(range(1, 17)), cpu, 16)
                  for m in (single, root)]
        report["probe_max_abs_diff"] = max(report.get("probe_max_abs_diff", 0.0),
                                           max(abs(a - b) for a, b in zip(*probes)))
        compute_step(single, single_opt, spec, trajectories, 0, cpu)
        compute_step(root, opt, spec, trajectories, 0, cpu, group=group)
    # After a last probe the root holds its shards again: FSDP2 registers the gathered
    # parameters on a module while they are gathered, and an optimizer (and the
    # reshard's step counts) keys its state by the sharded ones.
    from torch.distributed.tensor import DTensor

    trainer_probe_logprobs(root, list(range(1, 17)), cpu, 16)
    report["probe_leaves_shards"] = all(isinstance(p, DTensor)
                                        for _, p in fsdp.policy_parameters(root))
    # Under the names a sync sends (PEFT's for adapters: fsdp.policy_parameters).
    from reflow.trainer.lora import synced_parameters

    reference = dict(synced_parameters(single))
    # Per-rank bytes of parameters and AdamW state held (local shards).
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    held = sum(local(p).numel() * local(p).element_size() for p in root.parameters())
    held += sum(local(v).numel() * local(v).element_size() for s in opt.state.values()
                for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    report["held_bytes"] = held
    diffs, peak_bucket, params = {}, 0, {}
    bucket_bytes = 64 * 1024
    for bucket in fsdp.gathered_buckets(root, bucket_bytes):
        peak_bucket = max(peak_bucket, sum(t.numel() * t.element_size() for _, t in bucket))
        for name, t in bucket:
            params[name] = t.clone()
            diffs[name] = float((t - reference[name].detach()).abs().max())
    report.update(max_abs_diff=max(diffs.values()) if diffs else None,
                  peak_bucket_bytes=peak_bucket, bucket_bytes=bucket_bytes,
                  largest_param_bytes=max(t.numel() * t.element_size()
                                          for t in params.values()))
    if not args.resume:
        report.update(_sync_to_an_engine(root, params, group.rank, bucket_bytes))
    if args.save:
        model_state, optim_state = fsdp.policy_state(root, opt)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=args.save)
    # What was saved after training, or what the resumed group loaded (a collective).
    whole = report.pop("loaded", None) or _whole_state(root, opt)
    if args.rank == 0:
        torch.save(whole, f"{args.out}.pt")
    with open(args.out, "w") as f:
        json.dump(report, f)
    group.close()


def _whole_state(root, opt) -> dict:
    """The parameters and AdamW's first moments, gathered whole, under the model's
    names (every rank must call it)."""
    from torch.distributed.tensor import DTensor

    from reflow.trainer import fsdp

    def whole(t):
        return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()

    params = {n: whole(p) for n, p in fsdp.policy_parameters(root)}
    _, optim_state = fsdp.policy_state(root, opt)
    return {"params": params,
            "exp_avg": {n: whole(s["exp_avg"]) for n, s in optim_state["state"].items()}}


class LiveBytes:
    """Bytes of tensors created inside the block and still alive, and their peak:
    a CPU stand-in for torch.cuda.max_memory_allocated, counted per storage."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self
        self.live = self.peak = 0
        self._storages: dict[int, int] = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        tracker._track(t)
                return out

        self.mode = Mode()

    def _track(self, t: torch.Tensor) -> None:
        import weakref

        try:
            storage = t.untyped_storage()
            key = storage.data_ptr()
        except RuntimeError:  # a tensor without storage of its own (a wrapper subclass)
            return
        if not storage.nbytes() or key in self._storages:
            return
        self._storages[key] = storage.nbytes()
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._storages.pop(key, 0)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _sync_to_an_engine(root, params, rank, bucket_bytes) -> dict:
    """Rank 0 broadcasts the gathered weights to one receiver (an engine's side of
    weight sync, on a thread here); returns whether it got the trained weights
    and the extra bytes alive at once during the send."""
    import threading

    from reflow.procs import free_port
    from reflow.trainer import fsdp
    from reflow.weightsync import make_group, new_rendezvous_key, receive_weights, specs_of

    specs = specs_of(fsdp.policy_parameters(root))
    received = {}
    sync = receiver = None
    if rank == 0:
        port, key = free_port(), new_rendezvous_key()

        def engine():
            group = make_group("127.0.0.1", port, 1, 2, "gloo", 60.0, rendezvous_key=key)
            for name, t in receive_weights(group, specs, bucket_bytes, torch.device("cpu")):
                received[name] = t.clone()

        receiver = threading.Thread(target=engine)
        receiver.start()
        sync = make_group("127.0.0.1", port, 0, 2, "gloo", 60.0, rendezvous_key=key)
    with LiveBytes() as live:
        fsdp.send_sharded_weights(root, sync, bucket_bytes)
    out = {"sync_peak_extra_bytes": live.peak}
    if receiver is not None:
        receiver.join()
        out["engine_has_trained_weights"] = (received.keys() == params.keys() and all(
            torch.equal(received[n], params[n]) for n in params))
    return out


if __name__ == "__main__":
    sys.exit(main())
