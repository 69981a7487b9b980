"""nvidia-smi ``-q -x`` outputs bent in the ways XML allows, for checking that the
parser reads them as it always did: entities, CDATA, comments, processing
instructions, whitespace and line ends, attributes, empty and repeated elements,
odd order, nested and mixed content, namespaces, other encodings, broken bytes.

``variants(seed, n)`` is deterministic (``random.Random(seed)``), so the
snapshots of its outputs can be kept as frozen expectations
(tests/fixtures/nvidia-smi/snapshot-digests.json, written by the parser as it
was before the fast reading of ``<processes>``; see tests/test_parse_expectations.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
from collections.abc import Callable
from typing import Any

from mig_exporter.core.errors import ParseError
from mig_exporter.nvidia_smi.build import ReadMemo, snapshot_from_smi

_PROCESS = re.compile(rb"<process_info>.*?</process_info>", re.S)
_FIELD = re.compile(rb"<(pid|type|process_name|used_memory|gpu_instance_id|compute_instance_id)>(.*?)</\1>", re.S)
_PROCESSES = re.compile(rb"<processes>.*?</processes>|<processes/>|<processes></processes>", re.S)

ODD_VALUES = [
    b"N/A", b"[N/A]", b"", b" ", b"0", b"-1", b"12", b" 12 ", b"007", b"4194304", b"4194303", b"1.5 MiB", b"12 MiB",
    b" 12 MiB ", b"12 GiB", b"12MiB", b"-3 MiB", b"C", b"G", b"C+G", b"M+C", b"\xc3\xa9\xe4\xb8\xad", b"\xff\xfe",
    b"a\x01b", b"\t7\t", b"Not Supported", b"unknown", b"[Insufficient Permissions]", b"99999999999 MiB",
    b"\xd9\xa3", b"\xef\xbc\x97",  # non-ASCII digits: str.isdecimal() says yes
]
ESCAPED = [b"&amp;", b"&lt;", b"&gt;", b"&quot;", b"&apos;", b"&#65;", b"&#x4e2d;", b"&#13;", b"&#9;", b"&#32;",
           b"&undeclared;", b"]]&gt;", b"&#x10FFFF;"]


def _some(rng: random.Random, data: bytes, pattern: re.Pattern[bytes]) -> re.Match[bytes] | None:
    found = list(pattern.finditer(data))
    return rng.choice(found) if found else None


def _splice(data: bytes, m: re.Match[bytes], new: bytes) -> bytes:
    return data[:m.start()] + new + data[m.end():]


def _field_value(rng: random.Random, data: bytes) -> bytes:
    m = _some(rng, data, _FIELD)
    if m is None:
        return data
    tag = m.group(1)
    value = rng.choice([
        rng.choice(ODD_VALUES),
        m.group(2) + rng.choice(ESCAPED),
        rng.choice(ESCAPED) + m.group(2),
        b"<![CDATA[" + m.group(2) + b"]]>",
        b"<![CDATA[" + m.group(2)[:2] + b"]]>" + m.group(2)[2:],
        b"<!-- c -->" + m.group(2),
        m.group(2)[:1] + b"<!-- c -->" + m.group(2)[1:],
        m.group(2) + b"<?pi x?>",
        m.group(2)[:1] + b"<x/>" + m.group(2)[1:],
        b"<x>1</x>" + m.group(2),
        b"\r\n" + m.group(2) + b"\r",
        m.group(2).replace(b"/", b"/\r/"),
        b"  " + m.group(2) + b"\n\t",
    ])
    open_tag = rng.choice([b"<" + tag + b">", b"<" + tag + b" >", b"<" + tag + b' a="1">', b"<" + tag + b"\n>"])
    if rng.random() < 0.1:
        return _splice(data, m, b"<" + tag + b"/>")
    return _splice(data, m, open_tag + value + b"</" + tag + b">")


def _process_shape(rng: random.Random, data: bytes) -> bytes:
    m = _some(rng, data, _PROCESS)
    if m is None:
        return data
    fields = [f.group(0) for f in _FIELD.finditer(m.group(0))]
    choice = rng.randrange(10)
    if choice == 0:
        rng.shuffle(fields)
    elif choice == 1 and fields:
        fields.insert(rng.randrange(len(fields) + 1), rng.choice(fields))
    elif choice == 2 and fields:
        del fields[rng.randrange(len(fields))]
    elif choice == 3:
        fields.insert(rng.randrange(len(fields) + 1), b"<extra>1</extra>")
    elif choice == 4:
        fields.insert(rng.randrange(len(fields) + 1), b"<!-- between -->")
    elif choice == 5:
        fields.insert(rng.randrange(len(fields) + 1), b"junk text")
    elif choice == 6:
        fields.insert(rng.randrange(len(fields) + 1), m.group(0))  # a process inside a process
    elif choice == 7:
        fields.insert(rng.randrange(len(fields) + 1), b"<a:pid>5</a:pid>")
    elif choice == 8:
        fields = [f.replace(b"<", b"<n:").replace(b"<n:/", b"</n:") for f in fields]
    sep = rng.choice([b"", b"\n", b"\r\n\t\t\t\t", b" "])
    head = rng.choice([b"<process_info>", b'<process_info id="1">', b"<process_info >",
                       b'<process_info xmlns="urn:x">', b'<process_info xmlns:n="urn:n">'])
    if choice == 9:
        return _splice(data, m, b"")
    return _splice(data, m, head + sep + sep.join(fields) + sep + b"</process_info>")


def _processes_block(rng: random.Random, data: bytes) -> bytes:
    m = _some(rng, data, _PROCESSES)
    if m is None:
        return data
    block = m.group(0)
    choice = rng.randrange(8)
    if choice == 0:
        return _splice(data, m, block + block)  # two <processes> in one card
    if choice == 1:
        return _splice(data, m, b"<!-- " + block.replace(b"--", b"") + b" -->" + block)
    if choice == 2:
        return _splice(data, m, b"<processes/>")
    if choice == 3:
        return _splice(data, m, b"<wrapper>" + block + b"</wrapper>")
    if choice == 4:
        return _splice(data, m, b'<processes note="x">' + block[len(b"<processes>"):])
    if choice == 5:
        return _splice(data, m, b"<?pi <processes>?>" + block)
    if choice == 6:
        return _splice(data, m, block.replace(b"<processes>", b"<processes>text", 1))
    return _splice(data, m, block.replace(b"<processes>", b"<processes><![CDATA[<process_info>]]>", 1))


def _document(rng: random.Random, data: bytes) -> bytes:
    choice = rng.randrange(6)
    if choice == 0:
        return data.replace(b"\n", b"\r\n")
    if choice == 1:
        return data.replace(b"\n", b"\r")
    if choice == 2 and data.startswith(b"<?xml"):
        end = data.index(b"?>") + 2
        latin = data[end:].replace(b"</process_name>", b"\xe9</process_name>", 1)
        return b'<?xml version="1.0" encoding="ISO-8859-1"?>' + latin
    if choice == 3:
        return data.replace(b"<nvidia_smi_log>", b'<nvidia_smi_log xmlns="urn:nv">', 1)
    if choice == 4:
        return b"\xef\xbb\xbf" + data
    return data.replace(b"<!DOCTYPE nvidia_smi_log SYSTEM", b"<!DOCTYPE nvidia_smi_log [<!ELEMENT pid ANY>]><!-- x", 1)


MUTATIONS: list[Callable[[random.Random, bytes], bytes]] = [_field_value] * 6 + [_process_shape] * 4 + [
    _processes_block] * 2 + [_document]


def variants(seeds: list[bytes], seed: int, n: int) -> list[bytes]:
    """``n`` documents, each a seed with one to four of the mutations above."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        data = rng.choice(seeds)
        for _ in range(rng.randint(1, 4)):
            data = rng.choice(MUTATIONS)(rng, data)
        out.append(data)
    return out


_MIG_DEVICES = re.compile(rb"([ \t]*)<mig_devices>.*?</mig_devices>", re.S)
_FB_MEMORY = re.compile(rb"<fb_memory_usage>.*?</fb_memory_usage>", re.S)
_MEMORY_VALUE = re.compile(rb"<(total|reserved|used|free)>[^<]*</\1>")
_UUID = re.compile(rb"<uuid>([^<]*)</uuid>")
_PRODUCT = re.compile(rb"<product_name>([^<]*)</product_name>")


def without_mig_monitor(xml: bytes) -> tuple[bytes, bytes]:
    """A real ``nvidia-smi -q -x`` of cards in MIG mode made into what a container prints that
    has the GPUs but neither the MIG monitor capability nor the access capability of any
    instance (see ``fake_nvml.without_mig_monitor``, the same container on the NVML path), and
    the ``nvidia-smi -L`` it prints beside it. The transformation, each step with its source:

    - the card's ``fb_memory_usage`` values become ``Insufficient Permissions``, as in the
      ``-q -x`` of IDSIA/sacred#864 (an A100-SXM4-40GB in MIG mode, in a container);
    - ``<mig_devices>`` holds no ``<mig_device>``, only ``None``, as nvidia-smi writes it for a
      card with no MIG device (every non-MIG card of the real corpus): the instances the
      container cannot open are not shown (NVIDIA/nvidia-docker#1473: an instance made after
      the container started is not seen in it). No capture of this exact case was found;
    - no ``<process_info>`` is left (listing the aggregate processes is what the monitor
      capability grants: NVIDIA container toolkit, NVIDIA_MIG_MONITOR_DEVICES);
    - ``-L`` lists each card alone, without MIG lines.

    Only documents whose cards are all in MIG mode are taken: the steps apply to every card.
    """
    if xml.count(b"<current_mig>Enabled</current_mig>") != xml.count(b"<gpu "):
        raise ValueError("not every card of this document is in MIG mode")
    def no_devices(m: re.Match[bytes]) -> bytes:
        indent = m.group(1)
        inner = indent + (b"\t" if indent.startswith(b"\t") else b"    ")
        return indent + b"<mig_devices>\n" + inner + b"None\n" + indent + b"</mig_devices>"

    out = _MIG_DEVICES.sub(no_devices, xml)
    out = _FB_MEMORY.sub(lambda m: _MEMORY_VALUE.sub(rb"<\1>Insufficient Permissions</\1>", m.group(0)), out)
    out = _PROCESS.sub(b"", out)
    names = [n.decode() for n in _PRODUCT.findall(out)]
    uuids = [u.decode() for u in _UUID.findall(out)]
    listing = "".join(f"GPU {i}: {name} (UUID: {uuid})\n" for i, (name, uuid) in enumerate(zip(names, uuids,
                                                                                                 strict=True)))
    return out, listing.encode()


def plain(obj: Any) -> Any:
    """A snapshot as JSON-able values, the same whether its types are dataclasses or named tuples."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [type(obj).__name__, {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}]
    fields = getattr(type(obj), "_fields", None)
    if isinstance(obj, tuple) and fields is not None:
        return [type(obj).__name__, {name: plain(getattr(obj, name)) for name in fields}]
    if isinstance(obj, tuple | list):
        return [plain(v) for v in obj]
    if isinstance(obj, float):
        return ["float", repr(obj)]
    return obj


def outcome(xml: bytes, listing: bytes | None, memo: ReadMemo | None = None) -> Any:
    """What ``snapshot_from_smi`` makes of the pair (with ``memo``, the last read's), as JSON-able
    values: the snapshot, or the error."""
    try:
        return plain(snapshot_from_smi(xml, listing, None, memo))
    except ParseError as e:
        return ["ParseError", str(e)]


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=True).encode()).hexdigest()[:20]


def fixture_cases(fixtures: Any, samples: Any) -> dict[str, tuple[bytes, bytes | None]]:
    """Our fixtures and the demo sample, each with its ``-L`` where there is one, and their variants."""
    cases: dict[str, tuple[bytes, bytes | None]] = {}
    xmls = [*sorted(fixtures.glob("*.xml")), samples / "demo.xml"]
    for path in xmls:
        listing = path.with_name(path.name[:-4] + ".L.txt")
        cases[f"fixture:{path.name}"] = (path.read_bytes(), listing.read_bytes() if listing.exists() else None)
    for i, data in enumerate(variants([p.read_bytes() for p in xmls], seed=17, n=600)):
        cases[f"fixture-variant:{i}"] = (data, None)
    return cases


def corpus_cases(corpus: Any, fixtures: Any) -> dict[str, tuple[bytes, bytes | None]]:
    """Every real ``-q -x`` alone, every real ``-L`` with our H100 fixture, and variants of the real ones."""
    cases: dict[str, tuple[bytes, bytes | None]] = {}
    xmls = sorted(corpus.glob("*.xml"))
    for path in xmls:
        cases[f"corpus:{path.name}"] = (path.read_bytes(), None)
    h100 = (fixtures / "h100-mig-processes.xml").read_bytes()
    for path in sorted(corpus.glob("*L.txt")):
        cases[f"corpus-L:{path.name}"] = (h100, path.read_bytes())
    for i, data in enumerate(variants([p.read_bytes() for p in xmls], seed=18, n=300)):
        cases[f"corpus-variant:{i}"] = (data, None)
    return cases


def scenario_cases(scenarios: Any) -> dict[str, tuple[bytes, bytes | None]]:
    """The benchmark's machines, and each with its -L missing."""
    cases: dict[str, tuple[bytes, bytes | None]] = {}
    for shape in (*scenarios.MAIN_SHAPES, scenarios.Shape("mixed", 3, 2, 5)):
        xml = scenarios.query_xml(shape)
        cases[f"scenario:{shape.name}"] = (xml, scenarios.listing(shape))
        cases[f"scenario-no-L:{shape.name}"] = (xml, None)
    return cases
