"""XLA's persistent compilation cache for the entry points: a restart or resume reuses the
programs an earlier run compiled instead of compiling them again.

The folder is `$EBPO_JAX_COMPILATION_CACHE`, else `$XDG_CACHE_HOME/ebpo_jax/xla`, else
`~/.cache/ebpo_jax/xla` (per user, never shared). The entry points (`ebpo_jax.cli.run`) turn it
on; `--nocompilation_cache` turns it off, `--compilation_cache_dir=DIR` moves it. Library
users call `enable()` themselves if they want it: importing ebpo_jax changes nothing.
"""

import os

ENV = "EBPO_JAX_COMPILATION_CACHE"
# Programs that compile faster than this are not worth a file (JAX's own default is 1 s).
MIN_COMPILE_S = 0.5


def default_dir(environ=os.environ) -> str:
    """The user's cache folder for compiled programs."""
    if environ.get(ENV):
        return environ[ENV]
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ebpo_jax", "xla")


def enable(path: str | None = None) -> str:
    """Point JAX's persistent compilation cache at `path` (default: default_dir()); returns it.

    Works as long as nothing has been compiled in this process yet.
    """
    import jax

    path = os.path.expanduser(path or default_dir())
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    return path
