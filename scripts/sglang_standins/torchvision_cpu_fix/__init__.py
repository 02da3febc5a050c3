"""Lets PyPI's torchvision import next to the CPU build of torch (a fix, not a replacement package).

PyPI's torchvision wheel is built against CUDA torch; with torch's CPU build its compiled `_C` extension does
not load, so the `torchvision::nms` / `torchvision::qnms` operators are never defined, and
`torchvision/_meta_registrations.py` fails at import time (`operator torchvision::nms does not exist`) when it
registers fake kernels for them. SGLang imports torchvision at startup (through its vision-model configs) and
never calls these ops on the text path. The CUDA assumption replaced: "torchvision's compiled ops are always
present". We define the two operator schemas (no kernels) right before torchvision is first imported; calling
them would still fail loudly. Installed with a `.pth` line, so it runs in every process of the SGLang venv,
including SGLang's spawned scheduler and detokenizer, without importing torch at interpreter start.
"""

import importlib.abc
import sys

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBS = []  # keep the torch.library.Library objects alive: dropping one removes its definitions


def _define_missing_ops() -> None:
    import torch

    for name, schema in _SCHEMAS.items():
        try:
            getattr(torch.ops.torchvision, name)
        except (AttributeError, RuntimeError):
            lib = torch.library.Library("torchvision", "FRAGMENT")
            lib.define(schema)
            _LIBS.append(lib)


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            _define_missing_ops()
        return None  # the regular finders import torchvision itself


def install() -> None:
    if not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())


install()
