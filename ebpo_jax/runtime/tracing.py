"""`run.profile_steps="a:b"`: a jax.profiler trace of steps a to b-1 into the run's workdir.

The trace goes to `<workdir>/plugins/profile/<time>/<host>.xplane.pb`, the layout that
TensorBoard's profile plugin and XProf read: `tensorboard --logdir <workdir>` shows it beside
the run's scalars. Steps are counted from 0 as `state.step` counts them (the step about to
run); with steps_per_jit = K the trace covers the K-step calls that hold steps a to b-1.
This module imports jax only when a trace starts (the schema's check imports it).
"""


def parse_steps(text: str) -> tuple[int, int] | None:
    """ "a:b" -> (a, b) with 0 <= a < b; "" -> None; ValueError names what is wrong."""
    if not text.strip():
        return None
    parts = text.split(":")
    try:
        a, b = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"{text!r} is not 'a:b' with integer steps a < b") from None
    if not 0 <= a < b:
        raise ValueError(f"{text!r} needs 0 <= a < b")
    return a, b


def check_steps(name: str, value: str) -> str | None:
    """The schema check of `run.profile_steps`."""
    try:
        parse_steps(value)
    except ValueError as e:
        return f"{name}={value!r}: {e}"
    return None


class StepTrace:
    """Starts the profiler before the call that runs step a, stops it after step b-1."""

    def __init__(self, steps: str, log_dir: str, *, profiler=None):
        self.window = parse_steps(steps)
        self.log_dir, self.profiler = log_dir, profiler
        self.active = False

    def before(self, step: int, k: int = 1) -> None:
        """The call about to run steps [step, step + k)."""
        if self.window is None or self.active:
            return
        a, b = self.window
        if step < b and a < step + k:
            if self.profiler is None:
                import jax.profiler

                self.profiler = jax.profiler
            self.profiler.start_trace(self.log_dir)
            self.active = True

    def after(self, step: int) -> None:
        """`step` steps are done (the next call runs step `step`)."""
        if self.active and step >= self.window[1]:
            self.stop()

    def stop(self) -> None:
        """End the trace now (the window's end, or the run stopped inside it)."""
        if self.active:
            self.active = False
            self.profiler.stop_trace()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
