"""The AsyncHybrid worker (paper §5): a rollout engine and a trainer replica,
both warm, in one process; its role says which of them works for the job."""
