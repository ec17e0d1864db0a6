"""The one exception type for errors a user can cause (config, data, cluster address, an
unsupported combination). The CLI prints its message on one line and exits with code 2."""


class RapidfireError(Exception):
    """A user-fixable error: the message names the key, file or row and says how to fix it."""


class RunFailed(Exception):
    """The run itself failed (a worker crashed, Ray Train gave up). CLI exit code 1."""


def run_command(command) -> int:
    """Run a CLI command (a callable returning its exit code): each failure ends with our one line
    on stderr and its exit code (2: user error, 1: the run failed, 130: interrupted)."""
    import sys

    try:
        return command()
    except RapidfireError as e:
        print(f"rapidfire: error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"rapidfire: {e}", file=sys.stderr)
        return 130 if type(e).__name__ == "RunInterrupted" else 1
    except KeyboardInterrupt:
        print("rapidfire: interrupted", file=sys.stderr)
        return 130
