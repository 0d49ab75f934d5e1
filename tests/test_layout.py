"""The compiled graphs' convolution-input pass (medddpm.model.layout.ConvolutionInputs) on small traced graphs."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from medddpm.model import layout

aten = torch.ops.aten


def _conv_and_backward(x, w, grad):
    """A recomputed forward convolution and its backward, as in a checkpointed backward graph: the input is a
    channels-last view of a (N, D, H, W, C) buffer, as the separable upsampling leaves it."""
    h = x.view(1, 4, 4, 4, 8).permute(0, 4, 1, 2, 3)  # (1, 8, 4, 4, 4), channels-last strides
    y = aten.convolution.default(h, w, None, [1, 1, 1], [1, 1, 1], [1, 1, 1], False, [0, 0, 0], 1)
    gi, gw, _ = aten.convolution_backward.default(grad, h, w, [8], [1, 1, 1], [1, 1, 1], [1, 1, 1], False,
                                                  [0, 0, 0], 1, [True, True, False])
    return y, gi, gw


def _graph(fn=_conv_and_backward):
    x = torch.randn(1, 4, 4, 2, 16)
    w = torch.randn(8, 8, 3, 3, 3).contiguous(memory_format=torch.channels_last_3d)
    grad = torch.randn(1, 8, 4, 4, 4).contiguous(memory_format=torch.channels_last_3d)
    return make_fx(fn, tracing_mode="fake")(x, w, grad).graph


def _convs(graph):
    return [n for n in graph.nodes if n.target in layout.CONV_INPUTS]


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_viewed_backward_input_is_written_out_once_for_both_convolutions(channels_last):
    """pytorch/pytorch#174869: the view would reach cuDNN with stride 0 at its batch dimension. One buffer,
    with the view's own (channels-last, dense) strides, is read by the forward and the backward convolution."""
    graph = _graph()
    conv, backward = _convs(graph)
    view = backward.args[1]
    assert layout._is_unit_view(view) and conv.args[0] is view
    p = layout.ConvolutionInputs(channels_last=channels_last)
    p(graph)
    graph.lint()
    assert p.written == 1
    out = backward.args[1]
    assert out.target is aten.clone.default and out.args[0] is view and conv.args[0] is out
    val = out.meta["val"]
    assert val.is_contiguous(memory_format=torch.channels_last_3d) and val.stride() == (512, 1, 128, 32, 8)
    assert not any(layout._is_unit_view(n.args[i]) for n in _convs(graph) for i in layout.CONV_INPUTS[n.target])
    # already channels-last: nothing left to pin, with or without pin_layout
    assert p.pinned == 0


def test_saved_inputs_and_forward_graphs_are_left_alone():
    """A backward graph's saved input is a placeholder and a forward graph has no convolution_backward:
    neither gets a copy, so the graphs of configurations without recomputation are unchanged."""
    def saved(h, w, grad):
        return aten.convolution_backward.default(grad, h, w, [8], [1, 1, 1], [1, 1, 1], [1, 1, 1], False,
                                                 [0, 0, 0], 1, [True, True, False])[:2]

    def forward(x, w, grad):
        h = x.view(1, 4, 4, 4, 8).permute(0, 4, 1, 2, 3)
        return aten.convolution.default(h, w, None, [1, 1, 1], [1, 1, 1], [1, 1, 1], False, [0, 0, 0], 1)

    h = torch.randn(1, 8, 4, 4, 4).contiguous(memory_format=torch.channels_last_3d)
    graphs = [make_fx(saved, tracing_mode="fake")(h, torch.randn(8, 8, 3, 3, 3), torch.randn(1, 8, 4, 4, 4)).graph,
              _graph(forward)]
    for graph in graphs:
        before = [str(n) for n in graph.nodes]
        p = layout.ConvolutionInputs(channels_last=False)
        p(graph)
        assert p.written == 0 and [str(n) for n in graph.nodes] == before


def test_compile_options_always_carry_the_pass():
    """Every compiled run gets the pass; only pin_layout pins channels-last (and turns layout optimization off)."""
    plain, pinned = layout.compile_options(pin_layout=False), layout.compile_options(pin_layout=True)
    assert not plain["post_grad_custom_post_pass"].channels_last and "layout_optimization" not in plain
    assert pinned["post_grad_custom_post_pass"].channels_last and pinned["layout_optimization"] is False
    assert plain["post_grad_custom_post_pass"].uuid() != pinned["post_grad_custom_post_pass"].uuid()
