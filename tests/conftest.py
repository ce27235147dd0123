import importlib.util

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    has_npu = importlib.util.find_spec("torch_npu") is not None
    for item in items:
        if "npu" in item.keywords and not has_npu:
            item.add_marker(pytest.mark.skip(reason="needs torch_npu and an Ascend NPU"))
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
