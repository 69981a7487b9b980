"""Log lines: one per event, as logfmt (the default) or JSON (``--log.format``).

Every record is one line, a traceback included (escaped into the line), so a
log shipper never splits an event and ``grep`` finds it whole::

    ts=2024-05-01T12:00:00.123Z level=WARNING logger=mig_exporter msg="read from nvidia-smi failed: ..."
    {"ts": "2024-05-01T12:00:00.123Z", "level": "WARNING", "logger": "mig_exporter", "msg": "read from ..."}
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

FORMATS = ("logfmt", "json")
_BARE = re.compile(r"^[^\s\"=\\]+$")


def _timestamp(record: logging.LogRecord) -> str:
    """RFC 3339 in UTC with milliseconds, as Prometheus' own components write it."""
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


def _exception(formatter: logging.Formatter, record: logging.LogRecord) -> str | None:
    if record.exc_info:
        return formatter.formatException(record.exc_info)
    return record.exc_text or None


def shown(text: str, limit_chars: int = 64) -> str:
    """Text from outside (a client's query, a file's name) as a log line can
    hold it: escaped to printable ASCII, quoted, one line, at most
    ``limit_chars`` long."""
    escaped = ascii(text)
    return escaped if len(escaped) <= limit_chars else escaped[: limit_chars - 4] + "...'"


def logfmt_value(value: str) -> str:
    """A value as logfmt writes it: bare when it can be, else quoted with
    ``"``, ``\\`` and line breaks escaped, so the record stays one line."""
    if value and _BARE.match(value):
        return value
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped}"'


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = [
            ("ts", _timestamp(record)),
            ("level", record.levelname),
            ("logger", record.name),
            ("msg", record.getMessage()),
        ]
        exc = _exception(self, record)
        if exc:
            fields.append(("exc", exc))
        return " ".join(f"{key}={logfmt_value(value)}" for key, value in fields)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = {"ts": _timestamp(record), "level": record.levelname, "logger": record.name,
                  "msg": record.getMessage()}
        exc = _exception(self, record)
        if exc:
            fields["exc"] = exc
        return json.dumps(fields, ensure_ascii=False)


def setup_logging(level: str, fmt: str = "logfmt") -> None:
    """Log to stderr at ``level`` (debug, info, warning, error) in ``fmt``."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)
