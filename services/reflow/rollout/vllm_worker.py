"""What ReFlow adds to each vLLM worker: named methods that vLLM mixes into its
worker class (`worker_extension_cls`), so the engine calls them by name with
plain arguments (`collective_rpc("reflow_receive_weights")`). Nothing is
pickled across the engine's process boundary, and vLLM's insecure
serialization stays off.

The work itself is in reflow.weightsync (the weight-sync group, the reload,
the KV cache's pages); this class only gives it names on the worker.
"""

from __future__ import annotations

from reflow import adapter_sync, weightsync

# What AsyncEngineArgs(worker_extension_cls=...) names: this module's class.
EXTENSION = f"{__name__}.ReflowWorkerExtension"


class ReflowWorkerExtension:
    """Mixed into vLLM's worker: `self` is the worker (its model_runner, its device)."""

    def reflow_init_weight_sync(self, master_address: str, master_port: int, first_rank: int,
                                world_size: int, backend: str, specs: list, bucket_bytes: int,
                                tensor_parallel_size: int = 1,
                                trainer_device_uuid: str = "",
                                rendezvous_key: str = "", lora: dict | None = None) -> bool:
        return weightsync.worker_init_weight_sync(
            self, master_address, master_port, first_rank, world_size, backend, specs,
            bucket_bytes, tensor_parallel_size, trainer_device_uuid, rendezvous_key, lora)

    def reflow_init_adapter(self, rank: int) -> bool:
        return adapter_sync.worker_init_adapter(self, rank)

    def reflow_receive_weights(self) -> float:
        return weightsync.worker_receive_weights(self)

    def reflow_release_kv_cache(self) -> dict[str, int]:
        return weightsync.worker_release_kv_cache(self)
