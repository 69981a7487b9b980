"""Render metric families for a scrape: the Prometheus text format or
OpenMetrics, whichever the client asks for, byte for byte as prometheus_client
writes them.

prometheus_client's encoders validate and escape every metric and label name
again on every sample (OpenMetrics with a Python call per character of each
sample name); on a node with hundreds of processes that was most of a
scrape's cost (docs/performance.md). Here a line template is built once per
sample name and label names, and a sample is one ``%`` format of its label
values, escaped only when they hold a backslash, quote or newline.
The hot families (a line per device, two per process, the card health's) are
``GaugeColumns`` or ``CounterColumns``: the
collector keeps their label values as columns, written here straight into the
template, with no ``Sample`` or label dict per line; their ``samples`` are
built only when something else reads them (another registry, a test).
The format and Content-Type are still chosen by prometheus_client's
``choose_encoder``; anything outside the plain case (another metric type, a
unit, timestamps, exemplars, a name that needs escaping, the ``dots`` or
``values`` escaping schemes) is handed to its encoder unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from itertools import repeat
from math import copysign
from operator import itemgetter

from prometheus_client import exposition
from prometheus_client.core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.samples import Sample
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


Column = Sequence[str] | str  # a label's value in each row, or one value for every row


class GaugeColumns(Metric):
    """A gauge family held as columns: for each label its value in each row (or one value for
    every row), and the rows' values (or one for all). ``render`` writes its lines straight from
    the columns, with no ``Sample`` or label dict per line, a column that holds one value written
    into the line's template once. ``samples`` are real prometheus_client samples, the same
    ``GaugeMetricFamily.add_metric`` makes, in row order, built from the columns the first time
    they are read (by another registry, ``generate_latest``, a test)."""

    TYPE = "gauge"
    SAMPLE_SUFFIX = ""

    def __init__(self, name: str, documentation: str, labels: Sequence[str], columns: Sequence[Column],
                 values: Sequence[float] | float, count: int) -> None:
        Metric.__init__(self, name, documentation, self.TYPE)
        if len(columns) != len(labels):
            raise ValueError(f"{name}: {len(labels)} labels, {len(columns)} columns")
        for column in (*columns, values):
            if not isinstance(column, (str, int, float)) and len(column) != count:
                raise ValueError(f"{name}: a column of {len(column)} rows, not {count}")
        self.label_names = tuple(labels)
        self.columns = tuple(columns)
        self.values = values
        self.count = count
        self._samples: list[Sample] | None = None  # after Metric's own ``samples = []``
        # Its lines once written (the same in both formats): the family is not changed after it
        # is made, and one made for an earlier scrape may be given again (health_families.py).
        self.lines: str | None = None

    @property  # Metric's is a plain attribute; these are built when first read
    def samples(self) -> list[Sample]:
        if self._samples is None:
            count = self.count
            columns = [repeat(c, count) if isinstance(c, str) else c for c in self.columns]
            rows: Iterable[tuple[str, ...]] = zip(*columns, strict=True) if columns else repeat((), count)
            values = self.values
            each = repeat(values, count) if isinstance(values, (int, float)) else values
            name, names = self.name, self.label_names
            sample_name = name + self.SAMPLE_SUFFIX
            self._samples = [Sample(sample_name, dict(zip(names, row, strict=True)), value)
                             for row, value in zip(rows, each, strict=True)]
        return self._samples

    @samples.setter
    def samples(self, samples: list[Sample]) -> None:
        self._samples = samples

    @property
    def unread(self) -> bool:
        """Whether ``samples`` were never read nor set: the columns are then all there is."""
        return self._samples is None


class CounterColumns(GaugeColumns):
    """A counter family held as columns: its lines are ``name_total``, as
    ``CounterMetricFamily.add_metric`` writes them (with no ``_created``)."""

    TYPE = "counter"
    SAMPLE_SUFFIX = "_total"


class _Unsupported(Exception):
    """Not the plain case: let prometheus_client render it."""


class _Families:
    """A one-shot collector over families already read, for prometheus_client's encoders."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Sequence[Metric]:
        return self._families


# The format versions served, by media type; prometheus_client echoes the version asked for.
_ESCAPINGS = ("allow-utf-8", "underscores", "dots", "values")
_SERVED_VERSIONS = {"application/openmetrics-text": ("", "0.0.1", "1.0.0"), "text/plain": ("", "0.0.4", "1.0.0")}


def negotiate(accept: str | None) -> tuple[Callable[..., bytes], str]:
    """prometheus_client's encoder and Content-Type for an Accept header. An alternative whose
    ``version=`` is not one we serve is passed over, as client_golang's negotiation does, so a
    client's version string is never echoed into Content-Type unless it is one of ours; one
    prometheus_client cannot read gets the text format, as no header does."""
    try:
        return exposition.choose_encoder(_served_alternatives(accept or ""))
    except Exception:
        return exposition.choose_encoder("")


def _served_alternatives(accept: str) -> str:
    """The header rebuilt from what we serve: each alternative as its media type, a version of
    ours and its escaping, nothing else of the client's, so no spelling of it reaches the answer.

    Only the alternatives of the highest ``q`` are kept, as Prometheus' own negotiation
    (expfmt.Negotiate over goautoneg) ranks them: prometheus_client takes OpenMetrics wherever
    it stands in the header, so ``application/openmetrics-text;q=0, text/plain`` would be
    answered in the format the client refused. ``q=0``, or a ``q`` that is not a number from 0
    to 1, means not acceptable (RFC 9110, 12.4.2)."""
    kept: list[tuple[float, str]] = []
    for alternative in accept.split(","):
        media_type, *params = (part.strip() for part in alternative.split(";"))
        values = {key.strip().lower(): value.strip() for key, _, value in (p.partition("=") for p in params)}
        versions = _SERVED_VERSIONS.get(media_type)
        if versions is None:
            continue
        version = values.get("version", "")
        quality = _quality(values.get("q", "1"))
        if version not in versions or quality <= 0:
            continue
        rebuilt = media_type + (f";version={version}" if version else "")
        if values.get("escaping") in _ESCAPINGS:
            rebuilt += f";escaping={values['escaping']}"
        kept.append((quality, rebuilt))
    best = max((quality for quality, _ in kept), default=0.0)
    return ",".join(rebuilt for quality, rebuilt in kept if quality == best)


def _quality(text: str) -> float:
    """An Accept ``q`` value; 0 (not acceptable) for one that is not a number from 0 to 1."""
    try:
        quality = float(text)
    except ValueError:
        return 0.0
    return quality if 0.0 <= quality <= 1.0 else 0.0


def render(families: Sequence[Metric], accept: str | None) -> tuple[bytes, str]:
    """The body and Content-Type for a client sending ``Accept: accept``.

    A family with no samples is left out: its HELP and TYPE alone tell a reader
    nothing (no pod on a node, no engine running), and prometheus_client would
    print them."""
    families = [f for f in families if (f.count if isinstance(f, GaugeColumns) and f.unread else f.samples)]
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
    lines = _LINES
    if len(lines) > _LINES_KEPT:
        lines.clear()
    numbers = _NUMBERS
    if len(numbers) > _NUMBERS_KEPT:
        numbers.clear()
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
        if isinstance(metric, GaugeColumns) and metric.unread:
            out.append(_columns_text(metric, numbers))
            continue
        moved = () if openmetrics_format else tuple(name + suffix for suffix in _TEXT_SUFFIXES)

        line: _Line | None = None
        for sample in metric.samples:
            sample_name, labels, value = sample[0], sample[1], sample[2]
            if sample[3] is not None or sample[4] is not None or (len(sample) > 5 and sample[5] is not None):
                raise _Unsupported  # a timestamp, an exemplar, a native histogram
            if value is None:
                raise _Unsupported
            number = numbers[value] if value or copysign(1.0, value) > 0 else floatToGoString(value)
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


# Lines per sample name, label names and the names the format moves to families of their own, kept
# from scrape to scrape: the exporter writes a few dozen.
_LINES: dict[tuple[str, frozenset[str], tuple[str, ...]], _Line] = {}
_LINES_KEPT = 1024


def _line(lines: dict[tuple[str, frozenset[str], tuple[str, ...]], _Line], sample_name: str, labels: dict[str, str],
          moved: tuple[str, ...]) -> _Line:
    key = (sample_name, frozenset(labels), moved)
    line = lines.get(key)
    if line is None:
        line = lines[key] = _Line(sample_name, list(labels), moved)
    return line


_EXACT = 2**53  # ints below are floats exactly


def _int_text(value: int) -> str:
    """``floatToGoString`` of an int 0 <= value < 2**53 (byte counts), without float's repr:
    ``N.0`` below a million, else Go's exponent form (``2.147483648e+09``)."""
    digits = str(value)
    if value < 1_000_000:
        return digits + ".0"
    return f"{digits[0]}.{digits[1:]}".rstrip("0.") + f"e+{len(digits) - 1:02d}"


# prometheus_client before 0.20 wrote exponents of 10 and more as e+010: there, all go through it.
_INT_TEXT_AGREES = all(_int_text(v) == floatToGoString(v)
                       for v in (0, 7, 999_999, 1_000_000, 2**31, 10**10, _EXACT - 1))


class _Numbers(dict[float, str]):
    """Each value's text (``floatToGoString``), made once."""

    def __missing__(self, value: float) -> str:
        if type(value) is int and 0 <= value < _EXACT and _INT_TEXT_AGREES:
            text = _int_text(value)
        else:
            text = floatToGoString(value)
        # 0 and -0.0 are one key, two texts: the key holds 0's, and a reader looks -0.0 up
        # apart (copysign); a health family's counts and flags are mostly 0.
        if value or copysign(1.0, value) > 0:
            self[value] = text
        return text


_PLAIN_COLUMNS: set[tuple[str, tuple[str, ...]]] = set()  # family and label names found plain


def _columns_text(metric: GaugeColumns, numbers: _Numbers) -> str:
    """The lines of a ``GaugeColumns`` family, labels in sorted order as prometheus_client writes
    them: each line one ``%`` format of its varying columns, in a C loop (``map``); a column
    holding one value, and one value for all rows, are written into the template."""
    if metric.lines is not None:
        return metric.lines
    metric.lines = _write_columns(metric, numbers)
    return metric.lines


def _write_columns(metric: GaugeColumns, numbers: _Numbers) -> str:
    name, names, count = metric.name + metric.SAMPLE_SUFFIX, metric.label_names, metric.count
    if (name, names) not in _PLAIN_COLUMNS:
        if not _PLAIN_NAME.match(name) or not all(_PLAIN_NAME.match(k) for k in names):
            raise _Unsupported
        if len(_PLAIN_COLUMNS) > _LINES_KEPT:
            _PLAIN_COLUMNS.clear()
        _PLAIN_COLUMNS.add((name, names))
    pieces = []
    args: list[Sequence[str]] = []
    for label, column in sorted(zip(names, metric.columns, strict=True), key=itemgetter(0)):
        if not isinstance(column, str) and column.count(column[0]) == count:
            column = column[0]
        if isinstance(column, str):
            pieces.append(f'{label}="{_escape_value(column).replace("%", "%%")}"')
            continue
        joined = "".join(column)
        if "\\" in joined or '"' in joined or "\n" in joined:
            column = [_escape_value(value) for value in column]
        pieces.append(f'{label}="%s"')
        args.append(column)
    template = f"{name}{{{','.join(pieces)}}} " if pieces else f"{name} "
    values = metric.values
    if isinstance(values, (int, float)) or (values[0] and values.count(values[0]) == count):
        # One value for every row (an _info family): 0 and -0.0 compare equal, but are two texts.
        one = values if isinstance(values, (int, float)) else values[0]
        template += (numbers[one] if one or copysign(1.0, one) > 0 else floatToGoString(one)) + "\n"
    else:
        template += "%s\n"
        if 0 in values and any(copysign(1.0, value) < 0 for value in values if value == 0):
            args.append([numbers[v] if v or copysign(1.0, v) > 0 else floatToGoString(v) for v in values])
        else:  # no -0.0: each value's text is the one kept for it
            args.append(list(map(numbers.__getitem__, values)))
    if not args:
        return (template % ()) * count
    if len(args) == 1:
        return "".join(map(template.__mod__, args[0]))
    return "".join(map(template.__mod__, zip(*args, strict=True)))


# Value texts kept from scrape to scrape: a process's memory and a device's seldom change between
# two. Cleared when it holds more than a few scrapes' worth (a dict op at a time: thread-safe).
_NUMBERS = _Numbers()
_NUMBERS_KEPT = 8192


def _escape_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def sample_count(families: Iterable[Metric]) -> int:
    """How many sample lines ``render`` writes for ``families`` (in either format: neither
    writes a ``_created`` here), without building a ``GaugeColumns``' samples."""
    return sum(f.count if isinstance(f, GaugeColumns) else len(f.samples) for f in families)
