"""Check scripts run by Triton's interpreter, each in a child process (TRITON_INTERPRET must be set before Triton is
imported), with this folder importable (the scripts use decode_rows and fp8_twin) and triton_rne imported first, so
that the interpreter rounds fp32 → bf16 to nearest as the GPU does."""

import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))


def run_interpreted(script: str, timeout: int = 600) -> None:
    """Run `script`; it passes by running to its end."""
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, "-c", "import triton_rne\n" + script + "\nprint('ok')"], capture_output=True,
                       text=True, env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}, timeout=timeout)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]
