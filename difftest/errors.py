"""Errors that map onto the exit codes of contract 7 (docs/architecture.md)."""

EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_BAD_INPUT = 2
EXIT_INFRA = 3


class DifftestError(Exception):
    """Base class; `exit_code` says what the CLI returns."""

    exit_code = EXIT_INFRA


class BadInput(DifftestError):
    """A suite, policy, result set or option is wrong. Nothing has run."""

    exit_code = EXIT_BAD_INPUT


class SuiteError(BadInput):
    """A suite file is invalid: names the file, the field and the problem."""

    def __init__(self, path, field: str, problem: str):
        self.path, self.field, self.problem = str(path), field, problem
        super().__init__(f"{self.path}: {field}: {problem}")


class InfraError(DifftestError):
    """An engine is down, a runner crashed, a server never became healthy."""

    exit_code = EXIT_INFRA


_NO_SPACE = ("No space left on device", "[Errno 28]", "Disk quota exceeded", "[Errno 122]")


def no_space(message: str) -> bool:
    """Whether an error, as a process or a server reported it, is a full disk (ENOSPC, EDQUOT): the
    machine's failure, never the candidate's, whoever's write it stopped."""
    return any(m in message for m in _NO_SPACE)
