"""Commands printed for a person to paste, spelled so that a fresh shell runs them.

`python experiments/plot_run.py` fails in a new terminal when the packages live in the
repo's `.venv` and nobody activated it: the hints name the interpreter that runs now
(`.venv/bin/python` under the current folder) and the tools installed beside it.
"""

import dataclasses
import os
import shlex
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _short(path: str, cwd: str) -> str:
    """`path` relative to `cwd` when it lies under it, else absolute."""
    path, cwd = os.path.abspath(path), os.path.abspath(cwd)
    return os.path.relpath(path, cwd) if path.startswith(cwd + os.sep) else path


@dataclasses.dataclass(frozen=True)
class Shell:
    """Where a command is pasted (`cwd`) and the interpreter that printed it."""

    cwd: str
    executable: str
    venv: bool  # a virtual environment: found only by its path until activated

    @classmethod
    def here(cls) -> "Shell":
        """This process: its folder and interpreter."""
        return cls(os.getcwd(), sys.executable, sys.prefix != sys.base_prefix)

    def _spelled(self, path: str) -> str:
        """A program by its name when PATH finds this one outside a venv, else by its path."""
        name, found = os.path.basename(path), shutil.which(os.path.basename(path))
        if not self.venv and found and os.path.realpath(found) == os.path.realpath(path):
            return name
        return _short(path, self.cwd)

    def python(self) -> str:
        """The interpreter: `.venv/bin/python` for a venv under the current folder."""
        return self._spelled(self.executable)

    def tool(self, name: str) -> str:
        """A console script (`tensorboard`) installed beside the interpreter, else its name."""
        beside = os.path.join(os.path.dirname(self.executable), name)
        return self._spelled(beside) if os.path.isfile(beside) else name

    def script(self, script: str, *args: str) -> str:
        """`<python> <the repo's script> args`, e.g. `.venv/bin/python experiments/plot_run.py d`."""
        path = os.path.join(REPO, script)
        shown = _short(path, self.cwd) if os.path.exists(path) else script
        return shlex.join([self.python(), shown, *args])
