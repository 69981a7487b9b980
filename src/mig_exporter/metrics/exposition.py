"""Render metric families for a scrape: the Prometheus text format or
OpenMetrics, whichever the client asks for, byte for byte as prometheus_client
writes them.

prometheus_client's encoders validate and escape every metric and label name
again on every sample (OpenMetrics with a Python call per character of each
sample name); on a node with hundreds of processes that was most of a
scrape's cost (docs/performance.md). Here a line template is built once per
sample name and label names, and a sample is one ``%`` format of its label
values, escaped only when they hold a backslash, quote or newline.
The format and Content-Type are still chosen by prometheus_client's
``choose_encoder``; anything outside the plain case (another metric type, a
unit, timestamps, exemplars, a name that needs escaping, the ``dots`` or
``values`` escaping schemes) is handed to its encoder unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from functools import partial
from operator import itemgetter

from prometheus_client import exposition
from prometheus_client.core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.utils import floatToGoString

# Names every escaping scheme but "dots" leaves as they are, in both formats.
_PLAIN_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# Escaping schemes (Accept: ...;escaping=) under which prometheus_client writes
# a plain name unchanged in both formats ("values" mangles OpenMetrics sample
# names, "dots" every underscore).
_PLAIN_ESCAPINGS = frozenset(
    getattr(openmetrics, name) for name in ("UNDERSCORES", "ALLOWUTF8") if hasattr(openmetrics, name)
)
_TEXT_SUFFIXES = ("_created", "_gsum", "_gcount")  # samples prometheus_client moves to families of their own


class _Unsupported(Exception):
    """Not the plain case: let prometheus_client render it."""


class _Families:
    """A one-shot collector over families already read, for prometheus_client's encoders."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Sequence[Metric]:
        return self._families


def negotiate(accept: str | None) -> tuple[Callable[..., bytes], str]:
    """prometheus_client's encoder and Content-Type for an Accept header. One it cannot read
    (it raises on some malformed ``version=`` values) gets the text format, as no header does."""
    try:
        return exposition.choose_encoder(accept or "")
    except Exception:
        return exposition.choose_encoder("")


def render(families: Sequence[Metric], accept: str | None) -> tuple[bytes, str]:
    """The body and Content-Type for a client sending ``Accept: accept``.

    A family with no samples is left out: its HELP and TYPE alone tell a reader
    nothing (no pod on a node, no engine running), and prometheus_client would
    print them."""
    families = [f for f in families if f.samples]
    encoder, content_type = negotiate(accept)
    fast = _fast_encoder(encoder)
    if fast is not None:
        try:
            return fast(families), content_type
        except _Unsupported:
            pass
    return encoder(_Families(families)), content_type


def _fast_encoder(encoder: Callable[..., bytes]) -> Callable[[Sequence[Metric]], bytes] | None:
    if encoder is exposition.generate_latest:
        return _text
    if encoder is openmetrics.generate_latest:  # prometheus_client before escaping schemes
        return _open_metrics
    if not isinstance(encoder, partial) or encoder.args:
        return None
    keywords = dict(encoder.keywords)
    if keywords.pop("escaping", None) not in _PLAIN_ESCAPINGS:
        return None
    keywords.pop("version", None)  # matters only for native histograms, which are not plain
    if keywords:
        return None
    if encoder.func is exposition.generate_latest:
        return _text
    if encoder.func is openmetrics.generate_latest:
        return _open_metrics
    return None


def _text(families: Sequence[Metric]) -> bytes:
    """The Prometheus text format 0.0.4, as ``prometheus_client.generate_latest``."""
    return _render(families, openmetrics_format=False)


def _open_metrics(families: Sequence[Metric]) -> bytes:
    """OpenMetrics 1.0, as ``prometheus_client.openmetrics.exposition.generate_latest``."""
    return _render(families, openmetrics_format=True)


def _render(families: Sequence[Metric], openmetrics_format: bool) -> bytes:
    out: list[str] = []
    lines: dict[tuple[str, frozenset[str]], _Line] = {}  # per sample name and label names
    values_text: dict[float, str] = {}  # each value's text, once per scrape
    for metric in families:
        name, kind = metric.name, metric.type
        if kind == "counter":
            family_name = name if openmetrics_format else name + "_total"
        elif kind == "gauge":
            family_name = name
        else:
            raise _Unsupported
        if metric.unit or not _PLAIN_NAME.match(family_name):
            raise _Unsupported
        help_text = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        if openmetrics_format:
            help_text = help_text.replace('"', r'\"')
        out.append(f"# HELP {family_name} {help_text}\n# TYPE {family_name} {kind}\n")
        moved = () if openmetrics_format else tuple(name + suffix for suffix in _TEXT_SUFFIXES)

        line: _Line | None = None
        for sample in metric.samples:
            sample_name, labels, value = sample[0], sample[1], sample[2]
            if sample[3] is not None or sample[4] is not None or (len(sample) > 5 and sample[5] is not None):
                raise _Unsupported  # a timestamp, an exemplar, a native histogram
            number = values_text.get(value) if value else None  # 0 and -0.0 are one key, two texts
            if number is None:
                if value is None:
                    raise _Unsupported
                number = floatToGoString(value)
                if value:
                    values_text[value] = number
            # The same label names as the sample before: the same line, values
            # picked by name (a missing name raises KeyError; with the count
            # equal too, the names are the same set).
            if line is None or sample_name != line.sample_name or len(labels) != line.count:
                line = _line(lines, sample_name, labels, moved)
            try:
                texts = line.pick(labels)
            except KeyError:
                line = _line(lines, sample_name, labels, moved)
                texts = line.pick(labels)
            joined = "".join(texts)
            if "\\" in joined or '"' in joined or "\n" in joined:
                texts = tuple(_escape_value(t) for t in texts)
            out.append(line.template % (*texts, number))
    if openmetrics_format:
        out.append("# EOF\n")
    return "".join(out).encode("utf-8")


class _Line:
    """How to write a sample with these label names: ``template % (*values, number)``."""

    __slots__ = ("count", "pick", "sample_name", "template")

    def __init__(self, sample_name: str, label_names: Sequence[str], moved: tuple[str, ...]) -> None:
        if not _PLAIN_NAME.match(sample_name) or sample_name in moved:
            raise _Unsupported
        if not all(isinstance(k, str) and _PLAIN_NAME.match(k) for k in label_names):
            raise _Unsupported
        names = sorted(label_names)  # prometheus_client writes labels sorted by name
        self.sample_name = sample_name
        self.count = len(names)
        if not names:
            self.pick: Callable[[dict[str, str]], tuple[str, ...]] = lambda labels: ()
            self.template = f"{sample_name} %s\n"
            return
        if len(names) == 1:
            only = names[0]
            self.pick = lambda labels: (labels[only],)
        else:
            self.pick = itemgetter(*names)
        labels = ",".join(f'{k}="%s"' for k in names)
        self.template = f"{sample_name}{{{labels}}} %s\n"


def _line(lines: dict[tuple[str, frozenset[str]], _Line], sample_name: str, labels: dict[str, str],
          moved: tuple[str, ...]) -> _Line:
    key = (sample_name, frozenset(labels))
    line = lines.get(key)
    if line is None:
        line = lines[key] = _Line(sample_name, list(labels), moved)
    return line


def _escape_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
