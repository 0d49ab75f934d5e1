"""What a checkpointed compiled graph does not recompute: random operators (the `checkpointing` switch).

A checkpointed block that AOTAutograd recomputes in the backward must draw the same random numbers
there as in the forward, so its partitioner wraps every recomputed operator tagged
`nondeterministic_seeded` in an RNG-state operator (`functionalize_rng_ops`). This model draws no random
numbers, but SDPA's fused kernels carry that tag (they take a dropout probability, 0 here). On a CUDA
device the wrapper is `graphsafe_run_with_rng_state`, a higher-order operator that torch 2.11's FX graph
cache does not take (`_check_for_hop`; cacheable from torch 2.13): the compiled graphs of a checkpointed
configuration bypassed the cache (`inductor.fxgraph_cache_bypass` in its run rows) and each phase of a run
that builds its engine again compiled them again: minutes per phase at 128^3 and at the BraTS size.

`SaveRandomOps` is a joint-graph pass (`joint_custom_pre_pass`) that saves such an operator's outputs
instead, as the partitioner itself does for effectful operators (`force_save_effectful_ops`) and as
torchtitan's selective-checkpointing policy does for SDPA (its `_save_list`): the attention blocks'
outputs here are small (5 MiB in all for best-ckpt at 128^3), and a backward that reads them runs no
second attention forward. Values are unchanged.
"""

from __future__ import annotations

import operator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.utils.checkpoint import CheckpointPolicy

RECOMPUTED = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def _is_random(node: torch.fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in target.tags)


def _tensor_outputs(node: torch.fx.Node):
    """node itself if it is a tensor, or the tensors taken out of its tuple (getitem of getitem ...). cuDNN's
    SDPA also returns ints and Nones (its meta function), which are no activations to save."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        yield node
    elif isinstance(val, (tuple, list)):
        for user in node.users:
            if user.target is operator.getitem:
                yield from _tensor_outputs(user)


class SaveRandomOps(CustomGraphPass):
    """Marks each recomputed random operator of the joint graph, and the tensors it returns, MUST_SAVE."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if not (_is_random(node) and node.meta.get("recompute") in RECOMPUTED):
                continue
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE  # banned from recomputation
            for out in _tensor_outputs(node):
                out.meta["recompute"] = CheckpointPolicy.MUST_SAVE

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))  # Inductor's cache keys on this
