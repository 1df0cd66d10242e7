"""A stage's weights file as content segments (issue 30): what lets a worker build a new stage's ``.bin`` from
the stages it holds already, so that a re-plan sends only the layers a PC did not have.

An OpenVINO IR's ``.bin`` is the data of its ``Const`` layers, each at the ``offset`` and ``size`` its
``<data>`` element in the ``.xml`` gives. Two builds of one source made with other layer ranges hold the same
tensors byte for byte at other offsets (the demo's 3- and 2-stage GGUF builds: 61 of the new stage 0's 74 MB
are the old stage 0's). ``ir_segments`` tiles a ``.bin`` into those ranges (the bytes between them, if any,
are segments too) and ``hash_segments`` gives each one's sha256: the sender lists (offset, size, sha256) of
the file to send, and the worker copies each segment whose sha256 it holds in a file it has.

The tiling is a property of the file alone: the xml is parsed for offsets only, never trusted for anything
else; a worker checks every copied segment's sha256 again and the whole file's against the manifest.
"""

from __future__ import annotations

import hashlib
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

READ_BYTES = 8 << 20  # hashing reads this much at a time: memory stays bounded whatever a tensor's size
MAX_SEGMENTS = 200_000  # more is not an IR a fleet build makes (the 1B model's stage: ~300)


@dataclass(frozen=True)
class Segment:
    """Bytes ``[offset, offset + size)`` of a file and their sha256 (32 bytes)."""

    offset: int
    size: int
    sha256: bytes


def ir_segments(xml: str | bytes | Path, bin_size: int) -> list[tuple[int, int]]:
    """(offset, size) ranges tiling ``[0, bin_size)`` of the IR whose ``.xml`` is ``xml`` (its text, bytes or
    path): one per distinct ``Const`` data range (ranges that overlap merged into one), and the bytes between
    them as ranges of their own. Raises ``ValueError`` for xml that does not parse, a range past
    ``bin_size`` or more than ``MAX_SEGMENTS`` ranges."""
    text = Path(xml).read_bytes() if isinstance(xml, Path) else xml
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise ValueError(f"IR xml does not parse: {exc}") from None
    ranges = set()
    for layer in root.iter("layer"):
        data = layer.find("data") if layer.get("type") == "Const" else None
        if data is None or data.get("offset") is None:
            continue
        offset, size = int(data.get("offset")), int(data.get("size", "0"))
        if offset < 0 or size < 0 or offset + size > bin_size:
            raise ValueError(f"Const {layer.get('name')!r}: bytes [{offset}, {offset + size}) outside the .bin's "
                             f"{bin_size}")
        if size:
            ranges.add((offset, size))
    tiles: list[tuple[int, int]] = []
    at = 0
    for offset, size in sorted(ranges):
        end = offset + size
        if tiles and offset < at:  # overlaps the previous range: one segment
            if end > at:
                start = tiles[-1][0]
                tiles[-1] = (start, end - start)
                at = end
            continue
        if offset > at:
            tiles.append((at, offset - at))
        tiles.append((offset, size))
        at = end
    if at < bin_size:
        tiles.append((at, bin_size - at))
    if len(tiles) > MAX_SEGMENTS:
        raise ValueError(f"{len(tiles)} segments: more than {MAX_SEGMENTS}")
    return tiles


def hash_segments(path: Path, ranges: list[tuple[int, int]]) -> list[Segment]:
    """Each range of the file at ``path`` with its sha256, read ``READ_BYTES`` at a time. Raises ``OSError``
    (``ValueError`` when the file is shorter than a range)."""
    out = []
    with open(path, "rb") as f:
        for offset, size in ranges:
            digest, done = hashlib.sha256(), 0
            f.seek(offset)
            while done < size:
                block = f.read(min(READ_BYTES, size - done))
                if not block:
                    raise ValueError(f"{path}: ends before byte {offset + size} of a segment")
                digest.update(block)
                done += len(block)
            out.append(Segment(offset, size, digest.digest()))
    return out


def file_segments(xml_path: Path, bin_path: Path) -> list[Segment]:
    """``hash_segments`` of ``bin_path`` over ``ir_segments`` of its ``xml_path``."""
    return hash_segments(bin_path, ir_segments(Path(xml_path), Path(bin_path).stat().st_size))
