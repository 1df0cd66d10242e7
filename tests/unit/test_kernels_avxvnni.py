"""The AVX-VNNI kernels (Intel Core Ultra and other AVX-VNNI CPUs without AVX-512) cannot run on this AMD CPU, which
has AVX-512 VNNI but not AVX-VNNI (qemu-user does not emulate it either). They are covered twice:
- their logic: isa_avxvnni.cpp and isa_avx512vnni.cpp compile the same source (kernels/core/x86/) with VEX
  vpdpbusd and EVEX-256 vpdpbusd respectively, computing the same thing; the EVEX build runs in every kernel
  test here (tests/unit/test_kernels.py);
- their encoding: this test disassembles the built library and checks that every instruction of the AVX-VNNI
  kernels is VEX- or legacy-encoded (no EVEX prefix 0x62, so no AVX-512 instruction can fault on those CPUs)
  and that their dot products are VEX vpdpbusd."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from fleet_common import kernels

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="fleet's kernels are not built"),
              pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")]

FUNCTION = re.compile(r"^[0-9a-f]+ <(.*)>:$")
INSN = re.compile(r"^\s*[0-9a-f]+:\t((?:[0-9a-f]{2} )+)\s*\t(.*)$")


def avxvnni_instructions() -> list[tuple[str, str]]:
    """(raw bytes, text) of every instruction in a function of namespace fleet::avxvnni."""
    out = subprocess.run(["objdump", "-d", "-C", "-w", str(kernels.library_path())], capture_output=True, text=True,
                         check=True).stdout
    found, inside = [], False
    for line in out.splitlines():
        if m := FUNCTION.match(line):
            inside = "fleet::avxvnni::" in m.group(1)
        elif inside and (m := INSN.match(line)):
            found.append((m.group(1).strip(), m.group(2)))
    return found


def test_the_avxvnni_kernels_hold_no_evex_instruction_and_use_vex_vpdpbusd() -> None:
    instructions = avxvnni_instructions()
    assert len(instructions) > 1000, "the AVX-VNNI kernels were not found in the library"
    evex = [text for raw, text in instructions if raw.startswith("62 ")]
    assert not evex, f"EVEX (AVX-512) instructions in the AVX-VNNI kernels: {evex[:5]}"
    assert not [text for _, text in instructions if "zmm" in text or re.search(r"%k[0-7]", text)]
    dots = [text for _, text in instructions if "vpdpbusd" in text]
    assert dots and all(text.startswith("{vex}") for text in dots), dots[:5]
