"""Channels-last 3D at every convolution of a compiled graph (the `pin_layout` switch).

Inductor pins channels-last only at 2-D convolutions (`V.graph.layout_opt and ndim == 2` in
torch/_inductor/kernel/conv.py), and its layout optimization is off for a U-Net whose decoder
convolutions narrow the channels (`is_in_out_channel` in `GraphLowering.decide_layout_opt`) and for
a backward graph, which holds no forward convolution (pytorch/pytorch#189239). A 3-D convolution's
inputs then follow the strides the graph's fake tensors recorded, and where those are not
channels-last, cuDNN copies them (`contiguous(channels_last_3d)` in ATen) on every call.

`ConvolutionInputs(channels_last=True)` is a post-grad pass that puts a channels-last clone in front
of every 5-D input of `convolution` and `convolution_backward` (the gradient, the saved input, the
weight) that the graph does not already hold channels-last, with channels-last fake strides.
Inductor's fallback for convolution keeps each input at the strides its graph recorded
(`constrain_to_fx_strides`), so the kernel that produces the tensor writes it channels-last; the clone
itself lowers to nothing more than that. The same idea as SandAI-org/MagiCompiler#36 for video VAEs.
Values are unchanged.

The same pass, in every compiled graph with or without `pin_layout`, also writes out each input of
`convolution_backward` that the graph computes as a view with a size-1 dimension (the batch).
Inductor hands such a view to the operator with stride 0 there (pytorch/pytorch#174869), which ATen's
`suggest_memory_format` does not take for channels-last: cuDNN then returns a contiguous weight
gradient where the graph's fake tensors (normal strides) expected channels-last, and Inductor's
stride check stops the step. Only recomputed inputs are such views (a saved one is a graph input):
`narrow_checkpoints`' upsamplings, whose 64x64x3x3x3 weight gradient comes back with strides
(1728, 27, 9, 3, 1) where the graph expects channels-last (torch 2.11). Written out, the view's producer
computes straight into the new buffer.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

aten = torch.ops.aten
CHANNELS_LAST = torch.channels_last_3d

# argument positions of the activations and weights, per operator
CONV_INPUTS = {aten.convolution.default: (0, 1), aten.convolution_backward.default: (0, 1, 2)}


def _needs_pin(node: torch.fx.Node) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.ndim == 5 and not val.is_contiguous(memory_format=CHANNELS_LAST)


def _is_unit_view(node: torch.fx.Node) -> bool:
    """A 5-D view computed in the graph with a size-1 dimension (which Inductor may give stride 0)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    target = node.target
    view = isinstance(target, torch._ops.OpOverload) and (target.is_view or target is aten._unsafe_view.default)
    val = node.meta.get("val")
    return view and isinstance(val, torch.Tensor) and val.ndim == 5 and 1 in val.shape


class ConvolutionInputs(CustomGraphPass):
    """Inductor post-grad pass (`post_grad_custom_post_pass`): `written` counts the view inputs of
    `convolution_backward` it wrote out; with `channels_last`, `pinned` counts the inputs it pinned."""

    def __init__(self, *, channels_last: bool) -> None:
        self.channels_last = channels_last
        self.written = 0
        self.pinned = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        layout = CHANNELS_LAST if self.channels_last else torch.preserve_format
        for node in list(graph.nodes):
            view = node.args[1] if node.target is aten.convolution_backward.default else None
            if not _is_unit_view(view):
                continue
            with graph.inserting_after(view):
                out = graph.call_function(aten.clone.default, (view,), {"memory_format": layout})
            out.meta["val"] = view.meta["val"].clone(memory_format=layout)
            for user in list(view.users):  # the recomputed forward convolution reads the same buffer
                for i in CONV_INPUTS.get(user.target, ()):
                    if user.args[i] is view:
                        user.update_arg(i, out)
            self.written += 1
        if self.channels_last:
            self._pin(graph)

    def _pin(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            for i in CONV_INPUTS.get(node.target, ()):
                arg = node.args[i]
                if not _needs_pin(arg):
                    continue
                with graph.inserting_before(node):
                    pin = graph.call_function(aten.clone.default, (arg,), {"memory_format": CHANNELS_LAST})
                pin.meta["val"] = arg.meta["val"].clone(memory_format=CHANNELS_LAST)  # a fake tensor's clone
                node.update_arg(i, pin)
                self.pinned += 1

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,)) + bytes([self.channels_last])  # Inductor's cache keys on this


def compile_options(*, pin_layout: bool) -> dict:
    """Inductor options for `torch.compile(..., options=...)`: the pass above, pinning channels-last only
    with `pin_layout`.

    Layout optimization goes off with the pinning: where Inductor turns it on (inference graphs whose
    convolutions it expects to gain from channels-last, `decide_layout_opt`), it pins channels-last
    at 2-D convolutions only and drops the fx-stride constraint on every convolution
    (`constrain_conv_to_fx_strides`), so a 3-D convolution's inputs fall back to contiguous and the
    pinned strides are lost: the sampler's denoising step then spends a quarter of its time in cuDNN's
    nchwToNhwc/nhwcToNchw copies, which layout optimization off removes."""
    options = {"post_grad_custom_post_pass": ConvolutionInputs(channels_last=pin_layout)}
    return {**options, "layout_optimization": False} if pin_layout else options
