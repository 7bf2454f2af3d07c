"""The server's limits on requests, and their defaults (the `serve` flags)."""

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_WAITING_REQUESTS = 256
DEFAULT_REQUEST_TIMEOUT_S = 600.0
MAX_STOP_CHARS = 1000  # a stop string's length, at most
RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait
SCHEMA_COMPILE_TIMEOUT_S = 10.0  # compiling a structured-output constraint, at most
