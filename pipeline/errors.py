"""User-facing errors: the CLI prints their message (no traceback) and exits with code 2 (a StageError: 1)."""


class UserError(Exception):
    """Something the user can fix (config, data, command line); the message says what and how."""


class ConfigError(UserError):
    """A mistake in the configuration file or its overrides."""


class DataError(UserError):
    """Raw data that cannot be used; the message names the file and line."""


class LockError(UserError):
    """Another run holds the run directory's lock (exit code 3: try again later, nothing is wrong)."""


class StorageError(UserError):
    """The object store could not be used (auth, network, throttling): never taken as "not there"."""


class StageError(Exception):
    """A stage stopped on purpose, with a message that says everything (the user's reward function failing on
    most calls): the CLI prints it without a traceback and exits 1, as for any failed stage."""
