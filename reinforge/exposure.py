"""How a reinforge server is exposed: its command-line options, the loopback check, the token from the
environment. No web framework is imported here, so that `reinforge --help` stays instant."""

from __future__ import annotations

import argparse
import ipaddress
import os

from reinforge.errors import ConfigError


def add_bind_arguments(parser: argparse.ArgumentParser, default_port: int | None) -> None:
    """--host, --port (required when `default_port` is None), --allow-remote and --token-env: how every
    reinforge server command is exposed."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    if default_port is None:
        parser.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    else:
        parser.add_argument(
            "--port", type=int, default=default_port, help=f"TCP port (default: {default_port}; 0 picks a free one)"
        )
    parser.add_argument("--allow-remote", action="store_true", help="allow a --host other than loopback")
    parser.add_argument(
        "--token-env",
        metavar="VAR",
        help="name of the environment variable holding the bearer token clients must send (the token itself "
        "never goes on the command line, where `ps` would show it)",
    )


def token_from_env(variable: str | None, setting: str) -> str | None:
    """The bearer token held by environment variable `variable` (None when no variable is named); `setting`
    names where the variable was given, for the error when it is unset or empty."""
    if not variable:
        return None
    token = os.environ.get(variable)
    if not token:
        raise ConfigError(f"{setting} {variable}: that environment variable is unset or empty; export the token in it")
    return token


def check_bind_address(host: str, allow_remote: bool) -> None:
    """Refuse a non-loopback `host` unless `allow_remote`."""
    if not allow_remote and not is_loopback(host):
        raise ConfigError(
            f"--host {host} is not a loopback address; pass --allow-remote to serve other machines "
            "(and set a token with --token-env)"
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
