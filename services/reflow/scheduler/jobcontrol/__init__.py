"""Job control: the scheduler service's core (`service.Scheduler`), the job
store, the per-job controller that turns a dead service into a restart, a
shrink or a failure, the FIFO placement queue, and recovery after a takeover.
It drives the three packages beside it; none of them imports it."""
