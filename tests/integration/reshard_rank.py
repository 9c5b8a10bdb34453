"""One process of an FSDP group that changes membership by moving shards
(trainer/reshard.py), as its own process: 2 ranks train, a third joins
(2 -> 3), then the second leaves (3 -> 2), two steps at each membership on
the same batches as a single unsharded trainer, which process 0 also runs.

    python -m tests.integration.reshard_rank MODEL OUT PORTS ME [hsdp]

PORTS: six ports, comma-separated: each phase's union group and new group.
With `hsdp`, four processes form 2 replicas x 2 shards, and after two steps
processes 2 and 3 leave without a word (a lost replica): the other two go on
as one replica from the shards they hold.
"""

import argparse
import json
import sys
import types

import torch

# Union ranks per phase: (old ranks, new ranks, shards per replica: 0 for fsdp);
# -1 where a process is not a member.
PHASES = [([-1, -1], [0, 1], 0),             # the first membership: 0 and 1
          ([0, 1, -1], [0, 1, 2], 0),        # process 2 joins
          ([0, 1, 2], [0, -1, 1], 0)]        # process 1 leaves
# trainer.parallelism hsdp: 2 replicas x 2 shards, then replica 1 (processes 2 and
# 3) is gone and the survivors form 1 x 2 with the shards they hold.
HSDP_PHASES = [([-1, -1, -1, -1], [0, 1, 2, 3], 2),
               ([0, 1], [0, 1], 2)]
STEPS_PER_PHASE = 2
# The union groups' key, shared by the processes as JoinGroup hands it out; each
# new group's key travels in the plan, drawn by process 0 as the leader does.
UNION_KEY = "c3" * 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("ports", type=lambda v: [int(p) for p in v.split(",")])
    ap.add_argument("me", type=int)
    ap.add_argument("scenario", nargs="?", default="fsdp", choices=["fsdp", "hsdp"])
    args = ap.parse_args()
    phases = HSDP_PHASES if args.scenario == "hsdp" else PHASES

    from transformers import AutoModelForCausalLM

    from reflow.core.config import parse_job_spec
    from reflow.trainer import fsdp, reshard
    from reflow.trainer.dp import TrainerGroup
    from reflow.trainer.step import compute_step
    from reflow.weightsync import new_rendezvous_key
    from tests.unit.test_micro_batches import _trajectories

    torch.manual_seed(0)
    spec = parse_job_spec({"model": {"path": args.model, "dtype": "float32"},
                           "trainer": {"max_grad_norm": 1e6, "max_tokens_per_micro_batch": 64,
                                       "logprob_chunk_tokens": 16},
                           "replay": {"replay_weight": 0.5}})
    cpu = torch.device("cpu")

    def fresh():
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                    local_files_only=True)

    def optimizer_of(params):
        return torch.optim.AdamW(params, lr=spec.trainer.learning_rate,
                                 weight_decay=spec.trainer.weight_decay)

    loop = types.SimpleNamespace(model=fresh(), root=None, optimizer=None, group=None,
                                 device=cpu, spec=spec, _new_optimizer=optimizer_of,
                                 group_timeout_s=120.0)
    vocab = loop.model.config.vocab_size
    batches = [_trajectories(13, vocab) for _ in range(len(phases) * STEPS_PER_PHASE)]
    single = fresh() if args.me == 0 else None
    single_opt = optimizer_of(single.parameters()) if single is not None else None
    report = {"me": args.me, "received": [], "full_state_bytes":
              reshard.state_bytes(loop.model)}
    done = 0
    for phase, (old_ranks, new_ranks, shards) in enumerate(phases):
        if args.me >= len(new_ranks):
            report["received"].append(None)
            if args.scenario == "hsdp":  # the lost replica: gone, its shards with it
                with open(args.out, "w") as f:
                    json.dump(report, f)
                return
            continue
        union = TrainerGroup.build("127.0.0.1", args.ports[2 * phase], args.me,
                                   len(new_ranks), phase + 1, cpu, 120.0,
                                   rendezvous_key=UNION_KEY)
        if args.me == 0:
            source = loop.root if loop.root is not None else loop.model
            plan = reshard.ReshardPlan(
                epoch=phase + 1, port=args.ports[2 * phase + 1], old_ranks=old_ranks,
                new_ranks=new_ranks, layout=reshard.layout_of(source)[2],
                steps=reshard.optimizer_steps(loop.root, loop.optimizer)
                if loop.root is not None else [], initial=phase == 0,
                rendezvous_key=new_rendezvous_key(), old_shards=shards if phase else 0,
                new_shards=shards)
            union._broadcast_bytes(plan.encode())
        else:
            plan = reshard.ReshardPlan.decode(union._broadcast_bytes(None))
        group, received = reshard.apply_plan(loop, plan, args.me, union, "127.0.0.1")
        union.close()
        report["received"].append(received)
        for _ in range(STEPS_PER_PHASE):
            trajectories = batches[done]
            done += 1
            if single is not None:
                compute_step(single, single_opt, spec, trajectories, 0, cpu)
            if group is not None:
                compute_step(loop.root, loop.optimizer, spec, trajectories, 0, cpu, group=group)
    from torch.distributed.tensor import DTensor

    if loop.root is not None:
        _, optim_state = fsdp.policy_state(loop.root, loop.optimizer)
        whole = {n: p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
                 for n, p in fsdp.policy_parameters(loop.root)}
        moments = {n: s["exp_avg"].full_tensor() for n, s in optim_state["state"].items()}
        if single is not None:
            reference = dict(single.named_parameters())
            single_moments = {n: single_opt.state[p]["exp_avg"] for n, p in reference.items()}
            report["max_abs_diff"] = max(float((t - reference[n].detach()).abs().max())
                                         for n, t in whole.items())
            report["max_exp_avg_diff"] = max(
                float((t - single_moments[n]).abs().max())
                for n, t in moments.items())
            report["steps"] = sorted({float(s["step"]) for s in optim_state["state"].values()})
        loop.group.close()
    with open(args.out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    sys.exit(main())
