"""The -q -x parser on its own: layouts, unknown markers, bad values, hostile input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import MIB, fixture_bytes
from mig_exporter.core.errors import ParseError
from mig_exporter.nvidia_smi.query_xml import _known, _Values, parse_query_xml


def _log(*gpus: str, head: str = "<driver_version>550.90.07</driver_version>") -> bytes:
    body = "".join(f'<gpu id="00000000:0{i}:00.0">{g}</gpu>' for i, g in enumerate(gpus))
    return (f'<?xml version="1.0" ?>\n<nvidia_smi_log>{head}<attached_gpus>{len(gpus)}</attached_gpus>'
            f'{body}</nvidia_smi_log>').encode()


@pytest.mark.parametrize(
    "marker",
    ["N/A", "[N/A]", "Not Supported", "[Not Supported]", "Requested functionality has been deprecated",
     "Unknown Error", "", "   "],
)
def test_every_unknown_marker_reads_as_none(marker):
    gpu = (
        f"<product_name>NVIDIA A10G</product_name><fb_memory_usage><total>{marker}</total>"
        f"<used>{marker}</used><free>{marker}</free></fb_memory_usage>"
        f"<temperature><gpu_temp>{marker}</gpu_temp></temperature>"
        f"<gpu_power_readings><power_draw>{marker}</power_draw></gpu_power_readings>"
        f"<utilization><gpu_util>{marker}</gpu_util></utilization>"
        f"<mig_mode><current_mig>{marker}</current_mig><pending_mig>{marker}</pending_mig></mig_mode>"
        f"<processes><process_info><pid>17</pid><type>C</type><process_name>x</process_name>"
        f"<used_memory>{marker}</used_memory></process_info></processes>"
    )
    card = parse_query_xml(_log(gpu)).cards[0]
    assert card.memory.total_bytes is None and card.memory.used_bytes is None and card.memory.free_bytes is None
    assert card.temperature_celsius is None and card.power_draw_watts is None and card.utilization_ratio is None
    assert card.mig_current is None and card.mig_pending is None
    assert card.processes[0].used_bytes is None


def test_power_draw_is_found_in_each_drivers_layout():
    old = "<power_readings><power_draw>70.11 W</power_draw></power_readings>"
    r535 = "<gpu_power_readings><power_draw>71.5 W</power_draw></gpu_power_readings>"
    r570 = ("<gpu_power_readings><average_power_draw>72.25 W</average_power_draw>"
            "<instant_power_draw>N/A</instant_power_draw></gpu_power_readings>")
    r570_instant_only = ("<gpu_power_readings><average_power_draw>N/A</average_power_draw>"
                         "<instant_power_draw>73 W</instant_power_draw></gpu_power_readings>")
    cards = parse_query_xml(_log(old, r535, r570, r570_instant_only)).cards
    assert [c.power_draw_watts for c in cards] == [70.11, 71.5, 72.25, 73.0]


def test_text_broken_across_lines_and_odd_indentation_is_trimmed():
    gpu = ("<product_name>\n      Tesla T4\n   </product_name>"
           "<fb_memory_usage><total>\n 15360 MiB\n</total></fb_memory_usage>")
    card = parse_query_xml(_log(gpu)).cards[0]
    assert card.name == "Tesla T4" and card.memory.total_bytes == 15360 * MIB


def test_pci_bus_id_falls_back_to_the_gpu_id_attribute():
    card = parse_query_xml(_log("<product_name>GRID K520</product_name>")).cards[0]
    assert card.pci_bus_id == "00000000:00:00.0"


def test_an_unreadable_value_is_none_and_a_problem_but_the_card_and_its_neighbours_stay():
    bad = "<product_name>A</product_name><fb_memory_usage><total>lots</total><used>5 MiB</used></fb_memory_usage>"
    good = "<product_name>B</product_name><fb_memory_usage><total>100 MiB</total></fb_memory_usage>"
    report = parse_query_xml(_log(bad, good))
    first, second = report.cards
    assert first.memory.total_bytes is None and first.memory.used_bytes == 5 * MIB
    assert second.memory.total_bytes == 100 * MIB
    assert report.problems == ("card 0: fb_memory_usage/total: unreadable size 'lots'",)


def test_processes_without_a_usable_pid_are_skipped_and_reported():
    gpu = ("<processes><process_info><pid>abc</pid></process_info><process_info><pid>0</pid></process_info>"
           "<process_info><pid>42</pid><type>G</type><process_name></process_name><used_memory>3 MiB</used_memory>"
           "</process_info></processes>")
    report = parse_query_xml(_log(gpu))
    assert [(p.pid, p.type, p.name, p.used_bytes) for p in report.cards[0].processes] == [(42, "G", "", 3 * MIB)]
    assert len(report.problems) == 2


def test_a_mig_device_without_an_index_is_skipped_and_reported():
    gpu = ("<mig_mode><current_mig>Enabled</current_mig><pending_mig>Enabled</pending_mig></mig_mode>"
           "<mig_devices><mig_device><index>x</index></mig_device><mig_device><index>0</index>"
           "<gpu_instance_id>7</gpu_instance_id><compute_instance_id>0</compute_instance_id></mig_device></mig_devices>")
    report = parse_query_xml(_log(gpu))
    assert [(i.mig_index, i.gpu_instance_id) for i in report.cards[0].instances] == [(0, 7)]
    assert any("MIG device without a readable index" in p for p in report.problems)


def test_card_order_in_the_report_is_the_index_even_when_minor_numbers_are_not():
    gpus = [f"<product_name>K80</product_name><minor_number>{m}</minor_number><uuid>GPU-{m}</uuid>"
            for m in (1, 2, 3, 0)]
    report = parse_query_xml(_log(*gpus))
    assert [(c.index, c.uuid) for c in report.cards] == [(0, "GPU-1"), (1, "GPU-2"), (2, "GPU-3"), (3, "GPU-0")]


def test_no_cuda_version_element_and_not_found_both_read_as_none():
    assert parse_query_xml(_log("")).cuda_version is None
    assert parse_query_xml(_log("", head="<cuda_version>Not Found</cuda_version>")).cuda_version is None


def test_zero_gpus_is_an_empty_report_not_an_error():
    report = parse_query_xml(_log())
    assert report.cards == () and report.driver_version == "550.90.07"


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "not well-formed"),
        (b"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", "not well-formed"),
        (b'<?xml version="1.0" ?><nvidia_smi_log><gpu>', "not well-formed"),
        (b"<html><body>hello</body></html>", "expected <nvidia_smi_log>"),
        (b'\x89PNG\r\n\x1a\n\x00\x00', "not UTF-8"),
    ],
)
def test_garbage_and_truncation_raise_parse_error(data, message):
    with pytest.raises(ParseError, match=message):
        parse_query_xml(data)


def test_truncated_real_output_raises_parse_error():
    data = fixture_bytes("h100-mig-processes.xml")
    for cut in (10, len(data) // 3, len(data) - 20):
        with pytest.raises(ParseError):
            parse_query_xml(data[:cut])


def test_billion_laughs_is_refused_before_parsing():
    bomb = b'<?xml version="1.0"?><!DOCTYPE nvidia_smi_log [<!ENTITY a "aaaaaaaaaa">' + b"".join(
        b'<!ENTITY %c "&%c;&%c;&%c;&%c;&%c;&%c;&%c;&%c;&%c;&%c;">' % ((98 + i,) + (97 + i,) * 10) for i in range(9)
    ) + b"]><nvidia_smi_log><driver_version>&j;</driver_version></nvidia_smi_log>"
    with pytest.raises(ParseError, match="declares XML entities"):
        parse_query_xml(bomb)


def test_external_entity_is_refused_and_no_file_is_read(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("TOPSECRET")
    xxe = (f'<?xml version="1.0"?><!DOCTYPE nvidia_smi_log [<!ENTITY x SYSTEM "file://{secret}">]>'
           "<nvidia_smi_log><driver_version>&x;</driver_version></nvidia_smi_log>").encode()
    with pytest.raises(ParseError):
        parse_query_xml(xxe)


def test_external_dtd_is_neither_fetched_nor_loaded(tmp_path):
    dtd = tmp_path / "nvsmi_device_v12.dtd"
    dtd.write_text('<!ENTITY ver "from-the-dtd">')
    data = (f'<?xml version="1.0" ?><!DOCTYPE nvidia_smi_log SYSTEM "{dtd}">'
            "<nvidia_smi_log><driver_version>550.1</driver_version><cuda_version>&ver;</cuda_version>"
            "</nvidia_smi_log>").encode()
    report = parse_query_xml(data)
    assert report.driver_version == "550.1"
    assert report.cuda_version is None, "the DTD's entity must not have been loaded"
    net = (b'<?xml version="1.0" ?><!DOCTYPE nvidia_smi_log SYSTEM "http://127.0.0.1:9/nvsmi_device_v12.dtd">'
           b"<nvidia_smi_log><driver_version>550.2</driver_version></nvidia_smi_log>")
    assert parse_query_xml(net).driver_version == "550.2"


def test_a_process_name_that_is_not_utf8_costs_only_its_own_text():
    data = fixture_bytes("h100-mig-processes.xml").replace(
        b"<process_name>./gpu_burn</process_name>", b"<process_name>/opt/\xff\xfe/gpu\x01burn</process_name>")
    report = parse_query_xml(data)
    names = {p.pid: p.name for p in report.cards[0].processes}
    assert names[21198] == "/opt/\ufffd\ufffd/gpu\ufffdburn"
    assert names[21180] == "/root/tools/memhog"
    assert report.problems == ("1 process name(s) held bytes that are not UTF-8 text; read with replacements",)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
def test_documents_in_other_encodings_are_refused(tmp_path, encoding):
    secret = tmp_path / "secret"
    secret.write_text("TOPSECRET")
    xxe = (f'<?xml version="1.0" encoding="{encoding}"?><!DOCTYPE nvidia_smi_log [<!ENTITY x SYSTEM "file://{secret}">]>'
           "<nvidia_smi_log><driver_version>&x;</driver_version></nvidia_smi_log>").encode(encoding)
    with pytest.raises(ParseError, match="not UTF-8"):
        parse_query_xml(xxe)


def test_the_parser_itself_expands_no_entity_even_past_the_pre_check():
    """Defence in depth: the lxml parser is configured not to resolve entities,
    whatever the byte-level check lets through."""
    from lxml import etree

    from mig_exporter.nvidia_smi.query_xml import _parser

    doc = b'<!DOCTYPE r [<!ENTITY a "expanded">]><r><v>&a;</v></r>'
    root = etree.fromstring(doc, _parser())
    assert root.findtext("v") in (None, "")


@pytest.mark.parametrize(("pid", "why"), [
    ("\u00b2", "not a whole number"), ("\u0663", "not a whole number"), ("-7", "negative"),
    ("0", "no process has id 0"),
    ("4294967295", "2^32-1, NVML's 'none' and the garbage of a process struct mismatch"),
    ("99999999999", "longer than the 10 digits of a 32-bit process id"),
])
def test_pids_no_process_can_have_are_skipped_with_why(pid, why):
    gpu = (f"<processes><process_info><pid>{pid}</pid><type>C</type><used_memory>1 MiB</used_memory>"
           "</process_info></processes>")
    report = parse_query_xml(_log(gpu))
    assert report.cards[0].processes == () and report.cards[0].error is None
    assert report.problems == (f"card 0: a process with pid {pid!r}: {why}; skipped",)


@pytest.mark.parametrize("pid", [4_194_304, 42_818_686, 4_294_967_294])
def test_pids_past_linuxs_range_are_kept_as_a_vgpu_host_lists_its_vms(pid):
    gpu = (f"<processes><process_info><pid>{pid}</pid><type>C+G</type><used_memory>4064 MiB</used_memory>"
           "</process_info></processes>")
    report = parse_query_xml(_log(gpu))
    assert [(p.pid, p.type, p.used_bytes) for p in report.cards[0].processes] == [(pid, "C+G", 4064 * MIB)]
    assert report.problems == ()


_VALUE_TEXTS = st.one_of(
    st.none(),
    st.text(max_size=12),
    st.text(alphabet="0123456789٣²", min_size=1, max_size=6),
    st.builds(lambda n, unit, pad: f"{pad}{n}{unit}{pad}", st.integers(-5, 10**7),
              st.sampled_from([" MiB", " MiB ", "MiB", " KiB", " GiB", " B", " mib", "  MiB", " MB", ""]),
              st.sampled_from(["", " ", "\n\t\t"])),
    st.sampled_from(["N/A", "[N/A]", "Not Supported", "٣٨٨ MiB", "3.5 MiB", "007", "1e3", "+5", " 7 "]),
)


@settings(max_examples=500, deadline=None)
@given(raw=_VALUE_TEXTS)
def test_the_short_ways_to_integers_and_sizes_read_as_the_general_way(raw):
    # Processes and MIG devices take a short way for the texts nvidia-smi
    # writes ("7", "388 MiB"); every text must read as the general way reads it.
    fast, general = _Values([]), _Values([])
    assert fast.integer_field(raw, "p") == general.integer_of(_known(raw), "p")
    assert fast.size_field(raw, "p") == general.size_of(_known(raw), "p")
    assert fast.problems == general.problems
