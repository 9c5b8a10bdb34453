"""A generation engine for worker tests: pauses, resumes and takes weights
without doing anything; subclasses say how they generate."""


class PausableEngine:
    def __init__(self) -> None:
        self.paused = False

    async def pause(self) -> None:
        self.paused = True

    async def resume(self) -> None:
        self.paused = False

    async def receive_weights(self) -> float:
        return 0.0

    def shutdown(self) -> None:
        pass
