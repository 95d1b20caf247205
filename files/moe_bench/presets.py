"""Layer shapes of real public MoE models, as published in their model configs.

Each preset is one routed-expert MoE layer: experts, hidden size, expert intermediate size,
experts per token. The weights are benchmarked as INT4 symmetric with bf16 scales, group 32
(the Kimi K2.6 format) whatever the model ships, so presets compare layer shapes on one format.
"""

from __future__ import annotations

from dataclasses import dataclass

from .quant import MoEShape


@dataclass(frozen=True)
class Preset:
    name: str
    experts: int
    hidden: int
    inter: int
    topk: int
    group_size: int
    source: str

    def shape(self, tp: int = 1) -> MoEShape:
        return shard_shape(
            MoEShape(experts=self.experts, hidden=self.hidden, inter=self.inter, topk=self.topk, group_size=self.group_size),
            tp,
        )


def shard_shape(shape: MoEShape, tp: int) -> MoEShape:
    """The expert layer one rank of a tensor-parallel group of `tp` holds: inter split tp ways."""
    if tp < 1:
        raise ValueError(f"--tp must be at least 1, got {tp}")
    if shape.inter % tp:
        raise ValueError(f"intermediate size {shape.inter} is not divisible by --tp {tp}")
    inter = shape.inter // tp
    if inter % shape.group_size:
        raise ValueError(
            f"intermediate size {shape.inter} / --tp {tp} = {inter} is not a multiple of group size {shape.group_size}"
        )
    return MoEShape(experts=shape.experts, hidden=shape.hidden, inter=inter, topk=shape.topk, group_size=shape.group_size)


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        # moonshotai/Kimi-K2 family config.json (K2.5/K2.6 share the layer): n_routed_experts 384,
        # hidden_size 7168, moe_intermediate_size 2048, num_experts_per_tok 8; INT4 group 32.
        Preset("kimi-k2.6", 384, 7168, 2048, 8, 32, "moonshotai Kimi-K2 config.json"),
        # deepseek-ai/DeepSeek-V3 config.json: n_routed_experts 256, hidden_size 7168,
        # moe_intermediate_size 2048, num_experts_per_tok 8.
        Preset("deepseek-v3", 256, 7168, 2048, 8, 32, "deepseek-ai/DeepSeek-V3 config.json"),
        # Qwen/Qwen3-235B-A22B config.json: num_experts 128, hidden_size 4096,
        # moe_intermediate_size 1536, num_experts_per_tok 8.
        Preset("qwen3-235b-a22b", 128, 4096, 1536, 8, 32, "Qwen/Qwen3-235B-A22B config.json"),
        # mistralai/Mixtral-8x7B-v0.1 config.json: num_local_experts 8, hidden_size 4096,
        # intermediate_size 14336, num_experts_per_tok 2.
        Preset("mixtral-8x7b", 8, 4096, 14336, 2, 32, "mistralai/Mixtral-8x7B-v0.1 config.json"),
        # Not a model: a layer small enough to run the whole harness on one CPU core in seconds.
        Preset("tiny", 16, 256, 128, 4, 32, "synthetic, for CPU runs and tests"),
    )
}

DEFAULT_PRESET = "kimi-k2.6"
