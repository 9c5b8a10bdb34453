"""A process that starts an inference engine's processes and then waits to be
killed, for test_process_teardown.py:

    python -m tests.integration.engine_parent spawn    # a child started as vLLM starts one
    python -m tests.integration.engine_parent vllm DIR # vLLM's own engine on the model in DIR

It prints `pids:` and the pids of the processes it started, once they are up,
then sleeps.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

import psutil


def engine_core(ready) -> None:
    """What vLLM's engine core does first that matters here: load vLLM's general
    plugins (vllm/v1/engine/core.py, EngineCore.__init__)."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    ready.set()
    time.sleep(600)


def main() -> None:
    from reflow.procs import ENGINE_PARENT_ENV

    if sys.argv[1] == "spawn":
        # As VllmEngine does before it starts the engine; vLLM on CPU spawns.
        os.environ[ENGINE_PARENT_ENV] = str(os.getpid())
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Event()
        ctx.Process(target=engine_core, args=(ready,), name="EngineCore").start()
        assert ready.wait(120), "the child never loaded the plugins"
    else:
        from reflow.rollout.vllm_engine import VllmEngine

        engine = VllmEngine(sys.argv[2], kv_cache_gb=1, max_model_len=128)  # noqa: F841 - kept
    children = psutil.Process().children(recursive=True)
    print("pids:", *(c.pid for c in children), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
