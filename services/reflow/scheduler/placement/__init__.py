"""Rollout/trainer placement (paper §6.2): Algorithm 1's planner, the feed that
gives it measured windows, and the elastic pool that carries out its flips
through a backend-neutral interface. Knows nothing of clusters."""
