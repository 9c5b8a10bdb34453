"""What the Kubernetes backend asks of a worker pod's own services over gRPC:
whether it serves a job, and stopping a job on it. Kept apart from the
Kubernetes API calls (scheduler/cluster/kube.py)."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

# A worker in any of these states serves a job: an elastic job's engine standing by
# and trainer replica (loaded, joining or in the group) count as busy too.
BUSY_STATES = ("starting", "running", "standby", "joining", "training")


def is_busy(trainer_state: str, rollout_state: str) -> bool:
    return trainer_state in BUSY_STATES or rollout_state in BUSY_STATES


def worker_status(address: str, timeout_s: float) -> tuple[str, str, str]:
    """(trainer state, rollout state, trainer job) of the worker at `address`."""
    from reflow.rollout.client import GrpcRolloutClient
    from reflow.trainer.client import GrpcTrainerClient

    trainer = GrpcTrainerClient(address, deadline_s=timeout_s)
    rollout = GrpcRolloutClient(address, deadline_s=timeout_s)
    try:
        status = trainer.status("")
        return status.state, rollout.stats("").state, status.job_id
    finally:
        trainer.close()
        rollout.close()


def stop_on_worker(address: str, job_id: str, rpc_timeout_s: float,
                   stop_timeout_s: float) -> None:
    """Stop `job_id` on both services of a worker; a service not running it is fine."""
    import grpc

    from reflow.rollout.client import GrpcRolloutClient
    from reflow.trainer.client import GrpcTrainerClient

    for client_cls in (GrpcTrainerClient, GrpcRolloutClient):
        client = client_cls(address, deadline_s=rpc_timeout_s)
        try:
            client.stop_job(job_id, deadline_s=stop_timeout_s)
        except grpc.RpcError as err:
            if err.code() not in (grpc.StatusCode.NOT_FOUND,
                                  grpc.StatusCode.FAILED_PRECONDITION):
                raise
        finally:
            client.close()


def stop_and_wait_idle(name: str, address: str, job_id: str, rpc_timeout_s: float,
                       stop_timeout_s: float) -> bool:
    """Stop the job on the worker and wait up to `stop_timeout_s` for it to report
    idle; False if it did not (it is checked again before any other job gets it)."""
    deadline = time.monotonic() + stop_timeout_s
    try:
        stop_on_worker(address, job_id, rpc_timeout_s, stop_timeout_s)
        while time.monotonic() < deadline:
            if not is_busy(*worker_status(address, rpc_timeout_s)[:2]):
                return True
            time.sleep(0.5)
    except Exception as err:  # noqa: BLE001 - an unreachable worker is checked at placement
        logger.warning("worker %s: could not stop job %s: %s", name, job_id, err)
    return False


def job_states(address: str, job_id: str, timeout_s: float) -> tuple[str, str]:
    """(trainer state, rollout state) of `job_id` on the worker at `address`; a
    service that does not answer for that job (another job's, or unreachable after
    its client's retries) gives "": the caller takes the job as not running there."""
    from reflow.rollout.client import GrpcRolloutClient
    from reflow.trainer.client import GrpcTrainerClient

    trainer = GrpcTrainerClient(address, deadline_s=timeout_s)
    rollout = GrpcRolloutClient(address, deadline_s=timeout_s)
    states = []
    try:
        for call in (lambda: trainer.status(job_id).state, lambda: rollout.stats(job_id).state):
            try:
                states.append(call())
            except Exception as err:  # noqa: BLE001 - not answering for the job
                logger.info("worker %s: job %s: %s", address, job_id, err)
                states.append("")
        return states[0], states[1]
    finally:
        trainer.close()
        rollout.close()
