"""Errors a user can cause: bad input, a missing model, a request that cannot fit.

Entry points print these as one line and exit non-zero; servers turn them into 4xx responses.
Anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Something the user asked for is wrong; the message says what and what to do."""
