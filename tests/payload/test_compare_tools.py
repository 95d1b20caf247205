"""The side-by-side timing tools (tools/path_compare.py, tools/row_compare.py, tools/graph_timing.py
--interleave): what they compare runs in each place of a round as often as the others over an
even number of rounds. At large M the GPU sits at its power limit and what runs later in a round
finds it hotter; in a fixed order the first of two bm128 tile sets was 4-5% faster at kimi-k2.6
M=3072 whichever set it was (PERFORMANCE.md rounds 30 and 32)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tools"))

import graph_timing as gt  # noqa: E402


def test_round_order_reverses_in_odd_rounds_so_each_place_is_shared():
    names = ["gluon0", "gluon1", "triton"]
    orders = [gt.round_order(names, index) for index in range(4)]
    assert orders == [names, names[::-1], names, names[::-1]]
    for name in names:  # over two rounds: first once and last once, or the middle twice
        places = [order.index(name) for order in orders[:2]]
        assert sum(places) == len(names) - 1
    assert names == ["gluon0", "gluon1", "triton"]  # the caller's list is left as it was


def _timing_loops(tool: str, callee: str = "gt.graph_time_us") -> list[ast.For]:
    """The innermost loop around each of the tool's calls of callee."""
    tree = ast.parse((REPO_ROOT / "tools" / tool).read_text())
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    loops = []
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and ast.unparse(call.func) == callee:
            node = call
            while node in parent and not isinstance(node, ast.For):
                node = parent[node]
            loops.append(node)
    return loops


def test_path_compare_row_compare_and_the_interleave_time_in_round_order():
    for tool, callee in (("path_compare.py", "gt.graph_time_us"), ("row_compare.py", "gt.graph_time_us"),
                         ("graph_timing.py", "cli.time_one_m")):  # --interleave: the harness beside the graph
        loops = _timing_loops(tool, callee)
        assert loops, tool
        for loop in loops:
            assert ast.unparse(loop.iter).split("(")[0] in ("gt.round_order", "round_order"), (tool, ast.unparse(loop.iter))


def test_every_timing_tool_times_the_preset_sharded_as_asked():
    """--preset and --tp (graph_timing.shape_arguments) give the layer every tool here times,
    through graph_timing.shape_of: the preset's shape with its intermediate split --tp ways."""
    import argparse

    import pytest
    from moe_bench import presets

    parser = argparse.ArgumentParser()
    gt.shape_arguments(parser)
    assert gt.shape_of(parser.parse_args([])) == presets.PRESETS["kimi-k2.6"].shape(1)
    shard = gt.shape_of(parser.parse_args(["--preset", "kimi-k2.6", "--tp", "8"]))
    assert (shard.experts, shard.hidden, shard.inter, shard.topk) == (384, 7168, 256, 8)
    assert gt.shape_of(parser.parse_args(["--preset", "mixtral-8x7b", "--tp", "8"])).inter == 14336 // 8
    with pytest.raises(ValueError, match="--tp 3"):
        gt.shape_of(parser.parse_args(["--tp", "3"]))
    for tool in ("graph_timing.py", "path_compare.py", "row_compare.py", "forward_parts.py"):
        source = (REPO_ROOT / "tools" / tool).read_text()
        calls = {ast.unparse(node.func) for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)}
        assert calls & {"shape_of", "gt.shape_of"}, tool
        assert source.count("PRESETS[args.preset]") == (tool == "graph_timing.py"), tool  # shape_of's own
