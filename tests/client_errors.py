"""What a client-visible error message must never carry: the internals of the server.

One pattern for every test that reads an error body or an SSE error event of an internal failure
(issue 28): process ids, memory figures, file paths, tracebacks, and the names of internal exception
classes. Their detail belongs in the replica's log and metrics, keyed by the request id."""

import re

INTERNAL_ERROR_NAMES = ("KVLost", "LaneOOM", "LaneLost", "EngineLost", "EngineDeviceFault", "EngineProcessDied",
                        "PoolFullError", "StaleTargetSlots", "RayTaskError", "RayActorError", "OutOfMemoryError")
INTERNALS = re.compile("|".join([
    r"Traceback", r'File "',  # a traceback
    r"\bProcess \d+", r"\bpid\b",  # a process id
    r"\d+(?:\.\d+)?\s*[KMGT]i?B\b",  # a memory figure ("228.00 MiB", "79.18 GiB")
    r"(?<![\w.])/(?:[\w.-]+/)+[\w.-]*",  # a file path
    r"\b\w+(?:Error|Exception)\b",  # an exception class
    r"\b[A-Z][a-z]+(?:[A-Z][a-z0-9]*)+\b",  # any other CamelCase name (a class)
    *(rf"\b{name}\b" for name in INTERNAL_ERROR_NAMES),
]))


def leaked_internals(message: str) -> list[str]:
    """The internals `message` shows (empty when it shows none)."""
    return [m.group(0) for m in INTERNALS.finditer(message)]


def assert_clean(message: str) -> None:
    assert isinstance(message, str) and message, f"no message: {message!r}"
    assert not leaked_internals(message), f"internals in a client-visible error: {leaked_internals(message)} in {message!r}"
