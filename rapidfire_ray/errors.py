"""The one exception type for errors a user can cause (config, data, cluster address, an
unsupported combination). The CLI prints its message on one line and exits with code 2."""


class RapidfireError(Exception):
    """A user-fixable error: the message names the key, file or row and says how to fix it."""


class RunFailed(Exception):
    """The run itself failed (a worker crashed, Ray Train gave up). CLI exit code 1."""
