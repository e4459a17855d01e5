"""`preftune.models.to_device`: host values to the training device (on CPU, a plain copy)."""
import torch

from preftune.models import to_device


def test_to_device_takes_lists_and_tensors():
    got = to_device([1, 2, 3], "cpu", torch.long)
    assert got.dtype == torch.long and got.tolist() == [1, 2, 3] and got.device.type == "cpu"
    t = torch.arange(4.0)
    assert to_device(t, torch.device("cpu")) is t  # already there: no copy
    assert to_device([[0.5]], "cpu").dtype == torch.float32
