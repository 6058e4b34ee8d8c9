"""LLM.int8 weights that compute the way the device they sit on computes them best.

On a GPU the layer is bitsandbytes' `Linear8bitLt` unchanged: the int8 x int8 matmul with outlier features above
the threshold in 16 bits (LLM.int8). On a CPU bitsandbytes has no fast int8 matmul; it casts the activations to
float16 and rounds them to 8 bits per row, and that rounding, not the weights', is what costs quality: on SmolLM2
it adds 1.65% of perplexity, while the same int8 weights used as weights only add 0.19%
(`python -m benchmarks.quant`). So on a CPU the weights are dequantised row by row into the activations' dtype and
multiplied there, as bitsandbytes itself does for CPU training (its `MatMul8bitFp`). The weights stay int8 in
memory either way; only the compute differs.

Kept apart from swarm/partition/quantize.py so that importing bitsandbytes waits until a span is quantised.
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch
from torch.nn import functional


class Int8Linear(bnb.nn.Linear8bitLt):
    """`Linear8bitLt` whose forward on a CPU is weight-only int8 (see the module's docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda":
            return super().forward(x)
        weight = bnb.functional.int8_vectorwise_dequant(self.weight.data, self._row_scales()).to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return functional.linear(x, weight, bias)

    def _row_scales(self) -> torch.Tensor:
        """The fp32 absmax of each output row: on the weight until a GPU forward moves it to the layer's state."""
        scales = self.weight.SCB if self.weight.SCB is not None else self.state.SCB
        if scales is None:
            raise RuntimeError("an int8 layer without row scales: its weight was never quantised")
        return scales
