"""A Kubernetes API emulator (kmock) on a loopback port, in its own thread,
for the official kubernetes client to talk real HTTP to. It stores objects and
merges patches; it ignores label selectors and resourceVersion preconditions,
and runs no controllers: tests against it check our API calls, not a cluster."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager


@contextmanager
def kube_emulator():
    import kmock
    from kubernetes import client

    ready, box = threading.Event(), {}
    loop = asyncio.new_event_loop()

    async def main():
        async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
            box["url"], box["emulator"] = str(server.url).rstrip("/"), emulator
            box["stop"] = asyncio.Event()
            ready.set()
            await box["stop"].wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(30), "kube emulator did not start"
    config = client.Configuration()
    config.host = box["url"]
    api_client = client.ApiClient(config)
    try:
        yield api_client, box["emulator"]
    finally:
        api_client.close()
        loop.call_soon_threadsafe(box["stop"].set)
        thread.join(10)


def worker_pod(name: str, ip: str = "127.0.0.1", ready: bool = True,
               labels: dict[str, str] | None = None, restarts: int = 0) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "resourceVersion": "1",
                     "labels": labels if labels is not None else
                     {"app.kubernetes.io/instance": "rl", "app.kubernetes.io/component": "worker"}},
        "spec": {"containers": [{"name": "worker", "image": "reflow"}]},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                   "containerStatuses": [{"name": "worker", "ready": ready, "restartCount": restarts,
                                          "image": "reflow", "imageID": "", "state": {}}]},
    }
