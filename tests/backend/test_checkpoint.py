"""Checkpoints of amp_fx-trained models load anywhere (issue 52).

torchao's fp8 training keeps tensor subclasses in the model, so its checkpoints do not load with
``torch.load(weights_only=True)`` (torchtitan #651, #1414; ao #4782). amp_fx keeps plain
parameters. Each case trains two steps, saves ``model.state_dict()`` (of the ``amp_fx.compile``d
module, or of the model ``compile_step`` trains), the optimizer's and the scaler's state with
``torch.save``, takes a third step (the run that did not stop), then loads the file with
``torch.load(weights_only=True)`` into a fresh plain model, compiles it again and takes the third
step: the loss, every parameter and every optimizer state tensor must equal the run that did not
stop, bit for bit (tensorwise fp8, blockwise and nvfp4 among the cases). Every tensor of the
file must be a plain ``torch.Tensor`` (a subclass such as amp_fx's ``Fp8Weight`` or a view into
a cache would be named); the last test shows the check fires on one.

FSDP2 with the fp8 all-gather, saved and loaded through ``torch.distributed.checkpoint``:
``tests/distributed/test_distributed_fp8.py::test_fsdp2_fp8_all_gather_checkpoint_resumes_bitwise_through_dcp``
(in that file's one spawn of gloo ranks).
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

import amp_fx
from amp_fx.fp8 import Fp8Config, Nvfp4Options
from amp_fx.kernels.fp8_weight import Fp8Weight
from amp_fx.testing import assert_bitwise

STOP = 2  # steps before the checkpoint


# nvfp4 without stochastic rounding: with it, the resumed run draws from a fresh generator state
# (the RNG state is the user's to checkpoint), so its next step would differ for that reason alone
_LOW_PRECISION: dict[str, Any] = {
    "fp8": "tensorwise",
    "blockwise": "blockwise",
    "nvfp4": Fp8Config("nvfp4", nvfp4=Nvfp4Options(stochastic_rounding=False)),
}


def _make() -> nn.Module:
    torch.manual_seed(0)  # dims multiples of 16: both Linears run in fp8 under fp8="tensorwise"
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


class _Run:
    """One way of training ``model``: ``step(i)`` takes step ``i`` and returns its loss;
    ``module`` is what ``state_dict()`` is called on; ``scaler`` is saved when there is one."""

    def __init__(self, case: str, model: nn.Module) -> None:
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # moments: optimizer state to compare
        self.scaler: Any = None
        if case in ("compile_step", "train_state"):
            kwargs: dict[str, Any] = (
                {"dtype": "fp16"} if case == "compile_step" else {"dtype": "bf16", "train_state": "bf16_kahan"}
            )
            # train_state turns the parameters to bf16 here, before any state is loaded into them
            self._step = amp_fx.compile_step(model, self.opt, _loss, backend="aot_eager", **kwargs)
            self.scaler = self._step
            self.module = model
            return
        options: dict[str, Any] = {"fp8": _LOW_PRECISION[case]} if case in _LOW_PRECISION else {}
        if case == "weight_cache":
            options["weight_cache"] = True
        self.module = amp_fx.compile(model, dtype="bf16", backend="aot_eager", **options)

        def eager_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = _loss(self.module(x), y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return loss.detach()

        self._step = eager_step

    def step(self, i: int) -> torch.Tensor:
        return self._step(*_batch(i))

    def state(self) -> dict[str, Any]:
        state = {"model": self.module.state_dict(), "opt": self.opt.state_dict()}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])


def _assert_plain(state: dict[str, Any]) -> None:
    """Every tensor of the checkpoint is a plain ``torch.Tensor`` (no subclass, no Parameter)."""
    leaves, _ = pytree.tree_flatten_with_path(state)
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor) and type(leaf) is not torch.Tensor:
            raise AssertionError(f"checkpoint{pytree.keystr(path)} is a {type(leaf).__name__}, not a plain tensor")


def _save_and_load(state: dict[str, Any]) -> dict[str, Any]:
    _assert_plain(state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


CASES = ["bf16", "fp8", "blockwise", "nvfp4", "weight_cache", "compile_step", "train_state"]


@pytest.mark.parametrize("case", CASES)
def test_a_checkpoint_loads_with_weights_only_into_a_plain_model_and_resumes_bitwise(case: str) -> None:
    torch._dynamo.reset()
    run = _Run(case, _make())
    for i in range(STOP):
        run.step(i)
    saved = _save_and_load(run.state())
    loss = run.step(STOP)  # the run that did not stop
    expected = {"loss": loss, "params": dict(run.model.named_parameters()), "opt": run.opt.state_dict()["state"]}

    torch._dynamo.reset()
    plain = _make()
    assert list(saved["model"]) == list(plain.state_dict()), "state_dict keys are the plain model's"
    resumed = _Run(case, plain)
    resumed.load(saved)
    for name, value in plain.state_dict().items():  # loaded bit for bit, in the dtype it was trained in
        assert_bitwise(value, saved["model"][name], f"loaded {name}")
    actual = {
        "loss": resumed.step(STOP),
        "params": dict(plain.named_parameters()),
        "opt": resumed.opt.state_dict()["state"],
    }
    assert_bitwise(actual, expected, f"{case}: step {STOP} after resuming")


def test_the_plain_tensor_check_names_a_subclass_in_the_checkpoint() -> None:
    """The twin: a checkpoint holding an fp8-gathered weight (amp_fx's ``Fp8Weight``, the tensor
    subclass FSDP2's fp8 all-gather hands the matmul) is refused by the check, and by
    ``torch.load(weights_only=True)`` itself."""
    weight = Fp8Weight(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.ones(()), torch.float32)
    state = {"model": {"0.weight": weight}}
    with pytest.raises(AssertionError, match=r"checkpoint\['model'\]\['0.weight'\] is a Fp8Weight"):
        _save_and_load(state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(buffer, weights_only=True)
