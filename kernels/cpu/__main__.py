"""`python -m kernels.cpu`: builds the native CPU kernels now (instead of at first use) and fails if they cannot be."""

import sys

from kernels import cpu

if __name__ == "__main__":
    ok = cpu.available()
    print("native CPU kernels:", "ready" if ok else "UNAVAILABLE (see the warning above)")
    sys.exit(0 if ok else 1)
