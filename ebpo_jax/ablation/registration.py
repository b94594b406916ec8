"""Pre-registration of claims: a grid's claims file (claims, verdict rule, seed rule) is
committed before its runs, every run records the file's SHA-256, and a claims table marks
a claim whose file changed after its results as post hoc.

Git is the clock: `committed` refuses a file with uncommitted changes, and for results
from before runs recorded a hash, `git_history` compares when a claim's text first entered
its file with when its grids' results.csv first entered the repository.
"""

import hashlib
import os
import subprocess
from collections.abc import Iterable

PRE = "pre-registered"
POST_CHANGED = "post hoc: claims file changed after its results"
POST_GIT = "post hoc: claim committed after its results"
SAME_COMMIT = "post hoc: claim committed with its results"
PARTIAL = "post hoc: some of its runs predate the claims file"
BEFORE_GIT = "stated before its results (git), runs not hashed"
UNKNOWN = "unknown: runs not hashed, no git history"


def file_sha256(path: str) -> str:
    """SHA-256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def git(repo: str, *args: str) -> str:
    """`git -C repo args`, stripped; CalledProcessError / FileNotFoundError without it."""
    out = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def committed(path: str) -> str:
    """The commit that last changed `path`; ValueError when the file is untracked, has
    uncommitted changes, or is outside a git repository."""
    folder, name = os.path.split(os.path.abspath(path))
    try:
        tracked = git(folder, "ls-files", "--error-unmatch", name)
        dirty = git(folder, "status", "--porcelain", "--", name)
        commit = git(folder, "log", "-1", "--format=%H", "--", name)
    except (subprocess.CalledProcessError, FileNotFoundError):
        tracked, dirty, commit = "", "", ""
    if not tracked or dirty or not commit:
        raise ValueError(
            f"claims file {path}: not committed; pre-register it (git add + commit) before "
            "any run of its grids"
        )
    return commit


def first_commit_time(repo: str, path: str, text: str = "") -> int | None:
    """Unix time of the first commit adding `path` (with `text`: the first that added `text`
    to it); None without git or such a commit."""
    args = ["log", "--reverse", "--format=%ct"]
    args += ["-S", text] if text else ["--diff-filter=A"]
    try:
        times = git(repo, *args, "--", path).split()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None
    return int(times[0]) if times else None


def git_history(repo: str, claims_path: str, claim: str, results: Iterable[str]) -> str:
    """A claim's registration from git alone: its text's first commit against the first
    commit of each results.csv it reads."""
    stated = first_commit_time(repo, claims_path, claim)
    firsts = [first_commit_time(repo, p) for p in results]
    firsts = [t for t in firsts if t is not None]
    if stated is None or not firsts:
        return UNKNOWN
    if stated > min(firsts):
        return POST_GIT
    return SAME_COMMIT if stated == min(firsts) else BEFORE_GIT


def status(recorded: Iterable, current_sha: str, history=lambda: UNKNOWN) -> str:
    """A claim's registration from the claims SHA-256s its rows recorded: PRE when every row
    holds the current file's hash, POST_CHANGED when any holds another, PARTIAL when some
    hold none; rows that all hold none defer to `history()` (git)."""
    values = list(recorded)
    hashed = [str(h) for h in values if isinstance(h, str) and h]
    if not hashed:
        return history()
    if set(hashed) != {current_sha}:
        return POST_CHANGED
    return PRE if len(hashed) == len(values) else PARTIAL
