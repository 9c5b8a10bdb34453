"""Generation scheduling (paper §6.1): the per-job dispatcher that streams
prompts to rollout workers, per-worker concurrency control with token-budget
admission, and the ledger of groups in flight. Knows nothing of clusters."""
