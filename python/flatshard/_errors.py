"""flatshard.Error and its subclasses, one per gRPC / absl status code.

Every failure of the client raises one of these, carrying the status code (``code``, an
int, and ``code_name``, e.g. "NOT_FOUND") and the server's or client's message.
"""

_CODE_NAMES = {
    1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
    13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}


class Error(Exception):
    """A failed flatshard operation: ``code`` (gRPC status code) and ``message``."""

    code = 2

    def __init__(self, message, code=None):
        if code is not None:
            self.code = code
        self.message = message
        super().__init__(f"{self.code_name}: {message}")

    @property
    def code_name(self):
        return _CODE_NAMES.get(self.code, str(self.code))


class CancelledError(Error):
    """A save, load or export cancelled by cancel_checkpoint_calls(), or a transfer in
    flight when its Client went away."""

    code = 1


class InvalidArgumentError(Error, ValueError):
    code = 3


class DeadlineExceededError(Error, TimeoutError):
    code = 4


class NotFoundError(Error, LookupError):
    code = 5


class AlreadyExistsError(Error):
    code = 6


class ResourceExhaustedError(Error):
    code = 8


class FailedPreconditionError(Error):
    code = 9


class AbortedError(Error):
    """What the call waited for was taken away (a checkpoint load while it waited)."""

    code = 10


class UnavailableError(Error, ConnectionError):
    code = 14


class InternalError(Error):
    code = 13


class DataLossError(Error):
    code = 15


class UnauthenticatedError(Error, PermissionError):
    code = 16


_BY_CODE = {cls.code: cls for cls in (
    CancelledError, InvalidArgumentError, DeadlineExceededError, NotFoundError, AlreadyExistsError,
    ResourceExhaustedError, FailedPreconditionError, AbortedError, UnavailableError, InternalError,
    DataLossError, UnauthenticatedError)}


def from_status(code, message):
    """The exception for an absl/gRPC status (used by the native module)."""
    cls = _BY_CODE.get(code, Error)
    return cls(message, code=code)
