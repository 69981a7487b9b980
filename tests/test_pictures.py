"""The dashboard pictures: committed, whole PNGs of a sensible size, shown by the README.

dashboards/grafana/render.py draws them (a real Prometheus, headless Chromium); it is
a script to rerun when the dashboards change, not a test. This checks only what it
left behind: each PNG parses (signature, chunks and their CRCs, IHDR, the image data
inflating to exactly its rows), is neither tiny nor huge nor blank, and the README
points at it.
"""

from __future__ import annotations

import re
import struct
import zlib

import pytest

from conftest import REPO

RENDER = REPO / "dashboards" / "grafana" / "render.py"
PICTURES = ["docs/images/overview.png", "docs/images/node.png"]
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


def test_render_script_is_there():
    assert RENDER.is_file()
    assert "def main(" in RENDER.read_text()


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
    assert set(PICTURES) <= shown, f"README shows {sorted(shown)}"
    assert "python dashboards/grafana/render.py" in readme
