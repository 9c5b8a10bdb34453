"""One rank of a 2 x 1 hsdp group (fsdp.ShardedGroup, gloo) on the tiny model in
which rank 0 gives a step up while alive and rank 1 runs it: rank 1 waits in
the all-reduce across replicas for a rank whose sockets stay open.

    python -m tests.integration.mesh_timeout_rank MODEL OUT PORT ME

Rank 1 writes what ended its step to OUT: the group's timeout is 600 s and
trainer.collective_timeout_s 5, so a step that ends at all within the test's
bound ended at the mesh's timeout.
"""

import argparse
import json
import time

import torch

GROUP_KEY = "d4" * 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("port", type=int)
    ap.add_argument("me", type=int)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from reflow.trainer import fsdp

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    cpu = torch.device("cpu")
    group = fsdp.ShardedGroup.build("127.0.0.1", args.port, args.me, 2, cpu, 600.0,
                                    rendezvous_key=GROUP_KEY, shards=1,
                                    collective_timeout_s=5.0)
    root = fsdp.shard_policy(model, group.mesh, cpu)
    ids, mask = torch.arange(8).reshape(1, 8), torch.ones(1, 8, dtype=torch.long)

    def step() -> None:
        out = root(ids, mask)
        (out[0] if isinstance(out, tuple) else out).sum().backward()

    step()  # one step together
    group.max_int(1)
    if args.me == 0:
        time.sleep(600)  # gave the next step up, and lives on; the test kills it
        return
    started = time.monotonic()
    try:
        step()
        outcome = {"ended": "completed"}
    except RuntimeError as err:
        outcome = {"ended": "failed", "collective_failed": fsdp.collective_failed(err),
                   "error": str(err)[:300]}
    outcome["waited_s"] = round(time.monotonic() - started, 2)
    fsdp.reshard_units(root)
    with open(args.out, "w") as f:
        json.dump(outcome, f)


if __name__ == "__main__":
    main()
