"""One C file of kernels/cpu compiled for a given -march with the engine's own flags, and
its disassembly: lets a test show that an ISA's loop builds, and holds the instructions
it should, on a host that cannot run it."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from kernels.cpu import native as cpu_native

CAN_DISASSEMBLE = shutil.which("gcc") is not None and shutil.which("objdump") is not None


def disassemble(source_name: str, march: list[str], out_dir: Path) -> str:
    """objdump -d of kernels/cpu/<source_name> built with cpu_native.COMPILE_FLAGS + march."""
    source = Path(cpu_native.__file__).with_name(source_name)
    obj = out_dir / f"{source.stem}.o"
    subprocess.run(["gcc", *cpu_native.COMPILE_FLAGS, *march, str(source), "-o", str(obj)],
                   check=True, capture_output=True)
    return subprocess.run(["objdump", "-d", str(obj)], check=True, capture_output=True,
                          text=True).stdout
