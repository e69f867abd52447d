"""One revision's kernel source as one file (native.c with its parts in place: `native.source_text`), to build it
beside this checkout's in an A/B run: scripts/ab_native.py, ab_screen.py, ab_vnni.py, same_outputs.py, ab_switch.py's
native-build (AB_OLD_NATIVE) and the C harnesses (-DNATIVE) take such a file. Revisions before the parts were split
out (a single native.c) come out as they were.

Usage: .venv/bin/python scripts/native_source.py REV > /tmp/old.c
"""

import subprocess
import sys

from dflash.models import native

FOLDER = "src/dflash/models/"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    revision = argv[0]

    def read(path: str) -> bytes:
        shown = subprocess.run(["git", "show", f"{revision}:{FOLDER}{path}"], capture_output=True)
        if shown.returncode != 0:
            sys.exit(f"git show {revision}:{FOLDER}{path}: {shown.stderr.decode().strip()}")
        return shown.stdout

    sys.stdout.buffer.write(native.source_text(read))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
