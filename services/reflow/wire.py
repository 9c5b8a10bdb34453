"""Conversions between domain types and their protobuf messages.

Imports the generated `*_pb2` modules (protobuf only, no grpc) so that core
logic and clients share one mapping.
"""

from __future__ import annotations

from reflow.core.types import Segment, Trajectory
from reflow.v1 import common_pb2


def trajectory_to_proto(t: Trajectory) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(
        sample_id=t.sample_id,
        group_id=t.group_id,
        prompt_ids=t.prompt_ids,
        response_ids=t.response_ids,
        logprobs=t.logprobs,
        loss_mask=t.loss_mask,
        segments=[
            common_pb2.Segment(policy_version=s.policy_version, num_tokens=s.num_tokens)
            for s in t.segments
        ],
        reward=t.reward,
        advantage=t.advantage,
        finish_reason=t.finish_reason,
        created_at=t.created_at,
        uses=t.uses,
        reward_error=t.reward_error,
        min_tokens=t.min_tokens,
    )


def trajectory_from_proto(m: common_pb2.Trajectory) -> Trajectory:
    # Slicing a repeated field copies it to a list faster than list() does.
    return Trajectory(
        sample_id=m.sample_id,
        group_id=m.group_id,
        prompt_ids=m.prompt_ids[:],
        response_ids=m.response_ids[:],
        logprobs=m.logprobs[:],
        loss_mask=m.loss_mask[:],
        segments=[Segment(s.policy_version, s.num_tokens) for s in m.segments],
        reward=m.reward,
        advantage=m.advantage,
        finish_reason=m.finish_reason,
        created_at=m.created_at,
        uses=m.uses,
        reward_error=m.reward_error,
        min_tokens=m.min_tokens,
    )


def trajectory_to_bytes(t: Trajectory) -> bytes:
    return trajectory_to_proto(t).SerializeToString()


def trajectory_from_bytes(data: bytes) -> Trajectory:
    m = common_pb2.Trajectory()
    m.ParseFromString(data)
    return trajectory_from_proto(m)
