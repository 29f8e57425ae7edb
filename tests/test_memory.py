"""What a model ready to translate keeps in memory: each weight once, in the form its kernel reads.

Prepacked (fp32) and int8 products run on their own copies of the weights; the float32 matrices they were
made from must not stay behind them (in the model, the loader or the checkpoint's state dict), or the
model's memory doubles. Weak references show that they are gone.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import Tensor, nn

from nmt.checkpoint import load_model
from nmt.config import Precision
from nmt.translate.builder import inference_model
from nmt.translate.prepacked import available
from nmt.untrained import save_random_model

from .synthetic import make_config, make_subword


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("memory")
    return save_random_model(d / "model.pt", make_config(), make_subword(d / "spm"))


def float_bytes(model: nn.Module) -> int:
    """Bytes of the distinct float storages the model's modules hold (parameters, buffers, plain tensor
    attributes such as a prepacked product's bias); opaque kernel copies are not counted."""
    storages = {}
    for module in model.modules():
        held = [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]
        for t in held:
            if isinstance(t, Tensor) and t.layout == torch.strided and t.is_floating_point():
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def linear_weights(model: nn.Module, skip: str | None = None) -> list[Tensor]:
    return [m.weight for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != skip]


@pytest.mark.skipif(not available(), reason="this torch lacks oneDNN's linear operators")
def test_prepacking_keeps_no_float32_copy_of_any_linear_map(checkpoint):
    model, _, _ = load_model(checkpoint)
    packed = linear_weights(model)
    before, freed = float_bytes(model), sum(w.nbytes for w in packed)
    refs, embedding = [weakref.ref(w) for w in packed], model.embed.weight
    del packed
    model = inference_model(model, Precision.FP32, torch.device("cpu"))
    gc.collect()
    assert refs and all(r() is None for r in refs), "a prepacked weight's float32 matrix is still held"
    # the embedding stays once, for the lookup; the output projection reads its own packed copy
    assert model.embed.weight is embedding
    assert float_bytes(model) == before - freed


def test_int8_keeps_no_float32_copy_of_any_linear_map(checkpoint):
    model, _, _ = load_model(checkpoint)
    refs = [weakref.ref(w) for w in linear_weights(model)]
    model = inference_model(model, Precision.INT8, torch.device("cpu"))
    gc.collect()
    assert refs and all(r() is None for r in refs), "an int8 weight's float32 matrix is still held"
