"""Command-line entry points: bad input and failed runs become one `error:` line and an
exit status from one scheme.

Exit status:
  0  done: trained to total_steps, or stopped by SIGTERM/Ctrl-C after saving a checkpoint
     (run the same command to resume), or --help / --list_config printed
  1  the run cannot go on: its workdir (in use, unwritable, full, or a resume refused:
     a changed config, metrics without a checkpoint), its checkpoints, a run of non-finite
     steps, a hung phase, a failed reward or environment worker; a traceback is a bug
  2  bad input, nothing run: a flag, a config field or value, a config, data or model file

ml_collections parses `--config.field=value` overrides while the flag is defined (no
--config given) or while absl parses argv (--config given), and reports a misspelt field
as a chain of three AttributeError/KeyError tracebacks. `define_config` and `run` turn
those, and `ConfigError` / `DataError` raised by the program, into one line.
"""

import logging
import os
import re
import sys
from collections.abc import Callable
from typing import NoReturn

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


def fail(message: str, status: int = EXIT_USAGE) -> NoReturn:
    """Print `error: message` to stderr and exit with `status` (2: bad input) and no traceback."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def _field_error(e: BaseException) -> str:
    """One line from ml_collections' missing-field errors: "unknown config field 'x' (...)"."""
    while e.args and isinstance(e.args[0], BaseException):  # AttributeError(KeyError(text))
        e = e.args[0]
    text = str(e.args[0]) if e.args else str(e)
    m = re.match(r"'([\w.]+)'\s*(.*)", text.strip(), re.DOTALL)
    if m:
        hint = f" ({' '.join(m.group(2).split())})" if m.group(2).strip() else ""
        return f"unknown config field '{m.group(1)}'{hint}"
    return " ".join(text.split())


def _override_names(argv: list[str], flag: str) -> list[str]:
    """The `--<flag>.x.y` overrides on the command line, as "x.y"."""
    pattern = re.compile(rf"^--?(?:no)?{re.escape(flag)}\.([\w.]+)")
    return [m.group(1) for a in argv if (m := pattern.match(a))]


def config_error_line(e: BaseException, argv: list[str], flag: str = "config") -> str:
    """The message for an exception raised while parsing `--config.*` flags."""
    from ebpo_jax.schema import ConfigError

    if isinstance(e, ConfigError):
        return str(e)
    line = _field_error(e)
    names = _override_names(argv, flag)
    if isinstance(e, AttributeError | KeyError) and names:
        # Name the whole dotted override the user typed, not only its last component.
        leaf = re.match(r"unknown config field '([\w.]+)'", line)
        hits = [n for n in names if leaf and n.split(".")[-1] == leaf.group(1)]
        if hits:
            line = line.replace(f"'{leaf.group(1)}'", f"'{flag}.{hits[-1]}'", 1)
    return line


def _file_error_line(e: BaseException) -> str:
    """ "config file: No such file or directory: 'x.py'" from ml_collections' nested OSErrors."""
    text = " ".join(str(e).split())
    m = re.search(r"\[Errno \d+\] (.*)$", text)
    return f"config file: {m.group(1)}" if m else text


def define_config(name: str, default: str, help_string: str):
    """config_flags.DEFINE_config_file whose override errors are one line and exit 2, and
    `--list_<name>`: print every field of the chosen config with its value and doc, and exit."""
    from absl import flags
    from ml_collections import config_flags

    if name in flags.FLAGS:  # a second entry point imported into one process (tests): share it
        return flags.FlagHolder(flags.FLAGS, flags.FLAGS[name])
    flags.DEFINE_bool(
        f"list_{name}",
        False,
        f"Print every field of --{name} (after overrides) with its value and one-line doc.",
    )
    try:
        return config_flags.DEFINE_config_file(name, default, help_string)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        fail(config_error_line(e, sys.argv, name))


class _FromPackages:
    """A logging filter: records logged from source files under `packages` (absl logs
    every module under one logger, so the file path is what tells them apart)."""

    def __init__(self, packages: tuple[str, ...], keep: bool):
        self.parts = tuple(f"{os.sep}{p}{os.sep}" for p in packages)
        self.keep = keep

    def filter(self, record) -> bool:
        return any(p in record.pathname for p in self.parts) == self.keep


class _BestEffortFile(logging.FileHandler):
    """A log file that drops what it cannot write (a full disk) instead of printing a traceback."""

    def handleError(self, record) -> None:
        pass


def divert_logs(path: str, packages: tuple[str, ...] = ("orbax",)) -> None:
    """Send what `packages` log (orbax's background-thread tracebacks on a failed save) to
    `path` instead of stderr, where the run's own `error:` line stands alone.

    The file is created only if something is logged.
    """
    from absl import logging as absl_logging

    to_file = _BestEffortFile(path, delay=True)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(pathname)s: %(message)s"))
    to_file.addFilter(_FromPackages(packages, keep=True))
    absl_logging.get_absl_handler().addFilter(_FromPackages(packages, keep=False))
    logging.getLogger().addHandler(to_file)


def _usage_errors() -> tuple[type[BaseException], ...]:
    """Bad input (exit 2): config fields, data files, model checkpoint folders."""
    from ebpo_jax.data import DataError
    from ebpo_jax.models.hf import HFCheckpointError
    from ebpo_jax.schema import ConfigError

    return (ConfigError, DataError, HFCheckpointError)


def _run_errors() -> tuple[type[BaseException], ...]:
    """A run that cannot go on (exit 1): its folder, metrics or checkpoints, or a failed write."""
    from ebpo_jax.runtime.checkpoint import CheckpointError
    from ebpo_jax.runtime.metrics import MetricsError
    from ebpo_jax.runtime.workdir import WorkdirError
    from ebpo_jax.runtime.workers import WorkerError  # a reward or environment worker pool failed

    # Raised only once the trainer is imported: no import of it (and of jax) here.
    loop = sys.modules.get("ebpo_jax.trainer.loop")
    stopped = (loop.NonFiniteError,) if loop is not None else ()
    return (WorkdirError, MetricsError, CheckpointError, OSError, WorkerError, *stopped)


def _define_cache_flags(flags, default: bool) -> None:
    """--[no]compilation_cache and --compilation_cache_dir, once per process."""
    from ebpo_jax.runtime import compile_cache

    if "compilation_cache" in flags.FLAGS:
        return
    flags.DEFINE_bool(
        "compilation_cache",
        default,
        "Keep compiled XLA programs on disk so a restart or resume skips compiling "
        "(--nocompilation_cache: off).",
    )
    flags.DEFINE_string(
        "compilation_cache_dir",
        compile_cache.default_dir(),
        f"Folder of the compilation cache (or ${compile_cache.ENV}).",
    )


def _exit_scheme() -> str:
    """The "Exit status:" paragraph of this module's docstring."""
    start = __doc__.index("Exit status:")
    return __doc__[start : __doc__.index("\n\n", start)]


def _run_as() -> str:
    """This program's command line as a fresh shell runs it (`.venv/bin/python x.py`)."""
    from ebpo_jax.runtime import shell

    script = os.path.relpath(os.path.abspath(sys.argv[0]), shell.REPO)
    return f"Run as: {shell.Shell.here().script(script)} [--flag=value ...]"


def _print_help(flag_values, config_flag: str) -> None:
    """The program's docstring and command line, its flags and ours, how to list the config
    fields, and the exit status."""
    print((sys.modules["__main__"].__doc__ or "").strip() + "\n")
    print(_run_as() + "\n")
    for text in (flag_values.main_module_help(), flag_values.module_help(__name__)):
        if text.strip():
            print(text + "\n")
    if config_flag in flag_values:
        print(
            f"Every --{config_flag}.<field>=<value> override, with its default and doc: "
            f"--list_{config_flag} (also after --{config_flag}=configs/x.py and overrides)."
        )
    print("All flags, absl's included: --helpfull\n")
    print(_exit_scheme())


def _parser(config_flag: str):
    """absl's flags parser, with flag and config errors as one line (exit 2)."""
    from absl import flags

    def parse(argv):
        try:
            rest = flags.FLAGS(argv)
            if config_flag in flags.FLAGS:  # a missing file is only reported on first use
                getattr(flags.FLAGS[config_flag].value, "to_dict", None)
            return rest
        except flags.Error as e:
            fail(str(e))
        except OSError as e:  # ml_collections: the config file is missing or unreadable
            fail(_file_error_line(e))
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            fail(config_error_line(e, argv, config_flag))

    return parse


def run(
    main: Callable[[list[str]], object],
    *,
    config_flag: str = "config",
    compilation_cache: bool = True,
) -> None:
    """absl.app.run(main); flag, config and data errors: one line, exit 2; run errors: exit 1.

    Also the persistent compilation cache (ebpo_jax.runtime.compile_cache), unless
    --nocompilation_cache; `compilation_cache` is the flag's default.
    """
    from absl import app, flags

    _define_cache_flags(flags, compilation_cache)
    usage = _usage_errors()
    if any(a in ("-h", "--help", "-?", "--helpshort") for a in sys.argv[1:]):
        _print_help(flags.FLAGS, config_flag)
        raise SystemExit(0)

    def wrapped(args):
        if flags.FLAGS[f"list_{config_flag}"].value if f"list_{config_flag}" in flags.FLAGS else 0:
            from ebpo_jax.config.doc import describe

            print(describe(flags.FLAGS[config_flag].value))
            return None
        if flags.FLAGS.compilation_cache:
            from ebpo_jax.runtime import compile_cache

            compile_cache.enable(flags.FLAGS.compilation_cache_dir)
        try:
            return main(args)
        except usage as e:
            fail(" ".join(str(e).split()) or type(e).__name__)
        except app.UsageError as e:
            fail(str(e))
        except Exception as e:
            if not isinstance(e, _run_errors()):
                raise
            if isinstance(e, OSError) and e.strerror:  # e.g. disk full: name the file
                text = (f"{e.filename}: " if e.filename else "") + e.strerror
            else:
                text = " ".join(str(e).split()) or type(e).__name__
            if type(e).__name__ == "CheckpointError":
                # A failed orbax save leaves non-daemon threads waiting ~5 min on signals
                # that never come; committed checkpoints are intact, so leave at once.
                print(f"error: {text}", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(EXIT_FAILURE)
            fail(text, status=EXIT_FAILURE)

    app.run(wrapped, flags_parser=_parser(config_flag))
