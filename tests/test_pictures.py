"""The pictures: committed, whole PNGs of a sensible size, shown by the page they belong to.

dashboards/grafana/render.py draws the dashboards' (a real Prometheus, headless Chromium),
scripts/screenshot-landing the landing page's, benchmarks/plot.py the benchmark's scaling
(docs/performance.md); they are scripts to rerun when the dashboards, the page or the code
change, not tests. This checks what they left behind: each PNG
parses (signature, chunks and their CRCs, IHDR, the image data inflating to exactly its
rows), is neither tiny nor huge nor blank, and the README points at it; and that every
panel render.py draws is still in the dashboards under its title.
"""

from __future__ import annotations

import importlib.util
import re
import struct
import sys
import zlib

import pytest

from conftest import REPO
from test_dashboards import _dashboards

RENDER = REPO / "dashboards" / "grafana" / "render.py"
# The dashboards' pictures (render.py) and the landing page's (scripts/screenshot-landing).
README_PICTURES = ["docs/images/overview.png", "docs/images/node.png", "docs/images/landing.png"]
# The benchmark's (python -m benchmarks --json F; python -m benchmarks.plot F PNG), in docs/performance.md.
PERFORMANCE_PICTURES = ["docs/images/scaling.png"]
# The card-health dashboard's (render.py), in docs/dashboards.md.
DASHBOARDS_PICTURES = ["docs/images/health.png"]
PICTURES = README_PICTURES + PERFORMANCE_PICTURES + DASHBOARDS_PICTURES
SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel


def read_png(data: bytes) -> tuple[int, int, bytes]:
    """Width, height and the inflated image data; AssertionError on anything malformed."""
    assert data[:8] == SIGNATURE, "not a PNG signature"
    chunks: list[tuple[bytes, bytes]] = []
    at = 8
    while at < len(data):
        assert at + 12 <= len(data), "truncated chunk"
        (length,) = struct.unpack(">I", data[at:at + 4])
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + length]
        assert len(body) == length, f"truncated {kind!r}"
        (crc,) = struct.unpack(">I", data[at + 8 + length:at + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind!r}"
        chunks.append((kind, body))
        at += 12 + length
        if kind == b"IEND":
            break
    assert at == len(data), "bytes after IEND"
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert colour in CHANNELS and depth == 8 and interlace == 0, (depth, colour, interlace)
    pixels = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    assert len(pixels) == height * (1 + width * CHANNELS[colour]), "image data does not fill the rows"
    return width, height, pixels


def _render_module():
    spec = importlib.util.spec_from_file_location("render_dashboards", RENDER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_render_draws_panels_the_dashboards_have():
    """Every panel render.py draws is a stat or time series panel of its dashboard, by title,
    as render.py's own find_panel looks it up: a panel renamed or removed in generate.py
    fails here, not only when someone next redraws the pictures. And it draws exactly the
    dashboard pictures listed here (landing.png is scripts/screenshot-landing's)."""
    render = _render_module()
    dashboards = _dashboards()
    drawn = []
    for png, (name, rows) in render.PICTURES.items():
        assert f"docs/images/{png}" in PICTURES, png
        for _height, titles in rows:
            for title in titles:
                panel = render.find_panel(dashboards[name], title, name)
                assert panel["title"] == title and panel["type"] in ("stat", "timeseries")
                drawn.append((name, title))
    assert sorted(f"docs/images/{png}" for png in render.PICTURES) == sorted(
        [p for p in README_PICTURES if p != "docs/images/landing.png"] + DASHBOARDS_PICTURES)
    assert len(drawn) == len(set(drawn)) >= 10, drawn
    with pytest.raises(RuntimeError, match="no stat or time series panel titled 'No such panel'"):
        render.find_panel(dashboards["overview.json"], "No such panel", "overview.json")


@pytest.mark.parametrize("path", PICTURES)
def test_picture_is_a_whole_png_of_a_sensible_size(path):
    data = (REPO / path).read_bytes()
    assert 20_000 < len(data) < 3_000_000, f"{path}: {len(data)} bytes"
    width, height, pixels = read_png(data)
    assert 1000 <= width <= 4000 and 500 <= height <= 4000, (width, height)
    # Not one flat colour: a drawn dashboard has many distinct byte values in its rows.
    assert len(set(pixels[:: max(1, len(pixels) // 100_000)])) > 50


def test_png_reader_refuses_a_damaged_file():
    data = bytearray((REPO / PICTURES[0]).read_bytes())
    data[40] ^= 0xFF
    with pytest.raises((AssertionError, zlib.error)):
        read_png(bytes(data))


def test_readme_shows_every_picture_and_how_to_redraw_them():
    readme = (REPO / "README.md").read_text()
    shown = set(re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", readme))
    assert set(README_PICTURES) <= shown, f"README shows {sorted(shown)}"
    assert "python dashboards/grafana/render.py" in readme


def test_dashboards_page_shows_the_health_picture_and_how_to_redraw_it():
    page = (REPO / "docs" / "dashboards.md").read_text()
    shown = {f"docs/{p}" for p in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", page)}
    assert set(DASHBOARDS_PICTURES) <= shown, f"docs/dashboards.md shows {sorted(shown)}"
    assert "python dashboards/grafana/render.py --only health.png" in page


def test_performance_page_shows_the_scaling_picture_and_how_to_redraw_it():
    page = (REPO / "docs" / "performance.md").read_text()
    shown = {f"docs/{p}" for p in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", page)}
    assert set(PERFORMANCE_PICTURES) <= shown, f"docs/performance.md shows {sorted(shown)}"
    assert "python -m benchmarks.plot" in page and "--json" in page
