"""Trajectories for replay-buffer tests."""

from reflow.core.types import Segment, Trajectory


def make_group(group_id: str, size: int = 4, version: int = 0) -> list[Trajectory]:
    return [
        Trajectory(f"{group_id}-{i}", group_id, [1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [1, 1, 1],
                   [Segment(version, 3)], reward=float(i), advantage=float(i) - 1.5)
        for i in range(size)
    ]
