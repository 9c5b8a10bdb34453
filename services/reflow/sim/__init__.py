"""`reflow sim`: the product's control code on a virtual clock.

Rollout engines and trainers are cost models (costs.py, engine.py); everything
else is the product's own code through its in-process interfaces: the replay
buffer's Lua scripts on an embedded Redis (replay/store.py), the dispatch
budget, the job-wide dispatcher with its concurrency controller and
token-budget admission (scheduler/generation/dispatch.py, scheduler/generation/concurrency.py), and
the four modes as JobSpec presets. The dispatcher reads time through a
VirtualClock (core/clock.py) that the simulation moves from event to event.
"""
