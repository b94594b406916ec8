"""Checkpointing of any pytree plus a small JSON dict with orbax, and a clean-exit signal guard.

Knows nothing of the model or the trainer. Saves are atomic: orbax writes each step into a
`<step>.orbax-checkpoint-tmp-*` directory and renames it only once complete, so a crash
mid-save leaves the previous checkpoint as the latest.
"""

import os
import signal
import threading
from collections.abc import Mapping
from typing import Any, Self

import orbax.checkpoint as ocp


class Checkpointer:
    """Saves `(pytree, extra)` every `save_every` steps into `directory`, keeping the last `max_to_keep`."""

    def __init__(
        self,
        directory: str,
        *,
        max_to_keep: int | None = 3,
        save_every: int = 1,
        async_save: bool = True,
    ):
        if save_every < 1:
            raise ValueError(f"checkpoint save_every must be >= 1, got {save_every}")
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"checkpoint max_to_keep must be >= 1 or None, got {max_to_keep}")
        self.directory = str(directory)
        self.save_every = save_every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_every,
            create=True,
            enable_async_checkpointing=async_save,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` would write (the interval is met and the step is new)."""
        return step % self.save_every == 0 and step not in self.all_steps()

    def save(
        self, step: int, pytree: Any, extra: Mapping[str, Any] | None = None, *, force: bool = False
    ) -> bool:
        """Save at `step` if due (or `force`, e.g. on preemption); returns whether it saved.

        `extra` must be JSON-able (data position, numpy rng state, config); arrays in `pytree`
        are copied to host before this returns, so the caller may donate them afterwards.
        """
        if step in self.all_steps():
            return False
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(pytree), extra=ocp.args.JsonSave(dict(extra or {}))
        )
        return self._manager.save(step, args=args, force=force)

    def restore(self, step: int | None = None, target: Any = None) -> tuple[Any, dict]:
        """(pytree, extra) of `step` (default: the latest), placed like `target`.

        `target` is a pytree of `jax.ShapeDtypeStruct` (with shardings) or of arrays with the
        structure that was saved; leaves are restored with its dtypes and shardings. Without
        it the saved shardings are reused, which needs the same device topology.
        """
        self.wait()
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no checkpoint to restore in {self.directory}")
            step = steps[-1]
        elif step not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}: {steps}")
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(target), extra=ocp.args.JsonRestore()
        )
        restored = self._manager.restore(step, args=args)
        return restored.state, dict(restored.extra or {})

    def saved_tree(self, step: int | None = None) -> Any:
        """The pytree saved at `step` (default: the latest) as ShapeDtypeStructs; reads no data."""
        import jax  # late: this module knows nothing of jax otherwise

        step = self.latest_step() if step is None else step
        # The manager only knows an item's handler once it saved or restored it in this process.
        with ocp.StandardCheckpointer() as reader:
            meta = reader.metadata(os.path.join(self.directory, str(step), "state"))
        tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
        return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of all complete checkpoints, ascending."""
        return sorted(self._manager.all_steps())

    def wait(self) -> None:
        """Block until any asynchronous save has been committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release resources."""
        self._manager.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PreemptionGuard:
    """Within the `with` block SIGTERM/SIGINT set `requested` instead of killing the process.

    The loop checks `guard.requested` after each step, saves and exits cleanly. A second
    SIGINT raises KeyboardInterrupt, so Ctrl-C twice still stops a stuck run. Handlers can only
    be installed from the main thread; elsewhere the guard is inert. On multi-host runs the
    flag is per host: combine it across hosts before acting on it.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = tuple(signals)
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


def load_params(workdir: str):
    """The policy params of the latest checkpoint in a trainer `workdir` (host numpy arrays)."""
    with Checkpointer(os.path.join(workdir, "checkpoints")) as ckpt:
        state, _ = ckpt.restore()
    return state["params"]
