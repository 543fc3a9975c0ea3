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


def check_port_free(host: str, port: int, key: str) -> None:
    """A UserError naming the port and `key`, the setting that changes it, if `host:port` cannot be bound: a
    server started on a busy port printed its address, failed, and (MLflow's) exited 0 (issue 59, item 3).
    SO_REUSEADDR as the servers themselves (uvicorn, Serve's proxy) set it: a port in TIME_WAIT is free."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            change = f"{key} N" if key.startswith("--") else f"{key}=N"
            raise UserError(f"{key}: cannot bind {host}:{port} ({exc.strerror}); another server is using it: stop "
                            f"it or choose another port ({change})") from None
