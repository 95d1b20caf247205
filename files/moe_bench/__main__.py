"""python -m moe_bench: the payload's command line (cli.main).

The process ends with os._exit once main() has returned - its results written and closed - and
the output is flushed: the interpreter's own teardown with torch loaded (and a CUDA context on a
GPU) took 0.6-1.0 s more on the simulated host, all of it inside the service's downtime, and
frees nothing the kernel does not free at exit anyway. An exception still ends the normal way
(its traceback, exit code 1).
"""

import os
import sys

from .cli import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code if isinstance(code, int) else 1)
