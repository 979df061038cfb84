"""The user's mistakes versus bugs, and how every entry point reports them.

The rule: an exception is the user's mistake if and only if it is a `UserError`. Its message
names the field (recipe key, CLI flag, file, column, tensor), the value and the fix. Entry points
(`engine.train`, every tools/ script) print it as one line, `error: <message>`, on stderr and
exit with code 2; under a launcher (torchrun, mp.spawn) only rank 0 prints. An error with
`lines` (a recipe with several keys to change: engine/config/load.py) prints its headline on that
line and each of its lines, indented, below it: still one message. Every other
exception is a bug and keeps its traceback.

Subclasses: `engine.config.ConfigError` (recipes, overrides, layouts), `DataError` (data
files), `ModelError` (HF configs and weights this engine cannot use),
`engine.checkpoint.CheckpointError` (training checkpoints), `UsageError` (command-line
arguments). All are ValueErrors, so older `except ValueError` code keeps working.

Foreign exceptions that can only mean bad input (a missing recipe or data file, pyarrow's
ArrowInvalid for a file that is not parquet, a UnicodeDecodeError for a JSONL that is not UTF-8)
are translated into a UserError where the input is read, never at the entry point: a ValueError
raised deep inside the engine stays a bug, with its traceback.

Tests: tests/test_bad_inputs.py, tests/test_launch_ray.py, tests/test_tool_overrides.py
"""
import argparse
import json
import os
import re
import sys
import time

EXIT_USER_ERROR = 2
# A rank other than 0 that hit a user error waits this long before exiting: if rank 0 failed
# too, the launcher ends this rank meanwhile and rank 0's line is the only one; if not (an
# error only this rank saw), this rank reports it itself.
PEER_GRACE_S = 30.0


class UserError(ValueError):
    """A mistake in what the user gave us; the message says what to change."""


class UsageError(UserError):
    """Command-line arguments: missing, malformed or contradictory."""


class DataError(UserError):
    """A data file that cannot be used: missing, unreadable, wrong columns, bad rows."""


class ModelError(UserError):
    """A model config (config.json, an inline config) or weights this engine cannot use."""


def launcher_rank() -> int:
    """This process's rank as the launcher set it (RANK); 0 outside a launcher."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def one_line(message) -> str:
    """The message on one line (YAML and transformers messages carry newlines)."""
    return re.sub(r"\s*\n\s*", "; ", str(message).strip())


def _write_launcher_error_file(line: str) -> None:
    """torchrun passes each worker an error file; its failure summary then shows our line
    instead of "To enable traceback see ..."."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                        "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


def report(error: BaseException, rank=None) -> int:
    """Print `error: <message>` once per job (rank 0) and return the exit code 2."""
    rank = launcher_rank() if rank is None else rank
    lines = getattr(error, "lines", None)  # several keys at once: a headline, then one line each
    text = (str(error).splitlines()[0] + "".join(f"\n  {one_line(x)}" for x in lines)) if lines \
        else one_line(error)
    line = f"error: {text}"
    if rank != 0:
        time.sleep(PEER_GRACE_S)  # ended here by the launcher when rank 0 reports the same error
        line = f"error (rank {rank}): {text}"
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    print(line, file=sys.stderr, flush=True)
    _write_launcher_error_file(line)
    return EXIT_USER_ERROR


def run_main(main, argv=None) -> int:
    """Run an entry point's `main(argv)`: a UserError becomes one line and exit code 2; any
    other exception propagates with its traceback."""
    try:
        code = main(argv)
    except UserError as e:
        return report(e)
    return 0 if code is None else code


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes are UsageErrors (one line, exit 2) instead of usage + message."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")

    def parse_known_args(self, args=None, namespace=None):
        """Recipe overrides (`key=value`) anywhere: argparse fills a `nargs="*"` positional only
        from the words before the first option, so `RECIPE --gpus 8 a=b` would leave `a=b`
        unrecognised; the words that look like overrides join that positional, in order."""
        namespace, extras = super().parse_known_args(args, namespace)
        rest = [a for a in self._actions if not a.option_strings and a.nargs == "*" and a.dest == "overrides"]
        if rest and extras:
            late = [a for a in extras if "=" in a and not a.startswith("-")]
            if late:
                setattr(namespace, "overrides", list(getattr(namespace, "overrides", None) or []) + late)
                extras = [a for a in extras if a not in late]
        return namespace, extras


def positive(kind, what: str):
    """argparse type: a finite number > 0 of `kind` (int or float); `what` says what it counts,
    e.g. "the GiB of memory per GPU, e.g. 80"."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}; "
                                             f"give {what}") from None
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"{text} must be > 0; give {what}")
        return value
    return parse


def require_file(path, flag: str, fix: str) -> None:
    """UsageError unless `path` (given as `flag`) is an existing regular file."""
    if not os.path.exists(path):
        raise UsageError(f"{flag} {path!r} does not exist; {fix}")
    if not os.path.isfile(path):
        raise UsageError(f"{flag} {path!r} is not a file; {fix}")


def check_output_file(path, flag: str) -> None:
    """UsageError unless the file `path` (given as `flag`) can be written: its directory exists
    and it is not itself a directory. Checked before any work, so none is lost at the end."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a directory; give a file name")
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path!r}: directory {folder!r} does not exist; create it first")
