class TinkerRequestError(ValueError):
    """One line for the user: what is wrong and how to fix it."""
