"""The errors a Tinker request can get."""

from __future__ import annotations


class TinkerRequestError(ValueError):
    """One line for the user: what is wrong with the request and how to fix it; the server answers it as a 400 that
    the SDK raises as its own exception."""
