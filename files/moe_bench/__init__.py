"""moe_bench: a W4A16 fused-MoE benchmark payload (run as `python -m moe_bench --help`).

Imports torch, triton and the standard library only; `moe_bench.schema` imports the standard
library alone, so the controller can read results without torch.
"""

__version__ = "1.0.0"
