"""The errors of kvd calls (kvd.client and kvd.step raise them)."""
import grpc


class KvdError(Exception):
    """A failed kvd call: `code` is the grpc.StatusCode, the message names what was wrong."""

    def __init__(self, code, message):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.details = message


class KvdRestarted(KvdError):
    """kvd restarted while this request was live: the request is gone with the daemon's memory of
    it. Start it again (a checkpoint kvd kept resumes it). Code ABORTED."""

    def __init__(self, request_id):
        super().__init__(grpc.StatusCode.ABORTED,
                         f"kvd restarted: request '{request_id}' was lost with it; start it again")
        self.request_id = request_id


class KvdUnavailable(KvdError):
    """kvd is not there: nothing listens at the target, or it did not answer in time. Code
    UNAVAILABLE; the message names the target."""

    def __init__(self, target, waited_s):
        super().__init__(grpc.StatusCode.UNAVAILABLE,
                         f"cannot reach kvd at {target} (waited {waited_s:g} s): is the daemon running, "
                         f"and may this user open its socket?")
        self.target = target
