"""What every floor above may use: the read errors, the deadline a request carries, shared
waits (single-flight), log lines and their rate limits, and process set-up (malloc)."""
